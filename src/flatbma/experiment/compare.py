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
      quick: {methods: [sgd, sam], seeds: [0], set: [train.epochs=2]}

Each (method, seed) is an ordinary run directory under ``OUT/runs/<method>/seed<s>`` (trained with
:func:`flatbma.experiment.run.train` and measured, on the experiment and state it just trained, by
:func:`flatbma.experiment.evaluate.measure`); its comparison measurements are cached beside it in
``compare.json`` together with the hash of the config that produced them, so a rerun skips every
finished (method, seed) and reuses it. The output directory records its compare config and refuses
to mix results of a different one unless ``--force`` is given. Under ``torchrun`` the runs are
spread over the processes (:func:`run_compare`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from flatbma.data.corruptions import corruption_names
from flatbma.errors import FlatbmaError, suggest
from flatbma.experiment import distributed, report
from flatbma.experiment.checkpoint import atomic_write_bytes, atomic_write_json
from flatbma.experiment.config import RunConfig, config_from_dict, load_raw, parse_override
from flatbma.experiment.evaluate import CLEAN_KEYS, measure
from flatbma.experiment.parse import parse_dataclass, set_dotted
from flatbma.experiment.run import load_run, train
from flatbma.experiment.stage import METRICS_FILE, finished_run

COMPARE_CONFIG = "compare_config.yaml"
RESULTS_JSON = "results.json"
RUN_CACHE = "compare.json"


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
            section (a two-stage run, see :class:`~flatbma.experiment.config.PriorConfig`).
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
    quick: QuickConfig = field(default_factory=QuickConfig)

    def __post_init__(self) -> None:
        if not self.methods:
            raise FlatbmaError("compare.methods is empty: list the methods to compare, e.g. [{name: sgd}, {name: sam}]")
        if not self.seeds:
            raise FlatbmaError("compare.seeds is empty: give at least one seed, e.g. [0, 1, 2]")
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
                    f"unknown corruption {unknown[0]!r}.{suggest(unknown[0], corruption_names())} "
                    f"Available: {', '.join(corruption_names())}"
                )


