"""Typed, frozen run configuration, parsed once from YAML (safe loader) and ``--set`` overrides."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

from flatbma.errors import FlatbmaError, suggest
from flatbma.experiment.methods import METHODS, MethodConfig, parse_method, prior_methods
from flatbma.experiment.parse import parse_dataclass, set_dotted

_FLOAT32_MAX = 3.4028234663852886e38


def _positive(where: str, value: float | None, *, allow_none: bool = False, allow_zero: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = value is not None and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise FlatbmaError(f"{where} must be {bound}, got {value!r}")
    if not math.isfinite(value) or value > _FLOAT32_MAX:  # the values meet float32 tensors
        raise FlatbmaError(f"{where} must be a finite number below 3.4e38 (float32 range), got {value!r}")


@dataclass(frozen=True)
class DataConfig:
    """Data set, few-shot protocol, transforms and loaders.

    Attributes:
        name: data set name (``flatbma.data.dataset_names()``).
        root: directory of the files, for data sets that are not embedded.
        k_shot: images per class drawn (by ``seed``) from the training split; ``None`` = all.
        val_per_class: images per class of the k-shot budget held out for validation (0 = none).
        image_size: resize images to this square size.
        to_rgb: repeat a single grey channel to three (for ImageNet backbones).
        normalize: ``"imagenet"`` mean/std normalization, or none.
        augment: random crop (padding 1/8 of the size) and horizontal flip during training.
        batch_size: training mini-batch size.
        eval_batch_size: evaluation batch size.
        test_limit: evaluate on a seeded stratified subset of this many test images (``None`` = all).
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

    def __post_init__(self) -> None:
        _positive("k_shot", self.k_shot, allow_none=True)
        _positive("val_per_class", self.val_per_class, allow_zero=True)
        _positive("image_size", self.image_size, allow_none=True)
        _positive("batch_size", self.batch_size)
        _positive("eval_batch_size", self.eval_batch_size)
        _positive("test_limit", self.test_limit, allow_none=True)


@dataclass(frozen=True)
class ModelConfig:
    """Network.

    Attributes:
        name: ``mlp``, ``cnn``, ``resnet18``, ``mobilenet_v2``, ``torchvision:<name>``, ``timm:<name>``.
        pretrained: ``"imagenet"`` (offline weights) or a path to a state dict; ``None`` = random init.
        width: base width of the network (model-specific default when ``None``).
        dropout: dropout rate before the classifier.
        trainable: which parameters the method trains (and, for a posterior, makes Bayesian):
            ``all``, ``norm+classifier`` (every normalization layer and the classifier, selected by
            module type — FP-BMA's Bayesian transfer learning) or ``classifier``; the rest stays at
            its pretrained (or initial) values.
    """

    name: str = "mlp"
    pretrained: str | None = None
    width: int | None = None
    dropout: float = 0.0
    trainable: Literal["all", "norm+classifier", "classifier"] = "all"

    def __post_init__(self) -> None:
        _positive("width", self.width, allow_none=True)
        if not 0 <= self.dropout < 1:
            raise FlatbmaError(f"dropout must be in [0, 1), got {self.dropout!r}")


@dataclass(frozen=True)
class OptimConfig:
    """Descent optimizer of the trained variables.

    Attributes:
        name: ``sgd`` (momentum, coupled weight decay) or ``adam`` (decoupled weight decay).
        lr: peak learning rate.
        momentum: SGD momentum.
        weight_decay: weight decay.
        nesterov: Nesterov momentum (SGD).
        schedule: ``cosine`` decay to 0 over training, or ``constant``.
        warmup_epochs: linear warm-up length in epochs.
    """

    name: Literal["sgd", "adam"] = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nesterov: bool = False
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_epochs: float = 0.0

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        _positive("weight_decay", self.weight_decay, allow_zero=True)
        _positive("warmup_epochs", self.warmup_epochs, allow_zero=True)
        if not 0 <= self.momentum < 1:
            raise FlatbmaError(f"momentum must be in [0, 1), got {self.momentum!r}")


