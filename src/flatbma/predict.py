"""Bayesian model averaging: the posterior predictive, streamed over a DataLoader.

``log p(y|x) = log (1/M) Σ_m softmax(f(x; w_m))_y = logsumexp_m log_softmax(f(x; w_m))_y − log M``,
computed in log space (never ``log`` of an averaged, clamped probability).

The ``M`` forward passes run one sample at a time or several per call, as :mod:`flatbma.batching` chooses.
In place of the samples, every function also takes a linearized predictive (:mod:`flatbma.linearized`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from flatbma import batching, progress
from flatbma.bn import eval_mode
from flatbma.calibration import scale
from flatbma.errors import FlatbmaError
from flatbma.linearized import LinearizedPredictive
from flatbma.metrics import StreamingMetrics
from flatbma.types import Batch, split_batch

Predictions = Sequence[Mapping[str, Tensor]] | LinearizedPredictive
"""What a BMA averages: weight samples (parameters and buffers by module name), or a linearized predictive."""



def sample_log_probs(
    model: nn.Module,
    samples: Predictions,
    x: Tensor,
    *,
    batched: bool | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """``log_softmax(f(x; w_m))`` for every sample: a tensor ``[M, B, C]``.

    Weight samples are evaluated by :func:`flatbma.batching.log_probs` (``batched``: batch the samples, loop,
    or ``None`` to choose; ``chunk_size``: samples per batched call); a linearized predictive gives its own.

    Raises:
        FlatbmaError: for invalid ``batched``/``chunk_size``, and with ``batched=True`` when the
            samples cannot be stacked or ``vmap`` cannot evaluate the model.
    """
    batching.check_options(batched, chunk_size)
    if isinstance(samples, LinearizedPredictive):
        return samples.log_probs(model, x)
    return batching.log_probs(model, samples, x, batched=batched, chunk_size=chunk_size)


def log_mean_exp(log_probs: Tensor, dim: int = 0) -> Tensor:
    """``log (1/M) Σ_m exp(a_m)`` along ``dim``."""
    return torch.logsumexp(log_probs, dim=dim) - math.log(log_probs.shape[dim])


@torch.no_grad()
def bma_log_probs(
    model: nn.Module,
    samples: Predictions,
    x: Tensor,
    *,
    batched: bool | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """BMA predictive log-probabilities ``[B, C]`` of one input batch (``batched``: :func:`sample_log_probs`)."""
    if not samples:
        raise FlatbmaError("BMA needs at least one posterior sample (num_samples >= 1)")
    return log_mean_exp(sample_log_probs(model, samples, x, batched=batched, chunk_size=chunk_size))


def predict(
    model: nn.Module,
    samples: Predictions,
    loader: Iterable[Batch],
    *,
    device: torch.device | str = "cpu",
    mode: Callable[[nn.Module], AbstractContextManager[Any]] | None = None,
    batched: bool | None = None,
    chunk_size: int | None = None,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield ``(BMA log-probabilities, labels)`` for every ``(x, y)`` batch of ``loader``, on ``device``.

    ``samples``: weight dicts (parameters and buffers) or a linearized predictive; ``mode``: a context manager
    factory for the prediction mode (a posterior's ``predict_mode``; ``None``: eval); ``batched``: batch the
    samples (``True``), loop (``False``) or choose (``None``); ``chunk_size``: samples per batched call (``None``:
    sized automatically). Inputs alone: :meth:`flatbma.predictor.BMA.predict_log_proba`.
    """
    batching.check_options(batched, chunk_size)
    with (mode or eval_mode)(model):
        for batch in loader:
            x, y = labelled(batch)
            log_probs = bma_log_probs(model, samples, x.to(device), batched=batched, chunk_size=chunk_size)
            yield log_probs, y.to(device)


def labelled(batch: object) -> Batch:
    """``(x, y)`` of a labelled batch (:func:`flatbma.types.split_batch`).

    Raises:
        FlatbmaError: for inputs without labels, saying where inputs alone are predicted.
    """
    x, y = split_batch(batch)
    if y is None:
        raise FlatbmaError(
            "metrics need labelled (x, y) batches, but a batch holds inputs alone; to predict inputs alone use "
            "flatbma.BMA(model, method, state).predict_proba(x)"
        )
    return x, y


def paired_nll(
    model: nn.Module,
    samples: Predictions,
    point: Mapping[str, Tensor],
    batches: Sequence[Batch],
    *,
    device: torch.device | str = "cpu",
    mode: Callable[[nn.Module], AbstractContextManager[Any]] | None = None,
) -> dict[str, float]:
    """The BMA of ``samples`` and the point estimate ``point`` on the same labelled ``batches``, example by example.

    The BMA runs in ``mode``, ``point`` in eval mode. Returns ``{"examples", "bma_nll", "bma_accuracy",
    "mean_nll", "mean_accuracy", "nll_diff_se"}``: the means, and the standard error ``sd/√n`` of the
    per-example differences ``NLL_BMA,i − NLL_point,i``.
    """
    sides = []
    for weights, side_mode in ((samples, mode), ([dict(point)], None)):
        nll, correct = [], []
        for log_probs, y in predict(model, weights, batches, device=device, mode=side_mode):
            nll.append(-log_probs.double().gather(1, y[:, None].to(torch.int64))[:, 0].cpu())
            correct.append((log_probs.argmax(-1) == y).cpu())
        sides.append((torch.cat(nll), torch.cat(correct)))
    (ours, ours_ok), (theirs, theirs_ok) = sides
    n = ours.numel()
    diff = ours - theirs
    se = float(diff.std(unbiased=True) / math.sqrt(n)) if n > 1 else float("inf")
    return {
        "examples": n,
        "bma_nll": float(ours.mean()),
        "bma_accuracy": float(ours_ok.double().mean()),
        "mean_nll": float(theirs.mean()),
        "mean_accuracy": float(theirs_ok.double().mean()),
        "nll_diff_se": se,
    }


