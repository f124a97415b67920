"""Hyperparameter selection on validation data: the score of ``flatbma compare``'s candidates and the choice.

The candidates are the grid points of a compare entry (:mod:`flatbma.experiment.entries`).

A compare method entry may give a list of values for any option whose type is a scalar (a number, a
flag or a name): a method option (``rho``, ``gamma``, ``rank``, …, typed by the registry's
signatures) or a key of the entry's own ``optim`` section::

    {name: sam, rho: [0.01, 0.05, 0.1], optim: {lr: [0.01, 0.05]}}

Every combination — the Cartesian product of the lists, in the order written — is a *candidate*, an
ordinary run of its own. Per method and seed, the candidate whose BMA predictive has the smallest
negative log-likelihood on the validation split is chosen,

    NLL_val = −(1/N) Σᵢ log p(yᵢ | xᵢ),   log p(y | x) = logsumexp_m log softmax f(x; w_m)_y − log M,

over the validation split (``data.val_per_class`` images per class held out of the k-shot budget, or
``data.val_pool`` drawn from outside it) and the run's
``eval.num_samples`` posterior samples (the samples its test evaluation draws). The test set plays
no part in the choice, and only the chosen candidate is evaluated on it — the protocol of the papers
the methods come from, which choose SAM's ρ (Foret et al. 2021) or FP-BMA's γ (Lim et al. 2025) on
held-out training data. An option whose type is itself a list (a tuple annotation) is a value, never
a grid; so is anything in an entry's ``prior`` section.
"""

from __future__ import annotations

import math

import torch

from flatbma.errors import FlatbmaError
from flatbma.experiment.build import Experiment
from flatbma.experiment.evaluate import bma_log_probs_over, bma_predictions, draw_samples
from flatbma.types import State

CRITERION = "val_nll"
"""The selection criterion recorded in ``results.json``: the BMA's NLL on the validation split."""

def validation_nll(exp: Experiment, state: State) -> float:
    """The validation NLL of the BMA of ``state`` (module docstring), from the build's RNG state.

    The samples are drawn exactly as the test evaluation draws them (BatchNorm recomputed on the training
    data), and averaged by the method's predictive (:func:`~flatbma.experiment.evaluate.bma_predictions`:
    Laplace's linearized ones included); only the validation loader is read.
    """
    if exp.val_loader is None:
        raise FlatbmaError(
            "choosing among candidates needs a validation split: set data.k_shot and data.val_per_class > 0 "
            "or data.val_pool > 0 (or data.val_fraction without k_shot)"
        )
    with exp.rng.restored():
        averaged = bma_predictions(exp, state, draw_samples(exp, state))
        log_probs, labels = bma_log_probs_over(exp, averaged, exp.val_loader)
    return float(-log_probs.gather(1, labels[:, None].to(torch.int64)).mean())


def choose(scores: list[float | None]) -> int | None:
    """Index of the smallest finite score (the first on ties); ``None`` when no score is finite."""
    finite = [(s, i) for i, s in enumerate(scores) if s is not None and math.isfinite(s)]
    return min(finite)[1] if finite else None
