"""Closed-form KL divergences of the low-rank plus diagonal Gaussian, and their closed-form gradients.

``q = N(μ, Σ)`` with ``Σ = A + UUᵀ``, ``A = diag(σ²/2)``, ``U = L/√(2(K−1))``. Two priors: the isotropic
``N(0, s²I)`` (:func:`kl_divergence`, :func:`kl_divergence_grad`) and another Gaussian of the same
family (:func:`kl_lowrank`, :func:`kl_lowrank_grad`), e.g. a SWAG posterior of a source task. All are
``O(d·K²)``: Woodbury's identity for ``Σ⁻¹`` and the matrix determinant lemma for ``log det Σ``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from flatbma.errors import FlatbmaError
from flatbma.gaussian.geometry import LowRankGeometry, diag_and_factor_blocks, geometry
from flatbma.gaussian.layout import PREFIXES, blocks, check_sections, factor_scale, from_rows, rank_of, rows, section


def kl_divergence(theta: Mapping[str, Tensor], prior_std: float) -> Tensor:
    """``KL(N(μ, Σ) ‖ N(0, s² I))`` in ``O(dK²)``.

    ``KL = ½[(tr Σ + ‖μ‖²)/s² − d + d log s² − log det Σ]`` with ``tr Σ = Σ a_i + ‖U‖²_F`` and
    ``log det Σ = Σ log a_i + log det(I_K + Uᵀ A⁻¹ U)`` (matrix determinant lemma).
    """
    mean, log_std = section(theta, "mean"), section(theta, "log_std")
    a, u = diag_and_factor_blocks(theta)
    k = rank_of(theta)
    ref = next(iter(mean.values()))
    capacitance = torch.eye(k, dtype=ref.dtype, device=ref.device)
    trace = sq_mean = logdet_a = torch.zeros((), dtype=ref.dtype, device=ref.device)
    d = 0
    for name, mu in mean.items():
        capacitance = capacitance + (u[name] / a[name]) @ u[name].T
        trace = trace + a[name].sum() + (u[name] ** 2).sum()
        sq_mean = sq_mean + (mu**2).sum()
        logdet_a = logdet_a + (2 * log_std[name] - math.log(2.0)).sum()
        d += mu.numel()
    # The capacitance is symmetric positive definite (≥ I); slogdet's LU is as accurate here as a
    # Cholesky factorization and, on small matrices, far cheaper with multi-threaded LAPACK builds.
    logdet = logdet_a + torch.linalg.slogdet(capacitance)[1]
    s2 = prior_std**2
    return 0.5 * ((trace + sq_mean) / s2 - d + d * math.log(s2) - logdet)


def kl_divergence_grad(theta: Mapping[str, Tensor], prior_std: float) -> Mapping[str, Tensor]:
    """``∇_θ KL(q_θ ‖ N(0, s²I))`` in closed form, packed like ``θ`` (:func:`~flatbma.gaussian.layout.theta_layout`).

    ``∇_μ KL = μ/s²``, ``∇_logσ KL = σ²/(2s²) − σ²⊙diag(Σ⁻¹)/2`` and ``∇_L KL = (L/s² − Σ⁻¹L)/(2(K−1))``
    (``L`` as ``d×K``), with ``diag Σ⁻¹`` and ``Σ⁻¹L`` from the Woodbury quantities of
    :func:`~flatbma.gaussian.geometry.geometry` (shared with the Fisher-ball ascent at the same ``θ``).
    """
    mu, _, factor = blocks(theta)
    geo = geometry(theta, torch.float64)
    s2 = prior_std**2
    out = torch.empty((factor.shape[0] + 2, mu.numel()), dtype=mu.dtype, device=mu.device)
    torch.div(mu, s2, out=out[0])
    # σ²(Σ⁻¹)_ii/2 = 1 − wᵢ;  Σ⁻¹L/(2(K−1)) = c·C⁻¹ŨᵀA^{-1/2} (as rows of the [K, d] layout)
    out[1] = geo.a / s2 - (1 - geo.w)
    # the float64 product rounded once to θ's dtype as it is stored (as `.to` did), no float64 temporary
    scaled = torch.mul(geo.pt, geo.cs, out=torch.empty_like(factor))
    torch.mul(factor, geo.c**2 / s2, out=out[2:]).sub_(scaled)
    return from_rows(out, theta)


def kl_lowrank(theta_q: Mapping[str, Tensor], prior_theta: Mapping[str, Tensor]) -> Tensor:
    """``KL(q ‖ p)`` between two low-rank plus diagonal Gaussians in ``θ`` layout, in ``O(d(K_q + K_p)²)``.

    ``KL = ½[tr(Σ_p⁻¹Σ_q) + (μ_p − μ_q)ᵀΣ_p⁻¹(μ_p − μ_q) − d + log det Σ_p − log det Σ_q]``, computed in the
    coordinates whitened by ``A_p`` (``Ũ_p = A_p^{-1/2}U_p``, capacitance ``C_p = I + Ũ_pᵀŨ_p``):
    ``Σ_p⁻¹ = A_p^{-1/2}(I − Ũ_pC_p⁻¹Ũ_pᵀ)A_p^{-1/2}`` (Woodbury) and ``log det Σ = Σ log aᵢ + log det C``
    (matrix determinant lemma). The ranks may differ; ``prior_theta`` must cover the same parameter names and
    shapes as ``theta_q``. Differentiable in both; evaluated in double precision, returned in ``q``'s dtype.
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
    q64 = rows(theta_q).to(torch.float64)  # both in sorted name order, as names_q
    prior = rows(prior_theta).to(device=q64.device, dtype=torch.float64)
    return kl_rows(q64, prior).to(out_dtype)


