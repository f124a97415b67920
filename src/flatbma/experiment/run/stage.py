"""One stage of a run: a config trained into its run directory — build, start or resume, the one loop, metrics.

A run directory holds the resolved ``config.yaml``, ``checkpoint.safetensors`` (the state with its loop
position) and ``metrics.json`` (with the record of the checkpoint it was computed from). A stage trains holding
the directory's lock and writes nothing before its first checkpoint (:func:`start_run`); a run is finished only as
:func:`finished_run` says (what a crash leaves: docs/reliability.md). A two-stage run
(:mod:`flatbma.experiment.run.prior`) trains its first stage into ``<output_dir>/prior``, then its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from flatbma import progress, training
from flatbma.errors import DivergenceError, FlatbmaError
from flatbma.experiment.config.parse import shown
from flatbma.experiment.config.run_config import RunConfig, run_identity
from flatbma.experiment.parallel import processes
from flatbma.experiment.run.build import Experiment, Inputs, build_experiment
from flatbma.experiment.run.checkpoint import (
    CHECKPOINT_NAME,
    DATA_KEY,
    ENVIRONMENT_KEY,
    RunRecord,
    at_end,
    atomic_write_bytes,
    checkpoint_metadata,
    checkpoint_record,
    config_changes,
    config_record,
    history_of,
    json_config,
    load_position,
    position_text,
    remove_stale_temps,
    save_position,
    write_error,
    write_sealed_json,
)
from flatbma.experiment.run.early_stopping import Monitor, stopped
from flatbma.experiment.run.evaluate import evaluate_state
from flatbma.experiment.run.lock import hold
from flatbma.experiment.run.logs import CSV_FILE, EpochLogger, check_available, read_csv
from flatbma.experiment.run.provenance import environment, provenance, template
from flatbma.experiment.run.resume import RESUMES_FILE, Resume, append_resume
from flatbma.health import assess, warn_if_flagged
from flatbma.loop import History, Position
from flatbma.options import yaml_float
from flatbma.params import model_buffers, trainable_params
from flatbma.posteriors import gaussians
from flatbma.state_io import seal_problem
from flatbma.types import Params, State

CONFIG_FILE = "config.yaml"
CHECKPOINT_FILE = CHECKPOINT_NAME
METRICS_FILE = "metrics.json"
PRIOR_DIR = "prior"
"""Subdirectory of a two-stage run that holds its first stage (a run directory of its own)."""


def same_config(run_dir: Path, cfg: RunConfig) -> bool:
    """Whether ``run_dir``'s ``config.yaml`` holds ``cfg``'s config (:func:`run_identity`; a damaged one does not)."""
    try:
        stored = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
        return run_identity(stored) == run_identity(cfg.to_dict())
    except (OSError, ValueError, yaml.YAMLError):  # ValueError: not UTF-8 (a damaged file is not a finished run)
        return False


def finished_run(run_dir: Path, cfg: RunConfig, data: str | None = None) -> bool:
    """Whether :func:`unfinished` finds nothing wrong in ``run_dir`` (metadata only; loading checks the checkpoint)."""
    return unfinished(run_dir, cfg, data) is None


UNFINISHED = ("config", "checkpoint", "position", "edited", "data", "metrics")
"""What :func:`unfinished` may find, in the order it looks."""


def unfinished(run_dir: Path, cfg: RunConfig, data: str | None = None) -> tuple[str, str] | None:
    """``None`` when ``run_dir`` holds a finished run of ``cfg``, else ``(what, detail)`` of the first thing missing.

    Finished means all of its files agree with ``cfg`` and with each other:

    * ``"config"``: ``config.yaml`` holds ``cfg``'s config (:func:`same_config`);
    * ``"checkpoint"``: the checkpoint's metadata is readable (detail: ``"missing"`` or ``"unreadable"``);
    * ``"position"``: it stands at the end of ``cfg``'s training (:func:`training_ended`);
    * ``"edited"``: it records ``cfg``'s whole config (:class:`~flatbma.experiment.run.checkpoint.RunRecord`), so a
      hand-edited ``config.yaml`` is not this run (detail: the keys that differ, checkpoint vs ``config.yaml``);
    * ``"data"``: with ``data``, it recorded training on that data;
    * ``"metrics"``: ``metrics.json`` was written from that checkpoint (:func:`checkpoint_record`) and carries its
      seal (:func:`read_metrics`; detail: what is wrong with it).
    """
    if not same_config(run_dir, cfg):
        return "config", ""
    path = run_dir / CHECKPOINT_FILE
    meta = checkpoint_metadata(path)
    if meta is None:
        return "checkpoint", "unreadable" if os.path.lexists(path) else "missing"
    if not training_ended(meta, cfg):
        return "position", position_text(meta, cfg.epochs)
    recorded = config_record(meta)
    if recorded != json_config(run_identity(cfg.to_dict())):
        changes = config_changes(recorded or {}, json_config(run_identity(cfg.to_dict())))
        return "edited", ", ".join(f"{k}={shown(a, 20)} vs {shown(b, 20)}" for k, (a, b) in changes.items())
    if data is not None and meta.get(DATA_KEY) != data:
        return "data", f"{shown(meta.get(DATA_KEY), 20)} vs {data}"
    metrics, problem = read_metrics_checked(run_dir)
    if metrics is None:
        return "metrics", problem
    if metrics.get("checkpoint") != checkpoint_record(meta):
        return "metrics", "computed from another checkpoint"
    return None


def training_ended(meta: Mapping[str, str] | None, cfg: RunConfig) -> bool:
    """Whether the checkpoint of metadata ``meta`` ends ``cfg``'s training.

    At its last epoch (:func:`~flatbma.experiment.run.checkpoint.at_end`), or, with ``train.early_stopping``, at
    the end of an epoch after which its rule stopped training (:func:`flatbma.experiment.run.early_stopping.stopped`).
    """
    if at_end(meta, cfg.epochs):
        return True
    rule = cfg.train.early_stopping
    if rule is None or meta is None or meta.get("batch") != "0":
        return False
    history = history_of(meta)
    return history is not None and bool(history.epochs) and stopped(history, rule)


def read_metrics(run_dir: Path) -> dict[str, Any] | None:
    """``run_dir``'s ``metrics.json`` (``None`` when missing, unreadable, not a JSON object or its seal is broken)."""
    return read_metrics_checked(run_dir)[0]


