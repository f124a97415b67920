"""The method registry: names used in configs and ``flatbma methods`` → (posterior family, ascent step).

This is the only place where methods are looked up by string. A method is a posterior family — its
``build(objective, optimizer, ascent, **options)`` and its frozen options dataclass — composed with an
optional ascent step class, so a flat-seeking variant is an entry that names the same family with an
ascent step — never a copy. Family options are the fields of the family's options dataclass (their
defaults live there); ascent options are the fields of the ascent dataclass; both are parsed from their
dataclasses alike. A method that nests another method's section (``of``: a mixture's members, Laplace's
MAP) says so with :class:`Nested`. A method with an ascent step also takes the options of
:class:`~flatbma.optim.Amortized` (``ascent_every``, ``reuse``, ``reuse_alpha``, ``ascent_fraction``: its
second pass every ``k`` steps, on a fraction of the batch), which wrap the step; given none of them, the
method is its plain step and its resolved section names none of them, so that runs resolved before these
options existed stay the same runs.

Over 500 lines on purpose: it is the registry, and the guide keeps every lookup of a method by name in
one place. Besides the entries it holds what only the registry may know — each method's checks before
training (snapshots, burn-in, cycles, dropout, members' memory, Laplace's stages), the compositions that
name families (mixtures of any family, Laplace over a MAP) and the schedules they imply (SWAG's held
learning rate). Split elsewhere, these would have to look methods up by name again.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flatbma.curvature import Curvature, Hessian
from flatbma.errors import FlatbmaError, suggest
from flatbma.experiment.config.parse import coerce, parse_dataclass, shown
from flatbma.optim import ASAM, SAM, Amortized, FisherBall, FisherSAM
from flatbma.options import resolved
from flatbma.posteriors import (
    bsam,
    ensemble,
    fp_bma,
    ivon,
    laplace,
    lowrank_vi,
    mc_dropout,
    mfvi,
    multi,
    point,
    sgld,
    swag,
)
from flatbma.posteriors.gaussian_vi import VarianceStep
from flatbma.types import Ascent, Phase, Posterior, Predictive, phases_after

if TYPE_CHECKING:
    from flatbma.experiment.config.shape import Stage


@dataclass(frozen=True)
class Nested:
    """A method section nested in a method's own, under the key ``of``: a mixture's members, Laplace's MAP.

    Attributes:
        default: the method ``of`` is when the section names none; ``None``: none (the family then refuses
            to build, asking for one: plain ``multi``).
        parse: ``parse(data, where) -> MethodConfig``: :func:`parse_method`, or one that restricts it.
        members: whether ``of`` is what every independent member of a mixture trains: then ``of`` is the
            method's component (:meth:`MethodConfig.component`, whose options a two-stage run's checks read)
            and a two-stage run's first stage is a mixture of ``prior.method`` (:func:`multi_first_stage`).
    """

    default: str | None
    parse: Callable[[Any, str], MethodConfig]
    members: bool = False

    def annotation(self) -> Any:
        """The type of ``of``: a mixture's may be ``None`` (plain ``multi``'s default), Laplace's MAP may not."""
        return MethodConfig | None if self.members else MethodConfig


