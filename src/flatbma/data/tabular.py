"""Tabular regression data sets: feature vectors and one float target per example, held in memory.

:data:`REGRESSION_DATASETS` (configs and the CLI, with ``model.likelihood: gaussian``) maps a name to its loader:

========= ===========================================================================================
name      source
========= ===========================================================================================
diabetes  scikit-learn's bundled diabetes data (442 patients, 10 features, a disease-progression
          score a year later; Efron et al. 2004), split 80/20 by a permutation of seed 0
========= ===========================================================================================

Loaders return raw data; :func:`standardized` rescales every split by the *training* mean and standard deviation,
so nothing held out leaks into training and RMSE, MAE and NLL are in standard deviations of the training targets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from flatbma.errors import FlatbmaError

__all__ = [
    "REGRESSION_DATASETS",
    "RegressionSplits",
    "TabularDataset",
    "is_regression_dataset",
    "load_diabetes",
    "load_regression_dataset",
    "random_split",
    "standardized",
]

DIABETES_TEST_FRACTION = 0.2
SPLIT_SEED = 0


@dataclass(frozen=True, eq=False, repr=False)
class TabularDataset(Dataset[tuple[Tensor, Tensor]]):
    """Feature vectors ``[N, D]`` and float targets ``[N]`` (float32); item ``i`` is ``(features[i], targets[i])``.

    The default collate gives ``[batch]`` float targets, as :class:`flatbma.regression.Gaussian` takes them.
    """

    features: Tensor
    targets: Tensor

    def __post_init__(self) -> None:
        x, y = self.features, self.targets
        if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise FlatbmaError(
                f"a tabular data set holds features [N, D] and targets [N], got {list(x.shape)} and {list(y.shape)}"
            )
        if not bool(torch.isfinite(x).all()) or not bool(torch.isfinite(y).all()):
            raise FlatbmaError("the features and targets of a tabular data set must be finite numbers")
        object.__setattr__(self, "features", x.to(torch.float32))
        object.__setattr__(self, "targets", y.to(torch.float32))

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.features[index], self.targets[index]

    def __repr__(self) -> str:
        return f"TabularDataset(n={len(self)}, features={self.num_features})"

    @property
    def num_features(self) -> int:
        """``D``, the length of a feature vector."""
        return int(self.features.shape[1])

    @property
    def num_classes(self) -> int:
        """0: regression targets have no classes."""
        return 0

    def with_transform(self, transform: object) -> TabularDataset:
        """The same data: tabular features take no image transform (``None``)."""
        if transform is not None:
            raise FlatbmaError(
                "a tabular data set takes no image transform (data.image_size, to_rgb, normalize, augment)"
            )
        return self

    def subset(self, indices: Tensor | Sequence[int]) -> TabularDataset:
        """The examples at ``indices``, in that order."""
        idx = torch.as_tensor(indices, dtype=torch.int64)
        return TabularDataset(self.features[idx], self.targets[idx])


@dataclass(frozen=True)
class RegressionSplits:
    """The train and test parts of a regression data set (raw: not standardized)."""

    train: TabularDataset
    test: TabularDataset
    name: str

    def content(self) -> tuple[bytes, list[Tensor]]:
        """What identifies the data (a run's data fingerprint): both splits' features and targets."""
        return b"regression", [t for s in (self.train, self.test) for t in (s.features, s.targets)]

    def __post_init__(self) -> None:
        if len(self.train) < 2 or len(self.test) == 0:
            raise FlatbmaError(
                f"dataset '{self.name}': too few examples ({len(self.train)} train, {len(self.test)} test)"
            )
        if self.train.num_features != self.test.num_features:
            raise FlatbmaError(f"dataset '{self.name}': train and test examples have different numbers of features")


def random_split(n: int, fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """``(kept, held)`` indices of ``range(n)``: ``round(fraction · n)`` held out by a permutation of ``seed``."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    held = round(fraction * n)
    return perm[held:].sort().values, perm[:held].sort().values


def standardized(train: TabularDataset, *others: TabularDataset) -> tuple[TabularDataset, ...]:
    """``train`` and ``others`` rescaled by the mean and standard deviation of ``train`` only (features and target).

    ``x' = (x − mean_train(x)) / std_train(x)`` per feature column and for the target (a constant keeps scale 1).
    """
    mean, std = train.features.mean(0), train.features.std(0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    y_mean, y_std = train.targets.mean(), train.targets.std()
    y_std = y_std if float(y_std) > 0 else torch.ones_like(y_std)
    return tuple(TabularDataset((d.features - mean) / std, (d.targets - y_mean) / y_std) for d in (train, *others))


def load_diabetes(root: str | None = None) -> RegressionSplits:
    """scikit-learn's bundled diabetes data: 442 examples of 10 features and a float target; 80/20, seed 0.

    Features and target are raw (``scaled=False``); :func:`standardized` scales them.
    """
    if root is not None:
        raise FlatbmaError("dataset 'diabetes' ships with scikit-learn and takes no root; leave root unset.")
    from sklearn.datasets import load_diabetes as sklearn_load_diabetes

    bunch = sklearn_load_diabetes(scaled=False)
    x = torch.from_numpy(np.asarray(bunch.data, dtype=np.float32))
    y = torch.from_numpy(np.asarray(bunch.target, dtype=np.float32))
    data = TabularDataset(x, y)
    train, test = random_split(len(data), DIABETES_TEST_FRACTION, SPLIT_SEED)
    return RegressionSplits(data.subset(train), data.subset(test), "diabetes")


REGRESSION_DATASETS: dict[str, Callable[..., RegressionSplits]] = {"diabetes": load_diabetes}


def is_regression_dataset(name: str) -> bool:
    """Whether ``name`` (spelled as :func:`flatbma.data.load_dataset` reads names) is a regression data set."""
    return isinstance(name, str) and name.strip().lower().replace("_", "-") in REGRESSION_DATASETS


def load_regression_dataset(name: str, root: str | None = None) -> RegressionSplits:
    """Load a registered regression data set by name (:data:`REGRESSION_DATASETS`)."""
    key = name.strip().lower().replace("_", "-")
    if key not in REGRESSION_DATASETS:
        raise FlatbmaError(f"unknown regression dataset {name!r}; known: {', '.join(sorted(REGRESSION_DATASETS))}")
    return REGRESSION_DATASETS[key](root)
