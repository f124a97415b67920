"""Mixed precision (``train.precision``): which computations run in bf16/fp16 and which keep fp32 or fp64.

With :attr:`Precision.BF16` or :attr:`Precision.FP16` only the model's forward passes run under
:func:`torch.autocast` (:func:`autocast`): in training (:meth:`flatbma.params.Objective.logits`, both
passes of a sharpness-aware step), in BatchNorm recomputation and in the BMA's predictions
(:mod:`flatbma.predict` through :class:`flatbma.predictor.BMA` and :mod:`flatbma.experiment.run.evaluate`).
There matrix products and convolutions take the lower dtype and the ops that autocast keeps in float32
stay there; the logits leave the forward pass as float32 (:func:`as_float32`), so losses, log-softmax,
the BMA's ``logsumexp`` and the metrics are float32 (or float64 where they were before).

Everything else keeps its precision, outside autocast:

* the trained variables, their gradients and every optimizer's state: float32 (autocast differentiates
  back to the float32 parameters);
* the ascent steps' perturbation (:mod:`flatbma.optim.ascent`): ``ε = ρ g/‖g‖`` and its kin take norms
  and ratios of float32 gradients — in bf16 (8 significant bits) the norm of a many-million-entry
  gradient would be off by more than the radius' own precision;
* FisherBall's Fisher solve (:mod:`flatbma.optim.fisher_ball`): float64, as always — conjugate gradients
  on a damped Fisher whose scales span orders of magnitude lose their residual test in float32 already;
* the Gaussian closed forms (:mod:`flatbma.gaussian`): the KL divergences, log-densities and their
  Woodbury algebra in float64 (their trace terms cancel parts of size ``‖Ũ‖² ≫ 1``), the sampler and its
  pullback in the variables' float32 — a bf16 log-determinant would have about three significant digits;
* the Laplace family's curvature and the flatness protocol's Hessian-vector products
  (:mod:`flatbma.flatness.hvp` and :mod:`flatbma.flatness.lanczos` turn autocast off, :func:`full_precision`,
  :func:`outside_autocast`): Lanczos needs float32 or float64 products to keep its vectors orthogonal.

fp16 (5 exponent bits) also needs a loss scale: gradients of small losses underflow to zero in fp16
activations. :class:`flatbma.optim.LossScaled` keeps a dynamic scale ``S`` in the method state; during its
update the forward passes' losses are multiplied by ``S`` (:func:`scaling`, read by
:meth:`flatbma.params.Objective.value_and_grad`) and the gradients divided by it again (``S`` is a power of
two: both are exact). A gradient that is not finite raises :class:`GradientOverflow` at once — before an
ascent step could use it — and the step is skipped: no ascent, no update, the scale halved.
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
    """float32 throughout: no autocast (the default; every run before this option existed)."""
    BF16 = "bf16"
    """Forward passes under autocast to bfloat16 (float32's exponent range: no loss scale needed)."""
    FP16 = "fp16"
    """Forward passes under autocast to float16, with a dynamic loss scale (:class:`flatbma.optim.LossScaled`)."""

    @property
    def dtype(self) -> torch.dtype:
        """The autocast dtype (``torch.float32`` for :attr:`FP32`)."""
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]


def autocast(precision: Precision | str | None, device: torch.device | str) -> contextlib.AbstractContextManager:
    """:func:`torch.autocast` to ``precision``'s dtype on ``device``'s type; no context at all for fp32 (or ``None``).

    fp32 enters nothing, so that a run at the default precision executes exactly the operations it did
    before this setting existed.
    """
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