def read_metrics_checked(run_dir: Path) -> tuple[dict[str, Any] | None, str]:
    """``(metrics, "")`` of ``run_dir``'s ``metrics.json`` (a JSON object, its seal intact), or ``(None, why not)``."""
    path = run_dir / METRICS_FILE
    if not os.path.lexists(path):
        return None, "missing"
    try:
        metrics = json.loads(path.read_text())
    except (OSError, ValueError):  # ValueError: not JSON, not UTF-8
        return None, "not JSON"
    if not isinstance(metrics, dict):
        return None, "not a JSON object"
    problem = seal_problem(metrics)
    return (None, problem) if problem else (metrics, "")


def start_run(run_dir: Path, resolved: dict[str, Any]) -> None:
    """Make ``run_dir`` the directory of a new run of ``resolved``, right before its first checkpoint (rank 0).

    The old run's checkpoint and ``metrics.json`` go first (and ``resumes.json`` when its config differs), then
    ``config.yaml`` is written: a config never sits beside another run's checkpoint, and a run that fails before
    its first checkpoint leaves the old one as it was.
    """
    if not processes.is_main():
        return
    other = not (run_dir / CONFIG_FILE).is_file() or run_identity(_read_config(run_dir)) != run_identity(resolved)
    stale = [METRICS_FILE, CHECKPOINT_FILE] + ([RESUMES_FILE] if other else [])
    try:
        for name in stale:
            (run_dir / name).unlink(missing_ok=True)
    except OSError as e:
        raise write_error(run_dir / name, e) from None
    write_config(run_dir, resolved)


def _read_config(run_dir: Path) -> Any:
    try:
        return yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None


def check_run_dir(run_dir: Path, resolved: dict[str, Any], force: bool) -> None:
    """Refuse a ``run_dir`` that holds a run of another config (unless ``force``)."""
    if (run_dir / CONFIG_FILE).is_file() and not force:
        if run_identity(_read_config(run_dir)) != run_identity(resolved):
            raise FlatbmaError(
                f"{run_dir} already holds a run with a different config; choose another output_dir "
                "(--set output_dir=...) or pass --force to overwrite it"
            )


def record_resume(run_dir: Path, resumed: Resume | None) -> None:
    """Write a resume's changed ``config.yaml`` and append the change to ``resumes.json`` (rank 0; nothing without one).

    Call it once every check of the resumed run has passed: a refused resume changes nothing on disk.
    """
    if resumed is not None and resumed.changed and processes.is_main():
        write_config(run_dir, dict(resumed.resolved))
        append_resume(run_dir / RESUMES_FILE, resumed)


