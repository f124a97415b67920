"""FP-BMA / SA-BMA: flat-posterior-aware Bayesian model averaging (Lim et al., UAI 2025).

FP-BMA is a composition, not a family of its own: the low-rank plus diagonal Gaussian of
:mod:`flatbma.posteriors.lowrank_vi` with the Fisher-ball ascent :class:`flatbma.optim.FisherBall` on ``θ``. It trains

    ``min_θ  max_{θ': KL(q_θ' ‖ q_θ) ≤ γ}  E_{w~q_θ'} L_B(w)  +  κ · KL(q_θ ‖ p) / n``

with :func:`flatbma.posteriors.gaussian_vi.theta_sharpness_value_and_grad`: the ascent ``δ* = √(2γ)F⁻¹g/√(gᵀF⁻¹g)``
along the data gradient ``g = ∇_θ E_z L_B(w(θ, z))`` in the Fisher metric of ``q_θ``, then the descent gradient at
``θ + δ*`` with the same noise, plus the KL gradient at ``θ`` (derivation: docs/methods.md §5; where the authors'
code differs: §10.1). :func:`build` uses the prior ``p = N(0, s²I)``; :func:`build_with_prior` a low-rank plus
diagonal Gaussian ``p`` (e.g. a source-task SWAG posterior).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flatbma.errors import FlatbmaError
from flatbma.family import Family
from flatbma.gaussian import (
    PREFIXES,
    PriorPrecision,
    check_sections,
    kl_lowrank,
    kl_lowrank_grad,
    prior_precision,
    rank_of,
    section,
)
from flatbma.params import Objective
from flatbma.posteriors import gaussian_vi, lowrank_vi
from flatbma.posteriors.lowrank_vi import LowRankGaussian
from flatbma.types import Ascent, GradientTransformation, Params, Posterior

__all__ = ["LowRankGaussianWithPrior", "build", "build_with_prior", "kl_lowrank"]

build = lowrank_vi.build
"""FP-BMA with the isotropic prior ``N(0, s²I)``: :func:`flatbma.posteriors.lowrank_vi.build` called with
``ascent = FisherBall(...)`` (with ``None`` it is plain low-rank VI)."""


@dataclass(frozen=True, eq=False)
class LowRankGaussianWithPrior(LowRankGaussian):
    """:class:`~flatbma.posteriors.lowrank_vi.LowRankGaussian` whose prior is a low-rank Gaussian.

    Attributes:
        prior: the prior's ``mean/``, ``log_std/``, ``factor/`` tensors (``prior_std`` is unused).
        precision: the prior's :class:`~flatbma.gaussian.PriorPrecision` (``Σ_p⁻¹`` in Woodbury form); by default
            computed once, on the prior's device. When ``θ`` is on another device it is recomputed at every step.
    """

    prior: Mapping[str, Tensor] = field(default_factory=dict)
    precision: PriorPrecision | None = None

    def __post_init__(self) -> None:
        if self.precision is None and self.prior:  # a constant of the family: once, on the prior's device
            device = next(iter(self.prior.values())).device
            object.__setattr__(self, "precision", prior_precision(self.prior, device))

    def _check_names(self, names: list[str]) -> None:
        prior_names = sorted(section(self.prior, "mean"))
        if prior_names != sorted(names):
            raise FlatbmaError(
                f"the fp-bma prior covers parameters {prior_names[:5]} but the trainable parameters are "
                f"{sorted(names)[:5]}; build the prior for exactly the trainable parameters"
            )

    def init_theta(self, params: Params, generator: torch.Generator) -> Params:
        """As the base family, after checking that the prior covers exactly ``params``."""
        self._check_names(list(params))
        return super().init_theta(params, generator)

    def check_theta(self, theta: Mapping[str, Tensor]) -> None:
        """As the base family, and the prior must cover the same parameters."""
        super().check_theta(theta)
        self._check_names(list(section(theta, "mean")))

    def kl(self, theta: Mapping[str, Tensor]) -> Tensor:
        """:func:`~flatbma.gaussian.kl_lowrank` to the prior."""
        return kl_lowrank(theta, self.prior)

    def kl_grad(self, theta: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """``∇_θ KL(q_θ ‖ p)`` in closed form, packed like ``θ``: :func:`~flatbma.gaussian.kl_lowrank_grad`."""
        return kl_lowrank_grad(theta, self.prior, self.precision)


def build_with_prior(
    objective: Objective,
    optimizer: GradientTransformation,
    ascent: Ascent | None,
    prior_theta: Mapping[str, Tensor],
    **options,
) -> Posterior:
    """FP-BMA with a low-rank plus diagonal Gaussian prior, for Python callers and transfer pipelines.

    As :func:`build`, with ``KL(q_θ ‖ p)`` (:func:`~flatbma.gaussian.kl_lowrank`) for the prior
    ``p = N(μ_p, ½(diag σ_p² + L_pL_pᵀ/(K_p−1)))`` given as ``prior_theta``: ``mean/``, ``log_std/``, ``factor/``
    tensors for exactly the trainable parameters, of any rank ``K_p ≥ 2`` (e.g. ``init_from_swag(...)``, which may
    also be passed to ``init`` if ``rank`` equals its ``K``). The prior is not stored in the state: to resume, build
    again with it. ``options`` are :class:`~flatbma.posteriors.lowrank_vi.Options` (``prior_std`` does not apply);
    ``ascent=None`` gives low-rank VI with that prior.

    Raises:
        FlatbmaError: ``prior_theta`` is not a ``θ``-layout dict of finite tensors of rank ``≥ 2`` matching ``mean/``.
    """
    o = lowrank_vi.Options(**options)
    lowrank_vi.check_rank(o.rank)
    step = gaussian_vi.check_options(
        num_mc_samples=o.num_mc_samples,
        init_std=o.init_std,
        prior_std=1.0,
        kl_weight=o.kl_weight,
        variance_step=o.variance_step,
    )
    if not isinstance(prior_theta, Mapping):
        raise FlatbmaError(f"prior_theta must be a dict of tensors in θ layout, got {type(prior_theta).__name__}")
    check_sections(prior_theta, PREFIXES, "fp-bma prior")
    if rank_of(prior_theta) < 2:
        raise FlatbmaError(f"the fp-bma prior needs a factor with at least 2 columns (got {rank_of(prior_theta)})")
    mean = section(prior_theta, "mean")
    bad = [n for n, f in section(prior_theta, "factor").items() if f.shape[1:] != mean[n].shape]
    if bad or any(prior_theta[f"log_std/{n}"].shape != mean[n].shape for n in mean):
        raise FlatbmaError(f"the fp-bma prior's log_std/ and factor/ shapes must match its mean/ (e.g. {bad[:3]})")
    if not all(torch.isfinite(v).all() for v in prior_theta.values()):
        raise FlatbmaError("the fp-bma prior contains non-finite values")
    prior = {k: v.detach() for k, v in prior_theta.items()}
    family = LowRankGaussianWithPrior(rank=o.rank, init_std=float(o.init_std), prior_std=1.0, prior=prior)
    return lowrank_vi.posterior(objective, optimizer, ascent, family, o.num_mc_samples, o.kl_weight, step)


FAMILY = Family(
    lowrank_vi.build, lowrank_vi.Options, gaussian=True, with_prior=build_with_prior, advice=gaussian_vi.advice
)
"""Low-rank plus diagonal Gaussian VI, which takes a two-stage run's Gaussian prior (:func:`build_with_prior`):
low-rank VI, with SAM on each sample F-low-rank VI, with the Fisher ball FP-BMA (:mod:`flatbma.methods`)."""
