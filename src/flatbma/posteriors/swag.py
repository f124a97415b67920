"""SWAG: a Gaussian fitted to the SGD trajectory (Maddox et al., NeurIPS 2019), and F-SWAG.

The weights are trained by a point estimate's update (:func:`flatbma.posteriors.point.build`); every
``collect_every`` updates after the first ``start_step``, the current iterate ``w`` is a *snapshot* that updates the
running moments and the deviation ring buffer. Along a SAM trajectory this is F-SWAG (Nguyen et al., NeurIPS 2023).
The maths: docs/methods.md §3.2.

State: ``params`` is the current iterate ``w``, ``buffers`` its BatchNorm statistics, ``aux["swag/..."]`` the
:class:`Moments` and ``aux["point/<key>"]`` the point update's own state (optimizer, ascent memory).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, ClassVar, Literal, NamedTuple

import torch
from torch import Tensor

from flatbma.checks import is_int, is_number
from flatbma.errors import FlatbmaError
from flatbma.family import Family, Section, Stage
from flatbma.gaussian import init_from_swag
from flatbma.named import chain, entries, part, split, typed
from flatbma.params import Objective, flatten, unflatten
from flatbma.posteriors import point
from flatbma.types import Ascent, Batch, Capabilities, GradientTransformation, Params, Posterior, State, StepOutput

POINT = point.NAME
"""Name of the point update's component of ``State.aux`` (its optimizer's state, an ascent step's memory)."""
SWAG = "swag"
"""Name of SWAG's own component of ``State.aux``: the :class:`Moments` (:mod:`flatbma.named`)."""
N_COLLECTED = f"{SWAG}/n_collected"
"""The ``State.aux`` entry of :attr:`Moments.n_collected`, the number of snapshots."""
VAR_CLAMP = 1e-30
"""Lower bound of the diagonal variance ``σ² = m2/n`` (0 for a weight no snapshot moved)."""

_HOW_TO_COLLECT_MORE = "lower method.start_step or method.collect_every, or raise train.epochs"

AUTO = "auto"
"""``collect_every: auto``: the snapshots spread evenly over the collection window (:func:`auto_collect_every`)."""


class Moments(NamedTuple):
    """SWAG's own state: the running moments of the snapshots and the deviation ring buffer.

    Attributes:
        mean: running mean ``w̄`` of the snapshots, by weight name.
        m2: their sum of squared deviations ``Σ_i (w_i − w̄_{i−1})⊙(w_i − w̄_i)`` (Welford's, accurate in float32).
        deviations: ``[K, d]`` ring buffer of the last ``K`` deviations ``w_i − w̄_i`` (``w̄_i`` the mean *including*
            snapshot ``i``, as in the paper), flattened in sorted-name order; ``None`` for the diagonal-only variant.
        n_collected: number of snapshots (0-d int64).
    """

    mean: dict[str, Tensor]
    m2: dict[str, Tensor]
    deviations: Tensor | None
    n_collected: Tensor


class SwagMoments(NamedTuple):
    """The SWAG statistics as flat vectors (weights in the order of ``names``).

    Attributes:
        names: parameter names, in the (sorted) order of the flattening.
        mean: ``w̄ ∈ R^d``, the SWA solution.
        variance: ``σ² = clamp(m2/n, 1e-30) ∈ R^d``, the population variance of the snapshots.
        deviations: ``D ∈ R^{K_eff×d}``, the stored deviations oldest first (``K_eff = min(n, K)``;
            empty for the diagonal-only variant).
    """

    names: tuple[str, ...]
    mean: Tensor
    variance: Tensor
    deviations: Tensor


