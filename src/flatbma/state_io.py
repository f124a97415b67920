"""State files and atomic writes, below every layer that writes them (the run checkpoints, the BMA predictor).

A state file is one ``.safetensors`` file: a :class:`~flatbma.types.State`'s tensors as ``<section>/<name>``
(plus optional ``extra/<name>``), and metadata holding the format tag :data:`FORMAT`, the ``step``, the key
``order`` of every section (it fixes the summation order of global norms) and the :func:`checksums` of every
tensor and the rest of the metadata. Files are written atomically (:func:`atomic_write_bytes`), and only regular
files are replaced or appended to (:func:`check_replaceable`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save
from torch import Tensor

from flatbma.errors import FlatbmaError
from flatbma.types import State

FORMAT = "flatbma-state-v2"
"""Format tag of the state files flatbma writes and reads; they always record their checksums
(:func:`checksum_problem` refuses one without them, so that removing the one key does not turn the check off)."""
SECTIONS = ("params", "buffers", "aux")
"""The sections of a :class:`~flatbma.types.State` stored in a state file."""
CHECKSUMS = "checksums"
"""Metadata key of a state file's checksums (:func:`checksums`, JSON)."""

TEMP_NAME = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")
"""The names :func:`atomic_write_bytes` writes first: ``.<name>.<8 random characters of mkstemp>.tmp``."""

_WRITE_PROBLEMS = {
    errno.ENOSPC: ("no space left on {path}", "free space or choose another output_dir"),
    errno.EDQUOT: ("disk quota exceeded on {path}", "free space or choose another output_dir"),
    errno.EROFS: ("cannot write {path}: read-only file system", "choose another output_dir"),
    errno.EACCES: ("cannot write {path}: permission denied", "choose another output_dir or fix its permissions"),
    errno.EPERM: ("cannot write {path}: operation not permitted", "choose another output_dir or fix its permissions"),
}


def write_error(path: Path, error: OSError, note: str = "") -> FlatbmaError:
    """The one-line :class:`FlatbmaError` of a failed write of ``path`` (``note``: what is still intact)."""
    what, todo = _WRITE_PROBLEMS.get(
        error.errno or 0, (f"cannot write {{path}} ({error.strerror or error})", "choose another output_dir")
    )
    return FlatbmaError(f"{what.format(path=path)}: {todo}" + (f"; {note}" if note else ""))


def _umask() -> int:
    """The process's umask (read from ``/proc`` where possible: ``os.umask`` must set it to read it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_replaceable(path: str | Path) -> None:
    """Refuse to write ``path`` unless it is missing or a regular file.

    A path that cannot be examined is left to the write, which names the problem.

    Raises:
        FlatbmaError: ``path`` exists and is no regular file, in one line saying what to do.
    """
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if stat.S_ISLNK(mode):
        raise FlatbmaError(
            f"{path} is a symbolic link: flatbma writes only regular files of its own there; remove the link or "
            "choose another path"
        )
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO, socket or device"
        raise FlatbmaError(
            f"{path} is not a regular file ({kind}): flatbma replaces only regular files; remove it or choose "
            "another path"
        )


def atomic_write_bytes(path: Path, data: bytes, *, note: str = "") -> None:
    """Write ``data`` to ``path`` via a temporary file and ``os.replace``; the file gets mode ``0o666 & ~umask``.

    ``path`` must be missing or a regular file (:func:`check_replaceable`); one hard-linked elsewhere is replaced
    under this name only. A failed write leaves ``path`` as it was and raises :class:`FlatbmaError` saying what to
    do, then ``note`` (e.g. which checkpoint is intact). An interruption propagates after the temporary file is
    removed.
    """
    path = Path(path)
    check_replaceable(path)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp creates 0600
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            try:
                Path(tmp).unlink(missing_ok=True)
            except OSError:
                pass
        if isinstance(e, OSError):
            raise write_error(path, e, note) from None
        raise


def append_bytes(path: Path, data: bytes) -> None:
    """Append ``data`` to the regular file ``path`` (created when missing), as a log grows.

    A file hard-linked elsewhere is first replaced by a copy of its own, so its other names keep their bytes.

    Raises:
        FlatbmaError: ``path`` is no regular file; ``OSError`` of the write itself is the caller's to report.
    """
    check_replaceable(path)
    try:
        linked = os.lstat(path).st_nlink > 1
    except FileNotFoundError:
        linked = False
    if linked:
        atomic_write_bytes(path, Path(path).read_bytes() + data)
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since it was checked
            raise FlatbmaError(f"{path} is not a regular file: flatbma appends only to regular files; remove it")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def encode_state(
    state: State, metadata: Mapping[str, str] | None = None, extra: Mapping[str, Tensor] | None = None
) -> bytes:
    """The bytes of the state file of ``state`` (CPU tensors), with ``metadata`` and ``extra/<key>`` tensors."""
    tensors = {
        f"{section}/{k}": v.detach().contiguous().cpu()
        for section in SECTIONS
        for k, v in getattr(state, section).items()
    }
    tensors.update({f"extra/{k}": v.detach().contiguous().cpu() for k, v in (extra or {}).items()})
    order = {section: list(getattr(state, section)) for section in SECTIONS}
    meta = {"format": FORMAT, "step": str(state.step), "order": json.dumps(order), **(metadata or {})}
    meta[CHECKSUMS] = json.dumps(checksums(tensors, meta), sort_keys=True)
    return save(tensors, metadata=meta)


def _digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def tensor_checksum(t: Tensor) -> str:
    """A short SHA-256 of a CPU tensor's dtype, shape and bytes: equal tensors, equal checksums."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)  # every dtype as its bytes (bool, bfloat16 too)
    h = hashlib.sha256(f"{dtype_name(t)}{list(t.shape)}".encode())
    h.update(memoryview(flat.numpy()))
    return h.hexdigest()[:16]


