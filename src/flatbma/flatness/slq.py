"""Spectral density of a symmetric operator, and of the Hessian, by stochastic Lanczos quadrature.

The spectral density ``φ(t) = (1/d) Σ_i δ(t − λ_i)`` satisfies ``∫ f dφ = (1/d) tr f(A) = E_v[vᵀ f(A) v]`` for
``v = z/√d`` with Rademacher ``z``. For one such ``v``, ``m`` Lanczos steps give ``T = Vᵀ A V`` with eigenpairs
``(θ_j, s_j)``, and the Gauss quadrature ``vᵀ f(A) v ≈ Σ_j τ_j f(θ_j)``, ``τ_j = (e_1ᵀ s_j)²``, is exact for
polynomials of degree ``≤ 2m − 1``. Averaging over ``n_v`` vectors gives nodes ``θ`` and weights ``τ / n_v``
(summing to 1), whose mean ``Σ w_j θ_j`` is a Hutchinson estimate of ``tr A / d``.

Golub & Meurant (2010); Lin, Saad & Yang, SIAM Review 58 (2016); Ubaru, Chen & Saad (2017);
Ghorbani, Krishnan & Xiao (2019) and PyHessian (Yao et al., 2020) for neural-network Hessians.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flatbma.errors import FlatbmaError
from flatbma.flatness.hutchinson import rademacher
from flatbma.flatness.hvp import HVPMethod, LossFn, ParamSelection, hvp_fn, nonzero_checked
from flatbma.flatness.lanczos import lanczos_tridiagonal
from flatbma.types import Batch

__all__ = ["SpectralDensity", "spectral_density", "stochastic_lanczos_quadrature"]

@dataclass(frozen=True)
class SpectralDensity:
    """A discrete approximation ``Σ_j w_j δ(t − θ_j)`` of the spectral density.

    Attributes:
        nodes: ``(n_v, m)`` float64 Ritz values, one row per probe; a run that stopped early is padded with
            nodes of weight 0.
        weights: ``(n_v, m)`` float64 quadrature weights; all of them sum to 1.
        dim: dimension ``d`` of the operator.
    """

    nodes: Tensor
    weights: Tensor
    dim: int

    def moment(self, p: int) -> float:
        """``Σ_j w_j θ_j^p``, an estimate of ``tr(A^p) / d``."""
        return float((self.weights * self.nodes.pow(p)).sum())

    def mean(self) -> float:
        """``Σ_j w_j θ_j``, an estimate of ``tr(A) / d``."""
        return self.moment(1)

    def trace(self) -> float:
        """``d · mean``, an estimate of ``tr A``."""
        return self.dim * self.mean()


def stochastic_lanczos_quadrature(
    matvec: Callable[[Tensor], Tensor],
    dim: int,
    *,
    num_vectors: int = 1,
    num_steps: int = 80,
    eps: float = torch.finfo(torch.float64).eps,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float64,
) -> SpectralDensity:
    """SLQ nodes and weights of a symmetric operator (module docstring).

    ``matvec`` is ``v ↦ A v`` on float64 vectors of length ``dim``. Each of the ``n_v = num_vectors`` Rademacher
    probes (drawn with the CPU ``generator``) runs ``m = num_steps`` Lanczos steps (capped at ``d``; ``n_v · m``
    products in all) on a ``m × d`` basis in ``dtype`` on ``device``; ``eps`` is ``matvec``'s relative precision.
    """
    for key, value in (("num_vectors", num_vectors), ("num_steps", num_steps)):
        if not isinstance(value, int) or value < 1:
            raise FlatbmaError(f"{key} must be a positive integer (got {value!r})")
    m = min(num_steps, dim)
    nodes = torch.zeros(num_vectors, m, dtype=torch.float64)
    weights = torch.zeros(num_vectors, m, dtype=torch.float64)
    for i in range(num_vectors):
        t, _ = lanczos_tridiagonal(matvec, rademacher(dim, generator).to(device), m, eps=eps, dtype=dtype)
        theta, s = torch.linalg.eigh(t)
        nodes[i, : len(theta)] = theta
        weights[i, : len(theta)] = s[0] ** 2 / num_vectors
    return SpectralDensity(nodes.to(device), weights.to(device), dim)


def spectral_density(
    model: nn.Module,
    data: Iterable[Batch] | Batch,
    *,
    loss_fn: LossFn | None = None,
    params: ParamSelection = None,
    weights: Mapping[str, Tensor] | None = None,
    num_vectors: int = 1,
    num_steps: int = 80,
    seed: int = 0,
    hvp: HVPMethod | str = HVPMethod.DOUBLE_BACKWARD,
) -> SpectralDensity:
    """Eigenvalue density of ``∇²L_S(w)`` over the chosen parameters by stochastic Lanczos quadrature.

    ``model``, ``data``, ``loss_fn``, ``params``, ``weights`` and ``hvp`` are as in :func:`~flatbma.flatness.hvp_fn`;
    ``num_vectors`` probes are drawn from ``seed``, with ``num_steps`` Lanczos steps each.

    Raises:
        FlatbmaError: on bad input (see :func:`~flatbma.flatness.hessian_eigenvalues`).
    """
    op = hvp_fn(model, data, loss_fn=loss_fn, params=params, weights=weights, hvp=hvp)
    return stochastic_lanczos_quadrature(
        nonzero_checked(op),
        op.dim,
        num_vectors=num_vectors,
        num_steps=num_steps,
        eps=op.eps,
        dtype=op.dtype,
        generator=torch.Generator().manual_seed(seed),
        device=op.device,
    )
