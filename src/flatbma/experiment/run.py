"""A run: config → data, model, method → the one loop → checkpoint → BMA evaluation → metrics.json."""

from __future__ import annotations

import dataclasses
import inspect
import json
import platform
import random
import time
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
from flatbma.flatness.posterior import flatness_report
from flatbma.models import build_model
from flatbma.optim import SGD, Adam, constant, cosine
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.predict import evaluate
from flatbma.transfer import restrict_trainable, subset_names
from flatbma.types import Posterior, State

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


def build_experiment(cfg: RunConfig) -> Experiment:
    """Load data, build the model and the method for ``cfg`` (seeded)."""
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

    parallel = distributed.is_distributed()
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
    method = cfg.method.build(objective, optimizer)
    return Experiment(
        config=cfg,
        model=model,
        method=method,
        train_loader=train_loader,
        val_loader=_loader(val, d.eval_batch_size, shuffle=False, seed=0) if val is not None else None,
        test_loader=(
            distributed.shard_loader(test, d.eval_batch_size)
            if parallel
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
    the Bayesian subset when ``model.trainable`` restricts it.
    """
    e = exp.config.eval
    names = [n for n, p in exp.model.named_parameters() if p.requires_grad]
    chosen = samples[: e.flatness_samples]
    start = time.perf_counter()
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


def train_run(cfg: RunConfig, *, force: bool = False, resume: bool = False) -> tuple[Path, dict[str, Any]]:
    """Train ``cfg`` into its output directory and write ``metrics.json``; return (dir, metrics).

    With ``resume``, continue from the directory's checkpoint exactly where it stopped (same data
    order, same random draws) instead of starting over.

    Data-parallel when a process group is initialized (``torchrun``, see
    :mod:`flatbma.experiment.distributed`): every rank trains on its shard of each global batch and
    only rank 0 writes files.
    """
    run_dir = Path(cfg.output_dir)
    resolved = cfg.to_dict()
    if not resume:
        _check_run_dir(run_dir, resolved, force)
    exp = build_experiment(cfg)
    ckpt = run_dir / CHECKPOINT_FILE
    position = None
    history = History()
    parallel = distributed.is_distributed()
    if resume:
        state, position, history = _load_checkpoint(ckpt, exp.device)
        _check_fits(exp, state, ckpt)
        position = distributed.local_position(position) if parallel else position
    else:
        try:
            if distributed.is_main():  # the other ranks of a data-parallel run write nothing
                run_dir.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(run_dir / CONFIG_FILE, yaml.safe_dump(resolved, sort_keys=False).encode())
        except OSError as e:
            raise FlatbmaError(
                f"cannot write the run directory {run_dir} ({e.strerror}): choose another output_dir "
                "(--set output_dir=...)"
            ) from None
        state = exp.method.init(trainable_params(exp.model), model_buffers(exp.model))

    def save(s: State, p: Position, h: History) -> None:
        _save_checkpoint(ckpt, s, p, h)

    start = time.perf_counter()
    exp.model.train()
    try:
        state, history = fit(
            exp.method,
            state,
            exp.train_loader,
            epochs=cfg.train.epochs,
            device=exp.device,
            resume=position,
            checkpoint=distributed.checkpoint_hook(save) if parallel else save,
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
    metrics = evaluate_state(exp, state, flatness=cfg.eval.flatness)
    metrics.update(
        method=cfg.method.name,
        seed=cfg.seed,
        train_time_s=train_time,
        steps=state.step,
        history=[vars(h) for h in history.epochs],
        environment=environment(),
    )
    if parallel:
        metrics["world_size"] = distributed.world_size()
    if distributed.is_main():
        atomic_write_json(run_dir / METRICS_FILE, metrics)
    return run_dir, metrics


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