def write_config(run_dir: Path, resolved: dict[str, Any]) -> None:
    """Write the resolved config into ``run_dir`` (rank 0 only: the other ranks write nothing)."""
    try:
        if processes.is_main():
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(run_dir / CONFIG_FILE, yaml.safe_dump(resolved, sort_keys=False).encode())
    except OSError as e:
        raise FlatbmaError(
            f"cannot write the run directory {run_dir} ({e.strerror}): choose another output_dir (--set output_dir=...)"
        ) from None


@dataclass(frozen=True)
class FittedPrior:
    """The first stage of a two-stage run, ready for the second (:func:`flatbma.experiment.run.prior.fit_prior`).

    Attributes:
        theta: the fitted Gaussian in low-rank VI's ``θ`` layout (:attr:`Capabilities.gaussian`), its ``σ``
            floored at ``prior.min_std``.
        buffers: the model buffers at the end of the first stage (BatchNorm statistics).
        run_dir: the first stage's run directory.
    """

    theta: Params
    buffers: Params
    run_dir: Path


@dataclass(frozen=True)
class Trained:
    """A trained stage: its experiment, final state and the metrics written to ``metrics.json``.

    ``reused``: the run was already finished in its directory and is returned as it was, nothing trained or written.
    """

    experiment: Experiment
    state: State
    metrics: dict[str, Any]
    reused: bool = False


def train_stage(
    cfg: RunConfig,
    *,
    force: bool,
    resume: bool,
    evaluate: bool,
    prior: FittedPrior | None = None,
    check: Callable[[Experiment], None] | None = None,
    on_start: Callable[[], None] | None = None,
    resumed: Resume | None = None,
    inputs: Inputs | None = None,
    checked: bool = False,
) -> Trained:
    """Train ``cfg`` into its output directory and write ``metrics.json``, holding the directory's lock.

    A fresh stage writes nothing before its first checkpoint, then replaces the directory's run (:func:`start_run`).
    A resumed stage continues only from a checkpoint of its own config (up to
    :data:`~flatbma.experiment.run.checkpoint.RESUMABLE` keys) and data.

    Args:
        cfg: the stage's config.
        force: overwrite a run directory that holds another config.
        resume: continue from the directory's checkpoint exactly where it stopped.
        evaluate: add the BMA evaluation (:func:`~flatbma.experiment.run.evaluate.evaluate_state`) to the metrics.
        prior: the fitted first stage: the method's prior and, with ``prior.init``, its start.
        check: called with the built experiment before anything is written or trained.
        on_start: called right before a fresh stage's first checkpoint.
        resumed: the change ``--resume --set`` made to the config, recorded (:func:`record_resume`) once checks pass.
        inputs: the run's data and network already read and built (:func:`~flatbma.experiment.run.build.prepare`).
        checked: the caller already holds the lock and checked the logs and the directory; not checked again.

    Raises:
        FlatbmaError: another process holds the directory (:func:`flatbma.experiment.run.lock.hold`), or the
            checkpoint to resume from is not this run's, or damaged.
    """
    with contextlib.nullcontext() if checked else hold(cfg.output_dir, "train"):
        return _train_stage(
            cfg,
            force=force,
            resume=resume,
            evaluate=evaluate,
            prior=prior,
            check=check,
            on_start=on_start,
            resumed=resumed,
            inputs=inputs,
            checked=checked,
        )


