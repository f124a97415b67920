"""A run: config → (the prior stage of a two-stage run) → its own stage → BMA evaluation → metrics.json.

It puts ``build``, ``stage``, ``prior`` and ``evaluate`` together for ``flatbma train`` and ``flatbma evaluate``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.parse import set_dotted
from flatbma.experiment.config.run_config import (
    RunConfig,
    config_from_dict,
    load_raw,
    missing_options,
    parse_override,
    run_identity,
)
from flatbma.experiment.parallel import processes
from flatbma.experiment.run.build import Experiment, Inputs, build_experiment, prepare
from flatbma.experiment.run.checkpoint import (
    RunRecord,
    at_end,
    checkpoint_metadata,
    checkpoint_record,
    config_changes,
    load_position,
    position_text,
    remove_stale_temps,
    write_sealed_json,
)
from flatbma.experiment.run.early_stopping import Monitor
from flatbma.experiment.run.evaluate import evaluate_state
from flatbma.experiment.run.lock import hold
from flatbma.experiment.run.logs import check_available
from flatbma.experiment.run.outdir import check_run_output
from flatbma.experiment.run.prior import fit_prior, prior_stage
from flatbma.experiment.run.provenance import template
from flatbma.experiment.run.resume import Resume, resume_change
from flatbma.experiment.run.stage import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    METRICS_FILE,
    Trained,
    check_run_dir,
    finished_run,
    read_metrics,
    read_metrics_checked,
    same_config,
    start_run,
    train_stage,
    training_ended,
    training_record,
    unfinished,
)
from flatbma.experiment.run.validate import check_evaluation, validate_run
from flatbma.health import assess, warn_if_flagged
from flatbma.state_io import check_replaceable, clip
from flatbma.types import State


def train(
    cfg: RunConfig,
    *,
    force: bool = False,
    resume: bool = False,
    evaluate: bool = True,
    resumed: Resume | None = None,
) -> Trained:
    """Train ``cfg`` into its output directory and write ``metrics.json``; return the trained stage.

    With ``resume``, continue from the directory's checkpoint exactly where it stopped; ``resumed``: the change
    ``--resume --set`` makes (:func:`resume_config`), written only once every check has passed. A two-stage run
    first fits its prior stage (:func:`~flatbma.experiment.run.prior.fit_prior`). Without ``evaluate`` the BMA
    evaluation is left to the caller.

    Holds the directory's lock throughout. Without ``resume`` and ``force``, this config's finished run is returned
    as it is (:attr:`Trained.reused`) and an interrupted one is refused with the ``--resume`` command that continues
    it; with ``force`` the old run is replaced only at the new one's first checkpoint. Under ``torchrun`` every rank
    trains its shard of each global batch (or its share of the members); only rank 0 writes files.
    """
    run_dir = Path(cfg.output_dir)
    check_available(cfg.train.log)  # before a first stage trains or anything is written
    inputs = prepare(cfg)  # the data read and the network built once, for the checks and both stages
    validate_run(cfg, inputs=inputs)  # what the config asks of the run's length and data, both stages
    if not resume:
        check_run_output(run_dir, force=force)  # never /, ~ or a mount point; another's files only with --force
    with hold(run_dir, "train"):
        if not resume:
            check_run_dir(run_dir, cfg.to_dict(), force)
            existing = None if force else _existing(cfg, inputs)
            if existing is not None:
                return existing
        # a two-stage run claims its directory (`train --resume` finds it) when its first stage starts
        start = lambda: start_run(run_dir, cfg.to_dict())  # noqa: E731
        prior = fit_prior(cfg, force=force, resume=resume, on_start=start, inputs=inputs)
        if prior is not None and resume:  # interrupted in the first stage: the second starts afresh
            resume = processes.main_decides((run_dir / CHECKPOINT_FILE).is_file())
            force = True
        stage = {"prior": prior, "resumed": resumed, "inputs": inputs}
        return train_stage(cfg, force=force, resume=resume, evaluate=evaluate, checked=True, **stage)


def _existing(cfg: RunConfig, inputs: Inputs | None = None) -> Trained | None:
    """The run of ``cfg`` its directory already holds: finished (returned as it is) or ``None`` when there is none.

    Raises:
        FlatbmaError: the directory holds this config's run interrupted (continue it with ``--resume``), finished
            on other data, or not as it was written (:func:`~flatbma.experiment.run.stage.unfinished`).
    """
    run_dir = Path(cfg.output_dir)
    if not processes.main_decides(same_config(run_dir, cfg)):
        return None
    found = unfinished(run_dir, cfg)
    if processes.main_decides(found is None):
        exp = build_experiment(cfg, inputs=inputs)
        if not processes.main_decides(finished_run(run_dir, cfg, data=exp.data_fingerprint)):
            raise FlatbmaError(
                f"{run_dir} holds this config's finished run, trained on other data (the data set changed since): "
                "pass --force to train it again on the data as it is now, or choose another output_dir"
            )
        metrics = read_metrics(run_dir) or {}
        if processes.is_main():  # reported again: a reused run is no less flagged
            advice = cfg.method.advice(cfg.prior is not None, metrics.get("diagnostics"))
            warn_if_flagged(metrics.get("health"), f"the run in {run_dir}", advice)
        return Trained(experiment=exp, state=trained_state(exp), metrics=metrics, reused=True)
    refusal = _not_as_written(run_dir, *found) if found is not None else None
    if processes.main_decides(refusal is not None):
        raise FlatbmaError(refusal or f"{run_dir} is not as its run wrote it (rank 0 says why)")
    stage = prior_stage(cfg)
    started = [(run_dir, cfg.epochs, "its checkpoint")]
    if stage is not None:
        started.append((Path(stage.output_dir), stage.epochs, "the checkpoint of its first stage"))
    for path, epochs, what in started:
        meta = checkpoint_metadata(path / CHECKPOINT_FILE)
        finished_stage = path != run_dir and at_end(meta, epochs)  # a finished first stage is reused as it is
        if processes.main_decides(meta is not None and not finished_stage):
            at = position_text(meta, epochs) if meta is not None else "a position"
            raise FlatbmaError(
                f"{run_dir} holds an interrupted run of this config ({what} stands at {at}): continue it with "
                f"'flatbma train --resume {run_dir}', or pass --force to train it again from the start"
            )
    return None


def _not_as_written(run_dir: Path, what: str, detail: str) -> str | None:
    """Why ``run_dir``, which holds this config's run, is not as that run wrote it (``None``: it is, or holds none).

    ``what`` and ``detail``: :func:`~flatbma.experiment.run.stage.unfinished`'s. A hand-edited ``config.yaml`` is not
    the run its checkpoint is, and a finished run whose checkpoint is gone is to be restored, not lost.
    """
    force = "or pass --force to train this config anew"
    kept = os.path.lexists(run_dir / METRICS_FILE)  # it finished once: start_run removes metrics.json first
    if what == "checkpoint" and (detail == "unreadable" or kept):
        held = "finished run" if kept else "run"
        return (
            f"{run_dir} holds this config's {held}, but its checkpoint is {detail} (truncated, deleted or damaged): "
            f"restore it from a copy, {force}"
        )
    if what == "edited":
        return (
            f"{run_dir}'s config.yaml is not the config its checkpoint was trained with ({clip(detail, 60)}; "
            f"checkpoint vs config.yaml): restore config.yaml, {force}"
        )
    if what == "metrics":
        state = "missing" if detail == "missing" else f"damaged ({detail})"
        return (
            f"{run_dir} holds this config's finished run, but its metrics.json is {state}: rebuild it with "
            f"'flatbma evaluate {run_dir}', or pass --force"
        )
    return None


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The resolved config of a run directory; a :class:`FlatbmaError` if an older flatbma wrote it.

    Its ``config.yaml`` must spell out every option (:func:`missing_options`): a default need not be what it trained
    with.
    """
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise FlatbmaError(f"{run_dir} is not a run directory (no {CONFIG_FILE}); pass the output_dir of a run")
    raw = load_raw(run_dir / CONFIG_FILE)
    cfg = config_from_dict(raw)
    missing = missing_options(raw, cfg.to_dict())
    if missing:
        raise FlatbmaError(
            f"{run_dir / CONFIG_FILE} was written by an older flatbma: it has no {', '.join(missing[:3])}"
            f"{' and more' if len(missing) > 3 else ''}, whose default may not be what it trained with; "
            "train the run again"
        )
    return dataclasses.replace(cfg, output_dir=str(run_dir))


