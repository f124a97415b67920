"""The covariance ``Σ = A + UUᵀ`` in whitened (Woodbury) form, and dense ``Σ`` for tests.

With ``A = diag(σ²/2)`` and ``U = L/√(2(K−1))`` (stored ``[K, d]``), the coordinates whitened by ``A``
(``Ũ = A^{-1/2}U``, capacitance ``C = I + ŨᵀŨ``) give ``Σ⁻¹ = A^{-1/2}(I − ŨC⁻¹Ũᵀ)A^{-1/2}`` and
``log det Σ = Σ log aᵢ + log det C`` in ``O(dK²)``; the closed-form KL gradients and the Fisher-ball
ascent (:mod:`flatbma.optim.fisher_ball`) share these quantities.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from flatbma.gaussian.layout import blocks, factor_scale, from_rows, rank_of, rows, section
from flatbma.packed import Packed


class LowRankGeometry(NamedTuple):
    """``Σ = A + UᵀU`` (``U`` stored ``[K, d]``) and the Woodbury quantities of its Fisher.

    Attributes:
        a: ``diag A = σ²/2``, shape ``[d]``.
        u: ``U = L/√(2(K−1))``, shape ``[K, d]``.
        c: ``1/√(2(K−1))``.
        cs: ``c A^{-1/2}``, shape ``[d]`` (maps ``V`` to the whitened ``Ṽ = cVA^{-1/2}``).
        ut: whitened factor ``Ũᵀ = U A^{-1/2}``, shape ``[K, d]``.
        cap: the capacitance ``C = I + ŨᵀŨ``.
        c_inv: ``C⁻¹``.
        pt: ``C⁻¹Ũᵀ`` (``= ŨᵀT`` with ``T = I − ŨC⁻¹Ũᵀ = A^{1/2}Σ⁻¹A^{1/2}``), shape ``[K, d]``.
        e: ``I − C⁻¹ = ŨᵀTŨ``.
        w: ``diag(ŨC⁻¹Ũᵀ) = 1 − diag T``, shape ``[d]``.
        inv_sqrt_a: ``A^{-1/2} = √2/σ``, shape ``[d]``.
        chol: the Cholesky factor of ``C`` (lower).
    """

    a: Tensor
    u: Tensor
    c: float
    cs: Tensor
    ut: Tensor
    cap: Tensor
    c_inv: Tensor
    pt: Tensor
    e: Tensor
    w: Tensor
    inv_sqrt_a: Tensor
    chol: Tensor


def _cholesky(matrix: Tensor) -> Tensor:
    """The Cholesky factor of ``matrix``; on a GPU without the error check's host synchronization.

    For capacitances ``I + ŨᵀŨ ⪰ I``, positive definite for every finite ``Ũ``: on a GPU a non-finite input gives a
    non-finite factor, and so a non-finite loss for the divergence check, instead of a synchronization every step.
    On a CPU it raises :class:`torch.linalg.LinAlgError` as :func:`torch.linalg.cholesky` does.
    """
    if matrix.is_cuda:
        return torch.linalg.cholesky_ex(matrix).L
    return torch.linalg.cholesky(matrix)


def geometry(theta: Mapping[str, Tensor], dtype: torch.dtype | None = None, *, cache: bool = True) -> LowRankGeometry:
    """The Woodbury quantities of ``q_θ``'s covariance, computed in ``dtype`` (default: ``θ``'s).

    For a :class:`~flatbma.packed.Packed` ``θ`` the result is kept with it (:attr:`~flatbma.packed.Packed.derived`),
    so one FP-BMA step computes it once for the ascent's Fisher solve and the KL gradient. Inputs that require
    gradients are never kept, nor is anything with ``cache=False`` (a fixed second Gaussian, a prior).
    """
    keep = cache and isinstance(theta, Packed) and not (torch.is_grad_enabled() and theta.flat.requires_grad)
    if keep and ("geometry", dtype) in theta.derived:  # type: ignore[union-attr]
        return theta.derived["geometry", dtype]  # type: ignore[union-attr,return-value]
    result = _geometry(*blocks(theta)[1:], dtype)
    if keep:
        theta.derived["geometry", dtype] = result  # type: ignore[union-attr]
    return result


def _geometry(log_std: Tensor, factor: Tensor, dtype: torch.dtype | None) -> LowRankGeometry:
    """:class:`LowRankGeometry` of ``log σ`` (``[d]``) and ``L`` (``[K, d]``)."""
    k = factor.shape[0]
    c = factor_scale(k)
    s = log_std.to(dtype)
    a = 0.5 * torch.exp(2 * s)
    inv_sqrt_a = math.sqrt(2.0) * torch.exp(-s)
    u = factor.to(s.dtype)
    # the same products as c·L: scaled in place when the cast made a copy (one [K, d] temporary less)
    u = c * u if u is factor else u.mul_(c)
    ut = u * inv_sqrt_a
    eye = torch.eye(k, dtype=u.dtype, device=u.device)
    cap = eye + ut @ ut.T
    chol = _cholesky(cap)
    c_inv = torch.cholesky_inverse(chol)
    pt = c_inv @ ut
    w = (ut * pt).sum(0)
    return LowRankGeometry(a, u, c, c * inv_sqrt_a, ut, cap, c_inv, pt, eye - c_inv, w, inv_sqrt_a, chol)


def diag_and_factor_blocks(theta: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``Σ = diag(a) + U Uᵀ`` with ``a = σ²/2`` and ``U = L / √(2(K−1))``, per parameter block.

    Returns:
        ``(a by name, flat [d_name]; U by name, [K, d_name])``.
    """
    log_std, factor = section(theta, "log_std"), section(theta, "factor")
    k = rank_of(theta)
    c = factor_scale(k)
    a = {n: 0.5 * torch.exp(2 * v).reshape(-1) for n, v in log_std.items()}
    u = {n: c * f.reshape(k, -1) for n, f in factor.items()}
    return a, u


