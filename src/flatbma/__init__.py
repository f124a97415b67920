"""flatbma: flat-posterior-aware Bayesian deep learning in PyTorch.

The public API is exactly what this module re-exports.
"""

from flatbma import data, metrics, models, optim, posteriors
from flatbma.errors import DivergenceError, FlatbmaError
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.predict import bma_log_probs, evaluate, predict
from flatbma.types import (
    Ascent,
    Batch,
    GradientTransformation,
    Params,
    Posterior,
    State,
    StepOutput,
    Transform,
)

__version__ = "0.1.0"

__all__ = [
    "Ascent",
    "Batch",
    "DivergenceError",
    "FlatbmaError",
    "GradientTransformation",
    "Objective",
    "Params",
    "Posterior",
    "State",
    "StepOutput",
    "Transform",
    "__version__",
    "bma_log_probs",
    "data",
    "evaluate",
    "metrics",
    "model_buffers",
    "models",
    "optim",
    "posteriors",
    "predict",
    "trainable_params",
]
