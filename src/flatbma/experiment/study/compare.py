"""``flatbma compare``: methods × seeds through the one runner, evaluated for calibration, shift and flatness.

A compare config is a run config plus a ``compare`` section listing what varies, e.g.
``compare: {methods: [{name: sgd}, {name: sam, rho: 0.05}], seeds: [0, 1, 2], reference: sgd}`` (every key,
candidate lists, ``match_width`` and ``pairs``: docs/cli.md). Each (method, seed) is an ordinary run directory
``OUT/runs/<method>/seed<s>`` (each candidate of an entry that lists values: ``.../cand-<options>``), trained by
:func:`flatbma.experiment.run.pipeline.train` and measured by :func:`flatbma.experiment.run.evaluate.measure`;
its measurements are cached beside it in ``compare.json`` with the hash of their config, so a rerun reuses
every finished (method, seed). The output directory records its compare config and refuses to mix in results
of a different one unless ``--force`` is given.

A row with candidates is the one with the best validation NLL, the only one measured on the test set. A ``match_width``
row is measured as ``N(μ, cΣ)`` with ``c = tr Σ_ref / tr Σ``. A candidate whose training diverges
(:class:`~flatbma.errors.DivergenceError`) gives a *failed row*, its identity and ``error`` without metrics, recorded in
:data:`ROW_ERROR` beside its run and reused by a rerun while the row key, config and source match (``--force`` trains it
again); a row width-matched to a failed row fails too. The report leaves failed rows out of every mean.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml

from flatbma import plotting, progress
from flatbma.errors import DivergenceError, FlatbmaError, FlatbmaWarning
from flatbma.experiment.config.parse import shown
from flatbma.experiment.config.run_config import RunConfig
from flatbma.experiment.parallel import processes
from flatbma.experiment.report import documents, findings
from flatbma.experiment.run.build import Experiment, data_fingerprint, load_data
from flatbma.experiment.run.checkpoint import (
    atomic_write_bytes,
    atomic_write_json,
    remove_stale_temps,
    verify_checkpoint,
    write_sealed_json,
)
from flatbma.experiment.run.evaluate import measure, metric_keys
from flatbma.experiment.run.lock import hold
from flatbma.experiment.run.outdir import check_compare_output
from flatbma.experiment.run.pipeline import load_run, train
from flatbma.experiment.run.provenance import environment
from flatbma.experiment.run.stage import CHECKPOINT_FILE, METRICS_FILE
from flatbma.experiment.run.validate import validate_runs
from flatbma.experiment.study import selection
from flatbma.experiment.study.cache import (
    COMPARE_CONFIG,
    RUN_CACHE,
    adopt,
    cached_result,
    finished,
    fresh,
    is_compare_config,
    is_row_cache,
    read_cache,
    read_train_metrics,
    source,
)
from flatbma.experiment.study.eta import TimeLeft, Work, row_work
from flatbma.experiment.study.plan import CompareConfig, Job, Plan, compare_record
from flatbma.experiment.study.width import width_matched
from flatbma.health import assess, warn_if_flagged
from flatbma.types import State

RESULTS_JSON = "results.json"
ROW_ERROR = "row_error.json"
"""A failed row's record in its directory: the row key, the run's config, its source and the error."""

T = TypeVar("T")


# --------------------------------------------------------------------------------------------------
# the whole comparison


def _check_out_dir(plan: Plan, force: bool) -> None:
    check_compare_output(plan.out_dir, force=force)  # never /, ~ or a mount point; another's files only with --force
    recorded = plan.out_dir / COMPARE_CONFIG
    if recorded.exists() and not force:
        old = read_cache(recorded, is_compare_config)
        same = old["study"] == plan.study() if "study" in old else old["fingerprint"] == plan.fingerprint()
        if not same:
            raise FlatbmaError(
                f"{plan.out_dir} holds the results of a compare config with other shared sections or measurement "
                "settings (methods and seeds may differ); choose another output_dir (--set output_dir=...) or pass "
                "--force to replace them"
            )


def run_compare(plan: Plan, *, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train and measure every (method, seed) not already finished; write results and reports.

    A (method, seed) with candidate lists first trains (or reuses) and scores every candidate on the validation
    split (:func:`~flatbma.experiment.study.selection.train_candidates`), then measures the best
    (:func:`_run_selected`). Width-matched rows run in a second round, after every other row.

    Under ``torchrun`` process ``r`` of ``N`` trains the candidate groups ``r, r+N, …`` (candidates sharing a first
    stage), then the rows ``r, r+N, …`` of :meth:`Plan.jobs`, each as a single-process run; every process then reads
    the others' rows from their caches and returns the same results, and rank 0 alone writes ``compare_config.yaml``
    (first), ``results.json`` and the reports (docs/distributed.md).

    Rank 0 holds the output directory's lock throughout, every process the lock of each run directory it works in. A row
    is reused only when its run finished on the current data (:func:`~flatbma.experiment.run.build.data_fingerprint`)
    and its cache was measured from that run's checkpoint (:func:`fresh`); a changed data set trains the rows again.
    """
    with contextlib.ExitStack() as owned:  # rank 0 holds the output directory's lock throughout
        return _run_compare(plan, force, progress, owned)


