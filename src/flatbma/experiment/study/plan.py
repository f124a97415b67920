"""A parsed compare config (:class:`Plan`): the shared run config, the ``compare`` section, and one job per row.

A compare config is a run config plus a ``compare`` section listing what varies (:class:`CompareConfig`; see
:mod:`flatbma.experiment.study.compare`). :func:`load_plan` parses it once and refuses, before anything trains,
what the comparison cannot honour: unknown keys, repeated labels or seeds, candidate lists without a validation
split, a ``match_width`` it cannot measure. Each (method, seed) is a :class:`Job`, one row of ``results.json``,
with its candidates (:class:`Candidate`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flatbma.data.corruptions import corruption_names
from flatbma.errors import FlatbmaError, suggest
from flatbma.experiment.config import entries
from flatbma.experiment.config.entries import label_of
from flatbma.experiment.config.parse import set_dotted, shown
from flatbma.experiment.config.run_config import (
    CORRUPTIONS_NOT_TABULAR,
    RunConfig,
    config_from_dict,
    load_raw,
    parse_override,
    run_identity,
)
from flatbma.experiment.report.findings import check_pairs
from flatbma.experiment.study.width import check_match_width
from flatbma.methods import parse_method
from flatbma.options import parse_dataclass


@dataclass(frozen=True)
class QuickConfig:
    """What ``--quick`` changes.

    Attributes:
        methods: method names to keep (``[]`` keeps all).
        seeds: seeds to run (``[]`` keeps the full list).
        set: ``key=value`` overrides of the shared run config (e.g. ``train.epochs=2``).
    """

    methods: tuple[str, ...] = ()
    seeds: tuple[int, ...] = ()
    set: tuple[str, ...] = ()


@dataclass(frozen=True)
class CompareConfig:
    """The ``compare`` section.

    Attributes:
        methods: method sections (``{name: ..., options...}``); an entry may carry a ``prior`` section, an ``optim``
            section (overriding the shared one's keys, for a first stage without ``prior.optim`` too), a ``label``,
            lists of candidate values and ``match_width`` (docs/cli.md).
        seeds: each (method, seed) is one run.
        corruptions: corruption names evaluated on the test set (``flatbma.data.corruption_names()``).
        severities: corruption severities in 1..5.
        corruption_samples: BMA samples on the corrupted test sets, the first of the run's ``eval.num_samples``
            (``None``: all); each corrupted copy costs a pass per sample. The clean test set uses every sample.
        bma_curve: numbers of BMA samples M at which accuracy/NLL/ECE are also reported.
        flatness: measure Hessian spectra and distribution-level flatness.
        landscape: record a 1-D loss landscape of the posterior along a filter-normalized direction.
        reference: the label of the method every other one is compared with (``None``: the first method).
        pairs: further ``[a, b]`` of two method labels, each reported as ``a − b`` over the seeds both ran; like
            ``reference``, it only shapes the report (in no fingerprint, study or row cache key).
        quick: the reduced setting of ``--quick`` (written to ``<output_dir>-quick``, beside the full run).
    """

    methods: tuple[Any, ...] = ()
    seeds: tuple[int, ...] = (0,)
    corruptions: tuple[str, ...] = ()
    severities: tuple[int, ...] = (3,)
    corruption_samples: int | None = None
    bma_curve: tuple[int, ...] = (1, 2, 5, 10, 20, 30)
    flatness: bool = True
    landscape: bool = True
    reference: str | None = None
    pairs: tuple[tuple[str, str], ...] = ()
    quick: QuickConfig = field(default_factory=QuickConfig)

    def __post_init__(self) -> None:
        if not self.methods:
            raise FlatbmaError("compare.methods is empty: list the methods to compare, e.g. [{name: sgd}, {name: sam}]")
        if not self.seeds:
            raise FlatbmaError("compare.seeds is empty: give at least one seed, e.g. [0, 1, 2]")
        twice = sorted({s for s in self.seeds if self.seeds.count(s) > 1})
        if twice:
            raise FlatbmaError(
                f"compare.seeds lists seed {twice[0]} more than once: a seed's runs are the same runs, so repeats "
                "would be reported as a spread of zero width over copies; give distinct seeds, e.g. [0, 1, 2]"
            )
        bad = [s for s in self.severities if not 1 <= s <= 5]
        if bad:
            raise FlatbmaError(f"compare.severities must lie in 1..5, got {bad}")
        if self.corruption_samples is not None and self.corruption_samples < 1:
            raise FlatbmaError(f"compare.corruption_samples must be >= 1 (or null: all), got {self.corruption_samples}")
        if any(m < 1 for m in self.bma_curve):
            raise FlatbmaError(f"compare.bma_curve holds numbers of samples >= 1, got {list(self.bma_curve)}")
        if self.corruptions:
            unknown = [c for c in self.corruptions if c not in corruption_names()]
            if unknown:
                raise FlatbmaError(
                    f"unknown corruption {shown(unknown[0])}.{suggest(unknown[0], corruption_names())} "
                    f"Available: {', '.join(corruption_names())}"
                )
        labels = [label_of(m) for m in self.methods]
        if self.reference is not None and self.reference not in labels:
            raise FlatbmaError(
                f"compare.reference {shown(self.reference)} is not a compared method.{suggest(self.reference, labels)} "
                f"Give one of: {', '.join(labels)} (a method's label, else its name), or leave it out for the first"
            )
        check_pairs(self.pairs, labels)


@dataclass(frozen=True)
class Candidate:
    """One run of a compare entry: a point of its candidate grid (``{}`` when it lists none) and its config."""

    options: dict[str, Any]
    config: RunConfig


@dataclass(frozen=True)
class Job:
    """One (method entry, seed): one row of ``results.json``.

    Attributes:
        label: the entry's name in tables and plots.
        row_dir: where the row is cached (``compare.json``): the run directory of a lone candidate, else
            the directory holding the candidates' run directories and their shared first stages.
        candidates: the entry's runs for this seed; of several, the row is the one chosen on validation
            data (:meth:`selects`).
        match_width: the label of the entry whose width (same seed) the row is measured at, or ``None``.
    """

    label: str
    seed: int
    row_dir: Path
    candidates: tuple[Candidate, ...]
    match_width: str | None = None

    @property
    def selects(self) -> bool:
        """Whether the row is chosen among several candidates."""
        return len(self.candidates) > 1


@dataclass(frozen=True)
class Plan:
    """A parsed compare: the shared run config, the compare section and the output directory."""

    base: RunConfig
    compare: CompareConfig
    raw: dict[str, Any]
    out_dir: Path

    def jobs(self) -> list[Job]:
        """One job per (method, seed), methods outer, each with the entry's candidates for that seed."""
        out = []
        for i, entry in enumerate(self.compare.methods):
            grid_points = entries.points(entry, f"compare.methods[{i}]")
            names = entries.directory_names(grid_points)
            for seed in self.compare.seeds:
                row_dir = self.out_dir / "runs" / _slug(entry) / f"seed{seed}"
                dirs = [row_dir] if len(grid_points) == 1 else [row_dir / name for name in names]
                candidates = tuple(
                    Candidate(point, self._config(entries.at(entry, point), seed, run_dir))
                    for point, run_dir in zip(grid_points, dirs, strict=True)
                )
                out.append(
                    Job(
                        label=label_of(entry),
                        seed=seed,
                        row_dir=row_dir,
                        candidates=candidates,
                        match_width=entry.get(entries.MATCH_WIDTH),
                    )
                )
        return out

    def labels(self) -> list[str]:
        """The method label of every run of :meth:`runs`, in the same order."""
        return [job.label for job in self.jobs() for _ in job.candidates]

    def runs(self) -> list[RunConfig]:
        """Every run config — one per (method, seed, candidate) — each with its own output directory."""
        return [c.config for job in self.jobs() for c in job.candidates]

    def _config(self, entry: Any, seed: int, run_dir: Path) -> RunConfig:
        raw = json.loads(json.dumps(self.raw))
        raw.update(entries.run_sections(entry, raw))
        raw["seed"] = seed
        raw["output_dir"] = str(run_dir)
        raw["eval"] = {**(raw.get("eval") or {}), "flatness": False}  # measured by the comparison itself
        return config_from_dict(raw)

    def fingerprint(self) -> str:
        """Hash of everything that determines the results (not the output directory)."""
        payload = {
            "base": {k: v for k, v in run_identity(self.base.to_dict()).items() if k != "output_dir"},
            "compare": {k: v for k, v in dataclasses.asdict(self.compare).items() if k not in _REPORT_ONLY},
        }
        return _digest(payload)

    def study(self) -> str:
        """Hash of what every row shares: the base sections and the measurement settings, without the rows.

        The method entries, seeds, ``reference`` and ``quick`` are left out, so a comparison that adds or drops
        methods or seeds stays the same study in the same ``output_dir`` and reuses its finished rows. The base's
        ``method``, ``seed`` and ``prior`` are each run's own (checked per run when it is reused).
        """
        base = {k: v for k, v in run_identity(self.base.to_dict()).items() if k not in _PER_RUN}
        return _digest({"base": base, "measure": _measurement(self.compare)})

    def row_key(self, job: Job) -> str:
        """The key of a row's cache (``compare.json``): the measurement settings and the row's label.

        A cached row is reused when its key matches and its run (or, for a selection, every candidate
        and the choice) is the same; the run's config itself is checked by :func:`finished`.
        """
        return _digest({"measure": _measurement(self.compare), "label": job.label})


_PER_RUN = ("output_dir", "method", "seed", "prior")
"""Sections of the base config that every run sets for itself (not part of :meth:`Plan.study`)."""


_REPORT_ONLY = ("reference", "pairs")
"""Fields of the compare section that only shape the report (not part of :meth:`Plan.fingerprint`)."""


_ROWS = ("methods", "seeds", *_REPORT_ONLY, "quick")
"""Fields of the compare section that choose the rows rather than how each row is measured."""


def compare_record(compare: CompareConfig) -> dict[str, Any]:
    """The compare section as recorded in ``results.json`` and ``compare_config.yaml``: plain values.

    ``pairs`` is recorded only when some are listed.
    """
    record = dataclasses.asdict(compare)
    if not record["pairs"]:
        del record["pairs"]
    return record


def _measurement(compare: CompareConfig) -> dict[str, Any]:
    """The compare section without the fields that choose the rows (:data:`_ROWS`): how every row is measured."""
    return {k: v for k, v in dataclasses.asdict(compare).items() if k not in _ROWS}


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _slug(method: dict[str, Any]) -> str:
    opts = {k: v for k, v in method.items() if k not in ("name", "label")}  # a label is only a display name
    if not opts:
        return str(method["name"])
    digest = hashlib.sha256(json.dumps(opts, sort_keys=True).encode()).hexdigest()[:6]
    return f"{method['name']}-{digest}"


def load_plan(path: str | Path, overrides: list[str] = (), *, quick: bool = False) -> Plan:
    """Parse a compare config file (+ ``--set`` overrides, + the ``--quick`` reduction)."""
    raw = load_raw(path)
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    if "compare" not in raw:
        raise FlatbmaError(f"{path} has no 'compare' section (methods, seeds, ...); see configs/demo.yaml")
    section = raw.pop("compare")
    if isinstance(section, dict) and isinstance(section.get("methods"), list):
        section = {**section, "methods": [m if isinstance(m, dict) else {"name": m} for m in section["methods"]]}
    compare = parse_dataclass(CompareConfig, section, "compare")
    if quick:
        q = compare.quick
        _check_quick(compare)
        if isinstance(raw.get("output_dir", ""), str):  # its own directory: a quick run never clashes with the full one
            raw["output_dir"] = raw.get("output_dir", RunConfig.__dataclass_fields__["output_dir"].default).rstrip("/")
            raw["output_dir"] += "-quick"
        for item in q.set:
            key, value = parse_override(item)
            set_dotted(raw, key, value)
        keep = set(q.methods)
        methods = tuple(m for m in compare.methods if not keep or {str(m.get("name")), label_of(m)} & keep)
        kept_labels = {label_of(m) for m in methods}  # a width-matched entry goes with the entry it is matched to
        methods = tuple(m for m in methods if m.get(entries.MATCH_WIDTH) in (None, *kept_labels))
        kept_labels = {label_of(m) for m in methods}
        kept = compare.reference in kept_labels  # a reference left out: the first kept method
        pairs = tuple(p for p in compare.pairs if set(p) <= kept_labels)  # a pair with a method left out is dropped
        compare = dataclasses.replace(
            compare,
            methods=methods,
            seeds=q.seeds or compare.seeds,
            reference=compare.reference if kept else None,
            pairs=pairs,
        )
    bad = [m["label"] for m in compare.methods if isinstance(m, dict) and not isinstance(m.get("label", ""), str)]
    if bad:
        raise FlatbmaError(f"compare.methods: a label is the row's display name, a text; got {shown(bad[0])}")
    labels = [label_of(m) for m in compare.methods]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise FlatbmaError(
            f"compare.methods has several entries named {shown(twice[0])}: give them distinct 'label' keys "
            "(e.g. label: fp-bma+swag-prior), the names their rows get in tables and plots"
        )
    check_match_width(compare)
    for i, entry in enumerate(compare.methods):  # validate every candidate's run config up front
        where = f"compare.methods[{i}]"
        for point in entries.points(entry, where):
            sections = entries.run_sections(entries.at(entry, point), raw)
            parse_method(sections["method"], where)  # its errors name the entry's keys (compare.methods[0].rho)
            try:
                config_from_dict({**raw, **sections})
            except FlatbmaError as e:
                raise FlatbmaError(f"{where} ({shown(label_of(entry), 40)}): {e}") from None
    raw.setdefault("method", entries.first_run_sections(compare.methods[0])["method"])
    base = config_from_dict(raw)
    plan = Plan(base=base, compare=compare, raw=raw, out_dir=Path(base.output_dir))
    _check_selection(plan.jobs(), base)
    _check_regression(plan)
    return plan


def _check_regression(plan: Plan) -> None:
    """Refuse corruptions in a regression comparison (``model.likelihood: gaussian``), before it trains.

    Its rows are the mixture predictive's NLL, RMSE, MAE, coverage and calibration error (with
    ``compare.flatness``/``landscape`` also its Gaussian NLL's); the corruptions are of images, not feature vectors.
    """
    if plan.base.model.likelihood.has_classes:
        return
    if plan.compare.corruptions:
        raise FlatbmaError(CORRUPTIONS_NOT_TABULAR)


def _check_quick(compare: CompareConfig) -> None:
    """Refuse ``--quick`` when ``compare.quick`` changes nothing or names a method no entry has."""
    q = compare.quick
    if q == QuickConfig():
        raise FlatbmaError(
            "--quick runs the reduced setting of the config's compare.quick section, but it sets none: add "
            "compare.quick (methods, seeds, set; see configs/demo.yaml), or drop --quick"
        )
    names = {n for m in compare.methods for n in (str(m.get("name")), label_of(m))}
    unknown = [m for m in q.methods if m not in names]
    if unknown:
        raise FlatbmaError(
            f"compare.quick.methods names {shown(unknown[0], 40)}, which is no entry of compare.methods "
            f"(names and labels: {', '.join(sorted(names))}).{suggest(unknown[0], names)}"
        )


def _check_selection(jobs: list[Job], base: RunConfig) -> None:
    """Refuse candidate lists without a validation split to choose on (before anything trains)."""
    selecting = [job for job in jobs if job.selects]
    if selecting and not base.data.validation:
        job = selecting[0]
        raise FlatbmaError(
            f"compare.methods entry {job.label!r} lists candidate values ({', '.join(job.candidates[0].options)}) "
            "to choose on validation data, but there is none: set data.k_shot and data.val_per_class > 0 (held "
            "out of the k-shot images) or data.val_pool > 0 (drawn from outside them), or data.val_fraction for "
            "full data (the test set never chooses), or give each option one value"
        )
