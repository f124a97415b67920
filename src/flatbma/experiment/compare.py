"""``flatbma compare``: methods × seeds through the one runner, evaluated for calibration, shift and flatness.

A compare config is a run config (the shared data/model/optim/train/eval sections and a default
``method``) plus a ``compare`` section listing what varies::

    compare:
      methods: [{name: sgd}, {name: sam, rho: 0.05}, {name: fp-bma, rank: 5}]
      seeds: [0, 1, 2]
      corruptions: [gaussian_noise, defocus_blur, contrast]
      severities: [1, 3, 5]
      bma_curve: [1, 2, 5, 10, 20, 30]
      flatness: true
      landscape: true
      reference: sgd        # the others' paired differences and findings are against it (default: the first)
      pairs: [[fp-bma, swag], [sam, sgd]]   # further paired differences, each a − b (in addition)
      quick: {methods: [sgd, sam], seeds: [0], set: [train.epochs=2]}

Each (method, seed) is an ordinary run directory under ``OUT/runs/<method>/seed<s>`` (trained with
:func:`flatbma.experiment.run.train` and measured, on the experiment and state it just trained, by
:func:`flatbma.experiment.evaluate.measure`); its comparison measurements are cached beside it in
``compare.json`` together with the hash of the config that produced them, so a rerun skips every
finished (method, seed) and reuses it. The output directory records its compare config and refuses
to mix results of a different one unless ``--force`` is given. Under ``torchrun`` the runs are
spread over the processes (:func:`run_compare`).

An entry may carry its own ``optim`` section (its keys override the shared one's) and give lists of
candidate values, e.g. ``{name: sam, rho: [0.01, 0.05, 0.1], optim: {lr: [0.01, 0.05]}}``: every
combination is then a run of its own in ``OUT/runs/<method>/seed<s>/cand-<options>``, and the row of
that (method, seed) is the candidate with the best validation NLL, the only one measured on the test
set (:mod:`flatbma.experiment.selection`; ``selection`` in the row records every candidate's score).

**Width-matched posteriors.** An entry of a method whose posterior is a low-rank plus diagonal Gaussian
(``swag``, ``lowrank-vi``, ``fp-bma``, …: :attr:`MethodSpec.gaussian`) may name an earlier entry in
``match_width``, e.g. ``{name: swag, label: swag-wide, rank: 5, match_width: fp-bma}``. It trains (and
selects) as usual, but is *measured* as ``N(μ, cΣ)`` with

    ``c = tr Σ_ref / tr Σ``,

``tr Σ_ref`` the posterior width (``width.trace_cov``, :mod:`flatbma.flatness.width`) of the
referenced entry's row for the same seed and ``tr Σ`` the entry's own (closed form), so both rows have
the same ``tr Σ`` and a flatness comparison between them is not confounded by width. The scaled ``θ``
(:func:`flatbma.gaussian.scale_covariance`) is sampled by the low-rank family's sampler
(:func:`flatbma.posteriors.lowrank_vi.fixed`), which is SWAG's sampler distribution; the row records
``width_matched: {to, factor, ...}``. Under ``torchrun`` these rows are measured in a second phase,
after every other row (:func:`run_compare`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import yaml

from flatbma import gaussian, plotting, progress
from flatbma.data.corruptions import corruption_names
from flatbma.errors import DivergenceError, FlatbmaError, suggest
from flatbma.experiment import distributed, entries, report, selection
from flatbma.experiment.build import Experiment, data_fingerprint, load_data
from flatbma.experiment.checkpoint import (
    atomic_write_bytes,
    atomic_write_json,
    checkpoint_metadata,
    checkpoint_record,
    remove_stale_temps,
)
from flatbma.experiment.config import RunConfig, config_from_dict, load_raw, parse_override
from flatbma.experiment.evaluate import CLEAN_KEYS, measure
from flatbma.experiment.findings import check_pairs
from flatbma.experiment.health import assess, warn_if_flagged
from flatbma.experiment.lock import LOCK_FILE, hold
from flatbma.experiment.methods import METHODS, parse_method
from flatbma.experiment.outdir import check_compare_output
from flatbma.experiment.parse import load_yaml, parse_dataclass, set_dotted, shown
from flatbma.experiment.prior import FittedPrior, fit_prior, prior_stage
from flatbma.experiment.run import load_run, train
from flatbma.experiment.stage import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    METRICS_FILE,
    finished_run,
    run_identity,
    train_stage,
)
from flatbma.experiment.validate import validate_runs
from flatbma.posteriors import lowrank_vi
from flatbma.types import State

COMPARE_CONFIG = "compare_config.yaml"
RESULTS_JSON = "results.json"
RUN_CACHE = "compare.json"
CANDIDATE_FILE = "candidate.json"
"""A candidate's validation score, in its run directory, beside the resolved config it belongs to."""

