"""Explicit BatchNorm utilities.

:func:`disable_running_stats` for users' own SAM loops (the second pass must not update running statistics);
:func:`recompute_bn_statistics` (SWAG's ``bn_update``) for posterior samples, in :func:`statistics_loader`'s order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, Dataset

from flatbma import progress
from flatbma.errors import FlatbmaError
from flatbma.types import Params, split_batch


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode for the block, then give every submodule its own previous mode back."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


def disable_running_stats(model: nn.Module) -> None:
    """Freeze BatchNorm running statistics (momentum 0) until :func:`enable_running_stats`.

    In train mode the layers still normalize with batch statistics; only the running averages and
    ``num_batches_tracked`` stay unchanged.
    """
    for m in model.modules():
        if isinstance(m, _BatchNorm) and not hasattr(m, "_flatbma_momentum"):
            m._flatbma_momentum = m.momentum
            m.momentum = 0.0
            m._flatbma_tracked = m.num_batches_tracked.clone() if m.num_batches_tracked is not None else None


def enable_running_stats(model: nn.Module) -> None:
    """Undo :func:`disable_running_stats`."""
    for m in model.modules():
        if isinstance(m, _BatchNorm) and hasattr(m, "_flatbma_momentum"):
            m.momentum = m._flatbma_momentum
            if m._flatbma_tracked is not None:
                m.num_batches_tracked.copy_(m._flatbma_tracked)
            del m._flatbma_momentum, m._flatbma_tracked


def has_batchnorm(model: nn.Module) -> bool:
    """Whether ``model`` contains a BatchNorm layer."""
    return any(isinstance(m, _BatchNorm) for m in model.modules())


@torch.no_grad()
def recompute_bn_statistics(
    model: nn.Module,
    weights: Mapping[str, Tensor],
    loader: Iterable[Any],
    *,
    device: torch.device | str = "cpu",
) -> Params:
    """BatchNorm running statistics of ``weights`` recomputed on ``loader`` (SWAG's ``bn_update``).

    A posterior sample comes without matching statistics; one pass over ``loader`` estimates them as the
    size-weighted average of batch statistics: running mean ``Σ_j n_j μ_{B_j} / Σ_j n_j`` and variance
    ``Σ_j n_j s²_{B_j} / Σ_j n_j`` (``s²`` unbiased), via the layers' own update with momentum
    ``n_j / (n_1 + … + n_j)``. The pass runs without gradient, BatchNorm layers in train mode and every other
    module in eval mode (dropout off: the deterministic forward's statistics); modes and momenta are restored.
    The result is deterministic in ``weights`` and the batches, so give a loader without shuffling or
    augmentation. Batches are ``(x, y)``, ``(x,)`` or ``x``; labels are unused.

    Returns:
        ``weights`` with every BatchNorm buffer replaced by the recomputed one (a new dict).
    """
    bn_layers = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    if not bn_layers:
        return dict(weights)
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    prefixes = {name for name, m in model.named_modules() if isinstance(m, _BatchNorm)}
    for name in prefixes:
        p = f"{name}." if name else ""
        buffers[p + "running_mean"].zero_()
        buffers[p + "running_var"].fill_(1.0)
        buffers[p + "num_batches_tracked"].zero_()
    momenta = [m.momentum for m in bn_layers]
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        for m in bn_layers:
            m.train()
        params = {k: v for k, v in weights.items() if k not in buffers}
        seen = 0
        for batch in loader:
            x, _ = split_batch(batch)
            n = x.shape[0]
            if n == 0:
                continue
            for m in bn_layers:
                m.momentum = n / (seen + n)
            functional_call(model, {**params, **buffers}, (x.to(device),))
            seen += n
        if not seen:
            raise FlatbmaError("recomputing BatchNorm statistics needs training data, but the loader is empty")
    finally:
        for m, momentum in zip(bn_layers, momenta):
            m.momentum = momentum
        for m, training in modes:
            m.training = training
    return {**weights, **buffers}


def with_recomputed_statistics(
    model: nn.Module,
    samples: Sequence[Mapping[str, Tensor]],
    loader: Iterable[Any],
    *,
    device: torch.device | str = "cpu",
) -> list[Params]:
    """``samples`` with their BatchNorm statistics recomputed on ``loader`` (:func:`recompute_bn_statistics`).

    Repeats of the same tensors (MC dropout's samples) are recomputed once and share one dict; a model without
    BatchNorm gets ``samples`` back as given. Give it the un-augmented training data in a fixed order
    (:func:`statistics_loader`), so the statistics are a function of the weights alone.
    """
    if not has_batchnorm(model):
        return list(samples)
    done: dict[tuple[int, ...], Params] = {}
    out = []
    for w in progress.current().bar(samples, desc="BatchNorm statistics", unit="sample"):
        key = tuple(id(v) for v in w.values())  # the samples are alive: ids are not reused
        if key not in done:
            done[key] = recompute_bn_statistics(model, w, loader, device=device)
        out.append(done[key])
    return out


def statistics_loader(
    dataset: Dataset, batch_size: int, *, collate_fn: Callable[[list[Any]], Any] | None = None
) -> DataLoader:
    """``dataset`` in a fixed order, in batches of ``batch_size``, for BatchNorm statistics.

    The order is one permutation of ``range(len(dataset))`` from a generator seeded with 0: it depends only on the
    data set's size, so every evaluation and process gets the same batches, and class-sorted data (image folders)
    does not give class-pure batches. A trailing batch of one example (BatchNorm cannot normalize it) joins the
    one before. Give it data without random augmentation. ``collate_fn`` is the DataLoader's (``None``: default).
    """
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if len(batches) > 1 and len(batches[-1]) == 1:
        last = batches.pop()
        batches[-1] = batches[-1] + last
    return DataLoader(dataset, batch_sampler=batches, collate_fn=collate_fn)