def kl_rows(q: Tensor, p: Tensor, p_geometry: LowRankGeometry | None = None) -> Tensor:
    """:func:`kl_lowrank` of two ``[K+2, d]`` matrices ``[μ; log σ; L]`` (:func:`rows`), in ``p``'s dtype, unchecked.

    ``q`` may be in a narrower dtype than ``p`` (float32 rows of a step's ``θ'``): its rows are promoted where first
    used, not copied. With ``r = a_q/a_p`` and everything whitened by ``A_p`` (``Ũ_p``, ``Ũ_q = U_qA_p^{-1/2}``,
    ``C_p = I + Ũ_pᵀŨ_p``), the trace is
    ``tr(Σ_p⁻¹Σ_q) = Σr − tr(C_p⁻¹Ũ_pᵀ diag(r) Ũ_p) + tr(Ũ_qᵀŨ_q) − tr(C_p⁻¹(Ũ_pᵀŨ_q)(Ũ_pᵀŨ_q)ᵀ)`` and
    ``log det C_q = log det(I + Ũ_qᵀ diag(1/r) Ũ_q)`` (``q``'s own whitening): four ``K×K`` Gram matrices over
    three ``[K, d]`` products.

    ``p_geometry``: :func:`~flatbma.gaussian.geometry.geometry` of ``p`` in ``p``'s dtype, when at hand (an ascent
    step's own): it supplies ``Ũ_pᵀ``, ``A_p^{-1/2}`` and the Cholesky factor of ``C_p``, so of ``p`` only rows 0
    and 1 are read.
    """
    dtype = p.dtype
    s_q, mu_q = q[1].to(dtype), q[0].to(dtype)
    s_p, mu_p = p[1], p[0]
    d = mu_q.numel()
    if p_geometry is None:
        inv_sqrt_ap = math.sqrt(2.0) * torch.exp(-s_p)
        up_t = factor_scale(p.shape[0] - 2) * p[2:] * inv_sqrt_ap  # Ũ_pᵀ, [K_p, d]
        eye_p = torch.eye(up_t.shape[0], dtype=dtype, device=p.device)
        chol_p = torch.linalg.cholesky(eye_p + up_t @ up_t.T)
    else:
        inv_sqrt_ap, up_t, chol_p = p_geometry.inv_sqrt_a, p_geometry.ut, p_geometry.chol
    uq_t = q[2:] * (factor_scale(q.shape[0] - 2) * inv_sqrt_ap)  # U_q whitened by A_p, [K_q, d], in p's dtype
    delta_t = (mu_p - mu_q) * inv_sqrt_ap
    ratio = torch.exp(2 * (s_q - s_p))  # a_q / a_p

    def c_inv_trace(gram: Tensor) -> Tensor:  # tr(C_p⁻¹ M) = tr(L⁻¹ M L⁻ᵀ) for a symmetric M of shape [K_p, K_p]
        half = torch.linalg.solve_triangular(chol_p, gram, upper=False)  # L⁻¹M
        return torch.linalg.solve_triangular(chol_p, half.T, upper=False).diagonal().sum()

    def c_inv_quad(x: Tensor) -> Tensor:  # tr(Xᵀ C_p⁻¹ X) for a narrow X of shape [K_p, m]
        return (torch.linalg.solve_triangular(chol_p, x, upper=False) ** 2).sum()

    cross = up_t @ uq_t.T  # Ũ_pᵀŨ_q, [K_p, K_q]
    own = uq_t @ uq_t.T  # Ũ_qᵀŨ_q
    trace = ratio.sum() - c_inv_trace((up_t * ratio) @ up_t.T) + own.diagonal().sum()
    trace = trace - (c_inv_quad(cross) if cross.shape[1] <= cross.shape[0] else c_inv_trace(cross @ cross.T))
    mahalanobis = (delta_t**2).sum() - c_inv_quad((up_t @ delta_t)[:, None])
    # log det Σ_q via the determinant lemma in q's own whitening: Ũ_qᵀŨ_q there is U_q diag(1/a_q) U_qᵀ
    eye_q = torch.eye(uq_t.shape[0], dtype=dtype, device=p.device)
    chol_q = torch.linalg.cholesky(eye_q + (uq_t * ratio.reciprocal()) @ uq_t.T)
    logdet_c = 2 * (chol_p.diagonal().log().sum() - chol_q.diagonal().log().sum())
    logdet_ratio = 2 * (s_p - s_q).sum() + logdet_c  # log det Σ_p − log det Σ_q
    return 0.5 * (trace + mahalanobis - d + logdet_ratio)


