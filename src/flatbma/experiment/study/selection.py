"""Hyperparameter selection on validation data: the score of ``flatbma compare``'s candidates and the choice.

A compare entry may list values for any scalar method option or ``optim`` key, e.g.
``{name: sam, rho: [0.01, 0.05, 0.1], optim: {lr: [0.01, 0.05]}}`` (docs/cli.md); every combination (the Cartesian
product, in the order written) is a *candidate*, an ordinary run. Per method and seed, the candidate whose BMA
predictive has the smallest validation NLL over the run's ``eval.num_samples`` posterior samples is chosen,

    NLL_val = −(1/N) Σᵢ log p(yᵢ | xᵢ),   log p(y | x) = logsumexp_m log softmax f(x; w_m)_y − log M,

and only it is evaluated on the test set, as in the methods' papers (SAM's ρ, Foret et al. 2021; FP-BMA's γ, Lim
et al. 2025). A list-typed option (a tuple annotation) is a value, never a grid; so is anything in ``prior``.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from flatbma.errors import DivergenceError, FlatbmaError
from flatbma.experiment.config.run_config import RunConfig, run_identity
from flatbma.experiment.run import evaluate
from flatbma.experiment.run.build import Experiment
from flatbma.experiment.run.checkpoint import write_sealed_json
from flatbma.experiment.run.lock import hold
from flatbma.experiment.run.pipeline import load_run
from flatbma.experiment.run.prior import FittedPrior, fit_prior, prior_stage
from flatbma.experiment.run.stage import train_stage
from flatbma.experiment.study.cache import (
    CANDIDATE_FILE,
    finished,
    is_candidate_record,
    read_cache,
    read_train_metrics,
    source,
)
from flatbma.experiment.study.plan import Candidate, Job
from flatbma.types import State

CRITERION = "val_nll"
"""The selection criterion recorded in ``results.json``: the BMA's NLL on the validation split."""


def validation_nll(exp: Experiment, state: State) -> float:
    """The validation NLL of the BMA of ``state``: :func:`~flatbma.experiment.run.evaluate.validation_nll`.

    Raises:
        FlatbmaError: the run has no validation split.
    """
    if exp.val_loader is None:
        raise FlatbmaError(
            "choosing among candidates needs a validation split: set data.k_shot and data.val_per_class > 0 "
            "or data.val_pool > 0 (or data.val_fraction without k_shot)"
        )
    return evaluate.validation_nll(exp, state)


def choose(scores: list[float | None]) -> int | None:
    """Index of the smallest finite score (the first on ties); ``None`` when no score is finite."""
    finite = [(s, i) for i, s in enumerate(scores) if s is not None and math.isfinite(s)]
    return min(finite)[1] if finite else None


# --------------------------------------------------------------------------------------------------
# training and scoring the candidates


def shared_stages(job: Job) -> list[tuple[Candidate, ...]]:
    """The candidates of ``job`` grouped by their first stage: a group shares one (a one-stage candidate is alone)."""
    groups: dict[str, list[Candidate]] = {}
    for c in job.candidates:
        stage = prior_stage(c.config)
        groups.setdefault(c.config.output_dir if stage is None else stage_key(stage), []).append(c)
    return [tuple(g) for g in groups.values()]


def stage_key(stage: RunConfig) -> str:
    """Short hash of a first stage's resolved config (its directory aside): equal keys, the same run."""
    resolved = {k: v for k, v in stage.to_dict().items() if k != "output_dir"}
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()[:8]


def describe_group(item: tuple[Job, tuple[Candidate, ...]]) -> str:
    """``<label> seed <s> <options>; <options>``: a group of candidates in the progress lines."""
    job, group = item
    options = "; ".join(",".join(f"{k}={v}" for k, v in c.options.items()) for c in group)
    return f"{job.label} seed {job.seed} {options}"


def unplaced(selection: Any) -> Any:
    """A row's selection record without its candidates' run directories (a comparison may move)."""
    if not isinstance(selection, dict) or not isinstance(selection.get("candidates"), list):
        return selection
    candidates = [
        {k: v for k, v in c.items() if k != "run_dir"} if isinstance(c, dict) else c for c in selection["candidates"]
    ]
    return {**selection, "candidates": candidates}


def candidate_record(cfg: RunConfig, data: str | None = None) -> dict[str, Any] | None:
    """The validation record of candidate ``cfg`` (``candidate.json``) if it belongs to exactly this config.

    With ``data`` (the data set's fingerprint), also to the run's current checkpoint and that data (:func:`source`).
    """
    run_dir = Path(cfg.output_dir)
    record = read_cache(run_dir / CANDIDATE_FILE, is_candidate_record, sealed=True)
    resolved = json.loads(json.dumps(cfg.to_dict()))
    if not isinstance(record, dict) or run_identity(record.get("config")) != run_identity(resolved):
        return None
    if data is not None and any(record.get(k) != v for k, v in source(run_dir, data).items()):
        return None
    if record.get("error") is None and not finished(run_dir, cfg, data):
        return None
    return record


def train_candidates(job: Job, group: tuple[Candidate, ...], force: bool, data: str) -> None:
    """Train (or reuse) the candidates of ``group`` and record each one's validation NLL in its ``candidate.json``.

    Nothing here reads the test set. A two-stage group trains its shared first stage once, into
    ``<row_dir>/prior-<hash of its config>`` (reused when finished). A candidate whose training diverges is
    recorded as such and never chosen. ``data``: the data set's fingerprint; each candidate's run directory is
    worked in holding its lock.
    """
    fitted: FittedPrior | None = None
    stage_error: str | None = None
    for cand in group:
        cfg = cand.config
        run_dir = Path(cfg.output_dir)
        with hold(run_dir, "compare"):
            if not force and candidate_record(cfg, data) is not None:
                continue
            try:
                if not force and finished(run_dir, cfg, data):
                    exp, state = load_run(cfg)
                    train_time = read_train_metrics(run_dir).get("train_time_s")
                else:
                    if cfg.prior is not None and fitted is None:
                        if stage_error is not None:
                            raise DivergenceError(stage_error)
                        try:
                            fitted = fit_prior(
                                cfg, force=force, run_dir=job.row_dir / f"prior-{stage_key(prior_stage(cfg))}"
                            )
                        except DivergenceError as e:
                            stage_error = f"its first stage diverged: {e}"
                            raise DivergenceError(stage_error) from None
                    trained = train_stage(cfg, force=True, resume=False, evaluate=False, prior=fitted)
                    exp, state, train_time = trained.experiment, trained.state, trained.metrics.get("train_time_s")
                record = {"val_nll": validation_nll(exp, state), "train_time_s": train_time, "error": None}
            except DivergenceError as e:
                record = {"val_nll": None, "train_time_s": None, "error": str(e)}
            write_sealed_json(run_dir / CANDIDATE_FILE, {"config": cfg.to_dict(), **source(run_dir, data), **record})
