"""Image transforms in plain torch.

Every transform takes a float image ``[C, H, W]`` or a batch ``[N, C, H, W]`` and returns the same rank.
Random transforms draw from an optional ``torch.Generator`` (``None``: the global one), per image of a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from flatbma.checks import check_int, is_int
from flatbma.errors import FlatbmaError, suggest

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Compose",
    "GrayscaleToRGB",
    "Normalize",
    "RandomCrop",
    "RandomHorizontalFlip",
    "Resize",
    "build_transform",
]

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

Transform = Callable[[Tensor], Tensor]


def _as_batch(x: Tensor, who: str) -> tuple[Tensor, bool]:
    """Return ``x`` as ``[N, C, H, W]`` and whether it was a single image."""
    if not isinstance(x, Tensor) or x.ndim not in (3, 4):
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise FlatbmaError(f"{who} expects an image [C, H, W] or a batch [N, C, H, W], got {shape}.")
    return (x.unsqueeze(0), True) if x.ndim == 3 else (x, False)


def _pair(size: int | Sequence[int], what: str) -> tuple[int, int]:
    """Return ``(height, width)`` from an int or a pair of positive ints."""
    pair = (size, size) if is_int(size) else tuple(size)
    if len(pair) != 2 or not all(is_int(s) and s > 0 for s in pair):
        raise FlatbmaError(f"{what} must be a positive int or a (height, width) pair, got {size!r}.")
    return int(pair[0]), int(pair[1])


class Compose:
    """Apply transforms (callables from tensor to tensor) in order."""

    def __init__(self, transforms: Sequence[Transform]) -> None:
        self.transforms = list(transforms)

    def __call__(self, x: Tensor) -> Tensor:
        """Apply every transform in turn."""
        for transform in self.transforms:
            x = transform(x)
        return x

    def __repr__(self) -> str:
        return f"Compose({self.transforms!r})"


class Resize:
    """Resize to a fixed ``(height, width)`` (an int: square) by bilinear interpolation, antialiased when shrinking."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = _pair(size, "Resize size")

    def __call__(self, x: Tensor) -> Tensor:
        """Resize ``x``; a no-op when it already has the target size."""
        batch, single = _as_batch(x, "Resize")
        if tuple(batch.shape[-2:]) == self.size:
            return x
        downscale = batch.shape[-2] > self.size[0] or batch.shape[-1] > self.size[1]
        out = F.interpolate(
            batch if batch.dtype.is_floating_point else batch.float(),
            size=self.size,
            mode="bilinear",
            align_corners=False,
            antialias=downscale,
        )
        return out[0] if single else out

    def __repr__(self) -> str:
        return f"Resize({self.size})"


class GrayscaleToRGB:
    """Repeat a single channel three times; three-channel input passes through unchanged."""

    def __call__(self, x: Tensor) -> Tensor:
        """Return ``x`` with three channels."""
        batch, single = _as_batch(x, "GrayscaleToRGB")
        channels = batch.shape[1]
        if channels == 3:
            return x
        if channels != 1:
            raise FlatbmaError(f"GrayscaleToRGB expects 1 or 3 channels, got {channels}.")
        out = batch.expand(-1, 3, -1, -1).contiguous()
        return out[0] if single else out

    def __repr__(self) -> str:
        return "GrayscaleToRGB()"