class PriorPrecision(NamedTuple):
    """A fixed low-rank plus diagonal prior ``p`` as :func:`kl_lowrank_grad` uses it (double precision).

    Attributes:
        mean: ``μ_p``, shape ``[d]``.
        inv_sqrt_a: ``A_p^{-1/2}``, shape ``[d]``.
        diagonal: ``diag Σ_p⁻¹``, shape ``[d]``.
        geometry: the Woodbury quantities of ``Σ_p``.
    """

    mean: Tensor
    inv_sqrt_a: Tensor
    diagonal: Tensor
    geometry: LowRankGeometry

    def apply(self, x: Tensor) -> Tensor:
        """``Σ_p⁻¹`` applied to each row of ``x`` (``[r, d]``).

        ``Σ_p⁻¹x = A_p^{-1/2}(x̃ − Ũ_pC_p⁻¹Ũ_pᵀx̃)`` with ``x̃ = A_p^{-1/2}x`` (Woodbury).
        """
        xt = x * self.inv_sqrt_a
        return (xt - (xt @ self.geometry.ut.T) @ self.geometry.pt) * self.inv_sqrt_a


def prior_precision(prior_theta: Mapping[str, Tensor], device: torch.device) -> PriorPrecision:
    """:class:`PriorPrecision` of the prior ``prior_theta`` (``θ`` layout) on ``device``, in double precision."""
    prior = {k: v.to(device=device, dtype=torch.float64) for k, v in prior_theta.items()}
    geo = geometry(prior, torch.float64, cache=False)
    inv_sqrt_a = geo.cs / geo.c
    return PriorPrecision(rows(prior)[0], inv_sqrt_a, (1 - geo.w) / geo.a, geo)


def kl_lowrank_grad(
    theta: Mapping[str, Tensor],
    prior_theta: Mapping[str, Tensor],
    precision: PriorPrecision | None = None,
) -> Mapping[str, Tensor]:
    """``∇_θ KL(q_θ ‖ p)`` in closed form for a low-rank plus diagonal prior ``p``, packed like ``θ``.

    With ``∇_{Σ_q} KL = ½(Σ_p⁻¹ − Σ_q⁻¹)``: ``∇_μ = Σ_p⁻¹(μ_q − μ_p)``, ``∇_logσ = a_q ⊙ (diag Σ_p⁻¹ − diag Σ_q⁻¹)``
    (``a = σ²/2``) and ``∇_L = (Σ_p⁻¹ − Σ_q⁻¹)L/(2(K_q−1))``; ``Σ_p⁻¹`` is :meth:`PriorPrecision.apply` and ``q``'s
    Woodbury quantities are shared with the ascent (:func:`~flatbma.gaussian.geometry.geometry`). Double precision, as
    :func:`kl_lowrank`. ``precision``: :func:`prior_precision` of ``prior_theta`` when computed already (a fixed
    prior's, once), used when it is on ``θ``'s device; else (or ``None``) computed here.
    """
    mu, _, factor = blocks(theta)
    geo = geometry(theta, torch.float64)
    prior = precision
    if prior is None or prior.mean.device != mu.device:
        prior = prior_precision(prior_theta, mu.device)
    out = torch.empty((factor.shape[0] + 2, mu.numel()), dtype=mu.dtype, device=mu.device)
    out[0] = prior.apply((mu.to(torch.float64) - prior.mean)[None])[0]
    out[1] = geo.a * prior.diagonal - (1 - geo.w)  # a_q(Σ_q⁻¹)_ii = 1 − w_i
    out[2:] = geo.c**2 * prior.apply(factor.to(torch.float64)) - geo.pt * geo.cs  # c²Σ_q⁻¹L = P·cA^{-1/2}
    return from_rows(out, theta)
