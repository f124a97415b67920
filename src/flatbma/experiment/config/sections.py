"""The sections of a run config — data, model, optimizer, training loop, evaluation — as typed frozen dataclasses.

Each is validated in ``__post_init__``. Options with a fixed set of values are ``str`` Enums: a config gives the
string, Python code the string or the member.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

from flatbma import likelihood as likelihoods
from flatbma.checks import check_positive, parse_choice
from flatbma.errors import FlatbmaError
from flatbma.experiment.config.parse import shown
from flatbma.likelihood import Likelihood
from flatbma.ood import check_ood_applies, check_ood_name
from flatbma.options import added
from flatbma.precision import Precision
from flatbma.regression import Gaussian
from flatbma.transfer import Subset

if TYPE_CHECKING:
    from flatbma.family import RunShape


def _set_member(section: Any, key: str, enum: type[Enum]) -> None:
    """Replace the string in ``section.key`` by its ``enum`` member (a frozen dataclass, in ``__post_init__``)."""
    object.__setattr__(section, key, parse_choice(enum, getattr(section, key), key))


def _set_members(section: Any, key: str, enum: type[Enum]) -> None:
    """Replace the list of strings in ``section.key`` by a tuple of ``enum`` members, repeats dropped."""
    values = getattr(section, key)
    if isinstance(values, (str, Enum)) or not isinstance(values, (tuple, list)):
        raise FlatbmaError(f"{key} must be a list (e.g. [{next(iter(enum)).value}]), got {shown(values)}")
    members = []
    for value in values:
        try:
            member = enum(value)
        except (ValueError, TypeError):
            choices = ", ".join(repr(m.value) for m in enum)
            raise FlatbmaError(f"{key} entries must be among {choices}, got {shown(value)}") from None
        if member not in members:
            members.append(member)
    object.__setattr__(section, key, tuple(members))


class Parallel(str, Enum):
    """What the processes of a ``torchrun`` launch share out (``train.parallel``; see ``TrainConfig.parallel``)."""

    DATA = "data"
    MEMBERS = "members"


@dataclass(frozen=True)
class DataConfig:
    """Data set, few-shot protocol, transforms and loaders.

    Attributes:
        name: data set name (``flatbma.data.dataset_names()``).
        root: directory of the files, for data sets that are not embedded.
        k_shot: images per class drawn (by ``seed``) from the training split; ``None`` = all.
        val_per_class: images per class of the k-shot budget held out for validation (0 = none).
        val_pool: images per class drawn for validation from *outside* the k-shot images (all of which then
            train); labels a strict few-shot setting would not have. Not with ``val_per_class``.
        image_size: resize images to this square size.
        to_rgb: repeat a single grey channel to three (for ImageNet backbones).
        normalize: ``"imagenet"`` mean/std normalization, or none.
        augment: random crop (padding 1/8 of the size) and horizontal flip during training.
        batch_size, eval_batch_size: the training mini-batch and the evaluation batch sizes.
        test_limit: evaluate on a seeded stratified subset of this many test images (``None`` = all).
        val_fraction: share of each class of the training split held out for validation without ``k_shot``;
            drawn by ``seed``, stratified, in ``[0, 1)``.
    """

    name: str = "digits"
    root: str | None = None
    k_shot: int | None = None
    val_per_class: int = 0
    image_size: int | None = None
    to_rgb: bool = False
    normalize: Literal["imagenet"] | None = None
    augment: bool = False
    batch_size: int = 64
    eval_batch_size: int = 256
    test_limit: int | None = None
    val_pool: int = added(0)
    val_fraction: float = added(0.0)

    def __post_init__(self) -> None:
        check_positive("k_shot", self.k_shot, allow_none=True)
        check_positive("val_per_class", self.val_per_class, allow_zero=True)
        check_positive("val_pool", self.val_pool, allow_zero=True)
        if self.val_pool and self.val_per_class:
            raise FlatbmaError(
                "give val_per_class (validation out of the k-shot budget) or val_pool (from outside it), not both"
            )
        if not 0 <= self.val_fraction < 1:
            raise FlatbmaError(f"val_fraction must be in [0, 1) (the held-out share), got {self.val_fraction!r}")
        if self.val_fraction and self.k_shot is not None:
            raise FlatbmaError(
                "val_fraction holds out a share of the full training split; with k_shot use val_per_class (out of "
                "the k-shot budget) or val_pool (images outside it)"
            )
        check_positive("image_size", self.image_size, allow_none=True)
        check_positive("batch_size", self.batch_size)
        check_positive("eval_batch_size", self.eval_batch_size)
        check_positive("test_limit", self.test_limit, allow_none=True)

    @property
    def validation(self) -> bool:
        """Whether the run has a validation split (``val_per_class``/``val_pool`` with ``k_shot``, ``val_fraction``)."""
        return (self.k_shot is not None and (self.val_per_class > 0 or self.val_pool > 0)) or self.val_fraction > 0


@dataclass(frozen=True)
class ModelConfig:
    """Network.

    Attributes:
        name: ``mlp``, ``cnn``, ``resnet18``, ``mobilenet_v2``, ``torchvision:<name>``, ``timm:<name>``.
        pretrained: ``"imagenet"`` (offline weights) or a path to a state dict; ``None`` = random init.
        width: base width of the network (model-specific default when ``None``).
        dropout: dropout rate before the classifier.
        trainable: which parameters the method trains (and a posterior makes Bayesian): ``all``,
            ``norm+classifier`` (normalization layers and classifier, by module type — FP-BMA's transfer
            learning) or ``classifier``; the rest stays at its pretrained (or initial) values.
        likelihood: ``categorical`` (a classifier) or ``gaussian`` (regression, :class:`flatbma.regression.Gaussian`:
            the network returns the mean and a raw scale, or the mean alone with ``noise_std``).
        noise_std: with ``gaussian``: ``null`` learns ``σ(x)`` with the weights (two outputs), a positive number
            fixes ``σ`` (one output), in standard deviations of the standardized target.
    """

    name: str = "mlp"
    pretrained: str | None = None
    width: int | None = None
    dropout: float = 0.0
    trainable: Subset = Subset.ALL
    likelihood: Likelihood = added(Likelihood.CATEGORICAL)
    noise_std: float | None = added(None)

    def __post_init__(self) -> None:
        _set_member(self, "trainable", Subset)
        _set_member(self, "likelihood", Likelihood)
        check_positive("width", self.width, allow_none=True)
        if not 0 <= self.dropout < 1:
            raise FlatbmaError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.noise_std is not None:
            if self.likelihood.has_classes:
                raise FlatbmaError("model.noise_std is the Gaussian likelihood's: set model.likelihood: gaussian")
            check_positive("noise_std", self.noise_std)

    @property
    def gaussian(self) -> Gaussian | None:
        """The :class:`~flatbma.regression.Gaussian` likelihood of a regression run, ``None`` for a classifier."""
        return likelihoods.build(self.likelihood, self.noise_std)


class TrainLog(str, Enum):
    """A per-epoch training log written into the run directory (``train.log``; strings and members accepted)."""

    CSV = "csv"
    """``log.csv``: one row per epoch (:mod:`flatbma.experiment.run.logs`)."""
    TENSORBOARD = "tensorboard"
    """TensorBoard event files under ``tensorboard/`` (needs the optional extra ``flatbma[tensorboard]``)."""


class Criterion(str, Enum):
    """What early stopping watches on the validation split (``train.early_stopping.criterion``)."""

    NLL = "nll"
    """The BMA's negative log-likelihood ``−mean log (1/M) Σ_m p(y|x, w_m)``."""
    LOSS = "loss"
    """Each sample's cross-entropy, averaged: ``−mean (1/M) Σ_m log p(y|x, w_m)`` (``E_q[L_val]``; a point estimate's
    equals ``nll``). A regression run's two criteria use the Gaussian ``N(y; μ_m, σ_m²)`` instead."""


