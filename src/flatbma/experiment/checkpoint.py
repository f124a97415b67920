"""Saving and loading method states without unpickling: safetensors tensors + JSON metadata.

A checkpoint is one ``.safetensors`` file whose tensors are the state's ``params/…``, ``buffers/…`` and
``aux/…`` entries and whose string metadata holds ``step`` and a format tag. Files are written to a
temporary name in the same directory and renamed, so a crash never leaves a half-written checkpoint.

A run's checkpoint also holds the loop position (:func:`save_position`, :func:`load_position`): the
runner's :class:`~flatbma.experiment.runner.Position` (RNG states as ``extra/…`` tensors, counters
and running sums as metadata) and the training history, so that training continues exactly.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save
from torch import Tensor, nn

from flatbma.errors import FlatbmaError
from flatbma.experiment.runner import EpochLog, History, Position
from flatbma.params import model_buffers, trainable_params
from flatbma.types import Posterior, State

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


def save_position(path: Path, state: State, position: Position, history: History) -> None:
    """Save ``state`` with the loop ``position`` and ``history`` it was reached with (:func:`load_position`)."""
    extra = {"torch_rng": position.torch_rng}
    if position.loader_rng is not None:
        extra["loader_rng"] = position.loader_rng
    for i, rng in enumerate(position.cuda_rng or ()):
        extra[f"cuda_rng/{i}"] = rng
    meta = {
        "epoch": str(position.epoch),
        "batch": str(position.batch),
        "partial": json.dumps(list(position.partial)),
        "history": json.dumps([vars(h) for h in history.epochs]),
    }
    save_state(state, path, meta, extra)


def load_position(path: Path, device: torch.device) -> tuple[State, Position, History]:
    """``(state, position, history)`` saved by :func:`save_position`, the state on ``device``."""
    state, meta, extra = load_checkpoint(path, device=str(device))
    try:
        cuda = tuple(extra[k] for k in sorted(k for k in extra if k.startswith("cuda_rng/"))) or None
        position = Position(
            epoch=int(meta["epoch"]),
            batch=int(meta["batch"]),
            loader_rng=extra.get("loader_rng"),
            torch_rng=extra["torch_rng"],
            cuda_rng=cuda,
            partial=tuple(json.loads(meta["partial"])),
        )
        history = History([EpochLog(**h) for h in json.loads(meta["history"])])
    except (KeyError, ValueError, TypeError):
        raise FlatbmaError(f"{path} has no resumable position (written by another tool?); train again") from None
    return state, position, history


def check_fits(state: State, method: Posterior, model: nn.Module, path: Path, *, device: torch.device) -> None:
    """A loaded state must have the structure ``method`` gives a fresh state of ``model`` (:func:`check_compatible`).

    The reference state is initialized under a forked RNG, so the run's random streams are left alone.
    """
    devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        reference = method.init(trainable_params(model), model_buffers(model))
    check_compatible(state, reference, path)