@dataclass(frozen=True)
class Options:
    """SWAG's options (:func:`build`).

    Attributes:
        rank: ``K``, the number of deviations kept (the rank of the low-rank part), at least 2.
        scale: factor multiplying the sampling covariance.
        start_step: updates before the collection window opens (0 = collect from the start, from a trained or
            pretrained point). ``None`` (the default): the last quarter of the run's updates at a held learning
            rate (:func:`last_quarter`), resolved by :func:`flatbma.training.build`.
        collect_every: updates between two snapshots. ``"auto"`` (the default): the window's updates divided by
            ``rank``, at least 1 (:func:`auto_collect_every`), resolved like ``start_step`` (:func:`resolve`).
            :func:`build` called directly refuses ``None`` and ``"auto"``.
        diagonal_only: keep no deviations and sample from the diagonal Gaussian (SWAG-Diagonal).
    """

    NOTES: ClassVar[str] = """
The collection window: start_step null (the default) opens it at the last quarter of the run's updates, with
the learning rate held from there at the value the schedule reached (Maddox et al.'s swa_lr); collect_every
auto (the default) spreads rank snapshots over it: collect_every = max(1, ⌊window's updates / rank⌋), so any
window of at least rank updates collects rank snapshots up to its end. Integers are used as given.
docs/methods.md §3.2.
"""

    rank: int = 20
    scale: float = 1.0
    start_step: int | None = None
    collect_every: int | Literal["auto"] = AUTO
    diagonal_only: bool = False


AUTO_SNAPSHOTS = Options.rank
"""The snapshots ``collect_every: auto`` spreads over SWAG-Diagonal's window (it has no ``rank``): SWAG's default."""


@dataclass(frozen=True)
class DiagonalOptions:
    """SWAG-Diagonal's options (:func:`build_diag`): :class:`Options` without ``rank`` and ``diagonal_only``.

    ``collect_every: auto`` spreads :data:`AUTO_SNAPSHOTS` snapshots over the window (:func:`resolve`).
    """

    NOTES: ClassVar[str] = Options.NOTES.replace("rank snapshots", "20 snapshots").replace("/ rank", "/ 20")

    scale: float = Options.scale
    start_step: int | None = Options.start_step
    collect_every: int | Literal["auto"] = Options.collect_every


def build(
    objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None = None, **options
) -> Posterior:
    """SWAG (Maddox et al. 2019); with ``ascent=SAM`` F-SWAG (Nguyen et al. 2023).

    Training is the point update ``w_{t+1} = opt(w_t, ∇L_B(w_t + ε_t))`` of :func:`flatbma.posteriors.point.build`.
    After update ``s`` (from 1), with ``s > start_step`` and ``(s − start_step) % collect_every == 0``, the iterate
    ``w`` is the ``(n+1)``-th snapshot, added by Welford's update (``w̄'`` the new mean)::

        w̄' = w̄ + (w − w̄)/(n+1),   m₂ ← m₂ + (w − w̄)⊙(w − w̄'),   D[n mod K] ← w − w̄',   w̄ ← w̄',   n ← n+1.

    Sampling draws ``z₁ ~ N(0, I_d)``, ``z₂ ~ N(0, I_{K_eff})`` from the generator::

        w = w̄ + √scale · ( σ⊙z₁/√2 + Dᵀz₂/√(2(K_eff − 1)) ),   σ² = clamp(m₂/n, 1e-30),

    i.e. ``w ~ N(w̄, scale · ½(diag σ² + DᵀD/(K_eff − 1)))`` (docs/methods.md §3.2); ``diagonal_only`` drops the
    ``D`` term. ``K_eff = min(n, K)``; sampling needs ``n ≥ 2`` snapshots. The ½ is in the sampler: Maddox et al.'s
    ``scale=0.5`` is ``scale=1`` here.

    The samples' BatchNorm statistics are the last iterate's, to be recomputed (``recompute_bn``); the mean is ``w̄``.

    Raises:
        FlatbmaError: for an invalid option (the message names the ``method.*`` key).
    """
    o = Options(**options)
    if o.start_step is None:
        raise FlatbmaError(
            "method.start_step: null (the last quarter of the updates) is resolved from the run's length: build "
            "the method with map_steps= (fit_posterior and flatbma train do), or give start_step"
        )
    if o.collect_every == AUTO:
        raise FlatbmaError(
            "method.collect_every: auto (rank snapshots spread over the window) is resolved from the run's length: "
            "build the method with map_steps= (fit_posterior and flatbma train do), or give collect_every"
        )
    _check_options(rank=o.rank, scale=o.scale, start_step=o.start_step, collect_every=o.collect_every)
    return Posterior(
        init=partial(init, options=o, optimizer=optimizer, ascent=ascent),
        update=partial(update, options=o, objective=objective, optimizer=optimizer, ascent=ascent),
        sample=partial(sample, options=o),
        recompute_bn=True,
        mean=partial(mean, options=o),
        marginal_variance=partial(marginal_variance, options=o),
        can=Capabilities(gaussian=None if o.diagonal_only else partial(gaussian, options=o)),
    )