def _run_compare(plan: Plan, force: bool, progress: bool, owned: contextlib.ExitStack) -> dict[str, Any]:
    me, world = processes.rank(), processes.world_size()
    fingerprint = plan.fingerprint()
    with processes.all_or_none():  # rank 0 claims the output directory; an error stops every process
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
    groups = [(job, group) for job in jobs if job.selects for group in selection.shared_stages(job)]
    if groups:  # the same on every process
        with processes.all_or_none(), processes.single_process():  # each an ordinary one-process run
            for job, group in _progress(
                groups[me::world],
                "candidates",
                selection.describe_group,
                progress,
                me,
                world,
                kind=lambda item: item[0].label,
            ):
                selection.train_candidates(job, group, force, data)
    own: dict[int, dict[str, Any]] = {}
    phases = (
        [k for k, j in enumerate(jobs) if j.match_width is None],
        [k for k, j in enumerate(jobs) if j.match_width],
    )
    # runs trained before a row's turn, which a row of the same config copies (adopt): the selections'
    # candidates, and for a width-matched row every row of the first phase
    candidates = tuple(c.config for job in jobs if job.selects for c in job.candidates)
    first = candidates + tuple(c.config for k in phases[0] for c in jobs[k].candidates)
    for phase in phases:  # the same on every process
        if not phase:
            continue
        describe = lambda k: f"{jobs[k].label} seed {jobs[k].seed}"  # noqa: E731
        with processes.all_or_none(), processes.single_process():
            for k in _progress(
                phase[me::world],
                "compare",
                describe,
                progress,
                me,
                world,
                kind=lambda k: jobs[k].label,
                work=lambda k: row_work(jobs[k].candidates[0].config, plan.compare),
            ):
                job = jobs[k]
                width_to = _width_reference(job, jobs, plan)
                if isinstance(width_to, str):  # its reference row diverged: nothing to match the width to
                    own[k] = _failed_row(job.label, job.candidates[0].config, width_to)
                    with hold(job.row_dir, "compare"):
                        _record_failure(job.row_dir, plan.row_key(job), own[k], None, data, cause="width")
                    _warn_diverged(own[k], "not measured")
                elif job.selects:
                    own[k] = _run_selected(job, plan.compare, plan.row_key(job), force, data, width_to)
                else:
                    elsewhere = first if job.match_width else candidates
                    own[k] = _run_one(job, plan.compare, plan.row_key(job), force, data, width_to, elsewhere)
    rows = [own[k] if k in own else _stored_row(job, plan.row_key(job)) for k, job in enumerate(jobs)]
    results = {
        "config_hash": fingerprint,
        "config": plan.raw,
        "compare": compare_record(plan.compare),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "runs": rows,
    }
    measured = any("error" not in row for row in rows)
    # generated from the rows' numbers, quoted by README; none when every row diverged
    results["findings"] = findings.findings(results) if measured else None
    if me == 0:
        atomic_write_json(plan.out_dir / RESULTS_JSON, results)
        if measured:
            documents.write_reports(results, plan.out_dir)
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
    work: Callable[[T], Work] | None = None,
) -> Iterator[T]:
    """``items`` with a progress bar, or without a terminal (a log file, CI) one line on stderr per item done.

    ``me``/``world``: this process's rank and the process count (only rank 0 shows a bar; none with ``--quiet``).
    The time left: :class:`~flatbma.experiment.study.eta.TimeLeft`, learned from the items done (``kind``, ``work``).
    """
    reporter = progress.current()
    # a bar shows this estimate in place of tqdm's, which assumes every item costs the same
    bar_format = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
    bar = reporter.bar(items, desc=what, enabled=show and me == 0, leave=True, bar_format=bar_format)
    learned = TimeLeft()
    rows = [(kind(x), work(x) if work is not None else None) for x in items]
    for i, item in enumerate(bar, 1):
        left = f"; {learned.text(rows[i - 1 :])}" if learned.rows else ""
        bar.set_postfix_str(describe(item) + left, refresh=True)
        begun = time.perf_counter()
        with progress.collecting() as phases:
            yield item
        took = time.perf_counter() - begun
        measured = learned.add(rows[i - 1][0], took, phases, rows[i - 1][1])
        if show and bar.disable and not reporter.quiet:  # no bar here: a log, or a process other than rank 0
            print(
                f"{what}{f' (process {me})' if world > 1 else ''}: [{i}/{len(items)}] {describe(item)} "
                f"{f'done in {took:.0f} s' if measured else 'read from its cache'}; {learned.text(rows[i:])}",
                file=sys.stderr,
                flush=True,
            )


