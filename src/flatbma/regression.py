"""Regression: a Gaussian likelihood for the network, and the metrics of the BMA's Gaussian-mixture predictive.

The likelihood (:class:`Gaussian`) is ``p(y | x, w) = N(y; μ(x; w), σ²(x; w))``, its noise **learned**
(``noise_std=None``, the default: the network returns ``(μ, s)`` per example, ``σ² = softplus(s) + 10⁻⁶``; Nix &
Weigend 1994; Lakshminarayanan et al. 2017) or **fixed** (``noise_std=σ``: the network returns ``μ`` alone).

The training loss is the mean NLL ``½ log(2π σ²) + (y − μ)² / (2σ²)`` in nats. The BMA predictive is the mixture
``p(y|x) = (1/M) Σ_m N(y; μ_m, σ_m²)`` with mean ``μ̄ = (1/M) Σ_m μ_m`` and variance aleatoric
``(1/M) Σ_m σ_m²`` + epistemic ``(1/M) Σ_m (μ_m − μ̄)²``. :func:`mixture_metrics` scores it, calibration by
the coverage of central intervals: ``y`` lies in the central ``α`` interval iff ``|F(y) − ½| ≤ α/2`` with
``F(y) = (1/M) Σ_m Φ((y − μ_m)/σ_m)`` (Kuleshov, Fenner & Ermon 2018).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from flatbma.errors import FlatbmaError

__all__ = ["COVERAGE_LEVELS", "Gaussian", "mixture_metrics", "normal_nll", "sample_outputs"]

MIN_VARIANCE = 1e-6
"""The floor added to a learned ``σ² = softplus(s)`` (Lakshminarayanan et al. 2017): no zero variance."""

COVERAGE_LEVELS = (0.5, 0.9, 0.95)
"""Levels ``α`` of the central intervals whose coverage :func:`mixture_metrics` reports."""

_CALIBRATION_LEVELS = tuple(round(0.05 * k, 2) for k in range(1, 20))  # 0.05 … 0.95


@dataclass(frozen=True)
class Gaussian:
    """The Gaussian likelihood ``N(y; μ(x; w), σ²)``: learned heteroscedastic ``σ`` (``noise_std=None``) or fixed.

    Called as a loss, ``gaussian(outputs, y)`` is the mean NLL over the batch (an ``Objective``'s ``loss_fn``).

    Attributes:
        noise_std: ``None``: learned, outputs ``[B, 2]``; a positive number: fixed, outputs ``[B, 1]``.
    """

    noise_std: float | None = None

    def __post_init__(self) -> None:
        std = self.noise_std
        if std is not None and (isinstance(std, bool) or not isinstance(std, int | float) or not 0 < std < math.inf):
            raise FlatbmaError(f"noise_std must be a positive number (or None: learned), got {std!r}")

    @property
    def outputs(self) -> int:
        """Numbers the network returns per example: 2 (``μ``, ``s``) when ``σ`` is learned, 1 when fixed."""
        return 2 if self.noise_std is None else 1

    def moments(self, outputs: Tensor) -> tuple[Tensor, Tensor]:
        """``(μ, σ²)`` ``[..., B]`` of network outputs ``[..., B, outputs]``."""
        if outputs.shape[-1] != self.outputs:
            raise FlatbmaError(
                f"the network returns {outputs.shape[-1]} numbers per example, but a Gaussian likelihood with "
                f"{'a learned' if self.noise_std is None else 'a fixed'} noise needs {self.outputs} "
                f"({'mean and raw scale' if self.noise_std is None else 'the mean'})"
            )
        mean = outputs[..., 0]
        if self.noise_std is None:
            return mean, F.softplus(outputs[..., 1]) + MIN_VARIANCE
        return mean, torch.full_like(mean, float(self.noise_std) ** 2)

    def nll(self, outputs: Tensor, y: Tensor) -> Tensor:
        """Per-example NLL ``½ log(2π σ²) + (y − μ)²/(2σ²)``, ``[B]``."""
        mean, var = self.moments(outputs)
        if y.shape != mean.shape:
            raise FlatbmaError(
                f"regression targets must be one number per example, shape {list(mean.shape)}, got {list(y.shape)}"
                + (
                    " (squeeze a [batch, 1] target tensor with y.squeeze(1))"
                    if y.dim() == 2 and y.shape[1] == 1
                    else ""
                )
            )
        return normal_nll(mean, var, y.to(mean.dtype))

    def __call__(self, outputs: Tensor, y: Tensor) -> Tensor:
        """The mean NLL of the batch: the training loss."""
        return self.nll(outputs, y).mean()


def normal_nll(mean: Tensor, var: Tensor, y: Tensor) -> Tensor:
    """Elementwise ``−log N(y; μ, σ²) = ½ log(2π σ²) + (y − μ)²/(2σ²)``, in the operands' dtype."""
    return 0.5 * (torch.log(2 * math.pi * var) + (y - mean) ** 2 / var)


def sample_outputs(model: nn.Module, samples: Sequence[Mapping[str, Tensor]], x: Tensor) -> Tensor:
    """``f(x; w_m)`` for every sample, ``[M, B, outputs]`` in float32 (or float64), the model in its current mode."""
    outs = [functional_call(model, dict(w), (x,)) for w in samples]
    stacked = torch.stack(outs)
    return stacked if stacked.dtype == torch.float64 else stacked.float()


def mixture_metrics(means: Tensor, variances: Tensor, y: Tensor) -> dict[str, float]:
    """NLL, RMSE and calibration of the mixture predictive ``(1/M) Σ_m N(y; μ_m, σ_m²)`` (module docstring).

    ``means`` ``μ_m`` and ``variances`` ``σ_m² > 0``: ``[M, N]`` per sample; ``y``: ``[N]`` targets.

    Returns:
        ``nll`` (mean ``−log p(y|x)``), ``rmse`` and ``mae`` of ``μ̄``, ``coverage_<α>`` for ``α`` in
        :data:`COVERAGE_LEVELS`, ``calibration_error`` (``(1/19) Σ_α |coverage_α − α|``, ``α = 0.05, …, 0.95``),
        ``mean_std``, ``aleatoric_var``, ``epistemic_var`` (means), ``n`` and ``num_samples``; float64.

    Raises:
        FlatbmaError: shapes that do not match, or variances that are not positive.
    """
    mu, var = means.detach().to(torch.float64), variances.detach().to(torch.float64)
    target = y.detach().to(torch.float64).reshape(-1)
    if mu.ndim != 2 or var.shape != mu.shape or target.shape[0] != mu.shape[1] or mu.shape[1] == 0:
        raise FlatbmaError(
            f"means and variances must be [num_samples, n] and y [n], got {list(mu.shape)}, {list(var.shape)} and "
            f"{list(y.shape)}"
        )
    if not bool((var > 0).all()):
        raise FlatbmaError("variances must be positive")
    m = mu.shape[0]
    log_normal = -normal_nll(mu, var, target)
    nll = -(torch.logsumexp(log_normal, dim=0) - math.log(m))
    mean = mu.mean(0)
    aleatoric, epistemic = var.mean(0), ((mu - mean) ** 2).mean(0)
    pit = torch.special.ndtr((target - mu) / var.sqrt()).mean(0)
    coverage = {
        a: float(((pit - 0.5).abs() <= a / 2).double().mean()) for a in {*COVERAGE_LEVELS, *_CALIBRATION_LEVELS}
    }
    return {
        "nll": float(nll.mean()),
        "rmse": float(((mean - target) ** 2).mean().sqrt()),
        "mae": float((mean - target).abs().mean()),
        **{f"coverage_{a:g}": coverage[a] for a in COVERAGE_LEVELS},
        "calibration_error": sum(abs(coverage[a] - a) for a in _CALIBRATION_LEVELS) / len(_CALIBRATION_LEVELS),
        "mean_std": float((aleatoric + epistemic).sqrt().mean()),
        "aleatoric_var": float(aleatoric.mean()),
        "epistemic_var": float(epistemic.mean()),
        "n": int(target.shape[0]),
        "num_samples": m,
    }
