"""A uniform mixture of ``M`` independently trained posteriors of one family: MultiSWAG, Multi-FP-BMA, ...

``q(w) = (1/M) Σ_m q_m(w)``, each ``q_m`` a posterior of the same family trained independently from its own
initialization on the same data: the multi-basin BMA of Wilson & Izmailov (NeurIPS 2020), whose MultiSWAG is this
mixture of SWAG posteriors. With a flat-seeking family (F-SWAG, FP-BMA) it is an ensemble of flat posteriors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from flatbma.checks import check_int
from flatbma.errors import FlatbmaError
from flatbma.family import Family, Nested, Section, Stage, always
from flatbma.params import Objective
from flatbma.posteriors.members import (
    check_member_memory,
    held,
    member,
    member_initializations,
    member_seed,
    member_state,
    mixture_output,
    prefixed,
    prefixed_members,
    splitter,
    unequal_members,
)
from flatbma.rng import draw_seed, forked_rng, seeded_generator
from flatbma.types import Ascent, Batch, Capabilities, Params, Posterior, Predictive, State, StepOutput


@dataclass(frozen=True)
class Options:
    """A mixture's options (:func:`build`).

    Attributes:
        members: ``M ≥ 1``.
        seed: seed of the members' initializations; ``None`` draws it from the global generator.
    """

    members: int = 5
    seed: int | None = None


def build(
    objective: Objective, base: Posterior | Sequence[Posterior], *, seed_single: bool = False, **options
) -> Posterior:
    """The uniform mixture of ``members`` independently trained posteriors ``base`` (docs/methods.md §3.8).

    ``base`` is the family of every member, or ``members`` posteriors of one family: member ``m``'s own prior, as in
    a two-stage run (MultiSWAG → Multi-FP-BMA) whose member ``m`` takes the first stage's member ``m`` as its prior.

    Member ``m`` starts at the weights of a deep ensemble of ``objective.model``
    (:func:`flatbma.posteriors.members.member_initializations` under ``seed``; ``None``: one draw from torch's global
    generator), or at its own entries of a start whose every key is a member's (``member<m>/...``). Its ``init``
    runs under global generators (restored afterwards) seeded by a hash of ``(seed, m)``, every ``update`` on the
    same mini-batch under ones seeded by ``(s_t, m)``, ``s_t`` one draw per step: no member depends on the others.
    ``update`` reports the mean member loss and the log-predictive ``log (1/M) Σ_m softmax(f_m)``. Sampling is
    round-robin, sample ``i`` from member ``i mod M`` with its generator seeded from ``(s, m)``, ``s`` one draw from
    the caller's generator; ``predict_mode`` (the family's) gets the last member's, ``(s, M − 1)``.

    ``members == 1`` is the family itself, bit for bit, predictive included (keys prefixed ``member0/``; no seed
    drawn unless ``seed_single``). More members average their samples (a linearized predictive is refused); a
    family's ``diagnostics`` are reported per member (``member<m>/...``).

    Mean and width, when the family has them: ``E_q[w] = (1/M) Σ_m μ_m`` (with member 0's buffers) and, by the law
    of total variance, ``Var_q[w_i] = (1/M) Σ_m Var_{q_m}[w_i] + (1/M) Σ_m (μ_{m,i} − μ̄_i)²``. Gaussian members
    give ``gaussian(state)``: every member's ``θ_m`` under its prefix. :attr:`Capabilities.members` ``= M``:
    ``split(state, indices)`` keeps the ``member<m>/`` entries of ``indices``; ``update``, ``sample``, ``mean`` and
    ``marginal_variance`` act on the members a state holds.

    Raises:
        FlatbmaError: ``members < 1``, a ``seed`` that is not a non-negative integer or ``None``, a ``base``
            that is itself a mixture of members, ``base`` posteriors not one per member, or a member-prefixed
            start that does not hold exactly the members ``0..M−1``.
    """
    o = Options(**options)
    members = o.members
    check_int(
        members, f"method.members must be an integer >= 1 (the number of mixture members), got {members!r}", minimum=1
    )
    if o.seed is not None:
        check_int(o.seed, f"method.seed must be a non-negative integer or null, got {o.seed!r}", minimum=0)
    bases = tuple(base) if not isinstance(base, Posterior) else (base,) * members
    if len(bases) != members:
        raise FlatbmaError(f"multi needs one posterior per member: got {len(bases)} for method.members={members}")
    if any(b.can.members for b in bases):
        raise FlatbmaError(
            "method.of is itself a mixture of independent members (an ensemble or multi): "
            "raise method.members instead of nesting mixtures"
        )
    first = bases[0]
    single = members == 1
    if not single and first.can.predictive is not Predictive.SAMPLES:
        raise FlatbmaError(
            f"multi averages its members' samples, but method.of predicts with the network linearized at its mean "
            f"(predictive: {first.can.predictive.value}), one per member: set method.of.predictive: samples, or "
            "method.members: 1"
        )

    def every(hook: str) -> bool:
        return all(getattr(b, hook) is not None for b in bases)

    def bound(f: Callable[..., Any]) -> Callable[..., Any]:
        return partial(f, bases=bases)

    seeded = not single or seed_single
    return Posterior(
        init=partial(init, options=o, bases=bases, model=objective.model, seeded=seeded),
        update=partial(update, bases=bases, seeded=seeded),
        sample=bound(sample),
        predict_mode=bound(predict_mode) if first.predict_mode is not None else None,
        recompute_bn=first.recompute_bn,
        mean=bound(mean) if every("mean") else None,
        marginal_variance=bound(marginal_variance) if every("mean") and every("marginal_variance") else None,
        can=Capabilities(
            gaussian=bound(gaussian) if all(b.can.gaussian is not None for b in bases) else None,
            members=members,
            split=splitter(members),
            predictive=first.can.predictive,
            functional_variance=bound(functional_variance) if single and first.can.functional_variance else None,
            diagnostics=bound(diagnostics) if all(b.can.diagnostics is not None for b in bases) else None,
        ),
    )


def init(
    params: Params,
    buffers: Params,
    *,
    options: Options,
    bases: Sequence[Posterior],
    model: torch.nn.Module,
    seeded: bool,
) -> State:
    """Every member's ``base.init`` of its own start (a member-prefixed one, or :func:`member_initializations`).

    Member ``m`` runs under the seed of ``(seed, m)``; a single member runs on the global generators unless ``seeded``.
    """
    own = _starts(params, buffers, options.members)
    if not seeded:
        p, b = own[0] if own is not None else (params, buffers)
        return _prefixed_state(0, bases[0].init(p, b), State(params={}))
    start = options.seed if options.seed is not None else draw_seed()
    if own is None:
        own = member_initializations(model, params, buffers, options.members, start)
    state = State(params={})
    for m, (p, b) in enumerate(own):
        with forked_rng(member_seed(start, m)):
            state = _prefixed_state(m, bases[m].init(p, b), state)
    return state


def update(state: State, batch: Batch, *, bases: Sequence[Posterior], seeded: bool) -> tuple[State, StepOutput]:
    """Every held member's ``base.update`` on the batch, member ``m`` under the seed of ``(s_t, m)`` (one ``s_t``).

    Not ``seeded`` (a single member): the member's ``base.update`` on the global generators, no ``s_t`` drawn.
    """
    step_seed = draw_seed() if seeded else None  # one draw, whatever the members held
    new, outs = State(params={}, step=state.step + 1), []
    for m in held(state):
        own = member_state(m, state)
        if step_seed is None:
            own, out = bases[m].update(own, batch)
        else:
            with forked_rng(member_seed(step_seed, m)):
                own, out = bases[m].update(own, batch)
        new = _prefixed_state(m, own, new)
        outs.append(out)
    return new, mixture_output(outs)


def sample(
    state: State, n: int, generator: torch.Generator | None = None, *, bases: Sequence[Posterior]
) -> list[Params]:
    """Round-robin over the held members, member ``m`` drawing from its generator of ``(s, m)`` (``s`` one draw)."""
    if n < 1:
        raise FlatbmaError(f"the number of samples must be >= 1 (eval.num_samples), got {n}")
    if len(bases) == 1:
        return bases[0].sample(member_state(0, state), n, generator)
    seed = draw_seed(generator)
    device = generator.device if generator is not None else torch.device("cpu")
    drawn = []
    for m in held(state):
        count = max(0, math.ceil((n - m) / len(bases)))
        own = seeded_generator(seed, m, device)
        drawn.append(bases[m].sample(member_state(m, state), count, own) if count else [])
    return [samples[i] for i in range(max(map(len, drawn), default=0)) for samples in drawn if i < len(samples)]


def predict_mode(
    model: torch.nn.Module, generator: torch.Generator | None = None, *, bases: Sequence[Posterior]
) -> AbstractContextManager[Any]:
    """The family's prediction mode, entered with the generator of the last member, ``(s, M − 1)`` (:func:`sample`)."""
    last = bases[-1]
    if len(bases) > 1 and generator is not None:
        generator = seeded_generator(draw_seed(generator), len(bases) - 1, generator.device)
    return last.predict_mode(model, generator)  # type: ignore[misc]


def mean(state: State, *, bases: Sequence[Posterior]) -> Params:
    """``(1/M) Σ_m μ_m`` over the held members (the first's buffers)."""
    means = [bases[m].mean(member_state(m, state)) for m in held(state)]  # type: ignore[misc]
    buffers = set(member(held(state)[0], state.buffers))
    return {k: v if k in buffers else torch.stack([mu[k] for mu in means]).mean(0) for k, v in means[0].items()}


def marginal_variance(state: State, *, bases: Sequence[Posterior]) -> Params:
    """``(1/M) Σ_m Var_{q_m}[w] + (1/M) Σ_m (μ_m − μ̄)²`` (the law of total variance) over the held members."""
    means, variances = [], []
    for m in held(state):
        own = member_state(m, state)
        means.append(bases[m].mean(own))  # type: ignore[misc]
        variances.append(bases[m].marginal_variance(own))  # type: ignore[misc]
    total = {}
    for k in variances[0]:
        mu = torch.stack([x[k] for x in means])
        within = torch.stack([v[k] for v in variances]).mean(0)
        total[k] = within + (mu - mu.mean(0)).square().mean(0)
    return total


def gaussian(state: State, *, bases: Sequence[Posterior]) -> Params:
    """Every held member's ``θ_m`` under its prefix ``member<m>/``."""
    theta: Params = {}
    for m in held(state):
        theta.update(prefixed(m, bases[m].can.gaussian(member_state(m, state))))  # type: ignore[misc]
    return theta


def functional_variance(state: State, jac: Params, *, bases: Sequence[Posterior]) -> torch.Tensor:
    """The single member's ``diag(J Σ Jᵀ)``."""
    return bases[0].can.functional_variance(member_state(0, state), jac)  # type: ignore[misc]


def diagnostics(state: State, *, bases: Sequence[Posterior]) -> dict[str, float]:
    """The single member's diagnostics, or every held member's under ``member<m>/``."""
    if len(bases) == 1:
        return bases[0].can.diagnostics(member_state(0, state))  # type: ignore[misc]
    each = {m: bases[m].can.diagnostics(member_state(m, state)) for m in held(state)}  # type: ignore[misc]
    return {f"member{m}/{k}": v for m, values in each.items() for k, v in values.items()}  # type: ignore[misc]


def _starts(params: Params, buffers: Params, members: int) -> list[tuple[Params, Params]] | None:
    """Every member's own ``(params, buffers)`` in a member-prefixed start; ``None`` for model weights."""
    found = prefixed_members(params)
    if found is None:
        return None
    if found != list(range(members)):
        raise FlatbmaError(
            f"the start holds members {found} but method.members is {members}: start a mixture at a posterior "
            "of as many members (a prior stage with the same members)"
        )
    own_buffers = prefixed_members(buffers) is not None  # else the buffers are the model's, every member's
    return [(member(m, params), member(m, buffers) if own_buffers else buffers) for m in range(members)]


def member_thetas(theta: Params, count: int) -> list[Params]:
    """Member ``m``'s ``θ_m`` of a mixture's ``θ`` (its :attr:`~flatbma.types.Capabilities.gaussian`), ``m < count``.

    Raises:
        FlatbmaError: ``θ`` holds other members than ``0..count−1`` (or is no mixture's).
    """
    found = prefixed_members(dict(theta))
    if found != list(range(count)):
        raise FlatbmaError(
            f"the fitted prior holds members {found} but method.members is {count}: a mixture's prior stage "
            "must be a mixture of as many members"
        )
    return [member(m, theta) for m in range(count)]


def _prefixed_state(m: int, own: State, into: State) -> State:
    """``into`` with member ``m``'s state ``own`` added under its prefix (``into``'s step kept)."""
    return State(
        params={**into.params, **prefixed(m, own.params)},
        buffers={**into.buffers, **prefixed(m, own.buffers)},
        aux={**into.aux, **prefixed(m, own.aux)},
        step=into.step,
    )


def build_of(
    objective: Objective, optimizer: Any, ascent: Ascent | None = None, *, of: Section | None = None, **options: Any
) -> Posterior:
    """:func:`build` of posteriors of the method ``of`` (a method section).

    ``options`` are those of :class:`Options`. ``ascent`` is unused: the members' ascent step is part of ``of``.
    """
    if of is None:
        raise FlatbmaError("method.of must name the members' method, e.g. of: {name: swag} (see 'flatbma methods')")
    return build(objective, of.build(objective, optimizer), **options)


def build_of_with_prior(
    objective: Objective,
    optimizer: Any,
    ascent: Ascent | None,
    prior_theta: Mapping[str, Tensor],
    *,
    of: Section | None = None,
    **options: Any,
) -> Posterior:
    """:func:`build_of` whose member ``m`` has its own prior: member ``m``'s Gaussian in ``prior_theta``.

    ``prior_theta`` is a mixture's ``θ`` (member ``m``'s under ``member<m>/``), fitted by the per-member first
    stage; member ``m`` is ``of`` built with its ``θ_m`` (:func:`member_thetas`) as its prior.
    """
    if of is None:
        return build_of(objective, optimizer, ascent, of=of, **options)  # its refusal
    thetas = member_thetas(dict(prior_theta), Options(**options).members)
    return build(objective, [of.build(objective, optimizer, theta) for theta in thetas], **options)


def check_members(method: Section, stage: Stage) -> None:
    """``multi``: its members fit in memory (:func:`check_member_memory`) and check the stage (``method.of.*``).

    With several members, a linearized predictive of ``of`` (Laplace's ``glm`` or ``probit``) is refused.
    """
    check_member_memory(method, stage, "members")
    of = method.options["of"]
    if of is not None:
        of.check(dataclasses.replace(stage, method_key=f"{stage.method_key}.of"))
        linearized = of.options.get("predictive", Predictive.SAMPLES) is not Predictive.SAMPLES
        if linearized and method.options["members"] > 1:
            raise FlatbmaError(
                f"{method.name} averages its members' samples, but {stage.key('of')} predicts with the network "
                f"linearized at its mean (predictive: {Predictive(of.options['predictive']).value}): set "
                f"{stage.key('of.predictive')}: samples, or {stage.key('members')}: 1"
            )


def advice(method: Section, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """What to change when a mixture is worse than its member 0 (:attr:`Family.advice`): its members' method's."""
    of = method.options.get("of")
    return f"of.{of.advice(prior, diagnostics)}" if of is not None else unequal_members(method, prior, {})


def mixture(of: str | None) -> Family:
    """The mixture family whose members' method is ``of`` unless the section names one (:mod:`flatbma.methods`).

    ``multi`` names none, MultiSWAG ``swag``, Multi-FP-BMA ``fp-bma``.
    """
    return Family(
        build_of,
        Options,
        of=Nested(of, members=True),
        with_prior=build_of_with_prior,
        check=check_members,
        needs_weights=always,
        advice=advice,
    )
