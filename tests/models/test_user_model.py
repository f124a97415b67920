"""``model.name: package.module:factory`` — a researcher's own model from the config (issue #14)."""

import sys
import textwrap

import pytest
import torch
import yaml
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.models import build_model

MODULE = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, num_classes, in_channels, image_size, width=16):
            super().__init__()
            self.width = width
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size**2, width), nn.ReLU())
            self.fc = nn.Linear(width, num_classes)

        def forward(self, x):
            return self.fc(self.body(x))

    def tiny(num_classes):
        return nn.Linear(64, num_classes)

    def not_a_model(num_classes):
        return "model"
    """
)


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    pkg = tmp_path / "mylab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "mylab.models"
    for name in [m for m in sys.modules if m.startswith("mylab")]:
        del sys.modules[name]


def test_the_factory_gets_the_data_shape_and_the_set_options(user_package):
    model = build_model(f"{user_package}:Net", num_classes=4, in_channels=1, image_size=8, width=7, seed=0)
    assert isinstance(model, nn.Module) and model.width == 7 and model.fc.out_features == 4
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 4)
    again = build_model(f"{user_package}:Net", num_classes=4, in_channels=1, image_size=8, width=7, seed=0)
    assert torch.equal(model.fc.weight, again.fc.weight)  # seeded like the built-ins
    tiny = build_model(f"{user_package}:tiny", num_classes=3, in_channels=1, image_size=8)
    assert tiny.out_features == 3  # only the arguments its signature takes


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("nolab.models:Net", {}, "cannot import 'nolab.models'"),
        ("{pkg}:Missing", {}, "has no 'Missing'"),
        ("{pkg}:tiny", {"width": 8}, "takes no 'width'"),
        ("{pkg}:not_a_model", {}, "not a torch.nn.Module"),
        ("math:sqrt", {}, "could not be built"),
        ("{pkg}:Net", {"pretrained": "imagenet", "in_channels": 3}, "no ImageNet weights"),
    ],
)
def test_bad_user_models_end_in_one_clear_error(user_package, name, options, message):
    kwargs = {"num_classes": 4, "in_channels": 1, "image_size": 8, **options}
    with pytest.raises(FlatbmaError, match=message):
        build_model(name.format(pkg=user_package), **kwargs)


def test_train_a_user_model_from_the_cli(user_package, tmp_path, capsys):
    cfg = {
        "output_dir": str(tmp_path / "run"),
        "method": {"name": "sgd"},
        "data": {"name": "digits", "batch_size": 128},
        "model": {"name": f"{user_package}:Net", "width": 8},
        "train": {"epochs": 1, "progress": False},
        "eval": {"num_samples": 1},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(path)]) == 0
    assert "accuracy=" in capsys.readouterr().out