T = TypeVar("T")


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
        methods: method sections (``{name: ..., options...}``) to compare; an entry may carry a ``prior``
            section (a two-stage run, see :class:`~flatbma.experiment.config.PriorConfig`), an ``optim``
            section (its keys override the shared ``optim``'s; a first stage without ``prior.optim``
            trains with it too), a ``label`` (its name in tables and plots) and lists of candidate
            values for scalar options and ``optim`` keys, chosen per seed on the validation split
            (:mod:`flatbma.experiment.selection`), and ``match_width`` (the label of an earlier entry
            whose posterior width this Gaussian one is measured at; module docstring).
        seeds: seeds; each (method, seed) is one run.
        corruptions: corruption names evaluated on the test set (``flatbma.data.corruption_names()``).
        severities: corruption severities in 1..5.
        corruption_samples: BMA samples on the corrupted test sets: the first ones of the run's
            ``eval.num_samples`` (``None``: all). Every corrupted copy costs a pass per sample, so on a
            CPU a smaller BMA there keeps the shift evaluation affordable; the clean test set always
            uses every sample.
        bma_curve: numbers of BMA samples M at which accuracy/NLL/ECE are also reported.
        flatness: measure Hessian spectra and distribution-level flatness.
        landscape: record a 1-D loss landscape of the posterior along a filter-normalized direction.
        reference: the label of the method every other one is compared with (paired differences over
            seeds and the report's findings, :func:`flatbma.experiment.report.findings`); ``None``: the
            first method. It only shapes the report, so it is not part of the results' fingerprint.
        pairs: further comparisons ``[a, b]`` of two method labels, each reported as the paired
            difference ``a − b`` over the seeds both ran, in addition to the reference's
            (:func:`flatbma.experiment.findings.pair_comparisons`). Like ``reference`` it only shapes the
            report: not part of the fingerprint, the study or a row's cache key, and left out of the
            recorded ``compare`` section when empty.
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
        seed: the seed.
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

        The method entries, seeds, ``reference`` and ``quick`` are left out, so a comparison that adds
        methods or seeds (or drops some) is the same study in the same ``output_dir``: its finished rows
        are reused and only the new ones train and are measured. The base's ``method``, ``seed`` and
        ``prior`` are each run's own (every run's resolved config is checked when it is reused).
        """
        base = {k: v for k, v in run_identity(self.base.to_dict()).items() if k not in _PER_RUN}
        return _digest({"base": base, "measure": _measurement(self.compare)})

    def row_key(self, job: Job) -> str:
        """The key of a row's cache (``compare.json``): the measurement settings and the row's label.

        A cached row is reused when its key matches and its run (or, for a selection, every candidate
        and the choice) is the same; the run's config itself is checked by :func:`_finished`.
        """
        return _digest({"measure": _measurement(self.compare), "label": job.label})


_PER_RUN = ("output_dir", "method", "seed", "prior")
"""Sections of the base config that every run sets for itself (not part of :meth:`Plan.study`)."""

_REPORT_ONLY = ("reference", "pairs")
"""Fields of the compare section that only shape the report (not part of :meth:`Plan.fingerprint`)."""

_ROWS = ("methods", "seeds", *_REPORT_ONLY, "quick")
"""Fields of the compare section that choose the rows rather than how each row is measured."""


def compare_record(compare: CompareConfig) -> dict[str, Any]:
    """The compare section as recorded in ``results.json`` and ``compare_config.yaml``.

    Its fields as plain values; ``pairs`` only when some are listed, so a comparison without pairs
    writes exactly what it wrote before they existed.
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


def label_of(method: Any) -> str:
    """The name of a ``compare.methods`` entry in tables and plots: its ``label``, else its method name."""
    if isinstance(method, dict):
        return str(method.get("label", method.get("name")))
    return str(method)


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
    _check_match_width(compare)
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
    return plan


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


def _check_match_width(compare: CompareConfig) -> None:
    """Refuse a ``match_width`` the comparison cannot honour (before anything trains; module docstring)."""
    earlier: dict[str, dict[str, Any]] = {}
    for i, entry in enumerate(compare.methods):
        target = entry.get(entries.MATCH_WIDTH)
        where = f"compare.methods[{i}] ({label_of(entry)!r}).match_width"
        if target is not None:
            if not isinstance(target, str):
                raise FlatbmaError(f"{where} must be the label of an earlier entry (a text), got {shown(target)}")
            name = entry.get("name")
            spec = METHODS.get(name) if isinstance(name, str) else None
            gaussians = ", ".join(n for n, m in METHODS.items() if m.gaussian)
            if spec is None or not spec.gaussian or entry.get("diagonal_only") is True:
                raise FlatbmaError(
                    f"{where}: method {entry.get('name')!r} has no low-rank plus diagonal Gaussian posterior to "
                    f"rescale; match_width works for {gaussians} (without diagonal_only)"
                )
            if target not in earlier:
                raise FlatbmaError(
                    f"{where} is {target!r}, which is not the label of an earlier entry"
                    f".{suggest(str(target), list(earlier))} Put the entry it is matched to first"
                )
            if earlier[target].get(entries.MATCH_WIDTH) is not None:
                raise FlatbmaError(
                    f"{where}: {target!r} is itself width-matched; match to an entry measured as trained"
                )
            if not compare.flatness:
                raise FlatbmaError(f"{where} needs the reference's measured width: set compare.flatness: true")
        earlier[label_of(entry)] = entry


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


