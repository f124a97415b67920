"""Stochastic-gradient Langevin dynamics: SGLD, cyclical SGLD and the flat-seeking F-SGLD.

SGLD: Welling & Teh (ICML 2011); cSGLD: Zhang et al. (ICLR 2020); F-SGLD: Nguyen et al. (NeurIPS 2023).
The chain targets the tempered posterior ``p_T(w | S) ∝ exp(−U(w)/T)`` with the potential

    U(w) = n·L_S(w) − log p(w),   p(w) = N(0, σ² I),

estimated on a mini-batch as ``Û(w) = n·L_B(w) + ‖w‖²/(2σ²)``; the iterates after burn-in (or at the end of each
cycle) are the posterior samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from functools import partial
from typing import Any, ClassVar, Literal, NamedTuple

import torch
from torch import Tensor

from flatbma.checks import check_int, is_number
from flatbma.errors import FlatbmaError
from flatbma.family import Family, Section, Stage
from flatbma.named import SEP, entries, nest, part, typed
from flatbma.optim.ascent import ascent_memory, has_memory, memory_of, sharpness_aware_value_and_grad
from flatbma.params import Objective, clone
from flatbma.types import Ascent, Batch, GradientTransformation, Params, Posterior, State, StepOutput

NAME = "sgld"
"""The component of ``aux`` the chain keeps its :class:`Chain` under (:mod:`flatbma.named`)."""
COUNT_KEY = f"{NAME}{SEP}collected"
"""Aux key of the number of samples collected so far (:attr:`Chain.collected`)."""
AUTO = "auto"
"""``burn_in: auto`` / ``thin: auto``: resolved from the run's length (:func:`resolve`)."""


class Chain(NamedTuple):
    """The chain's own state (component :data:`NAME` of ``aux``): ``sgld/collected``, ``sgld/samples/<name>``.

    Attributes:
        collected: the number of iterates stored so far (0-d int64); past ``max_samples`` a ring buffer.
        samples: the stored iterates of each weight stacked ``[S, ...]``, ``S = min(collected, max_samples)``
            (empty before the first).
    """

    collected: Tensor
    samples: dict[str, Tensor]


class LrScale(str, Enum):
    """What the learning rate ``η_t`` multiplies (``method.lr_scale``; strings and members are both accepted).

    ``MEAN``: the gradient of the per-datum potential ``U/n``, so ``ε_t = η_t/n`` (an SGD-sized ``η``).
    ``POTENTIAL``: the gradient of the full-data potential ``U``, so ``ε_t = η_t``.
    """

    MEAN = "mean"
    POTENTIAL = "potential"


@dataclass(frozen=True)
class Options:
    """SGLD's options (:func:`build`).

    Attributes:
        prior_std: ``σ`` of the Gaussian prior; ``inf`` gives a flat prior.
        temperature: ``T > 0``.
        lr_scale: :class:`LrScale` (or its name, ``"mean"`` or ``"potential"``): what ``η_t`` multiplies.
        burn_in: steps before the first stored sample; ``"auto"`` (the default): ``⌊T/2⌋`` of the run's ``T``
            updates (:func:`resolve`).
        thin: steps between stored samples; ``"auto"`` (the default): ``max(1, ⌊(T − burn_in)/max_samples⌋)``.
            :func:`build` called directly refuses ``"auto"`` for either.
        max_samples: samples kept.
    """

    NOTES: ClassVar[str] = """
burn_in auto (the default): the first half of the run's updates; thin auto: the max_samples kept spread over the
second half up to its end, max(1, ⌊(T − burn_in)/max_samples⌋). Integers are used as given. docs/methods.md §3.7.
"""

    prior_std: float = 1.0
    temperature: float = 1.0
    lr_scale: LrScale = LrScale.MEAN
    burn_in: int | Literal["auto"] = AUTO
    thin: int | Literal["auto"] = AUTO
    max_samples: int = 30

    def schedule(self, step: int) -> tuple[float, bool, bool]:
        """``(step-size factor, noise?, store?)`` of step ``step``: 1, always, after ``burn_in`` every ``thin``."""
        taken = step + 1
        return 1.0, True, taken > self.burn_in and (taken - self.burn_in) % self.thin == 0

    def no_samples(self, state: State) -> str:
        """Why ``state`` holds no sample yet, and what to change."""
        return (
            f"sgld has collected no samples in {state.step} steps (the first one is stored after "
            f"method.burn_in + method.thin = {self.burn_in + self.thin} steps): lower method.burn_in or method.thin, "
            "or train longer (train.epochs)"
        )


