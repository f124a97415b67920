"""A run: config → data, model, method → the one loop → checkpoint → BMA evaluation → metrics.json."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import platform
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch.utils.data import DataLoader

from flatbma.bn import recompute_bn_statistics
from flatbma.data import DATASETS, ArrayDataset, build_transform, few_shot_indices, load_dataset, stratified_split
from flatbma.errors import DivergenceError, FlatbmaError
from flatbma.experiment import distributed
from flatbma.experiment.checkpoint import (
    atomic_write_bytes,
    atomic_write_json,
    check_compatible,
    load_checkpoint,
    load_state,
    save_state,
)
from flatbma.experiment.config import DataConfig, RunConfig, config_from_dict, load_raw
from flatbma.experiment.parse import yaml_float
from flatbma.experiment.runner import EpochLog, History, Position, fit
from flatbma.flatness.lanczos import ConvergenceWarning
from flatbma.flatness.posterior import flatness_report
from flatbma.models import build_model
from flatbma.optim import SGD, Adam, constant, cosine
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.predict import evaluate
from flatbma.transfer import restrict_trainable, subset_names
from flatbma.types import Params, Posterior, State

CONFIG_FILE = "config.yaml"
CHECKPOINT_FILE = "checkpoint.safetensors"
METRICS_FILE = "metrics.json"


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 (seeds the legacy global generator users may rely on)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU; other names are checked."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise FlatbmaError(f"train.device {name!r} is not a device name (use auto, cpu, cuda, cuda:0, ...)") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise FlatbmaError(f"train.device {name!r}: flatbma trains on cpu, cuda or mps devices; use auto, cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FlatbmaError(f"train.device is {name!r} but CUDA is not available here: use auto or cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise FlatbmaError(f"train.device is {name!r} but there are {torch.cuda.device_count()} CUDA devices")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise FlatbmaError(f"train.device is {name!r} but MPS is not available here: use auto or cpu")
    return device


@dataclass
class Experiment:
    """Everything a run needs, built from a config."""

    config: RunConfig
    model: torch.nn.Module
    method: Posterior
    train_loader: DataLoader
    val_loader: DataLoader | None
    test_loader: DataLoader
    hessian_loader: DataLoader
    num_classes: int
    device: torch.device
    bn_loader: DataLoader | None = None
    """Loader for BatchNorm recomputation when it is not ``train_loader`` (data-parallel runs: the
    global batches, on every rank)."""


def _loader(ds: ArrayDataset, batch_size: int, *, shuffle: bool, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    # A trailing batch of one example would break BatchNorm in train mode.
    drop_last = shuffle and len(ds) > batch_size and len(ds) % batch_size == 1
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=generator, drop_last=drop_last)


def _dataset_options(d: DataConfig) -> dict[str, Any]:
    """``data.image_size`` for the loaders that resize while reading (image-folder: files of mixed sizes)."""
    loader = DATASETS.get(d.name.strip().lower().replace("_", "-"))
    takes_size = loader is not None and "size" in inspect.signature(loader).parameters
    return {"size": d.image_size} if takes_size and d.image_size is not None else {}


def build_experiment(cfg: RunConfig, prior: Params | None = None) -> Experiment:
    """Load data, build the model and the method for ``cfg`` (seeded).

    ``prior`` is a fitted Gaussian in ``θ`` layout (:func:`fit_prior`) that replaces the method's
    default prior; without it a two-stage run's method keeps its default prior, which is all that
    sampling and evaluation need.
    """
    seed_everything(cfg.seed)
    device = distributed.local_device(resolve_device(cfg.train.device))
    d = cfg.data
    splits = load_dataset(d.name, d.root, **_dataset_options(d))
    train, test = splits.train, splits.test
    val = None
    if d.k_shot is not None:
        train_idx, val_idx = few_shot_indices(
            train.labels,
            d.k_shot,
            seed=cfg.seed,
            val_per_class=d.val_per_class,
            num_classes=train.num_classes,  # so that a class missing from the training split is reported
            class_names=train.classes,
        )
        val = train.subset(val_idx) if len(val_idx) else None
        train = train.subset(train_idx)
    elif d.val_per_class:
        raise FlatbmaError("data.val_per_class needs data.k_shot (validation comes from the k-shot budget)")
    if d.test_limit is not None and d.test_limit < len(test):
        _, kept = stratified_split(test.labels, d.test_limit / len(test), seed=0)
        test = test.subset(kept)
        if len(test) == 0:
            raise FlatbmaError(
                f"data.test_limit={d.test_limit} keeps no test image (the subset is stratified, rounded per "
                f"class): use data.test_limit >= {test.num_classes}, the number of classes"
            )
    eval_tf = build_transform(size=d.image_size, to_rgb=d.to_rgb, normalize=d.normalize, augment=False)
    train_tf = build_transform(size=d.image_size, to_rgb=d.to_rgb, normalize=d.normalize, augment=d.augment)
    hessian_data = train.with_transform(eval_tf)
    if cfg.eval.hessian_examples < len(hessian_data):
        _, kept = stratified_split(hessian_data.labels, cfg.eval.hessian_examples / len(hessian_data), seed=0)
        hessian_data = hessian_data.subset(kept)
        if len(hessian_data) == 0:
            raise FlatbmaError(
                f"eval.hessian_examples={cfg.eval.hessian_examples} keeps no training example (the subset is "
                f"stratified, rounded per class): use eval.hessian_examples >= {hessian_data.num_classes}"
            )
    train, test = train.with_transform(train_tf), test.with_transform(eval_tf)
    val = val.with_transform(eval_tf) if val is not None else None

    channels, height, _ = train[0][0].shape
    model = build_model(
        cfg.model.name,
        num_classes=train.num_classes,
        in_channels=channels,
        image_size=height,
        pretrained=cfg.model.pretrained,
        width=cfg.model.width,
        dropout=cfg.model.dropout,
        seed=cfg.seed,
    ).to(device)
    restrict_trainable(model, subset_names(model, cfg.model.trainable))

    parallel = distributed.is_distributed() and cfg.train.parallel == "data"  # members: all data on every rank
    if parallel:  # data.batch_size is the global batch; this rank loads its shard of each
        train_loader = distributed.train_loader(train, d.batch_size, seed=cfg.seed)
    else:
        train_loader = _loader(train, d.batch_size, shuffle=True, seed=cfg.seed)
    steps = cfg.train.epochs * len(train_loader)
    o = cfg.optim
    warmup = round(o.warmup_epochs * len(train_loader))
    lr = cosine(o.lr, steps, warmup) if o.schedule == "cosine" else constant(o.lr)
    if o.name == "sgd":
        optimizer = SGD(lr=lr, momentum=o.momentum, weight_decay=o.weight_decay, nesterov=o.nesterov)
    else:
        optimizer = Adam(lr=lr, weight_decay=o.weight_decay)
    objective = Objective(model=model, num_data=len(train))
    if parallel:
        objective = distributed.data_parallel(objective)
    method = cfg.method.build(objective, optimizer, prior)
    return Experiment(
        config=cfg,
        model=model,
        method=method,
        train_loader=train_loader,
        val_loader=_loader(val, d.eval_batch_size, shuffle=False, seed=0) if val is not None else None,
        test_loader=(
            distributed.shard_loader(test, d.eval_batch_size)
            if distributed.is_distributed()
            else _loader(test, d.eval_batch_size, shuffle=False, seed=0)
        ),
        hessian_loader=_loader(hessian_data, d.eval_batch_size, shuffle=False, seed=0),
        num_classes=train.num_classes,
        device=device,
        bn_loader=distributed.train_loader(train, d.batch_size, seed=cfg.seed, shard=False) if parallel else None,
    )


def environment() -> dict[str, str]:
    """Library versions recorded with every run."""
    import flatbma

    return {
        "flatbma": flatbma.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def _check_run_dir(run_dir: Path, resolved: dict[str, Any], force: bool) -> None:
    existing = run_dir / CONFIG_FILE
    if existing.is_file() and not force:
        try:
            old = yaml.safe_load(existing.read_text())
        except yaml.YAMLError:
            old = None
        if old != resolved:
            raise FlatbmaError(
                f"{run_dir} already holds a run with a different config; choose another output_dir "
                "(--set output_dir=...) or pass --force to overwrite it"
            )


def posterior_samples(exp: Experiment, state: State) -> list[dict[str, torch.Tensor]]:
    """The ``eval.num_samples`` posterior samples of the BMA (BatchNorm recomputed when the method asks)."""
    generator = torch.Generator(device="cpu").manual_seed(exp.config.seed)
    samples = exp.method.sample(state, exp.config.eval.num_samples, generator)
    if exp.method.recompute_bn:
        loader = exp.bn_loader if exp.bn_loader is not None else exp.train_loader
        samples = [recompute_bn_statistics(exp.model, w, loader, device=exp.device) for w in samples]
    return samples


def flatness_metrics(exp: Experiment, samples: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Hessian spectra of the first ``eval.flatness_samples`` samples and distribution-level flatness.

    The Hessian is that of the mean training loss (no augmentation) over the trained parameters —
    the Bayesian subset when ``model.trainable`` restricts it. Lanczos runs that stop at
    ``eval.hessian_max_iter`` before reaching their tolerance are reported (``hessian_converged``,
    ``hessian_warnings`` with their residuals) rather than printed.
    """
    e = exp.config.eval
    names = [n for n, p in exp.model.named_parameters() if p.requires_grad]
    chosen = samples[: e.flatness_samples]
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:  # recorded in the report instead of printed per spectrum
        warnings.simplefilter("always", ConvergenceWarning)
        report = flatness_report(
            exp.model,
            chosen,
            [(x.to(exp.device), y.to(exp.device)) for x, y in exp.hessian_loader],
            k=e.hessian_k,
            params=names,
            rho=e.sharpness_rho,
            max_iter=e.hessian_max_iter,
            seed=exp.config.seed,
        )
    unconverged = [str(w.message) for w in caught if issubclass(w.category, ConvergenceWarning)]
    for w in caught:
        if not issubclass(w.category, ConvergenceWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    report["hessian_converged"] = not unconverged
    report["hessian_warnings"] = unconverged
    report["flatness_time_s"] = time.perf_counter() - start
    return report


def evaluate_state(exp: Experiment, state: State, *, flatness: bool = False) -> dict[str, Any]:
    """BMA metrics of ``state`` on the test set (and flatness when asked)."""
    samples = posterior_samples(exp, state)
    metrics = _bma_metrics(exp, samples)
    if flatness:
        metrics.update(flatness_metrics(exp, samples))
    return metrics


def _bma_metrics(exp: Experiment, samples: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    return evaluate(
        exp.model,
        samples,
        exp.test_loader,
        num_classes=exp.num_classes,
        n_bins=exp.config.eval.n_bins,
        device=exp.device,
        mode=exp.method.predict_mode,
        reduce_metrics=distributed.all_reduce_metrics if distributed.is_distributed() else None,
    )


def _save_checkpoint(path: Path, state: State, position: Position, history: History) -> None:
    extra = {"torch_rng": position.torch_rng}
    if position.loader_rng is not None:
        extra["loader_rng"] = position.loader_rng
    for i, rng in enumerate(position.cuda_rng or ()):
        extra[f"cuda_rng/{i}"] = rng
    meta = {
        "epoch": str(position.epoch),
        "batch": str(position.batch),
        "partial": json.dumps(list(position.partial)),
        "history": json.dumps([vars(h) for h in history.epochs]),
    }
    save_state(state, path, meta, extra)


def _check_fits(exp: Experiment, state: State, path: Path) -> None:
    """A loaded state must have the structure the run's method gives a fresh state of the run's model."""
    devices = list(range(torch.cuda.device_count())) if exp.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the reference init leaves the run's random streams alone
        reference = exp.method.init(trainable_params(exp.model), model_buffers(exp.model))
    check_compatible(state, reference, path)


def _load_checkpoint(path: Path, device: torch.device) -> tuple[State, Position, History]:
    state, meta, extra = load_checkpoint(path, device=str(device))
    try:
        cuda = tuple(extra[k] for k in sorted(k for k in extra if k.startswith("cuda_rng/"))) or None
        position = Position(
            epoch=int(meta["epoch"]),
            batch=int(meta["batch"]),
            loader_rng=extra.get("loader_rng"),
            torch_rng=extra["torch_rng"],
            cuda_rng=cuda,
            partial=tuple(json.loads(meta["partial"])),
        )
        history = History([EpochLog(**h) for h in json.loads(meta["history"])])
    except (KeyError, ValueError, TypeError):
        raise FlatbmaError(f"{path} has no resumable position (written by another tool?); train again") from None
    return state, position, history


PRIOR_DIR = "prior"
"""Subdirectory of a two-stage run that holds its first stage (a run directory of its own)."""


@dataclass(frozen=True)
class FittedPrior:
    """The first stage of a two-stage run, ready for the second.

    Attributes:
        theta: the fitted Gaussian in low-rank VI's ``θ`` layout (:attr:`Posterior.gaussian`), its ``σ``
            floored at ``prior.min_std``.
        buffers: the model buffers at the end of the first stage (BatchNorm statistics).
        run_dir: the first stage's run directory.
    """

    theta: Params
    buffers: Params
    run_dir: Path


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


def finished_run(run_dir: Path, resolved: dict[str, Any]) -> bool:
    """Whether ``run_dir`` holds a finished run (metrics written) of exactly the config ``resolved``."""
    if not ((run_dir / METRICS_FILE).is_file() and (run_dir / CHECKPOINT_FILE).is_file()):
        return False
    try:
        return yaml.safe_load((run_dir / CONFIG_FILE).read_text()) == resolved
    except (OSError, yaml.YAMLError):
        return False


def fit_prior(cfg: RunConfig, *, force: bool = False, resume: bool = False) -> FittedPrior | None:
    """Train (or reuse, when it finished with the same config and not ``force``) the first stage of ``cfg``.

    Returns ``None`` for a one-stage run. With ``resume`` an unfinished first stage continues from its
    checkpoint. Under ``torchrun`` rank 0 decides whether to reuse, so every rank does the same.
    """
    stage = prior_stage(cfg)
    if stage is None:
        return None
    run_dir = Path(stage.output_dir)
    if distributed.main_decides(not force and finished_run(run_dir, stage.to_dict())):
        exp = build_experiment(stage)
        _check_stable_with_prior(cfg, len(exp.train_loader.dataset))
        state = load_state(run_dir / CHECKPOINT_FILE, device=str(exp.device))
        _check_fits(exp, state, run_dir / CHECKPOINT_FILE)
    else:
        resumable = distributed.main_decides(resume and (run_dir / CHECKPOINT_FILE).is_file())
        exp, state, _ = _train(
            stage,
            force=True,
            resume=resumable,
            evaluate=False,  # `flatbma evaluate <output_dir>/prior` measures the first stage on its own
            check=lambda e: _check_stable_with_prior(cfg, len(e.train_loader.dataset)),  # before training
        )
    assert exp.method.gaussian is not None and cfg.prior is not None  # checked when the config was parsed
    theta = exp.method.gaussian(state)
    floor = math.log(cfg.prior.min_std)
    theta = {k: v.clamp_min(floor) if k.startswith("log_std/") else v for k, v in theta.items()}
    return FittedPrior(theta=theta, buffers=dict(state.buffers), run_dir=run_dir)


def _check_stable_with_prior(cfg: RunConfig, num_data: int) -> None:
    """Refuse an SGD learning rate that the KL to the fitted prior makes diverge (before stage 1 trains).

    ``κ KL(q ‖ p)/n`` has curvature ``κ/(n σ²)`` in ``μ`` along a weight whose prior ``σ`` sits at the
    floor ``prior.min_std``; gradient descent on it diverges for ``lr > 2nσ²/κ`` (Adam's normalized steps
    do not).
    """
    assert cfg.prior is not None
    kl_weight = float(cfg.method.options.get("kl_weight", 1.0))
    bound = 2 * num_data * cfg.prior.min_std**2 / kl_weight if kl_weight > 0 else math.inf
    if cfg.optim.name == "sgd" and cfg.optim.lr > bound:
        raise FlatbmaError(
            f"optim.lr={cfg.optim.lr:g} is above {bound:.3g} = 2·n·prior.min_std²/kl_weight (n={num_data}), where "
            "SGD on the KL to the fitted prior diverges: lower optim.lr, raise prior.min_std, or use optim.name=adam"
        )


def train_run(
    cfg: RunConfig, *, force: bool = False, resume: bool = False, evaluate: bool = True
) -> tuple[Path, dict[str, Any]]:
    """Train ``cfg`` into its output directory and write ``metrics.json``; return (dir, metrics).

    With ``resume``, continue from the directory's checkpoint exactly where it stopped (same data
    order, same random draws) instead of starting over. A two-stage run (``cfg.prior``) first fits
    its prior stage (:func:`fit_prior`), then trains its method with that prior and, with
    ``prior.init``, from it. Without ``evaluate`` the BMA evaluation is left to the caller
    (``flatbma compare`` measures more and merges its metrics in).

    Data-parallel when a process group is initialized (``torchrun``, see
    :mod:`flatbma.experiment.distributed`): every rank trains on its shard of each global batch and
    only rank 0 writes files.
    With ``train.parallel: members`` every rank instead trains its share of the posterior's independent
    members on all the data (:class:`~flatbma.experiment.distributed.MemberParallel`).
    """
    run_dir = Path(cfg.output_dir)
    if not resume:
        _check_run_dir(run_dir, cfg.to_dict(), force)
        if cfg.prior is not None:  # `train --resume` finds the run (and its config) while stage 1 trains
            _write_config(run_dir, cfg.to_dict())
    prior = fit_prior(cfg, force=force, resume=resume)
    if prior is not None and resume:  # interrupted in the first stage: the second starts afresh
        resume = distributed.main_decides((run_dir / CHECKPOINT_FILE).is_file())
        force = True
    _, _, metrics = _train(cfg, force=force, resume=resume, evaluate=evaluate, prior=prior)
    return run_dir, metrics


def _write_config(run_dir: Path, resolved: dict[str, Any]) -> None:
    """Write the resolved config into ``run_dir`` (rank 0 only: the other ranks write nothing)."""
    try:
        if distributed.is_main():
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(run_dir / CONFIG_FILE, yaml.safe_dump(resolved, sort_keys=False).encode())
    except OSError as e:
        raise FlatbmaError(
            f"cannot write the run directory {run_dir} ({e.strerror}): choose another output_dir (--set output_dir=...)"
        ) from None


def _train(
    cfg: RunConfig,
    *,
    force: bool,
    resume: bool,
    evaluate: bool,
    prior: FittedPrior | None = None,
    check: Callable[[Experiment], None] | None = None,
) -> tuple[Experiment, State, dict[str, Any]]:
    run_dir = Path(cfg.output_dir)
    resolved = cfg.to_dict()
    if not resume:
        _check_run_dir(run_dir, resolved, force)
    exp = build_experiment(cfg, prior=prior.theta if prior is not None else None)
    if check is not None:
        check(exp)
    ckpt = run_dir / CHECKPOINT_FILE
    position = None
    history = History()
    parallel = distributed.is_distributed() and cfg.train.parallel == "data"
    if resume:
        state, position, history = _load_checkpoint(ckpt, exp.device)
        _check_fits(exp, state, ckpt)
        position = distributed.local_position(position) if parallel else position
    else:
        _write_config(run_dir, resolved)
        at_prior = prior is not None and cfg.prior is not None and cfg.prior.init  # start at the fitted posterior
        start = (prior.theta, prior.buffers) if at_prior else (trainable_params(exp.model), model_buffers(exp.model))
        try:
            state = exp.method.init(*start)
        except FlatbmaError as e:
            if not at_prior:
                raise
            raise FlatbmaError(
                f"{cfg.method.name} cannot start at the prior fitted in {prior.run_dir}: {e} — or let the first "
                "stage collect more snapshots (raise prior.epochs, lower prior.method.start_step or collect_every)"
            ) from None

    def save(s: State, p: Position, h: History) -> None:
        _save_checkpoint(ckpt, s, p, h)

    method, checkpoint, spread = exp.method, (distributed.checkpoint_hook(save) if parallel else save), None
    if cfg.train.parallel == "members":  # each process trains its share of the members on all the data
        spread = distributed.MemberParallel(exp.method, state, cfg.method.name)
        method, state, checkpoint = spread.method, spread.local(state), spread.checkpoint_hook(save)
    start = time.perf_counter()
    exp.model.train()
    try:
        state, history = fit(
            method,
            state,
            exp.train_loader,
            epochs=cfg.train.epochs,
            device=exp.device,
            resume=position,
            checkpoint=checkpoint,
            checkpoint_every=cfg.train.checkpoint_every,
            progress=cfg.train.progress and distributed.is_main(),
            history=history,
        )
    except DivergenceError as e:
        kept = f"the last good checkpoint is kept at {ckpt}" if ckpt.exists() else "no checkpoint was written yet"
        raise DivergenceError(
            f"{e}; {kept}. Lower the learning rate (e.g. --set optim.lr={yaml_float(cfg.optim.lr / 10)}) and train "
            "again"
        ) from None
    train_time = time.perf_counter() - start
    if parallel:
        state, history = distributed.finish(state, history)
    if spread is not None:
        state = spread.merge(state)
    metrics = evaluate_state(exp, state, flatness=cfg.eval.flatness) if evaluate else {}
    metrics.update(
        method=cfg.method.name,
        seed=cfg.seed,
        train_time_s=train_time,
        steps=state.step,
        history=[vars(h) for h in history.epochs],
        environment=environment(),
    )
    if prior is not None:
        metrics["prior_run"] = str(prior.run_dir)
    if distributed.is_distributed():
        metrics["world_size"] = distributed.world_size()
    if distributed.is_main():
        atomic_write_json(run_dir / METRICS_FILE, metrics)
    return exp, state, metrics


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The resolved config of a run directory."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise FlatbmaError(f"{run_dir} is not a run directory (no {CONFIG_FILE}); pass the output_dir of a run")
    cfg = config_from_dict(load_raw(run_dir / CONFIG_FILE))
    return dataclasses.replace(cfg, output_dir=str(run_dir))


def evaluate_run(run_dir: str | Path, *, flatness: bool = False) -> dict[str, Any]:
    """Re-evaluate a finished run from its directory (config + checkpoint) and update metrics.json."""
    run_dir = Path(run_dir)
    exp = build_experiment(load_run_config(run_dir))
    state = load_state(run_dir / CHECKPOINT_FILE, device=str(exp.device))
    _check_fits(exp, state, run_dir / CHECKPOINT_FILE)
    metrics_path = run_dir / METRICS_FILE
    try:
        metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    except ValueError:
        metrics = None
    if not isinstance(metrics, dict):
        raise FlatbmaError(f"{metrics_path} is damaged (not a JSON object): delete it and evaluate again")
    metrics.update(evaluate_state(exp, state, flatness=flatness))
    if distributed.is_main():
        atomic_write_json(metrics_path, metrics)
    return metrics