def evaluate(
    model: nn.Module,
    samples: Predictions,
    loader: Iterable[Batch],
    *,
    num_classes: int,
    n_bins: int = 15,
    device: torch.device | str = "cpu",
    mode: Callable[[nn.Module], AbstractContextManager[Any]] | None = None,
    batched: bool | None = None,
    chunk_size: int | None = None,
    reduce_metrics: Callable[[StreamingMetrics], None] | None = None,
    temperature: float = 1.0,
) -> dict[str, float]:
    """Accuracy, NLL, ECE, adaptive ECE and Brier score of the BMA predictive over ``loader``.

    ``temperature`` ``T`` scales the predictive to ``log softmax(log p̄ / T)`` (1: none); ``reduce_metrics`` is
    applied to the accumulated :class:`~flatbma.metrics.StreamingMetrics` before computing (e.g. a sum over
    processes each evaluating a shard). The other keyword arguments are those of :func:`predict`.
    """
    states = stream_metrics(
        model,
        samples,
        loader,
        num_classes=num_classes,
        n_bins=n_bins,
        device=device,
        mode=mode,
        batched=batched,
        chunk_size=chunk_size,
        reduce_metrics=reduce_metrics,
        temperature=temperature,
    )
    metrics = states[len(samples)].compute()
    if metrics["n"] == 0:
        raise FlatbmaError("the evaluation data is empty: check the test split and data options")
    return {**metrics, "num_samples": len(samples)}


@torch.no_grad()
def stream_metrics(
    model: nn.Module,
    samples: Predictions,
    loader: Iterable[Batch],
    *,
    num_classes: int,
    n_bins: int = 15,
    sizes: Iterable[int] = (),
    temperature: float = 1.0,
    device: torch.device | str = "cpu",
    mode: Callable[[nn.Module], AbstractContextManager[Any]] | None = None,
    batched: bool | None = None,
    chunk_size: int | None = None,
    reduce_metrics: Callable[[StreamingMetrics], None] | None = None,
    keep: list[tuple[Tensor, Tensor]] | None = None,
) -> dict[int, StreamingMetrics]:
    """The metric states of the BMA of the first ``m`` samples for every ``m`` in ``sizes``, in one pass.

    Each batch's ``M`` per-sample log-probabilities are computed once; the BMA of the first ``m`` is
    ``logsumexp_{i<m} log softmax(f(x; w_i))_y − log m``, rescaled to ``log softmax(log p_m / T)``
    (:func:`flatbma.calibration.scale`). ``sizes`` are cut to ``M``, and ``M`` is always included;
    ``reduce_metrics`` is applied to every state at the end; ``keep``, a list, receives every batch's
    ``(full-BMA log-probabilities before T, labels)`` for :func:`rescaled_metrics`. The other arguments are
    those of :func:`evaluate` and :func:`predict`. Returns ``{m: state}`` in increasing ``m``.
    """
    if not samples:
        raise FlatbmaError("BMA needs at least one posterior sample (num_samples >= 1)")
    batching.check_options(batched, chunk_size)
    total = len(samples)
    chosen = sorted({min(m, total) for m in sizes} | {total})
    states = {m: StreamingMetrics(num_classes=num_classes, n_bins=n_bins) for m in chosen}
    with (mode or eval_mode)(model):
        for batch in progress.current().bar(loader, desc=f"BMA of {total}", unit="batch"):  # a bar on a terminal
            x, y = labelled(batch)
            x, y = x.to(device), y.to(device)
            per_sample = sample_log_probs(model, samples, x, batched=batched, chunk_size=chunk_size)
            for m, state in states.items():
                log_probs = log_mean_exp(per_sample[:m])
                state.update(log_probs if temperature == 1.0 else scale(log_probs, temperature), y)
                if keep is not None and m == total:
                    keep.append((log_probs, y))
    if reduce_metrics is not None:
        for state in states.values():
            reduce_metrics(state)
    return states


def rescaled_metrics(
    kept: Iterable[tuple[Tensor, Tensor]],
    temperature: float,
    *,
    num_classes: int,
    n_bins: int = 15,
    reduce_metrics: Callable[[StreamingMetrics], None] | None = None,
) -> StreamingMetrics:
    """The metric state of the kept BMA predictives (:func:`stream_metrics`'s ``keep``) rescaled by ``T``.

    The state :func:`stream_metrics` with this ``temperature`` gives, without evaluating the samples again.
    """
    state = StreamingMetrics(num_classes=num_classes, n_bins=n_bins)
    for log_probs, y in kept:
        state.update(log_probs if temperature == 1.0 else scale(log_probs, temperature), y)
    if reduce_metrics is not None:
        reduce_metrics(state)
    return state
