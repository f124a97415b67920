"""A uniform mixture of ``M`` independently trained posteriors of one family: MultiSWAG, Multi-FP-BMA, ...

``q(w) = (1/M) Σ_m q_m(w)``, each component ``q_m`` a posterior of the same family trained from its own
initialization on the same data, without interacting — the multi-basin BMA of Wilson & Izmailov
(NeurIPS 2020, "Bayesian deep learning and a probabilistic perspective of generalization"), whose
MultiSWAG is this mixture of SWAG posteriors. With a flat-seeking family (F-SWAG, FP-BMA) it is an
ensemble of flat posteriors: flatness within basins, diversity across them.
"""

from __future__ import annotations

import math

import torch

from flatbma.checks import check_int
from flatbma.errors import FlatbmaError
from flatbma.params import Objective
from flatbma.posteriors.members import (
    held,
    member,
    member_initializations,
    member_seed,
    member_state,
    mixture_output,
    prefixed,
    splitter,
)
from flatbma.rng import draw_seed, forked_rng, seeded_generator
from flatbma.types import Batch, Params, Posterior, Predictive, State, StepOutput


def build(objective: Objective, base: Posterior, *, members: int = 5, seed: int | None = None) -> Posterior:
    """The uniform mixture of ``members`` independently trained posteriors ``base``.

    Initialization (``init``): member ``m``'s starting weights are those of a deep ensemble
    (:func:`flatbma.posteriors.members.member_initializations`: member 0 the given ones, member ``m ≥ 1``
    every fully trainable module of ``objective.model`` re-initialized under a seed drawn from ``seed``;
    ``None``: one integer drawn from torch's global generator), and its state is ``base.init`` of them,
    run with torch's global generators seeded by a hash of ``(seed, m)`` (restored afterwards).

    Training (``update``): every member takes ``base.update`` on the same mini-batch. The step draws one
    integer ``s_t`` from torch's global generator and runs member ``m``'s update with the global
    generators seeded by a hash of ``(s_t, m)``, so member ``m``'s draws do not depend on the other
    members. It reports the mean member loss and the mixture's log-predictive
    ``log (1/M) Σ_m softmax(f_m)`` (:func:`~flatbma.posteriors.members.mixture_output`).

    Sampling (``sample(state, n, g)``): round-robin over the members — sample ``i`` comes from member
    ``i mod M``, so member ``m`` gives ``⌈(n − m)/M⌉`` samples (none when ``n ≤ m``; a point-estimate
    family gives its one point). One integer ``s`` is drawn from ``g`` and member ``m`` samples with its
    own generator seeded from ``(s, m)`` (:func:`flatbma.rng.seeded_generator`), so a member's samples do
    not depend on the others. The samples' BatchNorm statistics and prediction mode are the family's
    (``recompute_bn``, ``predict_mode``).

    ``members == 1`` is the family itself, bit for bit: no seed is drawn and ``base`` runs on the global
    generators directly (the state's keys carry the ``member0/`` prefix), with the family's predictive
    (:attr:`~flatbma.types.Posterior.predictive`: Laplace's linearized ones included). More members
    average their samples (a linearized predictive, one per member's mean, is refused); a family's
    ``diagnostics`` are reported per member (``member<m>/...``).

    Mean and width: the mixture mean is the average of the members' means, ``E_q[w] = (1/M) Σ_m μ_m``
    (with member 0's buffers; the evaluation recomputes BatchNorm statistics); its marginal variance
    follows from the law of total variance over the uniform choice of member,
    ``Var_q[w_i] = (1/M) Σ_m Var_{q_m}[w_i] + (1/M) Σ_m (μ_{m,i} − μ̄_i)²`` (the mean within-member
    variance plus the population variance of the member means). Both exist when the family has them.

    A two-stage run (a ``prior`` section: FP-BMA after a SWAG stage) is not offered. One shared prior
    stage would pull every member towards the one basin the prior was fitted in (and with ``prior.init``
    start them all at the same posterior), which is not a multi-basin mixture; per-member prior stages
    (MultiSWAG → Multi-FP-BMA, each member with its own SWAG prior) need one prior run per member, a
    change of the two-stage pipeline that is not made yet. ``multi`` of ``fp-bma`` therefore uses the
    family's isotropic prior ``N(0, s²I)``.

    The members are the posterior's independent components (:attr:`Posterior.members` ``= M``):
    ``split(state, indices)`` keeps the ``member<m>/`` entries of ``indices``; ``update``, ``sample``,
    ``mean`` and ``marginal_variance`` act on the members a state holds, which is what
    ``train.parallel: members`` spreads over processes.

    Args:
        objective: model and mini-batch loss (its model gives the members' initializations).
        base: the family of every member, built for ``objective``.
        members: ``M ≥ 1``.
        seed: seed of the members' initializations; ``None`` draws it from the global generator.

    Raises:
        FlatbmaError: ``members < 1``, a ``seed`` that is not a non-negative integer or ``None``, or a
            ``base`` that is itself a mixture of members.
    """
    check_int(
        members, f"method.members must be an integer >= 1 (the number of mixture members), got {members!r}", minimum=1
    )
    if seed is not None:
        check_int(seed, f"method.seed must be a non-negative integer or null, got {seed!r}", minimum=0)
    if base.members:
        raise FlatbmaError(
            "method.of is itself a mixture of independent members (an ensemble or multi): "
            "raise method.members instead of nesting mixtures"
        )
    single = members == 1
    if not single and base.predictive is not Predictive.SAMPLES:
        raise FlatbmaError(
            f"multi averages its members' samples, but method.of predicts with the network linearized at its mean "
            f"(predictive: {base.predictive.value}), one per member: set method.of.predictive: samples, or "
            "method.members: 1"
        )

    def init(params: Params, buffers: Params) -> State:
        if single:
            return _prefixed_state(0, base.init(params, buffers), State(params={}))
        start = seed if seed is not None else draw_seed()
        state = State(params={})
        for m, (p, b) in enumerate(member_initializations(objective.model, params, buffers, members, start)):
            with forked_rng(member_seed(start, m)):
                state = _prefixed_state(m, base.init(p, b), state)
        return state

    def update(state: State, batch: Batch) -> tuple[State, StepOutput]:
        step_seed = None if single else draw_seed()  # one draw, whatever the members held
        new, outs = State(params={}, step=state.step + 1), []
        for m in held(state):
            own = member_state(m, state)
            if step_seed is None:
                own, out = base.update(own, batch)
            else:
                with forked_rng(member_seed(step_seed, m)):
                    own, out = base.update(own, batch)
            new = _prefixed_state(m, own, new)
            outs.append(out)
        return new, mixture_output(outs)

    def sample(state: State, n: int, generator: torch.Generator | None = None) -> list[Params]:
        if n < 1:
            raise FlatbmaError(f"the number of samples must be >= 1 (eval.num_samples), got {n}")
        if single:
            return base.sample(member_state(0, state), n, generator)
        seed_ = draw_seed(generator)
        device = generator.device if generator is not None else torch.device("cpu")
        drawn = []
        for m in held(state):
            count = max(0, math.ceil((n - m) / members))
            own = seeded_generator(seed_, m, device)
            drawn.append(base.sample(member_state(m, state), count, own) if count else [])
        return [samples[i] for i in range(max(map(len, drawn), default=0)) for samples in drawn if i < len(samples)]

    def mean(state: State) -> Params:
        means = [base.mean(member_state(m, state)) for m in held(state)]  # type: ignore[misc]
        first = held(state)[0]
        buffers = set(member(first, state.buffers))
        return {k: v if k in buffers else torch.stack([mu[k] for mu in means]).mean(0) for k, v in means[0].items()}

    def marginal_variance(state: State) -> Params:
        means, variances = [], []
        for m in held(state):
            own = member_state(m, state)
            means.append(base.mean(own))  # type: ignore[misc]
            variances.append(base.marginal_variance(own))  # type: ignore[misc]
        total = {}
        for k in variances[0]:
            mu = torch.stack([x[k] for x in means])
            within = torch.stack([v[k] for v in variances]).mean(0)
            total[k] = within + (mu - mu.mean(0)).square().mean(0)
        return total

    def functional_variance(state: State, jac: Params) -> torch.Tensor:
        return base.functional_variance(member_state(0, state), jac)  # type: ignore[misc]

    def diagnostics(state: State) -> dict[str, float]:
        if single:
            return base.diagnostics(member_state(0, state))  # type: ignore[misc]
        return {f"member{m}/{k}": v for m in held(state) for k, v in base.diagnostics(member_state(m, state)).items()}  # type: ignore[misc]

    return Posterior(
        init=init,
        update=update,
        sample=sample,
        predict_mode=base.predict_mode,
        recompute_bn=base.recompute_bn,
        members=members,
        split=splitter(members),
        mean=mean if base.mean is not None else None,
        marginal_variance=marginal_variance if base.mean is not None and base.marginal_variance is not None else None,
        predictive=base.predictive,
        functional_variance=functional_variance if single and base.functional_variance is not None else None,
        diagnostics=diagnostics if base.diagnostics is not None else None,
    )


def _prefixed_state(m: int, own: State, into: State) -> State:
    """``into`` with member ``m``'s state ``own`` added under its prefix (``into``'s step kept)."""
    return State(
        params={**into.params, **prefixed(m, own.params)},
        buffers={**into.buffers, **prefixed(m, own.buffers)},
        aux={**into.aux, **prefixed(m, own.aux)},
        step=into.step,
    )
