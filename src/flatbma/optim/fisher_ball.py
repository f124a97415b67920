"""The FP-BMA / SA-BMA ascent step on variational parameters (Lim et al., UAI 2025).

Over 500 lines on purpose: the variational Fisher, its preconditioned CG solve, the rotation projection and the
step are one derivation whose pieces are only correct together.

FP-BMA perturbs the *distribution* ``q_θ`` inside a KL ball, ``max_{δ: KL(q_{θ+δ} ‖ q_θ) ≤ γ} E_{q_{θ+δ}} L_B``
with ``KL(q_{θ+δ} ‖ q_θ) ≈ ½ δᵀF(θ)δ``, whose linearized solution is

    ``δ* = √(2γ) F⁻¹g / √(gᵀF⁻¹g)``,   ``g = ∇_θ E_z L_B(w(θ, z))`` (the reparameterized *data-loss* gradient),

``F(θ)`` the Fisher information of the variational family (not the data Fisher). :class:`FisherBall` computes ``δ*``
for the low-rank plus diagonal Gaussian of :mod:`flatbma.gaussian`,

    ``Σ = ½(diag σ² + LLᵀ/(K−1)) = A + UUᵀ``,  ``A = diag(σ²/2)``,  ``U = L/√(2(K−1))``,  ``θ = (μ, log σ, L)``:

the mean block exactly (``F_μ⁻¹g_μ = Σg_μ``); the covariance block, ``(Fv)_logσ = ½σ²⊙diag(M)`` and
``(Fv)_L = ½ML/(K−1)`` with ``M = Σ⁻¹dΣ[v]Σ⁻¹`` for ``v = (v_logσ, V)``, by preconditioned conjugate gradients on
``O(dK²)`` Fisher products (:func:`whitened_fisher_product`, no ``d×d`` matrix), after projecting ``g_L`` off the
factor's rotations (the block's null space, which a damped inverse would amplify by ``1/λ``), with Tikhonov damping
``λB`` in each block's curvature scale (:func:`damping_scale`), which bounds the step along degenerate factor
directions (``‖δ_L A^{-1/2}‖/√(2(K−1)) ≤ √(2γ/λ)``). ``δ*`` is normalized in the damped metric, so
``½δ*ᵀF_λδ* = γ`` exactly (derivation: docs/methods.md §5).

Metrics (:class:`BallMetric`): ``"fisher"``, ``"euclidean"`` (``F = I``: SAM on ``θ`` with ``ρ = √(2γ)``) and
``"data-fisher"`` (Fisher-SAM's metric on ``θ``). The step acts on ``θ`` (``FisherBall.space`` is ``THETA``), so a
Gaussian VI posterior built with it takes the θ-level step
(:func:`flatbma.posteriors.gaussian_vi.theta_sharpness_value_and_grad`): that composition is FP-BMA.

Precision: never under autocast. The geometry, the ``K×K`` algebra, the mean block and the trust region run in
float64; the conjugate gradients' ``[K, d]`` operands in float32 under ``precision: auto`` when
:func:`float32_error` allows (sums in float64, :func:`gram`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from flatbma.checks import check_int, check_number, parse_choice
from flatbma.errors import FlatbmaError
from flatbma.gaussian import (
    PREFIXES,
    LowRankGeometry,
    blocks,
    check_sections,
    from_rows,
    geometry,
    kl_rows,
    packed_rows,
    rows,
    score,
)
from flatbma.optim.ascent import TINY
from flatbma.optim.fisher_sam import FisherSAM
from flatbma.optim.sam import SAM
from flatbma.options import added
from flatbma.params import detached, scale
from flatbma.types import AscentSpace, Params


class BallMetric(str, Enum):
    """The metric ``F`` of :class:`FisherBall` (strings and members are both accepted)."""

    FISHER = "fisher"
    """The Fisher information of the low-rank plus diagonal Gaussian ``q_θ``."""
    EUCLIDEAN = "euclidean"
    """``F = I``: SAM on ``θ``."""
    DATA_FISHER = "data-fisher"
    """``F = 1 + η g⊙g``: Fisher-SAM on ``θ``."""


class Direction(str, Enum):
    """Where :class:`FisherBall` pushes ``θ`` (strings and members are both accepted)."""

    LOSS = "loss"
    """The paper's step: the maximizer ``F⁻¹g`` of the linearized data loss in the ball."""
    SCORE = "score"
    """As in the authors' code, not the paper: ``ρ·s/‖s‖`` per block with ``s = ∇_θ log q_θ(w)`` at the drawn sample."""


class BallBlocks(str, Enum):
    """Which blocks of ``θ`` the ascent perturbs (strings and members are both accepted)."""

    ALL = "all"
    """The mean, ``log σ`` and the factor."""
    MEAN = "mean"
    """The mean alone (``q``'s covariance is left as it is): the whole budget moves ``μ``."""


class SolvePrecision(str, Enum):
    """The precision of :class:`FisherBall`'s conjugate-gradient solve (strings and members are both accepted)."""

    AUTO = "auto"
    """The ``[K, d]`` operands in float32 when :func:`float32_error` is at most ``cg_tol``, else float64."""
    FLOAT64 = "float64"
    """Every operand in float64."""


# ---------------------------------------------------------------------------------------------------
# the low-rank plus diagonal Gaussian in flat, whitened form
#
# A covariance-block vector v = (v_logσ, V) is stored as one [K+1, d] tensor: row 0 is v_logσ, rows
# 1..K are V (the factor, row k = column k of L). Parameters follow sorted name order. The Woodbury
# quantities (LowRankGeometry, geometry) live with the family in flatbma.gaussian.