@dataclass(frozen=True)
class CyclicalOptions:
    """Cyclical SGLD's options (:func:`build_cyclical`); ``prior_std``, ``temperature``, ``lr_scale`` as in SGLD's.

    Attributes:
        cycle_length: steps per cycle ``L``.
        exploration: fraction of each cycle without noise, in ``[0, 1)``.
        samples_per_cycle: iterates stored per cycle (at most the sampling stage's length).
        max_samples: samples kept.
    """

    prior_std: float = Options.prior_std
    temperature: float = Options.temperature
    lr_scale: LrScale = Options.lr_scale
    cycle_length: int = 1000
    exploration: float = 0.8
    samples_per_cycle: int = 1
    max_samples: int = Options.max_samples

    def schedule(self, step: int) -> tuple[float, bool, bool]:
        """``(½(cos(π r) + 1), r ≥ exploration, store?)`` at position ``r = (t mod L)/L`` of step ``t``'s cycle."""
        length = self.cycle_length
        first_sampling, spacing = _cycle(length, self.exploration, self.samples_per_cycle)
        j = step % length
        factor = 0.5 * (math.cos(math.pi * j / length) + 1)
        sampling = j >= first_sampling
        back = length - 1 - j
        return factor, sampling, sampling and back % spacing == 0 and back // spacing < self.samples_per_cycle

    def no_samples(self, state: State) -> str:
        """Why ``state`` holds no sample yet, and what to change."""
        return (
            f"csgld has collected no samples in {state.step} steps (the first is stored at the end of the "
            f"first cycle, step {self.cycle_length}): lower method.cycle_length or train longer (train.epochs)"
        )


def build(
    objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None = None, **options
) -> Posterior:
    """SGLD (Welling & Teh 2011); with an ascent step, F-SGLD (Nguyen et al. 2023).

    One step at ``t`` with step size ``ε_t``:

        w ← w − ε_t ∇Û(w + δ_t) + √(2 ε_t T) ξ_t,   ξ_t ~ N(0, I),
        ∇Û(w + δ) = n ∇L_B(w + δ) + w/σ²,

    where ``δ_t = ascent.perturb(w, ∇L_B(w))`` (``δ = 0`` without an ascent step; the prior term is taken at
    ``w``). For small ``ε`` the iterates follow ``p_T(w|S)``: ``T = 1`` is the Bayesian posterior, ``T < 1`` a cold
    one. The noise comes from torch's global RNG (under data parallelism every process must be seeded alike).

    Step size: ``ε_t = η_t/n`` (``lr_scale="mean"``, an SGD-sized ``η``, as Zhang et al.'s code) or ``ε_t = η_t``
    (``"potential"``: ``η·λ_max(∇²U) < 2``), ``η_t = optimizer.learning_rate(t)``. Only the schedule of
    ``optimizer`` is used: its momentum, weight decay and state are ignored (the prior is the weight decay).

    Samples: the iterate after ``burn_in + k·thin`` steps (``k ≥ 1``) is stored, a ring buffer keeping the latest
    ``max_samples``. ``sample(state, n, generator)`` returns ``min(n, S)`` of the ``S`` stored iterates, evenly
    spaced oldest to latest (the latest for ``n = 1``), with the current buffers; the generator is not used.

    Raises:
        FlatbmaError: on an invalid option, or an optimizer without ``learning_rate``.
    """
    o = Options(**options)
    o = replace(o, lr_scale=_check_common(optimizer, o.prior_std, o.temperature, o.lr_scale, o.max_samples))
    for name, minimum in (("burn_in", 0), ("thin", 1)):
        if getattr(o, name) == AUTO:
            raise FlatbmaError(
                f"method.{name}: auto is resolved from the run's length: build the method with map_steps= "
                f"(fit_posterior and flatbma train do), or give {name}"
            )
        _check_int(name, getattr(o, name), minimum=minimum)
    return _langevin(objective, optimizer, ascent, o)