@dataclass(frozen=True)
class TrainConfig:
    """Training loop.

    Attributes:
        epochs: passes over the training data.
        checkpoint_every: also checkpoint every this many steps (0 = at epoch ends only).
        device: ``auto`` (CUDA when available), ``cpu``, ``cuda``, ``cuda:1``, ...
        progress: show progress bars.
        parallel: what the processes of a ``torchrun`` launch share out: ``data`` (every process
            trains all of the method on its shard of each global batch) or ``members`` (each trains a
            disjoint share of the posterior's independent members, e.g. ensemble members, on all the
            data; only for methods with members). See :mod:`flatbma.experiment.distributed`.
    """

    epochs: int = 10
    checkpoint_every: int = 0
    device: str = "auto"
    progress: bool = True
    parallel: Literal["data", "members"] = "data"

    def __post_init__(self) -> None:
        _positive("epochs", self.epochs)
        _positive("checkpoint_every", self.checkpoint_every, allow_zero=True)


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation.

    Attributes:
        num_samples: posterior samples M in the BMA.
        n_bins: ECE bins.
        flatness: also measure flatness after training (``flatbma evaluate --flatness`` does it
            for a finished run).
        flatness_samples: posterior samples whose Hessian spectra are computed.
        hessian_k: number of top Hessian eigenvalues (λ₁ … λ_k; ``λ₁/λ_k`` is reported).
        hessian_examples: training examples (without augmentation) the Hessian is taken over.
        hessian_max_iter: Lanczos iterations (Hessian-vector products) per spectrum.
        sharpness_rho: radius of the SAM sharpness ``E_w[max_{‖ε‖≤ρ} L(w+ε) − L(w)]``.
    """

    num_samples: int = 30
    n_bins: int = 15
    flatness: bool = False
    flatness_samples: int = 5
    hessian_k: int = 5
    hessian_examples: int = 512
    hessian_max_iter: int = 100
    sharpness_rho: float = 0.05

    def __post_init__(self) -> None:
        for key in (
            "num_samples",
            "n_bins",
            "flatness_samples",
            "hessian_k",
            "hessian_examples",
            "hessian_max_iter",
            "sharpness_rho",
        ):
            _positive(key, getattr(self, key))


@dataclass(frozen=True)
class PriorConfig:
    """The first stage of a two-stage run: a Gaussian posterior fitted on the run's (target) data.

    It becomes the prior ``p`` in ``KL(q_θ ‖ p)`` and the initialization of the run's method.

    This is the Bayesian transfer-learning pipeline of SA-BMA / FP-BMA (Lim et al., UAI 2025): SWAG on
    the target data → FP-BMA with the SWAG prior, started at the SWAG posterior → BMA. The stage trains
    into ``<output_dir>/prior`` (a run directory of its own, with its own BMA metrics) and is reused
    when it has already finished with the same config.

    Attributes:
        method: the first stage's method; its posterior must be a low-rank plus diagonal Gaussian
            (swag, f-swag, lowrank-vi, fp-bma, ...), e.g. ``{name: swag, rank: 5}``.
        epochs: training epochs of the first stage.
        optim: the first stage's optimizer; the run's ``optim`` section when ``None``.
        init: start the run's method at the fitted posterior (its ``method.rank`` must then equal the
            number of deviation columns the first stage collected); otherwise only the prior is used.
        min_std: floor of the fitted Gaussian's diagonal standard deviations ``σ`` (prior and start).
            SWAG's ``σ`` is ~0 for weights the snapshots barely move, and ``KL(q ‖ p)`` then has
            curvature ``κ/(n σ²)`` in ``μ``: gradient descent with learning rate ``lr`` is stable only
            for ``σ² > κ·lr/(2n)``, which this floor secures for usual ``lr`` and ``n``.
    """

    method: MethodConfig
    epochs: int = 10
    optim: OptimConfig | None = None
    init: bool = True
    min_std: float = 0.01

    def __post_init__(self) -> None:
        _positive("prior.epochs", self.epochs)
        _positive("prior.min_std", self.min_std)

    def to_dict(self) -> dict[str, Any]:
        """The resolved section."""
        optim = dataclasses.asdict(self.optim) if self.optim is not None else None
        return {
            "method": self.method.to_dict(),
            "epochs": self.epochs,
            "optim": optim,
            "init": self.init,
            "min_std": self.min_std,
        }


@dataclass(frozen=True)
class _PriorOptions:
    epochs: int = 10
    init: bool = True
    min_std: float = PriorConfig.min_std


def parse_prior(data: Any, method: MethodConfig) -> PriorConfig | None:
    """Parse the ``prior`` section (``None`` or absent: a one-stage run) for the run's ``method``."""
    if data is None:
        return None
    if not isinstance(data, dict) or "method" not in data:
        raise FlatbmaError(
            "prior must be a mapping with a 'method' key, e.g. prior: {method: {name: swag, rank: 5}, epochs: 10}"
        )
    if METHODS[method.name].with_prior is None:
        raise FlatbmaError(
            f"method {method.name!r} takes no Gaussian prior, so the prior section does not apply to it: use one of "
            f"{', '.join(prior_methods())} or remove the prior section"
        )
    stage = parse_method(data["method"], "prior.method")
    if not stage_has_gaussian(stage):
        raise FlatbmaError(
            f"prior.method {stage.name!r} is not a low-rank plus diagonal Gaussian posterior, so it cannot serve as "
            f"a prior: use one of {', '.join(gaussian_methods())}"
        )
    rest = parse_dataclass(_PriorOptions, {k: v for k, v in data.items() if k not in ("method", "optim")}, "prior")
    optim = parse_dataclass(OptimConfig, data["optim"], "prior.optim") if data.get("optim") is not None else None
    ranks = (method.options.get("rank"), stage.options.get("rank"))
    if rest.init and None not in ranks and ranks[0] != ranks[1]:
        raise FlatbmaError(
            f"prior.init starts {method.name} at the fitted prior, so method.rank ({ranks[0]}) must equal "
            f"prior.method.rank ({ranks[1]}): set both to the same K, or prior.init: false"
        )
    return PriorConfig(method=stage, epochs=rest.epochs, optim=optim, init=rest.init, min_std=rest.min_std)


