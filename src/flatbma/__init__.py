"""flatbma: flat-posterior-aware Bayesian deep learning in PyTorch.

The public API is exactly what this module re-exports: the subpackages and modules below, the contract types
of :mod:`flatbma.types`, the training objective and parameter helpers of :mod:`flatbma.params`, the BMA
predictive of :mod:`flatbma.predict` and its predictor :class:`~flatbma.predictor.BMA` (in torch code:
:class:`~flatbma.predictor.BMAModule`). Importing flatbma loads neither matplotlib (:mod:`flatbma.plotting`
imports it when a figure is drawn) nor the experiment layer (:mod:`flatbma.experiment`: configs, the training
loop, the CLI and reports): :func:`fit_posterior` and :func:`load_posterior`, which train and reload through
it (:mod:`flatbma.experiment.api`), are imported when first used.
"""

from typing import TYPE_CHECKING

from flatbma import (
    bn,
    calibration,
    curvature,
    data,
    flatness,
    gaussian,
    jacobians,
    metrics,
    models,
    optim,
    plotting,
    posteriors,
    stats,
    transfer,
)
from flatbma.errors import DivergenceError, FlatbmaError, FlatbmaTypeError, FlatbmaWarning
from flatbma.params import Objective, load_into, model_buffers, trainable_params
from flatbma.predict import bma_log_probs, evaluate, predict
from flatbma.predictor import BMA, BMAModule
from flatbma.types import (
    Ascent,
    Batch,
    GradientTransformation,
    Params,
    Posterior,
    Predictive,
    State,
    StepOutput,
    Transform,
)

if TYPE_CHECKING:  # imported when first used (__getattr__); named here for type checkers and the API reference
    from flatbma.experiment.api import fit_posterior, load_posterior

__version__ = "0.1.0"

_LAZY = ("fit_posterior", "load_posterior")
"""Names of :mod:`flatbma.experiment.api`, imported with the experiment layer when first used."""


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from flatbma.experiment import api

        value = getattr(api, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flatbma' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "BMA",
    "Ascent",
    "BMAModule",
    "Batch",
    "DivergenceError",
    "FlatbmaError",
    "FlatbmaTypeError",
    "FlatbmaWarning",
    "GradientTransformation",
    "Objective",
    "Params",
    "Posterior",
    "Predictive",
    "State",
    "StepOutput",
    "Transform",
    "__version__",
    "bma_log_probs",
    "bn",
    "calibration",
    "curvature",
    "data",
    "evaluate",
    "fit_posterior",
    "flatness",
    "gaussian",
    "jacobians",
    "load_into",
    "load_posterior",
    "metrics",
    "model_buffers",
    "models",
    "optim",
    "plotting",
    "posteriors",
    "predict",
    "stats",
    "trainable_params",
    "transfer",
]
