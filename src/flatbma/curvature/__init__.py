"""Curvature of the training loss as a block-diagonal Gaussian precision, and its evidence.

The pieces of a Gaussian approximation ``N(w*, (H/T + δ)⁻¹)`` around a point ``w*``, where ``H`` is the
generalized Gauss-Newton (or empirical Fisher) of the summed loss, diagonal, Kronecker-factored for Linear/Conv2d
layers (Martens & Grosse 2015; Grosse & Martens 2016) or full (primal ``[d, d]``, or dual through the ``nK``
per-example rows; Khan et al. 2019): streaming estimators of ``H`` (:func:`estimator`), ``H`` eigendecomposed per
block with ``log det``, samples and variances (:class:`Blocks`), and the Laplace evidence with the prior
precision that maximizes it (MacKay 1992; Immer et al. 2021).
"""

from flatbma.curvature.estimators import (
    CROSS_ENTROPY,
    DiagEstimator,
    DualEstimator,
    Estimator,
    FullEstimator,
    KfacEstimator,
    Likelihood,
    estimator,
    squared_error,
)
from flatbma.curvature.evidence import DELTA_RANGE, effective_parameters, log_evidence, optimize_prior
from flatbma.curvature.options import Curvature, Hessian, PriorStructure
from flatbma.curvature.structures import Blocks, DenseBlock, DiagBlock, KronBlock, LowRankBlock, Precision

__all__ = [
    "CROSS_ENTROPY",
    "DELTA_RANGE",
    "Blocks",
    "Curvature",
    "DenseBlock",
    "DiagBlock",
    "DiagEstimator",
    "DualEstimator",
    "Estimator",
    "FullEstimator",
    "Hessian",
    "KfacEstimator",
    "KronBlock",
    "Likelihood",
    "LowRankBlock",
    "Precision",
    "PriorStructure",
    "effective_parameters",
    "estimator",
    "log_evidence",
    "optimize_prior",
    "squared_error",
]
