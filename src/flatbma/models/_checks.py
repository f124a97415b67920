"""Argument checks shared by the model constructors (raise :class:`FlatbmaError` saying how to fix)."""

from __future__ import annotations

from flatbma.errors import FlatbmaError


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an ``int >= 1`` (not a bool), else raise :class:`FlatbmaError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FlatbmaError(f"{name} must be a positive integer, got {value!r}.")
    return value


def check_dropout(value: object) -> float:
    """Return ``value`` as a float if it is a probability in ``[0, 1)``, else raise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
        raise FlatbmaError(f"dropout must be a probability in [0, 1), got {value!r}.")
    return float(value)


def check_seed(value: object) -> int | None:
    """Return ``value`` if it is ``None`` or an ``int`` (not a bool), else raise."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise FlatbmaError(f"seed must be an integer or None, got {value!r}.")
    return value