@dataclass(frozen=True)
class EarlyStopping:
    """Early stopping on validation (``train.early_stopping``), the protocol of the FP-BMA authors' scripts.

    Every ``every`` epochs (and the last) the posterior is evaluated on the validation split with ``samples``
    samples (BatchNorm statistics recomputed); the best state (smallest ``criterion``, first on ties) is kept in
    ``best.safetensors``, training stops ``patience`` epochs after it, and the run is evaluated at it. The values go
    to ``log.csv`` (``val/nll``, ``val/loss``, ``val/accuracy`` or ``val/rmse``), the best epoch to ``metrics.json``.
    The authors used ``patience`` 50 of 150 epochs and 3 ``samples``.
    """

    criterion: Criterion = Criterion.NLL
    patience: int = 10
    every: int = 1
    samples: int = 3

    def __post_init__(self) -> None:
        _set_member(self, "criterion", Criterion)
        check_positive("patience", self.patience)
        check_positive("every", self.every)
        check_positive("samples", self.samples)
        for key in ("patience", "every", "samples"):
            if not isinstance(getattr(self, key), int):
                raise FlatbmaError(f"{key} must be an integer, got {getattr(self, key)!r}")


@dataclass(frozen=True)
class TrainConfig:
    """Training loop.

    Attributes:
        epochs: passes over the training data.
        checkpoint_every: also checkpoint every this many steps (0 = at epoch ends only).
        device: ``auto`` (CUDA when available), ``cpu``, ``cuda``, ``cuda:1``, ...
        progress: a bar on a terminal, one line per epoch on ``stderr`` elsewhere (``--quiet`` silences it too).
        log: per-epoch logs in the run directory, any of ``csv`` (``log.csv``, default) and ``tensorboard``
            (optional extra ``flatbma[tensorboard]``); ``[]`` writes none.
        parallel: what the processes of a ``torchrun`` launch share out: ``data`` (each process trains the whole
            method on its shard of each global batch) or ``members`` (each trains a disjoint share of the
            posterior's independent members on all the data; methods with members only).
        early_stopping: stop on validation and keep the best state (:class:`EarlyStopping`); ``None``:
            train all ``epochs`` and keep the last.
        precision: of the forward passes in training and in the BMA (:class:`~flatbma.precision.Precision`):
            ``fp32``; ``bf16`` (autocast); ``fp16`` (autocast and a dynamic loss scale whose overflows skip the
            step, :class:`flatbma.optim.LossScaled`).
    """

    epochs: int = 10
    checkpoint_every: int = 0
    device: str = "auto"
    progress: bool = True
    log: tuple[TrainLog, ...] = (TrainLog.CSV,)
    parallel: Parallel = Parallel.DATA
    early_stopping: EarlyStopping | None = added(None)
    precision: Precision = added(Precision.FP32)

    def __post_init__(self) -> None:
        _set_member(self, "parallel", Parallel)
        _set_member(self, "precision", Precision)
        _set_members(self, "log", TrainLog)
        check_positive("epochs", self.epochs)
        check_positive("checkpoint_every", self.checkpoint_every, allow_zero=True)


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation, and the flatness protocol (:func:`flatbma.flatness.flatness_report`), the same for every method.

    Attributes:
        num_samples: posterior samples M in the BMA.
        n_bins: ECE bins.
        flatness: also measure flatness after training (``flatbma evaluate --flatness`` for a finished run).
        flatness_samples: posterior samples whose Hessian is measured (λ₁ per sample, then summarized).
        hessian_k: top Hessian eigenvalues per sample (λ₁ … λ_k); ``k > 1`` adds ``λ₁/λ_k`` where λ_k converged.
        hessian_examples: size of the stratified, un-augmented training subset of the Hessian (``None`` = all).
        hessian_max_iter: cap on the Hessian-vector products of one spectrum; an eigenvalue that has
            not met ``hessian_tol`` by then is reported as unconverged, not averaged.
        hessian_tol: Lanczos stops when ``‖H y − θ y‖ ≤ tol·|θ|``, bounding θ's relative error by ``tol``; 1e-3
            is two orders of magnitude below the spread of λ₁ between posterior samples.
        sharpness_rho: radius of the SAM sharpness ``E_w[max_{‖ε‖≤ρ} L(w+ε) − L(w)]``.
        trace: also estimate the Hessian trace per sample (Hutchinson, ``trace_probes`` products each).
        trace_probes: Rademacher probes per sample of the trace estimate.
        distribution_spectrum: also the spectrum of the averaged Hessian ``E_q[H]`` (one product per sample each).
        repeatability: repeat λ₁ with another measurement seed and draw of samples (doubles the cost of λ₁).
        ood: the OOD set (:mod:`flatbma.ood`): a corruption (test set at severity 5) or another data set's test
            split; AUROCs of predictive entropy and mutual information go to ``metrics["ood"]`` (``None``: none).
    """

    num_samples: int = 30
    n_bins: int = 15
    flatness: bool = False
    flatness_samples: int = 8
    hessian_k: int = 1
    hessian_examples: int | None = None
    hessian_max_iter: int = 100
    hessian_tol: float = 1e-3
    sharpness_rho: float = 0.05
    trace: bool = True
    trace_probes: int = 4
    distribution_spectrum: bool = True
    repeatability: bool = True
    ood: str | None = added(None)

    def __post_init__(self) -> None:
        if self.ood is not None:
            check_ood_name(self.ood)
        for key in (
            "num_samples",
            "n_bins",
            "flatness_samples",
            "hessian_k",
            "hessian_max_iter",
            "hessian_tol",
            "sharpness_rho",
        ):
            check_positive(key, getattr(self, key))
        check_positive("hessian_examples", self.hessian_examples, allow_none=True)
        if self.hessian_max_iter < self.hessian_k:
            raise FlatbmaError(
                f"hessian_max_iter ({self.hessian_max_iter}) must be >= hessian_k ({self.hessian_k}): Lanczos "
                "needs at least one Hessian-vector product per eigenvalue"
            )
        if not self.hessian_tol < 1:
            raise FlatbmaError(f"hessian_tol is a relative tolerance and must be < 1, got {self.hessian_tol!r}")
        if not isinstance(self.trace_probes, int) or isinstance(self.trace_probes, bool) or self.trace_probes < 2:
            raise FlatbmaError(
                f"trace_probes must be an integer >= 2 (Hutchinson probes per sample), got {self.trace_probes!r}"
            )

    def check(self, shape: RunShape, *, flatness: bool) -> None:
        """Refuse settings the run's data sizes make meaningless or impossible (before it trains).

        ``n_bins`` above the test examples (empty bins: binning noise, not calibration), an OOD set unfit for the
        run's channels, and with ``flatness`` a ``hessian_k`` above the trained weights (when ``shape`` knows them).

        Raises:
            FlatbmaError: naming the setting and a value that works.
        """
        if self.n_bins > shape.num_test:
            raise FlatbmaError(
                f"eval.n_bins={self.n_bins} is more than the {shape.num_test} test examples: most calibration bins "
                f"would be empty; use eval.n_bins <= {shape.num_test} (15 suits a thousand examples)"
            )
        if self.ood is not None and shape.channels is not None:
            check_ood_applies(self.ood, shape.channels)
        if flatness and shape.num_trainable is not None and self.hessian_k > shape.num_trainable:
            raise FlatbmaError(
                f"eval.hessian_k={self.hessian_k} eigenvalues were asked for, but the Hessian has only "
                f"{shape.num_trainable} (one per trained weight, model.trainable): use eval.hessian_k <= "
                f"{shape.num_trainable}"
            )