@dataclass(frozen=True)
class MethodSpec:
    """A registered method.

    Attributes:
        name: the config/CLI name.
        summary: one line for ``flatbma methods``.
        family: the posterior family's ``build(objective, optimizer, ascent=None, **options)``, the options
            those of ``options`` (and ``of``, when the method nests a section).
        options: the family's frozen options dataclass: its fields are the method's options, their defaults
            the options' defaults. A family whose run takes epochs beyond ``train.epochs`` declares them as
            phases in its class variable ``phases`` (:class:`flatbma.types.Phase`; Laplace's curvature phase):
            the optimizer's schedule still spans ``train.epochs``, and the family's ``start_step: null``
            resolves to ``train.epochs`` × steps per epoch (:meth:`MethodConfig.build`'s ``map_steps``), so the
            updates before it are those of a run of ``train.epochs`` epochs.
        ascent: the ascent step dataclass, or ``None``.
        of: the method's nested method section (:class:`Nested`), or ``None``.
        with_prior: ``with_prior(objective, optimizer, ascent, prior_theta, **options)``, the family with a
            low-rank plus diagonal Gaussian prior in place of its default one (a two-stage run's ``prior``
            section; options of that default, ``prior_std``, do not apply), or ``None`` when the method takes
            no such prior.
        gaussian: whether the posterior is a low-rank plus diagonal Gaussian (its
            :attr:`~flatbma.types.Posterior.gaussian` gives ``θ``), so that it can be the first stage
            of a two-stage run; an option may still turn the low-rank part off (SWAG's
            ``diagonal_only``), which the run reports when it builds that stage. A mixture of Gaussians
            (``multi``) is none: its ``gaussian`` gives one per member, for its own per-member stages.
        check: ``check(method, stage)`` raises a :class:`FlatbmaError` when the method's options ask more
            of a run than the ``stage`` (:class:`~flatbma.experiment.config.shape.Stage`: its updates, its keys)
            gives — e.g. more snapshots than it collects — before anything trains; ``None``: nothing to check.
        needs_weights: ``needs_weights(method)``: whether ``check`` needs the number of trained weights
            (:attr:`~flatbma.experiment.config.shape.RunShape.num_trainable`, which builds the network).
        prior_refusal: why the method takes no ``prior`` section, when there is more to say than that its
            family has no ``with_prior`` (said in the refusal).
        start: ``start(map_steps)``, what the family's ``start_step: null`` resolves to for a run of
            ``map_steps`` = ``train.epochs`` × steps per epoch updates (:meth:`MethodConfig.resolved`);
            ``None``: the family has no such default. Laplace: ``map_steps`` (the curvature pass after
            the whole MAP); SWAG: :func:`last_quarter`.
        resolve: ``resolve(options, map_steps) -> options``, the family's other options that follow from the run's
            length, resolved after ``start_step`` (:meth:`MethodConfig.resolved`); ``None``: none. SWAG:
            :func:`flatbma.posteriors.swag.resolve` (``collect_every: auto``); SGLD:
            :func:`flatbma.posteriors.sgld.resolve` (``burn_in: auto``, ``thin: auto``).
        hold_lr: with ``start_step: null``, the learning rate is held constant from that start on at the
            value the schedule reached there (:meth:`MethodConfig.held_from`): SWAG's constant ``swa_lr``
            over its collection window (Maddox et al. 2019).
        advice: ``advice(method, prior, diagnostics) -> str``: what to change, given the section's own settings, when
            the BMA's NLL is worse than its reference network's (the health rule ``worse_than_mean``, in
            :func:`flatbma.fit_posterior` and the CLI alike: :mod:`flatbma.experiment.run.health`); ``prior``: whether
            the run has a prior stage; ``diagnostics``: the posterior's (Laplace's ``prior_precision``). ``None``: a
            generic line. Never advice to set what is already set.
        on_validation: ``{option: grid}``: an option that may be ``val`` (:data:`VALIDATION`), then chosen after
            training among ``grid`` by the BMA's validation NLL (:meth:`MethodConfig.on_validation`; Laplace's
            ``prior_precision``, the grid search of Daxberger et al. 2021 / laplace-torch).
        aliases: other spellings of family options, ``{alias: option}`` (``ensemble``'s ``members``: its
            ``size``), accepted in a section and recorded under the option's own name.
        regression: whether the family fits with any loss, so with a Gaussian likelihood's
            (``model.likelihood: gaussian``); Laplace's curvature is the softmax's Gauss-Newton: it does not.
        stored: ``{option: value}`` for options added after runs were stored with another behaviour than their
            default: what a stored resolved section (a run directory's ``config.yaml``) without the option
            trained with (:func:`as_trained`). Laplace's ``subset``: ``all`` (it was all weights before
            ``subset`` existed; its default is now ``last-layer``); Gaussian VI's ``variance_step``: ``plain``
            (:class:`~flatbma.posteriors.gaussian_vi.VarianceStep`; its default is now ``natural``).
    """

    name: str
    summary: str
    family: Callable[..., Posterior]
    options: type
    ascent: type | None = None
    of: Nested | None = None
    with_prior: Callable[..., Posterior] | None = None
    gaussian: bool = False
    check: Callable[[MethodConfig, Stage], None] | None = None
    needs_weights: Callable[[MethodConfig], bool] | None = None
    prior_refusal: str | None = None
    start: Callable[[int], int] | None = None
    resolve: Callable[[Mapping[str, Any], int], dict[str, Any]] | None = None
    hold_lr: bool = False
    advice: Callable[[MethodConfig, bool, Mapping[str, Any]], str] | None = None
    on_validation: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    stored: Mapping[str, Any] = field(default_factory=dict)
    regression: bool = True

    def family_options(self) -> dict[str, Any]:
        """The type of every family option, in order: ``of`` first when the method nests a section."""
        hints = typing.get_type_hints(self.options)
        own = {f.name: hints[f.name] for f in dataclasses.fields(self.options)}
        return {"of": self.of.annotation(), **own} if self.of is not None else own

    def defaults(self) -> dict[str, Any]:
        """The default of every family option, in the order of :meth:`family_options`."""
        own = {f.name: f.default for f in dataclasses.fields(self.options)}  # the family's, one value everywhere
        if self.of is None:
            return own
        return {"of": parse_method(self.of.default) if self.of.default is not None else None, **own}

    def ascent_options(self) -> dict[str, dataclasses.Field]:
        """Fields of the ascent step dataclass."""
        return {f.name: f for f in dataclasses.fields(self.ascent)} if self.ascent else {}

    def amortized_options(self) -> dict[str, dataclasses.Field]:
        """:func:`amortized_options` when the method has an ascent step, else none."""
        return amortized_options() if self.ascent else {}


def amortized_options() -> dict[str, dataclasses.Field]:
    """Fields of :class:`~flatbma.optim.Amortized` besides the wrapped step: the options that amortize a second pass."""
    return {f.name: f for f in dataclasses.fields(Amortized) if f.name != "ascent"}


