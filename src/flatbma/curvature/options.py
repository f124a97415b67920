"""The curvature layer's options as ``str`` Enums (strings and members are both accepted)."""

from __future__ import annotations

from enum import Enum

__all__ = ["Curvature", "Hessian", "PriorStructure"]


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
