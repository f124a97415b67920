"""The curvature layer's options as ``str`` Enums (strings and members are both accepted)."""

from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

from flatbma.errors import FlatbmaError, suggest

__all__ = ["Curvature", "Hessian", "PriorStructure", "parse_option"]

E = TypeVar("E", bound=Enum)


def parse_option(cls: type[E], value: Any, key: str) -> E:
    """The member of ``cls`` for ``value``, or a :class:`FlatbmaError` naming ``key`` and the choices."""
    try:
        return cls(value)
    except ValueError:
        choices = [m.value for m in cls]
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise FlatbmaError(f"{key} must be one of {choices} (got {shown}).{suggest(str(value), choices)}") from None


class Hessian(str, Enum):
    """The structure of the curvature ``H``: diagonal, Kronecker-factored (KFAC) or the full matrix."""

    DIAG = "diag"
    KFAC = "kfac"
    FULL = "full"


class Curvature(str, Enum):
    """Which curvature: the generalized Gauss-Newton (``ggn``) or the empirical Fisher (``ef``)."""

    GGN = "ggn"
    EF = "ef"


class PriorStructure(str, Enum):
    """One prior precision ``δ`` for all weights (``scalar``) or one per parameter tensor (``layerwise``)."""

    SCALAR = "scalar"
    LAYERWISE = "layerwise"