def build_diag(
    objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None = None, **options
) -> Posterior:
    """SWAG-Diagonal (Maddox et al. 2019): :func:`build` with ``diagonal_only=True`` (:class:`DiagonalOptions`)."""
    DiagonalOptions(**options)  # refuses rank and diagonal_only
    return build(objective, optimizer, ascent, diagonal_only=True, **options)


def init(
    params: Params, buffers: Params, *, options: Options, optimizer: GradientTransformation, ascent: Ascent | None
) -> State:
    """The point's state (:func:`flatbma.posteriors.point.init`) with empty moments: ``n = 0``, ``w̄ = m₂ = D = 0``."""
    state = point.init(params, buffers, optimizer=optimizer, ascent=ascent)
    w, first = state.params, next(iter(state.params.values()))
    moments = Moments(
        mean={k: torch.zeros_like(w[k]) for k in sorted(w)},
        m2={k: torch.zeros_like(w[k]) for k in sorted(w)},
        deviations=None if options.diagonal_only else first.new_zeros(options.rank, sum(v.numel() for v in w.values())),
        n_collected=torch.zeros((), dtype=torch.int64, device=first.device),
    )
    return replace(state, aux=chain((POINT, state.aux), (SWAG, entries(moments))))


def update(
    state: State,
    batch: Batch,
    *,
    options: Options,
    objective: Objective,
    optimizer: GradientTransformation,
    ascent: Ascent | None,
) -> tuple[State, StepOutput]:
    """The point update; update ``s`` is a snapshot if ``s > start_step`` and ``collect_every | s − start_step``."""
    own, moments = split(state.aux, POINT, SWAG)
    state, out = point.update(replace(state, aux=own), batch, objective=objective, optimizer=optimizer, ascent=ascent)
    s = state.step
    if s > options.start_step and (s - options.start_step) % options.collect_every == 0:
        _collect(state.params, typed(Moments, moments))
    return replace(state, aux=chain((POINT, state.aux), (SWAG, moments))), out


def sample(state: State, n: int, generator: torch.Generator | None = None, *, options: Options) -> list[Params]:
    """``n`` draws ``w = w̄ + √scale·(σ⊙z₁/√2 + Dᵀz₂/√(2(K_eff − 1)))`` (no ``D`` diagonal-only), with the buffers."""
    m = _moments(state, _schedule(options))
    noise_device = generator.device if generator is not None else torch.device("cpu")
    std = m.variance.sqrt()
    k_eff = m.deviations.shape[0]
    like = {k: state.params[k] for k in m.names}
    if k_eff == 0 and not options.diagonal_only:
        raise FlatbmaError(
            "this SWAG state holds no deviations (it was trained with method swag-diag or "
            "method.diagonal_only=true): sample it with diagonal_only=true"
        )
    samples = []
    for _ in range(n):
        z1 = torch.randn(m.mean.numel(), generator=generator, device=noise_device, dtype=m.mean.dtype)
        noise = std * z1.to(m.mean.device)
        if not options.diagonal_only:
            z2 = torch.randn(k_eff, generator=generator, device=noise_device, dtype=m.mean.dtype)
            noise = noise + (m.deviations.T @ z2.to(m.mean.device)) / math.sqrt(k_eff - 1)
        w = m.mean + math.sqrt(options.scale / 2) * noise
        samples.append({**unflatten(w, like), **state.buffers})
    return samples


def gaussian(state: State, *, options: Options) -> Params:
    """The distribution :func:`sample` draws from, in the ``θ`` layout of :mod:`flatbma.gaussian` (low-rank only)."""
    m = _moments(state, _schedule(options))
    like = {k: state.params[k] for k in m.names}
    return init_from_swag(m.mean, m.variance, m.deviations, like, scale=options.scale)


def mean(state: State, *, options: Options) -> Params:
    """The SWA mean ``w̄``, with the last iterate's buffers."""
    m = _moments(state, _schedule(options))
    return {**unflatten(m.mean.clone(), {k: state.params[k] for k in m.names}), **state.buffers}


