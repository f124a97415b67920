"""flatbma: flat-posterior-aware Bayesian deep learning in PyTorch.

The public API is exactly what this module re-exports: the subpackages and modules below, the
contract types of :mod:`flatbma.types`, the training objective and parameter helpers of
:mod:`flatbma.params`, and the BMA predictive of :mod:`flatbma.predict`. Importing flatbma loads
neither matplotlib (:mod:`flatbma.plotting` imports it when a figure is drawn) nor the experiment
layer (:mod:`flatbma.experiment`: configs, the training loop, the CLI and reports).
"""

from flatbma import (
    bn,
    calibration,
    data,
    flatness,
    gaussian,
    metrics,
    models,
    optim,
    plotting,
    posteriors,
    stats,
    transfer,
)
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
    "bn",
    "calibration",
    "data",
    "evaluate",
    "flatness",
    "gaussian",
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