def stage_has_gaussian(method: MethodConfig) -> bool:
    """Whether ``method`` builds a posterior with a :attr:`~flatbma.types.Posterior.gaussian`.

    Probed on a tiny classifier: building a method validates its options and touches no data.
    """
    from flatbma.optim import SGD
    from flatbma.params import Objective

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    return method.build(Objective(model=model), SGD(lr=0.1)).gaussian is not None


def gaussian_methods() -> list[str]:
    """Names of the methods (with default options) whose posterior can serve as a ``prior`` stage."""
    found = []
    for name in METHODS:
        try:
            if stage_has_gaussian(parse_method(name)):
                found.append(name)
        except FlatbmaError:
            continue
    return found


@dataclass(frozen=True)
class RunConfig:
    """A whole run: ``flatbma train --config FILE`` parses one of these.

    Attributes:
        method: the method (``flatbma methods``) and its options.
        seed: seed of initialization, k-shot draw, data order and posterior sampling.
        output_dir: the run directory.
        prior: the first stage of a two-stage run (:class:`PriorConfig`), or ``None``.
    """

    method: MethodConfig
    seed: int = 0
    output_dir: str = "runs/run"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    prior: PriorConfig | None = None

    def to_dict(self) -> dict[str, Any]:
        """The resolved configuration, every value spelled out (``prior`` only for a two-stage run)."""
        out: dict[str, Any] = {"seed": self.seed, "output_dir": self.output_dir}
        out["method"] = self.method.to_dict()
        for section in ("data", "model", "optim", "train", "eval"):
            out[section] = dataclasses.asdict(getattr(self, section))
        if self.prior is not None:
            out["prior"] = self.prior.to_dict()
        return out


SECTIONS = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig, "train": TrainConfig, "eval": EvalConfig}
TOP_LEVEL = {"seed", "output_dir", "method", "prior", *SECTIONS}


def config_from_dict(raw: Any) -> RunConfig:
    """Validate a plain mapping into a :class:`RunConfig`."""
    if not isinstance(raw, dict):
        raise FlatbmaError("the config must be a YAML mapping with sections method, data, model, ...")
    for key in raw:
        if key not in TOP_LEVEL:
            raise FlatbmaError(
                f"unknown config key '{key}'.{suggest(str(key), TOP_LEVEL)} Valid: {', '.join(sorted(TOP_LEVEL))}"
            )
    if "method" not in raw:
        raise FlatbmaError("the config has no 'method' section: add e.g. 'method: {name: sgd}'")
    sections = {name: parse_dataclass(cls, raw.get(name), name) for name, cls in SECTIONS.items()}
    top = parse_dataclass(_TopLevel, {k: raw[k] for k in ("seed", "output_dir") if k in raw}, "")
    method = parse_method(raw["method"])
    prior = parse_prior(raw.get("prior"), method)
    return RunConfig(method=method, seed=top.seed, output_dir=top.output_dir, prior=prior, **sections)


@dataclass(frozen=True)
class _TopLevel:
    seed: int = 0
    output_dir: str = "runs/run"

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 2**63:
            raise FlatbmaError(f"seed must be an integer in [0, 2**63), got {self.seed}")
        if not self.output_dir.strip() or "\0" in self.output_dir:
            raise FlatbmaError(f"output_dir must be a directory path, got {self.output_dir!r}")


def parse_override(item: str) -> tuple[str, Any]:
    """Parse ``key.sub=value`` (the value as YAML: numbers, true/false, null, lists)."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise FlatbmaError(f"--set expects key=value (e.g. --set optim.lr=0.1), got {item!r}")
    try:
        value = yaml.safe_load(text) if text else ""
    except (yaml.YAMLError, RecursionError, ValueError):  # ValueError: an integer of > 4300 digits
        value = text
    return key.strip(), value


def load_raw(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file with the safe loader."""
    path = Path(path)
    if not path.is_file():
        raise FlatbmaError(f"config file {path} does not exist (ready configs are in configs/)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise FlatbmaError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    except UnicodeDecodeError:
        raise FlatbmaError(f"{path} is not a text (YAML) file") from None
    except RecursionError:
        raise FlatbmaError(f"{path} nests lists or mappings too deeply to be a config") from None
    except OSError as e:
        raise FlatbmaError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise FlatbmaError(f"{path} holds a value YAML cannot read: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise FlatbmaError(f"{path} must hold a YAML mapping (sections method, data, model, ...)")
    return raw


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Load ``path`` (or start from defaults when ``None``), apply ``--set`` overrides, validate."""
    raw = load_raw(path) if path is not None else {}
    compare = raw.pop("compare", None)  # a compare config's shared sections are a run config
    methods = compare.get("methods") if isinstance(compare, dict) else None
    if isinstance(methods, list) and methods and "method" not in raw:
        raw["method"] = methods[0]  # `flatbma train` on a compare config trains its first method
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    return config_from_dict(raw)
