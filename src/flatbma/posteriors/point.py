"""Point estimates (MAP): SGD and the sharpness-aware optimizers SAM, ASAM and Fisher-SAM.

The "posterior" is a Dirac mass at ``w``: sampling and the mean return ``w``, the width is 0.

State: ``params`` = ``w``, ``buffers`` = the model's buffers, ``aux`` = the optimizer's state under
``optimizer/`` (SGD's ``optimizer/momentum/<w>``; Adam's ``optimizer/exp_avg/<w>``, ``optimizer/exp_avg_sq/<w>``)
and an amortized ascent step's memory under ``ascent/`` (:mod:`flatbma.named`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

from flatbma.family import Family
from flatbma.named import OPTIMIZER, chain, part
from flatbma.optim.ascent import ascent_memory, has_memory, memory_entries, memory_of, sharpness_aware_value_and_grad
from flatbma.params import Objective, clone
from flatbma.types import Ascent, Batch, GradientTransformation, Params, Posterior, State, StepOutput


@dataclass(frozen=True)
class Options:
    """A point estimate has no options of its own: its optimizer and ascent step are the whole method."""


NAME = "point"
"""The name a composed method keeps a point update's state under in its ``aux`` (:mod:`flatbma.named`): SWAG's
trajectory and Laplace's MAP. A point method's own state is that state alone, without a name."""


def build(
    objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None = None, **options
) -> Posterior:
    """Train a point estimate ``w`` with ``optimizer``, optionally sharpness-aware.

    ``w_{t+1} = opt(w_t, ∇L_B(w_t + ε_t))`` with ``ε_t = ascent.perturb(w_t, ∇L_B(w_t))`` (``ε_t = 0`` without an
    ascent step: plain SGD/MAP); with one, SAM (Foret et al. 2021), ASAM or Fisher-SAM (docs/methods.md §4.2), each
    with its second pass every ``k`` steps under :class:`~flatbma.optim.Amortized` (memory in ``aux``). No ``options``.
    """
    Options(**options)
    return Posterior(
        init=partial(init, optimizer=optimizer, ascent=ascent),
        update=partial(update, objective=objective, optimizer=optimizer, ascent=ascent),
        sample=sample,
        mean=weights_of,
        marginal_variance=zero_variance,
    )


def init(params: Params, buffers: Params, *, optimizer: GradientTransformation, ascent: Ascent | None) -> State:
    """``w₀ = params`` (copied), the buffers, the optimizer's state and the ascent step's memory (:func:`init_aux`)."""
    params = clone(params)
    return State(params=params, buffers=clone(buffers), aux=init_aux(optimizer, ascent, params))


def update(
    state: State,
    batch: Batch,
    *,
    objective: Objective,
    optimizer: GradientTransformation,
    ascent: Ascent | None,
) -> tuple[State, StepOutput]:
    """One step of :func:`build` (:func:`step` on the state's weights, in place)."""
    aux, out = step(objective, optimizer, ascent, state.params, state.buffers, state.aux, state.step, batch)
    return replace(state, aux=aux, step=state.step + 1), out


def sample(state: State, n: int, generator: torch.Generator | None = None) -> list[Params]:
    """The point ``w`` with its buffers, once whatever ``n``: the BMA of a point is the point."""
    return [{**state.params, **state.buffers}]


def weights_of(state: State) -> Params:
    """The point ``w`` with its buffers: the mean of a Dirac posterior (:attr:`Posterior.mean`)."""
    return {**state.params, **state.buffers}


def zero_variance(state: State) -> Params:
    """``0`` for every trained weight: a Dirac posterior has no width (:attr:`Posterior.marginal_variance`)."""
    return {k: torch.zeros_like(v) for k, v in state.params.items()}


def init_aux(optimizer: GradientTransformation, ascent: Ascent | None, params: Params) -> Params:
    """The ``aux`` of a point trained by :func:`step`: the optimizer's state (``optimizer/``), the ascent memory."""
    return {**chain((OPTIMIZER, optimizer.init(params))), **ascent_memory(ascent, params)}


def step(
    objective: Objective,
    optimizer: GradientTransformation,
    ascent: Ascent | None,
    params: Params,
    buffers: Params,
    opt_state: Params,
    step: int,
    batch: Batch,
) -> tuple[Params, StepOutput]:
    """One (sharpness-aware) optimizer step on ``params``, in place: the update of :func:`build`.

    ``buffers`` are updated in place too (BatchNorm in train mode); ``opt_state`` is the optimizer state of ``params``
    and the ascent step's memory (:func:`init_aux`); ``step`` the index of this step (schedules, bias corrections).

    Returns:
        ``(new optimizer state, StepOutput(L_B(w), logits at w))``.
    """
    memory = memory_of(opt_state) if has_memory(ascent) else None
    loss, logits, grads = sharpness_aware_value_and_grad(objective, params, buffers, batch, ascent, memory)
    new_state = chain((OPTIMIZER, optimizer.apply(params, grads, part(OPTIMIZER, opt_state), step)))
    if memory is not None:  # updated in place
        new_state = {**new_state, **memory_entries(opt_state)}
    return new_state, StepOutput(loss, logits)


FAMILY = Family(build, Options)
"""The point estimates: SGD and, with an ascent step, SAM, ASAM, Fisher-SAM (:mod:`flatbma.methods`)."""