def covariance_fisher_product(geo: LowRankGeometry, v: Tensor) -> Tensor:
    """``F_cov v`` for ``v = [v_logσ; V]`` of shape ``[K+1, d]``, in ``O(dK²)``.

    ``F_cov = D_c⁻¹ F̃ D_c⁻¹`` with ``D_c = diag(1 on log σ, 1/(cA^{-1/2}) on L)`` and ``F̃`` the Fisher in
    whitened coordinates (:func:`whitened_fisher_product`): ``F_cov v = D_c⁻¹ F̃ [v_logσ; cVA^{-1/2}]``.
    """
    y = torch.cat([v[:1], v[1:] * geo.cs])
    out = whitened_fisher_product(geo, y, torch.empty_like(y))
    out[1:].mul_(geo.cs)
    return out


def whitened_fisher_product(
    geo: LowRankGeometry, y: Tensor, out: Tensor, *, damping: float = 0.0, diagonal_weight: Tensor | None = None
) -> Tensor:
    """``(F̃ + λI) y`` in the whitened coordinates ``y = [v_logσ; Ṽ]``, ``Ṽ = cVA^{-1/2}``, written into ``out``.

    With ``T = A^{1/2}Σ⁻¹A^{1/2}``, ``D = diag(2v_logσ)`` and ``Q = ṼT``:
    ``M̃ = A^{1/2}MA^{1/2} = T(D + ṼᵀŨᵀ + ŨṼ)T = TDT + QᵀP + PᵀQ`` (``P = ŨᵀT = C⁻¹Ũᵀ``), so
    ``(Fv)_logσ = ½σ²⊙diag(M) = diag(M̃) = D(1 − 2w) + Σ_j P_j ⊙ (GP + 2Q)_j`` with ``G = ŨᵀDŨ`` and
    ``(Fv)_L = ½ML/(K−1) = c(ŨᵀM̃)A^{-1/2}``, ``ŨᵀM̃ = PD + (ŨᵀQᵀ − PDŨ)P + (I − C⁻¹)Q``; the whitened
    product is ``[diag M̃; ŨᵀM̃]``. Two ``K×K`` identities save passes over ``[K, d]`` operands: with
    ``R = ṼŨ`` (``[K, K]``), ``Q = Ṽ − RP`` and ``ŨᵀQᵀ = (I − ŨᵀŨC⁻¹)Rᵀ = C⁻¹Rᵀ`` (``ŨᵀŨ = C − I``), so

    ``(F̃y)_logσ = D(1 − 2w) + Σ_j P_j ⊙ ((G − 2R)P + 2Ṽ)_j``,
    ``(F̃y)_L = PD + (C⁻¹Rᵀ − C⁻¹G − ER)P + EṼ`` (``E = I − C⁻¹``, ``C⁻¹G = PDŨ``),

    and the damping ``λI`` (whitened units of :func:`damping_scale`) is added as ``λv_logσ`` and ``(E + λI)Ṽ``.
    ``diagonal_weight``: ``1 − 2w`` when the caller has it (a solve forms many products at one ``θ``).
    """
    v_s, v_l = y[0], y[1:]
    d2 = 2.0 * v_s
    kk = geo.cap.dtype  # the K×K algebra's dtype (float64), whatever the operands' (float64 or float32)
    r = gram(v_l, geo.ut)  # R = ṼŨ
    pd = torch.mul(geo.pt, d2, out=out[1:])  # P D, then the factor rows accumulate on it
    pdu = gram(pd, geo.ut)  # P D Ũ = C⁻¹G
    if diagonal_weight is None:
        diagonal_weight = 1 - 2 * geo.w
    y_mix = torch.addmm(v_l, (geo.cap @ pdu - 2.0 * r).to(y.dtype), geo.pt, beta=2.0)  # (G − 2R)P + 2Ṽ = GP + 2Q
    torch.linalg.vecdot(geo.pt, y_mix, dim=0, out=out[0])
    out[0].addcmul_(d2, diagonal_weight)
    if damping:
        out[0].add_(v_s, alpha=damping)
    e_damped = geo.e + damping * torch.eye(geo.e.shape[0], dtype=kk, device=geo.e.device) if damping else geo.e
    out[1:].addmm_((geo.c_inv @ r.T - pdu - geo.e @ r).to(y.dtype), geo.pt).addmm_(e_damped.to(y.dtype), v_l)
    return out


GRAM_BLOCK = 256
"""Terms summed in the operands' dtype by :func:`gram` on float32 operands before the float64 sum of the blocks."""


