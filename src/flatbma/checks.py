"""Argument checks shared by every layer (the ``_check_*`` habit of torch-uncertainty).

``bool`` is an ``int`` in Python, but a config's ``true`` must not pass as 1 or 1.0: these predicates say it
once. The checks raise :class:`~flatbma.errors.FlatbmaError` with the caller's own message.
"""

from __future__ import annotations

import math
import reprlib
from enum import Enum
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from flatbma.errors import FlatbmaError, suggest

E = TypeVar("E", bound=Enum)

_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 3, 6, 6, 6
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = 60


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for an error message, at most ``limit`` characters whatever the value's size."""
    text = _SHOWN.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_choice(cls: type[E], value: Any, key: str) -> E:
    """The member of the option Enum ``cls`` for ``value`` (a member or its string), else a :class:`FlatbmaError`.

    E.g. ``"reuse must be one of 'orthogonal', 'none', got 'orth'. Did you mean 'orthogonal'?"`` (the value's
    repr cut at 40 characters).
    """
    try:
        return cls(value)
    except (ValueError, TypeError):  # TypeError: an unhashable value on some Python versions
        choices = [str(m.value) for m in cls]
        names = ", ".join(repr(c) for c in choices)
        hint = suggest(str(value), choices)
        raise FlatbmaError(f"{key} must be one of {names}, got {shown(value, 40)}.{hint}") from None


def is_int(value: object) -> bool:
    """Whether ``value`` is an ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_integral(value: object) -> bool:
    """Whether ``value`` is a Python or NumPy integer and not a ``bool`` (e.g. an index read from an array)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """Whether ``value`` is an ``int`` or ``float`` and not a ``bool`` (NaN and ±inf included)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(value: object, message: str, *, minimum: int | None = None) -> int:
    """``value`` if it is an integer (not a bool) ``>= minimum``; else :class:`FlatbmaError` (``message``)."""
    if not is_int(value) or (minimum is not None and value < minimum):
        raise FlatbmaError(message)
    return value


def check_number(
    value: object,
    message: str,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` if it is a number (not a bool) in the interval ``[low, high]``; else :class:`FlatbmaError`.

    ``low_open``/``high_open`` exclude the bound; NaN is never inside. Returned as given (an ``int`` stays one).
    """
    if not is_number(value):
        raise FlatbmaError(message)
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        raise FlatbmaError(message)
    return value


def check_finite_vector(values: object, name: str) -> Tensor:
    """``values`` (list, tuple, array or tensor) as a float64 CPU tensor if it is a non-empty 1-D finite sequence.

    Otherwise a :class:`FlatbmaError` naming the argument ``name``.
    """
    try:
        t = torch.as_tensor(values, dtype=torch.float64).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        raise FlatbmaError(f"{name} must be a sequence of numbers (got {type(values).__name__})") from None
    if t.dim() != 1 or t.numel() == 0:
        raise FlatbmaError(f"{name} must be a non-empty 1-D sequence of numbers (got shape {tuple(t.shape)})")
    if not bool(torch.isfinite(t).all()):
        raise FlatbmaError(f"{name} must be finite (got {t.tolist()})")
    return t


def check_device(
    device: object, key: str, *, instead: str, kinds: tuple[str, ...] = ("cpu", "cuda", "mps")
) -> torch.device:
    """``device`` (a name or a ``torch.device``) as a device flatbma can use on this machine.

    A CPU, an existing CUDA device or an available MPS device, among ``kinds`` (the predictor also takes ``meta``);
    else a :class:`FlatbmaError` naming ``key`` and what to use ``instead`` (``"auto or cpu"`` in a config).
    """
    try:
        parsed = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        raise FlatbmaError(f"{key} {shown(device)} is not a device name (use {instead}, cuda, cuda:0, ...)") from None
    if parsed.type not in kinds:
        raise FlatbmaError(f"{key} {shown(device)}: flatbma trains on cpu, cuda or mps devices; use {instead}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise FlatbmaError(f"{key} is {shown(device)} but CUDA is not available here: use {instead}")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise FlatbmaError(f"{key} is {shown(device)} but there are {torch.cuda.device_count()} CUDA devices")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise FlatbmaError(f"{key} is {shown(device)} but MPS is not available here: use {instead}")
    return parsed


def check_seed(seed: object, key: str) -> int:
    """``seed`` if it is an integer in ``[0, 2**63)`` (what ``torch.manual_seed`` takes); else :class:`FlatbmaError`."""
    if not is_int(seed) or not 0 <= seed < 2**63:
        raise FlatbmaError(f"{key} must be an integer in [0, 2**63), got {shown(seed, 40)}")
    return seed


_FLOAT32_MAX = 3.4028234663852886e38


def check_positive(where: str, value: float | None, *, allow_none: bool = False, allow_zero: bool = False) -> None:
    """Raise unless ``value > 0`` (``>= 0``: ``allow_zero``; ``None`` passes: ``allow_none``), finite in float32."""
    if value is None and allow_none:
        return
    ok = value is not None and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise FlatbmaError(f"{where} must be {bound}, got {value!r}")
    if not math.isfinite(value) or value > _FLOAT32_MAX:  # the values meet float32 tensors
        raise FlatbmaError(f"{where} must be a finite number below 3.4e38 (float32 range), got {value!r}")
