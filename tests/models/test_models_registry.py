from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.models import build_model, classifier_of, mobilenet_v2, model_names, replace_classifier, resnet18


def _build(name: str, **kwargs: object) -> nn.Module:
    args: dict[str, object] = {"num_classes": 10, "in_channels": 1, "image_size": 8} | kwargs
    return build_model(name, **args)  # type: ignore[arg-type]


def test_model_names() -> None:
    assert model_names() == ("cnn", "mlp", "mobilenet_v2", "resnet18")


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet18", "mobilenet_v2"])
@pytest.mark.parametrize(("channels", "size"), [(1, 8), (3, 28)])
def test_forward_shapes(name: str, channels: int, size: int) -> None:
    width = None if name == "mobilenet_v2" else 4
    model = _build(name, in_channels=channels, image_size=size, width=width, dropout=0.1)
    assert model(torch.randn(2, channels, size, size)).shape == (2, 10)


def test_classifier_of_each_model() -> None:
    names = {n: classifier_of(_build(n, width=None if n == "mobilenet_v2" else 4))[0] for n in model_names()}
    assert names == {
        "mlp": "classifier",
        "cnn": "classifier",
        "resnet18": "fc",
        "mobilenet_v2": "classifier.1",
    }
    with pytest.raises(FlatbmaError, match=r"no nn\.Linear"):
        classifier_of(nn.Sequential(nn.Conv2d(1, 1, 1)))


def test_replace_classifier() -> None:
    model = _build("cnn", width=4)
    head = replace_classifier(model, 3, seed=0)
    assert model.classifier is head and head.out_features == 3
    assert torch.equal(head.weight, replace_classifier(_build("cnn", width=4), 3, seed=0).weight)


def test_resnet_stem_follows_image_size() -> None:
    assert _build("resnet18", width=4, image_size=32).conv1.kernel_size == (3, 3)
    assert _build("resnet18", width=4, image_size=224).conv1.kernel_size == (7, 7)


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet18"])
def test_seeded_build_is_deterministic(name: str) -> None:
    before = torch.get_rng_state()
    a, b = _build(name, width=4, seed=3).state_dict(), _build(name, width=4, seed=3).state_dict()
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is left alone
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = _build(name, width=4, seed=4).state_dict()
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_unknown_name_suggests_closest() -> None:
    with pytest.raises(FlatbmaError, match="Did you mean 'resnet18'"):
        _build("resnet81")
    with pytest.raises(FlatbmaError, match="Did you mean 'mobilenet_v2'"):
        _build("mobilenetv2")
    with pytest.raises(FlatbmaError, match="Did you mean 'timm'"):
        _build("tim:resnet50")


@pytest.mark.parametrize("library", ["torchvision", "timm"])
def test_optional_extras_give_clear_error(library: str) -> None:
    with pytest.raises(FlatbmaError, match=f"needs {library}, an optional extra that is not importable here"):
        _build(f"{library}:resnet50", in_channels=3, image_size=32)


def test_torchvision_names_use_the_library_when_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    def get_model(arch: str, weights: str | None = None, num_classes: int = 1000) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, num_classes))

    fake = types.ModuleType("torchvision")
    fake.models = types.SimpleNamespace(list_models=lambda: ["tiny"], get_model=get_model)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    model = _build("torchvision:tiny", in_channels=3, image_size=4)  # ImageNet weights: test_pretrained_local.py
    assert classifier_of(model)[1].out_features == 10
    with pytest.raises(FlatbmaError, match="Did you mean 'tiny'"):
        _build("torchvision:tinyy", in_channels=3, image_size=4)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "torchvision:resnet18"])
def test_pretrained_imagenet_needs_rgb(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", types.ModuleType("torchvision"))
    with pytest.raises(FlatbmaError, match=r"in_channels=3.*data.to_rgb: true"):
        _build(name, in_channels=1, image_size=28, pretrained="imagenet")


def test_mobilenet_imagenet_through_registry() -> None:
    model = _build("mobilenet_v2", in_channels=3, image_size=32, pretrained="imagenet", seed=0)
    assert classifier_of(model)[1].out_features == 10
    assert model.classifier[0].p == 0.0


def test_resnet_checkpoint_infers_architecture_and_reinitializes_head(tmp_path: Path) -> None:
    source = resnet18(num_classes=7, in_channels=3, width=4, stem="imagenet")
    path = tmp_path / "r18.pth"
    torch.save(source.state_dict(), path)
    model = _build("resnet18", in_channels=3, image_size=32, pretrained=path, seed=0)
    assert model.conv1.kernel_size == (7, 7) and model.fc.out_features == 10
    for key, value in model.state_dict().items():
        if not key.startswith("fc."):
            assert torch.equal(value, source.state_dict()[key]), key
    with pytest.raises(FlatbmaError, match=r"expects 3-channel input.*data.to_rgb"):
        _build("resnet18", in_channels=1, image_size=32, pretrained=path)
    with pytest.raises(FlatbmaError, match="width=8 but checkpoint"):
        _build("resnet18", in_channels=3, image_size=32, pretrained=path, width=8)


def test_resnet_imagenet_without_cached_weights_explains(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    with pytest.raises(FlatbmaError, match=r"resnet18-f37072fd\.pth"):
        _build("resnet18", in_channels=3, image_size=32, pretrained="imagenet")


def test_small_model_checkpoint_roundtrip(tmp_path: Path) -> None:
    source = _build("cnn", width=4, seed=0)
    path = tmp_path / "cnn.pth"
    torch.save(source.state_dict(), path)
    model = _build("cnn", width=4, pretrained=path, seed=1)
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items())
    with pytest.raises(FlatbmaError, match="no ImageNet weights for 'cnn'"):
        _build("cnn", pretrained="imagenet")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_classes": 0},
        {"image_size": -1},
        {"dropout": 1.5},
        {"seed": 1.5},
        {"width": 0},
        {"pretrained": 3},
    ],
)
def test_invalid_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(FlatbmaError):
        _build("cnn", **kwargs)


def test_mobilenet_rejects_width() -> None:
    with pytest.raises(FlatbmaError, match="width"):
        _build("mobilenet_v2", width=4)


def test_mobilenet_checkpoint_path_checks_channels(tmp_path: Path) -> None:
    path = tmp_path / "m.pth"
    torch.save(mobilenet_v2(4, width_mult=1.0).state_dict(), path)
    model = _build("mobilenet_v2", in_channels=3, image_size=32, pretrained=path)
    assert classifier_of(model)[1].out_features == 10
    with pytest.raises(FlatbmaError, match=r"expects 3-channel input.*data.to_rgb"):
        _build("mobilenet_v2", in_channels=1, image_size=32, pretrained=path)