def build_cyclical(
    objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None = None, **options
) -> Posterior:
    """Cyclical SGLD (cSGLD, Zhang et al. 2020): the SGLD step of :func:`build` with a cosine cyclical step size.

    With ``L = cycle_length``, step ``t`` is at position ``j = t mod L`` of its cycle, ``r = j/L`` and

        ε_t = ε⁰_t · ½ (cos(π r) + 1),

    where ``ε⁰_t`` is :func:`build`'s step size (use ``optim.schedule: constant`` for the paper's schedule).
    Exploration stage ``r < exploration``: no noise (SGD on ``U``, to a new mode). Sampling stage
    ``r ≥ exploration``: Langevin steps with noise ``√(2 ε_t T) ξ``. Per cycle, ``samples_per_cycle`` iterates are
    stored, spaced evenly over the sampling stage and ending with the cycle's last step. Storage and sampling are as
    in :func:`build`; ``options`` are :class:`CyclicalOptions`.

    Raises:
        FlatbmaError: on an invalid option.
    """
    o = CyclicalOptions(**options)
    o = replace(o, lr_scale=_check_common(optimizer, o.prior_std, o.temperature, o.lr_scale, o.max_samples))
    _cycle(o.cycle_length, o.exploration, o.samples_per_cycle)
    return _langevin(objective, optimizer, ascent, o)


def _langevin(
    objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None, options: Options | CyclicalOptions
) -> Posterior:
    """The Langevin chain shared by SGLD and cSGLD: :func:`init`, :func:`update` and :func:`sample` of ``options``."""
    return Posterior(
        init=partial(init, ascent=ascent),
        update=partial(update, options=options, objective=objective, optimizer=optimizer, ascent=ascent),
        sample=partial(sample, options=options),
        recompute_bn=True,
    )


def init(params: Params, buffers: Params, *, ascent: Ascent | None) -> State:
    """The weights (copied), an empty :class:`Chain` and the ascent step's memory."""
    aux = {**nest(NAME, entries(Chain(torch.zeros((), dtype=torch.long), {}))), **ascent_memory(ascent, params)}
    return State(params=clone(params), buffers=clone(buffers), aux=aux)


def update(
    state: State,
    batch: Batch,
    *,
    options: Options | CyclicalOptions,
    objective: Objective,
    optimizer: GradientTransformation,
    ascent: Ascent | None,
) -> tuple[State, StepOutput]:
    """``w ← w − ε_t ∇Û(w + δ_t) + √(2 ε_t T) ξ_t`` (noise if the schedule says), then the iterate stored if it says."""
    n = objective.num_data
    prior_precision = 0.0 if math.isinf(options.prior_std) else 1.0 / options.prior_std**2
    factor, noisy, store = options.schedule(state.step)
    eps = optimizer.learning_rate(state.step) * factor  # type: ignore[attr-defined]
    if options.lr_scale is LrScale.MEAN:
        eps /= n
    memory = memory_of(state.aux) if has_memory(ascent) else None
    loss, logits, grads = sharpness_aware_value_and_grad(objective, state.params, state.buffers, batch, ascent, memory)
    with torch.no_grad():
        for k, g in grads.items():
            w = state.params[k]
            grad_u = g * n + w * prior_precision if prior_precision else g * n
            w.add_(grad_u, alpha=-eps)
            if noisy:
                w.add_(torch.randn_like(w), alpha=math.sqrt(2 * eps * options.temperature))
    aux = _store(state.aux, state.params, options.max_samples) if store else state.aux
    return replace(state, aux=aux, step=state.step + 1), StepOutput(loss, logits)


def sample(
    state: State, n: int, generator: torch.Generator | None = None, *, options: Options | CyclicalOptions
) -> list[Params]:
    """``min(n, S)`` of the ``S`` stored iterates, evenly spaced oldest to latest (the latest for ``n = 1``)."""
    if n < 1:
        raise FlatbmaError(f"the number of samples must be >= 1 (eval.num_samples), got {n}")
    stacked = stored_samples(state)
    if not stacked:
        raise FlatbmaError(options.no_samples(state))
    count = next(iter(stacked.values())).shape[0]
    k = min(n, count)
    picks = [count - 1] if k == 1 else [round(i * (count - 1) / (k - 1)) for i in range(k)]
    return [{**{k: v[i] for k, v in stacked.items()}, **state.buffers} for i in picks]


