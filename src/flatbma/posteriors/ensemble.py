"""Deep ensembles (Lakshminarayanan et al., NeurIPS 2017) and F-ensembles (Nguyen et al. 2023).

``M`` independently initialized networks trained on the same data; the BMA is their uniform mixture
``p(y|x) = (1/M) Σ_m softmax(f(x; w_m))``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn

from flatbma.checks import check_int
from flatbma.errors import FlatbmaError
from flatbma.params import Objective
from flatbma.posteriors import point
from flatbma.posteriors.members import (
    held,
    member,
    member_initializations,
    member_seed,
    mixture_output,
    prefixed,
    splitter,
)
from flatbma.rng import draw_seed, forked_rng
from flatbma.types import Ascent, Batch, GradientTransformation, Params, Posterior, State, StepOutput


@dataclass(frozen=True)
class Options:
    """A deep ensemble's options (:func:`build`).

    Attributes:
        size: number of members ``M``.
        seed: seed of the members' initializations; ``None`` draws it from the global generator.
    """

    size: int = 5
    seed: int | None = None


def build(
    objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None = None, **options
) -> Posterior:
    """A deep ensemble of ``size`` members, each trained like :func:`flatbma.posteriors.point.build`.

    Every member ``m`` takes the step ``w^m_{t+1} = opt(w^m_t, ∇L_B(w^m_t + ε^m_t))`` with
    ``ε^m_t = ascent.perturb(w^m_t, ∇L_B(w^m_t))`` on the same mini-batch ``B`` (``ε = 0`` without an
    ascent step; with SAM this is the F-ensemble of Nguyen et al. 2023). Diversity comes from the
    independent initializations (and dropout masks, if any); the data order is shared.

    Initialization (``init``): member 0 is the given ``params``. For member ``m ≥ 1``, every module of
    ``objective.model`` that has ``reset_parameters`` and whose parameters are all in the trainable
    set (the keys of ``params``) is re-initialized under a seed drawn from ``seed`` (``None``: one integer
    drawn from torch's global generator at ``init``, so that runs with different seeds have different
    members, as their member 0 differs); the rest — frozen
    (pretrained) parts, and trainable parameters of modules without ``reset_parameters`` — is shared
    with member 0. The buffers of re-initialized modules (BatchNorm statistics) are reset with them.
    The template module's weights are restored afterwards.

    State layout: ``params["member<m>/<name>"]``, ``buffers["member<m>/<name>"]`` (each member keeps
    its own BatchNorm statistics) and ``aux["member<m>/<optimizer key>"]`` (each its own momentum, and
    its own ascent memory when the ascent step has one: :func:`flatbma.posteriors.point.init_aux`).

    Randomness of a step (dropout masks): ``update`` draws one integer ``s_t`` from torch's global
    generator and runs member ``m``'s step with the global generators seeded by a hash of
    ``(s_t, m)`` (restored afterwards), so member ``m``'s draws do not depend on the other members.

    ``update`` reports the mean member loss and, as logits, the ensemble's predictive log-probabilities
    ``log (1/M) Σ_m softmax(f(x; w^m))`` (their argmax is the ensemble's prediction).
    ``sample(state, n, generator)`` returns the first ``min(n, size)`` members (a BMA over the whole
    ensemble needs ``n >= size``); the generator is not used.

    The members are the posterior's independent components (:attr:`Posterior.members` ``= size``):
    ``split(state, indices)`` keeps the ``member<m>/`` entries of the members ``indices``; ``update``
    and ``sample`` act on the members a state holds (all of them, or a split's), with the mean loss
    and mixture predictive over those, which is what ``train.parallel: members`` spreads over processes.

    Args:
        objective: model and mini-batch loss.
        optimizer: the descent step of every member.
        ascent: the ascent step (SAM for F-ensembles), or ``None``.
        options: the fields of :class:`Options`.

    Raises:
        FlatbmaError: ``size < 1`` or a ``seed`` that is not a non-negative integer or ``None``.
    """
    o = Options(**options)
    check_int(
        o.size, f"method.size must be an integer >= 1 (the number of ensemble members), got {o.size!r}", minimum=1
    )
    if o.seed is not None:
        check_int(o.seed, f"method.seed must be a non-negative integer or null, got {o.seed!r}", minimum=0)
    return Posterior(
        init=partial(init, options=o, model=objective.model, optimizer=optimizer, ascent=ascent),
        update=partial(update, objective=objective, optimizer=optimizer, ascent=ascent),
        sample=sample,
        members=o.size,
        split=splitter(o.size),
    )


def init(
    params: Params,
    buffers: Params,
    *,
    options: Options,
    model: nn.Module,
    optimizer: GradientTransformation,
    ascent: Ascent | None,
) -> State:
    """Every member's weights (:func:`~flatbma.posteriors.members.member_initializations`) and optimizer state."""
    base = options.seed if options.seed is not None else draw_seed()
    state_params: Params = {}
    state_buffers: Params = {}
    aux: Params = {}
    for m, (p, b) in enumerate(member_initializations(model, params, buffers, options.size, base)):
        state_params.update(prefixed(m, p))
        state_buffers.update(prefixed(m, b))
        aux.update(prefixed(m, point.init_aux(optimizer, ascent, p)))
    return State(params=state_params, buffers=state_buffers, aux=aux)


def update(
    state: State,
    batch: Batch,
    *,
    objective: Objective,
    optimizer: GradientTransformation,
    ascent: Ascent | None,
) -> tuple[State, StepOutput]:
    """:func:`flatbma.posteriors.point.step` of every held member, member ``m`` under the seed of ``(s_t, m)``."""
    aux: Params = {}
    outs = []
    step_seed = draw_seed()  # one draw, whatever the members
    for m in held(state):
        p, b, o = (member(m, d) for d in (state.params, state.buffers, state.aux))
        with forked_rng(member_seed(step_seed, m)):
            o, out = point.step(objective, optimizer, ascent, p, b, o, state.step, batch)
        aux.update(prefixed(m, o))
        outs.append(out)
    return replace(state, aux=aux, step=state.step + 1), mixture_output(outs)


def sample(state: State, n: int, generator: torch.Generator | None = None) -> list[Params]:
    """The first ``min(n, M)`` held members' weights with their buffers (``generator`` unused)."""
    if n < 1:
        raise FlatbmaError(f"the number of samples must be >= 1 (eval.num_samples), got {n}")
    return [{**member(m, state.params), **member(m, state.buffers)} for m in held(state)[:n]]