# --------------------------------------------------------------------------------------------------
# the whole comparison


def _check_out_dir(plan: Plan, force: bool) -> None:
    check_compare_output(plan.out_dir, force=force)  # never /, ~ or a mount point; another's files only with --force
    recorded = plan.out_dir / COMPARE_CONFIG
    if recorded.exists() and not force:
        old = _read_cache(recorded, _recorded_config)
        same = old["study"] == plan.study() if "study" in old else old["fingerprint"] == plan.fingerprint()
        if not same:
            raise FlatbmaError(
                f"{plan.out_dir} holds the results of a compare config with other shared sections or measurement "
                "settings (methods and seeds may differ); choose another output_dir (--set output_dir=...) or pass "
                "--force to replace them"
            )


def run_compare(plan: Plan, *, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train and measure every (method, seed) not already finished; write results and reports.

    A (method, seed) with candidate lists takes two phases: first every candidate is trained (a
    finished one is reused) and scored on the validation split (:func:`_train_candidates`); then the
    best one is measured like any run (:func:`_run_selected`).

    Under ``torchrun`` (a process group of ``N`` processes, see :mod:`flatbma.experiment.distributed`)
    the work is spread, each piece as an ordinary single-process run: process ``r`` first trains the
    candidate groups ``r, r+N, r+2N, …`` (a group is one candidate, or the candidates that share a
    first stage), then, once every process has finished, does the (method, seed) rows ``r, r+N, …`` of
    :meth:`Plan.jobs` (methods outer, seeds inner). When all have finished, every process reads the
    other processes' rows from their caches (``compare.json``), so ``output_dir`` must be on a file
    system they share; rank 0 alone writes ``compare_config.yaml`` (first), ``results.json`` and the
    reports. Every process returns the same results.

    Width-matched rows (``match_width``, module docstring) need their reference's row: they are dealt
    out in a second round after every other row (a collective in between), then read it from its cache.

    Rank 0 holds the output directory's lock throughout and every process the lock of each run directory
    it works in (:func:`flatbma.experiment.lock.hold`). A row is reused only when its run is finished on
    the data as it is now (:func:`~flatbma.experiment.stage.finished_run`, the data set's
    :func:`~flatbma.experiment.build.data_fingerprint`) and its cache was measured from that run's
    checkpoint on that data (:func:`_fresh`); a changed data set trains the rows again.
    """
    with contextlib.ExitStack() as owned:  # rank 0 holds the output directory's lock throughout
        return _run_compare(plan, force, progress, owned)


def _run_compare(plan: Plan, force: bool, progress: bool, owned: contextlib.ExitStack) -> dict[str, Any]:
    me, world = distributed.rank(), distributed.world_size()
    fingerprint = plan.fingerprint()
    with distributed.all_or_none():  # rank 0 claims the output directory; an error stops every process
        plotting.check_available("flatbma compare's report figures")  # before hours of training, not after
        validate_runs(_every_run(plan), flatness=plan.compare.flatness)  # every run's demands, before any trains
        if me == 0:
            _check_out_dir(plan, force)
            owned.enter_context(hold(plan.out_dir, "compare", every_process=False))  # one comparison at a time
            for folder in (plan.out_dir, plan.out_dir / "figures"):
                remove_stale_temps(folder)  # left by a killed write (the lock is held: nobody writes here)
            record = {
                "fingerprint": fingerprint,
                "study": plan.study(),
                "config": plan.raw,
                "compare": compare_record(plan.compare),
            }
            atomic_write_bytes(plan.out_dir / COMPARE_CONFIG, yaml.safe_dump(record, sort_keys=False).encode())

    data = data_fingerprint(load_data(plan.base.data))  # what every row trains and is measured on
    jobs = plan.jobs()
    groups = [(job, group) for job in jobs if job.selects for group in _shared_stages(job)]
    if groups:  # the same on every process
        with distributed.all_or_none(), distributed.single_process():  # each an ordinary one-process run
            for job, group in _progress(
                groups[me::world], "candidates", _describe_group, progress, me, world, kind=lambda item: item[0].label
            ):
                _train_candidates(job, group, force, data)
    own: dict[int, dict[str, Any]] = {}
    phases = (
        [k for k, j in enumerate(jobs) if j.match_width is None],
        [k for k, j in enumerate(jobs) if j.match_width],
    )
    # runs trained before a row's turn, which a row of the same config copies (_adopt): the selections'
    # candidates, and for a width-matched row every row of the first phase
    candidates = tuple(c.config for job in jobs if job.selects for c in job.candidates)
    first = candidates + tuple(c.config for k in phases[0] for c in jobs[k].candidates)
    for phase in phases:  # the same on every process
        if not phase:
            continue
        describe = lambda k: f"{jobs[k].label} seed {jobs[k].seed}"  # noqa: E731
        with distributed.all_or_none(), distributed.single_process():
            for k in _progress(
                phase[me::world], "compare", describe, progress, me, world, kind=lambda k: jobs[k].label
            ):
                job = jobs[k]
                width_to = _width_reference(job, jobs, plan)
                if job.selects:
                    own[k] = _run_selected(job, plan.compare, plan.row_key(job), force, data, width_to)
                else:
                    elsewhere = first if job.match_width else candidates
                    own[k] = _run_one(job, plan.compare, plan.row_key(job), force, data, width_to, elsewhere)
    rows = [own[k] if k in own else _cached_result(job.row_dir, plan.row_key(job)) for k, job in enumerate(jobs)]
    results = {
        "config_hash": fingerprint,
        "config": plan.raw,
        "compare": compare_record(plan.compare),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "runs": rows,
    }
    results["findings"] = report.findings(results)  # generated from the rows' numbers, quoted by README
    if me == 0:
        atomic_write_json(plan.out_dir / RESULTS_JSON, results)
        report.write_reports(results, plan.out_dir)
    return results


def _every_run(plan: Plan) -> Iterator[tuple[str, RunConfig]]:
    """``(where, config)`` of every run of the comparison: each entry × seed × candidate."""
    for job in plan.jobs():
        for cand in job.candidates:
            where = f"compare.methods entry {shown(job.label)}, seed {job.seed}"
            if cand.options:
                where += ", candidate " + ", ".join(f"{k}={shown(v)}" for k, v in cand.options.items())
            yield where, cand.config


def _progress(
    items: list[T],
    what: str,
    describe: Callable[[T], str],
    show: bool,
    me: int,
    world: int,
    kind: Callable[[T], str] = lambda item: "",
) -> Iterator[T]:
    """``items`` with a progress bar, or without a terminal (a log file, CI) one line on stderr per item done.

    ``me`` and ``world`` are the process's rank and the number of processes (only rank 0 shows a bar).
    Bar or lines as :func:`flatbma.progress.current` decides (none with ``--quiet``). Each line, and the
    bar, gives the time left from the measured cost of each ``kind`` of item (the method: :func:`_time_left`).
    """
    reporter = progress.current()
    # a bar shows this estimate in place of tqdm's, which assumes every item costs the same
    bar_format = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
    bar = reporter.bar(items, desc=what, enabled=show and me == 0, leave=True, bar_format=bar_format)
    took: dict[str, list[float]] = {}
    for i, item in enumerate(bar, 1):
        left = f"; {_time_left(took, [kind(x) for x in items[i - 1 :]])}" if took else ""
        bar.set_postfix_str(describe(item) + left, refresh=True)
        begun = time.perf_counter()
        yield item
        took.setdefault(kind(item), []).append(time.perf_counter() - begun)
        if show and bar.disable and not reporter.quiet:  # no bar here: a log, or a process other than rank 0
            print(
                f"{what}{f' (process {me})' if world > 1 else ''}: [{i}/{len(items)}] {describe(item)} "
                f"done in {took[kind(item)][-1]:.0f} s; {_time_left(took, [kind(x) for x in items[i:]])}",
                file=sys.stderr,
                flush=True,
            )


def _time_left(took: dict[str, list[float]], remaining: list[str]) -> str:
    """The time left, said: each remaining item costs the mean measured time of its kind (its method).

    A kind not yet measured is counted at the costliest kind measured so far (the methods differ by orders
    of magnitude: the cheapest one's time would promise far too little), and the line says so.
    """
    if not remaining:
        return "nothing left"
    cost = {k: sum(ts) / len(ts) for k, ts in took.items() if ts}
    costliest = max(cost.values(), default=0.0)
    left = sum(cost.get(k, costliest) for k in remaining)
    untimed = list(dict.fromkeys(k for k in remaining if k not in cost))
    text = f"about {left / 60:.1f} min left"
    if untimed:
        names = ", ".join(untimed)
        text += f" ({names} not yet timed: counted at the slowest so far)" if names else ""
    return text


def _cached_result(row_dir: Path, row_key: str) -> dict[str, Any]:
    """The row another process wrote into ``row_dir`` (its ``compare.json``)."""
    cached = _read_cache(row_dir / RUN_CACHE, _row_cache)
    if not isinstance(cached, dict) or cached.get("fingerprint") != row_key or "result" not in cached:
        raise FlatbmaError(
            f"{row_dir / RUN_CACHE} holds no result of this comparison although another process finished that "
            "run: put output_dir on a file system that every process shares"
        )
    return cached["result"]


def _read_cache(path: Path, check: Callable[[Any], bool]) -> Any:
    """What ``path`` (a file of an earlier compare) holds, or ``None`` if it does not exist.

    ``check`` says whether the content has the shape flatbma writes there. A file that cannot be read,
    is not JSON or YAML, or fails ``check`` is refused by name: a traceback later, or redoing its part
    without a word, would hide that the directory was damaged.
    """
    if not path.exists():
        return None
    try:
        text = path.read_text()
        content = load_yaml(text, str(path)) if path.suffix == ".yaml" else json.loads(text)
    except (OSError, ValueError, RecursionError, yaml.YAMLError) as e:  # ValueError: not JSON or UTF-8, a YAML bomb
        raise _damaged(path, str(e).splitlines()[0] if str(e).strip() else type(e).__name__) from None
    if not check(content):
        raise _damaged(path, "not what flatbma writes there")
    return content


def _damaged(path: Path, why: str) -> FlatbmaError:
    if path.name == COMPARE_CONFIG:  # without it the directory is no longer a compare directory (outdir module)
        way_out = "pass --force to start the comparison over in this directory, or choose another output_dir"
    else:
        way_out = "delete it (that part is redone), or pass --force to start the comparison over"
    return FlatbmaError(f"{path} is damaged ({why[:100]}): {way_out}")


def _recorded_config(content: Any) -> bool:
    return isinstance(content, dict) and isinstance(content.get("fingerprint"), str)


def _row_cache(content: Any) -> bool:
    """A ``compare.json``: the row key (:meth:`Plan.row_key`, as "fingerprint") and the row with its test metrics."""
    if not (isinstance(content, dict) and isinstance(content.get("fingerprint"), str)):
        return False
    row = content.get("result")
    if not (isinstance(row, dict) and isinstance(row.get("method"), str)):
        return False
    return all(_is_number(row.get(k)) for k in CLEAN_KEYS)


def _candidate_record(content: Any) -> bool:
    """A ``candidate.json``: the candidate's resolved config, its validation NLL, train time and error."""
    return (
        isinstance(content, dict)
        and isinstance(content.get("config"), dict)
        and (content.get("val_nll") is None or _is_number(content["val_nll"]))
        and (content.get("error") is None or isinstance(content["error"], str))
        and {"val_nll", "train_time_s", "error"} <= set(content)
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _train_metrics(run_dir: Path) -> dict[str, Any]:
    """The ``metrics.json`` of a finished run that compare reuses."""
    return _read_cache(run_dir / METRICS_FILE, lambda content: isinstance(content, dict)) or {}


def _finished(run_dir: Path, cfg: RunConfig, data: str | None = None) -> bool:
    """:func:`~flatbma.experiment.stage.finished_run` on the data of fingerprint ``data``.

    A damaged ``config.yaml`` or ``metrics.json`` in ``run_dir`` is refused by name first.
    """
    _read_cache(run_dir / CONFIG_FILE, lambda content: isinstance(content, dict))
    _train_metrics(run_dir)
    return finished_run(run_dir, cfg, data)


def _source(run_dir: Path, data: str) -> dict[str, Any]:
    """What a row measured in ``run_dir`` is computed from: its run's checkpoint (record) and the data set."""
    return {"checkpoint": checkpoint_record(checkpoint_metadata(run_dir / CHECKPOINT_FILE)), "data": data}


def _width_reference(job: Job, jobs: list[Job], plan: Plan) -> tuple[str, float] | None:
    """``(label, tr Σ_ref)`` of the row ``job`` is width-matched to (same seed, from its cache), or ``None``."""
    if job.match_width is None:
        return None
    ref = next(j for j in jobs if j.label == job.match_width and j.seed == job.seed)
    width = _cached_result(ref.row_dir, plan.row_key(ref)).get("width")
    if not isinstance(width, dict) or not isinstance(width.get("trace_cov"), (int, float)):
        raise FlatbmaError(
            f"the row of {ref.label!r} (seed {ref.seed}) has no measured width to match {job.label!r} to"
        )
    return ref.label, float(width["trace_cov"])


def _width_matched(
    exp: Experiment, state: State, label: str, trace_ref: float
) -> tuple[Experiment, State, dict[str, Any]]:
    """``exp`` and ``state`` with the Gaussian posterior's covariance scaled to ``tr Σ = trace_ref`` (module docstring).

    Returns the experiment measuring :func:`flatbma.posteriors.lowrank_vi.fixed` of the scaled ``θ``, its
    state and the row's ``width_matched`` record.
    """
    theta = exp.method.gaussian(state) if exp.method.gaussian is not None else None
    if theta is None:
        raise FlatbmaError(f"{exp.config.method.name} has no Gaussian posterior to rescale (match_width)")
    own = float(sum(v.to(torch.float64).sum() for v in gaussian.marginal_variance(theta).values()))
    if not (own > 0 and math.isfinite(own) and math.isfinite(trace_ref) and trace_ref > 0):
        raise FlatbmaError(f"match_width needs positive widths; got tr Σ = {own} here and {trace_ref} for {label!r}")
    factor = trace_ref / own
    posterior, scaled = lowrank_vi.fixed(gaussian.scale_covariance(theta, factor), state.buffers)
    posterior = dataclasses.replace(posterior, predict_mode=exp.method.predict_mode)
    record = {
        "to": label,
        "factor": factor,
        "reference_trace": trace_ref,
        "trained_trace": own,
        "sampler": "low-rank Gaussian sampler over the scaled θ (SWAG's sampler distribution)",
    }
    return dataclasses.replace(exp, method=posterior), scaled, record


def _fresh(cached: Any, row_key: str, width_to: tuple[str, float] | None, source: dict[str, Any]) -> bool:
    """Whether a cached row belongs to this comparison and, width-matched, to the reference's current width.

    It must also have been measured from ``source`` (:func:`_source`): the run's current checkpoint and the
    data set as it is now. Rows cached before flatbma recorded them lack the records and are taken as is.
    """
    if not (isinstance(cached, dict) and cached.get("fingerprint") == row_key and "result" in cached):
        return False
    if any(key in cached and cached[key] != value for key, value in source.items()):
        return False
    matched = cached["result"].get("width_matched")
    if width_to is None:
        return matched is None
    return isinstance(matched, dict) and (matched.get("to"), matched.get("reference_trace")) == width_to


def _run_one(
    job: Job,
    compare: CompareConfig,
    row_key: str,
    force: bool,
    data: str,
    width_to: tuple[str, float] | None = None,
    trained_elsewhere: tuple[RunConfig, ...] = (),
) -> dict[str, Any]:
    """The row of a (method, seed) with one candidate: train it (or reuse it) and measure it, holding its lock.

    ``data``: the fingerprint of the data set (:func:`~flatbma.experiment.build.data_fingerprint`); ``width_to``:
    ``(label, tr Σ_ref)`` of a width-matched row (:func:`_width_reference`). ``trained_elsewhere``: runs of
    the comparison trained before this row (the candidates of selections, the rows a width-matched row comes
    after); a finished one of the same config is copied in rather than trained again (:func:`_adopt`).
    """
    cfg = job.candidates[0].config
    run_dir = Path(cfg.output_dir)
    cache = run_dir / RUN_CACHE
    with hold(run_dir, "compare"):
        if not force:
            _adopt(cfg, trained_elsewhere, data)
        if not force and _finished(run_dir, cfg, data):
            cached = _read_cache(cache, _row_cache)
            if _fresh(cached, row_key, width_to, _source(run_dir, data)):
                return {**cached["result"], "run_dir": str(run_dir)}  # where the row is now (a comparison may move)
            train_metrics = _train_metrics(run_dir)
            exp, state = load_run(cfg)
        else:  # measure evaluates the BMA (and more); its clean-test metrics go into metrics.json below
            trained = train(cfg, force=True, evaluate=False)
            train_metrics, exp, state = trained.metrics, trained.experiment, trained.state
        result = _measured(job.label, cfg, exp, state, train_metrics, compare, width_to)
        result["selection"] = None
        atomic_write_json(cache, {"fingerprint": row_key, **_source(run_dir, data), "result": result})
    return result


ADOPTED_FROM = "adopted_from.txt"
"""In a run directory that :func:`_adopt` filled: the directory it was copied from."""


def _adopt(cfg: RunConfig, others: tuple[RunConfig, ...], data: str) -> None:
    """Copy into ``cfg``'s directory a finished run of the same config from ``others`` (a selection's candidate).

    Only into a directory that holds no checkpoint (nothing is overwritten). Each file is copied atomically,
    ``metrics.json`` — with the checkpoint, what makes the run count as finished — last, so an interrupted
    copy leaves no run that looks finished; the source is named in :data:`ADOPTED_FROM`.
    """
    run_dir = Path(cfg.output_dir)
    if (run_dir / CHECKPOINT_FILE).exists():
        return
    places = (Path(o.output_dir) for o in others)
    source = next((p for p in places if p != run_dir and _finished(p, cfg, data)), None)
    if source is None:
        return
    skip = (METRICS_FILE, CANDIDATE_FILE, RUN_CACHE, LOCK_FILE)  # metrics.json last; not the source's row or lock
    files = sorted(f for f in source.iterdir() if f.is_file() and f.name not in skip and not f.name.endswith(".tmp"))
    run_dir.mkdir(parents=True, exist_ok=True)
    for f in [*files, source / METRICS_FILE]:
        atomic_write_bytes(run_dir / f.name, f.read_bytes())
    atomic_write_bytes(run_dir / ADOPTED_FROM, f"{source}\n".encode())


def _measured(
    label: str,
    cfg: RunConfig,
    exp: Experiment,
    state: State,
    train_metrics: dict[str, Any],
    compare: CompareConfig,
    width_to: tuple[str, float] | None = None,
) -> dict[str, Any]:
    """The row of run ``cfg``: :func:`~flatbma.experiment.evaluate.measure` on the test set (and more).

    With ``width_to = (label, tr Σ_ref)`` the Gaussian posterior is measured at that width
    (:func:`_width_matched`); the run directory's own metrics then stay those of the trained posterior.
    """
    matched = None
    if width_to is not None:
        exp, state, matched = _width_matched(exp, state, *width_to)
    run_dir = Path(cfg.output_dir)
    resolved = cfg.to_dict()
    result = {
        "method": label,
        "method_options": resolved["method"],
        "optim": resolved["optim"],
        "prior": cfg.prior.to_dict() if cfg.prior is not None else None,
        "seed": cfg.seed,
        "run_dir": str(run_dir),
        "train_time_s": train_metrics.get("train_time_s"),
        # KL(q_T || q_0) of a low-rank Gaussian run: whether training moved q (stage.train_stage)
        **({"kl_from_start": train_metrics["kl_from_start"]} if "kl_from_start" in train_metrics else {}),
        # how far the ascent moved q per step (step_stats), and the early-stopping record
        **{k: train_metrics[k] for k in ("step_stats", "early_stopping") if k in train_metrics},
        **measure(
            exp,
            state,
            bma_curve=compare.bma_curve,
            corruptions=compare.corruptions,
            severities=compare.severities,
            corruption_samples=compare.corruption_samples,
            flatness=compare.flatness,
            landscape=compare.landscape,
        ),
        "width_matched": matched,
    }
    result["health"] = assess(train_metrics.get("history"), result["health"])
    if matched is None and not all(k in train_metrics for k in CLEAN_KEYS):  # the run directory is complete on its own
        train_metrics.update({k: result[k] for k in CLEAN_KEYS}, num_samples=cfg.eval.num_samples)
        train_metrics["health"] = result["health"]
        atomic_write_json(run_dir / METRICS_FILE, train_metrics)
    warn_if_flagged(result["health"], f"{label} seed {cfg.seed} ({run_dir})")
    return result


# --------------------------------------------------------------------------------------------------
# hyperparameter selection on the validation split


def _shared_stages(job: Job) -> list[tuple[Candidate, ...]]:
    """The candidates of ``job`` grouped by their first stage: a group shares one (a one-stage candidate is alone)."""
    groups: dict[str, list[Candidate]] = {}
    for c in job.candidates:
        stage = prior_stage(c.config)
        groups.setdefault(c.config.output_dir if stage is None else _stage_key(stage), []).append(c)
    return [tuple(g) for g in groups.values()]


def _stage_key(stage: RunConfig) -> str:
    """Short hash of a first stage's resolved config (its directory aside): equal keys, the same run."""
    resolved = {k: v for k, v in stage.to_dict().items() if k != "output_dir"}
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()[:8]


def _describe_group(item: tuple[Job, tuple[Candidate, ...]]) -> str:
    job, group = item
    options = "; ".join(",".join(f"{k}={v}" for k, v in c.options.items()) for c in group)
    return f"{job.label} seed {job.seed} {options}"


def _unplaced(selection: Any) -> Any:
    """A row's selection record without its candidates' run directories (a comparison may move)."""
    if not isinstance(selection, dict) or not isinstance(selection.get("candidates"), list):
        return selection
    candidates = [
        {k: v for k, v in c.items() if k != "run_dir"} if isinstance(c, dict) else c for c in selection["candidates"]
    ]
    return {**selection, "candidates": candidates}


def _record(cfg: RunConfig, data: str | None = None) -> dict[str, Any] | None:
    """The validation record of candidate ``cfg`` (``candidate.json``) if it belongs to exactly this config.

    With ``data`` (the data set's fingerprint), also to the run's current checkpoint and that data
    (:func:`_source`; records written before flatbma recorded them are taken as is).
    """
    run_dir = Path(cfg.output_dir)
    record = _read_cache(run_dir / CANDIDATE_FILE, _candidate_record)
    resolved = json.loads(json.dumps(cfg.to_dict()))
    if not isinstance(record, dict) or run_identity(record.get("config")) != run_identity(resolved):
        return None
    if data is not None and any(record.get(k, v) != v for k, v in _source(run_dir, data).items()):
        return None
    if record.get("error") is None and not _finished(run_dir, cfg, data):
        return None
    return record


def _train_candidates(job: Job, group: tuple[Candidate, ...], force: bool, data: str) -> None:
    """Train (or reuse) the candidates of ``group`` and record each one's validation NLL in its ``candidate.json``.

    Nothing here reads the test set: training does not evaluate, and the score reads only the
    validation split (:func:`flatbma.experiment.selection.validation_nll`). A two-stage group trains its
    shared first stage once, into ``<row_dir>/prior-<hash of its config>`` (reused when finished). A
    candidate whose training diverges is recorded as such and not chosen. ``data`` is the data set's
    fingerprint; each candidate's run directory is worked in holding its lock.
    """
    fitted: FittedPrior | None = None
    stage_error: str | None = None
    for cand in group:
        cfg = cand.config
        run_dir = Path(cfg.output_dir)
        with hold(run_dir, "compare"):
            if not force and _record(cfg, data) is not None:
                continue
            try:
                if not force and _finished(run_dir, cfg, data):
                    exp, state = load_run(cfg)
                    train_time = _train_metrics(run_dir).get("train_time_s")
                else:
                    if cfg.prior is not None and fitted is None:
                        if stage_error is not None:
                            raise DivergenceError(stage_error)
                        try:
                            fitted = fit_prior(
                                cfg, force=force, run_dir=job.row_dir / f"prior-{_stage_key(prior_stage(cfg))}"
                            )
                        except DivergenceError as e:
                            stage_error = f"its first stage diverged: {e}"
                            raise DivergenceError(stage_error) from None
                    trained = train_stage(cfg, force=True, resume=False, evaluate=False, prior=fitted)
                    exp, state, train_time = trained.experiment, trained.state, trained.metrics.get("train_time_s")
                record = {"val_nll": selection.validation_nll(exp, state), "train_time_s": train_time, "error": None}
            except DivergenceError as e:
                record = {"val_nll": None, "train_time_s": None, "error": str(e)}
            atomic_write_json(run_dir / CANDIDATE_FILE, {"config": cfg.to_dict(), **_source(run_dir, data), **record})


def _run_selected(
    job: Job, compare: CompareConfig, row_key: str, force: bool, data: str, width_to: tuple[str, float] | None = None
) -> dict[str, Any]:
    """The row of a (method, seed) with candidates: the one with the best validation NLL, measured on the test set.

    Its run is read back from its directory (another process may have trained it) and measured by
    :func:`_measured` like a lone run, holding the locks of the row's and the run's directories;
    ``selection`` in the row records every candidate.
    """
    records = [_record(c.config, data) for c in job.candidates]
    missing = [c.config.output_dir for c, r in zip(job.candidates, records, strict=True) if r is None]
    if missing:
        raise FlatbmaError(
            f"{missing[0]} holds no validation score although its candidate was trained: put output_dir on a "
            "file system that every process shares"
        )
    scores = [r["val_nll"] for r in records]
    best = selection.choose(scores)
    if best is None:
        raise FlatbmaError(
            f"no candidate of {job.label} (seed {job.seed}) has a finite validation NLL "
            f"({records[0]['error'] or scores[0]}): change its candidate values (e.g. lower optim.lr)"
        )
    chosen = job.candidates[best]
    record = {
        "criterion": selection.CRITERION,
        "candidates": [
            {
                "options": c.options,
                "val_nll": r["val_nll"],
                "train_time_s": r["train_time_s"],
                "error": r["error"],
                "run_dir": c.config.output_dir,
            }
            for c, r in zip(job.candidates, records, strict=True)
        ],
        "chosen": chosen.options,
    }
    cache = job.row_dir / RUN_CACHE
    cfg = chosen.config
    run_dir = Path(cfg.output_dir)
    with hold(job.row_dir, "compare"), hold(run_dir, "compare"):
        cached = None if force else _read_cache(cache, _row_cache)
        if not force and _fresh(cached, row_key, width_to, _source(run_dir, data)):
            if _unplaced((cached.get("result") or {}).get("selection")) == _unplaced(json.loads(json.dumps(record))):
                return {**cached["result"], "run_dir": chosen.config.output_dir, "selection": record}
        exp, state = load_run(cfg)
        train_metrics = _train_metrics(run_dir)
        result = _measured(job.label, cfg, exp, state, train_metrics, compare, width_to)
        result["selection"] = record
        atomic_write_json(cache, {"fingerprint": row_key, **_source(run_dir, data), "result": result})
    return result
