"""Flatness of the training loss at given weights: Hessian spectra from Hessian-vector products.

* :func:`hvp_fn` — the operator ``v ↦ ∇²L_S(w) v`` of the mean loss over a data set, batch by batch;
* :func:`hessian_eigenvalues` — the top-``k`` eigenvalues (Lanczos, or power iteration as reference);
* :func:`hessian_trace` — Hutchinson's trace estimate with its standard error;
* :func:`spectral_density` — the eigenvalue density by stochastic Lanczos quadrature.
* :func:`loss_along` / :func:`loss_surface` / :func:`posterior_landscape` — 1-D and 2-D loss landscapes
  along filter-normalized random (:func:`random_direction`) or top-eigenvector directions.

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
from flatbma.flatness.landscape import (
    BiasBNPolicy,
    EigenDirection,
    LandscapeBand,
    landscape_1d_png,
    landscape_2d_png,
    loss_along,
    loss_along_samples,
    loss_surface,
    plot_landscape_1d,
    plot_landscape_2d,
    posterior_landscape,
    random_direction,
    top_eigen_direction,
)
from flatbma.flatness.slq import SpectralDensity, spectral_density, stochastic_lanczos_quadrature

__all__ = [
    "BiasBNPolicy",
    "ConvergenceWarning",
    "EigenDirection",
    "EigenMethod",
    "EigenResult",
    "HVPMethod",
    "HessianOperator",
    "LandscapeBand",
    "SpectralDensity",
    "TraceEstimate",
    "hessian_eigenvalues",
    "hessian_trace",
    "hutchinson_trace",
    "hvp_fn",
    "lanczos",
    "lanczos_tridiagonal",
    "landscape_1d_png",
    "landscape_2d_png",
    "loss_along",
    "loss_along_samples",
    "loss_surface",
    "plot_landscape_1d",
    "plot_landscape_2d",
    "posterior_landscape",
    "power_iteration",
    "random_direction",
    "spectral_density",
    "stochastic_lanczos_quadrature",
    "top_eigen_direction",
]
