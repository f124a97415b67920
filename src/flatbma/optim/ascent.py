"""The shared perturb-then-descend logic of the sharpness-aware family.

Every flat-seeking method takes the descent gradient at a perturbed point ``params + ε``,
``ε = ascent.perturb(params, g)``; :func:`two_pass` is that step for any gradient function (of the weights here, of
``θ`` in :func:`flatbma.posteriors.gaussian_vi.theta_sharpness_value_and_grad`).

An ascent step that schedules its second pass (:class:`flatbma.optim.Amortized`) keeps a *memory*: tensors stored
in the method state's ``aux`` under :data:`MEMORY` (:func:`ascent_memory`), handed back at every step
(:func:`memory_of`) and updated in place, so checkpoints hold it. Stateless steps add no entries.

Precision: under bf16/fp16 only the forward computations run under autocast; the gradients are float32, and ``ε``,
its norms and ``x + ε`` are computed in float32 outside autocast. Under fp16's loss scale an overflowing first
pass raises :class:`flatbma.precision.GradientOverflow` before ``perturb`` sees its gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from flatbma.checks import check_number
from flatbma.named import SEP, nest, part
from flatbma.params import Objective, add
from flatbma.precision import GradientOverflow
from flatbma.types import Ascent, Batch, Params

TINY = 1e-12
"""Added to norms before dividing, so that a zero gradient gives a zero perturbation."""

ASCENT = "ascent"
"""Name of the ascent step's component of ``aux`` (:mod:`flatbma.named`): its memory (none for a stateless step)."""
MEMORY = ASCENT + SEP
"""Prefix of the ``aux`` entries that hold an ascent step's memory."""

Gradient = Callable[[Mapping[str, Tensor], Batch, bool], tuple[Tensor, Tensor, Mapping[str, Tensor]]]
"""``gradient(point, batch, first) -> (loss, logits, ∇L_batch(point))``. ``first`` marks the pass at the
unperturbed point, the only one allowed to update BatchNorm running statistics."""


def check_radius(rho: float, name: str = "rho") -> None:
    """Raise a :class:`FlatbmaError` unless ``rho`` is a positive finite number."""
    message = f"{name} must be a positive number (the ascent radius), got {rho!r}"
    check_number(rho, message, low=0, low_open=True, high=math.inf, high_open=True)


def has_memory(ascent: Ascent | None) -> bool:
    """Whether ``ascent`` schedules its second pass and keeps a memory (``init`` and ``descent_gradient``)."""
    return hasattr(ascent, "descent_gradient")


def needs_sample(ascent: Ascent | None) -> bool:
    """Whether ``ascent`` is taken from the drawn weight sample (``perturb_sample(θ, w)``), not a first pass."""
    return bool(getattr(ascent, "needs_sample", False))


def ascent_memory(ascent: Ascent | None, params: Mapping[str, Tensor], name: str = ASCENT) -> Params:
    """The initial memory of ``ascent`` for ``params`` under the component ``name``: ``{}`` for a stateless step."""
    if not has_memory(ascent):
        return {}
    return nest(name, ascent.init(params))  # type: ignore[union-attr]


def memory_entries(aux: Mapping[str, Tensor], name: str = ASCENT) -> Params:
    """The ``aux`` entries of the component ``name``, keys as stored: what a method carries past its optimizer."""
    return nest(name, part(name, aux))


def memory_of(aux: Mapping[str, Tensor], name: str = ASCENT) -> Params | None:
    """The memory of the component ``name`` of ``aux``, without its name (the same tensors); ``None`` if none."""
    return part(name, aux) or None


def two_pass(
    gradient: Gradient,
    params: Mapping[str, Tensor],
    batch: Batch,
    ascent: Ascent | None,
    memory: Mapping[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Mapping[str, Tensor]]:
    """Loss and logits at ``x = params`` and the sharpness-aware descent gradient, for any gradient function.

    First pass ``g = ∇L_B(x)`` (``gradient(x, batch, True)``). Without an ascent step the result is ``g``;
    otherwise ``ε = ascent.perturb(x, g)`` and the second pass ``gradient(x + ε, batch, False)`` gives the
    result (Foret et al., ICLR 2021). An ascent step with a memory (:func:`has_memory`) decides itself whether
    and on what to take the second pass (``ascent.descent_gradient``).

    Returns:
        ``(L_B(x), logits at x, descent gradient)``.
    """
    loss, logits, grads = gradient(params, batch, True)
    if ascent is None:
        return loss, logits, grads
    try:
        if has_memory(ascent):
            return loss, logits, ascent.descent_gradient(gradient, params, batch, grads, memory)  # type: ignore[attr-defined]
        _, grads = ascended(gradient, params, batch, ascent, grads)
    except GradientOverflow:  # the second pass's: the skipped step reports the unperturbed pass, as any step
        raise GradientOverflow(loss, logits) from None
    return loss, logits, grads


def ascended(
    gradient: Gradient, params: Mapping[str, Tensor], batch: Batch, ascent: Ascent, grads: Mapping[str, Tensor]
) -> tuple[Mapping[str, Tensor], Mapping[str, Tensor]]:
    """``(ε, ∇L_batch(x + ε))`` with ``ε = ascent.perturb(x, grads)``: the second pass of :func:`two_pass`."""
    eps = ascent.perturb(params, grads)
    with torch.no_grad():
        perturbed = add(params, eps)
    _, _, grads = gradient(perturbed, batch, False)
    return eps, grads


def sharpness_aware_value_and_grad(
    objective: Objective,
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    batch: Batch,
    ascent: Ascent | None,
    memory: Mapping[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Params]:
    """Loss and logits at ``w`` and the descent gradient ``∇L_B(w + ε)``: :func:`two_pass` on the weights.

    BatchNorm running statistics are updated by the first pass only, once. ``memory``: the ascent step's memory
    (:func:`memory_of`), for a step that has one.

    Returns:
        ``(L_B(w), logits at w, gradient)``.
    """

    def gradient(point: Mapping[str, Tensor], part: Batch, first: bool) -> tuple[Tensor, Tensor, Params]:
        return objective.value_and_grad(point, buffers, part, update_buffers=first)

    return two_pass(gradient, params, batch, ascent, memory)  # type: ignore[return-value]
