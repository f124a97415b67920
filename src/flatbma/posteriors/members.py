"""Independent components of a mixture posterior: their initializations, state layout, seeds and splits.

Component ``m`` of a mixture (:mod:`flatbma.posteriors.multi`) owns the entries ``"member<m>/<key>"`` of a state's
``params``, ``buffers`` and ``aux``; :func:`splitter` is the :attr:`~flatbma.types.Capabilities.split` of that
layout, which ``train.parallel: members`` uses to spread the components over processes.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.family import Section, Stage
from flatbma.models import classifier_of, is_pretrained
from flatbma.named import nest, part
from flatbma.params import clone
from flatbma.rng import SEED_BOUND, forked_rng, splitmix64
from flatbma.types import Params, State, StepOutput, view

__all__ = [
    "held",
    "member",
    "member_initializations",
    "member_name",
    "member_seed",
    "member_state",
    "mixture_output",
    "prefixed",
    "prefixed_members",
    "splitter",
    "unprefixed",
]

_PREFIX = re.compile(r"member(\d+)/")


def _head_name(model: nn.Module) -> str | None:
    """The qualified name of ``model``'s classifier head, or ``None`` when it has no ``nn.Linear``."""
    try:
        return classifier_of(model)[0]
    except FlatbmaError:
        return None


