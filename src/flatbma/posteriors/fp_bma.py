"""FP-BMA / SA-BMA: flat-posterior-aware Bayesian model averaging (Lim et al., UAI 2025).

The variational family is the low-rank plus diagonal Gaussian of :mod:`flatbma.posteriors.lowrank_vi`
(same ``θ`` layout ``mean/``, ``log_std/``, ``factor/`` and the same sampler, so a state of either
samples identically), trained on

    ``min_θ  max_{θ': KL(q_θ' ‖ q_θ) ≤ γ}  E_{w~q_θ'} L_B(w)  +  κ · KL(q_θ ‖ p) / n``

with the two-pass step of :func:`flatbma.posteriors.gaussian_vi.theta_sharpness_value_and_grad`: the
reparameterized data gradient ``g = ∇_θ E_z L_B(w(θ, z))`` (noise drawn once per step), the ascent
``δ* = ascent.perturb(θ, g)`` — :class:`flatbma.optim.fp_bma.FisherBall`, ``√(2γ)F⁻¹g/√(gᵀF⁻¹g)`` in the
Fisher metric of ``q_θ`` — and the descent gradient ``∇_θ E_z L_B(w(θ + δ*, z))`` with the same noise,
plus the KL gradient at ``θ``. BatchNorm running statistics are updated by the first pass only.

Priors: :func:`build` (the registry entry, config-typed) uses ``p = N(0, s²I)``;
:func:`build_with_prior` takes any low-rank plus diagonal Gaussian ``p`` in the same ``θ`` layout, e.g.
a SWAG posterior fitted on the source task (``lowrank_vi.init_from_swag(...)``), for transfer learning;
its KL is :func:`kl_lowrank`.

Unlike the authors' public code (see the project's METHODS.md §4), the perturbation follows the
data-loss gradient ``g`` (not the score of ``log q``), ``z₂`` has mean 0, and the Fisher matches the
sampler's ``Σ = ½(diag σ² + LLᵀ/(K−1))``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from flatbma.errors import FlatbmaError
from flatbma.params import Objective
from flatbma.posteriors import gaussian_vi
from flatbma.posteriors.gaussian_vi import check_sections, section
from flatbma.posteriors.lowrank_vi import (
    PREFIXES,
    LowRankGaussian,
    LowRankGeometry,
    blocks,
    from_rows,
    geometry,
    rank_of,
    rows,
    theta_of,
)
from flatbma.types import Ascent, GradientTransformation, Params, Posterior


def _whitened_blocks(theta: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(log σ [d], μ [d], U = L/√(2(K−1)) [K, d])`` in sorted name order (the rows of :func:`rows`)."""
    matrix = rows(theta)
    k = matrix.shape[0] - 2
    return matrix[1], matrix[0], (1.0 / math.sqrt(2.0 * (k - 1))) * matrix[2:]


