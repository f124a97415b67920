"""An experiment: a run config assembled into data loaders, the model and the method (seeded).

:func:`build_experiment` seeds every generator first and records the global RNG state it leaves
(:attr:`Experiment.rng`), so evaluation draws the same numbers right after building or after training. The data
drawn, the network and the loaders are one deterministic sequence of draws, whose order the runs' numbers depend on.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from flatbma import likelihood as likelihoods
from flatbma import training
from flatbma.bn import statistics_loader
from flatbma.checks import check_device, shown
from flatbma.data import (
    DATASETS,
    ArrayDataset,
    DatasetSplits,
    build_transform,
    check_learnable,
    few_shot_indices,
    load_dataset,
    stratified_split,
)
from flatbma.data.tabular import (
    RegressionSplits,
    TabularDataset,
    load_regression_dataset,
    random_split,
    standardized,
)
from flatbma.data.transforms import Transform
from flatbma.errors import FlatbmaError
from flatbma.experiment.config.run_config import RunConfig
from flatbma.experiment.config.sections import DataConfig
from flatbma.experiment.parallel import processes, strategies
from flatbma.experiment.parallel.loaders import seeded_loader
from flatbma.experiment.parallel.strategies import Strategy
from flatbma.likelihood import Likelihood
from flatbma.models import build_model, check_classifier, copied
from flatbma.optim.schedules import Schedule
from flatbma.params import Objective
from flatbma.precision import Precision
from flatbma.regression import Gaussian
from flatbma.transfer import restrict_trainable, subset_names
from flatbma.types import Params, Posterior


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 (seeds the legacy global generator users may rely on)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU; other names are checked (:func:`~flatbma.checks.check_device`)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return check_device(name, "train.device", instead="auto or cpu")


@dataclass(frozen=True)
class GlobalRNG:
    """A snapshot of torch's global generators: the CPU one and, on a CUDA run, every GPU's."""

    cpu: Tensor
    cuda: tuple[Tensor, ...] = ()

    @classmethod
    def capture(cls, device: torch.device) -> GlobalRNG:
        """The current states (the GPUs' only when ``device`` is a CUDA device)."""
        cuda = tuple(torch.cuda.get_rng_state_all()) if device.type == "cuda" else ()
        return cls(cpu=torch.get_rng_state(), cuda=cuda)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Within the block the global generators start from this snapshot; afterwards they are as before it."""
        with torch.random.fork_rng(devices=list(range(len(self.cuda)))):
            torch.set_rng_state(self.cpu)
            if self.cuda:
                torch.cuda.set_rng_state_all(list(self.cuda))
            yield


@dataclass
class Experiment:
    """Everything a run needs, built from a config.

    Attributes:
        hessian_loader: the un-augmented training examples the Hessian is taken over (``eval.hessian_examples``).
        strategy: how the processes share the run (:func:`flatbma.experiment.parallel.strategies.strategy`).
        bn_loader: the un-augmented training images in a fixed order, for BatchNorm recomputation.
        rng: the global RNG state at the end of building; evaluation starts from it.
        data_fingerprint: :func:`data_fingerprint` of the data set the run draws its examples from.
        learning_rate: ``step -> η_t`` as the method trains with it (:attr:`flatbma.training.Built.learning_rate`).
        likelihood: the Gaussian likelihood of a regression run (``num_classes`` then 0), ``None`` for a classifier.
    """

    config: RunConfig
    model: torch.nn.Module
    method: Posterior
    train_loader: DataLoader
    val_loader: DataLoader | None
    test_loader: DataLoader
    hessian_loader: DataLoader
    num_classes: int
    device: torch.device
    strategy: Strategy
    bn_loader: DataLoader
    rng: GlobalRNG
    data_fingerprint: str
    learning_rate: Schedule
    likelihood: Gaussian | None = None


def _dataset_options(d: DataConfig) -> dict[str, Any]:
    """``data.image_size`` for the loaders that resize while reading (image-folder: files of mixed sizes)."""
    loader = DATASETS.get(d.name.strip().lower().replace("_", "-"))
    takes_size = loader is not None and "size" in inspect.signature(loader).parameters
    return {"size": d.image_size} if takes_size and d.image_size is not None else {}


@dataclass(frozen=True)
class RunData:
    """The examples of a run (:func:`select_data`), without transforms.

    Attributes:
        train: the training examples (the k-shot draw of ``data.k_shot``, else the whole training split).
        val: the validation examples (``data.val_per_class``, ``data.val_pool`` or ``data.val_fraction``), or ``None``.
        test: the test examples (the stratified subset of ``data.test_limit``, else the whole test split).
        hessian: indices into ``train`` of the Hessian's examples (``eval.hessian_examples``), or ``None`` for all.
    """

    train: ArrayDataset | TabularDataset
    val: ArrayDataset | TabularDataset | None
    test: ArrayDataset | TabularDataset
    hessian: Tensor | None


def load_data(d: DataConfig) -> DatasetSplits | RegressionSplits:
    """The data set of the ``data`` section, as read from its files (or the embedded copy)."""
    return DATA[likelihoods.of_data(d.name)].load(d)


def data_fingerprint(splits: DatasetSplits | RegressionSplits) -> str:
    """A short SHA-256 of a data set's content: both splits' images and labels (dtype, shape, bytes) and its classes.

    With the resolved config it says what data a run saw: a checkpoint records it, and a run whose data changed
    is neither reused nor resumed.
    """
    head, tensors = splits.content()
    h = hashlib.sha256(head)
    for t in tensors:
        h.update(f"{t.dtype}{list(t.shape)}".encode())
        h.update(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()[:16]


def select_regression_data(cfg: RunConfig, splits: RegressionSplits) -> RunData:
    """The examples of a regression run, every split standardized on the training examples only.

    ``data.val_fraction`` of the training split is held out (by the run's seed) and ``data.test_limit`` test
    examples kept (by seed 0) before rescaling (:func:`flatbma.data.tabular.standardized`).
    """
    d = cfg.data
    train, test, val = splits.train, splits.test, None
    if d.val_per_class or d.val_pool:
        raise FlatbmaError("a regression data set has no classes: hold out validation data with data.val_fraction")
    if d.val_fraction:
        kept, held = random_split(len(train), d.val_fraction, cfg.seed)
        if len(held) == 0 or len(kept) < 2:
            raise FlatbmaError(
                f"data.val_fraction={d.val_fraction} holds out {len(held)} of {len(train)} training examples: choose a "
                "share that leaves both parts non-empty"
            )
        train, val = train.subset(kept), train.subset(held)
    if d.test_limit is not None and d.test_limit < len(test):
        _, kept = random_split(len(test), d.test_limit / len(test), 0)
        test = test.subset(kept)
    hessian = None
    if cfg.eval.hessian_examples is not None and cfg.eval.hessian_examples < len(train):
        _, hessian = random_split(len(train), cfg.eval.hessian_examples / len(train), 0)
    train, test, *rest = standardized(train, test, *([val] if val is not None else []))
    return RunData(train=train, val=rest[0] if rest else None, test=test, hessian=hessian)


def select_data(cfg: RunConfig, splits: DatasetSplits | RegressionSplits) -> RunData:
    """The examples ``cfg`` trains, validates, tests and measures the Hessian on, drawn from ``splits`` (seeded).

    Raises:
        FlatbmaError: data a classifier cannot learn (:func:`~flatbma.data.check_learnable`: one class, a
            class without a training example), a k-shot draw the data cannot give, or a ``data.test_limit``
            or ``eval.hessian_examples`` that keeps no example.
    """
    return DATA[cfg.model.likelihood].select(cfg, splits)


def _select_images(cfg: RunConfig, splits: DatasetSplits) -> RunData:
    """:func:`select_data` of a classifier's image data set."""
    check_learnable(splits)
    d = cfg.data
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
            val_pool=d.val_pool,
        )
        val = train.subset(val_idx) if len(val_idx) else None
        train = train.subset(train_idx)
    elif d.val_per_class or d.val_pool:
        raise FlatbmaError(
            "data.val_per_class and data.val_pool need data.k_shot (validation comes from the k-shot draw); for a "
            "full-data run hold out a share of each class with data.val_fraction"
        )
    elif d.val_fraction:
        kept, held = stratified_split(train.labels, d.val_fraction, seed=cfg.seed)
        if len(held) == 0 or len(kept) == 0:
            raise FlatbmaError(
                f"data.val_fraction={d.val_fraction} holds out {len(held)} of {len(train)} training images (rounded "
                "per class): choose a share that leaves both parts non-empty"
            )
        train, val = train.subset(kept), train.subset(held)
    if d.test_limit is not None and d.test_limit < len(test):
        _, kept = stratified_split(test.labels, d.test_limit / len(test), seed=0)
        test = test.subset(kept)
        if len(test) == 0:
            raise FlatbmaError(
                f"data.test_limit={d.test_limit} keeps no test image (the subset is stratified, rounded per "
                f"class): use data.test_limit >= {test.num_classes}, the number of classes"
            )
    hessian = None
    if cfg.eval.hessian_examples is not None and cfg.eval.hessian_examples < len(train):
        _, hessian = stratified_split(train.labels, cfg.eval.hessian_examples / len(train), seed=0)
        if len(hessian) == 0:
            raise FlatbmaError(
                f"eval.hessian_examples={cfg.eval.hessian_examples} keeps no training example (the subset is "
                f"stratified, rounded per class): use eval.hessian_examples >= {train.num_classes}"
            )
    return RunData(train=train, val=val, test=test, hessian=hessian)


def transforms(d: DataConfig) -> tuple[Transform | None, Transform | None]:
    """``(training, evaluation)`` transforms of the ``data`` section (evaluation never augments; regression: none)."""
    return DATA[likelihoods.of_data(d.name)].transforms(d)


def _image_transforms(d: DataConfig) -> tuple[Transform | None, Transform | None]:
    """:func:`transforms` of an image data set."""
    train_tf = build_transform(size=d.image_size, to_rgb=d.to_rgb, normalize=d.normalize, augment=d.augment)
    eval_tf = build_transform(size=d.image_size, to_rgb=d.to_rgb, normalize=d.normalize, augment=False)
    return train_tf, eval_tf


def build_regression_network(cfg: RunConfig, train: TabularDataset) -> torch.nn.Module:
    """The network of a regression run: ``model.name`` on ``D`` input features with ``gaussian.outputs`` outputs.

    2 outputs (mean, raw scale) with a learned noise, 1 (the mean) with a fixed ``model.noise_std``; checked
    with one forward pass on two training examples.
    """
    gaussian: Gaussian = cfg.model.gaussian  # type: ignore[assignment]  # (DATA's Gaussian row)
    model = build_model(
        cfg.model.name,
        num_classes=gaussian.outputs,
        in_channels=train.num_features,
        image_size=1,
        pretrained=cfg.model.pretrained,
        width=cfg.model.width,
        dropout=cfg.model.dropout,
        seed=cfg.seed,
    )
    restrict_trainable(model, subset_names(model, cfg.model.trainable))
    with torch.no_grad():
        out = model(train.features[:2])
    if not isinstance(out, Tensor) or list(out.shape) != [2, gaussian.outputs]:
        got = list(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise FlatbmaError(
            f"model {shown(cfg.model.name)} returns {got} for 2 feature vectors of a regression data set; a Gaussian "
            f"likelihood needs [2, {gaussian.outputs}]: use model.name: mlp"
        )
    return model


def build_network(cfg: RunConfig, train: ArrayDataset | TabularDataset) -> torch.nn.Module:
    """The network of ``cfg`` (on the CPU, seeded) for the images of ``train``, only ``model.trainable`` trainable.

    Checked with one forward pass on two images under a forked RNG (:func:`~flatbma.models.check_classifier`):
    logits ``[2, num_classes]``, float32, finite weights, something to train.
    """
    return DATA[cfg.model.likelihood].network(cfg, train)


def _build_classifier(cfg: RunConfig, train: ArrayDataset) -> torch.nn.Module:
    """:func:`build_network` of a classifier."""
    channels, height, width = train[0][0].shape  # (an augmenting transform draws here: runs' numbers count on it)
    with torch.random.fork_rng(devices=[]):  # the check's images draw nothing the run sees
        x = torch.stack([train[i][0] for i in range(min(2, len(train)))])
    model = build_model(
        cfg.model.name,
        num_classes=train.num_classes,
        in_channels=channels,
        image_size=height,
        pretrained=cfg.model.pretrained,
        width=cfg.model.width,
        dropout=cfg.model.dropout,
        seed=cfg.seed,
    )
    restrict_trainable(model, subset_names(model, cfg.model.trainable))
    hint = "" if height == width else f"the images are {height}x{width}, not square: set data.image_size to resize them"
    check_classifier(model, x, name=f"model {shown(cfg.model.name)}", num_classes=train.num_classes, hint=hint)
    return model


@dataclass(frozen=True)
class DataRow:
    """How a run of one likelihood reads, draws, transforms and tests its data and builds its network (:data:`DATA`).

    ``load``, ``select``, ``transforms`` and ``network`` implement :func:`load_data`, :func:`select_data`,
    :func:`transforms` and :func:`build_network`; ``test_loader(strategy, test, batch_size)``: the test metrics'.
    """

    load: Callable[[DataConfig], Any]
    select: Callable[[RunConfig, Any], RunData]
    transforms: Callable[[DataConfig], tuple[Transform | None, Transform | None]]
    network: Callable[[RunConfig, Any], torch.nn.Module]
    test_loader: Callable[[Strategy, Any, int], Any]


DATA: dict[Likelihood, DataRow] = {
    Likelihood.CATEGORICAL: DataRow(
        load=lambda d: load_dataset(d.name, d.root, **_dataset_options(d)),
        select=_select_images,
        transforms=_image_transforms,
        network=_build_classifier,
        test_loader=lambda strategy, test, batch_size: strategy.test_loader(test, batch_size),
    ),
    Likelihood.GAUSSIAN: DataRow(
        load=lambda d: load_regression_dataset(d.name, d.root),
        select=select_regression_data,
        transforms=lambda d: (None, None),  # feature vectors
        network=build_regression_network,
        # a regression run's mixture metrics (coverage, calibration) are not sums over shards: every process
        # scores the whole (small) test set, as one process would
        test_loader=lambda strategy, test, batch_size: seeded_loader(test, batch_size, shuffle=False, seed=0),
    ),
}
"""The data's rows of the likelihood dispatch (:mod:`flatbma.likelihood`), one per :class:`Likelihood`."""


def _check_one_scale(strategy: Strategy) -> None:
    """Refuse fp16 where processes would train parts of one state under separate loss scales."""
    if isinstance(strategy, strategies.Members) and processes.world_size() > 1:
        raise FlatbmaError(
            "train.precision: fp16 keeps one loss scale for the whole state, but train.parallel: members splits "
            "the state over the processes: use train.precision: bf16 or train.parallel: data"
        )


@dataclass
class Inputs:
    """What every stage of a run shares, read and built once (:func:`prepare`): its data and its network.

    Each stage's experiment is assembled from these (:func:`build_experiment`), bit for bit the one a build of its
    own would give.

    Attributes:
        data: the examples drawn (:func:`select_data`), without transforms.
        train: the training examples with the training transform (it may augment); ``test`` and ``val`` (or
            ``None``) with the evaluation transform.
        statistics: the training examples without augmentation (BatchNorm statistics, the Hessian's examples).
        num_classes: classes of the training data (0 for a regression data set's).
        model: the network at its initial weights (each experiment gets a copy: :func:`flatbma.models.copied`).
        fingerprint: :func:`data_fingerprint` of the data set read.
        random: the global random states right after the network was built (Python's, NumPy's, torch's).
    """

    device: torch.device
    data: RunData
    train: Any
    test: Any
    val: Any
    statistics: Any
    num_classes: int
    model: torch.nn.Module
    fingerprint: str
    random: tuple[Any, ...]


def prepare(cfg: RunConfig) -> Inputs:
    """Read the data set of ``cfg``, draw its examples and build its network at its initial weights (seeded)."""
    seed_everything(cfg.seed)
    device = processes.local_device(resolve_device(cfg.train.device))
    d = cfg.data
    splits = load_data(d)
    data = select_data(cfg, splits)
    train_tf, eval_tf = transforms(d)
    statistics = data.train.with_transform(eval_tf)  # the training images, un-augmented
    train, test = data.train.with_transform(train_tf), data.test.with_transform(eval_tf)
    val = data.val.with_transform(eval_tf) if data.val is not None else None
    model = build_network(cfg, train).to(device)
    return Inputs(
        device=device,
        data=data,
        train=train,
        test=test,
        val=val,
        statistics=statistics,
        num_classes=train.num_classes,
        model=model,
        fingerprint=data_fingerprint(splits),
        random=_random_state(device),
    )


def _random_state(device: torch.device) -> tuple[Any, ...]:
    """Python's, NumPy's and torch's global random states (the GPUs' on a CUDA run)."""
    cuda = tuple(torch.cuda.get_rng_state_all()) if device.type == "cuda" else ()
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda  # noqa: NPY002


def _set_random_state(state: tuple[Any, ...]) -> None:
    python, numpy, cpu, cuda = state
    random.setstate(python)
    np.random.set_state(numpy)  # noqa: NPY002
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(list(cuda))


def build_experiment(cfg: RunConfig, prior: Params | None = None, inputs: Inputs | None = None) -> Experiment:
    """The experiment of ``cfg``: its data, its network and its method (seeded).

    ``prior``: a fitted Gaussian in ``θ`` layout (:func:`flatbma.experiment.run.prior.fit_prior`) replacing the
    method's default prior (enough for sampling and evaluation). ``inputs``: the data and network of
    :func:`prepare`; the experiment gets a copy of the network and the random state they left, as if it had built
    them itself (``None``: built here).
    """
    if inputs is None:
        inputs = prepare(cfg)
        model = inputs.model
    else:
        _set_random_state(inputs.random)
        model = copied(inputs.model)
    device = inputs.device
    strategy = strategies.strategy(cfg.train.parallel)
    d = cfg.data
    data, train, test, val = inputs.data, inputs.train, inputs.test, inputs.val
    statistics_data = inputs.statistics
    hessian_data = statistics_data.subset(data.hessian) if data.hessian is not None else statistics_data

    train_loader = strategy.train_loader(train, d.batch_size, seed=cfg.seed)  # data.batch_size: the global batch
    precision = cfg.train.precision
    gaussian = cfg.model.gaussian
    loss_fn = likelihoods.loss(gaussian)
    objective = strategy.objective(Objective(model=model, num_data=len(train), precision=precision, loss_fn=loss_fn))
    if precision is Precision.FP16:
        _check_one_scale(strategy)
    built = training.build(
        cfg.method,
        cfg.optim,
        objective,
        steps_per_epoch=len(train_loader),
        epochs=cfg.train.epochs,
        prior=prior,
        precision=precision,
    )
    return Experiment(
        config=cfg,
        model=model,
        method=built.posterior,
        learning_rate=built.learning_rate,
        train_loader=train_loader,
        val_loader=seeded_loader(val, d.eval_batch_size, shuffle=False, seed=0) if val is not None else None,
        test_loader=DATA[cfg.model.likelihood].test_loader(strategy, test, d.eval_batch_size),
        hessian_loader=seeded_loader(hessian_data, d.eval_batch_size, shuffle=False, seed=0),
        num_classes=inputs.num_classes,
        device=device,
        strategy=strategy,
        bn_loader=statistics_loader(statistics_data, d.eval_batch_size),
        rng=GlobalRNG.capture(device),
        data_fingerprint=inputs.fingerprint,
        likelihood=gaussian,
    )
