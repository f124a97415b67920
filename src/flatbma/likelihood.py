"""The likelihood ``p(y | x, w)`` of a network's outputs: the one place that tells a classifier from a regression.

A classifier's ``softmax(f(x; w))_y`` (represented by ``None``, the loss functions' default) or a regression's
``N(y; μ(x; w), σ²)`` (:class:`flatbma.regression.Gaussian`). Each layer that treats the two differently keeps one
table keyed by :class:`Likelihood` (e.g. :data:`flatbma.predictor.TASKS`) and looks its row up with :func:`kind`;
no code tests for a regression elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch.nn.functional as F
from torch import Tensor

from flatbma.checks import parse_choice
from flatbma.data.tabular import is_regression_dataset
from flatbma.errors import FlatbmaError, FlatbmaTypeError
from flatbma.regression import Gaussian

__all__ = ["Likelihood", "build", "kind", "loss", "of_data", "recorded"]


class Likelihood(str, Enum):
    """The likelihood ``p(y | x, w)`` of the network's outputs (``model.likelihood``; strings and members accepted)."""

    CATEGORICAL = "categorical"
    """A classifier: softmax of the logits, cross-entropy; integer labels."""
    GAUSSIAN = "gaussian"
    """Regression, :class:`flatbma.regression.Gaussian`: the loss is the Gaussian NLL; float targets."""

    @property
    def has_classes(self) -> bool:
        """Whether the targets are classes (scored by accuracy; the categorical likelihood) or numbers (by RMSE)."""
        return self is Likelihood.CATEGORICAL


def build(name: object, noise_std: object = None) -> Gaussian | None:
    """The likelihood ``name``: ``None`` for ``categorical``, the :class:`Gaussian` of ``noise_std`` for ``gaussian``.

    Raises:
        FlatbmaError: an unknown name, or a ``noise_std`` given to the categorical likelihood.
    """
    chosen = parse_choice(Likelihood, name, "likelihood")
    if chosen is Likelihood.GAUSSIAN:
        return Gaussian(noise_std=noise_std)  # type: ignore[arg-type]
    if noise_std is not None:
        raise FlatbmaError("noise_std is the Gaussian likelihood's: give it with likelihood='gaussian'")
    return None


def kind(likelihood: Gaussian | None) -> Likelihood:
    """Which :class:`Likelihood` ``likelihood`` is (``None``: the categorical one): the key of every table."""
    if likelihood is None:
        return Likelihood.CATEGORICAL
    if isinstance(likelihood, Gaussian):
        return Likelihood.GAUSSIAN
    raise FlatbmaTypeError(
        f"likelihood must be None (a classifier) or a flatbma.regression.Gaussian, got a {type(likelihood).__name__}"
    )


def of_data(name: str) -> Likelihood:
    """The likelihood of the data set ``name``'s targets: Gaussian for a regression data set, else categorical."""
    return Likelihood.GAUSSIAN if is_regression_dataset(name) else Likelihood.CATEGORICAL


def loss(likelihood: Gaussian | None) -> Callable[[Tensor, Tensor], Tensor]:
    """The training loss ``loss(outputs, y)`` of ``likelihood``: the mean cross-entropy, or the Gaussian's mean NLL."""
    return F.cross_entropy if likelihood is None else likelihood


def recorded(value: object) -> Likelihood:
    """The likelihood a run's record names under ``"likelihood"`` (a classifier's record names none)."""
    return _BY_VALUE.get(value, Likelihood.CATEGORICAL) if isinstance(value, str) else Likelihood.CATEGORICAL


_BY_VALUE = {member.value: member for member in Likelihood}
