"""A run: config → (the prior stage of a two-stage run) → its own stage → BMA evaluation → metrics.json.

The parts live below: assembling an experiment (:mod:`~flatbma.experiment.build`), training one
stage into its run directory (:mod:`~flatbma.experiment.stage`), the two-stage pipeline
(:mod:`~flatbma.experiment.prior`), evaluation (:mod:`~flatbma.experiment.evaluate`) and how
processes share a run (:mod:`~flatbma.experiment.distributed`). This module puts them together for
``flatbma train`` and ``flatbma evaluate``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from flatbma.errors import FlatbmaError
from flatbma.experiment import distributed
from flatbma.experiment.build import Experiment, build_experiment
from flatbma.experiment.checkpoint import (
    RESUMES_FILE,
    Resume,
    append_resume,
    atomic_write_json,
    config_changes,
    load_position,
    remove_stale_temps,
    resume_change,
    template,
)
from flatbma.experiment.config import RunConfig, config_from_dict, load_raw, parse_override
from flatbma.experiment.early_stopping import Monitor
from flatbma.experiment.evaluate import evaluate_state
from flatbma.experiment.health import assess, warn_if_flagged
from flatbma.experiment.logs import check_available
from flatbma.experiment.outdir import check_run_output
from flatbma.experiment.parse import set_dotted
from flatbma.experiment.prior import fit_prior, prior_stage
from flatbma.experiment.stage import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    METRICS_FILE,
    Trained,
    check_run_dir,
    train_stage,
    write_config,
)
from flatbma.experiment.validate import validate_run
from flatbma.types import State


def train(cfg: RunConfig, *, force: bool = False, resume: bool = False, evaluate: bool = True) -> Trained:
    """Train ``cfg`` into its output directory and write ``metrics.json``; return the trained stage.

    With ``resume``, continue from the directory's checkpoint exactly where it stopped (same data
    order, same random draws) instead of starting over. A two-stage run (``cfg.prior``) first fits
    its prior stage (:func:`~flatbma.experiment.prior.fit_prior`), then trains its method with that
    prior and, with ``prior.init``, from it. Without ``evaluate`` the BMA evaluation is left to the
    caller (``flatbma compare`` measures more, on the returned experiment and state).

    Data-parallel when a process group is initialized (``torchrun``, see
    :mod:`flatbma.experiment.distributed`): every rank trains on its shard of each global batch and
    only rank 0 writes files.
    With ``train.parallel: members`` every rank instead trains its share of the posterior's independent
    members on all the data (:class:`~flatbma.experiment.distributed.Members`).
    """
    run_dir = Path(cfg.output_dir)
    check_available(cfg.train.log)  # before a first stage trains or anything is written
    validate_run(cfg)  # what the config asks of the run's length and data, both stages, before anything is written
    if not resume:
        check_run_output(run_dir, force=force)  # never /, ~ or a mount point; another's files only with --force
        check_run_dir(run_dir, cfg.to_dict(), force)
        if cfg.prior is not None:  # `train --resume` finds the run (and its config) while stage 1 trains
            write_config(run_dir, cfg.to_dict())
    prior = fit_prior(cfg, force=force, resume=resume)
    if prior is not None and resume:  # interrupted in the first stage: the second starts afresh
        resume = distributed.main_decides((run_dir / CHECKPOINT_FILE).is_file())
        force = True
    return train_stage(cfg, force=force, resume=resume, evaluate=evaluate, prior=prior)


def train_run(
    cfg: RunConfig, *, force: bool = False, resume: bool = False, evaluate: bool = True
) -> tuple[Path, dict[str, Any]]:
    """:func:`train`, returning (run directory, metrics)."""
    trained = train(cfg, force=force, resume=resume, evaluate=evaluate)
    return Path(cfg.output_dir), trained.metrics


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The resolved config of a run directory."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise FlatbmaError(f"{run_dir} is not a run directory (no {CONFIG_FILE}); pass the output_dir of a run")
    cfg = config_from_dict(load_raw(run_dir / CONFIG_FILE))
    return dataclasses.replace(cfg, output_dir=str(run_dir))


def load_run(cfg: RunConfig) -> tuple[Experiment, State]:
    """The experiment of a finished run ``cfg`` and its trained state, read from its checkpoint.

    The state is the checkpoint's, or with ``train.early_stopping`` the best validation evaluation's
    (:meth:`~flatbma.experiment.early_stopping.Monitor.best`), as the run evaluated it. The experiment is built
    without the run's fitted prior: sampling and evaluation do not need it.
    """
    exp = build_experiment(cfg)
    kind = template(exp)
    state, _, history = load_position(Path(cfg.output_dir) / CHECKPOINT_FILE, kind)
    if cfg.train.early_stopping is not None:
        state = Monitor(exp, cfg.train.early_stopping, Path(cfg.output_dir)).best(state, history, kind)
    return exp, state


def resume_config(run_dir: str | Path, overrides: list[str]) -> tuple[RunConfig, Resume | None]:
    """The config ``flatbma train --resume RUN_DIR --set ...`` continues with, and its change (``None``: no ``--set``).

    A resume may change only :data:`~flatbma.experiment.checkpoint.RESUMABLE` keys
    (:func:`~flatbma.experiment.checkpoint.resume_change`), and in a two-stage run only keys its
    first stage does not share (the first stage is reused as it was trained).
    """
    cfg = load_run_config(run_dir)
    if not overrides:
        return cfg, None
    raw = load_raw(Path(run_dir) / CONFIG_FILE)
    old = config_from_dict(raw)
    for item in overrides:
        set_dotted(raw, *parse_override(item))
    new = config_from_dict(raw)
    resume = resume_change(Path(run_dir) / CHECKPOINT_FILE, old.to_dict(), new.to_dict())
    shared = config_changes(prior_stage(old).to_dict(), prior_stage(new).to_dict()) if old.prior else {}
    if shared:
        raise FlatbmaError(
            f"--resume cannot change {', '.join(shared)} of this two-stage run: its first stage shares "
            f"{'it' if len(shared) == 1 else 'them'} and is reused as trained; train a new run (a prior.optim "
            "section gives the first stage an optimizer of its own)"
        )
    return dataclasses.replace(new, output_dir=str(run_dir)), resume


def record_resume(run_dir: str | Path, resume: Resume) -> None:
    """Write a resume's changed ``config.yaml`` and append the change to the run's ``resumes.json`` (rank 0)."""
    if resume.changed and distributed.is_main():
        write_config(Path(run_dir), dict(resume.resolved))
        append_resume(Path(run_dir) / RESUMES_FILE, resume)


def evaluate_run(run_dir: str | Path, *, flatness: bool = False) -> dict[str, Any]:
    """Re-evaluate a finished run from its directory (config + checkpoint) and update metrics.json."""
    run_dir = Path(run_dir)
    exp, state = load_run(load_run_config(run_dir))
    if distributed.is_main():
        remove_stale_temps(run_dir)  # left by a killed write
    metrics_path = run_dir / METRICS_FILE
    try:
        metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    except ValueError:
        metrics = None
    if not isinstance(metrics, dict):
        raise FlatbmaError(f"{metrics_path} is damaged (not a JSON object): delete it and evaluate again")
    metrics.update(evaluate_state(exp, state, flatness=flatness))
    metrics["health"] = assess(metrics.get("history"), metrics["health"])
    if distributed.is_main():
        atomic_write_json(metrics_path, metrics)
        warn_if_flagged(metrics["health"], f"the run in {run_dir}")  # once its metrics are kept
    return metrics
