"""Mixed precision (``train.precision``): which computations run in bf16/fp16 and which keep fp32 or fp64.

With :attr:`Precision.BF16` or :attr:`Precision.FP16` only the model's forward passes run under
:func:`torch.autocast` (:func:`autocast`): in training (:meth:`flatbma.params.Objective.logits`), BatchNorm
recomputation and the BMA's predictions. The logits leave the forward pass as float32 (:func:`as_float32`),
so losses, log-softmax, the BMA's ``logsumexp`` and the metrics keep float32 or float64.

Everything else keeps its precision, outside autocast:

* trained variables, gradients and optimizer state: float32;
* the ascent steps' perturbation ``ε = ρ g/‖g‖`` (:mod:`flatbma.optim.ascent`): float32 norms;
* FisherBall's conjugate-gradient Fisher solve (:mod:`flatbma.optim.fisher_ball`): float64;
* the Gaussian closed forms: KLs, log-densities and Woodbury algebra in float64, the sampler in float32;
* Laplace curvature, Hessian-vector products and Lanczos (:func:`full_precision`, :func:`outside_autocast`), so
  Lanczos stays orthogonal.

fp16 also needs a loss scale, as small gradients underflow: :class:`flatbma.optim.LossScaled` keeps a dynamic
power-of-two scale ``S`` (:func:`scaling`); a non-finite gradient raises :class:`GradientOverflow` at once and
the step is skipped (no ascent, no update, the scale halved).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from enum import Enum
from typing import ParamSpec, TypeVar

import torch
from torch import Tensor

P = ParamSpec("P")
R = TypeVar("R")


class Precision(str, Enum):
    """The precision of the model's forward passes (``train.precision``; strings and members are accepted)."""

    FP32 = "fp32"
    """float32 throughout: no autocast (the default)."""
    BF16 = "bf16"
    """Forward passes under autocast to bfloat16 (float32's exponent range: no loss scale needed)."""
    FP16 = "fp16"
    """Forward passes under autocast to float16, with a dynamic loss scale (:class:`flatbma.optim.LossScaled`)."""

    @property
    def dtype(self) -> torch.dtype:
        """The autocast dtype (``torch.float32`` for :attr:`FP32`)."""
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]


def autocast(precision: Precision | str | None, device: torch.device | str) -> contextlib.AbstractContextManager:
    """:func:`torch.autocast` to ``precision``'s dtype on ``device``'s type; no context for fp32 (or ``None``)."""
    if precision is None or Precision(precision) is Precision.FP32:
        return contextlib.nullcontext()
    device_type = torch.device(device).type
    return torch.autocast(device_type, dtype=Precision(precision).dtype)


def full_precision(device: torch.device | str) -> contextlib.AbstractContextManager:
    """Autocast switched off on ``device``'s type within the block (for computations that need fp32/fp64)."""
    return torch.autocast(torch.device(device).type, enabled=False)


def outside_autocast(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` run with autocast switched off on the CPU and, where there is one, the GPU."""

    @functools.wraps(function)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
        with contextlib.ExitStack() as stack:
            for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
                stack.enter_context(full_precision(device))
            return function(*args, **kwargs)

    return wrapped


def as_float32(logits: Tensor) -> Tensor:
    """``logits`` in float32 when autocast made them bf16/fp16; other tensors are returned as they are (same object)."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


class GradientOverflow(Exception):
    """A gradient under a loss scale that is not finite: the step is skipped (:class:`flatbma.optim.LossScaled`).

    Attributes:
        loss: the unscaled loss of the pass whose gradient overflowed (finite or not).
        logits: that pass's logits.
    """

    def __init__(self, loss: Tensor, logits: Tensor) -> None:
        super().__init__("a gradient under the fp16 loss scale is not finite")
        self.loss, self.logits = loss, logits


_scale: contextvars.ContextVar[Tensor | None] = contextvars.ContextVar("flatbma_loss_scale", default=None)


def loss_scale() -> Tensor | None:
    """The loss scale of the update in progress (:func:`scaling`), or ``None`` outside one."""
    return _scale.get()


@contextlib.contextmanager
def scaling(scale: Tensor) -> Iterator[None]:
    """Within the block, :meth:`flatbma.params.Objective.value_and_grad` differentiates ``scale·L`` and unscales."""
    token = _scale.set(scale)
    try:
        yield
    finally:
        _scale.reset(token)


def all_finite(tensors: list[Tensor]) -> bool:
    """Whether every entry of every tensor is finite (one host read: a synchronization on a GPU)."""
    if not tensors:
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())
