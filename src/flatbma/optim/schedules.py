"""Learning-rate schedules: ``schedule(step) -> learning rate``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from flatbma.errors import FlatbmaError

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


def held_schedule(rate: Schedule, start: int) -> Schedule:
    """``η_t = rate(min(t, start))``: ``rate`` until update ``start``, then constant at ``rate(start)``."""

    def schedule(step: int) -> float:
        return rate(min(step, start))

    return schedule


def hold_learning_rate(optimizer: Any, start: int, name: str) -> Any:
    """``optimizer`` with its learning rate held at ``η_start`` from update ``start`` on (:func:`held_schedule`).

    Raises:
        FlatbmaError: an optimizer without a ``lr`` schedule field (the built-in SGD and Adam have one).
    """
    if not (dataclasses.is_dataclass(optimizer) and any(f.name == "lr" for f in dataclasses.fields(optimizer))):
        raise FlatbmaError(
            f"{name} with method.start_step: null holds the learning rate constant over its collection window, which "
            f"needs an optimizer with a lr schedule (sgd, adam), got a {type(optimizer).__name__}: set "
            "method.start_step"
        )
    return dataclasses.replace(optimizer, lr=held_schedule(optimizer.learning_rate, start))
