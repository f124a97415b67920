"""Explicit BatchNorm utilities.

* :func:`disable_running_stats` / :func:`enable_running_stats` for users' own SAM loops (the second
  pass must not update running statistics);
* :func:`recompute_bn_statistics` for weights sampled from a posterior (SWAG's ``bn_update``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm

from flatbma.errors import FlatbmaError
from flatbma.types import Params


def disable_running_stats(model: nn.Module) -> None:
    """Freeze BatchNorm running statistics (momentum 0) until :func:`enable_running_stats`.

    The layers still normalize with the batch statistics in train mode; only the running averages
    and ``num_batches_tracked`` stay unchanged.
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
    loader: Iterable[tuple[Tensor, Tensor]],
    *,
    device: torch.device | str = "cpu",
) -> Params:
    """BatchNorm running statistics of ``weights`` recomputed on ``loader`` (SWAG's ``bn_update``).

    A weight sample drawn from a posterior does not come with statistics that match it; this pass
    estimates them as the average of the batch statistics over one epoch of ``loader``, each batch
    weighted by its size: with batches ``B_1 … B_J`` of sizes ``n_j``, the running mean is
    ``Σ_j n_j μ_{B_j} / Σ_j n_j`` and the running variance ``Σ_j n_j s²_{B_j} / Σ_j n_j`` (``s²`` the
    unbiased batch variance), computed by the layers' own update with momentum ``n_j / (n_1 + … + n_j)``
    for batch ``j``. One batch gives the statistics of all the data exactly. The pass runs without
    gradient with the BatchNorm layers in train mode and every other module in eval mode (dropout
    off, so that a dropout network's statistics are those of its deterministic forward pass, not of
    one draw of masks). The statistics are a deterministic function of ``weights`` and the loader's
    batches: give it a loader without randomness (no shuffling, no augmentation) for reproducible ones.

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
        for x, _ in loader:
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