class Normalize:
    """Standardize each channel: ``(x - mean[c]) / std[c]``, one ``mean`` and one positive ``std`` per channel."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        if len(self.mean) != len(self.std) or not self.mean:
            raise FlatbmaError(
                f"Normalize needs one mean and one std per channel; got {len(self.mean)} mean(s) and "
                f"{len(self.std)} std(s)."
            )
        if not all(s > 0 for s in self.std):
            raise FlatbmaError(f"Normalize std values must be positive, got {self.std}.")

    def __call__(self, x: Tensor) -> Tensor:
        """Return the normalized image(s)."""
        batch, _ = _as_batch(x, "Normalize")
        if not x.dtype.is_floating_point:
            x = x.float()
        channels = batch.shape[1]
        if channels != len(self.mean):
            hint = (
                " Convert grayscale images to RGB first (data.to_rgb: true in a run config; GrayscaleToRGB, or "
                "build_transform(to_rgb=True))."
                if channels == 1 and len(self.mean) == 3
                else ""
            )
            raise FlatbmaError(
                f"Normalize has {len(self.mean)} channel statistics but the image has {channels} channels." + hint
            )
        shape = (-1, 1, 1)
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(shape)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(shape)
        return (x - mean) / std

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean}, std={self.std})"


class RandomHorizontalFlip:
    """Mirror left-right with probability ``p`` in ``[0, 1]`` (independently per image of a batch)."""

    def __init__(self, p: float = 0.5, generator: torch.Generator | None = None) -> None:
        if not 0.0 <= p <= 1.0:
            raise FlatbmaError(f"RandomHorizontalFlip p must be in [0, 1], got {p}.")
        self.p = float(p)
        self.generator = generator

    def __call__(self, x: Tensor) -> Tensor:
        """Return ``x`` with a random subset of images mirrored."""
        batch, single = _as_batch(x, "RandomHorizontalFlip")
        flip = torch.rand(batch.shape[0], generator=self.generator) < self.p
        out = torch.where(flip.to(batch.device).view(-1, 1, 1, 1), batch.flip(-1), batch)
        return out[0] if single else out

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"


class RandomCrop:
    """Zero-pad every side by ``padding`` pixels, then crop a random ``size`` window (an int: square).

    ``size`` ``None``: the input's size ("pad and crop back"); ``padding`` ``None``: 1/8 of the input's smaller side,
    at least 1 (4 on CIFAR).
    """

    def __init__(
        self, size: int | Sequence[int] | None, padding: int | None = 0, generator: torch.Generator | None = None
    ) -> None:
        self.size = None if size is None else _pair(size, "RandomCrop size")
        if padding is not None:
            check_int(padding, f"RandomCrop padding must be a non-negative int or None, got {padding!r}.", minimum=0)
        self.padding = padding
        self.generator = generator

    def __call__(self, x: Tensor) -> Tensor:
        """Return random crops of ``x``."""
        batch, single = _as_batch(x, "RandomCrop")
        height, width = self.size if self.size is not None else tuple(batch.shape[-2:])
        padding = self.padding if self.padding is not None else max(1, min(batch.shape[-2:]) // 8)
        if padding:
            batch = F.pad(batch, (padding,) * 4)
        padded_h, padded_w = batch.shape[-2:]
        if height > padded_h or width > padded_w:
            raise FlatbmaError(
                f"RandomCrop size {(height, width)} is larger than the padded image {(padded_h, padded_w)}; "
                f"use a smaller size or more padding."
            )
        n = batch.shape[0]
        tops = torch.randint(0, padded_h - height + 1, (n,), generator=self.generator).tolist()
        lefts = torch.randint(0, padded_w - width + 1, (n,), generator=self.generator).tolist()
        crops = [
            batch[i, :, top : top + height, left : left + width]
            for i, (top, left) in enumerate(zip(tops, lefts, strict=True))
        ]
        out = torch.stack(crops)
        return out[0] if single else out

    def __repr__(self) -> str:
        return f"RandomCrop(size={self.size}, padding={self.padding})"


_NORMALIZATIONS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "imagenet": (IMAGENET_MEAN, IMAGENET_STD),
}


def build_transform(
    *,
    size: int | Sequence[int] | None = None,
    to_rgb: bool = False,
    normalize: str | None = None,
    augment: bool = False,
    crop_padding: int | None = None,
    generator: torch.Generator | None = None,
) -> Compose:
    """Build the standard :class:`Compose` pipeline: to RGB, resize, augment, normalize (each optional; none: identity).

    Augmentation (``augment``, training only: pad-and-crop back to the same size, then a horizontal flip with
    probability 1/2) runs after resizing (padding in output pixels) and before normalization (padding is black).
    ``normalize="imagenet"`` standardizes with :data:`IMAGENET_MEAN` / :data:`IMAGENET_STD` (three channels
    required); ``crop_padding`` ``None``: 1/8 of the side.
    """
    steps: list[Transform] = []
    if to_rgb:
        steps.append(GrayscaleToRGB())
    if size is not None:
        steps.append(Resize(size))
    if augment:
        steps.append(RandomCrop(None, padding=crop_padding, generator=generator))
        steps.append(RandomHorizontalFlip(0.5, generator=generator))
    if normalize is not None:
        if normalize not in _NORMALIZATIONS:
            raise FlatbmaError(
                f"unknown normalize option {normalize!r}.{suggest(str(normalize), _NORMALIZATIONS)} "
                f"Use one of {sorted(_NORMALIZATIONS)} or None."
            )
        mean, std = _NORMALIZATIONS[normalize]
        steps.append(Normalize(mean, std))
    return Compose(steps)
