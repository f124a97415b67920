"""Trace of a symmetric operator, and of the training-loss Hessian, by Hutchinson's estimator.

With Rademacher ``z`` (entries ±1 with probability ½), ``E[zᵀ A z] = tr A`` and ``Var[zᵀ A z] = 2 Σ_{i≠j} A_ij²``;
the estimate is the mean of ``m`` independent ``zᵀ A z``, its standard error their sample std over ``√m``.
Rademacher probes give the smallest variance of this form (Hutchinson, 1990); PyHessian (Yao et al., 2020) uses them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import torch
from torch import Tensor, nn

from flatbma.errors import FlatbmaError
from flatbma.flatness.hvp import HVPMethod, LossFn, ParamSelection, hvp_fn, nonzero_checked
from flatbma.types import Batch

__all__ = ["TraceEstimate", "hessian_trace", "hutchinson_trace", "rademacher"]


class TraceEstimate(NamedTuple):
    """A Monte Carlo trace estimate.

    Attributes:
        trace: mean of the samples.
        stderr: standard error of the mean (sample standard deviation / ``√m``).
        samples: ``(m,)`` float64, the individual ``zᵀ A z``.
    """

    trace: float
    stderr: float
    samples: Tensor


def rademacher(dim: int, generator: torch.Generator | None = None) -> Tensor:
    """A float64 CPU vector of independent ±1 entries."""
    return torch.randint(0, 2, (dim,), generator=generator).to(torch.float64).mul_(2).sub_(1)


def hutchinson_trace(
    matvec: Callable[[Tensor], Tensor],
    dim: int,
    *,
    num_samples: int = 100,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> TraceEstimate:
    """``tr A ≈ (1/m) Σ_i z_iᵀ A z_i`` with Rademacher ``z_i`` (module docstring).

    ``matvec`` is ``v ↦ A v`` on float64 vectors of length ``dim``; the ``m = num_samples ≥ 2`` probes are drawn
    with the CPU ``generator`` and moved to ``device``.
    """
    if not isinstance(num_samples, int) or num_samples < 2:
        raise FlatbmaError(f"num_samples must be an integer >= 2 for a standard error (got {num_samples!r})")
    samples = torch.empty(num_samples, dtype=torch.float64)
    for i in range(num_samples):
        z = rademacher(dim, generator).to(device)
        samples[i] = float(z @ matvec(z).to(torch.float64))
    return TraceEstimate(float(samples.mean()), float(samples.std(correction=1)) / math.sqrt(num_samples), samples)


def hessian_trace(
    model: nn.Module,
    data: Iterable[Batch] | Batch,
    *,
    loss_fn: LossFn | None = None,
    params: ParamSelection = None,
    weights: Mapping[str, Tensor] | None = None,
    num_samples: int = 100,
    seed: int = 0,
    hvp: HVPMethod | str = HVPMethod.DOUBLE_BACKWARD,
) -> TraceEstimate:
    """Hutchinson estimate of ``tr ∇²L_S(w)`` over the chosen parameters, with its standard error.

    ``model``, ``data``, ``loss_fn``, ``params``, ``weights`` and ``hvp`` are as in :func:`~flatbma.flatness.hvp_fn`;
    ``num_samples`` Rademacher probes (Hessian-vector products) are drawn from ``seed``.

    Raises:
        FlatbmaError: on bad input (see :func:`~flatbma.flatness.hessian_eigenvalues`).
    """
    if not isinstance(num_samples, int) or num_samples < 2:
        raise FlatbmaError(f"num_samples must be an integer >= 2 for a standard error (got {num_samples!r})")
    op = hvp_fn(model, data, loss_fn=loss_fn, params=params, weights=weights, hvp=hvp)
    return hutchinson_trace(
        nonzero_checked(op),
        op.dim,
        num_samples=num_samples,
        generator=torch.Generator().manual_seed(seed),
        device=op.device,
    )
