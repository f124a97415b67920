"""Flatness of the training loss at given weights: Hessian spectra from Hessian-vector products.

* :func:`hvp_fn` — the operator ``v ↦ ∇²L_S(w) v`` of the mean loss over a data set, batch by batch;
* :func:`hessian_eigenvalues` — the top-``k`` eigenvalues (Lanczos, or power iteration as reference);
* :func:`hessian_trace` — Hutchinson's trace estimate with its standard error;
* :func:`spectral_density` — the eigenvalue density by stochastic Lanczos quadrature.

The solvers on flat vectors (:func:`lanczos`, :func:`power_iteration`, :func:`hutchinson_trace`,
:func:`stochastic_lanczos_quadrature`) work for any symmetric operator.
"""

from flatbma.flatness.hutchinson import TraceEstimate, hessian_trace, hutchinson_trace
from flatbma.flatness.hvp import HessianOperator, HVPMethod, hvp_fn
from flatbma.flatness.lanczos import (
    ConvergenceWarning,
    EigenMethod,
    EigenResult,
    hessian_eigenvalues,
    lanczos,
    lanczos_tridiagonal,
    power_iteration,
)
from flatbma.flatness.slq import SpectralDensity, spectral_density, stochastic_lanczos_quadrature

__all__ = [
    "ConvergenceWarning",
    "EigenMethod",
    "EigenResult",
    "HVPMethod",
    "HessianOperator",
    "SpectralDensity",
    "TraceEstimate",
    "hessian_eigenvalues",
    "hessian_trace",
    "hutchinson_trace",
    "hvp_fn",
    "lanczos",
    "lanczos_tridiagonal",
    "power_iteration",
    "spectral_density",
    "stochastic_lanczos_quadrature",
]
