"""Tiny models for CPU tests and small image data sets: an MLP and a small CNN."""

from __future__ import annotations

from torch import Tensor, nn

from flatbma.checks import is_int
from flatbma.errors import FlatbmaError
from flatbma.models._checks import check_dropout, check_positive_int


class MLP(nn.Module):
    """A ReLU multi-layer perceptron on flattened inputs.

    Layout: ``features`` = ``Flatten`` then, per hidden layer, ``Linear → ReLU → Dropout``; then ``classifier``.
    ``in_features`` counts the flattened inputs (``C·H·W`` for images); ``hidden`` may be empty (a linear model).
    """

    def __init__(
        self, in_features: int, num_classes: int, hidden: tuple[int, ...] = (128, 128), dropout: float = 0.0
    ) -> None:
        super().__init__()
        check_positive_int("in_features", in_features)
        check_positive_int("num_classes", num_classes)
        p = check_dropout(dropout)
        if isinstance(hidden, int | str) or not all(is_int(h) and h >= 1 for h in hidden):
            raise FlatbmaError(f"hidden must be a tuple of positive integers, got {hidden!r}.")
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU(), nn.Dropout(p)]
            width = size
        self.in_features = in_features
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Return logits of shape ``(batch, num_classes)`` for inputs of shape ``(batch, ...)``."""
        return self.classifier(self.features(x))


class SmallCNN(nn.Module):
    """Three ``conv3×3 → BatchNorm → ReLU`` blocks, global average pooling and a linear classifier.

    Channels ``width, 2·width, 4·width``; the second and third blocks have stride 2, and any input of at least 1×1
    pixels works. Layout: ``features`` (the blocks), ``pool``, ``dropout``, ``classifier`` (``nn.Linear``).
    """

    def __init__(self, in_channels: int, num_classes: int, width: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        check_positive_int("in_channels", in_channels)
        check_positive_int("num_classes", num_classes)
        check_positive_int("width", width)
        p = check_dropout(dropout)
        channels = (width, 2 * width, 4 * width)
        self.features = nn.Sequential(
            _conv_bn_relu(in_channels, channels[0], stride=1),
            _conv_bn_relu(channels[0], channels[1], stride=2),
            _conv_bn_relu(channels[1], channels[2], stride=2),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(p)
        self.classifier = nn.Linear(channels[2], num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Return logits of shape ``(batch, num_classes)`` for images ``(batch, C, H, W)``."""
        h = self.pool(self.features(x)).flatten(1)
        return self.classifier(self.dropout(h))


def _conv_bn_relu(in_channels: int, out_channels: int, *, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
    )
