"""Learning-rate schedules: ``schedule(step) -> learning rate``."""

from __future__ import annotations

import math
from collections.abc import Callable

Schedule = Callable[[int], float]


def constant(lr: float) -> Schedule:
    """``η_t = lr``."""
    return lambda step: lr


def cosine(lr: float, total_steps: int, warmup_steps: int = 0, final_fraction: float = 0.0) -> Schedule:
    """Linear warm-up then cosine decay.

    ``η_t = lr·t/T_w`` for ``t < T_w``, then
    ``η_t = lr·(f + (1−f)·½(1 + cos(π (t−T_w)/(T−T_w))))`` with ``f = final_fraction``
    (Loshchilov & Hutter 2017).
    """
    span = max(total_steps - warmup_steps, 1)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        t = min(step - warmup_steps, span) / span
        return lr * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * t)))

    return schedule
