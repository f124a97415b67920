"""The one contract every optimizer and posterior in flatbma implements.

A method is a :class:`Transform` — functions ``init`` and ``update`` over a :class:`State` holding the trained
parameters as a ``dict[str, Tensor]``, in the shape of `posteriors <https://github.com/normal-computing/posteriors>`_
and optax; a :class:`Posterior` can also ``sample`` weights. :func:`flatbma.loop.fit` drives any of them with
``state, out = method.update(state, batch)``.

``update`` may modify the tensors of the state it receives in place and returns the state to use next;
callers must not rely on the old state afterwards.
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

    A dict batch holds its inputs under the first of :data:`INPUT_KEYS` it has and its targets under the first
    of :data:`TARGET_KEYS`; other keys are ignored. ``y`` is ``None`` for inputs alone.

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

    ``y`` holds 1-D integer class indices, or soft targets ``[batch, classes]`` (rows of class probabilities;
    the loss is then ``−Σ_c y_c log p_c``).

    Raises:
        FlatbmaTypeError: another batch (inputs alone, three tensors) or labels of another kind.
        FlatbmaError: targets that are not one per input (the caller checks their values).
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
        params: the trained variables: the weights ``w`` for point methods, the variational parameters ``θ``
            for variational families (keys prefixed, e.g. ``"mean/"``).
        buffers: model buffers (BatchNorm running statistics) that forward passes update.
        aux: method state (optimizer moments, SWAG moments, ...) as a flat ``dict[str, Tensor]`` with
            ``/``-separated keys, saved to safetensors without pickling; a composed method keeps each
            component's entries under its name (:mod:`flatbma.named`).
        step: number of ``update`` calls applied so far.
        derived: what a method computes from this state's tensors on first use (:func:`derive`). Never
            saved or compared; a state made by ``update`` or ``dataclasses.replace`` starts without any.
    """

    params: Params
    buffers: Params = field(default_factory=dict)
    aux: Params = field(default_factory=dict)
    step: int = 0
    derived: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)


T = TypeVar("T")


def derive(state: State, key: Hashable, compute: Callable[[State], T]) -> T:
    """``compute(state)``, computed once per state: kept in :attr:`State.derived` under ``key``.

    Valid because a state's tensors do not change while it is in use (the module docstring).
    """
    if key not in state.derived:
        state.derived[key] = compute(state)
    return state.derived[key]


def view(state: State, key: str, params: Params, buffers: Params, aux: Params) -> State:
    """A state of (some of) ``state``'s tensors under other names — one member's, the method's own without a wrapper's.

    Its :attr:`~State.derived` values are kept in ``state``'s under ``key``, so a view made again finds them.
    ``step`` is ``state``'s.
    """
    out = State(params=params, buffers=buffers, aux=aux, step=state.step)
    object.__setattr__(out, "derived", state.derived.setdefault(key, {}))  # frozen: set as __init__ does
    return out


class StepOutput(NamedTuple):
    """What one ``update`` reports: the (unperturbed) mini-batch loss and the logits it computed.

    ``stats``: named scalars the loop averages over each epoch and logs (e.g. ``ascent/kl``), or ``None``.
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

    A family's updates go through its phases in order; a state's phase follows from its ``step`` and the options.

    Attributes:
        name: what the phase does (``"map"``, ``"curvature"``), as logs and refusals name it.
        epochs: ``None`` for a phase within the run's ``train.epochs``; else the passes over the training data
            it takes after them (Laplace's curvature pass: 1).
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

    ``SAMPLES``: the Monte-Carlo average of ``softmax(f(x; w_m))`` over weight samples ``w_m``.
    ``GLM``: the same average for the network linearized at the posterior mean ``w̄``,
    ``f(x; w̄) + J(x)(w_m − w̄)`` (Immer et al. 2021); needs :attr:`Posterior.mean`.
    ``PROBIT``: the deterministic ``softmax(κ ⊙ f(x; w̄))``, ``κ_c = (1 + π/8·σ²_c)^{−½}``,
    ``σ²_c = (J Σ Jᵀ)_cc`` (MacKay 1992); also needs ``Capabilities.functional_variance``.
    """

    SAMPLES = "samples"
    GLM = "glm"
    PROBIT = "probit"


@dataclass(frozen=True)
class Capabilities:
    """What some posteriors can do beyond sampling (:attr:`Posterior.can`); the default can none of it.

    Attributes:
        gaussian: ``gaussian(state) -> θ`` for a low-rank plus diagonal Gaussian ``N(μ, ½(diag σ² + LLᵀ/(K−1)))``:
            its ``mean/``, ``log_std/`` and ``factor/`` tensors in the layout of :mod:`flatbma.gaussian`, used
            as a two-stage run's prior. A mixture of such Gaussians gives every member's ``θ`` under its
            ``member<m>/`` prefix. ``None`` for other posteriors.
        members: number ``M`` of components of a uniform mixture ``q = (1/M) Σ_m q_m`` trained without
            interacting (0: none). Contract: each component owns its entries of the state; ``update`` on a
            :attr:`split` state trains exactly its components as in the full state, reporting their mean loss
            and the log of their mixture predictive ``log (1/m) Σ_{j held} p_j(y|x)``; a component's random
            draws do not depend on the others held; ``sample`` on a split state samples its components only.
        split: ``split(state, indices) -> State``: the entries (same tensors) and ``step`` of components
            ``indices ⊆ {0..M−1}``; a partition's splits partition the entries. ``None`` exactly when
            ``members == 0``.
        predictive: how the BMA predicts (:class:`Predictive`).
        functional_variance: ``functional_variance(state, J) -> σ²``: for per-example logit Jacobians ``J[name]``
            ``[B, C, *shape]`` at the mean, the diagonal of ``J Σ Jᵀ``, ``[B, C]``; ``None`` without a
            closed-form covariance.
        diagnostics: ``diagnostics(state) -> {name: value}``: scalars the evaluation reports beside the
            metrics (e.g. Laplace's log evidence); ``None`` reports nothing.
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

    A point estimate's ``sample`` returns its single weight set regardless of ``n``.

    Attributes:
        sample: ``sample(state, n, generator) -> list of n weight dicts`` (parameters and buffers by module
            name, ready for ``torch.func.functional_call``).
        mean: ``mean(state) -> weights`` at the posterior mean ``E_q[w]``, in the form of a sample (``μ`` for
            a Gaussian, the point itself, MC dropout's trained weights). ``None`` without a closed-form mean
            (ensembles, SG-MCMC): the evaluation then averages the BMA's samples.
        marginal_variance: ``marginal_variance(state) -> v``, ``v[name]`` the diagonal of the posterior
            covariance over trained parameter ``name`` (same shape), in closed form (``0`` for a point).
            ``None`` where there is none: the width is then estimated from samples.
        predict_mode: ``predict_mode(model, generator)``: a context manager putting the model in its prediction
            mode, which may draw from ``generator`` (MC dropout's masks; ``None``: the global generator);
            ``None`` means eval mode.
        recompute_bn: whether the samples' own BatchNorm statistics do not match them (e.g. SWAG or VI
            samples), so they must be recomputed on the training data (:func:`flatbma.bn.recompute_bn_statistics`).
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

    Every entry gets a fresh generator seeded alike, so every prediction draws the same masks.
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

    ``perturb(params, grads)`` returns ``ε`` (same keys as ``grads``): the descent gradient is taken at
    ``params + ε``. ``space`` says what ``params`` are (absent: weights, :func:`ascent_space`).
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
