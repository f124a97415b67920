"""Typed, frozen run configuration, parsed once from YAML (safe loader) and ``--set`` overrides."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from flatbma import likelihood as likelihoods
from flatbma.errors import FlatbmaError, suggest
from flatbma.experiment.config.entries import first_run_sections
from flatbma.experiment.config.parse import load_yaml, set_dotted, shown
from flatbma.experiment.config.sections import DataConfig, EvalConfig, ModelConfig, TrainConfig
from flatbma.likelihood import Likelihood
from flatbma.methods import MethodConfig, parse_method
from flatbma.optim.config import OptimConfig
from flatbma.options import parse_dataclass, plain, plain_values
from flatbma.prior import PriorConfig, parse_prior


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

    @property
    def epochs(self) -> int:
        """Epochs the run trains: ``train.epochs`` (the schedule's) plus the method's extra ones (e.g. Laplace's)."""
        return self.train.epochs + self.method.extra_epochs()

    def to_dict(self) -> dict[str, Any]:
        """The resolved configuration, every value spelled out (``prior`` only for a two-stage run)."""
        out: dict[str, Any] = {"seed": self.seed, "output_dir": self.output_dir}
        out["method"] = plain_values(self.method.to_dict())
        for section in SECTIONS:
            out[section] = plain(getattr(self, section))
        if self.prior is not None:
            out["prior"] = self.prior.to_dict()
        return out


def missing_options(stored: Any, resolved: Mapping[str, Any], where: str = "") -> list[str]:
    """The dotted keys of ``resolved`` (a run's :meth:`RunConfig.to_dict`) that the ``stored`` config lacks."""
    if not isinstance(stored, Mapping):
        return []
    missing = []
    for key, value in resolved.items():
        path = f"{where}{key}"
        if key not in stored:
            missing.append(path)
        elif isinstance(value, Mapping):
            missing += missing_options(stored[key], value, f"{path}.")
    return missing


def run_identity(resolved: Any) -> Any:
    """A resolved config without ``output_dir`` and ``train.log`` (no number depends on them): the run's identity."""
    if not isinstance(resolved, dict):
        return resolved
    out = {k: v for k, v in resolved.items() if k != "output_dir"}
    if isinstance(out.get("train"), dict):
        out["train"] = {k: v for k, v in out["train"].items() if k != "log"}
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
                f"unknown config key {shown(key)}.{suggest(str(key), TOP_LEVEL)} Valid: {', '.join(sorted(TOP_LEVEL))}"
            )
    if "method" not in raw:
        raise FlatbmaError("the config has no 'method' section: add e.g. 'method: {name: sgd}'")
    sections = {name: parse_dataclass(cls, raw.get(name), name) for name, cls in SECTIONS.items()}
    top = parse_dataclass(_TopLevel, {k: raw[k] for k in ("seed", "output_dir") if k in raw}, "")
    method = parse_method(raw["method"])
    prior = parse_prior(raw.get("prior"), method)
    cfg = RunConfig(method=method, seed=top.seed, output_dir=top.output_dir, prior=prior, **sections)
    check_likelihood(cfg)
    return cfg


CORRUPTIONS_NOT_TABULAR = (
    "compare.corruptions are image corruptions (noise, blur, contrast, … of pixels; Hendrycks & Dietterich 2019): "
    "a regression run's feature vectors (model.likelihood: gaussian) have no image to corrupt: set "
    "compare.corruptions: []"
)
"""Why a regression run takes no corruptions, in one line (the comparison's plan, before anything trains)."""


_MISMATCH = {
    Likelihood.GAUSSIAN: "dataset {name} has regression targets: set model.likelihood: gaussian "
    "(and a model with 2 outputs, or 1 with model.noise_std)",
    Likelihood.CATEGORICAL: "model.likelihood: gaussian needs a regression data set (data.name: diabetes), but {name} "
    "is a classification one: use model.likelihood: categorical",
}
"""What a run whose model's likelihood is not its data's is told, by the data's likelihood."""


def check_likelihood(cfg: RunConfig) -> None:
    """Refuse a likelihood the run's data, method or evaluation cannot take (``model.likelihood``), in one line.

    A regression data set needs ``gaussian``, a classification one ``categorical``. A regression run refuses
    methods without :attr:`~flatbma.family.Family.regression` (Laplace's softmax Gauss-Newton), ``eval.ood``,
    ``data.k_shot`` and the image options.
    """
    data = likelihoods.of_data(cfg.data.name)
    if data is not cfg.model.likelihood:
        raise FlatbmaError(_MISMATCH[data].format(name=repr(cfg.data.name)))
    if data.has_classes:
        return
    for method in (cfg.method, cfg.prior.method if cfg.prior is not None else None):
        if method is not None and not method.regression():
            raise FlatbmaError(
                f"method {method.name!r} cannot fit a regression network (model.likelihood: gaussian): its curvature "
                "is the Gauss-Newton of the softmax; use swag or swag-diag (a Gaussian around SGD) or mfvi instead"
            )
    refused = {
        "eval.ood": cfg.eval.ood is not None,
        "data.k_shot": cfg.data.k_shot is not None,
        **{f"data.{k}": bool(getattr(cfg.data, k)) for k in ("image_size", "to_rgb", "normalize", "augment")},
    }
    for key, given in refused.items():
        if given:
            raise FlatbmaError(f"{key} is not implemented for a regression run (model.likelihood: gaussian): remove it")


@dataclass(frozen=True)
class _TopLevel:
    seed: int = 0
    output_dir: str = "runs/run"

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 2**63:
            raise FlatbmaError(f"seed must be an integer in [0, 2**63), got {self.seed}")
        if not self.output_dir.strip() or "\0" in self.output_dir:
            raise FlatbmaError(f"output_dir must be a directory path, got {shown(self.output_dir)}")
        long = next((part for part in Path(self.output_dir).parts if len(os.fsencode(part)) > NAME_MAX), None)
        if long is not None:
            raise FlatbmaError(
                f"output_dir has a directory name of {len(os.fsencode(long))} bytes ({shown(long, 40)}); file "
                f"systems take at most {NAME_MAX}: choose a shorter output_dir"
            )


NAME_MAX = 255
"""The longest file or directory name, in bytes, on Linux, macOS and Windows file systems."""


def parse_override(item: str) -> tuple[str, Any]:
    """Parse ``key.sub=value`` (the value as YAML: numbers, true/false, null, lists)."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise FlatbmaError(f"--set expects key=value (e.g. --set optim.lr=0.1), got {shown(item)}")
    try:
        value = load_yaml(text, f"--set {key.strip()}") if text else ""
    except (yaml.YAMLError, RecursionError, ValueError) as e:  # ValueError: an integer of > 4300 digits
        if isinstance(e, FlatbmaError):  # an alias bomb is refused, not read as text
            raise
        value = text
    return key.strip(), value


SHIPPED = resources.files("flatbma") / "configs"
"""The ready configs shipped with flatbma (the repository's ``configs/`` is a link to them)."""


def shipped_configs() -> list[str]:
    """The names of the ready configs (``flatbma train --config demo``)."""
    return sorted(p.name[: -len(".yaml")] for p in SHIPPED.iterdir() if p.name.endswith(".yaml"))


def config_path(path: str | Path) -> Path:
    """The file a ``--config`` argument names: a path, or a shipped config's name (``demo``, ``configs/demo.yaml``).

    A path that exists is read as it is; otherwise a bare name (with or without ``.yaml``, or under ``configs/``)
    names a shipped config.
    """
    path = Path(path)
    if path.exists() or path.parent not in (Path("."), Path("configs")) or path.suffix not in ("", ".yaml"):
        return path
    shipped = SHIPPED / f"{path.stem}.yaml"
    return Path(str(shipped)) if shipped.is_file() else path


def load_raw(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file (a path, or a shipped config's name: :func:`config_path`) with the safe loader."""
    path = config_path(path)
    if path.is_dir():
        raise FlatbmaError(f"config file {path} is a directory: give the YAML file (ready configs are in configs/)")
    if path.exists() and not path.is_file():  # a FIFO or a device: reading it could block forever
        raise FlatbmaError(f"config file {path} is not a regular file (a FIFO or a device): give the YAML file")
    if not path.is_file():
        raise FlatbmaError(
            f"config file {path} does not exist; the ready configs (by name, e.g. --config demo): "
            f"{', '.join(shipped_configs())}"
        )
    try:
        raw = load_yaml(path.read_text(), str(path))
    except FlatbmaError:
        raise
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
        raw.update(first_run_sections(methods[0], raw))  # `flatbma train` trains the first one
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    return config_from_dict(raw)
