"""fp16's dynamic loss scale for any method: :class:`LossScaled`, a functional ``torch.amp.GradScaler``.

The method's losses are multiplied by a scale ``S`` before differentiation and the gradients divided by it again
(:meth:`flatbma.params.Objective.value_and_grad`), so small fp16 gradients do not underflow. As in ``GradScaler``
(Micikevicius et al., ICLR 2018), a step whose gradient is not finite (in either pass) is skipped whole, its state
restored with ``step`` advanced by one, and ``S`` halved; after ``growth_interval`` finite steps in a row ``S``
doubles. Every step reports ``amp/skipped`` and ``amp/scale``; ``S`` and the count live in the method state's
``aux`` (:data:`SCALE`, :data:`GROWTH`), so checkpoints hold them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flatbma.named import SEP, nest, part, without
from flatbma.params import clone
from flatbma.precision import GradientOverflow, scaling
from flatbma.types import Batch, Params, Posterior, State, StepOutput, view

AMP = "amp"
"""The name the loss scale keeps its state under in ``aux`` (:mod:`flatbma.named`): :data:`SCALE` and :data:`GROWTH`."""
SCALE = AMP + SEP + "scale"
"""``aux`` entry of the loss scale ``S`` (a float32 scalar)."""
GROWTH = AMP + SEP + "growth"
"""``aux`` entry of the number of finite steps since ``S`` last changed (an int64 scalar)."""


@dataclasses.dataclass(frozen=True)
class LossScaled:
    """A dynamic fp16 loss scale around ``method``'s update (see the module doc).

    Args:
        init_scale: the first ``S`` (a power of two: scaling and unscaling are then exact).
        growth_interval: finite steps in a row after which ``S`` doubles.
    """

    init_scale: float = 2.0**16
    growth_interval: int = 2000

    def __call__(self, method: Posterior) -> Posterior:
        """``method`` with its ``init`` adding the scale's entries and its ``update`` run under the scale.

        Every other function of the posterior (``sample``, ``mean``, ...) is given the state without the scale's
        entries (``split`` puts them back into each part).
        """
        hidden = {f: _hiding(getattr(method, f)) for f in ("sample", "mean", "marginal_variance") if getattr(method, f)}
        can = method.can
        hidden_can = {
            f: _hiding(getattr(can, f)) for f in ("gaussian", "functional_variance", "diagnostics") if getattr(can, f)
        }
        split = (lambda state, members: self._split(method, state, members)) if can.split is not None else None
        return dataclasses.replace(
            method,
            init=lambda params, buffers: self._init(method, params, buffers),
            update=lambda state, batch: self._update(method, state, batch),
            can=dataclasses.replace(can, split=split, **hidden_can),
            **hidden,
        )

    def _init(self, method: Posterior, params: Params, buffers: Params) -> State:
        state = method.init(params, buffers)
        device = next(iter(state.params.values())).device if state.params else torch.device("cpu")
        entries = {
            SCALE: torch.tensor(float(self.init_scale), device=device),
            GROWTH: torch.zeros((), dtype=torch.int64, device=device),
        }
        return dataclasses.replace(state, aux={**state.aux, **entries})

    def _update(self, method: Posterior, state: State, batch: Batch) -> tuple[State, StepOutput]:
        scale, growth = state.aux[SCALE], state.aux[GROWTH]
        inner = _without_scale(state)
        before = State(clone(inner.params), clone(inner.buffers), clone(inner.aux), inner.step)
        try:
            with scaling(scale):
                new, out = method.update(inner, batch)
        except GradientOverflow as overflow:  # skip the ascent and the update; halve the scale
            entries = {SCALE: scale * 0.5, GROWTH: torch.zeros_like(growth)}
            kept = dataclasses.replace(before, aux={**before.aux, **entries}, step=state.step + 1)
            stats = {"amp/skipped": torch.ones((), device=scale.device), "amp/scale": scale}
            return kept, StepOutput(overflow.loss, overflow.logits, stats)
        growth = growth + 1
        grow = growth >= self.growth_interval  # a tensor: no host read
        entries = {
            SCALE: torch.where(grow, scale * 2.0, scale),
            GROWTH: torch.where(grow, torch.zeros_like(growth), growth),
        }
        stats = {**(out.stats or {}), "amp/skipped": torch.zeros((), device=scale.device), "amp/scale": scale}
        return dataclasses.replace(new, aux={**new.aux, **entries}), StepOutput(out.loss, out.logits, stats)

    def _split(self, method: Posterior, state: State, members: Sequence[int]) -> State:
        each = method.can.split(_without_scale(state), members)  # type: ignore[misc]
        return dataclasses.replace(each, aux={**each.aux, **_scale_entries(state)})


def _hiding(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function(state, ...)`` called with a :func:`~flatbma.types.view` of the state without the scale's entries."""

    def hidden(state: State, *args: Any) -> Any:
        return function(view(state, "unscaled", state.params, state.buffers, _unscaled(state)), *args)

    return hidden


def _without_scale(state: State) -> State:
    """``state`` without the scale's ``aux`` entries (what the wrapped method knows)."""
    return dataclasses.replace(state, aux=_unscaled(state))


def _unscaled(state: State) -> Params:
    """The ``aux`` of ``state`` without the scale's entries (:func:`flatbma.named.without` of :data:`AMP`)."""
    return without(AMP, state.aux)


def _scale_entries(state: State) -> Params:
    """The scale's ``aux`` entries of ``state`` (its :data:`AMP` component, under its name)."""
    return nest(AMP, part(AMP, state.aux))
