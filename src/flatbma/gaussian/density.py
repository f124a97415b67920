"""The log-density of ``q_θ`` at given weights, its score, and the size of a move of ``θ``.

``log q_θ(w) = −½[(w−μ)ᵀΣ⁻¹(w−μ) + log det Σ + d log 2π]`` in ``O(dK²)``; the score ``∇_θ log q_θ(w)`` is the
direction of the SA-BMA authors' ascent step (:class:`flatbma.optim.FisherBall` with ``direction: score``), and
:func:`step_size` is recorded for every step of FP-BMA's ascent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from flatbma.gaussian.geometry import geometry
from flatbma.gaussian.kl import kl_rows
from flatbma.gaussian.layout import factor_scale, from_rows, names_and_shapes, rows


def _flat_weights(weights: Mapping[str, Tensor], theta: Mapping[str, Tensor]) -> Tensor:
    """``w`` as one ``[d]`` vector in ``θ``'s (sorted) parameter order."""
    names, _ = names_and_shapes(theta)
    return torch.cat([weights[n].reshape(-1) for n in names])


def log_density(theta: Mapping[str, Tensor], weights: Mapping[str, Tensor]) -> Tensor:
    """``log q_θ(w)`` of ``w`` (by parameter name) under ``N(μ, ½(diag σ² + LLᵀ/(K−1)))``, in double precision.

    With ``A = diag(σ²/2)``, ``U = L/√(2(K−1))`` (``[K, d]``), ``r = A^{-1/2}(w − μ)``, ``Ũ = UA^{-1/2}`` and
    ``C = I + ŨŨᵀ``: ``(w−μ)ᵀΣ⁻¹(w−μ) = ‖r‖² − (Ũr)ᵀC⁻¹(Ũr)`` and ``log det Σ = Σᵢ log aᵢ + log det C``.
    Differentiable in ``θ`` (not in ``w``, which is read as a constant).
    """
    matrix = rows(theta).to(torch.float64)
    mu, log_std, factor = matrix[0], matrix[1], matrix[2:]
    w = _flat_weights(weights, theta).detach().to(torch.float64)
    inv_sqrt_a = math.sqrt(2.0) * torch.exp(-log_std)
    r = (w - mu) * inv_sqrt_a
    ut = factor_scale(factor.shape[0]) * factor * inv_sqrt_a
    chol = torch.linalg.cholesky(torch.eye(factor.shape[0], dtype=w.dtype, device=w.device) + ut @ ut.T)
    projected = torch.linalg.solve_triangular(chol, (ut @ r)[:, None], upper=False)
    quad = (r**2).sum() - (projected**2).sum()
    logdet = (2 * log_std - math.log(2.0)).sum() + 2 * chol.diagonal().log().sum()
    return -0.5 * (quad + logdet + w.numel() * math.log(2 * math.pi))


def score(theta: Mapping[str, Tensor], weights: Mapping[str, Tensor]) -> Tensor:
    """``∇_θ log q_θ(w)`` at fixed ``w``, as the ``[K+2, d]`` matrix ``[s_μ; s_logσ; s_L]`` (rows of ``θ``).

    ``s_μ = Σ⁻¹(w − μ)``; the covariance blocks are ``½ tr[(Σ⁻¹(w−μ)(w−μ)ᵀΣ⁻¹ − Σ⁻¹) ∂Σ]`` for each
    parameter, by automatic differentiation of :func:`log_density` (double precision, ``θ``'s device).
    """
    matrix = rows(theta).detach().to(torch.float64).requires_grad_(True)
    leaves = from_rows(matrix, theta)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(log_density(leaves, weights), matrix)
    return grad


def step_size(theta: Mapping[str, Tensor], moved: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """How far ``q`` moved from ``θ`` to ``θ'`` (``moved``), as 0-d float64 tensors.

    ``mean_shift = ‖μ' − μ‖₂`` (the radius of a SAM step that moves the weights as far), ``kl = KL(q_θ' ‖ q_θ)``
    (exact) and ``kl_mean = ½δμᵀΣ⁻¹δμ`` (``δμ = μ' − μ``: the KL of moving the mean alone).
    """
    with torch.no_grad():
        before, after = rows(theta), rows(moved)
        delta = (after[0] - before[0]).to(torch.float64)
        geo = geometry(theta, torch.float64)
        whitened = delta / geo.a.sqrt()
        along = geo.ut @ whitened
        kl_mean = 0.5 * ((whitened**2).sum() - along @ geo.c_inv @ along)
        # kl_lowrank(moved, theta), reading θ's whitened factor and capacitance from the geometry the step has
        kl = kl_rows(after, before[:2].to(torch.float64), geo).to(after.dtype).to(torch.float64)
    return {"mean_shift": torch.linalg.vector_norm(delta), "kl": kl, "kl_mean": kl_mean}