def kl_lowrank(theta_q: Mapping[str, Tensor], prior_theta: Mapping[str, Tensor]) -> Tensor:
    """``KL(q ‖ p)`` between two low-rank plus diagonal Gaussians in ``θ`` layout, in ``O(d(K_q + K_p)²)``.

    ``KL = ½[tr(Σ_p⁻¹Σ_q) + (μ_p − μ_q)ᵀΣ_p⁻¹(μ_p − μ_q) − d + log det Σ_p − log det Σ_q]`` with
    ``Σ = A + UUᵀ``, ``A = diag(σ²/2)``, ``U = L/√(2(K−1))`` for each. Everything is computed in the
    coordinates whitened by ``A_p`` (``Ũ_p = A_p^{-1/2}U_p``, capacitance ``C_p = I + Ũ_pᵀŨ_p``):
    ``Σ_p⁻¹ = A_p^{-1/2}(I − Ũ_pC_p⁻¹Ũ_pᵀ)A_p^{-1/2}`` (Woodbury) and
    ``log det Σ = Σ log aᵢ + log det C`` (matrix determinant lemma). The ranks may differ;
    differentiable in ``theta_q`` (and in ``prior_theta``); evaluated in double precision, returned in
    ``q``'s dtype.

    Args:
        theta_q: ``q``'s ``mean/``, ``log_std/``, ``factor/`` parameters.
        prior_theta: ``p``'s, for the same parameter names and shapes.
    """
    names_q = list(check_sections(theta_q, PREFIXES, "kl_lowrank (q)"))
    mean_p = check_sections(prior_theta, PREFIXES, "kl_lowrank (prior)")
    if set(mean_p) != set(names_q):
        raise FlatbmaError(
            f"the prior covers parameters {sorted(mean_p)[:5]} but q covers {names_q[:5]}; the prior must be "
            "given for exactly the trainable parameters"
        )
    for n in names_q:
        if mean_p[n].shape != theta_q[f"mean/{n}"].shape:
            raise FlatbmaError(
                f"prior mean/{n} has shape {tuple(mean_p[n].shape)} but the parameter has "
                f"{tuple(theta_q[f'mean/{n}'].shape)}"
            )
    out_dtype = theta_q[f"mean/{names_q[0]}"].dtype
    # the trace terms cancel parts of size ~‖Ũ‖² ≫ 1: evaluate in double precision (differentiably)
    ref = theta_q[f"mean/{names_q[0]}"].to(torch.float64)
    q64 = {k: v.to(torch.float64) for k, v in theta_q.items()}
    prior = {k: v.to(device=ref.device, dtype=ref.dtype) for k, v in prior_theta.items()}
    s_q, mu_q, u_q = _whitened_blocks(q64)  # both in sorted name order, as names_q
    s_p, mu_p, u_p = _whitened_blocks(prior)
    d = mu_q.numel()
    inv_sqrt_ap = math.sqrt(2.0) * torch.exp(-s_p)
    up_t = u_p * inv_sqrt_ap  # Ũ_pᵀ, [K_p, d]
    uq_t = u_q * inv_sqrt_ap  # U_q whitened by A_p, [K_q, d]
    delta_t = (mu_p - mu_q) * inv_sqrt_ap
    ratio = torch.exp(2 * (s_q - s_p))  # a_q / a_p
    eye_p = torch.eye(u_p.shape[0], dtype=ref.dtype, device=ref.device)
    chol_p = torch.linalg.cholesky(eye_p + up_t @ up_t.T)

    def c_inv_quad(x: Tensor) -> Tensor:  # tr(Xᵀ C_p⁻¹ X) for X of shape [K_p, m]
        return (torch.linalg.solve_triangular(chol_p, x, upper=False) ** 2).sum()

    trace = ratio.sum() - c_inv_quad(up_t * ratio.sqrt()) + (uq_t**2).sum() - c_inv_quad(up_t @ uq_t.T)
    mahalanobis = (delta_t**2).sum() - c_inv_quad((up_t @ delta_t)[:, None])
    # log det Σ_q via the determinant lemma in q's own whitening
    uq_own = u_q * (math.sqrt(2.0) * torch.exp(-s_q))
    eye_q = torch.eye(u_q.shape[0], dtype=ref.dtype, device=ref.device)
    chol_q = torch.linalg.cholesky(eye_q + uq_own @ uq_own.T)
    logdet_c = 2 * (chol_p.diagonal().log().sum() - chol_q.diagonal().log().sum())
    logdet_ratio = 2 * (s_p - s_q).sum() + logdet_c  # log det Σ_p − log det Σ_q
    return (0.5 * (trace + mahalanobis - d + logdet_ratio)).to(out_dtype)


