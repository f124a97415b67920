"""``torchvision:<arch>`` / ``timm:<arch>`` pretrained weights come from local files only (issue #14).

torchvision and timm are not installed here (they would pull a CUDA torch): fake modules stand in for
them and record every call that would download — torchvision's ``get_model(weights=...)``, timm's
``create_model(pretrained=True)`` — and torch's own download helpers are made to fail loudly.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.models import build_model, classifier_of

URL = "https://download.pytorch.org/models/tiny-0123abcd.pth"


def _tiny(num_classes: int = 1000) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 6), nn.ReLU(), nn.Linear(6, num_classes))


@pytest.fixture
def downloads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every attempted download, by what attempted it; torch.hub's downloaders fail the test."""
    calls: list[str] = []

    def refuse(name: str) -> Callable[..., None]:
        def download(*args: object, **kwargs: object) -> None:
            calls.append(name)
            raise AssertionError(f"{name} was called: flatbma must never download")

        return download

    for name in ("load_state_dict_from_url", "download_url_to_file"):
        monkeypatch.setattr(torch.hub, name, refuse(f"torch.hub.{name}"))
    return calls


@pytest.fixture
def fake_torchvision(monkeypatch: pytest.MonkeyPatch, downloads: list[str]) -> types.ModuleType:
    def get_model(arch: str, weights: object = None, num_classes: int = 1000) -> nn.Module:
        if weights is not None:
            downloads.append(f"torchvision get_model(weights={weights!r})")
        return _tiny(num_classes)

    def get_model_weights(arch: str) -> object:
        return types.SimpleNamespace(DEFAULT=types.SimpleNamespace(url=URL))

    fake = types.ModuleType("torchvision")
    fake.models = types.SimpleNamespace(  # type: ignore[attr-defined]
        list_models=lambda: ["tiny"], get_model=get_model, get_model_weights=get_model_weights
    )
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    return fake


@pytest.fixture
def fake_timm(monkeypatch: pytest.MonkeyPatch, downloads: list[str]) -> types.ModuleType:
    def create_model(arch: str, pretrained: bool = False, num_classes: int = 1000, **kwargs: object) -> nn.Module:
        if pretrained:
            downloads.append("timm create_model(pretrained=True)")
        model = _tiny(num_classes)
        model.pretrained_cfg = {"hf_hub_id": f"timm/{arch}.in1k"}  # what timm attaches to its models
        return model

    fake = types.ModuleType("timm")
    fake.list_models = lambda: ["tiny"]  # type: ignore[attr-defined]
    fake.create_model = create_model  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "timm", fake)
    return fake


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty torch hub cache in a temporary folder."""
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    return tmp_path / "hub" / "checkpoints"


def _build(name: str, **kwargs: object) -> nn.Module:
    args: dict[str, object] = {"num_classes": 10, "in_channels": 3, "image_size": 4, "seed": 0} | kwargs
    return build_model(name, **args)  # type: ignore[arg-type]


def _imagenet_file(path: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    state = _tiny(1000).state_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return state


def _check_loaded(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every tensor but the classifier's is the file's; the classifier has the new class count."""
    assert classifier_of(model) == ("3", model[3]) and model[3].out_features == 10
    for key, value in model.state_dict().items():
        if not key.startswith("3."):
            assert torch.equal(value, state[key]), key


def test_torchvision_imagenet_without_a_local_file_says_where_to_put_it(fake_torchvision, hub, downloads):
    with pytest.raises(FlatbmaError) as info:
        _build("torchvision:tiny", pretrained="imagenet")
    message = str(info.value)
    assert "\n" not in message and "flatbma never downloads" in message
    assert f"put {URL} at '{hub / 'tiny-0123abcd.pth'}'" in message and "model.pretrained" in message
    assert downloads == []


def test_torchvision_imagenet_loads_the_file_in_the_hub_cache(fake_torchvision, hub, downloads):
    state = _imagenet_file(hub / "tiny-0123abcd.pth")
    _check_loaded(_build("torchvision:tiny", pretrained="imagenet"), state)
    assert downloads == []


def test_torchvision_without_weight_metadata_asks_for_a_path(fake_torchvision, hub, downloads):
    del fake_torchvision.models.get_model_weights  # e.g. an older torchvision
    with pytest.raises(FlatbmaError, match=r"never downloads weights\): save its ImageNet state dict"):
        _build("torchvision:tiny", pretrained="imagenet")
    assert downloads == []


@pytest.mark.parametrize("library", ["torchvision", "timm"])
def test_a_local_weights_path_is_loaded_weights_only(library, fake_torchvision, fake_timm, tmp_path, downloads):
    state = _imagenet_file(tmp_path / "weights.pth")
    _check_loaded(_build(f"{library}:tiny", pretrained=tmp_path / "weights.pth"), state)
    assert downloads == []
    torch.save({"model": _tiny(1000)}, tmp_path / "pickled.pth")  # a pickled module: refused, not unpickled
    with pytest.raises(FlatbmaError, match="refused to load checkpoint"):
        _build(f"{library}:tiny", pretrained=tmp_path / "pickled.pth")


def test_timm_imagenet_never_downloads_and_asks_for_a_path(fake_timm, hub, downloads):
    with pytest.raises(FlatbmaError) as info:
        _build("timm:tiny", pretrained="imagenet")
    message = str(info.value)
    assert "\n" not in message and "flatbma never downloads" in message and "model.pretrained" in message
    assert "https://huggingface.co/timm/tiny.in1k" in message
    assert downloads == []


def test_the_cli_ends_in_one_line_and_exit_2(fake_torchvision, hub, downloads, tmp_path, capsys):
    cfg = {
        "output_dir": str(tmp_path / "run"),
        "method": {"name": "sgd"},
        "data": {"name": "digits", "to_rgb": True},
        "model": {"name": "torchvision:tiny", "pretrained": "imagenet"},
        "train": {"epochs": 1, "progress": False},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flatbma: error: no local ImageNet weights for 'torchvision:tiny'")
    assert downloads == []
