"""Post-hoc temperature scaling of a BMA predictive (Guo et al. 2017), fitted on validation data only.

``p_T(y|x) = softmax(log p(y|x) / T)``; ``T`` minimizes the validation NLL, which is convex in ``β = 1/T``, so a
golden-section search over ``β`` finds the global minimum within the bracket (docs/methods.md §7).
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor

from flatbma.errors import FlatbmaError


def scale(log_probs: Tensor, temperature: float) -> Tensor:
    """``log softmax(log_probs / T)``."""
    if not temperature > 0:
        raise FlatbmaError(f"temperature must be > 0, got {temperature!r}")
    return F.log_softmax(log_probs / temperature, dim=-1)


def fit_temperature(log_probs: Tensor, labels: Tensor, *, bounds: tuple[float, float] = (0.05, 20.0)) -> float:
    """The temperature ``T ∈ bounds`` minimizing the mean NLL of ``softmax(log_probs / T)`` on ``labels``.

    ``log_probs`` ``[N, C]`` (e.g. the BMA predictive) and ``labels`` ``[N]`` are validation data.
    """
    if log_probs.ndim != 2 or len(log_probs) == 0 or len(log_probs) != len(labels):
        raise FlatbmaError(
            "temperature scaling needs validation predictions [N, C] with N matching labels and N > 0: "
            "set data.val_per_class, data.val_pool or data.val_fraction"
        )
    z = log_probs.double().clamp_min(-1e4)
    y = labels.long()

    def nll(beta: float) -> float:
        return float(F.cross_entropy(z * beta, y))

    lo, hi = 1.0 / bounds[1], 1.0 / bounds[0]
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = nll(a), nll(b)
    for _ in range(80):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = nll(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = nll(b)
    return 1.0 / ((lo + hi) / 2)