def gram(a: Tensor, b: Tensor) -> Tensor:
    """``a bᵀ`` (``[m, n]`` by ``[k, n]``) as float64: one product, or float32 blocks summed in float64.

    Float32 operands: the sums over ``n`` are split into blocks of :data:`GRAM_BLOCK` terms, each summed in float32,
    and the blocks summed in float64, so each entry's rounding error is at most
    ``(GRAM_BLOCK − 1)·u₃₂·Σ|a||b| + n·u₆₄·Σ|a||b|`` instead of ``(n − 1)·u₃₂·Σ|a||b|`` (Higham, *Accuracy and
    Stability of Numerical Algorithms*, §3.1).
    """
    if a.dtype == torch.float64:
        return a @ b.T
    n = a.shape[1]
    full = n - n % GRAM_BLOCK
    out = (a[:, full:] @ b[:, full:].T).to(torch.float64)
    if full:
        blocks_a = a[:, :full].reshape(a.shape[0], -1, GRAM_BLOCK).transpose(0, 1)  # [n/B, m, B]
        blocks_b = b[:, :full].reshape(b.shape[0], -1, GRAM_BLOCK).permute(1, 2, 0)  # [n/B, B, k]
        out += torch.bmm(blocks_a, blocks_b).sum(0, dtype=torch.float64)
    return out


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """``⟨a, b⟩`` over all entries as a 0-d float64 tensor (:func:`gram`'s accuracy)."""
    a, b = a.reshape(-1), b.reshape(-1)
    if a.dtype == torch.float64:
        return torch.vdot(a, b)
    full = a.numel() - a.numel() % GRAM_BLOCK
    tail = torch.vdot(a[full:], b[full:]).to(torch.float64)
    blocks_ab = torch.linalg.vecdot(a[:full].view(-1, GRAM_BLOCK), b[:full].view(-1, GRAM_BLOCK))
    return tail + blocks_ab.sum(dtype=torch.float64)


def covariance_fisher_diagonal(geo: LowRankGeometry) -> Tensor:
    """Exact diagonal of ``F_cov`` as ``[K+1, d]`` (the conjugate-gradient preconditioner).

    ``F_{logσᵢ,logσᵢ} = 2(1 − wᵢ)²`` and ``F_{L_ki,L_ki} = [(C⁻¹Ũᵀ)²_ki + (1 − wᵢ)(I − C⁻¹)_kk] / (2(K−1)aᵢ)``.
    """
    one_minus_w = 1 - geo.w
    diag_l = (geo.pt**2 + one_minus_w * geo.e.diagonal()[:, None]) * geo.cs**2
    return torch.cat([(2 * one_minus_w**2)[None], diag_l])


def _rotation(factor: Tensor, g_l: Tensor) -> Tensor:
    """The skew ``Ω`` minimizing ``‖g_l − ΩL‖_F`` for ``L = factor`` (``[K, d]``): ``g_l − ΩL`` has no rotation.

    ``ΩG + GΩ = X − Xᵀ`` with ``G = LLᵀ``, ``X = g_l Lᵀ``, solved in the eigenbasis of ``G`` (pairs with
    ``λᵢ + λⱼ = 0``, i.e. columns of a rank-deficient ``L``, are left alone).
    """
    gram = factor @ factor.T
    lam, q = torch.linalg.eigh(gram)
    x = g_l @ factor.T
    rhs = q.T @ (x - x.T) @ q
    denom = lam[:, None] + lam[None, :]
    keep = denom > denom.abs().max() * torch.finfo(denom.dtype).eps * 8
    return q @ torch.where(keep, rhs / torch.where(keep, denom, torch.ones_like(denom)), 0.0) @ q.T


class _Preconditioner(NamedTuple):
    """Jacobi plus an exact coarse correction on the factor directions ``{SL : S symmetric}`` (whitened)."""

    jacobi: Tensor  # [K+1, d]: 1 / (diag F̃ + λ)
    basis: Tensor  # [m, K, K]: a basis of the symmetric K×K matrices, m = K(K+1)/2
    coarse_inv: Tensor  # [m, m]: pseudo-inverse of the Galerkin matrix ZᵀF̃_λZ (Z spanned by S·Ũᵀ)
    factor: Tensor  # Ũᵀ, [K, d]

    def __call__(self, r: Tensor, out: Tensor | None = None) -> Tensor:
        z = torch.mul(self.jacobi, r, out=out) if out is not None else self.jacobi * r
        coeff = torch.einsum("mij,ij->m", self.basis, gram(r[1:], self.factor))  # Zᵀr
        sol = self.coarse_inv @ coeff
        z[1:].addmm_(torch.einsum("m,mij->ij", sol, self.basis).to(z.dtype), self.factor)  # Z (ZᵀF̃_λZ)⁻¹ Zᵀr
        return z


def damping_scale(geo: LowRankGeometry) -> Tensor:
    """``B = diag(1 on log σ, 1/(2(K−1)aᵢ) on L)`` as ``[K+1, d]``: the units of the damping ``λB``."""
    return torch.cat([torch.ones_like(geo.cs)[None], (geo.cs**2).expand(geo.u.shape[0], -1)])


