"""ResNet-18 with torchvision's parameter names and a CIFAR or ImageNet stem.

He et al., "Deep Residual Learning for Image Recognition", CVPR 2016. Module names follow
``torchvision.models.ResNet`` exactly, so torchvision-style state dicts load unchanged; the one addition is a
parameter-free ``dropout`` before ``fc``.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from flatbma.errors import FlatbmaError, suggest
from flatbma.models._checks import check_dropout, check_positive_int

Stem = Literal["cifar", "imagenet"]
_STEMS = ("cifar", "imagenet")


class BasicBlock(nn.Module):
    """Two 3×3 conv-BN layers with an identity (or 1×1 conv-BN ``downsample``) shortcut; ``stride`` is the first's."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Sequential | None = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: Tensor) -> Tensor:
        """Return ``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


class ResNet(nn.Module):
    """A ResNet of :class:`BasicBlock` stages with channels ``width·(1, 2, 4, 8)``.

    ``blocks`` counts the blocks per stage (``(2, 2, 2, 2)`` for ResNet-18); ``width`` is the channels of the stem
    and the first stage; ``stem`` is ``"cifar"`` (a 3×3 stride-1 convolution, no max-pool, for 32×32 inputs) or
    ``"imagenet"`` (a 7×7 stride-2 convolution, then a 3×3 stride-2 max-pool); ``dropout`` acts before ``fc``.
    """

    def __init__(
        self,
        blocks: tuple[int, int, int, int],
        num_classes: int,
        in_channels: int,
        width: int,
        stem: Stem,
        dropout: float,
    ) -> None:
        super().__init__()
        check_positive_int("num_classes", num_classes)
        check_positive_int("in_channels", in_channels)
        check_positive_int("width", width)
        p = check_dropout(dropout)
        if stem not in _STEMS:
            raise FlatbmaError(f"unknown ResNet stem {stem!r}; use one of {list(_STEMS)}.{suggest(stem, _STEMS)}")
        self.stem = stem
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
            self.maxpool: nn.Module = nn.MaxPool2d(3, stride=2, padding=1)
        else:
            self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.layer1 = self._stage(width, width, blocks[0], stride=1)
        self.layer2 = self._stage(width, 2 * width, blocks[1], stride=2)
        self.layer3 = self._stage(2 * width, 4 * width, blocks[2], stride=2)
        self.layer4 = self._stage(4 * width, 8 * width, blocks[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(p)
        self.fc = nn.Linear(8 * width, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    @staticmethod
    def _stage(in_planes: int, planes: int, n: int, *, stride: int) -> nn.Sequential:
        layers = [BasicBlock(in_planes, planes, stride)]
        layers += [BasicBlock(planes, planes, 1) for _ in range(n - 1)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Return logits of shape ``(batch, num_classes)`` for images ``(batch, C, H, W)``."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.dropout(self.avgpool(x).flatten(1)))


def resnet18(
    num_classes: int = 10,
    in_channels: int = 3,
    width: int = 64,
    stem: Stem = "cifar",
    *,
    dropout: float = 0.0,
) -> ResNet:
    """ResNet-18: :class:`ResNet` with two :class:`BasicBlock` per stage.

    Arguments as :class:`ResNet`'s (the parameter count grows as ``width²``); initialized like torchvision's. With
    ``width=64, stem="imagenet", num_classes=1000`` the state dict equals torchvision's ``resnet18`` key for key.
    """
    return ResNet((2, 2, 2, 2), num_classes, in_channels, width, stem, dropout)
