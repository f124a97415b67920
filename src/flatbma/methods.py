"""The method registry: names used in configs, ``flatbma methods`` and :func:`flatbma.fit_posterior` → family + ascent.

The only place methods are looked up by string. A method is a posterior family (:class:`~flatbma.family.Family`)
composed with an optional ascent step class (a flat-seeking variant: the same family with an ascent step); their
options are the fields of their dataclasses. A method with an ascent step also takes :func:`amortized_options`
(the second pass every ``k`` steps, on a fraction of the batch); given none, its resolved section names none.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flatbma.checks import shown
from flatbma.errors import FlatbmaError, suggest
from flatbma.family import STEP_SIZES, Family, Stage, divergence_advice
from flatbma.optim import ASAM, SAM, Amortized, FisherBall, FisherSAM
from flatbma.optim.schedules import held_schedule, hold_learning_rate
from flatbma.options import coerce, parse_dataclass, resolved
from flatbma.posteriors import (
    bsam,
    ensemble,
    fp_bma,
    ivon,
    laplace,
    mc_dropout,
    mfvi,
    multi,
    point,
    sgld,
    swag,
)
from flatbma.types import Ascent, Phase, Posterior, phases_after

__all__ = [
    "METHODS",
    "MethodConfig",
    "MethodSpec",
    "amortized_options",
    "parse_method",
    "point_methods",
    "prior_methods",
    "register",
]


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: a name, one line for ``flatbma methods``, a family and an ascent step class (or none)."""

    name: str
    summary: str
    family: Family
    ascent: type | None = None

    def family_options(self) -> dict[str, Any]:
        """The type of every family option, in order: ``of`` first when the family nests a section."""
        own = self.family.option_types()
        if self.family.of is None:
            return own
        return {"of": MethodConfig | None if self.family.of.members else MethodConfig, **own}

    def defaults(self) -> dict[str, Any]:
        """The default of every family option, in the order of :meth:`family_options`."""
        own = {f.name: f.default for f in dataclasses.fields(self.family.options)}  # the family's, one value everywhere
        of = self.family.of
        if of is None:
            return own
        return {"of": parse_method(of.default) if of.default is not None else None, **own}

    def ascent_options(self) -> dict[str, dataclasses.Field]:
        """Fields of the ascent step dataclass."""
        return {f.name: f for f in dataclasses.fields(self.ascent)} if self.ascent else {}

    def amortized_options(self) -> dict[str, dataclasses.Field]:
        """:func:`amortized_options` when the method has an ascent step, else none."""
        return amortized_options() if self.ascent else {}


