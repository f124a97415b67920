"""Argument checks of the model constructors, built on :mod:`flatbma.checks` (the messages say how to fix)."""

from __future__ import annotations

from flatbma.checks import check_int, check_number, is_int
from flatbma.errors import FlatbmaError


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an ``int >= 1`` (not a bool), else raise :class:`FlatbmaError`."""
    return check_int(value, f"{name} must be a positive integer, got {value!r}.", minimum=1)


def check_dropout(value: object) -> float:
    """Return ``value`` as a float if it is a probability in ``[0, 1)``, else raise."""
    message = f"dropout must be a probability in [0, 1), got {value!r}."
    return float(check_number(value, message, low=0.0, high=1.0, high_open=True))


def check_seed(value: object) -> int | None:
    """Return ``value`` if it is ``None`` or an ``int`` (not a bool), else raise."""
    if value is not None and not is_int(value):
        raise FlatbmaError(f"seed must be an integer or None, got {value!r}.")
    return value
