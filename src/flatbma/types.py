"""The one contract every optimizer and posterior in flatbma implements.

A method is a :class:`Transform` — a pair of pure-looking functions ``init`` and ``update`` over a
:class:`State` that holds the trained parameters as a ``dict[str, Tensor]`` — following the shape of
`posteriors <https://github.com/normal-computing/posteriors>`_ and optax. A :class:`Posterior` is a
transform that can also ``sample`` weights. The runner (:func:`flatbma.loop.fit`) drives
any of them with the same loop: ``state, out = method.update(state, batch)``.

``update`` may modify the tensors of the state it receives in place (like ``inplace=True`` in
posteriors) and returns the state to use next; callers must not rely on the old state afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple, Protocol, TypeVar

import torch
from torch import Tensor, nn

from flatbma.errors import FlatbmaError, FlatbmaTypeError

Params = dict[str, Tensor]
"""Named tensors: model parameters (``model.named_parameters()`` names) or method variables."""

Batch = tuple[Tensor, Tensor]
"""A mini-batch ``(inputs, targets)``: integer labels ``[B]``, or class probabilities ``[B, C]`` (soft targets)."""

INPUT_KEYS = ("x", "input", "inputs", "image", "images", "pixel_values")
"""The keys a dict batch may hold its inputs under, in the order they are looked up (:func:`split_batch`)."""

TARGET_KEYS = ("y", "label", "labels", "target", "targets")
"""The keys a dict batch may hold its targets under, in the order they are looked up (:func:`split_batch`)."""


def _from_mapping(batch: Mapping[Any, Any]) -> tuple[Tensor, Tensor | None]:
    """``(x, y)`` of a dict batch: the first key of :data:`INPUT_KEYS` it has, and of :data:`TARGET_KEYS`."""
    x_key = next((k for k in INPUT_KEYS if k in batch), None)
    y_key = next((k for k in TARGET_KEYS if k in batch), None)
    keys = ", ".join(repr(k) for k in batch)
    if x_key is None or not isinstance(batch[x_key], Tensor):
        raise FlatbmaTypeError(
            f"a dict batch must hold its inputs as a tensor under one of the keys {', '.join(INPUT_KEYS)}, got the "
            f"keys {keys or '(none)'}: rename them (e.g. {{'x': inputs, 'y': labels}})"
        )
    if y_key is not None and not isinstance(batch[y_key], Tensor):
        kind = type(batch[y_key]).__name__
        raise FlatbmaTypeError(f"a dict batch's targets ({y_key!r}) must be a tensor, got a {kind}")
    return batch[x_key], batch[y_key] if y_key is not None else None


def split_batch(batch: object) -> tuple[Tensor, Tensor | None]:
    """``(x, y)`` of one batch: ``(x, y)`` or ``(x,)`` (a tuple or a list, as DataLoaders yield), ``x``, or a dict.

    A dict batch (what a DataLoader over a dataset of dicts yields, e.g. ``{"x": ..., "y": ...}``) holds its
    inputs under the first of the keys :data:`INPUT_KEYS` it has (``x``, ``input``, ``inputs``, ``image``,
    ``images``, ``pixel_values``) and its targets under the first of :data:`TARGET_KEYS` (``y``, ``label``,
    ``labels``, ``target``, ``targets``); other keys are ignored. ``y`` is ``None`` for inputs alone
    (``x``, ``(x,)`` or a dict without a target key).

    Raises:
        FlatbmaError: for anything else (three tensors, a non-tensor entry, a dict without an input key).
    """
    if isinstance(batch, Tensor):
        return batch, None
    if isinstance(batch, Mapping):
        return _from_mapping(batch)
    if isinstance(batch, tuple | list) and len(batch) in (1, 2) and all(isinstance(t, Tensor) for t in batch):
        return batch[0], batch[1] if len(batch) == 2 else None
    kinds = ", ".join(type(t).__name__ for t in batch) if isinstance(batch, tuple | list) else ""
    raise FlatbmaError(
        f"a batch must be inputs x, (x,), (x, y) of tensors or a dict {{'x': ..., 'y': ...}}, got a "
        f"{type(batch).__name__}" + (f" of ({kinds})" if kinds else "") + "; give a DataLoader of such batches"
    )


def training_batch(batch: object) -> tuple[Tensor, Tensor]:
    """``(x, y)`` of a training batch: a pair of tensors or a dict (:func:`split_batch`), one target per row of ``x``.

    ``y`` holds 1-D integer class indices, or soft targets: float class probabilities ``[batch, classes]``
    (each row non-negative, summing to 1; the loss is then the cross-entropy with those probabilities,
    ``−Σ_c y_c log p_c``, as :func:`torch.nn.functional.cross_entropy` computes it).

    Raises:
        FlatbmaTypeError: another batch (inputs alone, three tensors) or labels of another kind.
        FlatbmaError: targets that are not one per input (their values are checked against the model's
            classes by the caller).
    """
    if isinstance(batch, Mapping):
        x, y = _from_mapping(batch)
        if y is None:
            raise FlatbmaTypeError(
                f"a dict training batch must hold its targets under one of the keys {', '.join(TARGET_KEYS)}, got "
                f"the keys {', '.join(repr(k) for k in batch)}"
            )
        batch = (x, y)
    if not (isinstance(batch, tuple | list) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch)):
        kinds = ", ".join(type(t).__name__ for t in batch) if isinstance(batch, tuple | list) else ""
        raise FlatbmaTypeError(
            f"a training batch must be a pair (x, y) of inputs and labels or a dict {{'x': ..., 'y': ...}}, got a "
            f"{type(batch).__name__}"
            + (f" of ({kinds})" if kinds else "")
            + ": give a DataLoader of (x, y) batches (e.g. over a TensorDataset(x, y))"
        )
    x, y = batch
    if y.is_floating_point() and y.dim() == 2 and x.dim() > 0 and y.shape[0] == x.shape[0]:
        return x, y  # soft targets: their classes and values are checked by the caller against the model's
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise FlatbmaTypeError(
            f"labels must be integer class indices [batch] or class probabilities [batch, classes], got "
            f"{str(y.dtype).removeprefix('torch.')} of shape {list(y.shape)}: convert them (y.long() for indices)"
        )
    if y.dim() != 1 or x.dim() == 0 or y.shape[0] != x.shape[0]:
        raise FlatbmaError(
            f"labels must be 1-D, one class index per input: got labels of shape {list(y.shape)} for inputs of "
            f"shape {list(x.shape)} (squeeze a [batch, 1] label tensor with y.squeeze(1))"
        )
    return x, y


@dataclass(frozen=True)
class State:
    """State of a method: a small frozen record of tensors and a step counter.

    Attributes:
        params: the trained variables. For point methods these are the model weights ``w``; for
            variational families the variational parameters ``θ`` (keys carry a prefix such as
            ``"mean/"``); a method documents its layout.
        buffers: model buffers (BatchNorm running statistics) that forward passes update.
        aux: method state — optimizer moments, SWAG moments, ... — as a flat ``dict[str, Tensor]``
            with ``/``-separated keys, so that every state saves to safetensors without pickling. A composed
            method keeps each component's entries under the component's name (:mod:`flatbma.named`, optax's
            ``named_chain``: an optimizer's ``optimizer/``, SWAG's ``point/`` and ``swag/``, a mixture's
            ``member<m>/``, the fp16 loss scale's ``amp/``), which only the family reads.
        step: number of ``update`` calls applied so far.
        derived: what a method computes from this state's tensors on first use and keeps with them
            (:func:`derive`: the Laplace family's fitted posterior, ``H``'s eigendecomposition and ``δ``). Never
            saved (a loaded state derives it again) and never compared; a state made by ``update`` or
            ``dataclasses.replace`` starts without any (its tensors may have changed in place), and a
            :func:`view` of a state keeps its own among the state's.
    """

    params: Params
    buffers: Params = field(default_factory=dict)
    aux: Params = field(default_factory=dict)
    step: int = 0
    derived: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)


T = TypeVar("T")


def derive(state: State, key: Hashable, compute: Callable[[State], T]) -> T:
    """``compute(state)``, computed once per state: kept in :attr:`State.derived` under ``key``.

    Valid because a state's tensors do not change while it is in use: ``update`` returns the state to use
    next, and callers do not rely on the old one afterwards (the module docstring).
    """
    if key not in state.derived:
        state.derived[key] = compute(state)
    return state.derived[key]


def view(state: State, key: str, params: Params, buffers: Params, aux: Params) -> State:
    """A state of (some of) ``state``'s tensors under other names — one member's, the method's own without a wrapper's.

    Its :attr:`~State.derived` values are kept in ``state``'s under ``key``, so that a view made again
    (one per call of a posterior's function) finds what an earlier one derived. ``step`` is ``state``'s.
    """
    out = State(params=params, buffers=buffers, aux=aux, step=state.step)
    object.__setattr__(out, "derived", state.derived.setdefault(key, {}))  # frozen: set as __init__ does
    return out


class StepOutput(NamedTuple):
    """What one ``update`` reports: the (unperturbed) mini-batch loss and the logits it computed.

    ``stats``: named scalars of the step that the loop averages over each epoch and logs (e.g. FP-BMA's
    ``ascent/mean_shift``, ``ascent/kl``: how far its ascent moved ``q``); ``None`` when there are none.
    """

    loss: Tensor
    logits: Tensor
    stats: Mapping[str, Tensor] | None = None


@dataclass(frozen=True)
class Transform:
    """``init(params, buffers) -> State`` and ``update(state, batch) -> (State, StepOutput)``."""

    init: Callable[[Params, Params], State]
    update: Callable[[State, Batch], tuple[State, StepOutput]]


@dataclass(frozen=True)
class Phase:
    """One phase of a family's updates, declared in the class variable ``phases`` of its options (:func:`phases`).

    A family's updates go through its phases in order; which one a state is in follows from the state (its
    ``step`` against the options, e.g. Laplace's ``start_step``), so a checkpoint holds it.

    Attributes:
        name: what the phase does (``"map"``, ``"curvature"``), as logs and refusals name it.
        epochs: ``None`` for a phase within the run's ``train.epochs`` (the optimizer's schedule spans them);
            else the passes over the training data the phase takes after them (Laplace's curvature pass: 1).
    """

    name: str
    epochs: int | None = None


TRAINING = (Phase("training"),)
"""The phases of a family that declares none: its updates are the ``train.epochs`` the optimizer's schedule spans."""


def phases(options: object) -> tuple[Phase, ...]:
    """The phases a family's options (the dataclass or an instance) declare in ``phases``; :data:`TRAINING` if none."""
    declared = getattr(options, "phases", TRAINING)
    if not (isinstance(declared, tuple) and declared and all(isinstance(p, Phase) for p in declared)):
        raise FlatbmaTypeError(
            f"{getattr(options, '__name__', type(options).__name__)}.phases must be a tuple of Phase"
        )
    return declared


def phases_after(options: object) -> tuple[Phase, ...]:
    """The phases of ``options`` (:func:`phases`) that the run takes after ``train.epochs``, in order."""
    return tuple(p for p in phases(options) if p.epochs is not None)


def extra_epochs(options: object) -> int:
    """The epochs a run of the family takes beyond ``train.epochs``: those of its :func:`phases_after`."""
    return sum(p.epochs or 0 for p in phases_after(options))


class Predictive(str, Enum):
    """How a posterior's BMA predicts (:attr:`Capabilities.predictive`; strings and members are both accepted).

    ``SAMPLES``: the Monte-Carlo average of the network's predictive over weight samples ``w_m``.
    ``GLM``: the same average for the network linearized at the posterior mean ``w̄``,
    ``f_lin(x; w_m) = f(x; w̄) + J(x)(w_m − w̄)`` (the MC-GLM predictive, Immer et al. 2021).
    ``PROBIT``: the probit approximation of the GLM predictive, ``softmax(κ ⊙ f(x; w̄))``,
    ``κ_c = (1 + π/8·σ²_c)^{−½}`` with ``σ²_c = (J Σ Jᵀ)_cc`` (MacKay 1992; deterministic).
    """

    SAMPLES = "samples"
    GLM = "glm"
    PROBIT = "probit"


@dataclass(frozen=True)
class Capabilities:
    """What some posteriors can do beyond sampling (:attr:`Posterior.can`); the default can none of it.

    Attributes:
        gaussian: ``gaussian(state) -> θ`` for posteriors that are a low-rank plus diagonal Gaussian
            ``N(μ, ½(diag σ² + LLᵀ/(K−1)))``: its ``mean/``, ``log_std/`` and ``factor/`` tensors in the
            layout of :mod:`flatbma.gaussian` (SWAG, low-rank VI, FP-BMA). A two-stage run
            uses it as the prior and initialization of the second stage; ``None`` for other posteriors.
            A mixture of such Gaussians (:attr:`members` ``> 0``, ``multi``) gives every member's ``θ``
            under its ``member<m>/`` prefix: one prior per member, not one Gaussian.
        members: number ``M`` of independent components (ensemble members) when the posterior is the
            uniform mixture ``q = (1/M) Σ_m q_m`` of components trained without interacting; 0 (the
            default) when it has none. ``train.parallel: members`` spreads them over processes.
            Contract: every component owns its own entries of ``params``/``buffers``/``aux``;
            ``update`` on a :attr:`split` state trains exactly the components it holds, as in the full
            state, and reports their mean loss and the log of their mixture predictive
            ``log (1/m) Σ_{j held} p_j(y|x)`` (so the outputs of a partition combine exactly); random
            draws of a component do not depend on which other components the state holds; ``sample``
            on a split state returns samples of its components only.
        split: ``split(state, indices) -> State``: the state of components ``indices ⊆ {0..M−1}``
            alone — the entries of ``state`` they own (the same tensors) and the same ``step``. The
            splits of a partition of ``{0..M−1}`` partition the entries, so the full state is their
            union. ``None`` exactly when ``members == 0``.
        predictive: how the BMA predicts (:class:`Predictive`): ``SAMPLES`` (every posterior but the
            Laplace family's linearized ones) averages ``softmax(f(x; w_m))`` over the samples; ``GLM``
            averages ``softmax(f(x; w̄) + J(x)(w_m − w̄))`` around :attr:`Posterior.mean` ``w̄``; ``PROBIT``
            is the deterministic ``softmax(κ ⊙ f(x; w̄))`` with ``κ_c = (1 + π/8·σ²_c)^{−½}`` and ``σ²`` from
            :attr:`functional_variance` (:mod:`flatbma.predict`). ``GLM`` needs :attr:`Posterior.mean`,
            ``PROBIT`` also :attr:`functional_variance`.
        functional_variance: ``functional_variance(state, J) -> σ²``: for per-example Jacobians of the
            logits ``J[name]`` of shape ``[B, C, *shape]`` at the mean, the diagonal of ``J Σ Jᵀ``,
            ``[B, C]``; ``None`` for posteriors without a closed-form covariance.
        diagnostics: ``diagnostics(state) -> {name: value}``: scalars the evaluation reports beside the
            metrics (the Laplace family's prior precision, log evidence and effective number of
            parameters); ``None`` (the default) reports nothing.
    """

    gaussian: Callable[[State], Params] | None = None
    members: int = 0
    split: Callable[[State, Sequence[int]], State] | None = None
    predictive: Predictive = Predictive.SAMPLES
    functional_variance: Callable[[State, Params], Tensor] | None = None
    diagnostics: Callable[[State], dict[str, float]] | None = None


@dataclass(frozen=True)
class Posterior(Transform):
    """A transform whose state defines a distribution over weights: ``init``, ``update``, ``sample``.

    ``sample(state, n, generator)`` returns ``n`` weight dictionaries, each holding parameters and
    buffers by their module names, ready for ``torch.func.functional_call``. A point estimate returns
    its single weight set regardless of ``n`` (the BMA of a point is the point). Beside them every
    posterior may give its mean and marginal variances in closed form and its prediction mode; what only
    some can do (a Gaussian's ``θ``, a mixture's members, a linearized predictive, diagnostics) is in
    :attr:`can`.

    Attributes:
        sample: ``sample(state, n, generator) -> list of weight dicts``.
        mean: ``mean(state) -> weights`` at the posterior mean ``E_q[w]``, in the form of a sample
            (parameters and buffers by module name): ``μ`` for a Gaussian (SWAG's SWA mean ``w̄``, VI's
            ``μ``, bSAM's ``m``), the point itself for a point estimate, the trained weights for MC
            dropout (``E[w ⊙ z/(1−p)] = w``). ``None`` for posteriors without a closed-form mean
            (ensembles, SG-MCMC): the evaluation then takes the average of the BMA's samples — the
            member average of an ensemble, the average of a chain's kept iterates. The flatness
            protocol measures λ₁ there (``lambda1_at_mean``).
        marginal_variance: ``marginal_variance(state) -> v`` with ``v[name]`` the diagonal of the
            posterior covariance ``Σ`` over trained parameter ``name`` (same shape), in closed form:
            exact for the Gaussian families, ``0`` for a point estimate. ``None`` where the posterior
            has none (ensembles, SG-MCMC): the width is then estimated from the BMA's samples
            (:mod:`flatbma.flatness.width`).
        predict_mode: ``predict_mode(model, generator)``: a context manager that puts the model in its
            prediction mode for the samples drawn from ``generator`` (a generator seeded as the one given to
            ``sample``, which the mode may draw from; :func:`prediction_mode` makes one per entry); ``None``
            means eval mode. MC dropout keeps dropout stochastic, with masks that follow from the generator
            (``None``: from torch's global generator).
        recompute_bn: whether the samples' own BatchNorm statistics do not match them (weights that
            were never trained with their own statistics, e.g. SWAG or VI samples). The evaluation
            (:func:`flatbma.experiment.run.evaluate.posterior_samples`) recomputes the statistics of every
            method's samples, point estimates included, on the un-augmented training data in a fixed
            order (:func:`flatbma.bn.recompute_bn_statistics`), so that every method is measured alike.
        can: what only some posteriors can do (:class:`Capabilities`).
    """

    sample: Callable[[State, int, torch.Generator | None], list[Params]]
    mean: Callable[[State], Params] | None = None
    marginal_variance: Callable[[State], Params] | None = None
    predict_mode: Callable[[nn.Module, torch.Generator | None], AbstractContextManager[Any]] | None = None
    recompute_bn: bool = False
    can: Capabilities = Capabilities()


def prediction_mode(method: Posterior, seed: int) -> Callable[[nn.Module], AbstractContextManager[Any]] | None:
    """``method``'s prediction mode for samples drawn from a CPU generator seeded with ``seed``; ``None``: eval mode.

    Every entry gets a fresh generator seeded alike, so every prediction with those samples draws the same
    randomness (MC dropout's masks), whatever ran before it.
    """
    mode = method.predict_mode
    if mode is None:
        return None
    return lambda model: mode(model, torch.Generator(device="cpu").manual_seed(seed))


class AscentSpace(str, Enum):
    """Where an ascent step acts (strings and members are both accepted).

    ``WEIGHTS``: on network weights ``w`` — a point estimate's, or each weight sample ``w(θ, z)`` of a
    variational posterior (F-VI, Nguyen et al. 2023). ``THETA``: on a variational posterior's own
    parameters ``θ`` (FP-BMA, Lim et al. 2025).
    """

    WEIGHTS = "weights"
    THETA = "theta"


class Ascent(Protocol):
    """An ascent (perturbation) step of the sharpness-aware family.

    ``perturb(params, grads)`` returns ``ε`` (same keys as ``grads``) such that the descent gradient
    is taken at ``params + ε``; ``space`` says what ``params`` are. SAM, ASAM and Fisher-SAM act on
    weights; FP-BMA's Fisher ball acts on variational parameters. An ascent step without a ``space``
    attribute acts on weights (:func:`ascent_space`).
    """

    space: AscentSpace

    def perturb(self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> Params:
        """Return the perturbation ε for every key of ``grads``."""
        ...


def ascent_space(ascent: Ascent | None) -> AscentSpace:
    """The space ``ascent`` acts in: its ``space`` attribute, ``WEIGHTS`` when it has none or is ``None``."""
    return AscentSpace(getattr(ascent, "space", AscentSpace.WEIGHTS))


class GradientTransformation(Protocol):
    """A first-order optimizer on a ``dict`` of tensors (the optax shape).

    ``init(params)`` returns its state as a flat tensor dict; ``apply(params, grads, state, step)``
    updates ``params`` in place and returns the new optimizer state.
    """

    def init(self, params: Mapping[str, Tensor]) -> Params:
        """Return the initial optimizer state."""
        ...

    def apply(self, params: Params, grads: Mapping[str, Tensor], state: Params, step: int) -> Params:
        """Apply one update to ``params`` in place and return the new optimizer state."""
        ...
