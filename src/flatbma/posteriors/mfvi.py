"""Mean-field Gaussian variational inference: Bayes by backprop (Blundell et al., ICML 2015).

``q_θ(w) = N(μ, diag σ²)`` with ``σ = softplus(ρ)``; ``θ`` is stored as ``"mean/<name>"`` (``μ``) and ``"rho/<name>"``
(``ρ``) for every trainable parameter. The prior is ``p = N(0, s² I)``. With an ascent step this is F-MFVI (flat-seeking
VI, Nguyen et al., NeurIPS 2023); the step is :func:`flatbma.posteriors.gaussian_vi.elbo_value_and_grad`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from flatbma.family import Family
from flatbma.gaussian import GaussianNoise, check_sections, section, standard_normal_like
from flatbma.params import Objective
from flatbma.posteriors import gaussian_vi
from flatbma.posteriors.gaussian_vi import VarianceStep
from flatbma.types import Ascent, GradientTransformation, Params, Posterior, State

PREFIXES = ("mean", "rho")


def inverse_softplus(y: float) -> float:
    """``ρ`` with ``softplus(ρ) = y > 0``: ``log(expm1(y))``, computed stably."""
    return y + math.log(-math.expm1(-y))


def reparameterize(theta: Mapping[str, Tensor], z: Mapping[str, Tensor]) -> Params:
    """``w = μ + softplus(ρ) ⊙ z`` by parameter name (``z`` may carry leading sample dimensions)."""
    mean, rho = section(theta, "mean"), section(theta, "rho")
    return {k: mean[k] + F.softplus(rho[k]) * z[k] for k in mean}


sample_weights = reparameterize


def kl_divergence(theta: Mapping[str, Tensor], prior_std: float) -> Tensor:
    """``KL(N(μ, diag σ²) ‖ N(0, s² I)) = Σ_i [log(s/σ_i) + (σ_i² + μ_i²)/(2s²) − ½]``."""
    mean, rho = section(theta, "mean"), section(theta, "rho")
    s2 = prior_std**2
    total = torch.zeros((), device=next(iter(mean.values())).device)
    for k, mu in mean.items():
        sigma = F.softplus(rho[k])
        total = total + (math.log(prior_std) - torch.log(sigma) + (sigma**2 + mu**2) / (2 * s2) - 0.5).sum()
    return total


@dataclass(frozen=True)
class MeanFieldGaussian:
    """The mean-field family as a :class:`~flatbma.posteriors.gaussian_vi.ReparameterizedFamily`.

    Attributes:
        init_std: ``σ`` at initialization (``ρ = softplus⁻¹(init_std)``); ``μ`` starts at the weights.
        prior_std: ``s``.
    """

    init_std: float
    prior_std: float

    def init_theta(self, params: Params, generator: torch.Generator) -> Params:
        """``μ = w₀``, ``ρ = softplus⁻¹(init_std)``."""
        rho0 = inverse_softplus(self.init_std)
        theta = {f"mean/{k}": v for k, v in params.items()}
        theta.update({f"rho/{k}": torch.full_like(v, rho0) for k, v in params.items()})
        return theta

    def check_theta(self, theta: Mapping[str, Tensor]) -> None:
        """Require ``mean/<name>`` and ``rho/<name>`` for the same names."""
        check_sections(theta, PREFIXES, "mfvi")

    def noise(self, theta: Mapping[str, Tensor], generator: torch.Generator | None) -> GaussianNoise:
        """``z ~ N(0, I_d)``."""
        return GaussianNoise(standard_normal_like(section(theta, "mean"), generator))

    def reparameterize(self, theta: Mapping[str, Tensor], noise: GaussianNoise) -> Params:
        """:func:`reparameterize`."""
        return reparameterize(theta, noise.z1)

    def kl(self, theta: Mapping[str, Tensor]) -> Tensor:
        """:func:`kl_divergence` with ``s = prior_std``."""
        return kl_divergence(theta, self.prior_std)

    def decays(self, key: str) -> bool:
        """Weight decay acts on ``mean/<name>`` (the weights) only, not on the covariance parameters."""
        return key.startswith("mean/")

    def natural_variance(self, theta: Mapping[str, Tensor], grads: Mapping[str, Tensor], scale: float) -> Params:
        """``grads`` with ``ρ``'s multiplied by ``scale · F_ρ⁻¹``, clipped: :func:`natural_rho_gradient`."""
        return natural_rho_gradient(theta, grads, scale)


