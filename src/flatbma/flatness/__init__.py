"""Flatness of the training loss at given weights: Hessian spectra from Hessian-vector products.

* :func:`hvp_fn` — the operator ``v ↦ ∇²L_S(w) v`` of the mean loss over a data set, batch by batch;
* :func:`hessian_eigenvalues` — the top-``k`` eigenvalues (Lanczos, or power iteration as reference);
* :func:`hessian_trace` — Hutchinson's trace estimate with its standard error;
* :func:`spectral_density` — the eigenvalue density by stochastic Lanczos quadrature;
* :func:`loss_along` / :func:`loss_surface` / :func:`posterior_landscape` — 1-D and 2-D loss landscapes
  along filter-normalized random (:func:`random_direction`) or top-eigenvector directions;
* :func:`sample_spectra` / :func:`distribution_spectrum` / :func:`sam_sharpness` — a posterior's per-sample and
  distribution-level flatness; :func:`flatness_report` is the measurement protocol, :func:`repeatability` compares
  two measurements; their shared spectrum keywords are :class:`SpectrumOptions`;
* :func:`width` / :func:`sample_variance` — the posterior's width (``tr Σ``, median marginal std).

The solvers on flat vectors (:func:`lanczos`, :func:`power_iteration`, :func:`hutchinson_trace`,
:func:`stochastic_lanczos_quadrature`) work for any symmetric operator. The landscape plots
(:func:`plot_landscape_1d`, :func:`plot_landscape_2d` and their ``*_png`` forms) are re-exported from
:mod:`flatbma.plotting`; they need matplotlib (``pip install flatbma[plots]``).
"""

from flatbma.flatness.hutchinson import TraceEstimate, hessian_trace, hutchinson_trace, rademacher
from flatbma.flatness.hvp import CPU_CHUNK_SIZE, HessianOperator, HVPMethod, ParamSelection, hvp_fn, nonzero_checked
from flatbma.flatness.lanczos import (
    ConvergenceWarning,
    EigenMethod,
    EigenResult,
    default_basis_size,
    hessian_eigenvalues,
    lanczos,
    lanczos_tridiagonal,
    power_iteration,
)
from flatbma.flatness.landscape import (
    BiasBNPolicy,
    EigenDirection,
    LandscapeBand,
    loss_along,
    loss_along_samples,
    loss_surface,
    posterior_landscape,
    random_direction,
    top_eigen_direction,
)
from flatbma.flatness.posterior import (
    HEAVY_TAIL_FACTOR,
    SampleFlatness,
    SpectrumOptions,
    distinct_samples,
    distribution_spectrum,
    flatness_report,
    lambda1_summary,
    measure_samples,
    repeatability,
    repeatable,
    sam_sharpness,
    sample_spectra,
)
from flatbma.flatness.slq import SpectralDensity, spectral_density, stochastic_lanczos_quadrature
from flatbma.flatness.width import Width, sample_variance, width
from flatbma.plotting import landscape_1d_png, landscape_2d_png, plot_landscape_1d, plot_landscape_2d

__all__ = [
    "CPU_CHUNK_SIZE",
    "HEAVY_TAIL_FACTOR",
    "BiasBNPolicy",
    "ConvergenceWarning",
    "EigenDirection",
    "EigenMethod",
    "EigenResult",
    "HVPMethod",
    "HessianOperator",
    "LandscapeBand",
    "ParamSelection",
    "SampleFlatness",
    "SpectralDensity",
    "SpectrumOptions",
    "TraceEstimate",
    "Width",
    "default_basis_size",
    "distinct_samples",
    "distribution_spectrum",
    "flatness_report",
    "hessian_eigenvalues",
    "hessian_trace",
    "hutchinson_trace",
    "hvp_fn",
    "lambda1_summary",
    "lanczos",
    "lanczos_tridiagonal",
    "landscape_1d_png",
    "landscape_2d_png",
    "loss_along",
    "loss_along_samples",
    "loss_surface",
    "measure_samples",
    "nonzero_checked",
    "plot_landscape_1d",
    "plot_landscape_2d",
    "posterior_landscape",
    "power_iteration",
    "rademacher",
    "random_direction",
    "repeatability",
    "repeatable",
    "sam_sharpness",
    "sample_spectra",
    "sample_variance",
    "spectral_density",
    "stochastic_lanczos_quadrature",
    "top_eigen_direction",
    "width",
]