def stored_samples(state: State) -> Params:
    """The stored iterates in chronological order: ``{name: tensor [S, ...]}`` (empty when none)."""
    own = part(NAME, state.aux)
    if not own:
        return {}
    count, stacked = _chain(own)
    if count == 0:
        return {}
    size = next(iter(stacked.values())).shape[0]
    if count <= size:
        return stacked
    start = count % size  # ring buffer: the oldest entry
    order = torch.arange(start, start + size) % size
    return {k: v[order.to(v.device)] for k, v in stacked.items()}


def resolve(options: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """``options`` (an SGLD section's) with ``burn_in: auto`` and ``thin: auto`` resolved for ``steps`` updates.

    ``burn_in = ⌊T/2⌋`` and ``thin = max(1, ⌊(T − burn_in)/max_samples⌋)``, so the ``max_samples`` iterates kept are
    spread over the second half. Integers are kept as they are.
    """
    out = dict(options)
    if out.get("burn_in") == AUTO:
        out["burn_in"] = steps // 2
    if out.get("thin") == AUTO and isinstance(out.get("burn_in"), int):
        out["thin"] = max(1, (steps - out["burn_in"]) // out.get("max_samples", Options.max_samples))
    return out


def samples_stored(steps: int, *, burn_in: int, thin: int) -> int:
    """The number of iterates :func:`build` stores in ``steps`` steps: ``max(0, ⌊(steps − burn_in)/thin⌋)``.

    The ``n``-th iterate is stored after ``burn_in + n·thin`` steps (at most ``max_samples`` are kept).

    Raises:
        FlatbmaError: ``burn_in < 0`` or ``thin < 1`` (as :func:`build`).
    """
    _check_int("burn_in", burn_in, minimum=0)
    _check_int("thin", thin, minimum=1)
    return max(0, (steps - burn_in) // thin)


def cyclical_samples_stored(steps: int, *, cycle_length: int, exploration: float, samples_per_cycle: int) -> int:
    """The number of iterates :func:`build_cyclical` stores in ``steps`` steps.

    With ``L = cycle_length``, a cycle stores the iterates at positions ``j = L − 1 − i·s`` (``i < samples_per_cycle``,
    ``s`` the sampling stage's spacing): ``⌊steps/L⌋·samples_per_cycle`` plus those ``j < steps mod L``.

    Raises:
        FlatbmaError: invalid options (as :func:`build_cyclical`).
    """
    _, spacing = _cycle(cycle_length, exploration, samples_per_cycle)
    positions = [cycle_length - 1 - i * spacing for i in range(samples_per_cycle)]
    full, rest = divmod(steps, cycle_length)
    return full * samples_per_cycle + sum(j < rest for j in positions)


def _cycle(cycle_length: int, exploration: float, samples_per_cycle: int) -> tuple[int, int]:
    """Check cSGLD's cycle options; return the first sampling position of a cycle and the spacing of its samples."""
    _check_int("cycle_length", cycle_length, minimum=1)
    _check_int("samples_per_cycle", samples_per_cycle, minimum=1)
    if not is_number(exploration) or not 0 <= exploration < 1:
        raise FlatbmaError(
            f"method.exploration must be in [0, 1) (the noise-free fraction of each cycle), got {exploration!r}"
        )
    first_sampling = math.ceil(exploration * cycle_length)
    sampling_steps = cycle_length - first_sampling
    if samples_per_cycle > sampling_steps:
        raise FlatbmaError(
            f"method.samples_per_cycle is {samples_per_cycle} but the sampling stage has only {sampling_steps} "
            f"steps per cycle (method.cycle_length={cycle_length}, method.exploration={exploration}): lower "
            "method.samples_per_cycle or method.exploration, or raise method.cycle_length"
        )
    return first_sampling, sampling_steps // samples_per_cycle


def _chain(own: Params) -> tuple[int, dict[str, Tensor]]:
    """``(collected, samples)`` of the :class:`Chain` entries ``own``.

    Raises:
        FlatbmaError: a chain that records stored iterates but holds none (a state of another layout).
    """
    chain = typed(Chain, own)
    count = int(chain.collected)
    if count and not chain.samples:
        iterates = f"{count} stored iterate{'s' if count != 1 else ''}"
        raise FlatbmaError(
            f"the sgld state records {iterates} but holds none (no aux entries {NAME}{SEP}samples/...): "
            "it was not written by this version of flatbma's sgld; train it again"
        )
    return count, chain.samples


@torch.no_grad()
def _store(aux: Params, params: Params, max_samples: int) -> Params:
    """``aux`` with ``params`` stored in its :class:`Chain`: appended, or over the oldest past ``max_samples``."""
    count, samples = _chain(part(NAME, aux))
    samples = dict(samples)
    for k, w in params.items():
        if count < max_samples:
            samples[k] = torch.cat([samples[k], w[None]]) if count else w[None].clone()
        else:
            samples[k][count % max_samples].copy_(w)
    return {**aux, **nest(NAME, entries(Chain(torch.full((), count + 1, dtype=torch.long), samples)))}


def _check_common(
    optimizer: GradientTransformation, prior_std: float, temperature: float, lr_scale: LrScale | str, max_samples: int
) -> LrScale:
    """Validate the options SGLD and cSGLD share; return ``lr_scale`` as a :class:`LrScale` member."""
    if not callable(getattr(optimizer, "learning_rate", None)):
        raise FlatbmaError(
            f"SGLD takes its step size from optimizer.learning_rate(step), which {type(optimizer).__name__} "
            "does not have; use flatbma.optim.SGD or Adam (only their learning-rate schedule is used)"
        )
    if not is_number(prior_std) or not prior_std > 0:
        raise FlatbmaError(f"method.prior_std must be > 0 (inf for a flat prior), got {prior_std!r}")
    if not is_number(temperature) or not 0 < temperature < float("inf"):
        raise FlatbmaError(
            f"method.temperature must be a finite number > 0 (1 = the Bayesian posterior), got {temperature!r}"
        )
    try:
        scale = LrScale(lr_scale)
    except (ValueError, TypeError):
        raise FlatbmaError(f"method.lr_scale must be 'mean' or 'potential', got {lr_scale!r}") from None
    _check_int("max_samples", max_samples, minimum=1)
    return scale


def _check_int(name: str, value: int, *, minimum: int) -> None:
    check_int(value, f"method.{name} must be an integer >= {minimum}, got {value!r}", minimum=minimum)


def check_burn_in(method: Section, stage: Stage) -> None:
    """SGLD's families: the run must store at least one sample (:func:`samples_stored`), ``auto`` options resolved."""
    o, key = method.resolved(stage.steps).options, stage.key
    burn_in, thin = o["burn_in"], o["thin"]
    if samples_stored(stage.steps, burn_in=burn_in, thin=thin) > 0:
        return
    first = burn_in + thin
    raise FlatbmaError(
        f"{method.name} stores its first sample after {key('burn_in')} + {key('thin')} = {burn_in} + {thin} = "
        f"{first} updates, but {stage.describe()}: raise {stage.epochs_key} to >= {stage.epochs_for(first)}, "
        f"or lower {key('burn_in')} or {key('thin')}"
    )


def check_cycles(method: Section, stage: Stage) -> None:
    """Cyclical SGLD: the run must store a sample (:func:`cyclical_samples_stored`)."""
    o, key = method.options, stage.key
    options = {k: o[k] for k in ("cycle_length", "exploration", "samples_per_cycle")}

    def count(steps: int) -> int:
        return cyclical_samples_stored(steps, **options)

    if count(stage.steps) > 0:
        return
    first = stage.steps_for(count, 1)
    raise FlatbmaError(
        f"{method.name} stores its first sample after {first} updates (in the sampling stage of the first cycle of "
        f"{key('cycle_length')}={o['cycle_length']}), but {stage.describe()}: raise {stage.epochs_key} to >= "
        f"{stage.epochs_for(first)}, or lower {key('cycle_length')}"
    )


def advice(method: Section, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """What to change when an SG-MCMC BMA is worse than its average of samples (:attr:`Family.advice`): colder."""
    t = method.options["temperature"]
    return f"temperature: {t / 10:g} (now {t:g}), or a lower optim.lr"


FAMILY = Family(build, Options, check=check_burn_in, resolve=resolve, advice=advice)
"""SGLD, and with the SAM gradient F-SGLD (:mod:`flatbma.methods`); ``burn_in: auto`` and ``thin: auto`` are
:func:`resolve`'s."""
CYCLICAL = Family(build_cyclical, CyclicalOptions, check=check_cycles, advice=advice)
"""Cyclical SGLD (:func:`build_cyclical`)."""