def load_run(cfg: RunConfig) -> tuple[Experiment, State]:
    """The experiment of a finished run ``cfg`` (built without its fitted prior, not needed) and its trained state."""
    exp = build_experiment(cfg)
    return exp, trained_state(exp)


def trained_state(exp: Experiment) -> State:
    """The trained state of ``exp``'s finished run, read from its checkpoint (every check of its loading passed).

    The checkpoint's state, or with ``train.early_stopping`` the best validation evaluation's
    (:meth:`~flatbma.experiment.run.early_stopping.Monitor.best`): the state the run evaluated.
    """
    cfg, kind = exp.config, template(exp)
    written_with = RunRecord(config=run_identity(cfg.to_dict()), data=None)  # config.yaml is the checkpoint's config
    state, _, history = load_position(Path(cfg.output_dir) / CHECKPOINT_FILE, kind, continuing=written_with)
    if cfg.train.early_stopping is not None:
        state = Monitor(exp, cfg.train.early_stopping, Path(cfg.output_dir)).best(state, history, kind)
    return state


def resume_config(run_dir: str | Path, overrides: list[str]) -> tuple[RunConfig, Resume | None]:
    """The config ``flatbma train --resume RUN_DIR --set ...`` continues with, and its change (``None``: no ``--set``).

    It may change only :data:`~flatbma.experiment.run.checkpoint.RESUMABLE` keys
    (:func:`~flatbma.experiment.run.resume.resume_change`), and in a two-stage run only keys its first stage
    (reused as trained) does not share.
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


def evaluate_run(run_dir: str | Path, *, flatness: bool = False, ood: str | None = None) -> dict[str, Any]:
    """Re-evaluate a finished run from its directory (config + checkpoint) and update metrics.json.

    ``ood``: the OOD set (``eval.ood``, :mod:`flatbma.ood`) for this evaluation in place of the run's own (``None``
    keeps it); it changes no other number. Holds the directory's lock.

    Raises:
        FlatbmaError: another process holds the directory; the run is unfinished (continue it with
            ``train --resume``); the checkpoint is not this run's, or damaged; ``metrics.json`` is damaged.
    """
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    if ood is not None:
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, ood=ood))
    with hold(run_dir, "evaluate"):
        meta = checkpoint_metadata(run_dir / CHECKPOINT_FILE)
        if meta is not None and not training_ended(meta, cfg):
            raise FlatbmaError(
                f"{run_dir} is unfinished: its checkpoint stands at {position_text(meta, cfg.epochs)}; continue it "
                f"with 'flatbma train --resume {run_dir}' (evaluate reads finished runs)"
            )
        exp, state = load_run(cfg)
        check_evaluation(exp, flatness=flatness)  # eval.* as train checks them (n_bins against the test set, ...)
        if processes.is_main():
            remove_stale_temps(run_dir)  # left by a killed write (the lock is held: no other process writes here)
        metrics_path = run_dir / METRICS_FILE
        check_replaceable(metrics_path)  # before the evaluation, not after
        kept, problem = read_metrics_checked(run_dir)
        if kept is None and problem != "missing":
            raise FlatbmaError(
                f"{metrics_path} is damaged ({problem}): delete it and evaluate again (its training record is "
                "rebuilt from the checkpoint and log.csv)"
            )
        # what metrics.json lacks of the run's training (all of it when it was lost) from the checkpoint and log.csv
        metrics = {**training_record(exp, state, checkpoint_metadata(run_dir / CHECKPOINT_FILE) or {}), **(kept or {})}
        metrics.update(evaluate_state(exp, state, flatness=flatness))
        metrics["health"] = assess(metrics.get("history"), metrics["health"])
        metrics["checkpoint"] = checkpoint_record(meta)  # the checkpoint these metrics are of
        if processes.is_main():
            write_sealed_json(metrics_path, metrics)
            advice = cfg.method.advice(cfg.prior is not None, metrics.get("diagnostics"))
            warn_if_flagged(metrics["health"], f"the run in {run_dir}", advice)  # once its metrics are kept
    return metrics