@functools.cache
def _symmetric_basis(k: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[K(K+1)/2, K, K]``: the matrices ``e_ie_jᵀ + e_je_iᵀ`` (``i ≤ j``), a basis of the symmetric ``K×K``."""
    rows, cols = torch.triu_indices(k, k)
    basis = torch.zeros(rows.numel(), k, k, dtype=dtype, device=device)
    index = torch.arange(rows.numel())
    basis[index, rows, cols] = 1.0
    basis[index, cols, rows] = 1.0
    return basis


def _preconditioner(geo: LowRankGeometry, damping: float) -> _Preconditioner:
    """Two-level additive preconditioner ``J⁻¹ + Z(ZᵀF̃_λZ)⁻¹Zᵀ`` of ``F̃_λ = F̃ + λI`` in whitened coordinates.

    ``F̃ = D_cF_covD_c`` is the Fisher in the coordinates of :func:`whitened_fisher_product` and ``λI = D_cλBD_c``
    its damping, so conjugate gradients take the same steps in either coordinates. ``J`` is the exact diagonal
    (:func:`covariance_fisher_diagonal`) plus the damping. It misses the factor directions ``V = SL`` (``S``
    symmetric), whose curvature is ``~1/d`` of the rest; with ``Z`` spanning them (``m = K(K+1)/2`` columns, ``SŨᵀ``
    in whitened coordinates) the Galerkin matrix is closed-form, ``⟨S'L, F_cov SL⟩ = 2 tr(S'ESE)``
    (``E = I − C⁻¹``) and ``⟨S'L, λB SL⟩ = λ tr(S'S(C − I))``, so the coarse solve costs ``O(dK²)``.
    """
    k = geo.u.shape[0]
    basis = _symmetric_basis(k, geo.u.dtype, geo.u.device)
    eye_k = torch.eye(k, dtype=geo.u.dtype, device=geo.u.device)
    ebe = geo.e @ basis @ geo.e
    galerkin = 2 * torch.einsum("mij,nji->mn", basis, ebe)
    galerkin = galerkin + damping * torch.einsum("mij,njk,ki->mn", basis, basis, geo.cap - eye_k)
    # pseudo-inverse: the matrix is ~‖L‖² and exactly 0 for L = 0 (then there is no coarse correction)
    lam, q = torch.linalg.eigh(galerkin)
    keep = lam > lam.abs().max() * torch.finfo(lam.dtype).eps * 64
    coarse_inv = (q * torch.where(keep, 1 / torch.where(keep, lam, 1.0), 0.0)) @ q.T
    # 1 / (diag F̃ + λ), fused: rows 1.. are P² + (1 − w)E_kk + λ (see covariance_fisher_diagonal)
    one_minus_w = (1 - geo.w).to(geo.pt.dtype)  # the operands' dtype: all terms are positive
    jacobi = torch.empty((k + 1, geo.w.numel()), dtype=geo.pt.dtype, device=geo.w.device)
    torch.mul(one_minus_w.square(), 2.0, out=jacobi[0]).add_(damping)
    torch.square(geo.pt, out=jacobi[1:])
    jacobi[1:].addcmul_(geo.e.diagonal()[:, None].to(jacobi.dtype), one_minus_w[None]).add_(damping)
    return _Preconditioner(jacobi.reciprocal_(), basis, coarse_inv, geo.ut)


FLOAT32_ERROR_CONSTANT = 4.0
"""``c`` of :func:`float32_error`: four times the largest ``‖f̂ − F̃_λy‖/(u₃₂(1 + a)²‖y‖)`` measured against
float64 (``tests/optim/test_fisher_ball_precision.py``)."""


def float32_error(geo: LowRankGeometry, damping: float) -> float:
    """``δ = c·u₃₂·(1 + a)²/λ``: the relative perturbation of the damped whitened Fisher by a float32 solve.

    A float32 :func:`whitened_fisher_product` returns ``f̂ = F̃_λy + e``. Its ``[K, d]`` terms are products of
    factors of norm at most 1 (``T``, ``P = C⁻¹Ũᵀ`` with ``‖P‖₂ = max_k s_k/(1 + s_k²)``, ``E``, ``ŨC⁻¹Ũᵀ``;
    ``s_k²`` the eigenvalues of ``C − I``) except ``RP`` and ``PᵀGP``, which a relative rounding ``η ~ u₃₂`` moves
    by at most ``η‖y‖a`` and ``η‖D‖a²`` with ``a = ‖Ũ‖_F‖P‖₂``; so ``‖e‖_F ≤ c·u₃₂(1 + a)²‖y‖_F`` to first order.
    Since ``F̃_λ ⪰ λI``, this moves the solution by at most ``δ/(1 − δ)`` relative: the float32 solve is used only
    while ``δ ≤ cg_tol``, the truncation error the solve accepts anyway. ``a`` is large when the factor's singular
    values spread (``‖Ũ‖_F ≫ s_min ≫ 1``, where ``T = I − ŨC⁻¹Ũᵀ`` cancels), ``≈ √K`` when alike. ``λ = 0``: ``inf``.
    """
    if damping <= 0:
        return math.inf
    s2 = torch.linalg.eigvalsh(geo.cap).sub_(1.0).clamp_min_(0.0)  # s_k² of Ũ, from the K×K capacitance
    a = float(s2.sum().sqrt() * (s2.sqrt() / (1 + s2)).max())
    return FLOAT32_ERROR_CONSTANT * torch.finfo(torch.float32).eps / 2 * (1 + a) ** 2 / damping


class CGResult(NamedTuple):
    """The outcome of :func:`solve_covariance_fisher`."""

    x: Tensor
    """The approximate solution ``[K+1, d]``."""
    iterations: int
    """Conjugate-gradient iterations run (Fisher products formed)."""
    residual: float
    """``√(rᵀMr / gᵀMg)``: the preconditioned residual relative to the right-hand side's, at the last
    residual computed (not at all after an iteration cap hit: then the value of the step before)."""


def solve_covariance_fisher(
    geo: LowRankGeometry,
    g: Tensor,
    *,
    damping: float,
    cg_iters: int,
    cg_tol: float = 0.0,
    dtype: torch.dtype | None = None,
) -> CGResult:
    """``(F_cov + λB)⁻¹g`` (``g`` of shape ``[K+1, d]``) by preconditioned conjugate gradients from 0.

    ``B`` is :func:`damping_scale`; the preconditioner ``M`` is :func:`_preconditioner`. The iteration stops at the
    first iterate whose relative preconditioned residual ``√(rᵀMr / gᵀMg)`` is at most ``cg_tol`` (one host
    synchronization per iteration), after ``cg_iters`` iterations, or at zero curvature. Every iterate satisfies
    ``xᵀ(F_cov + λB)x = gᵀx``, so the damped quadratic form is ``gᵀx`` at any stopping point. ``dtype``: of the
    ``[K, d]`` operands (default ``g``'s).
    """
    if cg_iters < 1:
        raise ValueError(f"cg_iters must be >= 1, got {cg_iters}")
    # in whitened coordinates y = D_c⁻¹x (y_L = cA^{-1/2}x_L): the system D_cF_λD_c y = D_c g, whose damping
    # is λI and whose products need no rescaling (whitened_fisher_product); the preconditioner is D_c⁻¹MD_c⁻¹,
    # so every scalar of the iteration (α, β, residuals) is the one of the iteration in x
    work = g.dtype if dtype is None else dtype
    cs = geo.cs
    if work != geo.ut.dtype:  # the [K, d] operands in the working dtype, the K×K algebra as it is
        geo = geo._replace(ut=geo.ut.to(work), pt=geo.pt.to(work))
    precondition = _preconditioner(geo, damping)
    diagonal_weight = (1 - 2 * geo.w).to(work)  # the products' log σ weight, formed once for the solve
    r = torch.empty(g.shape, dtype=work, device=g.device)  # D_c g; never updated in place
    r[0] = g[0]
    if work == g.dtype:
        torch.div(g[1:], cs, out=r[1:])
    else:  # cast, then divide in the working dtype (a mixed-dtype division is a slow, unvectorized pass)
        r[1:].copy_(g[1:]).div_(cs.to(work))
    p = z = precondition(r)
    rz0 = float(_dot(r, z))
    rz = torch.tensor(rz0, dtype=torch.float64, device=g.device)
    stop = max(cg_tol, torch.finfo(work).eps) ** 2 * rz0
    y = torch.zeros_like(r)
    f = torch.empty_like(r)  # work buffers: one allocation each per solve, not per iteration
    residual = torch.empty_like(r)
    relative = 1.0
    iterations = cg_iters
    for i in range(cg_iters):
        whitened_fisher_product(geo, p, f, damping=damping, diagonal_weight=diagonal_weight)
        curvature = _dot(p, f)
        if not float(curvature) > 0:  # p = 0 (g = 0) or numerically exhausted
            iterations = i
            break
        alpha = rz / curvature
        y.add_(p, alpha=float(alpha))
        if i == cg_iters - 1:
            break
        r = torch.add(r, f, alpha=-float(alpha), out=residual)
        z = precondition(r, out=None if z is p else z)  # the first z is p, still needed below
        rz_new = _dot(r, z)
        relative = math.sqrt(max(float(rz_new), 0.0) / rz0)
        if float(rz_new) <= stop:
            iterations = i + 1
            break
        p = torch.add(z, p, alpha=float(rz_new / rz), out=p)
        rz = rz_new
    x = torch.empty(g.shape, dtype=g.dtype, device=g.device)  # x = D_c y
    x[0] = y[0]
    if work == g.dtype:
        torch.div(y[1:], cs, out=x[1:])
    else:
        x[1:].copy_(y[1:]).div_(cs)
    return CGResult(x, iterations, relative)


def natural_gradient(
    theta: Mapping[str, Tensor],
    grads: Mapping[str, Tensor],
    *,
    damping: float,
    cg_iters: int,
    cg_tol: float = 0.0,
    project: bool = True,
    precision: SolvePrecision | str = "float64",
) -> tuple[Mapping[str, Tensor], Tensor]:
    """``x = F_λ⁻¹g`` for the low-rank plus diagonal Gaussian and the quadratic form ``gᵀx``.

    ``F_λ`` is the variational Fisher with Tikhonov damping ``λB`` on the covariance block. With ``project`` the
    rotation directions ``N`` of ``L`` are removed from ``g`` first; then ``NᵀF_λx = λNᵀBx = 0``, so ``x`` has no
    component along the rotations in the damping metric (the minimum-norm solution, not the ``1/λ``-amplified one).

    Args:
        theta: ``mean/``, ``log_std/``, ``factor/`` variational parameters.
        grads: a gradient with the keys of ``theta``.
        damping: ``λ ≥ 0`` (in the units :func:`damping_scale`).
        cg_iters: the most conjugate-gradient iterations for the covariance block.
        cg_tol: stop earlier at this relative preconditioned residual (:func:`solve_covariance_fisher`).
        project: project the null space of ``F_cov`` (rotations of ``L``) out of ``g``.
        precision: a :class:`SolvePrecision`: ``"float64"``, or ``"auto"``: the solve's ``[K, d]`` operands in float32
            when :func:`float32_error` is at most ``cg_tol`` (> 0).

    Returns:
        ``(x by key of θ, gᵀx)``; ``x`` in ``θ``'s dtype.
    """
    precision = parse_choice(SolvePrecision, precision, "precision")
    matrix = packed_rows(theta)
    if matrix is None:  # a packed θ has the layout by construction
        check_sections(theta, PREFIXES, "fp-bma")
    out_dtype = (matrix if matrix is not None else next(iter(theta.values()))).dtype
    # The geometry (Ũ, C⁻¹ and the rest) in double precision; the solve's [K, d] operands in single precision
    # where float32_error bounds the perturbation of the solve by cg_tol (see the module docstring).
    geo = geometry(theta, torch.float64)
    single = precision is SolvePrecision.AUTO and cg_tol > 0 and float32_error(geo, damping) <= cg_tol
    g = rows(grads).to(geo.a.dtype, copy=True)  # [g_μ; g_cov] with g_cov = [g_logσ; g_L]
    g_mu, g_cov = g[0], g[1:]
    x_mu = torch.addcmul((geo.u @ g_mu) @ geo.u, geo.a, g_mu)  # Σ g_μ
    if project:  # in place; U = cL spans the same rotations as L
        g_cov[1:].addmm_(_rotation(geo.u, g_cov[1:]), geo.u, alpha=-1.0)
    work = torch.float32 if single else None
    x_cov = solve_covariance_fisher(geo, g_cov, damping=damping, cg_iters=cg_iters, cg_tol=cg_tol, dtype=work).x
    quad = torch.vdot(g_mu, x_mu) + torch.vdot(g_cov.reshape(-1), x_cov.reshape(-1))
    out = torch.empty(g.shape, dtype=out_dtype, device=g.device)
    out[0], out[1:] = x_mu, x_cov
    return from_rows(out, theta), quad


# ---------------------------------------------------------------------------------------------------
# the ascent step


_TRUST_REGION_BISECTIONS = 12
_QUADRATIC_REGIME = 0.1
"""Largest change of any ``log σ`` (and relative change of the factor) for which the KL of a step is
within ~10% of its quadratic model, so the exact check is skipped (the mean block is exactly quadratic)."""


def _leaves_quadratic_regime(theta: Mapping[str, Tensor], x: Mapping[str, Tensor], scale: float) -> bool:
    """Whether the step ``scale·x`` moves some ``log σ`` or the factor by more than :data:`_QUADRATIC_REGIME`.

    Only the covariance parameters make the Gaussian KL non-quadratic (exponentially so in ``log σ``).
    """
    _, x_log_std, x_factor = blocks(x)
    log_std_step = float(x_log_std.abs().max())
    factor_step = float(torch.linalg.vector_norm(x_factor))
    factor = float(torch.linalg.vector_norm(blocks(theta)[2]))
    return scale * log_std_step > _QUADRATIC_REGIME or scale * factor_step > _QUADRATIC_REGIME * factor


DEFAULT_RADIUS = 0.05
"""The default ascent step of :class:`FisherBall`, in the weights' units: SAM's default ``ρ`` (Foret et al.,
ICLR 2021), so FP-BMA and SAM move the weights equally far per step whatever ``q``'s width (docs/methods.md §5.1)."""


@dataclass(frozen=True)
class FisherBall:
    """FP-BMA's ascent step on ``θ``: the maximizer of the linearized loss in a KL ball of radius ``γ``.

    ``δ* = √(2γ) F⁻¹g / √(gᵀF⁻¹g)`` (Lim et al., UAI 2025, the SA-BMA step), so ``½δ*ᵀFδ* = γ`` and, for small
    ``γ``, ``KL(q_{θ+δ*} ‖ q_θ) ≈ γ``. ``g`` must be the reparameterized data-loss gradient
    ``∇_θ E_z L_B(w(θ, z))`` (see :func:`flatbma.posteriors.gaussian_vi.theta_sharpness_value_and_grad`).

    **The scale of γ.** The step moves ``μ`` by at most ``√(2γ)·σ̄`` (``σ̄`` a marginal std of ``q`` along the move),
    so ``γ`` means less as ``q`` narrows (docs/methods.md §5.1); ``radius`` states the step in the weights' units.
    The posterior records every step's size (:func:`flatbma.gaussian.step_size`).

    Attributes:
        space: :attr:`AscentSpace.THETA <flatbma.types.AscentSpace.THETA>`: the step perturbs ``θ``.
        gamma: ``γ``, radius of the KL ball (nats). When neither ``gamma`` nor ``radius`` is given the step is SAM's
            default ``ρ = 0.05`` in the weights' units (:data:`DEFAULT_RADIUS`): ``radius = 0.05`` for ``"fisher"``,
            ``γ = ρ²/2`` for the other metrics (their ball has the radius ``√(2γ)``).
        metric: a :class:`BallMetric` (its name is accepted and stored as the member); ``"fisher"`` needs the
            ``mean/``, ``log_std/``, ``factor/`` layout.
        cg_iters: the most conjugate-gradient iterations for the covariance block (``"fisher"`` only).
        cg_tol: stop the conjugate gradients earlier, at this preconditioned residual relative to the right-hand
            side's (0: always ``cg_iters``); ``½δ*ᵀF_λδ* = γ`` holds exactly at any stopping point.
        damping: Tikhonov damping ``λ ≥ 0`` of the covariance block, relative to its curvature scale
            (``"fisher"`` only).
        eta: ``η`` of the ``"data-fisher"`` metric.
        max_kl_ratio: trust region on the exact divergence (``"fisher"`` only): when ``KL(q_{θ+δ*} ‖ q_θ)`` exceeds
            ``max_kl_ratio · γ``, ``δ*`` is scaled by the largest ``t ∈ [0, 1]`` (bisection to 2⁻¹²) that keeps it
            within; checked only for steps that move some ``log σ`` by more than 0.1 or the factor by more than 10%;
            ``inf`` turns it off.
        radius: the step in the weights' units (``"fisher"`` only; not with ``gamma``). With ``direction: loss``,
            ``γ`` is chosen at every step so that ``‖δμ‖₂ = radius`` (the trust region then bounds the exact KL by
            ``max_kl_ratio`` times that step's ``½δᵀF_λδ``); with ``direction: score``, every block's step norm.
        direction: a :class:`Direction`. ``"loss"`` (the paper): ``F⁻¹g`` above. ``"score"`` (the authors' code,
            not the paper; docs/methods.md §5.2): ``δ_b = radius·s_b/‖s_b‖`` per block ``b`` of ``θ``, with
            ``s = ∇_θ log q_θ(w)`` at the drawn sample; needs ``radius`` and the sample (:meth:`perturb_sample`).
        blocks: a :class:`BallBlocks`. ``"all"``; ``"mean"``: only ``μ`` is perturbed, ``δμ = t·Σg_μ`` with ``t``
            from ``½δμᵀΣ⁻¹δμ = γ`` (exact) or from ``radius``.
        precision: a :class:`SolvePrecision` (``"fisher"`` only): ``"auto"`` runs the solve on float32 ``[K, d]``
            operands when :func:`float32_error` is at most ``cg_tol``; ``"float64"`` always in float64.
    """

    space: ClassVar[AscentSpace] = AscentSpace.THETA
    NOTES: ClassVar[str] = """
The scale of gamma: a mean shift d costs KL = ½ dᵀΣ⁻¹d, so the ascent moves μ by at most sqrt(2·gamma)·σ
(σ: q's marginal std along the move; the low-rank part of Σ makes some directions far wider than its
diagonal floor). Measured on the transfer demo's SWAG prior, gamma = 1 moved μ by 0.04-0.07 per step, about
SAM's ρ = 0.05 (docs/methods.md §5.1). The same gamma means less as q narrows, more as it widens. Give the
step in the weights' units instead with radius: ‖δμ‖₂ = radius at every step (not with gamma). Default
(neither given): radius 0.05, SAM's default ρ. blocks: mean spends the whole budget on μ (a large joint gamma
goes to σ and the factor, where it is cheapest). direction: score is the authors' code, not the paper: every
block of θ moved by radius along the drawn sample's score ∇θ log q(w). Every step records ascent/mean_shift
(‖δμ‖₂), ascent/kl (the exact KL of the step) and ascent/kl_mean in log.csv and metrics.json.
docs/methods.md §5.1-5.2.
"""

    gamma: float | None = None
    metric: BallMetric = BallMetric.FISHER
    cg_iters: int = 20
    cg_tol: float = 1e-3
    damping: float = 1e-2
    eta: float = 1.0
    max_kl_ratio: float = 2.0
    radius: float | None = added(None)
    direction: Direction = added(Direction.LOSS)
    blocks: BallBlocks = added(BallBlocks.ALL)
    precision: SolvePrecision = added(SolvePrecision.AUTO)

    def __post_init__(self) -> None:
        inf = float("inf")
        object.__setattr__(self, "precision", parse_choice(SolvePrecision, self.precision, "precision"))
        object.__setattr__(self, "metric", _parse_metric(self.metric))
        object.__setattr__(self, "direction", parse_choice(Direction, self.direction, "direction"))
        object.__setattr__(self, "blocks", parse_choice(BallBlocks, self.blocks, "blocks"))
        if self.radius is not None:
            check_number(
                self.radius,
                f"radius must be a positive number (the step's Euclidean length in the weights' units), "
                f"got {self.radius!r}",
                low=0,
                low_open=True,
                high=inf,
                high_open=True,
            )
            if self.gamma is not None:
                raise FlatbmaError(
                    f"give gamma (a KL radius in nats) or radius (a Euclidean one in the weights' units), not both: "
                    f"got gamma={self.gamma!r} and radius={self.radius!r}"
                )
            if self.metric is not BallMetric.FISHER:
                raise FlatbmaError(
                    f"radius applies to metric: fisher; with metric: {self.metric.value} the step already has the "
                    f"Euclidean radius sqrt(2·gamma): give gamma"
                )
        elif self.direction is Direction.SCORE:
            raise FlatbmaError(
                "direction: score (the authors' step) moves every block of θ by a Euclidean radius: give radius "
                "(e.g. 0.1, their best CIFAR-10 setting), not gamma"
            )
        elif self.gamma is None and self.metric is BallMetric.FISHER:
            object.__setattr__(self, "radius", DEFAULT_RADIUS)
        elif self.gamma is None:
            object.__setattr__(self, "gamma", 0.5 * DEFAULT_RADIUS**2)
        if self.gamma is not None:
            check_number(
                self.gamma,
                f"gamma must be a positive number (the KL radius of FP-BMA), got {self.gamma!r}",
                low=0,
                low_open=True,
                high=inf,
                high_open=True,
            )
        if self.blocks is BallBlocks.MEAN and self.metric is not BallMetric.FISHER:
            raise FlatbmaError(f"blocks: mean applies to metric: fisher, not {self.metric.value}")
        message = f"cg_iters must be an integer >= 1 (conjugate-gradient steps), got {self.cg_iters!r}"
        check_int(self.cg_iters, message, minimum=1)
        check_number(
            self.cg_tol,
            f"cg_tol must be a number in [0, 1) (relative residual at which CG stops), got {self.cg_tol!r}",
            low=0,
            high=1,
            high_open=True,
        )
        check_number(
            self.damping,
            f"damping must be a number >= 0 (Tikhonov damping of the Fisher), got {self.damping!r}",
            low=0,
            high=inf,
            high_open=True,
        )
        check_number(
            self.eta,
            f"eta must be a number >= 0 (data-Fisher weight in F = 1 + eta g²), got {self.eta!r}",
            low=0,
            high=inf,
            high_open=True,
        )
        check_number(
            self.max_kl_ratio,
            f"max_kl_ratio must be a number >= 1 (or .inf: the exact KL of the step may reach max_kl_ratio·gamma), "
            f"got {self.max_kl_ratio!r}",
            low=1,
        )

    @property
    def rho(self) -> float:
        """``√(2γ)``, the radius of the ball in the chosen metric (``radius`` when ``γ`` is set per step)."""
        return math.sqrt(2.0 * self.gamma) if self.gamma is not None else float(self.radius)

    @property
    def needs_sample(self) -> bool:
        """Whether the step is taken from the drawn sample (``direction: score``: :meth:`perturb_sample`)."""
        return self.direction is Direction.SCORE

    @torch.no_grad()
    def perturb(self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """Return ``δ* = t·F⁻¹g``, ``t = √(2γ)/√(gᵀF⁻¹g)`` (or from ``radius``), for every key of ``grads``."""
        if self.needs_sample:
            raise FlatbmaError(
                "direction: score perturbs θ along the score of the drawn sample, not the loss gradient: the "
                "posterior calls perturb_sample(θ, w)"
            )
        if self.metric is BallMetric.EUCLIDEAN:
            return SAM(rho=self.rho).perturb(params, grads)
        if self.metric is BallMetric.DATA_FISHER:
            return FisherSAM(rho=self.rho, eta=self.eta).perturb(params, grads)
        theta = detached(params)
        if self.blocks is BallBlocks.MEAN:
            return self._mean_step(theta, grads)
        x, quad = natural_gradient(
            theta, grads, damping=self.damping, cg_iters=self.cg_iters, cg_tol=self.cg_tol, precision=self.precision
        )
        quad = float(quad.clamp_min(0))
        if self.radius is None:
            length = float(self.rho / (math.sqrt(quad) + TINY))
        else:
            length = float(self.radius / (float(torch.linalg.vector_norm(blocks(x)[0])) + TINY))
        gamma = self.gamma if self.radius is None else 0.5 * length**2 * quad  # the step's γ = ½δᵀF_λδ
        if math.isfinite(self.max_kl_ratio) and _leaves_quadratic_regime(theta, x, length):
            length *= self._trust_region(theta, x, length, gamma)
        return scale(x, length)

    def _mean_step(self, theta: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """``blocks: mean``: ``δμ = t·Σg_μ`` with ``½δμᵀΣ⁻¹δμ = γ`` (or ``‖δμ‖₂ = radius``); no covariance move."""
        geo = geometry(theta, torch.float64)
        g_mu = rows(grads)[0].to(geo.a.dtype)
        x_mu = torch.addcmul((geo.u @ g_mu) @ geo.u, geo.a, g_mu)  # Σ g_μ
        if self.radius is None:
            length = self.rho / (math.sqrt(max(float(torch.vdot(g_mu, x_mu)), 0.0)) + TINY)
        else:
            length = self.radius / (float(torch.linalg.vector_norm(x_mu)) + TINY)
        matrix = rows(theta)
        out = torch.zeros(matrix.shape, dtype=matrix.dtype, device=matrix.device)
        out[0] = length * x_mu
        return from_rows(out, theta)

    @torch.no_grad()
    def perturb_sample(self, params: Mapping[str, Tensor], weights: Mapping[str, Tensor]) -> Params:
        """``direction: score``: ``δ_b = radius·s_b/‖s_b‖`` per block ``b``, ``s = ∇_θ log q_θ(w)`` at the sample ``w``.

        The blocks are the mean, ``log σ`` and the factor, each one vector over all trained weights; with
        ``blocks: mean`` only the mean moves. Needs no loss gradient, so it can be formed before any forward pass.
        """
        theta = detached(params)
        s = score(theta, weights)
        matrix = rows(theta)
        out = torch.zeros(matrix.shape, dtype=matrix.dtype, device=matrix.device)
        parts = [(0, 1)] if self.blocks is BallBlocks.MEAN else [(0, 1), (1, 2), (2, matrix.shape[0])]
        for start, stop in parts:
            block = s[start:stop]
            out[start:stop] = (self.radius / (float(torch.linalg.vector_norm(block)) + TINY)) * block
        return dict(from_rows(out, theta))

    def _trust_region(self, theta: Mapping[str, Tensor], x: Mapping[str, Tensor], scale: float, gamma: float) -> float:
        """The factor ``t ≤ 1`` with ``KL(q_{θ+t·scale·x} ‖ q_θ) ≤ max_kl_ratio·γ`` (see ``max_kl_ratio``)."""
        bound = self.max_kl_ratio * gamma
        matrix, step = rows(theta), rows(x)  # x covers every key of θ (natural_gradient)
        before = matrix[:2].to(torch.float64)
        own = geometry(theta, torch.float64)  # cached: the step's own

        def within(t: float) -> bool:
            # kl_lowrank(θ + t·scale·x, θ) on the packed rows: the same numbers, no per-tensor loop
            moved = (matrix + (t * scale) * step).to(torch.float64)
            kl = float(kl_rows(moved, before, own).to(matrix.dtype))
            return math.isfinite(kl) and kl <= bound

        if within(1.0):
            return 1.0
        lo, hi = 0.0, 1.0  # bisection: KL grows along the ray (exponentially in log σ, so no t² model)
        for _ in range(_TRUST_REGION_BISECTIONS):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if within(mid) else (lo, mid)
        return lo


def _parse_metric(value: object) -> BallMetric:
    """The :class:`BallMetric` named by ``value`` (a member or its name), else a :class:`FlatbmaError`."""
    return parse_choice(BallMetric, value, "metric")