def _width_reference(job: Job, jobs: list[Job], plan: Plan) -> tuple[str, float] | str | None:
    """``(label, tr Σ_ref)`` of the row ``job`` is width-matched to (same seed, from its cache), or ``None``.

    A reference row that diverged (its ``row_error.json``) gives the reason instead (a text): the row is failed too.
    """
    if job.match_width is None:
        return None
    ref = next(j for j in jobs if j.label == job.match_width and j.seed == job.seed)
    row = _stored_row(ref, plan.row_key(ref))
    if "error" in row:
        return f"its width reference {ref.label} seed {ref.seed} diverged"
    width = row.get("width")
    if not isinstance(width, dict) or not isinstance(width.get("trace_cov"), (int, float)):
        raise FlatbmaError(
            f"the row of {ref.label!r} (seed {ref.seed}) has no measured width to match {job.label!r} to"
        )
    return ref.label, float(width["trace_cov"])


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

    ``data``: the data set's fingerprint; ``width_to``: ``(label, tr Σ_ref)`` of a width-matched row.
    ``trained_elsewhere``: runs trained earlier in the comparison; a finished one of the same config is copied in
    rather than trained again (:func:`adopt`).
    """
    cfg = job.candidates[0].config
    run_dir = Path(cfg.output_dir)
    cache = run_dir / RUN_CACHE
    with hold(run_dir, "compare"):
        if not force:
            adopt(cfg, trained_elsewhere, data)
        if not force and finished(run_dir, cfg, data):
            cached = read_cache(cache, is_row_cache, sealed=True)
            if fresh(cached, row_key, width_to, source(run_dir, data)):
                verify_checkpoint(run_dir / CHECKPOINT_FILE)  # the row's numbers are of an intact checkpoint
                (run_dir / ROW_ERROR).unlink(missing_ok=True)  # an earlier failure of this row is out of date
                return {**cached["result"], "run_dir": str(run_dir)}  # where the row is now (a comparison may move)
            train_metrics = read_train_metrics(run_dir)
            exp, state = load_run(cfg)
        else:  # measure evaluates the BMA (and more); its clean-test metrics go into metrics.json below
            failed = None if force else _reused_failure(run_dir, row_key, cfg, data)
            if failed is not None:
                _warn_diverged(failed, "reused; --force trains it again")
                return failed
            try:
                trained = train(cfg, force=True, evaluate=False)
            except DivergenceError as e:  # a failed row; the comparison goes on
                failed = _failed_row(job.label, cfg, str(e))
                _record_failure(run_dir, row_key, failed, cfg, data, cause="training")
                _warn_diverged(failed, f"recorded in {run_dir / ROW_ERROR}")
                return failed
            train_metrics, exp, state = trained.metrics, trained.experiment, trained.state
        result = _measured(job.label, cfg, exp, state, train_metrics, compare, width_to)
        result["selection"] = None
        write_sealed_json(cache, {"fingerprint": row_key, **source(run_dir, data), "result": result})
        (run_dir / ROW_ERROR).unlink(missing_ok=True)  # an earlier failure of this row is out of date
    return result


def _failed_row(label: str, cfg: RunConfig, error: str) -> dict[str, Any]:
    """The row of run ``cfg`` that has no numbers: its identity and ``error``, why it has none."""
    resolved = cfg.to_dict()
    return {
        "method": label,
        "method_options": resolved["method"],
        "optim": resolved["optim"],
        "prior": cfg.prior.to_dict() if cfg.prior is not None else None,
        "seed": cfg.seed,
        "run_dir": str(cfg.output_dir),
        "error": error,
    }


def _failure_source(run_dir: Path, cfg: RunConfig | None, data: str) -> dict[str, Any]:
    """What a failed row's record is checked against: the run's config (JSON form), its checkpoint and the data."""
    config = json.loads(json.dumps(cfg.to_dict(), default=str)) if cfg is not None else None
    return {"config": config, **source(run_dir, data)}


def _record_failure(
    row_dir: Path, row_key: str, row: dict[str, Any], cfg: RunConfig | None, data: str, *, cause: str
) -> None:
    """Write the failed ``row`` into ``row_dir``'s :data:`ROW_ERROR` (atomically), its cache stale."""
    record = {"fingerprint": row_key, "cause": cause, **_failure_source(row_dir, cfg, data), "result": row}
    write_sealed_json(row_dir / ROW_ERROR, record)


