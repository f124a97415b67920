"""Optimizers (gradient transformations) and ascent steps of the sharpness-aware family."""

from flatbma.bn import disable_running_stats, enable_running_stats
from flatbma.optim.asam import ASAM
from flatbma.optim.ascent import sharpness_aware_value_and_grad
from flatbma.optim.fisher_sam import FisherSAM
from flatbma.optim.sam import SAM
from flatbma.optim.schedules import constant, cosine
from flatbma.optim.sgd import SGD, Adam
from flatbma.optim.torch_sam import SAMOptimizer

__all__ = [
    "ASAM",
    "SAM",
    "SGD",
    "Adam",
    "FisherSAM",
    "SAMOptimizer",
    "constant",
    "cosine",
    "disable_running_stats",
    "enable_running_stats",
    "sharpness_aware_value_and_grad",
]