@dataclass(frozen=True)
class Plan:
    """A parsed compare: the shared run config, the compare section and the output directory."""

    base: RunConfig
    compare: CompareConfig
    raw: dict[str, Any]
    out_dir: Path

    def labels(self) -> list[str]:
        """The method label of every run of :meth:`runs`, in the same order."""
        return [label_of(method) for method in self.compare.methods for _ in self.compare.seeds]

    def runs(self) -> list[RunConfig]:
        """One run config per (method, seed), each with its own output directory."""
        out = []
        for method in self.compare.methods:
            for seed in self.compare.seeds:
                raw = json.loads(json.dumps(self.raw))
                raw.update(_run_sections(method))
                raw["seed"] = seed
                raw["output_dir"] = str(self.out_dir / "runs" / _slug(method) / f"seed{seed}")
                raw["eval"] = {**(raw.get("eval") or {}), "flatness": False}  # measured by the comparison itself
                out.append(config_from_dict(raw))
        return out

    def fingerprint(self) -> str:
        """Hash of everything that determines the results (not the output directory)."""
        payload = {
            "base": {k: v for k, v in self.base.to_dict().items() if k != "output_dir"},
            "compare": dataclasses.asdict(self.compare),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _run_sections(method: Any) -> dict[str, Any]:
    """The run config sections of one ``compare.methods`` entry.

    An entry is a method section; its optional ``prior`` key becomes the run's ``prior`` section (a
    two-stage run, e.g. ``{name: fp-bma, rank: 5, prior: {method: {name: swag, rank: 5}, epochs: 15}}``)
    and its optional ``label`` (the name in tables and plots) is not part of the run's config.
    """
    if not isinstance(method, dict):
        return {"method": method}
    method = {k: v for k, v in method.items() if k != "label"}
    if "prior" not in method:
        return {"method": method}
    return {"prior": method.pop("prior"), "method": method}


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
        if isinstance(raw.get("output_dir", ""), str):  # its own directory: a quick run never clashes with the full one
            raw["output_dir"] = raw.get("output_dir", RunConfig.__dataclass_fields__["output_dir"].default).rstrip("/")
            raw["output_dir"] += "-quick"
        for item in q.set:
            key, value = parse_override(item)
            set_dotted(raw, key, value)
        keep = set(q.methods)
        methods = tuple(m for m in compare.methods if not keep or {str(m.get("name")), label_of(m)} & keep)
        compare = dataclasses.replace(compare, methods=methods, seeds=q.seeds or compare.seeds)
    bad = [m["label"] for m in compare.methods if isinstance(m, dict) and not isinstance(m.get("label", ""), str)]
    if bad:
        raise FlatbmaError(f"compare.methods: a label is the row's display name, a text; got {bad[0]!r}")
    labels = [label_of(m) for m in compare.methods]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise FlatbmaError(
            f"compare.methods has several entries named {twice[0]!r}: give them distinct 'label' keys "
            "(e.g. label: fp-bma+swag-prior), the names their rows get in tables and plots"
        )
    raw.setdefault("method", _run_sections(compare.methods[0])["method"])
    base = config_from_dict(raw)
    for method in compare.methods:  # validate every method section up front
        config_from_dict({**raw, **_run_sections(method)})
    return Plan(base=base, compare=compare, raw=raw, out_dir=Path(base.output_dir))


# --------------------------------------------------------------------------------------------------
# the whole comparison


def _check_out_dir(plan: Plan, force: bool) -> None:
    recorded = plan.out_dir / COMPARE_CONFIG
    if recorded.is_file() and not force:
        old = yaml.safe_load(recorded.read_text()) or {}
        if old.get("fingerprint") != plan.fingerprint():
            raise FlatbmaError(
                f"{plan.out_dir} holds the results of a different compare config; choose another output_dir "
                "(--set output_dir=...) or pass --force to replace them"
            )


def run_compare(plan: Plan, *, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train and measure every (method, seed) not already finished; write results and reports.

    Under ``torchrun`` (a process group of ``N`` processes, see :mod:`flatbma.experiment.distributed`)
    the runs are spread: process ``r`` does runs ``r, r+N, r+2N, …`` of :meth:`Plan.runs` (methods
    outer, seeds inner) as ordinary single-process runs. When all have finished, every process reads
    the other processes' rows from their runs' caches (``compare.json``), so ``output_dir`` must be on
    a file system they share; rank 0 alone writes ``compare_config.yaml`` (first), ``results.json``
    and the reports. Every process returns the same results.
    """
    me, world = distributed.rank(), distributed.world_size()
    fingerprint = plan.fingerprint()
    with distributed.all_or_none():  # rank 0 claims the output directory; an error stops every process
        if me == 0:
            _check_out_dir(plan, force)
            plan.out_dir.mkdir(parents=True, exist_ok=True)
            record = {"fingerprint": fingerprint, "config": plan.raw, "compare": dataclasses.asdict(plan.compare)}
            atomic_write_bytes(plan.out_dir / COMPARE_CONFIG, yaml.safe_dump(record, sort_keys=False).encode())

    runs = list(zip(plan.labels(), plan.runs(), strict=True))
    mine = runs[me::world]
    own = []
    bar = tqdm(mine, desc="compare", disable=not progress or me > 0 or None, dynamic_ncols=True)
    start = time.perf_counter()
    with distributed.all_or_none(), distributed.single_process():  # each run is an ordinary one-process run
        for i, (label, cfg) in enumerate(bar, 1):
            bar.set_postfix(method=label, seed=cfg.seed, refresh=True)
            begun = time.perf_counter()
            own.append(_run_one(label, cfg, plan.compare, fingerprint, force))
            if progress and bar.disable:  # no terminal (a log file, CI): one line per run instead of the bar
                now = time.perf_counter()
                left = (now - start) / i * (len(mine) - i)
                print(
                    f"compare{f' (process {me})' if world > 1 else ''}: [{i}/{len(mine)}] {label} "
                    f"seed {cfg.seed} done in {now - begun:.0f} s; about {left / 60:.1f} min left",
                    file=sys.stderr,
                    flush=True,
                )
    rows = [own[k // world] if k % world == me else _cached_result(cfg, fingerprint) for k, (_, cfg) in enumerate(runs)]
    results = {
        "config_hash": fingerprint,
        "config": plan.raw,
        "compare": dataclasses.asdict(plan.compare),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "runs": rows,
    }
    if me == 0:
        atomic_write_json(plan.out_dir / RESULTS_JSON, results)
        report.write_reports(results, plan.out_dir)
    return results


def _cached_result(cfg: RunConfig, fingerprint: str) -> dict[str, Any]:
    """The row another process wrote for run ``cfg`` (its ``compare.json``)."""
    cache = Path(cfg.output_dir) / RUN_CACHE
    try:
        cached = json.loads(cache.read_text())
    except (OSError, ValueError):
        cached = None
    if not isinstance(cached, dict) or cached.get("fingerprint") != fingerprint or "result" not in cached:
        raise FlatbmaError(
            f"{cache} holds no result of this comparison although another process finished that run: "
            "put output_dir on a file system that every process shares"
        )
    return cached["result"]


def _run_one(label: str, cfg: RunConfig, compare: CompareConfig, fingerprint: str, force: bool) -> dict[str, Any]:
    run_dir = Path(cfg.output_dir)
    cache = run_dir / RUN_CACHE
    resolved = cfg.to_dict()
    if finished_run(run_dir, resolved) and not force:
        if cache.is_file():
            cached = json.loads(cache.read_text())
            if cached.get("fingerprint") == fingerprint:
                return cached["result"]
        train_metrics = json.loads((run_dir / METRICS_FILE).read_text())
        exp, state = load_run(cfg)
    else:  # measure evaluates the BMA (and more); its clean-test metrics go into metrics.json below
        trained = train(cfg, force=True, evaluate=False)
        train_metrics, exp, state = trained.metrics, trained.experiment, trained.state
    result = {
        "method": label,
        "method_options": resolved["method"],
        "prior": cfg.prior.to_dict() if cfg.prior is not None else None,
        "seed": cfg.seed,
        "run_dir": str(run_dir),
        "train_time_s": train_metrics.get("train_time_s"),
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
    }
    if not all(k in train_metrics for k in CLEAN_KEYS):  # the run directory is complete on its own
        train_metrics.update({k: result[k] for k in CLEAN_KEYS}, num_samples=cfg.eval.num_samples)
        atomic_write_json(run_dir / METRICS_FILE, train_metrics)
    atomic_write_json(cache, {"fingerprint": fingerprint, "result": result})
    return result