def marginal_variance(state: State, *, options: Options) -> Params:
    """The diagonal of :func:`sample`'s covariance, ``scale·½(σ² + Σ_k D_k²/(K_eff − 1))`` (``scale·½σ²`` diagonal)."""
    m = _moments(state, _schedule(options))
    variance = m.variance
    if not options.diagonal_only:
        variance = variance + (m.deviations * m.deviations).sum(0) / (m.deviations.shape[0] - 1)
    return unflatten(options.scale / 2 * variance, {k: state.params[k] for k in m.names})


def _schedule(options: Options) -> str:
    """How the snapshots are taken, and what to change for more (the refusal of a state with fewer than two)."""
    return (
        f"snapshots are taken every method.collect_every={options.collect_every} updates after the first "
        f"method.start_step={options.start_step}: {_HOW_TO_COLLECT_MORE}"
    )


def snapshots(steps: int, *, start_step: int, collect_every: int) -> int:
    """The number of snapshots :func:`build` collects in ``steps`` updates: ``max(0, ⌊(steps − start)/every⌋)``.

    Snapshot ``n`` is taken at update ``start_step + n·collect_every``. Sampling needs ``n ≥ 2``; the low-rank part
    has its ``K = rank`` columns once ``n ≥ K``.

    Raises:
        FlatbmaError: ``start_step < 0`` or ``collect_every < 1`` (as :func:`build`).
    """
    _check_schedule(start_step, collect_every)
    return max(0, (steps - start_step) // collect_every)


def auto_collect_every(window: int, snapshots: int) -> int:
    """``collect_every: auto`` for a window of ``window`` updates: ``max(1, ⌊window/snapshots⌋)``.

    A window of at least ``snapshots`` updates then collects at least ``snapshots`` and fewer than ``2·snapshots``,
    spread evenly up to its end; a shorter window collects one per update.
    """
    return max(1, window // snapshots)


def resolve(options: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """``options`` (a method section's, ``start_step`` already resolved) with ``collect_every: auto`` resolved.

    ``collect_every`` is :func:`auto_collect_every` of the window ``steps − start_step`` and ``rank``
    (:data:`AUTO_SNAPSHOTS` for SWAG-Diagonal); an integer ``collect_every`` or a ``None`` ``start_step`` is kept.
    """
    out = dict(options)
    start = out.get("start_step")
    if out.get("collect_every") == AUTO and start is not None:
        out["collect_every"] = auto_collect_every(steps - start, out.get("rank", AUTO_SNAPSHOTS))
    return out


def swag_moments(state: State) -> SwagMoments:
    """Flat mean, diagonal variance and deviations (oldest first) of a SWAG state.

    Raises:
        FlatbmaError: if fewer than two snapshots were collected.
    """
    return _moments(state, _HOW_TO_COLLECT_MORE)


@torch.no_grad()
def _collect(params: Params, moments: Moments) -> None:
    """Add the snapshot ``params`` to the ``moments`` and their ring buffer (in place)."""
    n = int(moments.n_collected)
    names = sorted(params)
    weight = 1.0 / (n + 1)
    for k in names:
        w = params[k]
        before = w - moments.mean[k]
        moments.mean[k].lerp_(w, weight)
        moments.m2[k].addcmul_(before, w - moments.mean[k])
    if moments.deviations is not None:
        dev = moments.deviations
        w = flatten({k: params[k] for k in names})
        dev[n % dev.shape[0]] = w - flatten({k: moments.mean[k] for k in names})
    moments.n_collected.add_(1)


def _moments(state: State, how_to_fix: str) -> SwagMoments:
    own = part(SWAG, state.aux)
    if "n_collected" not in own:
        raise FlatbmaError("this state has no SWAG statistics (no 'swag/n_collected'): it was not trained with SWAG")
    m = typed(Moments, own)
    n = int(m.n_collected)
    if n < 2:
        raise FlatbmaError(
            f"SWAG collected {n} snapshot(s) of the weights in {state.step} updates, but sampling needs "
            f"at least 2; {how_to_fix}"
        )
    names = tuple(sorted(m.mean))
    mean = torch.cat([m.mean[k].reshape(-1) for k in names])
    m2 = torch.cat([m.m2[k].reshape(-1) for k in names])
    variance = torch.clamp(m2 / n, min=VAR_CLAMP)
    if m.deviations is not None:
        dev = m.deviations
        k = dev.shape[0]
        deviations = torch.roll(dev, -(n % k), dims=0) if n >= k else dev[:n]
    else:
        deviations = mean.new_zeros(0, mean.numel())
    return SwagMoments(names=names, mean=mean, variance=variance, deviations=deviations)


def _check_options(*, rank: int, scale: float, start_step: int, collect_every: int) -> None:
    if not is_int(rank) or rank < 2:
        raise FlatbmaError(
            f"method.rank must be an integer >= 2 (got {rank!r}): SWAG's low-rank covariance "
            "DᵀD/(K−1) needs at least two deviations (use method swag-diag for no low-rank part)"
        )
    if not is_number(scale) or not 0 < scale < math.inf:
        raise FlatbmaError(f"method.scale must be a positive number (it multiplies the covariance), got {scale!r}")
    _check_schedule(start_step, collect_every)


def _check_schedule(start_step: int, collect_every: int) -> None:
    if not is_int(start_step) or start_step < 0:
        raise FlatbmaError(f"method.start_step must be an integer >= 0 (updates before collecting), got {start_step!r}")
    if not is_int(collect_every) or collect_every < 1:
        raise FlatbmaError(
            f"method.collect_every must be an integer >= 1 (updates between snapshots), got {collect_every!r}"
        )


def last_quarter(map_steps: int) -> int:
    """SWAG's default ``start_step``: the collection window is the last 25% of the run's updates, ``T − ⌊T/4⌋``.

    With :attr:`~flatbma.family.Family.hold_lr` the learning rate is held over that window at the value the schedule
    reached where it opens (Maddox et al.'s ``swa_lr``): ``≈ 0.146·optim.lr`` for cosine (docs/methods.md §3.2).
    """
    return map_steps - map_steps // 4


def check_snapshots(method: Section, stage: Stage) -> None:
    """SWAG's families: the run must collect ``K = rank`` snapshots (2 for the diagonal variant), else it is refused.

    With fewer than ``K``, a second stage started at the posterior (``prior.init``) could not start.
    """
    o, key = method.options, stage.key
    low_rank = "rank" in o and not o.get("diagonal_only", False)
    if low_rank and o["rank"] < 2:
        return  # the builder refuses it with its own message
    needed = o["rank"] if low_rank else 2
    auto = o["collect_every"] == AUTO  # rank snapshots spread over the window (resolve)

    def count(steps: int) -> int:
        resolved = method.resolved(steps).options  # start_step: null and collect_every: auto for these steps
        return snapshots(steps, start_step=resolved["start_step"], collect_every=resolved["collect_every"])

    got = count(stage.steps)
    if got >= needed:
        return
    resolved = method.resolved(stage.steps).options
    start, every = resolved["start_step"], resolved["collect_every"]
    purpose = f"for {key('rank')}={needed}" if low_rank else "to sample (a variance takes two)"
    lower = (f"{key('start_step')}" if auto else f"{key('start_step')} or {key('collect_every')}") + (
        f", or {key('rank')}" if low_rank else ""
    )
    shown_start = f"null (the last quarter: {start})" if o["start_step"] is None else f"{start}"
    shown_every = f"auto ({every}: one snapshot per update)" if auto else f"{every}"
    raise FlatbmaError(
        f"{method.name} needs >= {needed} snapshots {purpose}, but {stage.describe()} with {key('start_step')}="
        f"{shown_start} and {key('collect_every')}={shown_every} collect {got}: raise {stage.epochs_key} to >= "
        f"{stage.epochs_for(stage.steps_for(count, needed))}, or lower {lower}"
    )


def advice(method: Section, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """What to change when SWAG's BMA is worse than its mean (:attr:`Family.advice`): half the covariance."""
    scale = method.options["scale"]
    return f"scale: {scale / 2:g} (now {scale:g})"


_RULES = {"check": check_snapshots, "start": last_quarter, "resolve": resolve, "hold_lr": True, "advice": advice}
FAMILY = Family(build, Options, gaussian=True, **_RULES)
"""SWAG, and along a SAM trajectory F-SWAG (:mod:`flatbma.methods`); ``start_step: null`` is :func:`last_quarter`
at a held learning rate, ``collect_every: auto`` is :func:`resolve`'s."""
DIAGONAL = Family(build_diag, DiagonalOptions, **_RULES)
"""SWAG-Diagonal (:func:`build_diag`)."""