def _moved(drawn: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A copy of ``drawn`` with ``like``'s device and dtype (never ``drawn`` itself: it is drawn again)."""
    return drawn.detach().to(like.device, like.dtype, copy=True)


def member_initializations(
    model: nn.Module, params: Params, buffers: Params, size: int, seed: int
) -> list[tuple[Params, Params]]:
    """``(params, buffers)`` of every member: member 0 = the given ones, others re-initialized.

    For member ``m ≥ 1``, every module of ``model`` with ``reset_parameters`` whose parameters are all trainable
    (keys of ``params``) and that is the classifier head or holds no pretrained parameter
    (:func:`flatbma.models.is_pretrained`) is re-initialized, with its buffers; the rest is shared with member 0.
    Members thus differ where the single model was randomly initialized.

    Member ``m`` is drawn on CPU copies under a forked RNG (the global stream is untouched) seeded by the ``m``-th
    integer drawn from a generator seeded with ``seed``: the same numbers on any device. ``model`` is not touched.
    """
    trainable = set(params)
    head = _head_name(model)
    resettable = [
        (name, module)
        for name, module in model.named_modules()
        if callable(getattr(module, "reset_parameters", None))
        and (names := [_join(name, k) for k, _ in module.named_parameters()])
        and all(k in trainable for k in names)
        and (name == head or not any(is_pretrained(p) for p in module.parameters()))
    ]
    reset_params = {_join(n, k) for n, mod in resettable for k, _ in mod.named_parameters()}
    reset_buffers = {_join(n, k) for n, mod in resettable for k, _ in mod.named_buffers()} & set(buffers)
    members = [(clone(params), clone(buffers))]
    if size == 1:
        return members
    seeds = torch.randint(SEED_BOUND, (size,), generator=torch.Generator().manual_seed(seed)).tolist()
    copies = [(name, copy.deepcopy(module).cpu()) for name, module in resettable]  # drawn on the CPU, any device
    for m in range(1, size):
        with forked_rng(seeds[m]), torch.no_grad():
            for _, module in copies:
                module.reset_parameters()
            drawn = {
                _join(name, k): v
                for name, module in copies
                for k, v in (*module.named_parameters(), *module.named_buffers())
            }
            p = {k: _moved(drawn[k], v) if k in reset_params else v.detach().clone() for k, v in params.items()}
            b = {k: _moved(drawn[k], v) if k in reset_buffers else v.detach().clone() for k, v in buffers.items()}
        members.append((p, b))
    return members


def member_name(m: int) -> str:
    """Member ``m``'s name, under which a mixture keeps its state (:mod:`flatbma.named`): ``"member<m>"``."""
    return f"member{m}"


def prefixed(m: int, tensors: Params) -> Params:
    """``tensors`` as member ``m``'s entries: keys ``"member<m>/<key>"`` (:func:`flatbma.named.nest`)."""
    return nest(member_name(m), tensors)


def member(m: int, tensors: Params) -> Params:
    """Member ``m``'s entries of ``tensors``, without their prefix (the same tensors; :func:`flatbma.named.part`)."""
    return part(member_name(m), tensors)


def unprefixed(key: str) -> str:
    """``key`` without its ``"member<m>/"`` prefix (``key`` itself when it has none)."""
    found = _PREFIX.match(key)
    return key[found.end() :] if found else key


def prefixed_members(tensors: Params) -> list[int] | None:
    """The members, ascending, whose entries ``tensors`` holds when every key is a member's; ``None`` otherwise."""
    found = [_PREFIX.match(k) for k in tensors]
    if not found or not all(found):
        return None
    return sorted({int(f.group(1)) for f in found if f is not None})


def member_state(m: int, state: State) -> State:
    """Member ``m``'s own state: its entries of every section, without their prefix, and the same ``step``.

    A :func:`~flatbma.types.view` of ``state``: what the member's family derives from it is kept with ``state``.
    """
    return view(state, member_name(m), member(m, state.params), member(m, state.buffers), member(m, state.aux))


def held(state: State) -> list[int]:
    """Indices of the members ``state`` holds (all of them, or those of a split), ascending."""
    found = {k[len("member") : k.index("/")] for d in (state.params, state.buffers, state.aux) for k in d}
    return sorted(map(int, found))


def member_seed(seed: int, m: int) -> int:
    """A seed for member ``m`` from ``seed``: the high 63 bits of :func:`flatbma.rng.splitmix64` of ``(seed, m)``."""
    return splitmix64(seed, m) >> 1


def mixture_output(outs: Sequence[StepOutput]) -> StepOutput:
    """The step output of a uniform mixture: the mean loss and, as logits, ``log (1/m) Σ_j softmax(logits_j)``."""
    loss = torch.stack([o.loss for o in outs]).mean()
    log_probs = torch.stack([F.log_softmax(o.logits, dim=-1) for o in outs])
    return StepOutput(loss, torch.logsumexp(log_probs, dim=0) - math.log(len(outs)))


def splitter(size: int) -> Callable[[State, Sequence[int]], State]:
    """:attr:`~flatbma.types.Capabilities.split` of the ``member<m>/`` layout of ``size`` members."""

    def split(state: State, indices: Sequence[int]) -> State:
        chosen = list(indices)
        if not chosen or len(set(chosen)) != len(chosen) or not all(0 <= m < size for m in chosen):
            raise ValueError(f"split needs distinct member indices in 0..{size - 1}, got {chosen}")
        keep = tuple(f"member{m}/" for m in chosen)

        def pick(tensors: Params) -> Params:
            return {k: v for k, v in tensors.items() if k.startswith(keep)}

        return replace(state, params=pick(state.params), buffers=pick(state.buffers), aux=pick(state.aux))

    return split


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def check_member_memory(method: Section, stage: Stage, option: str = "size") -> None:
    """A posterior of ``method.<option>`` independent members holds at least that many copies of the trained weights.

    Each copy is ``num_trainable`` float32 values (4 bytes), a lower bound (optimizer states and gradients come on
    top). Does nothing when the shape or the available memory is unknown.

    Raises:
        FlatbmaError: that bound exceeds :attr:`~flatbma.family.RunShape.available_memory`.
    """
    d, free = stage.shape.num_trainable, stage.shape.available_memory
    if d is None or free is None:
        return
    count = method.options[option]
    need = count * d * 4
    if need > free:
        raise FlatbmaError(
            f"{stage.key(option)}={count} members of {d:,} trained weights need at least {_gigabytes(need)} for "
            f"their weights alone, but {_gigabytes(free)} of memory is available here: lower {stage.key(option)} "
            f"(at most {free // (4 * d):,} members fit)"
        )


def unequal_members(method: Section, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """What to change when a mixture is worse than its member 0 (:attr:`~flatbma.family.Family.advice`)."""
    return "more epochs or a lower optim.lr: members worse than member 0 are averaged in"


def _gigabytes(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"