STEP_SIZES = ("gamma", "radius", "rho", "init_std")
"""Options that set the size of a method's own step or of its starting spread, whichever family or ascent step
declares them (a rule that reads no method's name): FP-BMA's KL ball (``gamma``, ``radius``), the SAM family's
neighbourhood (``rho``), a variational posterior's initial standard deviation (``init_std``). A divergence's advice
names those a method sets beside the learning rate (:meth:`MethodConfig.divergence_advice`)."""


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class MethodConfig:
    """A method selected by name with its typed options (built by :func:`parse_method`).

    Attributes:
        name: registry name.
        options: family options (the fields of its options dataclass, and ``of``), defaults filled in.
        ascent: the ascent step instance, or ``None``; an :class:`~flatbma.optim.Amortized` around the
            registered step when the section gives any of its options.
    """

    name: str
    options: Mapping[str, Any]
    ascent: Ascent | None

    def build(
        self,
        objective: Any,
        optimizer: Any,
        prior: Mapping[str, Any] | None = None,
        *,
        map_steps: int | None = None,
    ) -> Posterior:
        """Build the method's transform for ``objective`` and ``optimizer``.

        With ``prior`` (a low-rank plus diagonal Gaussian in ``θ`` layout, e.g. the ``gaussian`` of a
        SWAG posterior) the family's ``with_prior`` builder is used: the prior replaces the family's
        default one, so options of that default (``prior_std``) do not apply.

        ``map_steps`` (``train.epochs`` × steps per epoch) resolves a ``start_step: null`` (:meth:`resolved`),
        and holds the learning rate from there where the family asks (:attr:`MethodSpec.hold_lr`).
        """
        if map_steps is not None:
            held = self.held_from(map_steps)
            if held is not None:
                optimizer = hold_learning_rate(optimizer, held, self.name)
            return self.resolved(map_steps).build(objective, optimizer, prior)
        spec = METHODS[self.name]
        if prior is None:
            return spec.family(objective, optimizer, self.ascent, **self.options)
        if spec.with_prior is None:
            takers = ", ".join(prior_methods())
            raise FlatbmaError(f"method {self.name!r} takes no Gaussian prior (the prior section): use one of {takers}")
        return spec.with_prior(objective, optimizer, self.ascent, prior, **self.options)

    def family_options(self) -> Any:
        """The family's options dataclass of this section (its options but ``of``)."""
        spec = METHODS[self.name]
        return spec.options(**{k: v for k, v in self.options.items() if k != "of" or spec.of is None})

    def component(self) -> MethodConfig | None:
        """The method each independent member trains (a mixture's ``of``: :attr:`Nested.members`); else itself."""
        of = METHODS[self.name].of
        return self.options["of"] if of is not None and of.members else self

    def takes_prior(self) -> bool:
        """Whether a ``prior`` section applies: the family has a ``with_prior``, and so has its members' method."""
        inner = self.component()
        return all(m is not None and METHODS[m.name].with_prior is not None for m in (self, inner))

    def first_stage(self, prior_method: MethodConfig) -> MethodConfig:
        """The method of a two-stage run's first stage, given ``prior.method``: a mixture's is a mixture of it."""
        of = METHODS[self.name].of
        return multi_first_stage(self, prior_method) if of is not None and of.members else prior_method

    def check(self, stage: Stage) -> None:
        """Refuse options that ask more of a run than ``stage`` gives (:attr:`MethodSpec.check`), before it trains."""
        spec = METHODS[self.name]
        if spec.check is not None:
            spec.check(self, stage)

    def phases_after(self) -> tuple[Phase, ...]:
        """The phases the run takes after ``train.epochs``: its family's, then the longest of a nested section's.

        A family's are those its options declare (:func:`flatbma.types.phases_after`; Laplace's curvature phase).
        """
        nested = [v.phases_after() for v in self.options.values() if isinstance(v, MethodConfig)]
        longest = max(nested, key=lambda ps: sum(p.epochs or 0 for p in ps), default=())
        return phases_after(METHODS[self.name].options) + longest

    def extra_epochs(self) -> int:
        """Epochs the run takes beyond ``train.epochs``: those of its :meth:`phases_after`."""
        return sum(p.epochs or 0 for p in self.phases_after())

    def needs_weights(self) -> bool:
        """Whether checking it needs the number of trained weights (:attr:`MethodSpec.needs_weights`)."""
        spec = METHODS[self.name]
        own = spec.needs_weights is not None and spec.needs_weights(self)
        return own or any(v.needs_weights() for v in self.options.values() if isinstance(v, MethodConfig))

    def resolved(self, map_steps: int) -> MethodConfig:
        """This section with ``start_step: null`` set to :attr:`MethodSpec.start` ``(map_steps)`` (families with one).

        Laplace: ``map_steps`` (its curvature pass follows the whole MAP); SWAG: :func:`last_quarter`. Then the
        family's :attr:`MethodSpec.resolve` (SWAG's ``collect_every: auto``). Nested sections (``multi``'s ``of``)
        are resolved the same way.
        """
        options = {k: v.resolved(map_steps) if isinstance(v, MethodConfig) else v for k, v in self.options.items()}
        spec = METHODS[self.name]
        if spec.start is not None and options.get("start_step", 0) is None:
            options["start_step"] = spec.start(map_steps)
        if spec.resolve is not None:
            options = spec.resolve(options, map_steps)
        return dataclasses.replace(self, options=options)

    def after_map(self) -> list[MethodConfig]:
        """The sections (itself, a nested one) whose posterior phase starts after a MAP phase of ``start_step`` updates.

        Those of a family with a :attr:`MethodSpec.start` (Laplace, SWAG): what :func:`flatbma.fit_posterior`'s
        ``posthoc`` skips, resolving their ``start_step: null`` to 0.
        """
        nested = [c for v in self.options.values() if isinstance(v, MethodConfig) for c in v.after_map()]
        return ([self] if METHODS[self.name].start is not None else []) + nested

    def held_from(self, map_steps: int) -> int | None:
        """The update from which the learning rate is held constant (:attr:`MethodSpec.hold_lr`), or ``None``.

        SWAG with ``start_step: null``: :func:`last_quarter` ``(map_steps)``, its collection window's start;
        a nested section's (MultiSWAG's members share one optimizer). An explicit ``start_step`` keeps the
        ``optim`` schedule as it is.
        """
        spec = METHODS[self.name]
        if spec.hold_lr and spec.start is not None and self.options.get("start_step", 0) is None:
            return spec.start(map_steps)
        nested = (v.held_from(map_steps) for v in self.options.values() if isinstance(v, MethodConfig))
        return next((h for h in nested if h is not None), None)

    def on_validation(self) -> dict[str, tuple[float, ...]]:
        """``{option: grid}`` of the options set to ``val``, to choose on validation data after training."""
        grids = METHODS[self.name].on_validation
        return {k: grid for k, grid in grids.items() if self.options.get(k) == VALIDATION}

    def step_settings(self) -> dict[str, Any]:
        """``{option: value}`` of the :data:`STEP_SIZES` it sets: in its options, its ascent step, a nested section's.

        A nested section's are keyed by its path (``of.gamma``); options left at ``None`` are not set.
        """
        step = self.ascent.ascent if isinstance(self.ascent, Amortized) else self.ascent
        out = {k: self.options[k] for k in STEP_SIZES if self.options.get(k) is not None}
        fields = {f.name for f in dataclasses.fields(step)} if step is not None else set()  # not its properties
        out.update({k: getattr(step, k) for k in STEP_SIZES if k in fields and getattr(step, k) is not None})
        for key, value in self.options.items():
            if isinstance(value, MethodConfig):
                out.update({f"{key}.{k}": v for k, v in value.step_settings().items()})
        return out

    def divergence_advice(self, cause: str, lr: float, prefix: str = "method.") -> str:
        """What to lower after training diverged (``cause``: :attr:`flatbma.errors.DivergenceError.cause`).

        ``"lower method.gamma=10000, method.init_std=0.001 or optim.lr=0.05"``: the learning rate and the
        method's :meth:`step_settings` at their current values — the method's first after a failed linear
        solve (a covariance pushed out of positive definiteness by its own step: FP-BMA's KL ball, its initial
        spread), the learning rate first after a non-finite loss. ``prefix``: how the options are named where the
        advice is read (``method.`` in a config; ``""`` for :func:`flatbma.fit_posterior`'s keywords, whose
        learning rate is then ``lr``).
        """
        named = [f"{prefix}{k}={_number(v)}" for k, v in self.step_settings().items()]
        rate = f"{'optim.' if prefix else ''}lr={_number(lr)}"
        order = [*named, rate] if cause == "solve" else [rate, *named]
        return "lower " + (f"{', '.join(order[:-1])} or {order[-1]}" if len(order) > 1 else order[0])

    def with_options(self, **options: Any) -> MethodConfig:
        """This section with ``options`` replaced (e.g. the chosen ``prior_precision``)."""
        return dataclasses.replace(self, options={**self.options, **options})

    def regression(self) -> bool:
        """Whether it fits a regression network (:attr:`MethodSpec.regression`, and that of a nested section)."""
        own = METHODS[self.name].regression
        return own and all(v.regression() for v in self.options.values() if isinstance(v, MethodConfig))

    def advice(self, prior: bool = False, diagnostics: Mapping[str, Any] | None = None) -> str:
        """What to change when the BMA is worse than its reference network (:attr:`MethodSpec.advice`), one clause."""
        spec = METHODS[self.name]
        if spec.advice is None:
            return f"narrow the posterior (its options: flatbma methods {self.name})"
        return spec.advice(self, prior, diagnostics or {})

    def learning_rate(self, rate: Callable[[int], float], map_steps: int) -> Callable[[int], float]:
        """The schedule ``step -> η_t`` the method trains with, given the ``optim`` section's ``rate`` (for logs)."""
        held = self.held_from(map_steps)
        return rate if held is None else held_schedule(rate, held)

    def to_dict(self) -> dict[str, Any]:
        """The resolved section, every option spelled out (written to the run directory)."""
        step = self.ascent.ascent if isinstance(self.ascent, Amortized) else self.ascent
        ascent = resolved(step) if step is not None else {}  # options added later: only when not at their default
        if isinstance(self.ascent, Amortized):  # only then: a plain step's section is as it always was
            ascent.update({k: getattr(self.ascent, k) for k in amortized_options()})
        options = {k: v.to_dict() if isinstance(v, MethodConfig) else v for k, v in self.options.items()}
        return {"name": self.name, **options, **ascent}