def checksums(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> dict[str, Any]:
    """``{"tensors": {name: checksum}, "metadata": checksum}`` of a state file's CPU tensors and metadata.

    The metadata's checksum covers every entry but :data:`CHECKSUMS` itself (keys sorted).
    """
    rest = {k: v for k, v in metadata.items() if k != CHECKSUMS}
    return {
        "tensors": {k: tensor_checksum(v) for k, v in tensors.items()},
        "metadata": _digest(json.dumps(rest, sort_keys=True).encode()),
    }


def checksum_problem(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> str | None:
    """What in a state file read back (CPU ``tensors``, ``metadata``) differs from its recorded checksums.

    A short text naming the first tensor (or the metadata) that differs, cut to 160 characters, or ``None``. A file
    without checksums is refused (only an edit removes the key: the format tag is covered by the metadata's).
    """
    text = metadata.get(CHECKSUMS)
    if text is None:
        return f"it records no checksums, which {shown_format(metadata)} files always do"
    try:
        recorded = json.loads(text)
        want_tensors, want_meta = dict(recorded["tensors"]), recorded["metadata"]
    except (ValueError, KeyError, TypeError):
        return "its record of checksums is damaged"
    have = checksums(tensors, metadata)
    for name in sorted({*want_tensors, *tensors}):
        if name not in tensors:
            return clip(f"tensor {name} is missing")
        if name not in want_tensors:
            return clip(f"tensor {name} has no checksum (it was added)")
        if have["tensors"][name] != want_tensors[name]:
            return clip(f"tensor {name} does not match its checksum")
    if have["metadata"] != want_meta:
        return "its metadata (step, position, records) does not match its checksum"
    return None


def shown_format(metadata: Mapping[str, str]) -> str:
    """The format tag of a state file's metadata, for a message (cut to 30 characters)."""
    return clip(str(metadata.get("format")), 30)


def state_digest(metadata: Mapping[str, str]) -> str | None:
    """A short hash of a state file's recorded checksums: the identity of its content (``None``: none recorded)."""
    text = metadata.get(CHECKSUMS)
    return _digest(text.encode()) if text is not None else None


SEAL = "checksum"
"""Key of a sealed JSON record's checksum (:func:`sealed`)."""


def sealed(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` with :data:`SEAL`: a short SHA-256 of the rest of it, so that an edit or a damaged byte is found.

    The checksum is of the record's JSON with sorted keys, so what ``json`` writes and reads back hashes the
    same; read it back through :func:`seal_problem`.
    """
    rest = {k: v for k, v in record.items() if k != SEAL}
    return {**rest, SEAL: _digest(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())}


def seal_problem(record: Any) -> str | None:
    """What is wrong with the seal of a JSON ``record`` read back (:func:`sealed`), or ``None``."""
    if not isinstance(record, dict):
        return None
    if SEAL not in record:
        return "it has no checksum (an edit?)"
    if sealed(record)[SEAL] != record[SEAL]:
        return "it does not match its checksum"
    return None


def in_order(tensors: Mapping[str, Tensor], order: list[str]) -> dict[str, Tensor]:
    """``tensors`` re-keyed in the saved ``order`` (keys not listed keep their place after them)."""
    listed = [k for k in order if k in tensors]
    return {k: tensors[k] for k in listed} | {k: v for k, v in tensors.items() if k not in set(listed)}


def structure_problem(state: State, reference: State) -> str | None:
    """What keeps ``state`` from having the structure of ``reference``, or ``None`` if nothing does.

    ``reference`` is the state the method initializes for the model: each section must hold its names with the
    same dtypes and shapes. The only extra entries accepted are ``aux`` stacks of copies of a parameter
    (``<prefix>/<name>``, ``[S, *shape]``, its dtype: a sampler's iterates). The answer names the first
    offending entry, cut to 160 characters.
    """
    for section in SECTIONS:
        have, want = getattr(state, section), getattr(reference, section)
        for k, v in want.items():
            if k not in have:
                return clip(f"{section}/{k} is missing")
            if have[k].dtype != v.dtype:
                return clip(f"{section}/{k} is {dtype_name(have[k])} instead of {dtype_name(v)}")
            if tuple(have[k].shape) != tuple(v.shape):
                return clip(f"{section}/{k} has shape {tuple(have[k].shape)} instead of {tuple(v.shape)}")
        for k, v in have.items():
            if k not in want and not (section == "aux" and _stacked_copy(k, v, reference.params)):
                return clip(f"{section}/{k} is unexpected")
    return None


def _stacked_copy(name: str, value: Tensor, params: Mapping[str, Tensor]) -> bool:
    """Whether aux entry ``name`` stacks copies of a parameter: ``<prefix>/<param>``, ``[S, *shape]``, its dtype."""
    for i, c in enumerate(name):
        p = params.get(name[i + 1 :]) if c == "/" else None
        if p is not None and value.dtype == p.dtype and value.dim() == p.dim() + 1 and value.shape[1:] == p.shape:
            return value.shape[0] >= 1
    return False


def clip(text: str, limit: int = 160) -> str:
    """``text`` cut to at most ``limit`` characters (names read from a file may be of any length)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def dtype_name(t: Tensor) -> str:
    """``t``'s dtype without the ``torch.`` prefix (``float32``), as messages name it."""
    return str(t.dtype).removeprefix("torch.")
