"""The Laplace approximation around a MAP trained in the same run: ``q(w) = N(w*, (H/T + δ)⁻¹)``.

Over 500 lines on purpose: its two stages, prior-precision choice and option checks read one ``Options`` and ``Fit``.

``w*`` is a point estimate (SGD, or SAM/ASAM/Fisher-SAM: F-Laplace), ``H`` the generalized Gauss-Newton (or
empirical Fisher) of the summed training loss at ``w*`` (:mod:`flatbma.curvature`), ``δ`` the precision of the prior
``N(w₀, δ⁻¹I)``, fixed or maximizing the Laplace evidence (MacKay 1992; Immer et al. 2021), and ``T`` a temperature.
The predictive is the network linearized at ``w*`` (GLM; Immer, Korzepa & Bauer 2021), its probit approximation, or
the network on the samples (:class:`flatbma.types.Predictive`; Daxberger et al. 2021, "Laplace Redux"); the maths:
docs/methods.md §3.9.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from functools import partial
from typing import Any, ClassVar, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from flatbma.bn import eval_mode
from flatbma.checks import is_int, is_number, parse_choice
from flatbma.curvature import (
    Blocks,
    Curvature,
    Estimator,
    Hessian,
    PriorStructure,
    effective_parameters,
    estimator,
    log_evidence,
    optimize_prior,
)
from flatbma.errors import FlatbmaError
from flatbma.family import Family, Nested, Section, Stage
from flatbma.models import classifier_of, is_pretrained
from flatbma.named import chain, entries, part, split, typed
from flatbma.params import Objective, clone
from flatbma.posteriors import point
from flatbma.posteriors.point import NAME as point_name
from flatbma.posteriors.point import init_aux as point_init_aux
from flatbma.posteriors.point import step as point_step
from flatbma.posteriors.point import weights_of
from flatbma.types import (
    Ascent,
    Batch,
    Capabilities,
    GradientTransformation,
    Params,
    Phase,
    Posterior,
    Predictive,
    State,
    StepOutput,
    derive,
)

POINT = point_name
"""Name of the MAP's component of ``State.aux``: the point update's state (its optimizer's, ``point/optimizer/``)."""
LAPLACE = "laplace"
"""Name of the curvature's component of ``State.aux``: an :class:`Accumulated` (:mod:`flatbma.named`)."""
SEEN = f"{LAPLACE}/seen"
"""The ``State.aux`` entry of :attr:`Accumulated.seen`."""


class Accumulated(NamedTuple):
    """The Laplace family's own state: what the curvature phase accumulated at ``w*``.

    Attributes:
        curvature: the curvature estimator's accumulators, by their keys (:mod:`flatbma.curvature`).
        seen: examples whose curvature was accumulated (int64; this process's, under data parallelism).
        nll: ``Σ ℓ_i(w*)`` over those examples (float64), for the reported evidence.
        prior_mean: ``w₀`` of ``prior_mean: pretrained``, one per trained tensor (its dtype); empty otherwise.
    """

    curvature: dict[str, Tensor]
    seen: Tensor
    nll: Tensor
    prior_mean: dict[str, Tensor]


VALIDATION = "val"
"""``prior_precision: val``: δ chosen on validation data after training (by :func:`flatbma.fit_posterior`)."""

_log = logging.getLogger(__name__)


class PriorMean(str, Enum):
    """The mean ``w₀`` of the prior ``N(w₀, δ⁻¹I)``.

    ``zero``: ``w₀ = 0``. ``pretrained``: ``w₀`` is the value given to ``init`` of every trained tensor loaded from
    a pretrained checkpoint (:func:`flatbma.models.is_pretrained`), 0 for the others (a re-initialized head): the
    L2-SP prior of transfer learning (Li, Grandvalet & Davoine, ICML 2018).
    """

    ZERO = "zero"
    PRETRAINED = "pretrained"


class Subset(str, Enum):
    """The weights the Laplace approximation is over; the others stay at the MAP (which trains them all).

    ``all``: every trained weight. ``last-layer``: the weight and bias of the classifier, the model's last
    ``nn.Linear``: laplace-torch's default (Daxberger et al., "Laplace Redux", NeurIPS 2021, §4).
    """

    ALL = "all"
    LAST_LAYER = "last-layer"


MAP = Phase("map")
"""Laplace's first phase (:func:`phase`): its first ``start_step`` updates train the MAP ``w*`` (``train.epochs``)."""
CURVATURE = Phase("curvature", epochs=1)
"""Laplace's second phase: one epoch after the MAP's accumulates the curvature at ``w*`` (:func:`curvature_step`)."""


@dataclass(frozen=True)
class Options:
    """Laplace's options (:func:`build`).

    Attributes:
        start_step: MAP updates before the curvature phase (0: post-hoc Laplace of the weights given to
            ``init``). ``None``: all the run's ``train.epochs``, set by :func:`flatbma.training.build`.
        hessian: ``diag``, ``kfac`` (Linear/Conv2d weights ``B ⊗ A``, everything else diagonal) or ``full``.
        curvature: ``ggn`` or ``ef`` (the empirical Fisher: cheaper, not second-order information).
        prior_precision: a fixed ``δ > 0``, ``None`` to maximize the evidence, or ``"val"`` (:data:`VALIDATION`):
            chosen after training by the BMA's validation NLL over a grid (:func:`flatbma.fit_posterior` with
            ``val_loader=``); until then the posterior is the evidence's.
        prior_structure: ``scalar`` (one ``δ``) or ``layerwise`` (one per parameter tensor; not with ``full``).
        prior_mean: ``zero`` or ``pretrained`` (:class:`PriorMean`; a model with no trained tensor loaded
            from a checkpoint is refused at ``init``).
        temperature: ``T > 0`` of ``P = H/T + δ`` (``T < 1`` sharpens the posterior).
        predictive: ``glm``, ``probit`` or ``samples`` (:class:`flatbma.types.Predictive`).
        max_full: ``full``: the primal ``[d, d]`` form up to ``d = max_full``, the dual rows up to
            ``n·C = max_full``; otherwise refused.
        subset: the weights the posterior is over (:class:`Subset`): ``last-layer`` (the default) or ``all``.
    """

    phases: ClassVar[tuple[Phase, ...]] = (MAP, CURVATURE)
    """The MAP phase (``train.epochs``, with ``start_step: None``), then the curvature phase's epoch after it."""

    start_step: int | None = None
    hessian: Hessian = Hessian.KFAC
    curvature: Curvature = Curvature.GGN
    prior_precision: float | Literal["val"] | None = None
    prior_structure: PriorStructure = PriorStructure.SCALAR
    prior_mean: PriorMean = PriorMean.ZERO
    temperature: float = 1.0
    predictive: Predictive = Predictive.GLM
    max_full: int = 4096
    subset: Subset = Subset.LAST_LAYER


@dataclass(frozen=True)
class Fit:
    """A state's posterior: ``H`` eigendecomposed, the prior precision ``δ`` per block and the evidence.

    Attributes:
        blocks: ``H`` in block-diagonal eigen form (:class:`flatbma.curvature.Blocks`).
        delta: ``δ_g`` per block.
        log_evidence: ``log Z(δ)`` (:func:`flatbma.curvature.log_evidence`).
        effective_params: ``γ = Σ_j (λ_j/T)/(λ_j/T + δ)`` (MacKay's effective number of parameters).
    """

    blocks: Blocks
    delta: dict[str, float]
    log_evidence: float
    effective_params: float


def build(
    objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None = None, **options
) -> Posterior:
    """A MAP phase, then a curvature phase, then ``N(w*, P⁻¹)`` with ``P = H/T + δ``.

    MAP phase: updates ``1..start_step`` are exactly :func:`flatbma.posteriors.point.step` (with ``ascent``, SAM
    gives F-Laplace). Curvature phase: every later update leaves ``w = w*`` and the optimizer state alone and adds
    the batch's ``Σ_{i∈B} J_iᵀ Λ_i J_i`` (GGN, ``Λ_i = diag p_i − p_i p_iᵀ``; or the empirical Fisher
    ``Σ_i g_i g_iᵀ``) to the accumulators (:func:`curvature_step`); after ``n_seen`` examples
    ``H = (n/n_seen)·Σ_seen`` (``n = objective.num_data``).

    Posterior (computed on first use, :func:`fitted`; never saved): ``δ`` is ``prior_precision``, or the maximizer
    of the Laplace evidence (MacKay 1992)
    ``log Z(δ) = −Σ_i ℓ_i(w*) − ½ Σ_g δ_g‖w*_g − w₀_g‖² + ½ Σ_g d_g log δ_g − ½ log det(H/T + diag δ)``,
    where ``δ‖w* − w₀‖² = γ`` (:func:`flatbma.curvature.optimize_prior`). The prior mean ``w₀`` (:class:`PriorMean`,
    kept in the state) enters only ``δ`` and the evidence: the posterior mean stays ``w*``. ``sample`` returns
    ``w* + Δ_m``, ``Δ_m ~ N(0, P⁻¹)``; ``marginal_variance`` is ``diag P⁻¹`` and ``functional_variance``
    ``diag(J P⁻¹ Jᵀ)``, both exact for the structure; ``diagnostics`` report ``δ``, ``log Z(δ)`` and ``γ``.

    Raises:
        FlatbmaError: an option out of range, a loss other than cross-entropy, and (at ``init``) a
            structure the trained weights or the run cannot take (see :func:`check_options`).
    """
    o = check_options(Options(**options))
    if objective.loss_fn is not F.cross_entropy:
        raise FlatbmaError(
            "laplace: the curvature is the Gauss-Newton of the cross-entropy (softmax) loss, but the objective has "
            f"another loss_fn ({getattr(objective.loss_fn, '__name__', type(objective.loss_fn).__name__)}); use the "
            "default cross-entropy"
        )
    fixed = {"options": o, "objective": objective}
    return Posterior(
        init=partial(init, **fixed, optimizer=optimizer, ascent=ascent),
        update=partial(update, **fixed, optimizer=optimizer, ascent=ascent),
        sample=partial(sample, **fixed),
        recompute_bn=True,
        mean=weights_of,
        marginal_variance=partial(marginal_variance, **fixed),
        can=Capabilities(
            predictive=o.predictive,
            functional_variance=partial(functional_variance, **fixed),
            diagnostics=partial(diagnostics, **fixed),
        ),
    )


def init(
    params: Params,
    buffers: Params,
    *,
    options: Options,
    objective: Objective,
    optimizer: GradientTransformation,
    ascent: Ascent | None,
) -> State:
    """The MAP's state (:func:`flatbma.posteriors.point.init_aux`), empty accumulators and, if pretrained, ``w₀``."""
    params = clone(params)
    est = _estimator(options, objective, chosen(options, objective, params))
    _log.info("laplace curvature: %s", est.describe())
    device = next(iter(params.values())).device
    own = Accumulated(
        curvature=est.init(),
        seen=torch.zeros((), dtype=torch.int64, device=device),
        nll=torch.zeros((), dtype=torch.float64, device=device),
        prior_mean=pretrained_mean(objective.model, params) if options.prior_mean is PriorMean.PRETRAINED else {},
    )
    aux = chain((POINT, point_init_aux(optimizer, ascent, params)), (LAPLACE, entries(own)))
    return State(params=params, buffers=clone(buffers), aux=aux)


def curvature_of(state: State) -> Accumulated:
    """The state's :class:`Accumulated` (its ``laplace/`` entries, the same tensors)."""
    return typed(Accumulated, part(LAPLACE, state.aux))


def phase(state: State, options: Options) -> Phase:
    """:data:`MAP` for the first ``start_step`` updates, then :data:`CURVATURE` (the state's step says which).

    Raises:
        FlatbmaError: ``start_step`` is ``None`` (left to :func:`flatbma.training.build`, which sets it).
    """
    if options.start_step is None:
        raise FlatbmaError(
            "laplace.build(start_step=None) leaves the MAP phase's length to the run (flatbma.training.build); give "
            "start_step (the MAP updates; 0 = post-hoc Laplace of the weights given to init)"
        )
    return MAP if state.step < options.start_step else CURVATURE


def update(
    state: State,
    batch: Batch,
    *,
    options: Options,
    objective: Objective,
    optimizer: GradientTransformation,
    ascent: Ascent | None,
) -> tuple[State, StepOutput]:
    """One update of the state's :func:`phase`: :func:`map_step` or :func:`curvature_step`."""
    if phase(state, options) is MAP:
        return map_step(state, batch, objective=objective, optimizer=optimizer, ascent=ascent)
    return curvature_step(state, batch, options=options, objective=objective)


def map_step(
    state: State, batch: Batch, *, objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None
) -> tuple[State, StepOutput]:
    """:func:`flatbma.posteriors.point.step` on the MAP's state (``point/``), the curvature's (``laplace/``) kept."""
    opt, own = split(state.aux, POINT, LAPLACE)
    opt, out = point_step(objective, optimizer, ascent, state.params, state.buffers, opt, state.step, batch)
    return replace(state, aux=chain((POINT, opt), (LAPLACE, own)), step=state.step + 1), out


def curvature_step(state: State, batch: Batch, *, options: Options, objective: Objective) -> tuple[State, StepOutput]:
    """Add the batch's ``Σ_{i∈B} J_iᵀ Λ_i J_i`` (or ``Σ_i g_i g_iᵀ``) and ``Σ_i ℓ_i(w*)`` at ``w*``, in eval mode.

    The first one (``step = start_step``) under data parallelism averages the BatchNorm statistics over the
    processes, so that every process linearizes the same network.
    """
    x, y = batch
    bayesian = chosen(options, objective, state.params)
    est = _estimator(options, objective, bayesian)
    opt, own = split(state.aux, POINT, LAPLACE)
    curv = typed(Accumulated, own)
    seen, b = int(curv.seen), int(y.shape[0])
    if est.form == "dual" and seen + b > objective.num_data:
        raise FlatbmaError(
            f"laplace: hessian: full in its dual form keeps one row per training example, so its curvature "
            f"phase is one epoch, but start_step={options.start_step} leaves more updates (after {seen} examples); "
            "set start_step to train.epochs × steps per epoch (null in a config)"
        )
    reduce = objective.reduce_grads
    buffers = state.buffers
    if reduce is not None and state.step == options.start_step:  # every process linearizes the same network
        floats = {k: v for k, v in buffers.items() if v.is_floating_point()}
        averaged = reduce(floats) if floats else {}
        buffers = {k: averaged[k].clone() if k in averaged else v for k, v in buffers.items()}
    fixed = {k: v for k, v in state.params.items() if k not in bayesian}  # at w*, no curvature
    acc = est.accumulate(curv.curvature, bayesian, {**buffers, **fixed}, x, y, offset=seen, reduce=reduce)
    with torch.no_grad(), eval_mode(objective.model):
        logits = objective.logits({**state.params, **buffers}, x)
        losses = F.cross_entropy(logits, y, reduction="none")
    nll = losses.to(torch.float64).sum()
    if reduce is not None:  # Σ over the global batch / number of processes, as the curvature
        nll = reduce({"nll": nll / b})["nll"] * b
    curv = curv._replace(curvature={**curv.curvature, **acc}, seen=curv.seen + b, nll=curv.nll + nll)
    aux = chain((POINT, opt), (LAPLACE, entries(curv)))
    out = StepOutput(objective.loss_fn(logits, y), logits)
    return replace(state, buffers=buffers, aux=aux, step=state.step + 1), out


def fitted(state: State, *, options: Options, objective: Objective) -> Fit:
    """The state's posterior :class:`Fit`, computed on first use and kept with it (:func:`~flatbma.types.derive`).

    Raises:
        FlatbmaError: the state accumulated no curvature yet (it is in its MAP phase).
    """
    key = ("laplace/fit", options, objective.num_data)  # one state may be read under other options
    return derive(state, key, partial(_fit, options=options, objective=objective))


def _fit(state: State, *, options: Options, objective: Objective) -> Fit:
    curv = curvature_of(state)
    seen = int(curv.seen)
    if seen < 1:
        raise FlatbmaError(
            "laplace: no curvature was accumulated yet (the state is still in its MAP phase): train at least one "
            "epoch after start_step before sampling"
        )
    params = chosen(options, objective, state.params)
    est = _estimator(options, objective, params)
    blocks = est.blocks(curv.curvature, seen, objective.num_data)
    w0 = None
    if options.prior_mean is PriorMean.PRETRAINED:
        w0 = {k: v for k, v in curv.prior_mean.items() if k in params}
    t = options.temperature
    if options.prior_precision is None or options.prior_precision == VALIDATION:  # val: the evidence's until chosen
        delta = optimize_prior(blocks, params, t, options.prior_structure, w0)
    else:
        delta = dict.fromkeys(blocks.names, float(options.prior_precision))
    nll = float(curv.nll) * objective.num_data / seen  # the summed loss over the n training examples
    return Fit(
        blocks=blocks,
        delta=delta,
        log_evidence=log_evidence(blocks, params, nll, delta, t, w0),
        effective_params=effective_parameters(blocks, delta, t),
    )


def sample(
    state: State, n: int, generator: torch.Generator | None = None, *, options: Options, objective: Objective
) -> list[Params]:
    """``n`` draws ``w* + Δ_m``, ``Δ_m ~ N(0, P⁻¹)`` (``Δ_m = 0`` off the :class:`Subset`), with the buffers."""
    fit = fitted(state, options=options, objective=objective)
    draws = fit.blocks.sample(n, fit.delta, options.temperature, generator)
    return [{**{k: v + d[k] if k in d else v for k, v in state.params.items()}, **state.buffers} for d in draws]


def marginal_variance(state: State, *, options: Options, objective: Objective) -> Params:
    """``diag P⁻¹`` by parameter name, exact for the structure."""
    fit = fitted(state, options=options, objective=objective)
    return fit.blocks.marginal_variance(fit.delta, options.temperature)


def functional_variance(state: State, jac: Params, *, options: Options, objective: Objective) -> Tensor:
    """``diag(J P⁻¹ Jᵀ)`` ``[B, C]`` for the per-example Jacobians ``jac``, exact for the structure.

    Only the Jacobians of the :class:`Subset`'s weights enter (the others have no variance).
    """
    fit = fitted(state, options=options, objective=objective)
    over = chosen(options, objective, state.params)
    return fit.blocks.functional_variance({k: v for k, v in jac.items() if k in over}, fit.delta, options.temperature)


def diagnostics(state: State, *, options: Options, objective: Objective) -> dict[str, float]:
    """The fit's prior precision, log evidence and effective number of parameters (:func:`describe`)."""
    return describe(fitted(state, options=options, objective=objective))


def chosen(options: Options, objective: Objective, params: Params) -> Params:
    """The weights of ``params`` the posterior is over (:attr:`Options.subset`)."""
    return params if options.subset is Subset.ALL else _last_layer(objective.model, params)


def _last_layer(model: torch.nn.Module, params: Params) -> Params:
    """The trained weights of ``model``'s classifier, its last ``nn.Linear`` (:attr:`Subset.LAST_LAYER`)."""
    try:
        name = classifier_of(model)[0]
    except FlatbmaError:
        raise FlatbmaError(
            f"laplace: subset: last-layer is the classifier, the model's last nn.Linear, but {type(model).__name__} "
            "has none; use subset: all"
        ) from None
    prefix = f"{name}." if name else ""
    out = {k: v for k, v in params.items() if k.startswith(prefix) and "." not in k[len(prefix) :]}
    if not out:
        raise FlatbmaError(
            f"laplace: subset: last-layer is the classifier {name or '(the model)'}, but none of its weights is "
            "trained (requires_grad=False); train it, or use subset: all"
        )
    return out


def _estimator(options: Options, objective: Objective, params: Params) -> Estimator:
    """The curvature estimator of ``options`` for ``params`` (refusing what the run cannot take)."""
    est = estimator(
        options.hessian,
        options.curvature,
        objective.model,
        params,
        num_data=objective.num_data,
        num_classes=_num_classes(objective.model),
        max_full=options.max_full,
    )
    if objective.reduce_grads is not None and not est.data_parallel:
        raise FlatbmaError(
            "laplace: hessian: full in its dual form (n·C ≤ max_full < d) keeps one row per training example "
            "and cannot run under train.parallel: data; use hessian: kfac or diag, or one process"
        )
    evidence = options.prior_precision is None or options.prior_precision == VALIDATION
    if evidence and options.prior_structure is PriorStructure.LAYERWISE and not est.blockwise:
        raise FlatbmaError(
            "laplace: prior_structure: layerwise needs a curvature that is block-diagonal over parameter "
            "tensors, but hessian: full couples them all; use prior_structure: scalar, or hessian: kfac or diag"
        )
    return est


def pretrained_mean(model: torch.nn.Module, params: Params) -> Params:
    """``w₀`` of ``prior_mean: pretrained``: ``params`` where ``model`` loaded them from a checkpoint, else zeros.

    Raises:
        FlatbmaError: none of ``params`` was loaded from a checkpoint (``w₀`` would be 0: ``prior_mean: zero``).
    """
    loaded = {name for name, p in model.named_parameters() if is_pretrained(p)}
    if not loaded & set(params):
        raise FlatbmaError(
            "laplace: prior_mean: pretrained centres the prior at the weights loaded from a pretrained checkpoint, "
            f"but none of the {len(params)} trained tensors of {type(model).__name__} was (nothing is pretrained): "
            "set model.pretrained (flatbma.models.build_model(..., pretrained=...)), or use prior_mean: zero"
        )
    return {k: v.detach().clone() if k in loaded else torch.zeros_like(v) for k, v in params.items()}


def describe(fit: Fit) -> dict[str, float]:
    """A fit's :attr:`~flatbma.types.Capabilities.diagnostics`: its prior precision, log evidence and γ.

    A layerwise ``δ`` gives the geometric mean as ``prior_precision`` and each as ``prior_precision/<tensor>``.
    """
    values = list(fit.delta.values())
    if len(set(values)) == 1:
        out = {"prior_precision": values[0]}
    else:
        out = {"prior_precision": math.exp(sum(math.log(v) for v in values) / len(values))}
        out.update({f"prior_precision/{g}": v for g, v in fit.delta.items()})
    out["log_evidence"] = fit.log_evidence
    out["effective_params"] = fit.effective_params
    return out


def check_options(options: Options, where: str = "method") -> Options:
    """Check :class:`Options` (a refusal is one line naming ``{where}.<option>``); return them with Enum members."""
    o = options
    if o.start_step is not None and (not is_int(o.start_step) or o.start_step < 0):
        raise FlatbmaError(
            f"{where}.start_step must be an integer >= 0 (MAP updates before the curvature pass) or null, got "
            f"{o.start_step!r}"
        )
    if (
        o.prior_precision is not None
        and o.prior_precision != VALIDATION
        and not (is_number(o.prior_precision) and math.isfinite(o.prior_precision) and o.prior_precision > 0)
    ):
        raise FlatbmaError(
            f"{where}.prior_precision must be a positive number (a fixed δ), null (maximize the evidence) or val "
            "(chosen on validation data), got "
            f"{o.prior_precision!r}"
        )
    if not (is_number(o.temperature) and math.isfinite(o.temperature) and o.temperature > 0):
        raise FlatbmaError(f"{where}.temperature must be a positive number (P = H/T + δ), got {o.temperature!r}")
    if not is_int(o.max_full) or o.max_full < 1:
        raise FlatbmaError(f"{where}.max_full must be a positive integer, got {o.max_full!r}")
    return replace(
        o,
        hessian=parse_choice(Hessian, o.hessian, f"{where}.hessian"),
        curvature=parse_choice(Curvature, o.curvature, f"{where}.curvature"),
        prior_structure=parse_choice(PriorStructure, o.prior_structure, f"{where}.prior_structure"),
        prior_mean=parse_choice(PriorMean, o.prior_mean, f"{where}.prior_mean"),
        predictive=parse_choice(Predictive, o.predictive, f"{where}.predictive"),
        subset=parse_choice(Subset, o.subset, f"{where}.subset"),
    )


def _num_classes(model: torch.nn.Module) -> int:
    """``C``: the output width of the model's classifier (its last ``nn.Linear``), fixing the accumulators' shapes."""
    try:
        return int(classifier_of(model)[1].out_features)
    except FlatbmaError:
        raise FlatbmaError(
            f"laplace needs the number of classes from the model's classifier (its last nn.Linear), but "
            f"{type(model).__name__} has no nn.Linear"
        ) from None


MAP_REFUSAL = "Laplace needs a MAP: {where} must be a point method ({methods}), got {got}"
"""The refusal of an ``of`` that is no point method (:attr:`flatbma.family.Nested.refusal`)."""


def build_around(
    objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None = None, *, of: Any, **options
) -> Posterior:
    """:func:`build` around the MAP of ``of`` (a point method's section).

    ``options`` are those of :class:`Options`; ``ascent`` is unused: the MAP's ascent step is ``of``'s.
    """
    return build(objective, optimizer, of.ascent, **options)


def check_laplace(method: Section, stage: Stage) -> None:
    """Laplace: options, a curvature epoch, a ``full`` Hessian within ``max_full``, a pretrained net for ``w₀``.

    ``start_step`` must be at most ``stage.steps``: the curvature epoch runs after ``stage.epochs``.

    Raises:
        FlatbmaError: any of these fails, or ``prior_precision: val`` outside the run's own method.
    """
    o, key = method.options, stage.key
    if o["prior_precision"] == VALIDATION and stage.method_key != "method":  # chosen after training
        raise FlatbmaError(
            f"{key('prior_precision')}: val chooses δ on validation data for the run's own method, not for a "
            f"mixture's members or a prior stage: give {key('prior_precision')} a value, or null (the evidence)"
        )
    check_options(Options(**{k: v for k, v in o.items() if k != "of"}), where=stage.method_key)
    if PriorMean(o["prior_mean"]) is PriorMean.PRETRAINED and not stage.shape.pretrained:
        raise FlatbmaError(
            f"{key('prior_mean')}: pretrained centres the prior at the pretrained weights, but model.pretrained is "
            f"null (nothing is pretrained): set model.pretrained, or use {key('prior_mean')}: zero"
        )
    start = o["start_step"]
    if start is not None and start > stage.steps:
        raise FlatbmaError(
            f"{method.name} accumulates its curvature over the epoch after its MAP, but {key('start_step')}={start} "
            f"is past {stage.describe()}: lower {key('start_step')} to <= {stage.steps} (null: all of them), or raise "
            f"{stage.epochs_key} to >= {stage.epochs_for(start)}"
        )
    d, shape = stage.shape.num_trainable, stage.shape
    whole = Subset(o["subset"]) is Subset.ALL  # the last layer's d: checked at init
    if whole and Hessian(o["hessian"]) is Hessian.FULL and d is not None and shape.num_classes is not None:
        k = shape.num_classes if Curvature(o["curvature"]) is Curvature.GGN else 1
        if d > o["max_full"] and shape.num_train * k > o["max_full"]:
            raise FlatbmaError(
                f"{key('hessian')}: full needs d <= {key('max_full')} (primal) or n·K <= {key('max_full')} (dual), but "
                f"d = {d} and n·K = {shape.num_train}·{k} = {shape.num_train * k} exceed {key('max_full')}="
                f"{o['max_full']}: use {key('hessian')}: kfac or diag, model.trainable: classifier, or raise "
                f"{key('max_full')}"
            )


_LAPLACE_PRIOR = (
    "its prior is N(w₀, δ⁻¹I) (method.prior_mean, method.prior_precision), fitted around the MAP it trains: remove "
    "the prior section"
)


def _whole_map(map_steps: int) -> int:
    """Laplace's ``start_step: null``: the curvature pass starts after the whole MAP (``train.epochs`` of updates)."""
    return map_steps


PRIOR_PRECISION_GRID = tuple(10.0 ** (k / 5) for k in range(-20, 21))
"""Laplace's ``prior_precision: val`` grid: 41 values ``10^(k/5)``, 1e-4 to 1e4 (laplace-torch's range)."""


def _full_hessian(method: Section) -> bool:
    return Hessian(method.options["hessian"]) is Hessian.FULL


def advice(method: Section, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """What to change when Laplace's BMA is worse than its MAP: the last layer, a larger δ, the GLM predictive."""
    o, tips = method.options, []
    if Subset(o["subset"]) is Subset.ALL:
        tips.append("subset: last-layer")
    delta = diagnostics.get("prior_precision")
    above = f"above δ = {delta:.3g}" if isinstance(delta, int | float) else "larger"
    if o["prior_precision"] == VALIDATION:
        tips.append(f"a fixed prior_precision {above}")
    else:
        tips.append(f"prior_precision: val, or {above}")
    if Predictive(o["predictive"]) is Predictive.SAMPLES:
        tips.append("predictive: glm")
    return "; ".join(tips)


_COMMON = {
    "check": check_laplace,
    "needs_weights": _full_hessian,
    "start": _whole_map,
    "advice": advice,
    "on_validation": {"prior_precision": PRIOR_PRECISION_GRID},
    "prior_refusal": _LAPLACE_PRIOR,
    "regression": False,
}
FAMILY = Family(build_around, Options, of=Nested("sgd", family=point.FAMILY, refusal=MAP_REFUSAL), **_COMMON)
"""Laplace around the MAP of a point method's section ``of`` (:mod:`flatbma.methods`)."""
SHARP = Family(build, Options, **_COMMON)
"""Laplace around the MAP its own ascent step trains: F-Laplace with SAM (:mod:`flatbma.methods`)."""
