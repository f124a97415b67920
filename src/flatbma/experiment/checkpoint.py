"""Saving and loading method states without unpickling: safetensors tensors + JSON metadata.

A checkpoint is one ``.safetensors`` file whose tensors are the state's ``params/…``, ``buffers/…`` and
``aux/…`` entries and whose string metadata holds ``step`` and a format tag. Files are written to a
temporary name in the same directory and renamed, so a crash never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save
from torch import Tensor

from flatbma.errors import FlatbmaError
from flatbma.types import State

FORMAT = "flatbma-state-v1"
SECTIONS = ("params", "buffers", "aux")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON atomically."""
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def save_state(
    state: State,
    path: str | Path,
    metadata: dict[str, str] | None = None,
    extra: dict[str, Tensor] | None = None,
) -> None:
    """Save ``state`` atomically to ``path`` (safetensors).

    Args:
        state: the method state.
        path: the file.
        metadata: extra string metadata (JSON text for structured values).
        extra: extra tensors stored under ``extra/<key>`` (e.g. RNG states), read back by
            :func:`load_checkpoint`.
    """
    path = Path(path)
    tensors = {
        f"{section}/{k}": v.detach().contiguous().cpu()
        for section in SECTIONS
        for k, v in getattr(state, section).items()
    }
    tensors.update({f"extra/{k}": v.detach().contiguous().cpu() for k, v in (extra or {}).items()})
    # safetensors returns tensors sorted by name; the key order is part of the state (it fixes the
    # summation order of global norms), so it is stored and restored.
    order = {section: list(getattr(state, section)) for section in SECTIONS}
    meta = {"format": FORMAT, "step": str(state.step), "order": json.dumps(order), **(metadata or {})}
    atomic_write_bytes(path, save(tensors, metadata=meta))


def _in_order(tensors: dict[str, Tensor], order: list[str]) -> dict[str, Tensor]:
    """``tensors`` re-keyed in the saved ``order`` (keys not listed keep their place after them)."""
    listed = [k for k in order if k in tensors]
    return {k: tensors[k] for k in listed} | {k: v for k, v in tensors.items() if k not in set(listed)}


def load_state(path: str | Path, device: str = "cpu") -> State:
    """Load a state saved by :func:`save_state`; corrupt or foreign files raise :class:`FlatbmaError`."""
    return load_checkpoint(path, device)[0]


def load_checkpoint(path: str | Path, device: str = "cpu") -> tuple[State, dict[str, str], dict[str, Tensor]]:
    """Load ``(state, metadata, extra tensors)`` saved by :func:`save_state`."""
    path = Path(path)
    if not path.is_file():
        raise FlatbmaError(f"checkpoint {path} does not exist: train first (flatbma train --config ...)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path), device=device)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise FlatbmaError(
            f"checkpoint {path} is not a readable safetensors file ({e}); it may be truncated or "
            "corrupted: delete it and resume from an earlier checkpoint or retrain"
        ) from None
    if meta.get("format") != FORMAT:
        raise FlatbmaError(f"{path} is not a flatbma checkpoint (format tag {meta.get('format')!r})")
    sections: dict[str, dict] = {s: {} for s in (*SECTIONS, "extra")}
    for key, value in tensors.items():
        section, _, name = key.partition("/")
        if section not in sections:
            raise FlatbmaError(f"{path}: unexpected tensor {key!r}; the file is not a flatbma checkpoint")
        sections[section][name] = value
    extra = sections.pop("extra")
    try:
        order = json.loads(meta.get("order", "{}"))
        sections = {name: _in_order(section, order.get(name, [])) for name, section in sections.items()}
    except (ValueError, AttributeError, TypeError):
        raise FlatbmaError(f"{path}: the checkpoint metadata is damaged (key order unreadable)") from None
    try:
        step = int(meta["step"])
    except (KeyError, ValueError):
        raise FlatbmaError(f"{path}: the checkpoint metadata has no valid step; the file is damaged") from None
    return State(step=step, **sections), meta, {k: v.cpu() for k, v in extra.items()}


def check_compatible(state: State, reference: State, path: str | Path) -> None:
    """Raise :class:`FlatbmaError` unless the loaded ``state`` has the structure of ``reference``.

    ``reference`` is the state the run's method initializes for the run's model. ``params`` and
    ``buffers`` must hold the same names with the same shapes; every ``aux`` entry of ``reference``
    must be there with its shape (a method may add ``aux`` entries while it trains, e.g. samples).
    """
    for section in SECTIONS:
        have, want = getattr(state, section), getattr(reference, section)
        problem = next((f"{section}/{k} is missing" for k in want if k not in have), None)
        problem = problem or next(
            (
                f"{section}/{k} has shape {tuple(have[k].shape)} instead of {tuple(v.shape)}"
                for k, v in want.items()
                if tuple(have[k].shape) != tuple(v.shape)
            ),
            None,
        )
        if problem is None and section != "aux":
            problem = next((f"{section}/{k} is unexpected" for k in have if k not in want), None)
        if problem is not None:
            raise FlatbmaError(
                f"{path} does not fit this run's config ({problem}): it was written for another method or "
                "model; restore the run's own checkpoint or train again"
            )
