"""Safe loading of state-dict checkpoints into models.

Checkpoints are never unpickled as arbitrary objects: ``.safetensors`` files are read with safetensors, any other
with ``torch.load(..., weights_only=True)``; a file that needs more (a pickled module, code in ``__reduce__``) is
refused with a :class:`FlatbmaError`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from flatbma.errors import FlatbmaError

StateDict = dict[str, Tensor]
"""A flat mapping from parameter/buffer names to tensors."""

_WRAPPER_KEYS = ("state_dict", "model_state_dict", "model")
_MAX_LISTED = 8


def load_state_dict_file(path: str | os.PathLike[str]) -> StateDict:
    """Read a state dict from a ``.pth``/``.pt`` (weights-only) or ``.safetensors`` file, on the CPU.

    A state dict nested under ``"state_dict"``, ``"model_state_dict"`` or ``"model"`` is unwrapped, and a
    ``"module."`` prefix shared by every key (``nn.DataParallel``) is removed. Returns the tensors by name.

    Raises:
        FlatbmaError: if the file is missing, cannot be read safely, or is not a mapping from names to tensors.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FlatbmaError(
            f"checkpoint '{path}' does not exist or is not a file; pass the path of a .pth/.pt state "
            "dict or of a .safetensors file."
        )
    obj = _read_safetensors(path) if path.suffix == ".safetensors" else _read_weights_only(path)
    return _as_state_dict(obj, path)


def load_matching(model: nn.Module, state_dict: Mapping[str, Tensor], *, source: str, head: str) -> bool:
    """Load ``state_dict`` into ``model``: every tensor must match, except possibly the classifier.

    Keys must correspond one to one with equal shapes (missing ``num_batches_tracked`` counters are tolerated),
    except the *shape* of the classifier ``head``'s tensors (its qualified name): that head is then re-drawn with
    ``reset_parameters()`` from the current RNG. Loaded parameters are marked :func:`is_pretrained`. ``source``
    names the checkpoint in messages. Returns whether the head was re-initialized.

    Raises:
        FlatbmaError: listing the missing, unexpected and mismatched keys if the checkpoint does not fit.
    """
    expected = model.state_dict()
    head_prefix = f"{head}."
    missing = [k for k in expected if k not in state_dict and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state_dict if k not in expected]
    mismatched = [k for k in expected if k in state_dict and state_dict[k].shape != expected[k].shape]
    head_differs = bool(mismatched) and all(k.startswith(head_prefix) for k in mismatched)
    if missing or unexpected or (mismatched and not head_differs):
        problems = []
        if missing:
            problems.append(f"missing keys {_listing(missing)}")
        if unexpected:
            problems.append(f"unexpected keys {_listing(unexpected)}")
        if mismatched:
            shapes = [
                f"{k} (checkpoint {tuple(state_dict[k].shape)}, model {tuple(expected[k].shape)})" for k in mismatched
            ]
            problems.append(f"shape mismatches {_listing(shapes)}")
        raise FlatbmaError(
            f"checkpoint '{source}' does not fit {type(model).__name__}: " + "; ".join(problems) + ". "
            "Check that the model name and its options (width, stem, in_channels) match the checkpoint."
        )
    if head_differs:
        body = {k: v for k, v in state_dict.items() if not k.startswith(head_prefix)}
        model.load_state_dict(body, strict=False)
        module = model.get_submodule(head)
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        _mark_pretrained(model, body)
        return True
    model.load_state_dict(dict(state_dict), strict=True)
    _mark_pretrained(model, state_dict)
    return False


_PRETRAINED = "_flatbma_pretrained"
"""Attribute set on a parameter whose values were loaded from a checkpoint (:func:`is_pretrained`)."""


def copied(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters keep their :func:`is_pretrained` marks (a tensor's copy drops them)."""
    out = copy.deepcopy(model)
    marked = {name for name, param in model.named_parameters() if is_pretrained(param)}
    for name, param in out.named_parameters():
        if name in marked:
            setattr(param, _PRETRAINED, True)
    return out


def _mark_pretrained(model: nn.Module, loaded: Mapping[str, Tensor]) -> None:
    for name, param in model.named_parameters():
        if name in loaded:
            setattr(param, _PRETRAINED, True)


def is_pretrained(param: Tensor) -> bool:
    """Whether ``param``'s values were loaded from a checkpoint by :func:`load_matching` (not randomly initialized).

    The mark is on the parameter object, so it survives renaming or wrapping its module (not a tensor copy: use
    ``copied``); a head re-initialized or replaced for another class count is not marked.
    """
    return bool(getattr(param, _PRETRAINED, False))


def _read_weights_only(path: Path) -> object:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, RuntimeError, KeyError, EOFError, ... from torch
        raise FlatbmaError(
            f"refused to load checkpoint '{path}': it is not a plain state dict of tensors that "
            f"torch.load(weights_only=True) accepts ({_reason(exc)}). flatbma never unpickles arbitrary "
            "objects; re-save the weights with torch.save(model.state_dict(), path) or as .safetensors."
        ) from None


def _read_safetensors(path: Path) -> object:
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:  # SafetensorError, OSError
        raise FlatbmaError(
            f"could not read '{path}' as a .safetensors file ({_reason(exc)}); re-save it with "
            "safetensors.torch.save_file(model.state_dict(), path)."
        ) from None


def _as_state_dict(obj: object, path: Path) -> StateDict:
    if isinstance(obj, Mapping) and not _all_tensors(obj):
        for key in _WRAPPER_KEYS:
            inner = obj.get(key)
            if isinstance(inner, Mapping) and _all_tensors(inner):
                obj = inner
                break
    if not isinstance(obj, Mapping):
        raise FlatbmaError(
            f"checkpoint '{path}' holds a {type(obj).__name__}, not a state dict; save "
            "model.state_dict() rather than the model or other objects."
        )
    bad = [f"{k!r}: {type(v).__name__}" for k, v in obj.items() if not (isinstance(k, str) and _is_tensor(v))]
    if bad:
        raise FlatbmaError(
            f"checkpoint '{path}' is not a state dict: entries {_listing(bad)} are not tensors under string "
            "names; save model.state_dict() (a training checkpoint may keep it under 'state_dict')."
        )
    state: StateDict = dict(obj)
    if state and all(k.startswith("module.") for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    return state


def _all_tensors(mapping: Mapping[object, object]) -> bool:
    return all(isinstance(k, str) and _is_tensor(v) for k, v in mapping.items())


def _is_tensor(value: object) -> bool:
    return isinstance(value, Tensor)


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return f"[{shown}{f', ... and {more} more' if more > 0 else ''}]"


def _reason(exc: BaseException) -> str:
    """One informative line of a (possibly long, multi-paragraph) torch error message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if line.startswith(("Trying to load", "Unsupported", "Unpickler found")):
            return line
    skip = ("Weights only load failed", "Please file an issue", "Check the documentation", "In PyTorch")
    useful = [line for line in lines if not line.startswith(skip)]
    detail = useful[0] if useful else ""
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