METHODS: dict[str, MethodSpec] = {}


def prior_methods() -> list[str]:
    """Names of the methods that accept a Gaussian prior (a run's ``prior`` section) with their default options."""
    return [n for n, spec in METHODS.items() if spec.with_prior is not None and parse_method(n).takes_prior()]


def register(spec: MethodSpec) -> MethodSpec:
    """Add ``spec`` to the registry (names are unique; family and ascent options must not collide)."""
    if spec.name in METHODS:
        raise ValueError(f"method {spec.name!r} is registered twice")
    if not dataclasses.is_dataclass(spec.options):
        raise ValueError(f"method {spec.name!r}: its options must be a dataclass, got {spec.options!r}")
    clash = set(spec.family_options()) & set(spec.ascent_options())
    clash |= set(amortized_options()) & (set(spec.family_options()) | set(spec.ascent_options()))
    if clash:
        raise ValueError(f"method {spec.name!r}: options {clash} belong to both the family and the ascent")
    METHODS[spec.name] = spec
    return spec


def last_quarter(map_steps: int) -> int:
    """SWAG's default ``start_step``: the collection window is the last 25% of the run's updates, ``T − ⌊T/4⌋``.

    With :attr:`MethodSpec.hold_lr` the learning rate over that window is constant — the protocol of
    Maddox et al. (NeurIPS 2019; their code's ``swa_start`` and ``swa_lr``, ``experiments/train/run_swag.py``):
    train with a decaying schedule, then collect snapshots at a constant learning rate ``swa_lr``. Their
    CIFAR runs collect one snapshot per epoch over epochs 161–300 of 300 (the last 47%), at ``swa_lr`` = 0.01
    for ``lr_init`` = 0.05 (VGG-16) or 0.05 for 0.1 (WideResNet), reached by a linear decay over 50–90% of
    the first 160 epochs. Here the window is the last quarter of the updates — three quarters of the run's
    budget train before collection starts — and ``swa_lr`` is the rate ``optim``'s schedule has reached
    where the window opens: ``½(1 + cos(3π/4))·optim.lr ≈ 0.146·optim.lr`` for the cosine schedule (their
    ratio is 0.2 or 0.5), ``optim.lr`` for ``constant``.
    """
    return map_steps - map_steps // 4


def held_schedule(rate: Callable[[int], float], start: int) -> Callable[[int], float]:
    """``η_t = rate(min(t, start))``: ``rate`` until update ``start``, then constant at ``rate(start)``."""

    def schedule(step: int) -> float:
        return rate(min(step, start))

    return schedule


def hold_learning_rate(optimizer: Any, start: int, name: str) -> Any:
    """``optimizer`` with its learning rate held at ``η_start`` from update ``start`` on (:func:`held_schedule`).

    Raises:
        FlatbmaError: an optimizer without a ``lr`` schedule field (the built-in SGD and Adam have one).
    """
    if not (dataclasses.is_dataclass(optimizer) and any(f.name == "lr" for f in dataclasses.fields(optimizer))):
        raise FlatbmaError(
            f"{name} with method.start_step: null holds the learning rate constant over its collection window, which "
            f"needs an optimizer with a lr schedule (sgd, adam), got a {type(optimizer).__name__}: set "
            "method.start_step"
        )
    return dataclasses.replace(optimizer, lr=held_schedule(optimizer.learning_rate, start))


def as_trained(section: Any) -> Any:
    """A stored resolved method section as it trained: options it lacks at their :attr:`MethodSpec.stored` values.

    A run directory's ``config.yaml`` spells out every option its version had; an option added since, whose
    default differs from what the run trained with, is absent there and would otherwise read as that
    default (Laplace's ``subset``: ``last-layer``, where the run's posterior is over all weights). Nested
    sections (``of``) are read the same way; anything else is returned as it is.
    """
    if not isinstance(section, Mapping) or not isinstance(section.get("name"), str) or section["name"] not in METHODS:
        return section
    out = dict(section)
    out.update({k: v for k, v in METHODS[out["name"]].stored.items() if k not in out})
    if isinstance(out.get("of"), Mapping):
        out["of"] = as_trained(out["of"])
    return out


