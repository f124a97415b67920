"""Everything a config demands of its run, checked against the data sizes before anything trains or is written.

Parsing checks each value on its own; this module checks what depends on the run's *shape* (its updates, training
and test examples), known once the data set is read (the checks: docs/cli.md). Each part of a config checks itself
given a :class:`RunShape` (a method through :attr:`~flatbma.family.Family.check`, the evaluation through
:meth:`~flatbma.experiment.config.sections.EvalConfig.check`); :func:`check_run` asks every stage of a run. Every
refusal is one :class:`~flatbma.errors.FlatbmaError` line naming the key, the numbers and the fix.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable

from flatbma.data import DatasetSplits
from flatbma.errors import FlatbmaError
from flatbma.experiment.config.run_config import RunConfig
from flatbma.experiment.config.sections import Parallel
from flatbma.experiment.parallel import processes, strategies
from flatbma.experiment.run.build import (
    Experiment,
    Inputs,
    build_network,
    load_data,
    resolve_device,
    select_data,
    transforms,
)
from flatbma.experiment.run.prior import check_stable_with_prior, prior_stage
from flatbma.family import RunShape, Stage, available_memory
from flatbma.ood import check_ood_data
from flatbma.options import plain

__all__ = ["available_memory", "check_evaluation", "check_run", "run_shape", "validate_run", "validate_runs"]


def run_shape(
    cfg: RunConfig, splits: DatasetSplits | None = None, *, trainable: bool = False, inputs: Inputs | None = None
) -> RunShape:
    """The shape of run ``cfg``: its examples drawn as its build draws them, its loader's length.

    ``splits``: the data set of ``cfg.data`` already read (:func:`~flatbma.experiment.run.build.load_data`; read
    here when ``None``); ``trainable``: also count the trained weights, which builds the network (on the CPU);
    ``inputs``: the run's data and network already built (:func:`~flatbma.experiment.run.build.prepare`).

    Raises:
        FlatbmaError: whatever the data selection refuses (a k-shot draw the data cannot give, ...).
    """
    if inputs is not None:
        data = inputs.data
    else:
        data = select_data(cfg, splits if splits is not None else load_data(cfg.data))
    strategy = strategies.strategy(cfg.train.parallel)
    loader = strategy.train_loader(data.train, cfg.data.batch_size, seed=cfg.seed)
    count = free = None
    if trainable:
        if inputs is not None:
            model = inputs.model
        else:
            _, eval_tf = transforms(cfg.data)
            model = build_network(cfg, data.train.with_transform(eval_tf))
        count = sum(p.numel() for p in model.parameters() if p.requires_grad)
        free = available_memory(resolve_device(cfg.train.device))
    return RunShape(
        steps_per_epoch=len(loader),
        num_train=len(data.train),
        num_test=len(data.test),
        num_trainable=count,
        num_classes=data.train.num_classes,
        pretrained=cfg.model.pretrained is not None,
        available_memory=free,
        channels=data.test.image_shape[0] if hasattr(data.test, "image_shape") else None,
    )


def _needs_trainable(cfg: RunConfig, flatness: bool) -> bool:
    """Whether a check needs the number of trained weights (``hessian_k > 1``, or the method's ``needs_weights``)."""
    return (flatness and cfg.eval.hessian_k > 1) or cfg.method.needs_weights()


def check_run(cfg: RunConfig, shape: RunShape, *, flatness: bool) -> None:
    """Check every stage of ``cfg`` against ``shape`` (module docstring); ``flatness``: the Hessian is measured.

    A two-stage run's first stage (:func:`~flatbma.experiment.run.prior.prior_stage`) trains ``prior.epochs`` on the
    same data and must leave the second what it needs; the run's learning rate must be stable with the fitted
    prior (:func:`~flatbma.experiment.run.prior.check_stable_with_prior`).
    """
    first = prior_stage(cfg)
    cfg.optim.check_length(cfg.train.epochs)
    if first is not None and cfg.prior is not None:
        where = "prior.optim" if cfg.prior.optim is not None else "optim"
        first.optim.check_length(first.train.epochs, where, "prior.epochs")
        # the prior.method section checks itself (a mixture's first stage trains it in every member, each step)
        cfg.prior.method.check(Stage(shape, first.train.epochs, "prior.epochs", "prior.method"))
        check_stable_with_prior(cfg, shape.num_train)
    cfg.method.check(Stage(shape, cfg.train.epochs))
    for option in cfg.method.on_validation():  # chosen after training in Python only (flatbma.fit_posterior)
        raise FlatbmaError(
            f"method.{option}: val (chosen on validation data after training) is available in Python "
            f"(flatbma.fit_posterior(..., val_loader=...)) but not yet in flatbma train: give method.{option} a "
            "value, or null"
        )
    cfg.eval.check(shape, flatness=flatness)
    check_early_stopping(cfg)


def check_early_stopping(cfg: RunConfig) -> None:
    """``train.early_stopping`` needs a validation split, one process per state, and a method without extra epochs."""
    if cfg.train.early_stopping is None:
        return
    if not cfg.data.validation:
        raise FlatbmaError(
            "train.early_stopping evaluates on a validation split, and the run has none: set data.k_shot with "
            "data.val_per_class > 0 (held out of the k-shot images) or data.val_pool > 0 (drawn from outside them), or "
            "data.val_fraction without k_shot"
        )
    if cfg.train.parallel is Parallel.MEMBERS:
        raise FlatbmaError(
            "train.early_stopping evaluates the whole posterior, but train.parallel: members splits its members "
            "over processes: use train.parallel: data, or no early stopping"
        )
    after = cfg.method.phases_after()
    if after:
        raise FlatbmaError(
            f"train.early_stopping stops the training epochs, but {cfg.method.name} takes "
            f"{cfg.method.extra_epochs()} more after them (its {', '.join(p.name for p in after)} pass over the "
            "weights of the last epoch), which early stopping would skip: remove train.early_stopping for this method"
        )


def validate_run(cfg: RunConfig, *, flatness: bool | None = None, inputs: Inputs | None = None) -> RunShape:
    """Check ``cfg`` before it trains (``flatbma train``); return its shape.

    ``flatness``: whether its flatness is measured (default ``eval.flatness``); ``inputs``: its data and network
    already built (:func:`~flatbma.experiment.run.build.prepare`).
    """
    flatness = cfg.eval.flatness if flatness is None else flatness
    shape = run_shape(cfg, trainable=_needs_trainable(cfg, flatness), inputs=inputs)
    check_run(cfg, shape, flatness=flatness)
    check_ood_data(cfg.eval.ood)
    return shape


def check_evaluation(exp: Experiment, *, flatness: bool) -> None:
    """Check what ``flatbma evaluate`` reads before it evaluates: the evaluation settings against the built run.

    ``eval.*`` (changeable since training by ``--resume --set`` or ``--ood``) is checked as ``flatbma train`` checks
    it (:meth:`~flatbma.experiment.config.sections.EvalConfig.check`).
    """
    cfg = exp.config
    shape = RunShape(
        steps_per_epoch=len(exp.train_loader),
        num_train=len(exp.train_loader.dataset),
        num_test=len(exp.test_loader.dataset),
        num_trainable=sum(p.numel() for p in exp.model.parameters() if p.requires_grad),
        num_classes=exp.num_classes,
        pretrained=cfg.model.pretrained is not None,
        channels=getattr(exp.test_loader.dataset, "image_shape", (None,))[0],
    )
    cfg.eval.check(shape, flatness=flatness)
    check_ood_data(cfg.eval.ood)


def validate_runs(runs: Iterable[tuple[str, RunConfig]], *, flatness: bool) -> None:
    """Check every ``(where, run)`` before the first one trains (``flatbma compare``), as one process each.

    The data set is read once per ``data`` section; a refusal names the run (``where``) first.
    """
    loaded: dict[str, DatasetSplits] = {}
    weights: dict[str, int] = {}
    readable: set[str | None] = set()  # eval.ood sets found readable
    with processes.single_process():  # each compared run is an ordinary one-process run
        for where, cfg in runs:
            try:
                data_key = json.dumps(plain(cfg.data), sort_keys=True, default=str)
                if data_key not in loaded:
                    loaded[data_key] = load_data(cfg.data)
                model_key = data_key + json.dumps(plain(cfg.model), sort_keys=True, default=str)
                trainable = _needs_trainable(cfg, flatness) and model_key not in weights
                shape = run_shape(cfg, loaded[data_key], trainable=trainable)
                if shape.num_trainable is not None:
                    weights[model_key] = shape.num_trainable
                elif model_key in weights:
                    shape = dataclasses.replace(shape, num_trainable=weights[model_key])
                check_run(cfg, shape, flatness=flatness)
                if cfg.eval.ood not in readable:
                    check_ood_data(cfg.eval.ood)
                    readable.add(cfg.eval.ood)
            except FlatbmaError as e:
                raise FlatbmaError(f"{where}: {e}") from None