@dataclass(frozen=True, eq=False)
class LowRankGaussianWithPrior(LowRankGaussian):
    """:class:`~flatbma.posteriors.lowrank_vi.LowRankGaussian` whose prior is a low-rank Gaussian.

    Attributes:
        prior: the prior's ``mean/``, ``log_std/``, ``factor/`` tensors (``prior_std`` is unused).
    """

    prior: Mapping[str, Tensor] = field(default_factory=dict)
    _prior_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

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
        """:func:`kl_lowrank` to the prior."""
        return kl_lowrank(theta, self.prior)

    def _prior_terms(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor, LowRankGeometry]:
        """``(μ_p, A_p^{-1/2}, diag Σ_p⁻¹, geometry of p)`` in double precision on ``device``, computed once."""
        if device not in self._prior_cache:
            prior = {k: v.to(device=device, dtype=torch.float64) for k, v in self.prior.items()}
            geo = geometry(prior, torch.float64, cache=False)
            inv_sqrt_a = geo.cs / geo.c
            self._prior_cache[device] = (rows(prior)[0], inv_sqrt_a, (1 - geo.w) / geo.a, geo)
        return self._prior_cache[device]

    def kl_grad(self, theta: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """``∇_θ KL(q_θ ‖ p)`` in closed form, packed like ``θ``.

        With ``∇_{Σ_q} KL = ½(Σ_p⁻¹ − Σ_q⁻¹)``: ``∇_μ = Σ_p⁻¹(μ_q − μ_p)``,
        ``∇_logσ = a_q ⊙ (diag Σ_p⁻¹ − diag Σ_q⁻¹)`` (``a = σ²/2``) and
        ``∇_L = (Σ_p⁻¹ − Σ_q⁻¹)L/(2(K_q−1))``; ``Σ_p⁻¹x = A_p^{-1/2}(x̃ − Ũ_pC_p⁻¹Ũ_pᵀx̃)``,
        ``x̃ = A_p^{-1/2}x``, with the prior's Woodbury quantities computed once and ``q``'s shared with the
        ascent (:func:`~flatbma.posteriors.lowrank_vi.geometry`). Double precision, as :func:`kl_lowrank`.
        """
        mu, _, factor = blocks(theta)
        geo = geometry(theta, torch.float64)
        mu_p, inv_sqrt_a_p, prior_diag, geo_p = self._prior_terms(mu.device)

        def prior_precision(x: Tensor) -> Tensor:  # Σ_p⁻¹ applied to each row of x [r, d]
            xt = x * inv_sqrt_a_p
            return (xt - (xt @ geo_p.ut.T) @ geo_p.pt) * inv_sqrt_a_p

        out = torch.empty((factor.shape[0] + 2, mu.numel()), dtype=mu.dtype, device=mu.device)
        out[0] = prior_precision((mu.to(torch.float64) - mu_p)[None])[0]
        out[1] = geo.a * prior_diag - (1 - geo.w)  # a_q(Σ_q⁻¹)_ii = 1 − w_i
        out[2:] = geo.c**2 * prior_precision(factor.to(torch.float64)) - geo.pt * geo.cs  # c²Σ_q⁻¹L = P·cA^{-1/2}
        return from_rows(out, theta)


def _posterior(
    objective: Objective,
    optimizer: GradientTransformation,
    ascent: Ascent | None,
    family: LowRankGaussian,
    num_mc_samples: int,
    kl_weight: float,
) -> Posterior:
    """The Gaussian VI posterior with the ascent in θ-space; its ``gaussian`` is ``q_θ`` itself."""
    posterior = gaussian_vi.build(
        objective,
        optimizer,
        ascent,
        family,
        num_mc_samples=num_mc_samples,
        kl_weight=float(kl_weight),
        ascent_space="theta",
    )
    return replace(posterior, gaussian=theta_of)


def _check_rank(rank: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 2:
        raise FlatbmaError(
            f"method.rank must be an integer >= 2 (got {rank!r}): Σ = ½(diag σ² + LLᵀ/(K−1)) needs K ≥ 2"
        )


def build(
    objective: Objective,
    optimizer: GradientTransformation,
    ascent: Ascent | None = None,
    *,
    rank: int = 5,
    num_mc_samples: int = 1,
    init_std: float = 1e-3,
    prior_std: float = 1.0,
    kl_weight: float = 1.0,
) -> Posterior:
    """FP-BMA with the isotropic prior ``N(0, s²I)`` (registered as ``fp-bma`` and ``sa-bma``).

    ``θ ← optimizer(θ, ∇_θ E_z L_B(w(θ + δ*, z)) + κ ∇_θ KL(q_θ ‖ N(0, s²I)) / n)`` with
    ``δ* = ascent.perturb(θ, ∇_θ E_z L_B(w(θ, z)))`` (the same ``z``; ``n = objective.num_data``). With
    ``ascent = FisherBall(...)`` this is FP-BMA; with ``None`` it is plain low-rank VI. ``init``
    accepts the model weights or a ready ``θ`` (e.g. from
    :func:`flatbma.posteriors.lowrank_vi.init_from_swag`); ``sample`` is low-rank VI's sampler and
    needs recomputed BatchNorm statistics (``recompute_bn=True``). Learning rates as for
    :func:`flatbma.posteriors.lowrank_vi.build` (Adam 3e-3 on digits).

    Args:
        objective: model and mini-batch loss.
        optimizer: optimizer of ``θ`` (Adam is the usual choice).
        ascent: the θ-space ascent step (:class:`flatbma.optim.fp_bma.FisherBall`), or ``None``.
        rank: ``K ≥ 2``, the number of factor columns.
        num_mc_samples: Monte-Carlo samples ``M`` per step, shared by both passes.
        init_std: initial marginal standard deviation of every weight.
        prior_std: prior standard deviation ``s``.
        kl_weight: ``κ`` (1 is the ELBO; smaller values temper the KL).
    """
    _check_rank(rank)
    gaussian_vi.check_options(
        num_mc_samples=num_mc_samples, init_std=init_std, prior_std=prior_std, kl_weight=kl_weight
    )
    family = LowRankGaussian(rank=rank, init_std=float(init_std), prior_std=float(prior_std))
    return _posterior(objective, optimizer, ascent, family, num_mc_samples, kl_weight)


def build_with_prior(
    objective: Objective,
    optimizer: GradientTransformation,
    ascent: Ascent | None,
    prior_theta: Mapping[str, Tensor],
    *,
    rank: int = 5,
    num_mc_samples: int = 1,
    init_std: float = 1e-3,
    kl_weight: float = 1.0,
) -> Posterior:
    """FP-BMA with a low-rank plus diagonal Gaussian prior, for Python callers and transfer pipelines.

    As :func:`build`, with ``KL(q_θ ‖ p)`` computed by :func:`kl_lowrank` for the prior
    ``p = N(μ_p, ½(diag σ_p² + L_pL_pᵀ/(K_p−1)))`` given in ``θ`` layout — e.g. a SWAG posterior of the
    source task, ``lowrank_vi.init_from_swag(mean, variance, deviations, like)``, which may also be
    passed to ``init`` to start ``q`` there (``rank`` must then equal its ``K``). The prior is not
    stored in the state: to resume training, build again with the same prior (``sample`` does not
    need it). It is not a registry option, because config options are typed scalars.

    Args:
        objective: model and mini-batch loss.
        optimizer: optimizer of ``θ``.
        ascent: the θ-space ascent step, or ``None``.
        prior_theta: the prior's ``mean/``, ``log_std/``, ``factor/`` tensors for exactly the trainable
            parameters (its rank ``K_p ≥ 2`` may differ from ``rank``).
        rank: ``K ≥ 2`` of ``q``.
        num_mc_samples: Monte-Carlo samples ``M`` per step.
        init_std: initial marginal standard deviation of every weight (when ``init`` gets weights).
        kl_weight: ``κ``.
    """
    _check_rank(rank)
    gaussian_vi.check_options(num_mc_samples=num_mc_samples, init_std=init_std, prior_std=1.0, kl_weight=kl_weight)
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
    family = LowRankGaussianWithPrior(rank=rank, init_std=float(init_std), prior_std=1.0, prior=prior)
    return _posterior(objective, optimizer, ascent, family, num_mc_samples, kl_weight)
