"""The ``optim`` section: which descent optimizer, its learning rate and schedule, as one frozen dataclass.

:class:`OptimConfig` builds a run's optimizer over its epochs: SGD with momentum and weight decay or Adam, a cosine
or constant schedule with a linear warm-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from flatbma.checks import check_positive, parse_choice
from flatbma.errors import FlatbmaError
from flatbma.optim.schedules import Schedule as LearningRate
from flatbma.optim.schedules import constant, cosine
from flatbma.optim.sgd import SGD, Adam
from flatbma.types import GradientTransformation

__all__ = ["OPTIMIZERS", "SCHEDULES", "OptimConfig", "Optimizer", "Schedule"]


class Optimizer(str, Enum):
    """The descent optimizer (``optim.name``; strings and members are both accepted)."""

    SGD = "sgd"
    ADAM = "adam"


class Schedule(str, Enum):
    """The learning-rate schedule (``optim.schedule``; strings and members are both accepted)."""

    COSINE = "cosine"
    CONSTANT = "constant"


@dataclass(frozen=True)
class OptimConfig:
    """Descent optimizer of the trained variables.

    Attributes:
        name: ``sgd`` (momentum, coupled weight decay) or ``adam`` (decoupled weight decay).
        lr: peak learning rate.
        momentum: SGD momentum.
        weight_decay: weight decay.
        nesterov: Nesterov momentum (SGD).
        schedule: ``cosine`` decay to 0 over training, or ``constant``.
        warmup_epochs: linear warm-up length in epochs.
    """

    name: Optimizer = Optimizer.SGD
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nesterov: bool = False
    schedule: Schedule = Schedule.COSINE
    warmup_epochs: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", parse_choice(Optimizer, self.name, "name"))  # frozen: as __init__ sets it
        object.__setattr__(self, "schedule", parse_choice(Schedule, self.schedule, "schedule"))
        check_positive("lr", self.lr)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        check_positive("warmup_epochs", self.warmup_epochs, allow_zero=True)
        if not 0 <= self.momentum < 1:
            raise FlatbmaError(f"momentum must be in [0, 1), got {self.momentum!r}")

    def check_length(self, epochs: int, where: str = "optim", epochs_key: str = "train.epochs") -> None:
        """Refuse a warm-up longer than the run's ``epochs``: it would never reach ``lr``.

        ``where`` and ``epochs_key`` name the section and the epochs' key in the message.

        Raises:
            FlatbmaError: one line naming both keys.
        """
        if self.warmup_epochs > epochs:
            raise FlatbmaError(
                f"{where}.warmup_epochs={self.warmup_epochs:g} is longer than the {epochs} epochs of the run "
                f"({epochs_key}): the learning rate would never reach {where}.lr; use {where}.warmup_epochs <= {epochs}"
            )

    def build(self, steps_per_epoch: int, epochs: int) -> GradientTransformation:
        """The optimizer, its learning rate following the schedule over ``epochs`` epochs of ``steps_per_epoch`` steps.

        The warm-up lasts ``round(warmup_epochs · steps_per_epoch)`` steps (cosine schedule).
        """
        return OPTIMIZERS[self.name](self, self.learning_rate(steps_per_epoch, epochs))

    def learning_rate(self, steps_per_epoch: int, epochs: int) -> LearningRate:
        """The schedule ``step -> η_t`` of :meth:`build`'s optimizer (the training log reports it)."""
        warmup = round(self.warmup_epochs * steps_per_epoch)
        return SCHEDULES[self.schedule](self.lr, epochs * steps_per_epoch, warmup)


OPTIMIZERS: dict[Optimizer, Callable[[OptimConfig, LearningRate], GradientTransformation]] = {
    Optimizer.SGD: lambda o, lr: SGD(lr=lr, momentum=o.momentum, weight_decay=o.weight_decay, nesterov=o.nesterov),
    Optimizer.ADAM: lambda o, lr: Adam(lr=lr, weight_decay=o.weight_decay),
}
"""Each ``optim.name`` → its optimizer built from the section and a learning-rate schedule."""

SCHEDULES: dict[Schedule, Callable[[float, int, int], LearningRate]] = {
    Schedule.COSINE: cosine,
    Schedule.CONSTANT: lambda lr, _steps, _warmup: constant(lr),
}
"""Each ``optim.schedule`` → ``schedule(peak lr, total steps, warm-up steps)``."""
