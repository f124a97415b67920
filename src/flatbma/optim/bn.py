"""Explicit BatchNorm utilities for users' own SAM loops (the second pass must not update statistics)."""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


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
