from __future__ import annotations

import pytest
import torch
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.models import MLP, SmallCNN, classifier_of


@pytest.mark.parametrize(("channels", "size"), [(1, 8), (1, 28), (3, 28)])
def test_mlp_forward_shape(channels: int, size: int) -> None:
    model = MLP(channels * size * size, 10, hidden=(16, 8), dropout=0.1)
    assert model(torch.randn(2, channels, size, size)).shape == (2, 10)
    assert classifier_of(model) == ("classifier", model.classifier)


def test_mlp_without_hidden_layers_is_linear() -> None:
    model = MLP(64, 3, hidden=())
    assert [type(m) for m in model.modules() if isinstance(m, nn.Linear)] == [nn.Linear]
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 3)


@pytest.mark.parametrize(("channels", "size"), [(1, 8), (1, 28), (3, 28)])
def test_small_cnn_forward_shape(channels: int, size: int) -> None:
    model = SmallCNN(channels, 10, width=8)
    assert model(torch.randn(2, channels, size, size)).shape == (2, 10)
    name, head = classifier_of(model)
    assert name == "classifier" and head.in_features == 32


def test_small_cnn_fits_a_tiny_batch() -> None:
    torch.manual_seed(0)
    model = SmallCNN(1, 4, width=8)
    x, y = torch.randn(16, 1, 8, 8), torch.arange(16) % 4
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]


@pytest.mark.parametrize(
    "kwargs",
    [{"num_classes": 0}, {"dropout": 1.0}, {"dropout": -0.1}, {"hidden": (4, 0)}, {"in_features": True}],
)
def test_mlp_rejects_bad_arguments(kwargs: dict[str, object]) -> None:
    args = {"in_features": 4, "num_classes": 2} | kwargs
    with pytest.raises(FlatbmaError):
        MLP(**args)  # type: ignore[arg-type]