def _is_failure_record(content: Any) -> bool:
    """A ``row_error.json``: the row key, the cause and a row with a method name and its error."""
    row = content.get("result") if isinstance(content, dict) else None
    return (
        isinstance(row, dict)
        and isinstance(content.get("fingerprint"), str)
        and isinstance(row.get("method"), str)
        and isinstance(row.get("error"), str)
    )


def _reused_failure(run_dir: Path, row_key: str, cfg: RunConfig, data: str) -> dict[str, Any] | None:
    """The failed row recorded in ``run_dir`` by a training that diverged on this config and data, or ``None``."""
    record = read_cache(run_dir / ROW_ERROR, _is_failure_record, sealed=True)
    if record is None or record["fingerprint"] != row_key or record.get("cause") != "training":
        return None
    now = _failure_source(run_dir, cfg, data)
    if any(record.get(key) != value for key, value in now.items()):
        return None
    return {**record["result"], "run_dir": str(run_dir)}


def _stored_row(job: Job, row_key: str) -> dict[str, Any]:
    """The row another process (or an earlier turn) left in ``job.row_dir``: a failed row's record, else the cache."""
    record = read_cache(job.row_dir / ROW_ERROR, _is_failure_record, sealed=True)
    if record is not None and record["fingerprint"] == row_key:  # _run_one, _run_selected remove it
        return record["result"]
    return cached_result(job.row_dir, row_key)


def _warn_diverged(row: dict[str, Any], what: str) -> None:
    """One line on the command line: the row diverged and is left out of the numbers."""
    warnings.warn(
        f"{row['method']} seed {row['seed']} diverged ({row['error']}); a failed row, left out of the "
        f"report's means and paired differences ({what})",
        FlatbmaWarning,
        stacklevel=2,
    )


def _measured(
    label: str,
    cfg: RunConfig,
    exp: Experiment,
    state: State,
    train_metrics: dict[str, Any],
    compare: CompareConfig,
    width_to: tuple[str, float] | None = None,
) -> dict[str, Any]:
    """The row of run ``cfg``: :func:`~flatbma.experiment.run.evaluate.measure` on the test set (and more).

    With ``width_to = (label, tr Σ_ref)`` the Gaussian posterior is measured at that width
    (:func:`width_matched`); the run directory's own metrics then stay those of the trained posterior.
    """
    matched = None
    if width_to is not None:
        exp, state, matched = width_matched(exp, state, *width_to)
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
        "environment": environment(exp.device),  # where the row was measured (its run's: its metrics.json)
    }
    result["health"] = assess(train_metrics.get("history"), result["health"])
    keys = metric_keys(result)
    if matched is None and not all(k in train_metrics for k in keys):  # the run directory is complete on its own
        train_metrics.update({k: result[k] for k in keys}, num_samples=cfg.eval.num_samples)
        train_metrics["health"] = result["health"]
        write_sealed_json(run_dir / METRICS_FILE, train_metrics)
    advice = cfg.method.advice(cfg.prior is not None, result.get("diagnostics"))
    warn_if_flagged(result["health"], f"{label} seed {cfg.seed} ({run_dir})", advice)
    return result


# --------------------------------------------------------------------------------------------------
# hyperparameter selection on the validation split


def _run_selected(
    job: Job, compare: CompareConfig, row_key: str, force: bool, data: str, width_to: tuple[str, float] | None = None
) -> dict[str, Any]:
    """The row of a (method, seed) with candidates: the one with the best validation NLL, measured on the test set.

    Its run is read back from its directory (another process may have trained it) and measured like a lone run,
    holding the row's and the run's locks; ``selection`` in the row records every candidate.
    """
    records = [selection.candidate_record(c.config, data) for c in job.candidates]
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
        cached = None if force else read_cache(cache, is_row_cache, sealed=True)
        if not force and fresh(cached, row_key, width_to, source(run_dir, data)):
            verify_checkpoint(run_dir / CHECKPOINT_FILE)  # the row's numbers are of an intact checkpoint
            if selection.unplaced((cached.get("result") or {}).get("selection")) == selection.unplaced(
                json.loads(json.dumps(record))
            ):
                (job.row_dir / ROW_ERROR).unlink(missing_ok=True)  # an earlier failure of this row is out of date
                return {**cached["result"], "run_dir": chosen.config.output_dir, "selection": record}
        exp, state = load_run(cfg)
        train_metrics = read_train_metrics(run_dir)
        result = _measured(job.label, cfg, exp, state, train_metrics, compare, width_to)
        result["selection"] = record
        write_sealed_json(cache, {"fingerprint": row_key, **source(run_dir, data), "result": result})
        (job.row_dir / ROW_ERROR).unlink(missing_ok=True)  # an earlier failure of this row is out of date
    return result
