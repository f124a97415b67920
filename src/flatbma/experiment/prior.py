"""Two-stage runs (a ``prior`` section): fit a Gaussian posterior on the target data, then train with it as prior.

The Bayesian transfer-learning pipeline of SA-BMA / FP-BMA (Lim et al., UAI 2025): the first stage
(e.g. SWAG) trains into ``<output_dir>/prior`` — a run directory of its own, reused when it has
finished with the same config — and its posterior, a low-rank plus diagonal Gaussian in ``θ``
layout with ``σ`` floored at ``prior.min_std``, becomes the second stage's prior ``p`` in
``KL(q_θ ‖ p)`` and, with ``prior.init``, its starting point. The section itself is parsed by
:mod:`flatbma.experiment.prior_config`; :func:`flatbma.experiment.run.train_run` runs both stages.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from flatbma.errors import FlatbmaError
from flatbma.experiment import distributed
from flatbma.experiment.build import Experiment, build_experiment
from flatbma.experiment.checkpoint import check_fits, load_state
from flatbma.experiment.config import RunConfig
from flatbma.experiment.prior_config import not_gaussian_message
from flatbma.experiment.sections import Optimizer
from flatbma.experiment.stage import CHECKPOINT_FILE, FittedPrior, finished_run, train_stage

PRIOR_DIR = "prior"
"""Subdirectory of a two-stage run that holds its first stage (a run directory of its own)."""

__all__ = ["PRIOR_DIR", "FittedPrior", "check_stable_with_prior", "fit_prior", "prior_stage"]


def prior_stage(cfg: RunConfig) -> RunConfig | None:
    """The run config of the first stage of a two-stage ``cfg`` (``None`` for a one-stage run).

    The stage shares the run's data, model, seed and evaluation settings (without flatness), trains
    ``prior.method`` for ``prior.epochs`` with ``prior.optim`` (or the run's optimizer) and writes to
    ``<output_dir>/prior``; it is not evaluated (``flatbma evaluate <output_dir>/prior`` does it).
    """
    p = cfg.prior
    if p is None:
        return None
    return dataclasses.replace(
        cfg,
        method=p.method,
        prior=None,
        optim=p.optim or cfg.optim,
        train=dataclasses.replace(cfg.train, epochs=p.epochs),
        eval=dataclasses.replace(cfg.eval, flatness=False),
        output_dir=str(Path(cfg.output_dir) / PRIOR_DIR),
    )


def fit_prior(cfg: RunConfig, *, force: bool = False, resume: bool = False) -> FittedPrior | None:
    """Train (or reuse, when it finished with the same config and not ``force``) the first stage of ``cfg``.

    Returns ``None`` for a one-stage run. With ``resume`` an unfinished first stage continues from its
    checkpoint. Under ``torchrun`` rank 0 decides whether to reuse, so every rank does the same.
    Before the stage trains, its posterior must be a Gaussian and the run's learning rate stable
    with the prior (:func:`check_stable_with_prior`).
    """
    stage = prior_stage(cfg)
    if stage is None:
        return None

    def check(exp: Experiment) -> None:
        if exp.method.gaussian is None:  # an option turned the low-rank part off (e.g. SWAG's diagonal_only)
            raise FlatbmaError(not_gaussian_message(stage.method.name))
        check_stable_with_prior(cfg, len(exp.train_loader.dataset))

    run_dir = Path(stage.output_dir)
    if distributed.main_decides(not force and finished_run(run_dir, stage.to_dict())):
        exp = build_experiment(stage)
        check(exp)
        state = load_state(run_dir / CHECKPOINT_FILE, device=str(exp.device))
        check_fits(state, exp.method, exp.model, run_dir / CHECKPOINT_FILE, device=exp.device)
    else:
        resumable = distributed.main_decides(resume and (run_dir / CHECKPOINT_FILE).is_file())
        trained = train_stage(
            stage,
            force=True,
            resume=resumable,
            evaluate=False,  # `flatbma evaluate <output_dir>/prior` measures the first stage on its own
            check=check,  # before training
        )
        exp, state = trained.experiment, trained.state
    theta = exp.method.gaussian(state)
    floor = math.log(cfg.prior.min_std)
    theta = {k: v.clamp_min(floor) if k.startswith("log_std/") else v for k, v in theta.items()}
    return FittedPrior(theta=theta, buffers=dict(state.buffers), run_dir=run_dir)


def check_stable_with_prior(cfg: RunConfig, num_data: int) -> None:
    """Refuse an SGD learning rate that the KL to the fitted prior makes diverge (before stage 1 trains).

    ``κ KL(q ‖ p)/n`` has curvature ``κ/(n σ²)`` in ``μ`` along a weight whose prior ``σ`` sits at the
    floor ``prior.min_std``; gradient descent on it diverges for ``lr > 2nσ²/κ`` (Adam's normalized steps
    do not). ``κ`` is the method's resolved ``kl_weight`` option.
    """
    assert cfg.prior is not None
    kl_weight = float(cfg.method.options["kl_weight"])
    bound = 2 * num_data * cfg.prior.min_std**2 / kl_weight if kl_weight > 0 else math.inf
    if cfg.optim.name is Optimizer.SGD and cfg.optim.lr > bound:
        raise FlatbmaError(
            f"optim.lr={cfg.optim.lr:g} is above {bound:.3g} = 2·n·prior.min_std²/kl_weight (n={num_data}), where "
            "SGD on the KL to the fitted prior diverges: lower optim.lr, raise prior.min_std, or use optim.name=adam"
        )