def _train_stage(
    cfg: RunConfig,
    *,
    force: bool,
    resume: bool,
    evaluate: bool,
    prior: FittedPrior | None,
    check: Callable[[Experiment], None] | None,
    on_start: Callable[[], None] | None,
    resumed: Resume | None = None,
    inputs: Inputs | None = None,
    checked: bool = False,
) -> Trained:
    run_dir = Path(cfg.output_dir)
    resolved = cfg.to_dict()
    if not checked:
        check_available(cfg.train.log)
        if not resume:
            check_run_dir(run_dir, resolved, force)
    exp = build_experiment(cfg, prior=prior.theta if prior is not None else None, inputs=inputs)
    if check is not None:
        check(exp)
    ckpt = run_dir / CHECKPOINT_FILE
    if processes.is_main():
        remove_stale_temps(run_dir)  # left by a killed write (the lock is held: no other process writes here)
    written_by = provenance(exp)  # recorded in every checkpoint, checked when it is loaded
    record = RunRecord(config=run_identity(resolved), data=exp.data_fingerprint, environment=environment(exp.device))
    position: Position | None = None
    history = History()
    if resume:
        state, position, history = load_position(ckpt, template(exp), continuing=record)
        if processes.is_main():  # every check passed: the run goes on under its config, recorded
            record_resume(run_dir, resumed)
            if config_record(checkpoint_metadata(ckpt)) != json_config(record.config):
                save_position(ckpt, state, position, history, written_by, record)  # the config it continues with
        position = exp.strategy.resume(position)
        with exp.rng.restored():  # the start as the interrupted run drew it, right after its build
            start_theta = gaussians.start(exp.method, _initial_state(cfg, exp, prior))
    else:
        state = _initial_state(cfg, exp, prior)
        start_theta = gaussians.start(exp.method, state)

    steps = len(exp.train_loader)
    if processes.is_main() and cfg.train.progress:
        done = f", resumed after epoch {len(history.epochs)}" if resume else ""
        progress.current().line(f"train: {cfg.method.name} into {run_dir}, {cfg.epochs} epochs of {steps} steps{done}")
    logger: EpochLogger | None = None
    logged = History(list(history.epochs))  # what the logs hold when the loop starts (fit appends to history)

    def save(s: State, p: Position, h: History) -> None:
        nonlocal logger
        first = logger is None
        if first and not resume:  # the directory becomes this run's only now, with its first checkpoint
            if on_start is not None:
                on_start()
            record_resume(run_dir, resumed)  # a two-stage run stopped in its first stage: before start_run
            start_run(run_dir, resolved)
        save_position(ckpt, s, p, h, written_by, record)
        if first:  # the one process that saves (with the history of all): it logs
            kinds, lines = cfg.train.log, cfg.train.progress
            logger = EpochLogger(
                run_dir,
                kinds,
                epochs=cfg.epochs,
                learning_rate=exp.learning_rate,
                history=logged,
                lines=lines,
                started=start,
                accuracy=cfg.model.likelihood.has_classes,  # regression targets have none
            )
        logger(h)  # after the checkpoint: the logs never run ahead of it

    monitor = Monitor(exp, cfg.train.early_stopping, run_dir) if cfg.train.early_stopping is not None else None
    method, state = exp.strategy.start(exp.method, state, cfg.method.name)
    start = time.perf_counter()
    report = progress.current() if cfg.train.progress and processes.is_main() else progress.Reporter(quiet=True)
    try:
        with report.phase("train", f"{cfg.method.name}, {progress.count(cfg.epochs, 'epoch')}"):  # 30 s at most silent
            state, history = training.train(
                method,
                state,
                exp.train_loader,
                model=exp.model,
                epochs=cfg.epochs,
                device=exp.device,
                resume=position,
                checkpoint=exp.strategy.checkpoint(save),
                checkpoint_every=cfg.train.checkpoint_every,
                progress=cfg.train.progress and processes.is_main(),
                history=history,
                after_epoch=monitor.after_epoch if monitor is not None else None,
                stop=monitor.stop if monitor is not None else None,
                regression=not cfg.model.likelihood.has_classes,
            )
    except DivergenceError as e:
        raise DivergenceError(_diverged(e, cfg, kept=logger is not None or resume), cause=e.cause) from None
    finally:
        if logger is not None:
            logger.close()
    train_time = time.perf_counter() - start
    state, history = exp.strategy.finish(state, history)
    if monitor is not None:  # the best validation evaluation's state is the run's result
        state = monitor.best(state, history, template(exp))
    metrics = evaluate_state(exp, state, flatness=cfg.eval.flatness) if evaluate else {}
    metrics.update(
        method=cfg.method.name,
        seed=cfg.seed,
        train_time_s=train_time,
        steps=state.step,
        history=[h.record() for h in history.epochs],
        environment=environment(exp.device),
    )
    if evaluate:  # the loss history and the BMA's fit to its training data (compare assesses its own rows)
        metrics["health"] = assess(metrics["history"], metrics.get("health"))
    if prior is not None:
        metrics["prior_run"] = str(prior.run_dir)
    if monitor is not None:
        metrics["early_stopping"] = monitor.record(history)
    if any(h.stats for h in history.epochs):  # e.g. how far FP-BMA's ascent moved q at each step
        metrics["step_stats"] = step_stats(history)
    if start_theta is not None:  # how far q moved: a flat-seeking step that barely changes q cannot matter
        metrics["kl_from_start"] = gaussians.kl_moved(exp.method, state, start_theta)  # a mixture's: the member mean
    metrics.update(exp.strategy.record())
    if processes.is_main():
        metrics["checkpoint"] = checkpoint_record(checkpoint_metadata(ckpt))  # what the metrics are of
        write_sealed_json(run_dir / METRICS_FILE, metrics, note=f"the checkpoint at step {state.step} is intact")
        if evaluate:
            advice = cfg.method.advice(cfg.prior is not None, metrics.get("diagnostics"))
            warn_if_flagged(metrics["health"], f"the run in {run_dir}", advice)  # once its metrics are kept
    return Trained(experiment=exp, state=state, metrics=metrics)


