"""SGD with momentum and coupled weight decay, and Adam with decoupled weight decay, on tensor dicts.

Weight decay is an L2 prior on the *weights*. When the optimized tensors are not all weights (a Gaussian
posterior's ``θ`` holds ``mean/`` beside ``log_std/``, ``factor/`` or ``rho/``), the decay is restricted by a
:data:`DecayMask`, a predicate on the keys, composed with an optimizer by :func:`with_decay_mask`; without a mask
it acts on every tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import TypeVar

import torch
from torch import Tensor

from flatbma import packed
from flatbma.errors import FlatbmaError
from flatbma.optim.schedules import Schedule, constant
from flatbma.packed import Layout
from flatbma.types import Params

DecayMask = Callable[[str], bool]
"""Which tensors weight decay acts on: ``mask(key)`` for every key of the optimized dict."""

_Optimizer = TypeVar("_Optimizer")


def with_decay_mask(optimizer: _Optimizer, mask: DecayMask) -> _Optimizer:
    """``optimizer`` with its weight decay restricted to the keys where ``mask(key)`` holds.

    An existing mask is combined with ``mask`` (both must hold). An optimizer without a ``decay_mask`` field is
    returned as it is when it has no weight decay, else refused with a ``FlatbmaError``.
    """
    if is_dataclass(optimizer) and any(f.name == "decay_mask" for f in fields(optimizer)):
        old = optimizer.decay_mask
        return replace(optimizer, decay_mask=mask if old is None else _Both(old, mask))
    if getattr(optimizer, "weight_decay", 0):
        raise FlatbmaError(
            f"{type(optimizer).__name__} applies weight decay to every variational parameter (log σ and the "
            "factor too) and cannot be restricted to the mean; set optim.weight_decay=0 or use sgd/adam"
        )
    return optimizer


@dataclass(frozen=True)
class _Both:
    """The conjunction of two decay masks."""

    first: DecayMask
    second: DecayMask

    def __call__(self, key: str) -> bool:
        return self.first(key) and self.second(key)


@functools.lru_cache(maxsize=16)
def _decayed_views(layout: Layout, mask: DecayMask) -> tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]:
    """``(shape, stride, offset)`` of the parts of a packed buffer that ``mask`` selects, merged where contiguous."""
    views: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    run_start = run_end = None
    for key, shape, stride, offset in zip(layout.keys, layout.shapes, layout.strides, layout.offsets, strict=True):
        if not mask(key):
            continue
        numel = shape.numel()
        if tuple(stride) != packed.contiguous_strides(shape) and numel > 1:
            views.append((tuple(shape), tuple(stride), offset))
            continue
        if run_end == offset:
            run_end += numel
            continue
        if run_start is not None:
            views.append(((run_end - run_start,), (1,), run_start))
        run_start, run_end = offset, offset + numel
    if run_start is not None:
        views.append(((run_end - run_start,), (1,), run_start))
    return tuple(views)


def _decay_targets(
    mask: DecayMask | None, keys: Sequence[str], params: Mapping[str, Tensor], *lists: list[Tensor]
) -> tuple[list[Tensor], ...]:
    """Views of the parts of each list (:func:`flatbma.packed.coalesce`'s for ``keys``) that decay acts on."""
    if mask is None:
        return lists
    if len(lists[0]) == len(keys):  # one tensor per key (a single packed key selects all or nothing alike)
        chosen = [i for i, k in enumerate(keys) if mask(k)]
        return tuple([tensors[i] for i in chosen] for tensors in lists)
    views = _decayed_views(packed.layout_of(params, keys), mask)  # one flat buffer per list
    return tuple([tensors[0].as_strided(*view) for view in views] for tensors in lists)


@dataclass(frozen=True)
class SGD:
    """Heavy-ball SGD (the PyTorch convention).

    ``d_t = g_t + λ w_t``; ``m_t = μ m_{t−1} + d_t`` (``m_0 = d_0``);
    ``w_{t+1} = w_t − η_t (d_t + μ m_t)`` if Nesterov else ``w_t − η_t m_t``.

    Attributes:
        lr: a schedule ``step -> η_t`` or a constant learning rate.
        momentum: μ.
        weight_decay: λ (L2 penalty added to the gradient).
        nesterov: Nesterov momentum.
        decay_mask: the keys the weight decay acts on (:data:`DecayMask`); ``None``: every key.
    """

    lr: Schedule | float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    nesterov: bool = False
    decay_mask: DecayMask | None = None

    def learning_rate(self, step: int) -> float:
        """``η_t`` at ``step``."""
        return self.lr(step) if callable(self.lr) else constant(self.lr)(step)

    def init(self, params: Mapping[str, Tensor]) -> Params:
        """Momentum buffers ``m = 0`` (packed like ``params``, see :mod:`flatbma.packed`)."""
        if not self.momentum:
            return {}
        return {f"momentum/{k}": v for k, v in packed.zeros_like(params).items()}

    @torch.no_grad()
    def apply(self, params: Params, grads: Mapping[str, Tensor], state: Params, step: int) -> Params:
        """Update ``params`` in place with one SGD step (a packed buffer as one tensor); return the momentum state."""
        keys = list(grads)
        lists = [params, grads]
        if self.momentum:
            lists.append([state[f"momentum/{k}"] for k in keys])
        w, g, *momenta = packed.coalesce(keys, *lists)
        d = [t.clone() for t in g]
        if self.weight_decay:
            d_decayed, w_decayed = _decay_targets(self.decay_mask, keys, params, d, w)
            if w_decayed:
                torch._foreach_add_(d_decayed, w_decayed, alpha=self.weight_decay)
        if self.momentum:
            (m,) = momenta
            if step == 0:
                torch._foreach_copy_(m, d)
            else:
                torch._foreach_mul_(m, self.momentum)
                torch._foreach_add_(m, d)
            if self.nesterov:
                torch._foreach_add_(d, m, alpha=self.momentum)
            else:
                d = m
        torch._foreach_add_(w, d, alpha=-self.learning_rate(step))
        return state


def steady_gain(optimizer: object) -> float:
    """The factor by which an optimizer's steps on a constant gradient ``g`` exceed ``η·g``, in the steady state.

    Heavy-ball SGD with momentum ``μ``: ``m_t → g/(1−μ)``, so its steps reach ``η·g/(1−μ)`` (Nesterov's too:
    ``g + μ·g/(1−μ)``); any other optimizer: 1 (Adam's steps are ``η·g/|g|``, whatever the scale of ``g``).
    """
    if isinstance(optimizer, SGD) and optimizer.momentum:
        return 1.0 / (1.0 - optimizer.momentum)
    return 1.0


@dataclass(frozen=True)
class Adam:
    """Adam (Kingma & Ba 2015) with decoupled weight decay (AdamW, Loshchilov & Hutter 2019).

    ``m_t = β₁m + (1−β₁)g``; ``v_t = β₂v + (1−β₂)g²``;
    ``w ← w(1 − ηλ) − η m̂_t / (√v̂_t + ε)`` with bias-corrected ``m̂, v̂``; the factor ``1 − ηλ`` only on
    the keys selected by ``decay_mask`` (:data:`DecayMask`; ``None``: every key).
    """

    lr: Schedule | float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decay_mask: DecayMask | None = None

    def learning_rate(self, step: int) -> float:
        """``η_t`` at ``step``."""
        return self.lr(step) if callable(self.lr) else constant(self.lr)(step)

    def init(self, params: Mapping[str, Tensor]) -> Params:
        """First and second moments ``m = v = 0`` (packed like ``params``, see :mod:`flatbma.packed`)."""
        state = {f"exp_avg/{k}": v for k, v in packed.zeros_like(params).items()}
        state.update({f"exp_avg_sq/{k}": v for k, v in packed.zeros_like(params).items()})
        return state

    @torch.no_grad()
    def apply(self, params: Params, grads: Mapping[str, Tensor], state: Params, step: int) -> Params:
        """Update ``params`` in place with one Adam step (a packed buffer as one tensor); return the moment state."""
        keys = list(grads)
        w, g, m, v = packed.coalesce(
            keys,
            params,
            grads,
            [state[f"exp_avg/{k}"] for k in keys],
            [state[f"exp_avg_sq/{k}"] for k in keys],
        )
        b1, b2 = self.betas
        lr = self.learning_rate(step)
        torch._foreach_lerp_(m, g, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, g, g, value=1 - b2)
        t = step + 1
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, (1 - b2**t) ** 0.5)
        torch._foreach_add_(denom, self.eps)
        if self.weight_decay:
            (w_decayed,) = _decay_targets(self.decay_mask, keys, params, w)
            if w_decayed:
                torch._foreach_mul_(w_decayed, 1 - lr * self.weight_decay)
        torch._foreach_addcdiv_(w, m, denom, value=-lr / (1 - b1**t))
        return state
