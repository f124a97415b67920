"""The width of a posterior over the Bayesian subset: ``tr Σ`` and the median marginal standard deviation.

Samples of a wider posterior lie in sharper places, so a flatness comparison needs the width beside it
(docs/methods.md §8.6). For ``v = diag Σ`` over the trained parameters, ``tr Σ = Σ_i v_i`` and the median marginal
std is ``median_i √v_i``; ``v`` is exact where the posterior gives it in closed form
(:attr:`flatbma.types.Posterior.marginal_variance`), else the unbiased per-coordinate variance of the samples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from flatbma.errors import FlatbmaError

__all__ = ["Width", "sample_variance", "width"]


@dataclass(frozen=True)
class Width:
    """``tr Σ`` and the median marginal standard deviation of a posterior (module docstring).

    Attributes:
        trace_cov: ``tr Σ = Σ_i v_i``.
        median_std: ``median_i √v_i``.
        exact: whether ``v`` is the posterior's own (closed form) rather than a sample estimate.
        source: where ``v`` comes from, in words.
        dim: number ``d`` of coordinates.
    """

    trace_cov: float
    median_std: float
    exact: bool
    source: str
    dim: int

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values."""
        return asdict(self)


def width(variance: Mapping[str, Tensor], *, exact: bool, source: str) -> Width:
    """:class:`Width` of the per-coordinate variances ``v`` (by parameter name; float64 sums).

    Raises:
        FlatbmaError: if ``variance`` is empty or has negative or non-finite entries.
    """
    if not variance:
        raise FlatbmaError("the posterior width needs the variances of at least one parameter")
    flat = torch.cat([v.detach().reshape(-1).to(device="cpu", dtype=torch.float64) for v in variance.values()])
    if not bool(torch.isfinite(flat).all()) or bool((flat < 0).any()):
        raise FlatbmaError("the posterior's marginal variances must be finite and >= 0")
    return Width(
        trace_cov=float(flat.sum()),
        median_std=float(flat.sqrt().median()),
        exact=exact,
        source=source,
        dim=flat.numel(),
    )


def sample_variance(samples: Sequence[Mapping[str, Tensor]], names: Sequence[str]) -> dict[str, Tensor]:
    """The unbiased per-coordinate variance of the tensors ``names`` over ``samples`` (zeros for one sample)."""
    if not samples:
        raise FlatbmaError("a sample estimate of the posterior width needs at least one sample")
    out = {}
    for name in names:
        stacked = torch.stack([s[name].detach().to(torch.float64) for s in samples])
        out[name] = stacked.var(dim=0, correction=1) if len(samples) > 1 else torch.zeros_like(stacked[0])
    return out
