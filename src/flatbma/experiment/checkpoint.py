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


def save_state(state: State, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Save ``state`` atomically to ``path`` (safetensors)."""
    path = Path(path)
    tensors = {
        f"{section}/{k}": v.detach().contiguous().cpu()
        for section in SECTIONS
        for k, v in getattr(state, section).items()
    }
    meta = {"format": FORMAT, "step": str(state.step), **(metadata or {})}
    atomic_write_bytes(path, save(tensors, metadata=meta))


def load_state(path: str | Path, device: str = "cpu") -> State:
    """Load a state saved by :func:`save_state`; corrupt or foreign files raise :class:`FlatbmaError`."""
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
    sections: dict[str, dict] = {s: {} for s in SECTIONS}
    for key, value in tensors.items():
        section, _, name = key.partition("/")
        if section not in sections:
            raise FlatbmaError(f"{path}: unexpected tensor {key!r}; the file is not a flatbma checkpoint")
        sections[section][name] = value
    return State(step=int(meta["step"]), **sections)
