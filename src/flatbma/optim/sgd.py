"""Stochastic gradient descent with momentum and coupled weight decay, on tensor dicts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from flatbma import packed
from flatbma.optim.schedules import Schedule, constant
from flatbma.types import Params


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
    """

    lr: Schedule | float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    nesterov: bool = False

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
        """Update ``params`` in place with one SGD step; return the new momentum state.

        Packed parameters, gradients and momenta (:mod:`flatbma.packed`) are updated as one tensor each.
        """
        keys = list(grads)
        lists = [params, grads]
        if self.momentum:
            lists.append([state[f"momentum/{k}"] for k in keys])
        w, g, *momenta = packed.coalesce(keys, *lists)
        d = [t.clone() for t in g]
        if self.weight_decay:
            torch._foreach_add_(d, w, alpha=self.weight_decay)
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


@dataclass(frozen=True)
class Adam:
    """Adam (Kingma & Ba 2015) with decoupled weight decay (AdamW, Loshchilov & Hutter 2019).

    ``m_t = β₁m + (1−β₁)g``; ``v_t = β₂v + (1−β₂)g²``;
    ``w ← w(1 − ηλ) − η m̂_t / (√v̂_t + ε)`` with bias-corrected ``m̂, v̂``.
    """

    lr: Schedule | float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

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
        """Update ``params`` in place with one Adam step; return the new moment state.

        Packed parameters, gradients and moments (:mod:`flatbma.packed`) are updated as one tensor each.
        """
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
            torch._foreach_mul_(w, 1 - lr * self.weight_decay)
        torch._foreach_addcdiv_(w, m, denom, value=-lr / (1 - b1**t))
        return state
