"""The low-rank plus diagonal Gaussian: its ``θ`` layout, sampler, covariance geometry and KL divergences.

``q_θ(w) = N(μ, Σ)`` with ``Σ = ½(diag σ² + L Lᵀ / (K − 1))``, ``L ∈ R^{d×K}``, sampled as

    ``w = μ + (1/√2)(σ ⊙ z₁ + L z₂ / √(K − 1))``,  ``z₁ ~ N(0, I_d)``, ``z₂ ~ N(0, I_K)`` (mean 0),

exactly the SWAG sampler (Maddox et al. 2019), so a SWAG posterior converts to it exactly
(:func:`init_from_swag`); docs/methods.md §3.4. ``θ`` is a dict of named tensors (``mean/<name>``,
``log_std/<name>``, ``factor/<name>``), so it works unchanged with optimizers, checkpoints and subset selection;
``z₂`` is shared by all parameters (one global ``L``).

The maths shared by low-rank VI, FP-BMA's Fisher-ball ascent and SWAG's Gaussian, depending on none of them:

* :mod:`~flatbma.gaussian.layout`: the sections of ``θ``, the packed ``[K+2, d]`` matrix, SWAG's ``θ``;
* :mod:`~flatbma.gaussian.sampling`: standard-normal noise, the sampler and its closed-form pullback;
* :mod:`~flatbma.gaussian.geometry`: ``Σ = A + UUᵀ`` in whitened (Woodbury) form, dense ``Σ``, ``diag Σ`` and ``cΣ``;
* :mod:`~flatbma.gaussian.kl`: ``KL`` to ``N(0, s²I)`` and to another low-rank Gaussian, with gradients;
* :mod:`~flatbma.gaussian.density`: ``log q_θ(w)``, its score ``∇_θ log q_θ(w)`` and the size of a step of ``θ``.

Precision: none of it runs under autocast (only the model's forward passes do). The KL divergences, log-densities
and step sizes are evaluated in float64 (their trace and log-determinant terms cancel much larger parts); the
sampler and its pullback run in the variables' dtype, float32.
"""

from flatbma.gaussian.density import log_density, score, step_size
from flatbma.gaussian.geometry import (
    LowRankGeometry,
    dense_covariance,
    diag_and_factor_blocks,
    geometry,
    marginal_variance,
    natural_covariance_gradient,
    scale_covariance,
)
from flatbma.gaussian.kl import (
    PriorPrecision,
    kl_divergence,
    kl_divergence_grad,
    kl_lowrank,
    kl_lowrank_grad,
    kl_rows,
    prior_precision,
)
from flatbma.gaussian.layout import (
    MIN_VARIANCE,
    PREFIXES,
    blocks,
    check_sections,
    factor_scale,
    from_rows,
    init_from_swag,
    is_theta,
    names_and_shapes,
    packed_rows,
    rank_of,
    rows,
    section,
    theta_layout,
)
from flatbma.gaussian.sampling import (
    GaussianNoise,
    draw_noise,
    pullback,
    sample_weights,
    standard_normal,
    standard_normal_like,
)

__all__ = [
    "MIN_VARIANCE",
    "PREFIXES",
    "GaussianNoise",
    "LowRankGeometry",
    "PriorPrecision",
    "blocks",
    "check_sections",
    "dense_covariance",
    "diag_and_factor_blocks",
    "draw_noise",
    "factor_scale",
    "from_rows",
    "geometry",
    "init_from_swag",
    "is_theta",
    "kl_divergence",
    "kl_divergence_grad",
    "kl_lowrank",
    "kl_lowrank_grad",
    "kl_rows",
    "log_density",
    "marginal_variance",
    "names_and_shapes",
    "natural_covariance_gradient",
    "packed_rows",
    "prior_precision",
    "pullback",
    "rank_of",
    "rows",
    "sample_weights",
    "scale_covariance",
    "score",
    "section",
    "standard_normal",
    "standard_normal_like",
    "step_size",
    "theta_layout",
]
