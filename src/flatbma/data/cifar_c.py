"""Reader for the published CIFAR-10-C and CIFAR-100-C files (Hendrycks & Dietterich, ICLR 2019).

The published directory (``CIFAR-10-C/`` or ``CIFAR-100-C/``) holds ``<corruption>.npy``, ``uint8 [5 * n, H, W, 3]``
(the ``n`` test images at severity 1, then 2, ..., 5), and ``labels.npy``, integer ``[5 * n]`` (or ``[n]``),
memory-mapped so that only the requested severity's rows are read. Nothing is downloaded: get the archives from
Zenodo (CIFAR-10-C: https://zenodo.org/records/2535967, CIFAR-100-C: https://zenodo.org/records/3555552).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from flatbma.checks import is_integral
from flatbma.data._readers import read_npy
from flatbma.data.arrays import ArrayDataset
from flatbma.data.corruptions import CORRUPTIONS
from flatbma.errors import FlatbmaError, suggest

__all__ = ["CIFAR10_CLASSES", "CIFAR_C_CORRUPTIONS", "cifar_c_corruptions", "load_cifar_c"]

#: CIFAR-10 class names in label order (the default classes of :func:`load_cifar_c`).
CIFAR10_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
#: The 19 corruption files of the published CIFAR-10-C / CIFAR-100-C (15 benchmark + 4 extra).
CIFAR_C_CORRUPTIONS: tuple[str, ...] = (*CORRUPTIONS, "spatter")
SEVERITY_COUNT = 5
LABELS_FILE = "labels.npy"
_FOLDERS = ("CIFAR-10-C", "CIFAR-100-C")

_HELP = (
    "Expected the published layout: a directory with <corruption>.npy (uint8 [5*n, H, W, 3], the n test "
    "images at severities 1 to 5 stacked in that order; [50000, 32, 32, 3] for CIFAR-10-C) and labels.npy "
    "(integer [5*n] or [n]). Nothing is downloaded: get CIFAR-10-C from https://zenodo.org/records/2535967 "
    "or CIFAR-100-C from https://zenodo.org/records/3555552, extract the archive and pass root=<the "
    "CIFAR-10-C or CIFAR-100-C folder, or the directory containing it>."
)

_SOURCE = (
    "CIFAR-C: get a good copy from https://zenodo.org/records/2535967 (CIFAR-10-C) or "
    "https://zenodo.org/records/3555552 (CIFAR-100-C)"
)
"""What a damaged ``.npy`` error adds: where a good copy comes from (the layout help is for layout errors)."""


def _root(root: str | Path) -> Path:
    """The directory holding ``labels.npy``: ``root`` itself or its one CIFAR-10-C / CIFAR-100-C folder."""
    if not isinstance(root, str | Path):
        raise FlatbmaError(f"CIFAR-C root must be a path, got {type(root).__name__}. {_HELP}")
    path = Path(root).expanduser()
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise FlatbmaError(f"CIFAR-C root {path} {what}. {_HELP}")
    if (path / LABELS_FILE).is_file():
        return path
    found = [path / name for name in _FOLDERS if (path / name / LABELS_FILE).is_file()]
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise FlatbmaError(
            f"CIFAR-C root {path} holds both {found[0].name} and {found[1].name}; pass the one you want as root."
        )
    raise FlatbmaError(f"CIFAR-C: {path / LABELS_FILE} is missing. {_HELP}")


def _load(path: Path) -> np.ndarray:
    return read_npy(path, source=_SOURCE)  # header checked against the file before mapping it


def _stems(directory: Path) -> list[str]:
    return [p.stem for p in directory.glob("*.npy") if p.is_file() and p.name != LABELS_FILE]


def cifar_c_corruptions(root: str | Path) -> list[str]:
    """List the corruptions whose ``.npy`` file is present under ``root``: published order first, then others sorted.

    ``root`` is the CIFAR-10-C / CIFAR-100-C folder, or the directory containing it.

    Raises:
        FlatbmaError: ``root`` is not a directory or has no ``labels.npy``.
    """
    present = set(_stems(_root(root)))
    known = [name for name in CIFAR_C_CORRUPTIONS if name in present]
    return known + sorted(present - set(CIFAR_C_CORRUPTIONS))


def _check_severity(severity: object) -> int:
    if not is_integral(severity) or not 1 <= severity <= SEVERITY_COUNT:
        raise FlatbmaError(f"CIFAR-C severity must be an integer from 1 to {SEVERITY_COUNT}, got {severity!r}.")
    return int(severity)


def load_cifar_c(
    root: str | Path, corruption: str, severity: int, *, classes: Sequence[str] | None = None
) -> ArrayDataset:
    """Load one corruption at one severity of CIFAR-10-C or CIFAR-100-C as an :class:`ArrayDataset`.

    The ``n`` test images of block ``severity`` (1 to 5) as ``uint8 [n, 3, H, W]`` with their labels (items read as
    float). ``root`` as for :func:`cifar_c_corruptions`; ``corruption`` is a file stem present there, e.g.
    ``"gaussian_noise"`` (case-insensitive, ``-`` and spaces read as ``_``); ``classes`` defaults to
    :data:`CIFAR10_CLASSES`: for CIFAR-100-C pass the 100 names (e.g. ``load_cifar100(root).test.classes``).

    Raises:
        FlatbmaError: Missing files, unknown corruption, bad severity, arrays or label counts, labels out of range.
    """
    directory = _root(root)
    level = _check_severity(severity)
    if not isinstance(corruption, str):
        raise FlatbmaError(f"CIFAR-C corruption must be a string, got {type(corruption).__name__}.")
    name = corruption.strip().lower().replace("-", "_").replace(" ", "_")
    available = cifar_c_corruptions(directory)
    if not name or "/" in name or "\\" in name or name not in available:
        raise FlatbmaError(
            f"CIFAR-C: no file {name or corruption!r}.npy in {directory}.{suggest(name, available)} "
            f"Available: {', '.join(available) or 'none'}. {_HELP}"
        )
    image_path, label_path = directory / f"{name}.npy", directory / LABELS_FILE
    images = _load(image_path)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise FlatbmaError(
            f"CIFAR-C: {image_path} holds {images.dtype} {images.shape}; expected uint8 [5*n, H, W, 3]. {_HELP}"
        )
    total = images.shape[0]
    if total == 0 or total % SEVERITY_COUNT:
        raise FlatbmaError(
            f"CIFAR-C: {image_path} has {total} images, not a positive multiple of {SEVERITY_COUNT} (one block "
            f"per severity). {_HELP}"
        )
    n = total // SEVERITY_COUNT
    labels = _load(label_path)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise FlatbmaError(
            f"CIFAR-C: {label_path} holds {labels.dtype} {labels.shape}; expected integer labels [5*n] or [n]. {_HELP}"
        )
    if labels.shape[0] not in (total, n):
        raise FlatbmaError(
            f"CIFAR-C: {label_path} has {labels.shape[0]} labels but {image_path.name} has {total} images "
            f"({n} per severity); expected {total} or {n} labels. {_HELP}"
        )
    rows = slice((level - 1) * n, level * n)
    block = np.ascontiguousarray(images[rows].transpose(0, 3, 1, 2))  # reads and copies these rows only
    targets = np.array(labels[rows] if labels.shape[0] == total else labels, dtype=np.int64)  # a copy, not the map
    names = list(CIFAR10_CLASSES if classes is None else classes)
    if targets.size and (targets.min() < 0 or targets.max() >= len(names)):
        hint = " For CIFAR-100-C pass classes=<the 100 CIFAR-100 class names>." if classes is None else ""
        raise FlatbmaError(
            f"CIFAR-C: {label_path} has labels in [{int(targets.min())}, {int(targets.max())}] but {len(names)} "
            f"classes were given.{hint}"
        )
    return ArrayDataset(torch.from_numpy(block), torch.from_numpy(targets), names)
