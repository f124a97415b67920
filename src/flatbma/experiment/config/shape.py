"""What a run's data decide about it (:class:`RunShape`) and one stage of it as its method sees it (:class:`Stage`).

A config's parts check themselves against these before anything trains — a method through its registry
entry (:attr:`~flatbma.experiment.config.methods.MethodSpec.check`), the evaluation through
:meth:`~flatbma.experiment.config.sections.EvalConfig.check`; :mod:`flatbma.experiment.run.validate`
computes the shape from the data and asks them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RunShape", "Stage"]


@dataclass(frozen=True)
class RunShape:
    """What a run's data decide about it, computed before it trains (:func:`run_shape`).

    Attributes:
        steps_per_epoch: updates per epoch: batches of ``data.batch_size`` of the training examples as
            the run's loader deals them (one process, or the global batches of ``torchrun``).
        num_train: training examples ``n`` (the k-shot draw, validation held out).
        num_test: test examples the metrics are computed on (``data.test_limit`` applied).
        num_trainable: trained weights (the Hessian's dimension), or ``None`` when not computed.
        num_classes: classes of the training data, or ``None`` when not known.
        pretrained: whether the network starts from a checkpoint (``model.pretrained`` is set).
        available_memory: bytes free where the run trains (:func:`available_memory`), counted with
            ``num_trainable``; ``None`` when not counted or not known.
        channels: channels of the test images (``eval.ood``'s corruptions need some), or ``None`` when not known.
    """

    steps_per_epoch: int
    num_train: int
    num_test: int
    num_trainable: int | None = None
    num_classes: int | None = None
    pretrained: bool = False
    available_memory: int | None = None
    channels: int | None = None


@dataclass(frozen=True)
class Stage:
    """One stage of a run (a two-stage run has two) as its method sees it: its length and the keys that set it.

    Attributes:
        shape: the run's shape (both stages share the data).
        epochs: the stage's epochs.
        epochs_key: the key that sets them (``train.epochs``, or ``prior.epochs`` for a first stage).
        method_key: the section of the stage's method (``method``, or ``prior.method``).
    """

    shape: RunShape
    epochs: int
    epochs_key: str = "train.epochs"
    method_key: str = "method"

    @property
    def steps(self) -> int:
        """Updates of the stage: ``epochs × steps_per_epoch``."""
        return self.epochs * self.shape.steps_per_epoch

    def key(self, option: str) -> str:
        """The config key of a method option (``method.rank``, ``prior.method.rank``)."""
        return f"{self.method_key}.{option}"

    def describe(self) -> str:
        """``train.epochs=2 × 4 steps per epoch = 8 updates``."""
        spe = self.shape.steps_per_epoch
        return f"{self.epochs_key}={self.epochs} × {spe} step{'s' * (spe != 1)} per epoch = {self.steps} updates"

    def epochs_for(self, steps: int) -> int:
        """The fewest epochs that take at least ``steps`` updates."""
        return -(-steps // self.shape.steps_per_epoch)

    @staticmethod
    def steps_for(count: Callable[[int], int], needed: int) -> int:
        """The fewest updates ``s`` with ``count(s) ≥ needed``, for a non-decreasing unbounded ``count`` (snapshots)."""
        high = 1
        while count(high) < needed:
            high *= 2
            if high > 2**62:
                raise ValueError(f"count never reaches {needed}")
        low = high // 2  # count(low) < needed (or low = 0)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if count(mid) >= needed else (mid, high)
        return high
