"""flatbma: flat-posterior-aware Bayesian deep learning in PyTorch.

The public API is exactly what this module re-exports: the subpackages below, the contract types of
:mod:`flatbma.types`, the helpers of :mod:`flatbma.params`, the BMA predictive (:mod:`flatbma.predict`) and its
predictor :class:`~flatbma.predictor.BMA`, :func:`fit_posterior` and :func:`load_posterior`. Importing flatbma
loads neither matplotlib nor the experiment layer (:mod:`flatbma.experiment`: configs, run directories, CLI).
"""

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
from flatbma.fit import fit_posterior, load_posterior
from flatbma.params import Objective, load_into, model_buffers, trainable_params
from flatbma.predict import bma_log_probs, evaluate, predict
from flatbma.predictor import BMA, BMAModule
from flatbma.types import (
    Ascent,
    Batch,
    Capabilities,
    GradientTransformation,
    Params,
    Posterior,
    Predictive,
    State,
    StepOutput,
    Transform,
)

__version__ = "0.1.0"

__all__ = [
    "BMA",
    "Ascent",
    "BMAModule",
    "Batch",
    "Capabilities",
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