def amortized_options() -> dict[str, dataclasses.Field]:
    """Fields of :class:`~flatbma.optim.Amortized` besides the wrapped step: the options that amortize a second pass."""
    return {f.name: f for f in dataclasses.fields(Amortized) if f.name != "ascent"}


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

    @property
    def family(self) -> Family:
        """The method's family (:attr:`MethodSpec.family`)."""
        return METHODS[self.name].family

    def build(
        self,
        objective: Any,
        optimizer: Any,
        prior: Mapping[str, Any] | None = None,
        *,
        map_steps: int | None = None,
    ) -> Posterior:
        """Build the method's transform for ``objective`` and ``optimizer``.

        With ``prior`` (a low-rank plus diagonal Gaussian in ``θ`` layout, e.g. a SWAG posterior's ``gaussian``) the
        family's ``with_prior`` builds it; the prior replaces the family's default one (``prior_std`` does not apply).
        ``map_steps`` (``train.epochs`` × steps per epoch) resolves ``start_step: null`` (:meth:`resolved`) and holds
        the learning rate from there where the family asks (:attr:`~flatbma.family.Family.hold_lr`).
        """
        if map_steps is not None:
            held = self.held_from(map_steps)
            if held is not None:
                optimizer = hold_learning_rate(optimizer, held, self.name)
            return self.resolved(map_steps).build(objective, optimizer, prior)
        family = self.family
        if prior is None:
            return family.build(objective, optimizer, self.ascent, **self.options)
        if family.with_prior is None:
            takers = ", ".join(prior_methods())
            raise FlatbmaError(f"method {self.name!r} takes no Gaussian prior (the prior section): use one of {takers}")
        return family.with_prior(objective, optimizer, self.ascent, prior, **self.options)

    def family_options(self) -> Any:
        """The family's options dataclass of this section (its options but ``of``)."""
        family = self.family
        return family.options(**{k: v for k, v in self.options.items() if k != "of" or family.of is None})

    def component(self) -> MethodConfig | None:
        """The method each independent member trains (a mixture's ``of``: ``Nested.members``); else itself."""
        of = self.family.of
        return self.options["of"] if of is not None and of.members else self

    def takes_prior(self) -> bool:
        """Whether a ``prior`` section applies: the family has a ``with_prior``, and so has its members' method."""
        inner = self.component()
        return all(m is not None and m.family.with_prior is not None for m in (self, inner))

    def first_stage(self, prior_method: MethodConfig) -> MethodConfig:
        """The method of a two-stage run's first stage, given ``prior.method``.

        A mixture's is ``multi`` of ``prior.method`` with the same members and member seed, so member ``m`` of both
        stages starts from the same initialization and the first fits member ``m``'s prior.
        """
        of = self.family.of
        if of is None or not of.members:
            return prior_method
        options = {"of": prior_method, "members": self.options["members"], "seed": self.options["seed"]}
        return MethodConfig(name="multi", options=options, ascent=None)

    def check(self, stage: Stage) -> None:
        """Refuse options that ask more of a run than ``stage`` gives (:attr:`~flatbma.family.Family.check`)."""
        check = self.family.check
        if check is not None:
            check(self, stage)

    def phases_after(self) -> tuple[Phase, ...]:
        """The phases after ``train.epochs``: its family's (Laplace's curvature), then a nested section's longest."""
        nested = [v.phases_after() for v in self.options.values() if isinstance(v, MethodConfig)]
        longest = max(nested, key=lambda ps: sum(p.epochs or 0 for p in ps), default=())
        return phases_after(self.family.options) + longest

    def extra_epochs(self) -> int:
        """Epochs the run takes beyond ``train.epochs``: those of its :meth:`phases_after`."""
        return sum(p.epochs or 0 for p in self.phases_after())

    def needs_weights(self) -> bool:
        """Whether checking it needs the number of trained weights (:attr:`~flatbma.family.Family.needs_weights`)."""
        needs = self.family.needs_weights
        own = needs is not None and needs(self)
        return own or any(v.needs_weights() for v in self.options.values() if isinstance(v, MethodConfig))

    def resolved(self, map_steps: int) -> MethodConfig:
        """This section with ``start_step: null`` set to the family's ``start(map_steps)``, then its ``resolve``.

        Laplace: ``map_steps`` (its curvature pass follows the whole MAP); SWAG: the last quarter, and
        ``collect_every: auto``. Nested sections are resolved the same way.
        """
        options = {k: v.resolved(map_steps) if isinstance(v, MethodConfig) else v for k, v in self.options.items()}
        family = self.family
        if family.start is not None and options.get("start_step", 0) is None:
            options["start_step"] = family.start(map_steps)
        if family.resolve is not None:
            options = family.resolve(options, map_steps)
        return dataclasses.replace(self, options=options)

    def after_map(self) -> list[MethodConfig]:
        """The sections (itself, a nested one) whose posterior phase starts after a MAP phase of ``start_step`` updates.

        Those of a family with a ``start`` (Laplace, SWAG): what ``posthoc`` skips, resolving ``start_step: null`` to 0.
        """
        nested = [c for v in self.options.values() if isinstance(v, MethodConfig) for c in v.after_map()]
        return ([self] if self.family.start is not None else []) + nested

    def held_from(self, map_steps: int) -> int | None:
        """The update from which the learning rate is held constant (the family's ``hold_lr``), or ``None``.

        SWAG with ``start_step: null``: its collection window's first update; or a nested section's (MultiSWAG's
        members share one optimizer). An explicit ``start_step`` keeps the ``optim`` schedule.
        """
        family = self.family
        if family.hold_lr and family.start is not None and self.options.get("start_step", 0) is None:
            return family.start(map_steps)
        nested = (v.held_from(map_steps) for v in self.options.values() if isinstance(v, MethodConfig))
        return next((h for h in nested if h is not None), None)

    def on_validation(self) -> dict[str, tuple[float, ...]]:
        """``{option: grid}`` of the options set to ``val``, to choose on validation data after training."""
        grids = self.family.on_validation
        return {k: grid for k, grid in grids.items() if self.options.get(k) == laplace.VALIDATION}

    def with_options(self, **options: Any) -> MethodConfig:
        """This section with ``options`` replaced (e.g. the chosen ``prior_precision``)."""
        return dataclasses.replace(self, options={**self.options, **options})

    def regression(self) -> bool:
        """Whether it fits a regression network (the family's ``regression``, and that of a nested section)."""
        own = self.family.regression
        return own and all(v.regression() for v in self.options.values() if isinstance(v, MethodConfig))

    def advice(self, prior: bool = False, diagnostics: Mapping[str, Any] | None = None) -> str:
        """What to change when the BMA is worse than its reference network (the family's ``advice``), one clause."""
        advice = self.family.advice
        if advice is None:
            return f"narrow the posterior (its options: flatbma methods {self.name})"
        return advice(self, prior, diagnostics or {})

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
        """What to lower after training diverged: :func:`~flatbma.family.divergence_advice` of its step settings."""
        return divergence_advice(self.step_settings(), cause, lr, prefix)

    def learning_rate(self, rate: Callable[[int], float], map_steps: int) -> Callable[[int], float]:
        """The schedule ``step -> η_t`` the method trains with, given the ``optim`` section's ``rate`` (for logs)."""
        held = self.held_from(map_steps)
        return rate if held is None else held_schedule(rate, held)

    def to_dict(self) -> dict[str, Any]:
        """The resolved section, every option spelled out (written to the run directory)."""
        step = self.ascent.ascent if isinstance(self.ascent, Amortized) else self.ascent
        ascent = resolved(step) if step is not None else {}  # options added later: only when not at their default
        if isinstance(self.ascent, Amortized):  # only then: a plain step's section names none of them
            ascent.update({k: getattr(self.ascent, k) for k in amortized_options()})
        options = {k: v.to_dict() if isinstance(v, MethodConfig) else v for k, v in self.options.items()}
        return {"name": self.name, **options, **ascent}


