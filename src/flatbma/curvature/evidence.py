"""The Laplace approximation to the evidence and its maximization over the prior precision.

With the prior ``N(w₀, diag δ⁻¹)`` (``δ_g`` on block ``g``; the mean ``w₀`` is 0 unless given: a
pretrained network's values, the L2-SP prior of Li, Grandvalet & Davoine 2018), the point ``w*`` fixed and
the curvature ``H`` of the summed loss, the Laplace approximation of ``log p(D) = log ∫ p(D|w) p(w) dw`` is
(MacKay 1992; Immer et al. 2021; the ``2π`` terms cancel)

    ``log Z(δ) = −Σ_i ℓ_i(w*) − ½ Σ_g δ_g ‖w*_g − w₀_g‖² + ½ Σ_g d_g log δ_g − ½ log det(H/T + diag δ)``,

exact for a linear-Gaussian model at its posterior mode. ``H`` is block-diagonal, so with ``λ_gj ≥ 0`` the eigenvalues
of block ``g``, ``s_g = ‖w*_g − w₀_g‖²`` and ``t = log δ``, each block contributes ``f_g(t)`` with

    ``f_g'(t) = ½(γ_g(δ) − δ s_g)``,  ``γ_g = Σ_j (λ_gj/T) / (λ_gj/T + δ)``  (MacKay's effective number
    of parameters),  ``f_g''(t) = −½δ s_g − ½Σ_j (λ_gj/T)δ / (λ_gj/T + δ)² < 0``,

so ``f`` is strictly concave in ``t`` and is maximized where ``δ‖w* − w₀‖² = γ`` (MacKay's fixed point). A
``scalar`` prior maximizes ``Σ_g f_g`` over one ``t``; a ``layerwise`` prior each ``f_g`` alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import torch
from torch import Tensor

from flatbma.checks import parse_choice
from flatbma.curvature.options import PriorStructure
from flatbma.curvature.structures import Blocks, Precision, check_temperature
from flatbma.errors import FlatbmaError

__all__ = ["DELTA_RANGE", "effective_parameters", "log_evidence", "optimize_prior"]

DELTA_RANGE = (1e-8, 1e8)
"""The bracket of the prior precision searched by :func:`optimize_prior`."""

F64 = torch.float64
_log = logging.getLogger(__name__)


def _sq_norm(
    blocks: Blocks, mean: Mapping[str, Tensor], block: str, prior_mean: Mapping[str, Tensor] | None = None
) -> float:
    """``‖w*_g − w₀_g‖²`` in float64 (``‖w*_g‖²`` when ``prior_mean`` is ``None``)."""
    names = blocks.params_of(block)
    for what, tensors in (("mean", mean), ("prior mean", prior_mean)):
        missing = [n for n in names if tensors is not None and n not in tensors]
        if missing:
            raise FlatbmaError(f"the {what} has no entry for parameter(s) {missing[:3]} of the curvature")
    if prior_mean is None:
        return float(sum(mean[n].detach().to(F64).square().sum() for n in names))
    return float(sum((mean[n].detach().to(F64) - prior_mean[n].detach().to(F64)).square().sum() for n in names))


def log_evidence(
    blocks: Blocks,
    mean: Mapping[str, Tensor],
    nll: float,
    delta: Precision,
    temperature: float,
    prior_mean: Mapping[str, Tensor] | None = None,
) -> float:
    """``log Z(δ)`` of the module docstring, with ``nll = Σ_i ℓ_i(w*)`` (the summed, not mean, loss).

    ``prior_mean``: ``w₀`` by parameter name, or ``None`` for the zero-mean prior ``N(0, δ⁻¹I)``.
    """
    deltas = blocks.deltas(delta)
    total = -float(nll) - 0.5 * blocks.logdet(deltas, temperature)
    for g in blocks.names:
        total += -0.5 * deltas[g] * _sq_norm(blocks, mean, g, prior_mean) + 0.5 * blocks.dim(g) * math.log(deltas[g])
    return total


def effective_parameters(blocks: Blocks, delta: Precision, temperature: float) -> float:
    """``γ = Σ_g Σ_j (λ_gj/T) / (λ_gj/T + δ_g)``: the directions the data determines (MacKay 1992)."""
    deltas, t = blocks.deltas(delta), check_temperature(temperature)
    return float(sum(_gamma(blocks.eigenvalues(g).to(F64) / t, deltas[g]) for g in blocks.names))


def _gamma(lam: Tensor, delta: float) -> float:
    return float((lam / (lam + delta)).sum())


def optimize_prior(
    blocks: Blocks,
    mean: Mapping[str, Tensor],
    temperature: float,
    structure: PriorStructure | str,
    prior_mean: Mapping[str, Tensor] | None = None,
) -> dict[str, float]:
    """The prior precisions ``δ_g`` maximizing :func:`log_evidence` (one for all blocks, or one per block).

    Bisection on the sign of the decreasing ``f'(t)`` over ``t = log δ ∈ [log 1e−8, log 1e8]``, then a Newton iteration
    safeguarded by the bracket, to ``|f'(t)| ≤ 10⁻¹⁰·d`` (``d`` the dimension of the problem): ``δ‖w* − w₀‖² = γ``, with
    ``w₀ = prior_mean`` (``None``: 0). Where ``f'`` keeps its sign over the bracket (``w*_g = w₀_g``: ``f' > 0``; no
    curvature, ``γ ≡ 0``: ``f' < 0``) the bracket's end is returned (and logged).

    Raises:
        FlatbmaError: ``layerwise`` with a block over several tensors (the full GGN).
    """
    structure = parse_choice(PriorStructure, structure, "prior_structure")
    t = check_temperature(temperature)
    problems = {
        g: (blocks.eigenvalues(g).to(F64) / t, _sq_norm(blocks, mean, g, prior_mean), blocks.dim(g))
        for g in blocks.names
    }
    if structure is PriorStructure.SCALAR:
        lam = torch.cat([p[0] for p in problems.values()])
        value = _solve(lam, sum(p[1] for p in problems.values()), sum(p[2] for p in problems.values()), "all weights")
        return dict.fromkeys(blocks.names, value)
    joint = [g for g in blocks.names if len(blocks.params_of(g)) > 1]
    if joint:
        raise FlatbmaError(
            "prior_structure: layerwise needs a curvature that is block-diagonal over parameter tensors, but "
            "hessian: full couples them all; use prior_structure: scalar, or hessian: kfac or diag"
        )
    return {g: _solve(*problems[g], g) for g in blocks.names}


def _solve(lam: Tensor, sq_norm: float, dim: int, what: str) -> float:
    """``δ`` maximizing ``½ d log δ − ½ δ s − ½ Σ log(λ + δ)``, ``s = sq_norm = ‖w − w₀‖²`` (``λ`` divided by ``T``)."""

    def slope(t: float) -> float:
        d = math.exp(t)
        return 0.5 * (_gamma(lam, d) - d * sq_norm)

    def curvature(t: float) -> float:
        d = math.exp(t)
        return -0.5 * d * sq_norm - 0.5 * float((lam * d / (lam + d).square()).sum())

    lo, hi = (math.log(v) for v in DELTA_RANGE)
    if slope(hi) >= 0:
        _log.info(
            "prior precision of %s: the evidence still rises at δ = %g (‖w − w₀‖ = 0?); using it", what, DELTA_RANGE[1]
        )
        return DELTA_RANGE[1]
    if slope(lo) <= 0:
        _log.info("prior precision of %s: the evidence falls at δ = %g (no curvature?); using it", what, DELTA_RANGE[0])
        return DELTA_RANGE[0]
    tol = 1e-10 * max(dim, 1)
    while hi - lo > 1.0:
        mid = 0.5 * (lo + hi)
        if slope(mid) > 0:
            lo = mid
        else:
            hi = mid
    t = 0.5 * (lo + hi)
    for _ in range(200):
        g = slope(t)
        if abs(g) <= tol:
            break
        if g > 0:
            lo = t
        else:
            hi = t
        step = t - g / curvature(t)
        t = step if lo < step < hi else 0.5 * (lo + hi)
        if hi - lo <= 1e-15 * max(1.0, abs(t)):
            break
    return math.exp(t)
