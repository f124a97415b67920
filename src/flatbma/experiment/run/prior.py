"""Two-stage runs (a ``prior`` section): fit a Gaussian posterior on the target data, then train with it as prior.

The Bayesian transfer-learning pipeline of SA-BMA / FP-BMA (Lim et al., UAI 2025; docs/cli.md, "Two-stage runs"):
the first stage's low-rank plus diagonal Gaussian (``σ`` floored at ``prior.min_std``) becomes the second stage's
prior ``p`` in ``KL(q_θ ‖ p)`` and, with ``prior.init``, its start; a mixture's member ``m`` takes member ``m``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.run_config import RunConfig
from flatbma.experiment.parallel import processes
from flatbma.experiment.run.build import Experiment, Inputs, build_experiment
from flatbma.experiment.run.checkpoint import load_run_state
from flatbma.experiment.run.lock import hold
from flatbma.experiment.run.provenance import template
from flatbma.experiment.run.stage import CHECKPOINT_FILE, PRIOR_DIR, FittedPrior, finished_run, train_stage
from flatbma.posteriors import gaussians
from flatbma.prior import check_lr_with_prior, not_gaussian_message

__all__ = [
    "PRIOR_DIR",
    "FittedPrior",
    "check_stable_with_prior",
    "fit_prior",
    "prior_stage",
]


def prior_stage(cfg: RunConfig, run_dir: str | Path | None = None) -> RunConfig | None:
    """The run config of the first stage of a two-stage ``cfg`` (``None`` for a one-stage run).

    The stage shares the run's data, model, seed, training and evaluation settings (without flatness and early
    stopping) and trains ``prior.method`` (a mixture's: :meth:`~flatbma.methods.MethodConfig.first_stage`) for
    ``prior.epochs`` with ``prior.optim`` (or the run's optimizer) into ``run_dir`` (default
    ``<output_dir>/prior``). It is not evaluated.
    """
    p = cfg.prior
    if p is None:
        return None
    return dataclasses.replace(
        cfg,
        method=cfg.method.first_stage(p.method),
        prior=None,
        optim=p.optim or cfg.optim,
        train=dataclasses.replace(cfg.train, epochs=p.epochs, early_stopping=None),
        eval=dataclasses.replace(cfg.eval, flatness=False),
        output_dir=str(run_dir if run_dir is not None else Path(cfg.output_dir) / PRIOR_DIR),
    )


def fit_prior(
    cfg: RunConfig,
    *,
    force: bool = False,
    resume: bool = False,
    run_dir: str | Path | None = None,
    on_start: Callable[[], None] | None = None,
    inputs: Inputs | None = None,
) -> FittedPrior | None:
    """Train (or reuse, when it finished with the same config and data and not ``force``) the first stage of ``cfg``.

    Returns ``None`` for a one-stage run. The stage trains into ``run_dir`` (:func:`prior_stage`) holding its
    lock; with ``resume`` an unfinished one continues from its checkpoint; ``on_start``: as
    :func:`~flatbma.experiment.run.stage.train_stage`'s. Before it trains, its posterior must be a Gaussian and the
    run's learning rate stable with the prior (:func:`check_stable_with_prior`). ``inputs``: the run's data and
    network already built, and its logs checked.
    """
    stage = prior_stage(cfg, run_dir)
    if stage is None:
        return None

    def check(exp: Experiment) -> None:
        if exp.method.can.gaussian is None:  # an option turned the low-rank part off (e.g. SWAG's diagonal_only)
            raise FlatbmaError(not_gaussian_message(cfg.prior.method.name))
        check_stable_with_prior(cfg, len(exp.train_loader.dataset))

    run_dir = Path(stage.output_dir)
    with hold(run_dir, "train"):
        exp = None
        if processes.main_decides(not force and finished_run(run_dir, stage)):
            exp = build_experiment(stage, inputs=inputs)
            if not processes.main_decides(finished_run(run_dir, stage, data=exp.data_fingerprint)):
                exp = None  # finished on other data: the data set changed since, so it trains again
        if exp is not None:
            check(exp)
            state = load_run_state(run_dir / CHECKPOINT_FILE, template(exp))
        else:
            resumable = processes.main_decides(resume and (run_dir / CHECKPOINT_FILE).is_file())
            trained = train_stage(
                stage,
                force=True,
                resume=resumable,
                evaluate=False,  # `flatbma evaluate <output_dir>/prior` measures the first stage on its own
                check=check,  # before training
                on_start=on_start,
                inputs=inputs,
                checked=inputs is not None,  # this lock is held; the logs and the directory (force) are checked
            )
            exp, state = trained.experiment, trained.state
    theta = gaussians.floored(exp.method.can.gaussian(state), cfg.prior.min_std)
    return FittedPrior(theta=theta, buffers=dict(state.buffers), run_dir=run_dir)


def check_stable_with_prior(cfg: RunConfig, num_data: int) -> None:
    """:func:`check_lr_with_prior` of a two-stage run's ``prior`` section, ``optim`` and ``method``."""
    assert cfg.prior is not None
    check_lr_with_prior(cfg.prior, cfg.optim, cfg.method, num_data)