METHODS: dict[str, MethodSpec] = {}


def prior_methods() -> list[str]:
    """Names of the methods that accept a Gaussian prior (a run's ``prior`` section) with their default options."""
    return [n for n, spec in METHODS.items() if spec.family.with_prior is not None and parse_method(n).takes_prior()]


def point_methods() -> list[str]:
    """Names of the point methods (the family :data:`flatbma.posteriors.point.FAMILY`): SGD, SAM, ..."""
    return [n for n, spec in METHODS.items() if spec.family is point.FAMILY]


def register(spec: MethodSpec) -> MethodSpec:
    """Add ``spec`` to the registry (names are unique; family and ascent options must not collide)."""
    if spec.name in METHODS:
        raise ValueError(f"method {spec.name!r} is registered twice")
    clash = set(spec.family_options()) & set(spec.ascent_options())
    clash |= set(amortized_options()) & (set(spec.family_options()) | set(spec.ascent_options()))
    if clash:
        raise ValueError(f"method {spec.name!r}: options {clash} belong to both the family and the ascent")
    METHODS[spec.name] = spec
    return spec


def parse_method(data: Any, where: str = "method") -> MethodConfig:
    """Parse the ``method`` config section: ``{name: sam, rho: 0.05, ...}``.

    Family options come first in the section's order, then the others with their defaults.
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
    aliases = spec.family.aliases
    family_opts, ascent_opts, amortized_opts = spec.family_options(), spec.ascent_options(), spec.amortized_options()
    options: dict[str, Any] = {}
    ascent_data: dict[str, Any] = {}
    amortized_data: dict[str, Any] = {}
    for key, value in data.items():
        if key == "name":
            continue
        if key in aliases:  # another spelling of a family option (ensemble's members: its size)
            option = aliases[key]
            if option in data:
                raise FlatbmaError(f"{where}.{key} and {where}.{option} are one option ({key} is its alias): keep one")
            options[option] = coerce(value, family_opts[option], f"{where}.{key}")
        elif key in ascent_opts:
            ascent_data[key] = value
        elif key in amortized_opts:
            amortized_data[key] = value
        elif key in amortized_options():
            raise FlatbmaError(_no_second_pass(spec, f"{where}.{key}"))
        elif key == "of" and spec.family.of is not None:
            options[key] = _parse_of(spec.family, value, f"{where}.{key}")
        elif key in family_opts:
            options[key] = coerce(value, family_opts[key], f"{where}.{key}")
        else:
            valid = sorted([*family_opts, *ascent_opts, *amortized_opts, *aliases])
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


def _parse_of(family: Family, data: Any, where: str) -> MethodConfig:
    """A nested section (:class:`~flatbma.family.Nested`): a method section, of its family where it names one."""
    nested = family.of
    assert nested is not None
    of = parse_method(data, where)
    if nested.family is not None and of.family is not nested.family:
        methods = ", ".join(n for n, spec in METHODS.items() if spec.family is nested.family)
        kind = nested.family.build.__module__
        raise FlatbmaError(nested.refusal.format(where=where, family=kind, methods=methods, got=repr(of.name)))
    return of


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
    where = " (for a mixture, give it in method.of)" if spec.family.of is not None else ""
    return (
        f"{key}: method {spec.name!r} has no ascent step, so there is no second pass to amortize{where}; "
        f"it applies to the flat-seeking methods: {flat}"
    )


# Point estimates, then the posterior families; every F- variant is the same family composed with SAM (Nguyen
# et al. 2023).
for _spec in (
    MethodSpec("sgd", "MAP point estimate by SGD (momentum, weight decay, cosine schedule)", point.FAMILY),
    MethodSpec("sam", "SAM: sharpness-aware minimization (Foret et al. 2021)", point.FAMILY, SAM),
    MethodSpec("asam", "ASAM: adaptive, scale-invariant SAM (Kwon et al. 2021)", point.FAMILY, ASAM),
    MethodSpec("fsam", "Fisher-SAM: SAM in the diagonal-Fisher geometry (Kim et al. 2022)", point.FAMILY, FisherSAM),
    MethodSpec("swag", "SWAG: diagonal + low-rank Gaussian of SGD iterates (Maddox et al. 2019)", swag.FAMILY),
    MethodSpec("swag-diag", "SWAG-Diagonal: diagonal Gaussian of SGD iterates (Maddox 2019)", swag.DIAGONAL),
    MethodSpec("f-swag", "F-SWAG: SWAG collected along a SAM trajectory (Nguyen et al. 2023)", swag.FAMILY, SAM),
    MethodSpec("mfvi", "Mean-field Gaussian VI: Bayes by backprop (Blundell et al. 2015)", mfvi.FAMILY),
    MethodSpec("lowrank-vi", "Low-rank + diagonal Gaussian VI, Σ = ½(diag σ² + LLᵀ/(K−1))", fp_bma.FAMILY),
    MethodSpec("f-mfvi", "F-MFVI: SAM on each sampled model of MFVI (Nguyen et al. 2023)", mfvi.FAMILY, SAM),
    MethodSpec("f-lowrank-vi", "F-low-rank VI: SAM on each sampled model (Nguyen et al. 2023)", fp_bma.FAMILY, SAM),
    MethodSpec("bsam", "Bayesian SAM: SAM as a relaxation of Bayes (Möllenhoff & Khan 2023)", bsam.FAMILY),
    MethodSpec(
        "ivon",
        "IVON: natural-gradient mean-field VI at SGD's cost (Shen et al. 2024); lr, beta1, delta from optim",
        ivon.FAMILY,
    ),
    MethodSpec("f-ivon", "F-IVON: IVON with SAM at each sampled model, its gradient fed to IVON", ivon.FAMILY, SAM),
    MethodSpec("mc-dropout", "MC dropout: BMA over dropout masks (Gal & Ghahramani 2016)", mc_dropout.FAMILY),
    MethodSpec("f-mc-dropout", "F-MC-dropout: SAM on the dropout net (Nguyen et al. 2023)", mc_dropout.FAMILY, SAM),
    MethodSpec("ensemble", "Deep ensemble of independently trained nets (Lakshminarayanan 2017)", ensemble.FAMILY),
    MethodSpec("f-ensemble", "F-ensemble: each member trained with SAM (Nguyen et al. 2023)", ensemble.FAMILY, SAM),
    MethodSpec("sgld", "SGLD: Langevin dynamics on mini-batch gradients (Welling & Teh 2011)", sgld.FAMILY),
    MethodSpec("csgld", "Cyclical SGLD: cosine cyclical step size (Zhang et al. 2020)", sgld.CYCLICAL),
    MethodSpec("f-sgld", "F-SGLD: SGLD with the SAM gradient (Nguyen et al. 2023)", sgld.FAMILY, SAM),
    # FP-BMA: the low-rank + diagonal Gaussian with the Fisher-ball ascent on θ, a KL ball (Lim et al. 2025).
    MethodSpec("fp-bma", "FP-BMA: low-rank Gaussian VI, ascent in a KL ball (Lim 2025)", fp_bma.FAMILY, FisherBall),
    MethodSpec("sa-bma", "SA-BMA: alias of fp-bma (Lim et al. 2025)", fp_bma.FAMILY, FisherBall),
    # Mixtures of independently trained posteriors of any family (MultiSWAG: Wilson & Izmailov 2020).
    MethodSpec("multi", "Uniform mixture of M independently trained posteriors of method.of", multi.mixture(None)),
    MethodSpec("multiswag", "MultiSWAG: mixture of M SWAG posteriors (Wilson & Izmailov 2020)", multi.mixture("swag")),
    MethodSpec(
        "multi-fp-bma", "Multi-FP-BMA: mixture of M FP-BMA posteriors, one per basin", multi.mixture("fp-bma")
    ),
    # The Laplace family: a MAP phase (a point method) and a curvature pass, then N(w*, (H/T + δ)⁻¹).
    MethodSpec(
        "laplace",
        "Laplace around the MAP of method.of (default sgd): GGN, KFAC, evidence, GLM (Daxberger 2021)",
        laplace.FAMILY,
    ),
    MethodSpec(
        "f-laplace",
        "F-Laplace: Laplace around a SAM-trained MAP (the F- composition of Nguyen et al. 2023)",
        laplace.SHARP,
        SAM,
    ),
):
    register(_spec)
