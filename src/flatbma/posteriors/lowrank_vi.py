"""Low-rank plus diagonal Gaussian variational inference (the SWAG covariance shape, trained by VI).

``q_θ(w) = N(μ, Σ)`` with ``Σ = ½(diag σ² + L Lᵀ / (K − 1))``, ``L ∈ R^{d×K}``, sampled as

    ``w = μ + (1/√2)(σ ⊙ z₁ + L z₂ / √(K − 1))``,  ``z₁ ~ N(0, I_d)``, ``z₂ ~ N(0, I_K)`` (mean 0),

exactly the SWAG sampler (Maddox et al. 2019), so a SWAG posterior can initialize it (:func:`init_from_swag`).
``θ`` holds ``"mean/<name>"``, ``"log_std/<name>"`` and ``"factor/<name>"`` (shape ``[K, *S]``) for every trained
parameter of shape ``S``; the family's maths is :mod:`flatbma.gaussian` (re-exported here), docs/methods.md §3.4.
The prior is ``p = N(0, s² I)`` (:func:`build`) or another low-rank plus diagonal Gaussian
(:func:`flatbma.posteriors.fp_bma.build_with_prior`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor

from flatbma.checks import check_int
from flatbma.errors import FlatbmaError
from flatbma.gaussian import (
    MIN_VARIANCE,
    PREFIXES,
    GaussianNoise,
    blocks,
    check_sections,
    dense_covariance,
    draw_noise,
    from_rows,
    geometry,
    init_from_swag,
    kl_divergence,
    kl_divergence_grad,
    marginal_variance,
    natural_covariance_gradient,
    pullback,
    rank_of,
    rows,
    sample_weights,
    section,
    step_size,
    theta_layout,
)
from flatbma.packed import Layout
from flatbma.params import Objective
from flatbma.posteriors import gaussian_vi
from flatbma.posteriors.gaussian_vi import VarianceStep
from flatbma.types import Ascent, Capabilities, GradientTransformation, Params, Posterior, State, StepOutput

__all__ = [
    "MIN_VARIANCE",
    "PREFIXES",
    "LowRankGaussian",
    "Options",
    "blocks",
    "build",
    "check_rank",
    "dense_covariance",
    "fixed",
    "from_rows",
    "geometry",
    "init_from_swag",
    "kl_divergence",
    "posterior",
    "rank_of",
    "reparameterize",
    "rows",
    "sample_weights",
    "theta_layout",
    "theta_of",
]

reparameterize = sample_weights


def theta_of(state: State) -> Params:
    """The Gaussian ``q_θ`` of a low-rank VI (or FP-BMA) state: its ``θ`` (:attr:`Capabilities.gaussian`)."""
    return {k: v.detach().clone() for k, v in state.params.items()}


@dataclass(frozen=True)
class LowRankGaussian:
    """The low-rank plus diagonal family as a :class:`~flatbma.posteriors.gaussian_vi.ReparameterizedFamily`.

    Attributes:
        rank: ``K``.
        init_std: initial marginal standard deviation.
        prior_std: ``s``.
    """

    rank: int
    init_std: float
    prior_std: float

    def init_theta(self, params: Params, generator: torch.Generator) -> Params:
        """``μ = w₀``, ``σ = init_std``, ``L_ik ~ N(0, init_std²(K−1)/K)`` (so ``E[Σ] = init_std² I``).

        ``L`` starts random because ``L = 0`` is a stationary point of the expected objective (``E[z₂] = 0``).
        """
        k = self.rank
        c = self.init_std * math.sqrt((k - 1) / k)
        theta = {f"mean/{n}": v for n, v in params.items()}
        theta.update({f"log_std/{n}": torch.full_like(v, math.log(self.init_std)) for n, v in params.items()})
        for n, v in params.items():
            z = torch.randn((k, *v.shape), generator=generator, device=generator.device, dtype=v.dtype)
            theta[f"factor/{n}"] = c * z.to(v.device)
        return theta

    def check_theta(self, theta: Mapping[str, Tensor]) -> None:
        """Require the ``mean/``, ``log_std/``, ``factor/`` layout with ``K = rank``."""
        mean = check_sections(theta, PREFIXES, "lowrank-vi")
        factor = section(theta, "factor")
        for n, mu in mean.items():
            if factor[n].shape != (self.rank, *mu.shape):
                raise FlatbmaError(
                    f"method.rank is {self.rank} but the given factor/{n} has shape {tuple(factor[n].shape)} "
                    f"(expected {(self.rank, *mu.shape)}); set method.rank to the SWAG rank"
                )

    def noise(self, theta: Mapping[str, Tensor], generator: torch.Generator | None) -> GaussianNoise:
        """``z₁ ~ N(0, I_d)`` (by name, in sorted order), ``z₂ ~ N(0, I_K)``: :func:`~flatbma.gaussian.draw_noise`."""
        return draw_noise(theta, self.rank, generator)

    def reparameterize(self, theta: Mapping[str, Tensor], noise: GaussianNoise) -> Params:
        """:func:`~flatbma.gaussian.sample_weights`."""
        return sample_weights(theta, noise.z1, noise.z2)

    def pullback(self, theta: Mapping[str, Tensor], noise: GaussianNoise, grads: Mapping[str, Tensor]) -> Params:
        """``(∂w/∂θ)ᵀ g`` in closed form: :func:`~flatbma.gaussian.pullback`."""
        return pullback(theta, noise, grads)

    def layout(self, theta: Mapping[str, Tensor]) -> Layout:
        """:func:`~flatbma.gaussian.theta_layout`: how a state's ``θ`` (and its optimizer moments) are packed."""
        return theta_layout(theta)

    def kl_grad(self, theta: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """``∇_θ KL(q_θ ‖ N(0, s²I))`` in closed form: :func:`~flatbma.gaussian.kl_divergence_grad`."""
        return kl_divergence_grad(theta, self.prior_std)

    def kl(self, theta: Mapping[str, Tensor]) -> Tensor:
        """:func:`~flatbma.gaussian.kl_divergence` with ``s = prior_std``."""
        return kl_divergence(theta, self.prior_std)

    def decays(self, key: str) -> bool:
        """Weight decay acts on ``mean/<name>`` (the weights) only, not on the covariance parameters."""
        return key.startswith("mean/")

    def step_size(self, theta: Mapping[str, Tensor], moved: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """How far an ascent step moved ``q``: :func:`~flatbma.gaussian.step_size`."""
        return step_size(theta, moved)

    def natural_variance(
        self, theta: Mapping[str, Tensor], grads: Mapping[str, Tensor], scale: float
    ) -> Mapping[str, Tensor]:
        """``grads``, ``log σ``'s times ``scale/2``, clipped: :func:`~flatbma.gaussian.natural_covariance_gradient`."""
        return natural_covariance_gradient(theta, grads, scale)


def check_rank(rank: int) -> None:
    """Raise a :class:`FlatbmaError` unless ``rank`` (``method.rank``) is an integer ``K ≥ 2``."""
    check_int(
        rank,
        f"method.rank must be an integer >= 2 (got {rank!r}): Σ = ½(diag σ² + LLᵀ/(K−1)) needs K ≥ 2",
        minimum=2,
    )


def posterior(
    objective: Objective,
    optimizer: GradientTransformation,
    ascent: Ascent | None,
    family: LowRankGaussian,
    num_mc_samples: int,
    kl_weight: float,
    variance_step: VarianceStep,
) -> Posterior:
    """The Gaussian VI posterior of a low-rank ``family``: mean ``μ``, variances ``diag Σ``, gaussian ``q_θ``."""
    built = gaussian_vi.build(
        objective,
        optimizer,
        ascent,
        family,
        num_mc_samples=num_mc_samples,
        kl_weight=float(kl_weight),
        variance_step=variance_step,
    )
    can = replace(built.can, gaussian=theta_of)
    return replace(built, mean=gaussian_vi.mean_of, marginal_variance=marginal_variance_of, can=can)


def marginal_variance_of(state: State) -> Params:
    """``diag Σ`` of a low-rank VI state by parameter name (:func:`flatbma.gaussian.marginal_variance` of ``θ``)."""
    return marginal_variance(state.params)


def fixed(theta: Mapping[str, Tensor], buffers: Mapping[str, Tensor]) -> tuple[Posterior, State]:
    """The Gaussian ``q_θ`` itself as a posterior to measure, not to train, and its state.

    It samples with the family's sampler, with ``buffers`` beside every sample (``recompute_bn=True``); its mean is
    ``μ`` and its marginal variances ``diag Σ``. ``init`` and ``update`` raise ``FlatbmaError``.
    """
    rank = rank_of(theta)
    check_rank(rank)

    def untrainable(*_: object) -> tuple[State, StepOutput]:
        raise FlatbmaError("a fixed Gaussian (a width-matched posterior) is measured, not trained")

    family = LowRankGaussian(rank=rank, init_std=1.0, prior_std=1.0)  # init_std and prior_std: unused by sampling
    posterior = Posterior(
        init=untrainable,
        update=untrainable,
        sample=gaussian_vi.sampler(family),
        recompute_bn=True,
        mean=gaussian_vi.mean_of,
        marginal_variance=marginal_variance_of,
        can=Capabilities(gaussian=theta_of),
    )
    state = State(params={k: v.detach().clone() for k, v in theta.items()}, buffers=dict(buffers))
    return posterior, state


@dataclass(frozen=True)
class Options:
    """Low-rank VI's options (:func:`build`; with a prior, :func:`~flatbma.posteriors.fp_bma.build_with_prior`).

    Attributes:
        rank: ``K ≥ 2``, the number of factor columns.
        num_mc_samples: Monte-Carlo samples ``M`` per step (gradients averaged; FP-BMA's two passes share them).
        init_std: initial marginal standard deviation of every weight.
        prior_std: prior standard deviation ``s`` (of the default prior ``N(0, s²I)``).
        kl_weight: ``κ`` (1 is the ELBO; smaller values temper the KL).
        variance_step: :class:`~flatbma.posteriors.gaussian_vi.VarianceStep` (or its name) of ``log σ``; the
            factor ``L`` takes the plain step either way.
    """

    NOTES: ClassVar[str] = """
variance_step: natural (the default) steps log σ along its natural gradient of the whole ELBO, so that the
diagonal of Σ moves from init_std by about optim.lr per update in log σ; the factor L takes the optimizer's plain
step (plain: every block's plain step). docs/methods.md §3.3-3.4.
"""

    rank: int = 5
    num_mc_samples: int = 1
    init_std: float = 1e-3
    prior_std: float = 1.0
    kl_weight: float = 1.0
    variance_step: VarianceStep = VarianceStep.NATURAL


def build(
    objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None = None, **options
) -> Posterior:
    """Low-rank plus diagonal Gaussian VI; with an ascent step, F-low-rank-VI or FP-BMA.

    Minimizes ``E_{z₁,z₂}[L_B(w(θ, z))] + κ·KL(q_θ ‖ N(0, s²I)) / n`` over ``θ = (μ, log σ, L)`` with
    ``optimizer`` (``n = objective.num_data``) by ``gaussian_vi.build``. The ascent step
    chooses the method: none, low-rank VI; SAM on weights, F-low-rank-VI (Nguyen et al. 2023), each sampled ``w``
    perturbed; the Fisher ball on ``θ`` (:class:`~flatbma.optim.FisherBall`), FP-BMA (Lim et al. 2025).

    ``init`` also accepts a ``θ`` from :func:`init_from_swag`. The optimizer's weight decay acts on ``μ`` only. The
    expected gradient in ``L`` is second order (``∝ H L``, Stein's lemma) but its noise first order, so under Adam
    ``L`` diffuses by about ``lr·√t``: prefer a smaller Adam learning rate than for mean-field VI, or SGD.
    """
    o = Options(**options)
    check_rank(o.rank)
    step = gaussian_vi.check_options(
        num_mc_samples=o.num_mc_samples,
        init_std=o.init_std,
        prior_std=o.prior_std,
        kl_weight=o.kl_weight,
        variance_step=o.variance_step,
    )
    family = LowRankGaussian(rank=o.rank, init_std=float(o.init_std), prior_std=float(o.prior_std))
    return posterior(objective, optimizer, ascent, family, o.num_mc_samples, o.kl_weight, step)