def parse_method(data: Any, where: str = "method") -> MethodConfig:
    """Parse the ``method`` config section: ``{name: sam, rho: 0.05, ...}``.

    Family options (the fields of the family's options dataclass; a nested ``of`` by :attr:`Nested.parse`) come
    first in the order the section gives them, then the others with their defaults.
    """
    if isinstance(data, str):
        data = {"name": data}
    if not isinstance(data, Mapping) or "name" not in data:
        raise FlatbmaError(f"{where} must be a mapping with a 'name' key (one of: {', '.join(METHODS)})")
    name = data["name"]
    if not isinstance(name, str) or name not in METHODS:
        raise FlatbmaError(
            f"unknown method {shown(name)}.{suggest(str(name), METHODS)} "
            f"Run 'flatbma methods' to list them: {', '.join(METHODS)}"
        )
    spec = METHODS[name]
    family_opts, ascent_opts, amortized_opts = spec.family_options(), spec.ascent_options(), spec.amortized_options()
    options: dict[str, Any] = {}
    ascent_data: dict[str, Any] = {}
    amortized_data: dict[str, Any] = {}
    for key, value in data.items():
        if key == "name":
            continue
        if key in spec.aliases:  # another spelling of a family option (ensemble's members: its size)
            option = spec.aliases[key]
            if option in data:
                raise FlatbmaError(f"{where}.{key} and {where}.{option} are one option ({key} is its alias): keep one")
            options[option] = coerce(value, family_opts[option], f"{where}.{key}")
        elif key in ascent_opts:
            ascent_data[key] = value
        elif key in amortized_opts:
            amortized_data[key] = value
        elif key in amortized_options():
            raise FlatbmaError(_no_second_pass(spec, f"{where}.{key}"))
        elif key == "of" and spec.of is not None:
            options[key] = spec.of.parse(value, f"{where}.{key}")
        elif key in family_opts:
            options[key] = coerce(value, family_opts[key], f"{where}.{key}")
        else:
            valid = sorted([*family_opts, *ascent_opts, *amortized_opts, *spec.aliases])
            raise FlatbmaError(
                f"unknown config key {shown(f'{where}.{key}')} for method {shown(name)}.{suggest(str(key), valid)} "
                f"Valid keys: {', '.join(valid) if valid else '(none)'}"
            )
    for key, default in spec.defaults().items():
        options.setdefault(key, default)
    ascent = parse_dataclass(spec.ascent, ascent_data, where) if spec.ascent else None
    if amortized_data:
        ascent = _amortized(ascent, amortized_data, where)
    return MethodConfig(name=name, options=options, ascent=ascent)


def _amortized(ascent: Any, data: Mapping[str, Any], where: str) -> Amortized:
    """``Amortized(ascent, **data)``, each option checked against its annotation (errors name ``where.<key>``)."""
    hints = typing.get_type_hints(Amortized)
    kwargs = {key: coerce(value, hints[key], f"{where}.{key}") for key, value in data.items()}
    try:
        return Amortized(ascent, **kwargs)
    except FlatbmaError as e:
        raise FlatbmaError(f"{where}.{e}") from None


def _no_second_pass(spec: MethodSpec, key: str) -> str:
    """Why ``key`` (an :class:`~flatbma.optim.Amortized` option) does not apply to the method of ``spec``."""
    flat = ", ".join(n for n, s in METHODS.items() if s.ascent is not None)
    where = " (for a mixture, give it in method.of)" if spec.of is not None else ""
    return (
        f"{key}: method {spec.name!r} has no ascent step, so there is no second pass to amortize{where}; "
        f"it applies to the flat-seeking methods: {flat}"
    )


def check_snapshots(method: MethodConfig, stage: Stage) -> None:
    """SWAG's families: the run must collect ``K = rank`` snapshots (2 for the diagonal variant).

    The snapshots of a stage are :func:`flatbma.posteriors.swag.snapshots`. Sampling needs two; with
    fewer than ``K`` the low-rank part has only as many columns as snapshots, a smaller rank than the
    one asked for — and a second stage started at the fitted posterior (``prior.init``) with ``K``
    columns cannot start at all.
    """
    o, key = method.options, stage.key
    low_rank = "rank" in o and not o.get("diagonal_only", False)
    if low_rank and o["rank"] < 2:
        return  # the builder refuses it with its own message
    needed = o["rank"] if low_rank else 2
    auto = o["collect_every"] == swag.AUTO  # rank snapshots spread over the window (swag.resolve)

    def count(steps: int) -> int:
        resolved = method.resolved(steps).options  # start_step: null and collect_every: auto for these steps
        return swag.snapshots(steps, start_step=resolved["start_step"], collect_every=resolved["collect_every"])

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


def check_burn_in(method: MethodConfig, stage: Stage) -> None:
    """SGLD's families: the run must store at least one sample (:func:`flatbma.posteriors.sgld.samples_stored`).

    ``burn_in: auto`` and ``thin: auto`` are resolved for the stage's updates (:func:`flatbma.posteriors.sgld.resolve`).
    """
    o, key = method.resolved(stage.steps).options, stage.key
    burn_in, thin = o["burn_in"], o["thin"]
    if sgld.samples_stored(stage.steps, burn_in=burn_in, thin=thin) > 0:
        return
    first = burn_in + thin
    raise FlatbmaError(
        f"{method.name} stores its first sample after {key('burn_in')} + {key('thin')} = {burn_in} + {thin} = "
        f"{first} updates, but {stage.describe()}: raise {stage.epochs_key} to >= {stage.epochs_for(first)}, "
        f"or lower {key('burn_in')} or {key('thin')}"
    )


def check_cycles(method: MethodConfig, stage: Stage) -> None:
    """Cyclical SGLD: the run must store a sample (:func:`flatbma.posteriors.sgld.cyclical_samples_stored`)."""
    o, key = method.options, stage.key
    options = {k: o[k] for k in ("cycle_length", "exploration", "samples_per_cycle")}

    def count(steps: int) -> int:
        return sgld.cyclical_samples_stored(steps, **options)

    if count(stage.steps) > 0:
        return
    first = stage.steps_for(count, 1)
    raise FlatbmaError(
        f"{method.name} stores its first sample after {first} updates (in the sampling stage of the first cycle of "
        f"{key('cycle_length')}={o['cycle_length']}), but {stage.describe()}: raise {stage.epochs_key} to >= "
        f"{stage.epochs_for(first)}, or lower {key('cycle_length')}"
    )