def _diverged(e: DivergenceError, cfg: RunConfig, *, kept: bool) -> str:
    """The one line of a run that diverged: what happened and what to change (``kept``: a checkpoint of it is there).

    Inputs that held NaN or inf name the data alone. Otherwise the settings that size a step
    (:meth:`~flatbma.methods.MethodConfig.divergence_advice`); the learning rate alone, when a
    resume may change it (in a two-stage run only with a ``prior.optim`` section), is changed by resuming.
    """
    if e.cause == "inputs":
        return str(e)
    run_dir = Path(cfg.output_dir)
    advice = cfg.method.divergence_advice(e.cause, cfg.optim.lr)
    lower = f"--set optim.lr={yaml_float(cfg.optim.lr / 10)}"
    resumable = cfg.prior is None or cfg.prior.optim is not None  # a resume may change the lr (of this stage only)
    if kept and resumable and not cfg.method.step_settings():
        return (
            f"{e}; the last checkpoint is kept: resume with 'flatbma train --resume {run_dir} {lower}' (if that "
            "diverges at once, train again with it)"
        )
    if kept:
        return f"{e}; {advice}, then train again"
    other = f" (the run that was in {run_dir} is left as it was)" if (run_dir / CHECKPOINT_FILE).exists() else ""
    return f"{e}; no checkpoint was written yet: {advice}, then train again{other}"


def step_stats(history: History) -> dict[str, dict[str, float]]:
    """Every step statistic of ``history`` (:attr:`EpochLog.stats`): the median, first and last of its epoch means."""
    names = dict.fromkeys(k for h in history.epochs for k in h.stats)
    out = {}
    for name in names:
        values = [h.stats[name] for h in history.epochs if name in h.stats]
        out[name] = {"median": float(np.median(values)), "first": values[0], "last": values[-1], "epochs": len(values)}
    return out


def training_record(exp: Experiment, state: State, meta: Mapping[str, str]) -> dict[str, Any]:
    """What a finished run's ``metrics.json`` records of its training, as its checkpoint and ``log.csv`` hold it.

    For ``flatbma evaluate`` to rebuild a lost ``metrics.json`` (docs/reliability.md, "Finished means finished");
    not restored: ``kl_from_start`` (it needs the starting posterior) and ``world_size``.
    """
    cfg, run_dir = exp.config, Path(exp.config.output_dir)
    history = history_of(meta) or History()
    out: dict[str, Any] = {
        "method": cfg.method.name,
        "seed": cfg.seed,
        "steps": state.step,
        "history": [h.record() for h in history.epochs],
    }
    try:
        out["environment"] = json.loads(meta[ENVIRONMENT_KEY])
    except (KeyError, ValueError):  # no record
        pass
    try:
        times = [row["time_s"] for row in read_csv(run_dir / CSV_FILE)]
    except (OSError, ValueError, KeyError):
        times = []
    if times and len(times) == len(history.epochs) and all(t is not None for t in times):
        out["train_time_s"] = float(sum(times))
    if cfg.prior is not None and (run_dir / PRIOR_DIR).is_dir():  # its own first stage (compare may share one)
        out["prior_run"] = str(run_dir / PRIOR_DIR)
    if cfg.train.early_stopping is not None:
        out["early_stopping"] = Monitor(exp, cfg.train.early_stopping, run_dir).record(history)
    if any(h.stats for h in history.epochs):
        out["step_stats"] = step_stats(history)
    return out


def _initial_state(cfg: RunConfig, exp: Experiment, prior: FittedPrior | None) -> State:
    """The method's fresh state: at the model's weights, or at the fitted prior's posterior (``prior.init``)."""
    at_prior = prior is not None and cfg.prior is not None and cfg.prior.init
    start = (prior.theta, prior.buffers) if at_prior else (trainable_params(exp.model), model_buffers(exp.model))
    try:
        return exp.method.init(*start)
    except FlatbmaError as e:
        if not at_prior:
            raise
        raise FlatbmaError(
            f"{cfg.method.name} cannot start at the prior fitted in {prior.run_dir}: {e} — or let the first "
            "stage collect more snapshots (raise prior.epochs, lower prior.method.start_step or collect_every)"
        ) from None
