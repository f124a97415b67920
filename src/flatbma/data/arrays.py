"""The in-memory data set every loader returns: :class:`ArrayDataset`, :class:`DatasetSplits`, and their checks.

An :class:`ArrayDataset` holds ``[N, C, H, W]`` images (``uint8`` or float in ``[0, 1]``), int64 labels and its
class list, checked when built; a :class:`DatasetSplits` pairs train and test parts sharing one class list and
image shape. :func:`check_learnable` refuses data a classifier cannot be trained on.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from flatbma.checks import shown
from flatbma.errors import FlatbmaError

__all__ = ["ArrayDataset", "DatasetSplits", "Transform", "check_learnable"]

Transform = Callable[[Tensor], Tensor]


# ---------------------------------------------------------------------------------------------------
# Containers
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False, repr=False)
class ArrayDataset(Dataset[tuple[Tensor, int]]):
    """Images and labels held in memory.

    Item ``i`` is ``(image, label)``: the image as float32 ``[C, H, W]`` in ``[0, 1]`` (``uint8`` divided by 255)
    passed through ``transform``, the label as an ``int``.

    Args:
        images: ``[N, C, H, W]``, ``uint8`` (0-255) or floating point in ``[0, 1]`` (stored as float32).
        labels: ``[N]`` integer class indices in ``[0, len(classes))`` (stored as int64).
        classes: Class names; index ``c`` names label ``c``. A class may have no examples.
        transform: Applied to each float image.

    Raises:
        FlatbmaError: Wrong ranks, dtypes or lengths, bad labels or pixels, or an empty or duplicated class list.
    """

    images: Tensor
    labels: Tensor
    classes: list[str]
    transform: Transform | None = field(default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "images", _check_images(self.images))
        object.__setattr__(self, "classes", _check_classes(self.classes))
        object.__setattr__(self, "labels", _check_labels(self.labels, len(self.images), self.classes))
        if self.transform is not None and not callable(self.transform):
            raise FlatbmaError(f"transform must be callable or None, got {type(self.transform).__name__}.")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        image = self.images[index]
        image = image.float().div_(255.0) if image.dtype == torch.uint8 else image.clone()
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])

    def __repr__(self) -> str:
        return (
            f"ArrayDataset(n={len(self)}, image_shape={self.image_shape}, dtype={self.images.dtype}, "
            f"num_classes={self.num_classes}, transform={self.transform!r})"
        )

    @property
    def num_classes(self) -> int:
        """Number of classes (the length of :attr:`classes`)."""
        return len(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """Stored ``(C, H, W)`` (before ``transform``)."""
        channels, height, width = self.images.shape[1:]
        return int(channels), int(height), int(width)

    def subset(self, indices: Tensor | Sequence[int] | np.ndarray) -> ArrayDataset:
        """The examples at non-negative integer ``indices`` (in order; no mask), with the same classes and transform."""
        idx = torch.as_tensor(np.asarray(indices) if not isinstance(indices, Tensor) else indices)
        if idx.ndim != 1 or (idx.numel() and (idx.dtype == torch.bool or idx.dtype.is_floating_point)):
            raise FlatbmaError(
                f"subset indices must be a 1-D sequence of integers, got shape {tuple(idx.shape)} and dtype "
                f"{idx.dtype}. For a boolean mask use mask.nonzero().flatten()."
            )
        idx = idx.to(torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(self)):
            bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
            raise FlatbmaError(f"subset index {bad} is out of range for a dataset of {len(self)} examples.")
        return ArrayDataset(self.images[idx], self.labels[idx], self.classes, self.transform)

    def with_transform(self, transform: Transform | None) -> ArrayDataset:
        """Return the same data with ``transform`` (which replaces the current one)."""
        return ArrayDataset(self.images, self.labels, self.classes, transform)


@dataclass(frozen=True)
class DatasetSplits:
    """The train and test parts of a dataset, sharing one class list.

    Attributes:
        train: Training examples (few-shot subsets and validation sets are drawn from here).
        test: Held-out evaluation examples, never used for model selection.
        name: Registry name of the dataset.

    Raises:
        FlatbmaError: an empty split, or class lists or image shapes that differ between the splits.
    """

    train: ArrayDataset
    test: ArrayDataset
    name: str

    def content(self) -> tuple[bytes, list[Tensor]]:
        """What identifies the data (a run's data fingerprint): its class list, both splits' images and labels."""
        tensors = [t for s in (self.train, self.test) for t in (s.images, s.labels)]
        return json.dumps(self.train.classes).encode(), tensors

    def __post_init__(self) -> None:
        for split, data in (("train", self.train), ("test", self.test)):
            if len(data) == 0:
                raise FlatbmaError(
                    f"dataset '{self.name}': the {split} split has no examples; check that its files hold images."
                )
        if self.train.classes != self.test.classes:
            raise FlatbmaError(
                f"dataset '{self.name}': train and test class lists differ ({self.train.classes} vs "
                f"{self.test.classes}); both splits must use the same label indices."
            )
        if self.train.image_shape != self.test.image_shape:
            raise FlatbmaError(
                f"dataset '{self.name}': train images are {self.train.image_shape} but test images are "
                f"{self.test.image_shape}."
            )


def check_learnable(splits: DatasetSplits) -> None:
    """Refuse data a classifier cannot be trained on: fewer than two classes, or a class without a training example.

    Such data (a class folder with only test images, a partial copy) would report numbers for unseen classes; the
    ``FlatbmaError`` names the classes and what to do.
    """
    classes = splits.train.classes
    if len(classes) < 2:
        raise FlatbmaError(
            f"dataset '{splits.name}' has {len(classes)} class ({shown(classes[0], 40)}): a classifier needs at "
            "least two; add the other classes' examples"
        )
    counts = torch.bincount(splits.train.labels, minlength=len(classes))
    empty = [classes[c] for c in range(len(classes)) if int(counts[c]) == 0]
    if empty:
        one = len(empty) == 1
        raise FlatbmaError(
            f"dataset '{splits.name}': {len(empty)} of its {len(classes)} classes {'has' if one else 'have'} no "
            f"training example ({shown(empty, 60)}), so the model could never learn {'it' if one else 'them'}: "
            "add training examples, or remove the class from the data"
        )


def _check_images(images: object) -> Tensor:
    if not isinstance(images, Tensor):
        raise FlatbmaError(f"images must be a torch.Tensor [N, C, H, W], got {type(images).__name__}.")
    if images.ndim != 4:
        raise FlatbmaError(
            f"images must be 4-D [N, C, H, W], got shape {tuple(images.shape)}. Add a channel axis to "
            f"grayscale data with images.unsqueeze(1)."
        )
    if 0 in images.shape[1:]:
        raise FlatbmaError(f"images must have at least one channel and pixel, got shape {tuple(images.shape)}.")
    if images.dtype == torch.uint8:
        return images
    if not images.dtype.is_floating_point:
        raise FlatbmaError(f"images must be uint8 (0-255) or floating point in [0, 1], got {images.dtype}.")
    finite = torch.isfinite(images).flatten(1).all(dim=1)
    if not bool(finite.all()):
        bad = torch.nonzero(~finite).flatten()
        raise FlatbmaError(
            f"images contain NaN or infinite pixels in {bad.numel()} image(s) (first: index {int(bad[0])}); "
            f"clean or drop them before building the dataset."
        )
    if images.numel() and (float(images.min()) < 0.0 or float(images.max()) > 1.0):
        raise FlatbmaError(
            f"float images must lie in [0, 1], got values in [{float(images.min()):g}, "
            f"{float(images.max()):g}]. Scale them (e.g. divide 0-255 data by 255) and standardize with a "
            f"transform instead."
        )
    return images.to(torch.float32)


def _check_classes(classes: object) -> list[str]:
    if isinstance(classes, str) or not isinstance(classes, Sequence):
        raise FlatbmaError(f"classes must be a list of class names, got {type(classes).__name__}.")
    names = list(classes)
    if not names or not all(isinstance(c, str) for c in names):
        raise FlatbmaError(f"classes must be a non-empty list of strings, got {shown(names)}.")
    if len(set(names)) != len(names):
        duplicates = sorted({c for c in names if names.count(c) > 1})
        raise FlatbmaError(f"class names must be unique; duplicated: {duplicates}.")
    return names


def _check_labels(labels: object, n: int, classes: list[str]) -> Tensor:
    if not isinstance(labels, Tensor):
        raise FlatbmaError(f"labels must be a torch.Tensor [N] of class indices, got {type(labels).__name__}.")
    if labels.ndim != 1 or labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise FlatbmaError(
            f"labels must be a 1-D integer tensor, got shape {tuple(labels.shape)} and dtype {labels.dtype}."
        )
    if labels.shape[0] != n:
        raise FlatbmaError(f"there are {n} images but {labels.shape[0]} labels; they must match one to one.")
    labels = labels.to(torch.int64)
    bad = (labels < 0) | (labels >= len(classes))
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0])
        raise FlatbmaError(
            f"label {int(labels[first])} (at index {first}) is out of range: labels must lie in "
            f"[0, {len(classes)}) for the {len(classes)} classes given."
        )
    return labels
