from __future__ import annotations

import pytest
import torch

from flatbma.errors import FlatbmaError
from flatbma.models import classifier_of, resnet18


def _n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _expected_params(width: int, in_channels: int, num_classes: int, stem_kernel: int) -> int:
    """ResNet-18 parameter count, counted by hand: convs ~ width², BatchNorms and fc ~ width."""
    w = width
    stem = stem_kernel**2 * in_channels * w + 2 * w
    layer1 = 2 * (2 * 9 * w * w + 2 * 2 * w)
    # stage k (channels c_out = 2c_in): first block 3x3 c_in->c_out, 3x3 c_out->c_out, 1x1 shortcut,
    # three BatchNorms; second block two 3x3 c_out->c_out and two BatchNorms.
    later = 0
    for c_in in (w, 2 * w, 4 * w):
        c_out = 2 * c_in
        later += 9 * c_in * c_out + 9 * c_out * c_out + c_in * c_out + 3 * 2 * c_out
        later += 2 * 9 * c_out * c_out + 2 * 2 * c_out
    fc = 8 * w * num_classes + num_classes
    return stem + layer1 + later + fc


@pytest.mark.parametrize(("channels", "size", "stem"), [(3, 8, "cifar"), (1, 28, "cifar"), (3, 28, "imagenet")])
def test_forward_shape(channels: int, size: int, stem: str) -> None:
    model = resnet18(num_classes=7, in_channels=channels, width=4, stem=stem)  # type: ignore[arg-type]
    assert model(torch.randn(2, channels, size, size)).shape == (2, 7)


def test_torchvision_names() -> None:
    keys = set(resnet18(width=4).state_dict())
    for key in (
        "conv1.weight",
        "bn1.running_var",
        "layer1.0.conv1.weight",
        "layer1.0.bn1.weight",
        "layer2.0.downsample.0.weight",
        "layer2.0.downsample.1.running_mean",
        "layer4.1.bn2.num_batches_tracked",
        "fc.weight",
        "fc.bias",
    ):
        assert key in keys
    assert not any("layer1.0.downsample" in k for k in keys)
    assert classifier_of(resnet18(width=4))[0] == "fc"


def test_imagenet_configuration_has_torchvision_parameter_count() -> None:
    # torchvision.models.resnet18() has 11,689,512 parameters.
    model = resnet18(num_classes=1000, width=64, stem="imagenet")
    assert _n_params(model) == 11_689_512 == _expected_params(64, 3, 1000, 7)
    assert model.conv1.kernel_size == (7, 7) and model.conv1.stride == (2, 2)


@pytest.mark.parametrize("width", [4, 8, 16])
def test_width_scaling(width: int) -> None:
    model = resnet18(num_classes=10, in_channels=1, width=width, stem="cifar")
    assert _n_params(model) == _expected_params(width, 1, 10, 3)
    assert model.fc.in_features == 8 * width
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)


def test_unknown_stem_suggests() -> None:
    with pytest.raises(FlatbmaError, match="Did you mean 'imagenet'"):
        resnet18(stem="imagenett")  # type: ignore[arg-type]
