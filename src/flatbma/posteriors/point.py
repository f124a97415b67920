"""Point estimates (MAP): SGD and the sharpness-aware optimizers SAM, ASAM and Fisher-SAM.

The "posterior" is a Dirac mass at ``w``; sampling returns ``w`` (the BMA of a point is the point).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flatbma.optim.ascent import sharpness_aware_value_and_grad
from flatbma.params import Objective, clone
from flatbma.types import Ascent, Batch, GradientTransformation, Params, Posterior, State, StepOutput


def build(objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None = None) -> Posterior:
    """Train a point estimate ``w`` with ``optimizer``, optionally sharpness-aware.

    ``w_{t+1} = opt(w_t, ∇L_B(w_t + ε_t))`` with ``ε_t = ascent.perturb(w_t, ∇L_B(w_t))``
    (``ε_t = 0`` without an ascent step: plain SGD/MAP). With :class:`~flatbma.optim.SAM` this is SAM
    (Foret et al. 2021); with :class:`~flatbma.optim.ASAM`, ASAM; with
    :class:`~flatbma.optim.FisherSAM`, Fisher-SAM.

    Args:
        objective: model and mini-batch loss.
        optimizer: the descent step.
        ascent: the ascent step, or ``None`` for a plain optimizer.
    """

    def init(params: Params, buffers: Params) -> State:
        params = clone(params)
        return State(params=params, buffers=clone(buffers), aux=optimizer.init(params))

    def update(state: State, batch: Batch) -> tuple[State, StepOutput]:
        loss, logits, grads = sharpness_aware_value_and_grad(objective, state.params, state.buffers, batch, ascent)
        aux = optimizer.apply(state.params, grads, state.aux, state.step)
        return replace(state, aux=aux, step=state.step + 1), StepOutput(loss, logits)

    def sample(state: State, n: int, generator: torch.Generator | None = None) -> list[Params]:
        return [{**state.params, **state.buffers}]

    return Posterior(init=init, update=update, sample=sample)
