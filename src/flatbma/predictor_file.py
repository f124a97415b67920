"""The predictor file: a :class:`flatbma.BMA`'s state and settings in one state file.

The layout is the run checkpoints' (:mod:`flatbma.state_io`), with the predictor's settings as JSON under the
metadata key :data:`PREDICTOR_KEY`. A missing, damaged or foreign file ends in one line saying what to do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from flatbma.checks import is_int
from flatbma.errors import FlatbmaError
from flatbma.regression import Gaussian
from flatbma.state_io import FORMAT, SECTIONS, atomic_write_bytes, checksum_problem, clip, encode_state, in_order
from flatbma.types import Params, State

__all__ = [
    "LOGITS_FIRST",
    "LOGITS_OUTPUT",
    "PREDICTOR_FORMAT",
    "PREDICTOR_KEY",
    "architecture",
    "architecture_problem",
    "likelihood_of",
    "read_file",
    "read_settings",
    "write_file",
]

PREDICTOR_KEY = "predictor"
"""Metadata key of a saved predictor's settings (JSON) in its state file."""

PREDICTOR_FORMAT = "flatbma-bma-v1"
"""Format tag of those settings."""

LOGITS_FIRST, LOGITS_OUTPUT = "first", "output"
"""The predictor file's ``logits`` record: the module's logits are the first element of its tuple output
(:func:`flatbma.models.keep_logits`), or its output."""


def write_file(path: str | Path, state: State, settings: Mapping[str, Any]) -> None:
    """Write ``state`` and the predictor ``settings`` to ``path`` as a state file, atomically (never half-written).

    Raises:
        FlatbmaError: the file cannot be written (one line saying why and what to do).
    """
    atomic_write_bytes(Path(path), encode_state(state, {PREDICTOR_KEY: json.dumps(dict(settings))}))


def read_file(path: str | Path) -> tuple[State, dict[str, Any]]:
    """``(state, settings)`` written by :func:`write_file`, the state on the CPU.

    Raises:
        FlatbmaError: a missing, truncated, damaged (its checksums differ) or foreign file, one of an older layout
            (format tag, checksums, logits or architecture record), or a state file without predictor settings.
    """
    path = Path(path)
    if path.is_dir():
        raise FlatbmaError(f"{path} is a directory, not a predictor file: give the path bma.save(path) wrote")
    if not path.is_file():
        raise FlatbmaError(f"{path} does not exist: save a predictor there first (bma.save(path))")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError):
        raise FlatbmaError(
            f"{path} is not a readable safetensors file (truncated?): save the predictor again"
        ) from None
    if meta.get("format") != FORMAT:
        raise FlatbmaError(f"{path} is not a flatbma state file: save the predictor with bma.save(path)")
    settings = read_settings(meta, path)
    damage = checksum_problem(tensors, meta)
    if damage:
        raise FlatbmaError(f"{path} is damaged: {damage} (a changed bit on the disk, or an edit); save it again")
    sections: dict[str, Params] = {s: {} for s in SECTIONS}
    try:
        order = json.loads(meta["order"])
        for key, value in tensors.items():
            section, _, name = key.partition("/")
            sections[section][name] = value
        sections = {s: in_order(section, order.get(s, [])) for s, section in sections.items()}
        step = int(meta["step"])
    except (KeyError, ValueError, TypeError, AttributeError):
        raise FlatbmaError(f"{path}: the state file is damaged (tensor names or metadata); save it again") from None
    return State(step=step, **sections), settings


def architecture(model: nn.Module) -> list[str]:
    """The module tree of ``model`` as a predictor file records it: ``"<name>: <class>"`` for every submodule.

    It tells apart same-shaped modules of other layers (a ``Tanh`` for a ``ReLU``), which the state cannot;
    activations called as functions inside ``forward`` are not seen.
    """
    return [f"{name or '.'}: {type(module).__qualname__}" for name, module in model.named_modules()]


def architecture_problem(recorded: Any, model: nn.Module) -> str | None:
    """How ``model``'s tree differs from the ``recorded`` one (:func:`architecture`); ``None``: it does not."""
    have = architecture(model)
    for there, here in zip(recorded, have, strict=False):
        if there != here:
            return clip(f"module {there} there, {here.partition(': ')[2]} here", 100)
    if len(recorded) != len(have):
        return f"{len(recorded)} modules there, {len(have)} here"
    return None


def likelihood_of(settings: Mapping[str, Any], path: str | Path) -> Gaussian | None:
    """The likelihood a predictor file records (:meth:`BMA.save`): ``None`` for a classifier."""
    recorded = settings.get("likelihood")
    if recorded is None:
        return None
    try:
        if recorded["name"] != "gaussian":
            raise ValueError(recorded["name"])
        return Gaussian(noise_std=recorded["noise_std"])
    except (KeyError, TypeError, ValueError, FlatbmaError):
        raise FlatbmaError(f"{path}: the predictor settings are damaged (likelihood); save it again") from None


def read_settings(meta: Mapping[str, str], path: str | Path) -> dict[str, Any]:
    """The predictor settings in a state file's metadata (:meth:`BMA.save`)."""
    if PREDICTOR_KEY not in meta:
        raise FlatbmaError(
            f"{path} holds a method state but no predictor settings (a run checkpoint?): evaluate a run with "
            "'flatbma evaluate RUN_DIR', or save a predictor with BMA.save"
        )
    try:
        settings = json.loads(meta[PREDICTOR_KEY])
        valid = settings["format"] == PREDICTOR_FORMAT and is_int(settings["num_samples"]) and is_int(settings["seed"])
        valid = valid and settings["logits"] in (LOGITS_FIRST, LOGITS_OUTPUT)
        tree = settings["architecture"]
        valid = valid and isinstance(tree, list) and all(isinstance(entry, str) for entry in tree)
    except (ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        raise FlatbmaError(f"{path}: the predictor settings are damaged or of another version; save it again")
    return settings
