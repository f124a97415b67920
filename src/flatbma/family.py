"""What a posterior family declares beside its ``build``: its options, its checks before a run, its compositions.

A family module (:mod:`flatbma.posteriors.swag`, ...) holds its :class:`Family`; the registry (:mod:`flatbma.methods`)
maps a name to a family and an ascent step. The checks read a :class:`RunShape` and a :class:`Stage`.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from flatbma.types import Posterior

__all__ = ["STEP_SIZES", "Family", "Nested", "RunShape", "Section", "Stage", "available_memory", "divergence_advice"]


@dataclass(frozen=True)
class RunShape:
    """What a run's data decide about it, computed before it trains.

    Attributes:
        steps_per_epoch: updates per epoch, as the run's loader deals batches (one process, or ``torchrun``'s
            global batches).
        num_train: training examples ``n`` (the k-shot draw, validation held out).
        num_test: test examples the metrics are computed on (``data.test_limit`` applied).
        num_trainable: trained weights (the Hessian's dimension), or ``None`` when not computed.
        num_classes: classes of the training data, or ``None`` when not known.
        pretrained: whether the network starts from a checkpoint (``model.pretrained`` is set).
        available_memory: bytes free where the run trains (:func:`available_memory`), or ``None``.
        channels: channels of the test images (``eval.ood``'s corruptions need some), or ``None`` when not known.
    """

    steps_per_epoch: int
    num_train: int
    num_test: int
    num_trainable: int | None = None
    num_classes: int | None = None
    pretrained: bool = False
    available_memory: int | None = None
    channels: int | None = None


STEP_SIZES = ("gamma", "radius", "rho", "init_std")
"""Options that size a method's own step or starting spread, whichever family or ascent step declares them: FP-BMA's
KL ball (``gamma``, ``radius``), SAM's ``rho``, a variational ``init_std``; named by :func:`divergence_advice`."""


def divergence_advice(settings: Mapping[str, Any], cause: str, lr: float, prefix: str = "method.") -> str:
    """What to lower after training diverged (``cause``: :attr:`flatbma.errors.DivergenceError.cause`).

    E.g. ``"lower method.gamma=10000, method.init_std=0.001 or optim.lr=0.05"``: the learning rate and the
    method's ``settings`` of :data:`STEP_SIZES` at their current values, the method's first after a failed linear
    solve (``cause="solve"``), the learning rate first otherwise. ``prefix`` names the options (``""`` for
    :func:`flatbma.fit_posterior`'s keywords, the learning rate then ``lr``).
    """
    named = [f"{prefix}{k}={_number(v)}" for k, v in settings.items()]
    rate = f"{'optim.' if prefix else ''}lr={_number(lr)}"
    order = [*named, rate] if cause == "solve" else [rate, *named]
    return "lower " + (f"{', '.join(order[:-1])} or {order[-1]}" if len(order) > 1 else order[0])


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


def available_memory(device: torch.device) -> int | None:
    """Bytes a run on ``device`` can still allocate, or ``None`` when the system does not say.

    A CUDA device's free memory; else ``MemAvailable`` (or free pages), capped by a cgroup v2 limit.
    """
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    free = _meminfo_available()
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
        if limit.isdigit() and used.isdigit():
            left = max(int(limit) - int(used), 0)
            free = left if free is None else min(free, left)
    except OSError:
        pass
    return free


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class Stage:
    """One stage of a run (a two-stage run has two) as its method sees it: its length and the keys that set it.

    Attributes:
        shape: the run's shape (both stages share the data).
        epochs: the stage's epochs.
        epochs_key: the key that sets them (``train.epochs``, or a first stage's ``prior.epochs``).
        method_key: the section of the stage's method (``method``, or ``prior.method``).
    """

    shape: RunShape
    epochs: int
    epochs_key: str = "train.epochs"
    method_key: str = "method"

    @property
    def steps(self) -> int:
        """Updates of the stage: ``epochs × steps_per_epoch``."""
        return self.epochs * self.shape.steps_per_epoch

    def key(self, option: str) -> str:
        """The config key of a method option (``method.rank``, ``prior.method.rank``)."""
        return f"{self.method_key}.{option}"

    def describe(self) -> str:
        """``train.epochs=2 × 4 steps per epoch = 8 updates``."""
        spe = self.shape.steps_per_epoch
        return f"{self.epochs_key}={self.epochs} × {spe} step{'s' * (spe != 1)} per epoch = {self.steps} updates"

    def epochs_for(self, steps: int) -> int:
        """The fewest epochs that take at least ``steps`` updates."""
        return -(-steps // self.shape.steps_per_epoch)

    @staticmethod
    def steps_for(count: Callable[[int], int], needed: int) -> int:
        """The fewest updates ``s`` with ``count(s) ≥ needed``, for a non-decreasing unbounded ``count`` (snapshots)."""
        high = 1
        while count(high) < needed:
            high *= 2
            if high > 2**62:
                raise ValueError(f"count never reaches {needed}")
        low = high // 2  # count(low) < needed (or low = 0)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if count(mid) >= needed else (mid, high)
        return high


class Section(Protocol):
    """A parsed method section as a family's functions see it (:class:`flatbma.methods.MethodConfig`)."""

    name: str
    options: Mapping[str, Any]
    ascent: Any

    def check(self, stage: Stage) -> None:
        """Refuse options that ask more of a run than ``stage`` gives."""
        ...

    def resolved(self, map_steps: int) -> Section:
        """The section with the options that follow from a run of ``map_steps`` updates resolved."""
        ...

    def build(self, objective: Any, optimizer: Any, prior: Mapping[str, Any] | None = None) -> Posterior:
        """The section's transform."""
        ...

    def advice(self, prior: bool = False, diagnostics: Mapping[str, Any] | None = None) -> str:
        """What to change when its BMA is worse than its reference network (:attr:`Family.advice`)."""
        ...


@dataclass(frozen=True)
class Nested:
    """A method section nested in a method's own, under the key ``of``: a mixture's members, Laplace's MAP.

    Attributes:
        default: the method ``of`` is when the section names none; ``None``: the family refuses to build without
            one (plain ``multi``).
        family: the family ``of`` must be of (Laplace's MAP: the point family); ``None``: any.
        members: whether ``of`` is what every member of a mixture trains: then ``of`` is the method's component
            (read by a two-stage run's checks) and a two-stage run's first stage is a mixture of ``prior.method``.
        refusal: the message for an ``of`` of another family, formatted with ``where``, ``family``, ``methods``
            and ``got``.
    """

    default: str | None
    family: Family | None = None
    members: bool = False
    refusal: str = "{where} must be a method of the family {family} ({methods}), got {got}"


@dataclass(frozen=True)
class Family:
    """A posterior family as the registry composes it: its build, its options, its rules.

    Attributes:
        build: ``build(objective, optimizer, ascent=None, **options) -> Posterior`` (and ``of=`` when nesting).
        options: the frozen options dataclass; its class variable ``phases`` (:class:`flatbma.types.Phase`)
            declares epochs beyond ``train.epochs`` (Laplace's curvature pass).
        of: the nested method section (:class:`Nested`), or ``None``.
        with_prior: ``with_prior(objective, optimizer, ascent, prior_theta, **options)``: the family with a
            low-rank plus diagonal Gaussian prior (a two-stage run's); ``None``: it takes none.
        gaussian: whether the posterior is a low-rank plus diagonal Gaussian
            (:attr:`~flatbma.types.Capabilities.gaussian`), so it can be a two-stage run's first stage.
        check: ``check(section, stage)`` raises a :class:`~flatbma.errors.FlatbmaError` when the options ask
            more of a run than ``stage`` gives (more snapshots than it collects, ...).
        needs_weights: ``needs_weights(section)``: whether ``check`` reads :attr:`RunShape.num_trainable`.
        prior_refusal: why the family takes no ``prior`` section, beyond having no ``with_prior``.
        start: ``start(map_steps)``: what ``start_step: null`` resolves to for ``map_steps`` updates.
        resolve: ``resolve(options, map_steps) -> options``: other options that follow from the run's length
            (SWAG's ``collect_every: auto``, SGLD's ``burn_in``/``thin: auto``), after ``start_step``.
        hold_lr: with ``start_step: null``, hold the learning rate from that start at the schedule's value
            there (SWAG's constant ``swa_lr``, Maddox et al. 2019).
        advice: ``advice(section, prior, diagnostics) -> str``: what to change when the BMA's NLL is worse than
            its reference network's (:mod:`flatbma.health`); each clause names a current value and a narrower one
            (the command line cuts a warning at 300 characters). ``None``: a generic line.
        on_validation: ``{option: grid}``: options that may be ``val``, chosen after training among ``grid`` by
            the BMA's validation NLL (Laplace's ``prior_precision``).
        aliases: other spellings of options, ``{alias: option}`` (ensemble's ``members``: its ``size``).
        regression: whether the family fits with any loss (a Gaussian likelihood's); Laplace's softmax
            Gauss-Newton does not.
    """

    build: Callable[..., Posterior]
    options: type
    of: Nested | None = None
    with_prior: Callable[..., Posterior] | None = None
    gaussian: bool = False
    check: Callable[[Any, Stage], None] | None = None
    needs_weights: Callable[[Any], bool] | None = None
    prior_refusal: str | None = None
    start: Callable[[int], int] | None = None
    resolve: Callable[[Mapping[str, Any], int], dict[str, Any]] | None = None
    hold_lr: bool = False
    advice: Callable[[Any, bool, Mapping[str, Any]], str] | None = None
    on_validation: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    regression: bool = True

    def __post_init__(self) -> None:
        if not dataclasses.is_dataclass(self.options):
            raise ValueError(f"{self.build.__qualname__}: a family's options must be a dataclass, got {self.options!r}")

    def option_types(self) -> dict[str, Any]:
        """The type of every option of :attr:`options`, in order (a nested ``of`` is the registry's)."""
        hints = typing.get_type_hints(self.options)
        return {f.name: hints[f.name] for f in dataclasses.fields(self.options)}


def always(section: Any) -> bool:
    """A :attr:`Family.needs_weights` that always needs them (a mixture's members' memory)."""
    return True
