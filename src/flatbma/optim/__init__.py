"""Optimizers (gradient transformations) and ascent steps of the sharpness-aware family.

Ascent steps on weights: :class:`SAM`, :class:`ASAM`, :class:`FisherSAM`; on a low-rank Gaussian's
variational parameters: :class:`FisherBall` (FP-BMA). Each declares where it acts (``space``).
:class:`Amortized` wraps any of them so that its second pass runs every ``k`` steps (LookSAM's reuse of
the orthogonal component in between) and on a fraction of the batch (ESAM). :class:`LossScaled` puts any
method under fp16's dynamic loss scale.
"""

from flatbma.bn import disable_running_stats, enable_running_stats
from flatbma.optim.amortized import Amortized, Reuse
from flatbma.optim.asam import ASAM
from flatbma.optim.ascent import sharpness_aware_value_and_grad
from flatbma.optim.fisher_ball import BallMetric, FisherBall
from flatbma.optim.fisher_sam import FisherSAM
from flatbma.optim.loss_scale import LossScaled
from flatbma.optim.sam import SAM
from flatbma.optim.schedules import constant, cosine
from flatbma.optim.sgd import SGD, Adam, DecayMask, steady_gain, with_decay_mask
from flatbma.optim.torch_sam import SAMOptimizer

__all__ = [
    "ASAM",
    "SAM",
    "SGD",
    "Adam",
    "Amortized",
    "BallMetric",
    "DecayMask",
    "FisherBall",
    "FisherSAM",
    "LossScaled",
    "Reuse",
    "SAMOptimizer",
    "constant",
    "cosine",
    "disable_running_stats",
    "enable_running_stats",
    "sharpness_aware_value_and_grad",
    "steady_gain",
    "with_decay_mask",
]
