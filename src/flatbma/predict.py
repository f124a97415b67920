"""Bayesian model averaging: the posterior predictive, streamed over a DataLoader.

``log p(y|x) = log (1/M) Σ_m softmax(f(x; w_m))_y = logsumexp_m log_softmax(f(x; w_m))_y − log M``,
computed in log space (never ``log`` of an averaged, clamped probability).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from flatbma.errors import FlatbmaError
from flatbma.metrics import StreamingMetrics
from flatbma.types import Batch


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode for the block and restore its previous mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def sample_log_probs(model: nn.Module, samples: Sequence[Mapping[str, Tensor]], x: Tensor) -> Tensor:
    """``log_softmax(f(x; w_m))`` for every sample: a tensor ``[M, B, C]``."""
    return torch.stack([F.log_softmax(functional_call(model, dict(w), (x,)), dim=-1) for w in samples])


def log_mean_exp(log_probs: Tensor, dim: int = 0) -> Tensor:
    """``log (1/M) Σ_m exp(a_m)`` along ``dim``."""
    return torch.logsumexp(log_probs, dim=dim) - math.log(log_probs.shape[dim])


@torch.no_grad()
def bma_log_probs(model: nn.Module, samples: Sequence[Mapping[str, Tensor]], x: Tensor) -> Tensor:
    """BMA predictive log-probabilities ``[B, C]`` of one input batch."""
    if not samples:
        raise FlatbmaError("BMA needs at least one posterior sample (num_samples >= 1)")
    return log_mean_exp(sample_log_probs(model, samples, x))


def predict(
    model: nn.Module,
    samples: Sequence[Mapping[str, Tensor]],
    loader: Iterable[Batch],
    *,
    device: torch.device | str = "cpu",
    mode: Callable[[nn.Module], AbstractContextManager[Any]] | None = None,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield ``(BMA log-probabilities, labels)`` batch by batch.

    Args:
        model: the template module.
        samples: weight dicts (parameters and buffers) of the posterior samples.
        loader: ``(x, y)`` batches.
        device: where batches go.
        mode: context manager factory for the model's prediction mode (a posterior's
            ``predict_mode``); eval mode when ``None``.
    """
    with (mode or eval_mode)(model):
        for x, y in loader:
            yield bma_log_probs(model, samples, x.to(device)), y.to(device)


def evaluate(
    model: nn.Module,
    samples: Sequence[Mapping[str, Tensor]],
    loader: Iterable[Batch],
    *,
    num_classes: int,
    n_bins: int = 15,
    device: torch.device | str = "cpu",
    mode: Callable[[nn.Module], AbstractContextManager[Any]] | None = None,
) -> dict[str, float]:
    """Accuracy, NLL, ECE, adaptive ECE and Brier score of the BMA predictive over ``loader``."""
    metrics = StreamingMetrics(num_classes=num_classes, n_bins=n_bins)
    for log_probs, labels in predict(model, samples, loader, device=device, mode=mode):
        metrics.update(log_probs, labels)
    if metrics.compute()["n"] == 0:
        raise FlatbmaError("the evaluation data is empty: check the test split and data options")
    return {**metrics.compute(), "num_samples": len(samples)}
