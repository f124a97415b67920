"""Reproducible class-stratified sampling: k-shot subsets and train/test splits.

Few-shot protocol (docs/methods.md §6 and §10.1 item 5): exactly ``k`` training images per class, drawn without
replacement by a seeded ``torch.Generator``; validation comes *out of the k-shot budget* (``val_per_class``) or,
with labels a strict few-shot setting lacks, from *outside* it (``val_pool``). Each class, in label order, draws
one ``randperm`` of its full size, so for a fixed seed the k-shot sets are nested (5-shot ⊂ 10-shot).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, TypeVar

import torch
from torch import Tensor

from flatbma.checks import check_int, check_number
from flatbma.errors import FlatbmaError


class Labelled(Protocol):
    """What :func:`few_shot` reads of a data set (:class:`flatbma.data.datasets.ArrayDataset` has it)."""

    labels: Tensor
    classes: Sequence[str]

    @property
    def num_classes(self) -> int: ...

    def subset(self: D, indices: Tensor) -> D: ...


D = TypeVar("D", bound=Labelled)

__all__ = ["few_shot", "few_shot_indices", "stratified_split"]


def _check_int(value: object, what: str) -> int:
    return check_int(value, f"{what} must be an integer, got {value!r} ({type(value).__name__}).")


def _generator(seed: object) -> torch.Generator:
    seed = _check_int(seed, "seed")
    if not 0 <= seed < 2**63:
        raise FlatbmaError(f"seed must be in [0, 2**63), got {seed}.")
    return torch.Generator().manual_seed(seed)


def _check_labels(labels: object, num_classes: int | None) -> tuple[Tensor, int]:
    """Validate a 1-D integer label tensor; return it as int64 with the number of classes."""
    if not isinstance(labels, Tensor):
        raise FlatbmaError(f"labels must be a torch.Tensor of class indices, got {type(labels).__name__}.")
    if labels.ndim != 1 or labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise FlatbmaError(
            f"labels must be a 1-D integer tensor, got shape {tuple(labels.shape)} and dtype {labels.dtype}."
        )
    labels = labels.to(torch.int64)
    if labels.numel() and int(labels.min()) < 0:
        raise FlatbmaError(f"labels must be non-negative class indices, found {int(labels.min())}.")
    observed = int(labels.max()) + 1 if labels.numel() else 0
    if num_classes is None:
        num_classes = observed
    else:
        num_classes = _check_int(num_classes, "num_classes")
        if observed > num_classes:
            raise FlatbmaError(
                f"label {observed - 1} is out of range for num_classes={num_classes}; labels must lie in "
                f"[0, {num_classes})."
            )
    if num_classes < 1:
        raise FlatbmaError("labels is empty: there are no classes to sample from.")
    return labels, num_classes


def _describe(c: int, class_names: Sequence[str] | None) -> str:
    return f"class {c} ('{class_names[c]}')" if class_names is not None else f"class {c}"


def few_shot_indices(
    labels: Tensor,
    k: int,
    *,
    seed: int,
    val_per_class: int = 0,
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
    val_pool: int = 0,
) -> tuple[Tensor, Tensor]:
    """Draw exactly ``k`` examples per class, ``val_per_class`` of which form a validation set.

    Args:
        labels: 1-D integer class labels of the full training set.
        k: Labelled examples per class in total (training + validation), at least 1.
        seed: Seed of the ``torch.Generator`` that draws the examples.
        val_per_class: Examples per class moved from the k-shot budget to validation, ``0 <= val_per_class < k``.
        num_classes: Number of classes (default ``max(labels) + 1``); pass it so an empty last class is detected.
        class_names: Names used in error messages.
        val_pool: Validation examples per class drawn from outside the ``k`` (the next ones of the same
            per-class permutation); not with ``val_per_class``.

    Returns:
        ``(train_indices, val_indices)``: sorted, disjoint int64 indices into ``labels``, ``k - val_per_class``
        and ``val_per_class`` per class (``k`` and ``val_pool`` with ``val_pool``); ``val_indices`` may be empty.

    Raises:
        FlatbmaError: bad ``k``/``val_per_class``/``val_pool``, or a class with fewer than ``k`` examples.
    """
    k = _check_int(k, "k")
    val_per_class = _check_int(val_per_class, "val_per_class")
    val_pool = _check_int(val_pool, "val_pool")
    if val_pool < 0 or (val_pool and val_per_class):
        raise FlatbmaError(
            f"val_pool must be >= 0 and not combined with val_per_class (validation either out of the k-shot "
            f"budget or from outside it), got val_pool={val_pool}, val_per_class={val_per_class}."
        )
    if k < 1:
        raise FlatbmaError(f"k (examples per class) must be at least 1, got {k}.")
    if not 0 <= val_per_class < k:
        raise FlatbmaError(
            f"val_per_class must satisfy 0 <= val_per_class < k={k} (validation comes out of the k-shot "
            f"budget and at least one example per class must remain for training), got {val_per_class}."
        )
    labels, num_classes = _check_labels(labels, num_classes)
    if class_names is not None and len(class_names) != num_classes:
        raise FlatbmaError(f"class_names has {len(class_names)} entries but there are {num_classes} classes.")
    counts = torch.bincount(labels, minlength=num_classes)
    empty = [c for c in range(num_classes) if int(counts[c]) == 0]
    if empty:
        names = ", ".join(_describe(c, class_names) for c in empty[:5])
        raise FlatbmaError(
            f"{len(empty)} class(es) have no examples ({names}{', ...' if len(empty) > 5 else ''}); "
            f"a {k}-shot subset needs at least {k} example(s) of every class. Check the dataset and its class list."
        )
    smallest = int(torch.argmin(counts))
    if int(counts[smallest]) < k + val_pool:
        pool = f" + val_pool={val_pool}" if val_pool else ""
        raise FlatbmaError(
            f"k={k}{pool} is larger than the smallest class: {_describe(smallest, class_names)} has only "
            f"{int(counts[smallest])} examples. Use k{pool} <= {int(counts[smallest])}."
        )
    generator = _generator(seed)
    train_parts: list[Tensor] = []
    val_parts: list[Tensor] = []
    for c in range(num_classes):
        members = torch.nonzero(labels == c).flatten()
        order = members[torch.randperm(members.numel(), generator=generator)]
        chosen = order[:k]
        val_parts.append(order[k : k + val_pool] if val_pool else chosen[:val_per_class])
        train_parts.append(chosen[val_per_class:])
    return torch.sort(torch.cat(train_parts)).values, torch.sort(torch.cat(val_parts)).values


def few_shot(
    dataset: D, k: int, *, seed: int, val_per_class: int = 0, val_pool: int = 0
) -> tuple[D, D | None]:
    """Return the k-shot training subset of ``dataset`` and its validation subset (``None`` when it has none).

    :func:`few_shot_indices` of its labels with the same options, and its class list, so that a class with no
    examples is detected even if it is the last; the subsets share its classes and transform.
    """
    train_idx, val_idx = few_shot_indices(
        dataset.labels,
        k,
        seed=seed,
        val_per_class=val_per_class,
        num_classes=dataset.num_classes,
        class_names=dataset.classes,
        val_pool=val_pool,
    )
    return dataset.subset(train_idx), (dataset.subset(val_idx) if len(val_idx) else None)


def stratified_split(labels: Tensor, fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """Split indices into (kept, held-out), ``floor(fraction · n_c + 1/2)`` of each class ``c`` held out at random.

    ``fraction`` lies strictly between 0 and 1; ``seed`` seeds the ``torch.Generator`` of the draw.

    Returns:
        ``(kept_indices, held_out_indices)``: sorted, disjoint int64 indices covering all examples.
    """
    message = f"fraction must be a number strictly between 0 and 1, got {fraction!r}."
    check_number(fraction, message, low=0, high=1, low_open=True, high_open=True)
    labels, num_classes = _check_labels(labels, None)
    generator = _generator(seed)
    kept: list[Tensor] = []
    held: list[Tensor] = []
    for c in range(num_classes):
        members = torch.nonzero(labels == c).flatten()
        n_held = math.floor(fraction * members.numel() + 0.5)
        shuffled = members[torch.randperm(members.numel(), generator=generator)]
        held.append(shuffled[:n_held])
        kept.append(shuffled[n_held:])
    return torch.sort(torch.cat(kept)).values, torch.sort(torch.cat(held)).values