def natural_rho_gradient(theta: Mapping[str, Tensor], grads: Mapping[str, Tensor], scale: float) -> Params:
    """``grads`` with every ``rho/<name>`` multiplied by ``scale · F_ρ⁻¹ = scale · σ²/(2 sigmoid(ρ)²)``, clipped to ±1.

    ``F_ρ`` is the exact Fisher of ``N(μ, σ²)`` in ``ρ``; for ``ρ ≪ 0`` the factor is ``scale/2``, the natural step of
    ``log σ``. ``scale = n/(κG)`` gives the natural gradient of the tempered ELBO in ``ρ`` at the optimizer's rate
    (:class:`~flatbma.posteriors.gaussian_vi.VarianceStep`). ``μ``'s entries are unchanged.
    """
    out = dict(grads)
    for key, rho in section(theta, "rho").items():
        ratio = torch.where(rho < -20, torch.ones_like(rho), F.softplus(rho) / torch.sigmoid(rho))  # σ/σ'(ρ) → 1
        out[f"rho/{key}"] = (grads[f"rho/{key}"] * (0.5 * scale) * ratio.square()).clamp_(-1.0, 1.0)
    return out


@dataclass(frozen=True)
class Options:
    """Mean-field VI's options (:func:`build`).

    Attributes:
        num_mc_samples: Monte-Carlo samples ``M`` per step (their gradients are averaged).
        init_std: ``σ`` at initialization.
        prior_std: prior standard deviation ``s``.
        kl_weight: ``κ`` (1 is the ELBO; smaller values temper the KL).
        variance_step: :class:`~flatbma.posteriors.gaussian_vi.VarianceStep` (or its name) of ``ρ``: ``natural``, or
            ``plain`` (Blundell et al. 2015), under which ``σ`` stays near ``init_std`` on thousands of examples.
    """

    NOTES: ClassVar[str] = """
variance_step: natural (the default) steps ρ along its natural gradient of the whole ELBO, so that σ² moves from
init_std² to the mean-field optimum 1/(n·h/kl_weight + 1/prior_std²) by about optim.lr per update in log σ
(plain: the optimizer's step on the plain gradient, under which σ stays at init_std). docs/methods.md §3.3.
"""

    num_mc_samples: int = 1
    init_std: float = 1e-3
    prior_std: float = 1.0
    kl_weight: float = 1.0
    variance_step: VarianceStep = VarianceStep.NATURAL


def build(
    objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None = None, **options
) -> Posterior:
    """Bayes by backprop (MFVI), or F-MFVI with an ascent step.

    Minimizes ``E_{z~N(0,I)}[L_B(μ + σ⊙z)] + κ·KL(q_θ ‖ N(0, s²I)) / n`` over ``θ = (μ, ρ)`` with ``optimizer``,
    ``n = objective.num_data``; with ``variance_step: natural`` (the default) the ``ρ`` gradient is first scaled by
    :func:`natural_rho_gradient` (docs/methods.md §3.3). With an ascent step each sampled ``w`` is perturbed by
    ``ε = ascent.perturb(w, ∇L_B(w))`` and ``∇L_B(w + ε)`` is back-propagated to ``θ``. Adam is the usual
    ``optimizer``; its weight decay acts on ``μ`` only.
    """
    o = Options(**options)
    step = gaussian_vi.check_options(
        num_mc_samples=o.num_mc_samples,
        init_std=o.init_std,
        prior_std=o.prior_std,
        kl_weight=o.kl_weight,
        variance_step=o.variance_step,
    )
    family = MeanFieldGaussian(init_std=float(o.init_std), prior_std=float(o.prior_std))
    built = gaussian_vi.build(
        objective,
        optimizer,
        ascent,
        family,
        num_mc_samples=o.num_mc_samples,
        kl_weight=float(o.kl_weight),
        variance_step=step,
    )
    return replace(built, mean=gaussian_vi.mean_of, marginal_variance=marginal_variance)


def marginal_variance(state: State) -> Params:
    """``σ² = softplus(ρ)²`` by parameter name: the exact marginal variances of ``q_θ``."""
    return {n: F.softplus(rho.detach()) ** 2 for n, rho in section(state.params, "rho").items()}


FAMILY = Family(build, Options, advice=gaussian_vi.advice)
"""Mean-field Gaussian VI, and with SAM on each sampled model F-MFVI (:mod:`flatbma.methods`)."""
