import pytest
import torch
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.models import mobilenet_v2, resnet18
from flatbma.params import trainable_params
from flatbma.transfer import restrict_trainable, subset_names


def test_resnet_subset_includes_downsample_batchnorms_and_head():
    model = resnet18(num_classes=10, width=8)
    names = subset_names(model, "norm+classifier")
    assert "layer2.0.downsample.1.weight" in names and "layer2.0.downsample.1.bias" in names
    assert {"fc.weight", "fc.bias", "bn1.weight", "layer1.0.bn2.bias"} <= set(names)
    bn_count = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert len(names) == 2 * bn_count + 2
    assert not any("conv" in n for n in names)


def test_selection_is_by_type_not_by_name():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn_like_conv = nn.Conv2d(1, 2, 1)  # name says 'bn', type says conv
            self.norm0 = nn.GroupNorm(1, 2)
            self.ln = nn.LayerNorm(2)
            self.fc_not_last = nn.Linear(2, 2)
            self.head = nn.Linear(2, 3)

    names = subset_names(Odd(), "norm+classifier")
    assert names == ["norm0.weight", "norm0.bias", "ln.weight", "ln.bias", "head.weight", "head.bias"]


def test_restrict_trainable_freezes_the_rest():
    model = mobilenet_v2(num_classes=10)
    n = restrict_trainable(model, subset_names(model, "norm+classifier"))
    params = trainable_params(model)
    assert set(params) == set(subset_names(model, "norm+classifier"))
    assert n == sum(v.numel() for v in params.values()) and 0 < n < 100_000
    assert not model.features[0][0].weight.requires_grad
    with pytest.raises(FlatbmaError, match="unknown parameter"):
        restrict_trainable(model, ["nope"])


def test_frozen_parameters_stay_fixed_through_training(tmp_path):
    from flatbma.experiment.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "method: {name: sgd}\ndata: {name: digits}\nmodel: {name: cnn, width: 4, trainable: norm+classifier}\n"
        f"train: {{epochs: 1, progress: false}}\neval: {{num_samples: 1}}\noutput_dir: {tmp_path / 'run'}\n"
    )
    assert main(["train", "--config", str(cfg)]) == 0
    from tests.helpers import load_state

    state = load_state(tmp_path / "run" / "checkpoint.safetensors")
    assert all(not k.endswith("conv.weight") for k in state.params)
    assert any("classifier" in k for k in state.params)
    assert torch.isfinite(torch.cat([v.flatten() for v in state.params.values()])).all()