# What to change when a BMA is worse than its reference network (MethodSpec.advice): each clause names the section's
# current value and a narrower one, never what is already set; short, since the command line cuts a warning at 300
# characters (kl_weight < 1 tempers the KL; scale and rate shrink SWAG's covariance and the dropout noise; a larger
# ess or data_factor narrows IVON and bSAM; Laplace's last layer, a larger δ and the GLM predictive narrow its BMA).
def swag_advice(method: MethodConfig, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """SWAG: half the covariance (``scale``)."""
    scale = method.options["scale"]
    return f"scale: {scale / 2:g} (now {scale:g})"


def vi_advice(method: MethodConfig, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """Gaussian VI: a tempered KL (``kl_weight``); FP-BMA from scratch: a SWAG prior stage, a shorter ascent."""
    o, tips = method.options, []
    kappa = o["kl_weight"]
    if kappa > 0:
        tips.append(f"kl_weight: {kappa / 10:g} (now {kappa:g})")
    if VarianceStep(o["variance_step"]) is VarianceStep.PLAIN:
        init = o["init_std"]
        tips.append(f"init_std: {init / 10:g} (now {init:g}; σ stays near it with variance_step: plain)")
    step = method.ascent.ascent if isinstance(method.ascent, Amortized) else method.ascent
    if isinstance(step, FisherBall):
        if not prior:
            tips.append("a SWAG prior stage to start from (prior)")
        if step.gamma is not None:
            tips.append(f"gamma: {step.gamma / 10:g} (now {step.gamma:g})")
        elif step.radius is not None:
            tips.append(f"radius: {step.radius / 2:g} (now {step.radius:g})")
    return "; ".join(tips) or f"prior_std: {o['prior_std'] / 10:g} (now {o['prior_std']:g})"


def dropout_advice(method: MethodConfig, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """MC dropout: half the dropout rate."""
    rate = method.options["rate"]
    return f"rate: {rate / 2:g} (now {rate:g})"


def langevin_advice(method: MethodConfig, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """SG-MCMC: a colder chain."""
    t = method.options["temperature"]
    return f"temperature: {t / 10:g} (now {t:g}), or a lower optim.lr"


def ensemble_advice(method: MethodConfig, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """An ensemble worse than its member 0: members of unequal quality."""
    return "more epochs or a lower optim.lr: members worse than member 0 are averaged in"


def mixture_advice(method: MethodConfig, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """A mixture of posteriors: its members' method's advice."""
    of = method.options.get("of")
    return f"of.{of.advice(prior, diagnostics)}" if isinstance(of, MethodConfig) else ensemble_advice(method, prior, {})


def ivon_advice(method: MethodConfig, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """IVON: a larger effective sample size narrows ``q``."""
    ess = method.options["ess"]
    return f"ess: 10x (now {'the data size' if ess is None else f'{ess:g}'})"


def bsam_advice(method: MethodConfig, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """bSAM: a larger data factor (its variance is ``1/(N·data_factor·s)``)."""
    factor = method.options["data_factor"]
    return f"data_factor: {factor * 10:g} (now {factor:g})"


def laplace_advice(method: MethodConfig, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """Laplace: the last layer, a larger prior precision (on validation data), the linearized predictive."""
    o, tips = method.options, []
    if laplace.Subset(o["subset"]) is laplace.Subset.ALL:
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


register(
    MethodSpec("sgd", "MAP point estimate by SGD (momentum, weight decay, cosine schedule)", point.build, point.Options)
)
register(MethodSpec("sam", "SAM: sharpness-aware minimization (Foret et al. 2021)", point.build, point.Options, SAM))
register(MethodSpec("asam", "ASAM: adaptive, scale-invariant SAM (Kwon et al. 2021)", point.build, point.Options, ASAM))
register(
    MethodSpec(
        "fsam",
        "Fisher-SAM: SAM in the diagonal-Fisher geometry (Kim et al. 2022)",
        point.build,
        point.Options,
        FisherSAM,
    )
)


# Posterior families; every F- variant is the same family composed with SAM (Nguyen et al. 2023).
# SWAG's start_step defaults to null (swag.Options): the last quarter of the updates at a held learning rate.
_SWAG_DEFAULTS: dict[str, Any] = {
    "advice": swag_advice,
    "start": last_quarter,
    "resolve": swag.resolve,
    "hold_lr": True,
    "check": check_snapshots,
}
register(
    MethodSpec(
        "swag",
        "SWAG: diagonal + low-rank Gaussian of SGD iterates (Maddox et al. 2019)",
        swag.build,
        swag.Options,
        gaussian=True,
        **_SWAG_DEFAULTS,
    )
)
register(
    MethodSpec(
        "swag-diag",
        "SWAG-Diagonal: diagonal Gaussian of SGD iterates (Maddox 2019)",
        swag.build_diag,
        swag.DiagonalOptions,
        **_SWAG_DEFAULTS,
    )
)
register(
    MethodSpec(
        "f-swag",
        "F-SWAG: SWAG collected along a SAM trajectory (Nguyen et al. 2023)",
        swag.build,
        swag.Options,
        SAM,
        gaussian=True,
        **_SWAG_DEFAULTS,
    )
)

# Gaussian VI: run directories stored before variance_step existed trained with the plain step (VarianceStep).
_VI_STORED: dict[str, Any] = {"stored": {"variance_step": VarianceStep.PLAIN.value}, "advice": vi_advice}
register(
    MethodSpec(
        "mfvi",
        "Mean-field Gaussian VI: Bayes by backprop (Blundell et al. 2015)",
        mfvi.build,
        mfvi.Options,
        **_VI_STORED,
    )
)
register(
    MethodSpec(
        "lowrank-vi",
        "Low-rank + diagonal Gaussian VI, Σ = ½(diag σ² + LLᵀ/(K−1))",
        lowrank_vi.build,
        lowrank_vi.Options,
        with_prior=fp_bma.build_with_prior,  # with no ascent step it is low-rank VI with that prior
        gaussian=True,
        **_VI_STORED,
    )
)
register(
    MethodSpec(
        "f-mfvi",
        "F-MFVI: SAM on each sampled model of MFVI (Nguyen et al. 2023)",
        mfvi.build,
        mfvi.Options,
        SAM,
        **_VI_STORED,
    )
)
register(
    MethodSpec(
        "f-lowrank-vi",
        "F-low-rank VI: SAM on each sampled model (Nguyen et al. 2023)",
        lowrank_vi.build,
        lowrank_vi.Options,
        SAM,
        with_prior=fp_bma.build_with_prior,  # low-rank VI with that prior, SAM on each sample: lowrank-vi's F- twin
        gaussian=True,
        **_VI_STORED,
    )
)
register(
    MethodSpec(
        "bsam",
        "Bayesian SAM: SAM as a relaxation of Bayes (Möllenhoff & Khan 2023)",
        bsam.build,
        bsam.Options,
        advice=bsam_advice,
    )
)
register(
    MethodSpec(
        "ivon",
        "IVON: natural-gradient mean-field VI at SGD's cost (Shen et al. 2024); lr, beta1, delta from optim",
        ivon.build,
        ivon.Options,
        gaussian=True,
        advice=ivon_advice,
    )
)
register(
    MethodSpec(
        "f-ivon",
        "F-IVON: IVON with SAM at each sampled model, its gradient fed to IVON",
        ivon.build,
        ivon.Options,
        SAM,
        gaussian=True,
        advice=ivon_advice,
    )
)


def check_dropout_rate(method: MethodConfig, stage: Stage) -> None:
    """MC dropout: ``rate: 0`` over every dropout layer (``override_existing``) draws no mask, a silent point estimate.

    The library takes it (:func:`flatbma.posteriors.mc_dropout.build`: the point estimate); a config asking
    for MC dropout means masks.
    """
    if method.options["rate"] == 0 and method.options["override_existing"]:
        raise FlatbmaError(
            f"{stage.key('rate')}=0.0 sets every dropout layer to p=0, so every {method.name} sample is the same "
            "network (a point estimate, which sgd trains): use a rate in (0, 1), e.g. 0.1"
        )


register(
    MethodSpec(
        "mc-dropout",
        "MC dropout: BMA over dropout masks (Gal & Ghahramani 2016)",
        mc_dropout.build,
        mc_dropout.Options,
        check=check_dropout_rate,
        advice=dropout_advice,
    )
)
register(
    MethodSpec(
        "f-mc-dropout",
        "F-MC-dropout: SAM on the dropout net (Nguyen et al. 2023)",
        mc_dropout.build,
        mc_dropout.Options,
        SAM,
        check=check_dropout_rate,
        advice=dropout_advice,
    )
)


def check_member_memory(method: MethodConfig, stage: Stage, option: str = "size") -> None:
    """A posterior of ``method.<option>`` independent members holds at least that many copies of the trained weights.

    Each copy is ``num_trainable`` float32 values (4 bytes): a lower bound of what the members need (their
    optimizer states, a family's moments and the gradients come on top), refused up front when it exceeds
    the memory available where the run trains (:attr:`~flatbma.experiment.config.shape.RunShape.available_memory`)
    — instead of an out-of-memory kill minutes later.
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


def _gigabytes(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def _always(method: MethodConfig) -> bool:
    return True


register(
    MethodSpec(
        "ensemble",
        "Deep ensemble of independently trained nets (Lakshminarayanan 2017)",
        ensemble.build,
        ensemble.Options,
        check=check_member_memory,
        needs_weights=_always,
        aliases={"members": "size"},
        advice=ensemble_advice,
    )
)
register(
    MethodSpec(
        "f-ensemble",
        "F-ensemble: each member trained with SAM (Nguyen et al. 2023)",
        ensemble.build,
        ensemble.Options,
        SAM,
        check=check_member_memory,
        needs_weights=_always,
        aliases={"members": "size"},
        advice=ensemble_advice,
    )
)
register(
    MethodSpec(
        "sgld",
        "SGLD: Langevin dynamics on mini-batch gradients (Welling & Teh 2011)",
        sgld.build,
        sgld.Options,
        check=check_burn_in,
        resolve=sgld.resolve,
        advice=langevin_advice,
    )
)
register(
    MethodSpec(
        "csgld",
        "Cyclical SGLD: cosine cyclical step size (Zhang et al. 2020)",
        sgld.build_cyclical,
        sgld.CyclicalOptions,
        check=check_cycles,
        advice=langevin_advice,
    )
)
register(
    MethodSpec(
        "f-sgld",
        "F-SGLD: SGLD with the SAM gradient (Nguyen et al. 2023)",
        sgld.build,
        sgld.Options,
        SAM,
        check=check_burn_in,
        resolve=sgld.resolve,
        advice=langevin_advice,
    )
)

# FP-BMA: the low-rank + diagonal Gaussian with the Fisher-ball ascent on θ, a KL ball (Lim et al. 2025).
register(
    MethodSpec(
        "fp-bma",
        "FP-BMA: low-rank Gaussian VI, ascent in a KL ball (Lim 2025)",
        lowrank_vi.build,
        lowrank_vi.Options,
        FisherBall,
        with_prior=fp_bma.build_with_prior,
        gaussian=True,
        **_VI_STORED,
    )
)
register(
    MethodSpec(
        "sa-bma",
        "SA-BMA: alias of fp-bma (Lim et al. 2025)",
        lowrank_vi.build,
        lowrank_vi.Options,
        FisherBall,
        with_prior=fp_bma.build_with_prior,
        gaussian=True,
        **_VI_STORED,
    )
)


# Mixtures of independently trained posteriors of any family (MultiSWAG: Wilson & Izmailov 2020).
def multi_family(
    objective: Any, optimizer: Any, ascent: Ascent | None = None, *, of: MethodConfig | None = None, **options: Any
) -> Posterior:
    """:func:`flatbma.posteriors.multi.build` of posteriors of the method ``of`` (a method section).

    ``options`` are those of :class:`flatbma.posteriors.multi.Options`. ``ascent`` is unused: the members'
    ascent step is part of ``of`` (e.g. ``{name: fp-bma, gamma: 0.01}``).
    """
    if of is None:
        raise FlatbmaError("method.of must name the members' method, e.g. of: {name: swag} (see 'flatbma methods')")
    return multi.build(objective, of.build(objective, optimizer), **options)


def multi_with_prior(
    objective: Any,
    optimizer: Any,
    ascent: Ascent | None,
    prior_theta: Mapping[str, Any],
    *,
    of: MethodConfig | None = None,
    **options: Any,
) -> Posterior:
    """:func:`multi_family` whose member ``m`` has its own prior: member ``m``'s Gaussian in ``prior_theta``.

    ``prior_theta`` is a mixture's ``θ`` (:attr:`~flatbma.types.Posterior.gaussian` of ``multi``: member
    ``m``'s under ``member<m>/``), fitted by the per-member first stage (:func:`multi_first_stage`); member
    ``m`` is ``of`` built with its ``θ_m`` (:func:`~flatbma.posteriors.multi.member_thetas`) as its prior.
    """
    if of is None:
        return multi_family(objective, optimizer, ascent, of=of, **options)  # its refusal
    thetas = multi.member_thetas(dict(prior_theta), multi.Options(**options).members)
    bases = [of.build(objective, optimizer, theta) for theta in thetas]
    return multi.build(objective, bases, **options)


def multi_first_stage(method: MethodConfig, prior_method: MethodConfig) -> MethodConfig:
    """``multi``'s first stage: ``multi`` of ``prior.method`` with the same members and member seed.

    So member ``m`` of the first stage starts from the same independent initialization as member ``m`` of
    the second (:func:`flatbma.posteriors.members.member_initializations`), and fits member ``m``'s prior.
    """
    options = {"of": prior_method, "members": method.options["members"], "seed": method.options["seed"]}
    return MethodConfig(name="multi", options=options, ascent=None)


def check_members(method: MethodConfig, stage: Stage) -> None:
    """``multi``: its members fit in memory (:func:`check_member_memory`) and check the stage (``method.of.*``).

    Several members average their samples: a members' method that predicts with the network linearized at
    its mean (Laplace's ``predictive: glm`` or ``probit``) is refused, as :func:`flatbma.posteriors.multi.build` does.
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


def _multi(name: str, summary: str, of: str | None) -> MethodSpec:
    return MethodSpec(
        name,
        summary,
        multi_family,
        multi.Options,
        of=Nested(of, parse_method, members=True),
        with_prior=multi_with_prior,
        check=check_members,
        needs_weights=_always,
        advice=mixture_advice,
    )


register(_multi("multi", "Uniform mixture of M independently trained posteriors of method.of", None))
register(_multi("multiswag", "MultiSWAG: mixture of M SWAG posteriors (Wilson & Izmailov 2020)", "swag"))
register(_multi("multi-fp-bma", "Multi-FP-BMA: mixture of M FP-BMA posteriors, one per basin", "fp-bma"))


# The Laplace family: a MAP phase (a point method) and a curvature pass, then N(w*, (H/T + δ)⁻¹).
def point_methods() -> list[str]:
    """Names of the point methods (family :func:`flatbma.posteriors.point.build`): the MAPs Laplace takes."""
    return [n for n, spec in METHODS.items() if spec.family is point.build]


def parse_point_method(data: Any, where: str = "method.of") -> MethodConfig:
    """A method section (:func:`parse_method`) that must name a point method: the MAP of ``laplace``."""
    of = parse_method(data, where)
    if METHODS[of.name].family is not point.build:
        raise FlatbmaError(
            f"Laplace needs a MAP: {where} must be a point method ({', '.join(point_methods())}), got {of.name!r}"
        )
    return of


def laplace_family(
    objective: Any, optimizer: Any, ascent: Ascent | None = None, *, of: MethodConfig, **options: Any
) -> Posterior:
    """:func:`flatbma.posteriors.laplace.build` around the MAP of ``of`` (a point method section).

    ``options`` are those of :class:`flatbma.posteriors.laplace.Options`; ``ascent`` is unused: the MAP's ascent
    step is ``of``'s (``{name: sam, rho: 0.05}``).
    """
    return laplace.build(objective, optimizer, of.ascent, **options)


def check_laplace(method: MethodConfig, stage: Stage) -> None:
    """Laplace: options, a curvature epoch, a ``full`` Hessian within ``max_full``, a pretrained net for ``w₀``.

    ``prior_mean: pretrained`` needs ``model.pretrained``.

    The run takes the epoch of the family's curvature phase beyond ``stage.epochs`` (its ``phases``), so
    ``start_step`` (MAP updates) must be at most ``stage.steps`` for the curvature to see a whole epoch.
    """
    o, key = method.options, stage.key
    if o["prior_precision"] == VALIDATION and stage.method_key != "method":  # chosen after training
        raise FlatbmaError(
            f"{key('prior_precision')}: val chooses δ on validation data for the run's own method, not for a "
            f"mixture's members or a prior stage: give {key('prior_precision')} a value, or null (the evidence)"
        )
    laplace.check_options(method.family_options(), where=stage.method_key)
    if laplace.PriorMean(o["prior_mean"]) is laplace.PriorMean.PRETRAINED and not stage.shape.pretrained:
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
    whole = laplace.Subset(o["subset"]) is laplace.Subset.ALL  # the last layer's d: checked at init
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


VALIDATION = laplace.VALIDATION
"""The value of an option chosen on validation data after training (:attr:`MethodSpec.on_validation`)."""

PRIOR_PRECISION_GRID = tuple(10.0 ** (k / 5) for k in range(-20, 21))
"""Laplace's ``prior_precision: val`` grid: 41 values ``10^(k/5)``, 1e-4 to 1e4 (laplace-torch's grid search spans
the same ``10^-4 … 10^4``, in 100 steps by default; Daxberger et al. 2021, "Laplace Redux", §2.4)."""


def _full_hessian(method: MethodConfig) -> bool:
    return Hessian(method.options["hessian"]) is Hessian.FULL


def _laplace(name: str, summary: str, family: Callable[..., Posterior], **kw: Any) -> MethodSpec:
    return MethodSpec(
        name,
        summary,
        family,
        laplace.Options,
        check=check_laplace,
        needs_weights=_full_hessian,
        stored={"subset": laplace.Subset.ALL.value},  # run directories stored before subset existed: all weights
        start=_whole_map,
        advice=laplace_advice,
        on_validation={"prior_precision": PRIOR_PRECISION_GRID},
        prior_refusal=_LAPLACE_PRIOR,
        regression=False,
        **kw,
    )


register(
    _laplace(
        "laplace",
        "Laplace around the MAP of method.of (default sgd): GGN, KFAC, evidence, GLM (Daxberger 2021)",
        laplace_family,
        of=Nested("sgd", parse_point_method),
    )
)
register(
    _laplace(
        "f-laplace",
        "F-Laplace: Laplace around a SAM-trained MAP (the F- composition of Nguyen et al. 2023)",
        laplace.build,
        ascent=SAM,
    )
)