def natural_covariance_gradient(
    theta: Mapping[str, Tensor], grads: Mapping[str, Tensor], scale: float
) -> Mapping[str, Tensor]:
    """``grads`` with its ``log σ`` row multiplied by ``scale/2`` and clipped to ``[−1, 1]``, packed like ``θ``.

    ``2`` is the Fisher information of ``q_θ`` in ``log σᵢ`` when the factor adds little to ``Σᵢᵢ``
    (``F_logσᵢ = ½(σᵢ²(Σ⁻¹)ᵢᵢ)²``; docs/methods.md §3.4): the natural step of the family's mean-field part. The clip
    bounds a ``log σ`` step to one learning rate against the heavy tail of the single-sample estimate.
    """
    matrix = rows(grads)
    out = matrix.clone()
    out[1].mul_(0.5 * scale).clamp_(-1.0, 1.0)
    return from_rows(out, theta)


def dense_covariance(theta: Mapping[str, Tensor]) -> Tensor:
    """``Σ = ½(diag σ² + L Lᵀ/(K−1))`` as a dense ``[d, d]`` matrix.

    Rows follow ``flatten(section(theta, "mean"))`` (sorted names); ``O(d²)`` memory: for tests and small models.
    """
    a, u = diag_and_factor_blocks(theta)
    names = list(section(theta, "mean"))
    a_vec = torch.cat([a[n] for n in names])
    u_mat = torch.cat([u[n] for n in names], dim=1)  # [K, d]
    return torch.diag(a_vec) + u_mat.T @ u_mat


def marginal_variance(theta: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``diag Σ = σ²/2 + Σ_k L_{·k}²/(2(K−1))`` by parameter name, shaped like the parameter, in ``O(dK)``."""
    a, u = diag_and_factor_blocks(theta)
    mean = section(theta, "mean")
    return {n: (a[n] + (u[n] * u[n]).sum(0)).reshape(mean[n].shape) for n in mean}


def scale_covariance(theta: Mapping[str, Tensor], c: float) -> dict[str, Tensor]:
    """``θ`` of ``N(μ, cΣ)``: ``log σ += ½ log c`` and ``L *= √c``, ``μ`` unchanged (new tensors, by key).

    Both terms of ``Σ = ½(diag σ² + LLᵀ/(K−1))`` scale by ``c``, so :func:`dense_covariance` and
    :func:`marginal_variance` of the result (and ``tr Σ``) are ``c`` times those of ``θ``.

    Raises:
        ValueError: unless ``c`` is finite and > 0.
    """
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"a covariance scale must be finite and > 0, got {c!r}")
    shift, root = 0.5 * math.log(c), math.sqrt(c)
    out: dict[str, Tensor] = {}
    for key, value in theta.items():
        v = value.detach()
        if key.startswith("log_std/"):
            out[key] = v + shift
        elif key.startswith("factor/"):
            out[key] = v * root
        else:
            out[key] = v.clone()
    return out
