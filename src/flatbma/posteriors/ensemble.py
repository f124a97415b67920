"""Deep ensembles (Lakshminarayanan et al., NeurIPS 2017) and F-ensembles (Nguyen et al. 2023).

``M`` independently initialized networks trained on the same data; the BMA is their uniform mixture
``p(y|x) = (1/M) Σ_m softmax(f(x; w_m))``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from flatbma.checks import check_int
from flatbma.errors import FlatbmaError
from flatbma.params import Objective, clone
from flatbma.posteriors import point
from flatbma.rng import SEED_BOUND, draw_seed, forked_rng, splitmix64
from flatbma.types import Ascent, Batch, GradientTransformation, Params, Posterior, State, StepOutput


def build(
    objective: Objective,
    optimizer: GradientTransformation,
    ascent: Ascent | None = None,
    *,
    size: int = 5,
    seed: int | None = None,
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
    its own BatchNorm statistics) and ``aux["member<m>/<optimizer key>"]`` (each its own momentum).

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
        size: number of members ``M``.
        seed: seed of the members' initializations; ``None`` draws it from the global generator.

    Raises:
        FlatbmaError: ``size < 1`` or a ``seed`` that is not a non-negative integer or ``None``.
    """
    check_int(size, f"method.size must be an integer >= 1 (the number of ensemble members), got {size!r}", minimum=1)
    if seed is not None:
        check_int(seed, f"method.seed must be a non-negative integer or null, got {seed!r}", minimum=0)

    def init(params: Params, buffers: Params) -> State:
        base = seed if seed is not None else draw_seed()
        members = member_initializations(objective.model, params, buffers, size, base)
        state_params: Params = {}
        state_buffers: Params = {}
        aux: Params = {}
        for m, (p, b) in enumerate(members):
            state_params.update(_prefixed(m, p))
            state_buffers.update(_prefixed(m, b))
            aux.update(_prefixed(m, optimizer.init(p)))
        return State(params=state_params, buffers=state_buffers, aux=aux)

    def update(state: State, batch: Batch) -> tuple[State, StepOutput]:
        aux: Params = {}
        losses, log_probs = [], []
        members = _members(state)
        step_seed = draw_seed()  # one draw, whatever the members
        for m in members:
            p, b, o = (_member(m, d) for d in (state.params, state.buffers, state.aux))
            with forked_rng(_member_seed(step_seed, m)):
                o, out = point.step(objective, optimizer, ascent, p, b, o, state.step, batch)
            aux.update(_prefixed(m, o))
            losses.append(out.loss)
            log_probs.append(F.log_softmax(out.logits, dim=-1))
        loss = torch.stack(losses).mean()
        logits = torch.logsumexp(torch.stack(log_probs), dim=0) - math.log(len(members))
        return replace(state, aux=aux, step=state.step + 1), StepOutput(loss, logits)

    def sample(state: State, n: int, generator: torch.Generator | None = None) -> list[Params]:
        if n < 1:
            raise FlatbmaError(f"the number of samples must be >= 1 (eval.num_samples), got {n}")
        return [{**_member(m, state.params), **_member(m, state.buffers)} for m in _members(state)[:n]]

    def split(state: State, indices: Sequence[int]) -> State:
        chosen = list(indices)
        if not chosen or len(set(chosen)) != len(chosen) or not all(0 <= m < size for m in chosen):
            raise ValueError(f"split needs distinct member indices in 0..{size - 1}, got {chosen}")
        keep = tuple(f"member{m}/" for m in chosen)

        def pick(tensors: Params) -> Params:
            return {k: v for k, v in tensors.items() if k.startswith(keep)}

        return replace(state, params=pick(state.params), buffers=pick(state.buffers), aux=pick(state.aux))

    return Posterior(init=init, update=update, sample=sample, members=size, split=split)


def member_initializations(
    model: nn.Module, params: Params, buffers: Params, size: int, seed: int
) -> list[tuple[Params, Params]]:
    """``(params, buffers)`` of every member: member 0 = the given ones, others re-initialized (see :func:`build`).

    Member ``m ≥ 1`` is drawn with torch's RNG seeded by the ``m``-th integer drawn from a generator
    seeded with ``seed``, on a forked copy of the RNG (the global stream is untouched); the model's own
    parameters and buffers are restored before returning.
    """
    trainable = set(params)
    resettable = [
        (name, module)
        for name, module in model.named_modules()
        if callable(getattr(module, "reset_parameters", None))
        and (names := [_join(name, k) for k, _ in module.named_parameters()])
        and all(k in trainable for k in names)
    ]
    reset_params = {_join(n, k) for n, mod in resettable for k, _ in mod.named_parameters()}
    reset_buffers = {_join(n, k) for n, mod in resettable for k, _ in mod.named_buffers()} & set(buffers)
    members = [(clone(params), clone(buffers))]
    if size == 1:
        return members
    seeds = torch.randint(SEED_BOUND, (size,), generator=torch.Generator().manual_seed(seed)).tolist()
    template = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    saved = {k: v.detach().clone() for k, v in template.items()}
    try:
        for m in range(1, size):
            with forked_rng(seeds[m]), torch.no_grad():
                for _, module in resettable:
                    module.reset_parameters()
            current = {**dict(model.named_parameters()), **dict(model.named_buffers())}
            p = {k: (current[k] if k in reset_params else v).detach().clone() for k, v in params.items()}
            b = {k: (current[k] if k in reset_buffers else v).detach().clone() for k, v in buffers.items()}
            members.append((p, b))
    finally:
        with torch.no_grad():
            current = {**dict(model.named_parameters()), **dict(model.named_buffers())}
            for k, v in saved.items():
                current[k].copy_(v)
    return members


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _prefixed(m: int, tensors: Params) -> Params:
    return {f"member{m}/{k}": v for k, v in tensors.items()}


def _member(m: int, tensors: Params) -> Params:
    prefix = f"member{m}/"
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def _members(state: State) -> list[int]:
    """Indices of the members ``state`` holds (all of them, or those of a split), ascending."""
    found = {k[len("member") : k.index("/")] for d in (state.params, state.buffers, state.aux) for k in d}
    return sorted(map(int, found))


def _member_seed(seed: int, m: int) -> int:
    """A seed for member ``m`` from ``seed``: the high 63 bits of :func:`flatbma.rng.splitmix64` of ``(seed, m)``."""
    return splitmix64(seed, m) >> 1
