"""The one way a registered method trains: built for a network, then driven by the loop, in memory.

:func:`flatbma.fit_posterior` and ``flatbma train``'s stage (which adds checkpoints, logs, resuming) both
train through it: :func:`build` (the method's transform, its optimizer, fp16's loss scale, the learning rate the
logs report), the caller's ``posterior.init`` (at the network's weights or a fitted prior), then :func:`train`
(:func:`flatbma.loop.fit` over :attr:`Built.epochs` in train mode, each finished epoch kept by :class:`EpochLines`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from flatbma import progress
from flatbma.loop import EpochLog, History, Position, fit
from flatbma.methods import MethodConfig
from flatbma.optim import LossScaled
from flatbma.optim.config import OptimConfig
from flatbma.optim.schedules import Schedule
from flatbma.params import Objective
from flatbma.precision import Precision
from flatbma.types import Batch, GradientTransformation, Posterior, State

__all__ = ["Built", "EpochLines", "build", "train"]


@dataclass(frozen=True)
class Built:
    """A method built for one run (:func:`build`).

    ``learning_rate``: ``step -> η_t`` as the method trains with it (SWAG's held rate), what the logs report;
    ``epochs``: the run's epochs plus those of the family's phases after them (Laplace's curvature pass).
    """

    posterior: Posterior
    optimizer: GradientTransformation
    learning_rate: Schedule
    epochs: int


def build(
    method: MethodConfig,
    optim: OptimConfig,
    objective: Objective,
    *,
    steps_per_epoch: int,
    epochs: int,
    map_steps: int | None = None,
    prior: Mapping[str, Tensor] | None = None,
    precision: Precision = Precision.FP32,
) -> Built:
    """``method`` built on ``objective`` with the optimizer of ``optim`` over ``epochs`` epochs of ``steps_per_epoch``.

    ``map_steps`` (default ``epochs · steps_per_epoch``; 0 post hoc) resolves ``start_step: null``; ``prior`` is
    a fitted Gaussian in ``θ`` layout replacing the method's default prior; ``precision`` fp16 wraps the method
    in :class:`~flatbma.optim.LossScaled`. The schedule spans at least one epoch.
    """
    spans = max(epochs, 1)
    map_steps = epochs * steps_per_epoch if map_steps is None else map_steps
    optimizer = optim.build(steps_per_epoch=steps_per_epoch, epochs=spans)
    rate = method.learning_rate(optim.learning_rate(steps_per_epoch, spans), map_steps)  # SWAG's held rate
    posterior = method.build(objective, optimizer, prior, map_steps=map_steps)
    if Precision(precision) is Precision.FP16:
        posterior = LossScaled()(posterior)
    return Built(posterior, optimizer, rate, epochs + method.extra_epochs())


def train(
    method: Posterior,
    state: State,
    loader: Iterable[Batch],
    *,
    model: nn.Module,
    epochs: int,
    device: Any,
    lines: EpochLines | None = None,
    resume: Position | None = None,
    history: History | None = None,
    checkpoint: Callable[[State, Position, History], None] | None = None,
    checkpoint_every: int = 0,
    after_epoch: Callable[[State, History], None] | None = None,
    stop: Callable[[History], bool] | None = None,
    progress: bool = True,
    regression: bool = False,
    num_classes: int | None = None,
) -> tuple[State, History]:
    """``method`` trained from ``state`` over ``epochs`` passes of ``loader`` (:func:`flatbma.loop.fit`).

    ``model`` (the network the method's objective holds) is in train mode throughout, its mode restored
    afterwards. ``lines`` is called each finished epoch, after ``after_epoch`` (e.g. early stopping's
    validation; a caller that checkpoints logs from ``checkpoint`` instead). The rest are :func:`~flatbma.loop.fit`'s.
    """

    def finished(s: State, h: History) -> None:
        if after_epoch is not None:
            after_epoch(s, h)
        if lines is not None:
            lines(h)

    was_training = model.training
    model.train()
    try:
        return fit(
            method,
            state,
            loader,
            epochs=epochs,
            device=device,
            resume=resume,
            checkpoint=checkpoint,
            checkpoint_every=checkpoint_every,
            progress=progress,
            history=history,
            after_epoch=finished,
            stop=stop,
            regression=regression,
            num_classes=num_classes,
        )
    finally:
        model.train(was_training)


class EpochLines:
    """Each finished epoch of a run as a row — shown as a line on ``stderr`` and kept in :attr:`rows`.

    Call it with the history after every epoch (or checkpoint): it handles the epochs not seen yet. A row holds
    the epoch's mean training loss and accuracy (regression: RMSE), steps, the learning rate at its last step,
    wall time (``None`` for epochs of the starting history), step statistics and ``val/<name>`` values.

    ``history``: the one the loop starts from (empty, or a resumed checkpoint's); ``lines``: print a line per epoch
    (where :mod:`flatbma.progress` prints lines); ``started``: the loop's start (``time.perf_counter()``; ``None``:
    now); ``accuracy``: rows hold the accuracy, else the RMSE (regression).
    """

    def __init__(
        self,
        *,
        epochs: int,
        learning_rate: Callable[[int], float],
        history: History,
        lines: bool = True,
        started: float | None = None,
        accuracy: bool = True,
    ) -> None:
        self._epochs = epochs
        self._accuracy = accuracy
        self._learning_rate = learning_rate
        self._lines = lines
        self._logged = len(history.epochs)
        self.rows: list[dict[str, Any]] = [self.row(history.epochs, i, None) for i in range(self._logged)]
        """Every epoch's row as logged (the history's epochs it starts from: without a time)."""
        self._last = started if started is not None else time.perf_counter()

    def __call__(self, history: History) -> None:
        """Show and keep the epochs of ``history`` past the ones already handled."""
        now = time.perf_counter()
        for i in range(self._logged, len(history.epochs)):
            row = self.row(history.epochs, i, now - self._last)
            self.rows.append(dict(row))
            if self._lines:
                score = f"acc {row['accuracy']:.3f}  " if self._accuracy else _rmse_text(row["rmse"])
                progress.current().line(
                    f"epoch {row['epoch']}/{self._epochs}  loss {row['loss']:.4f}  {score}"
                    f"lr {row['lr']:.4g}  {_seconds(row['time_s'])} s"
                )
            self.logged(history, i, row)
            self._last = now
        self._logged = max(self._logged, len(history.epochs))

    def logged(self, history: History, i: int, row: dict[str, Any]) -> None:
        """Called with each new row after its line (a subclass writes it to its files)."""

    def row(self, epochs: Sequence[EpochLog], i: int, seconds: float | None) -> dict[str, Any]:
        """Epoch ``i`` of ``epochs`` as a row (``seconds``: its wall time, ``None`` when not measured)."""
        h = epochs[i]
        last_step = sum(e.steps for e in epochs[: i + 1]) - 1  # the step the epoch's last update took
        return {
            "epoch": h.epoch,
            "loss": h.loss,
            **({"accuracy": h.accuracy} if self._accuracy else {"rmse": h.rmse}),
            "steps": h.steps,
            "lr": float(self._learning_rate(max(last_step, 0))),
            "time_s": seconds,
            **h.stats,
            **{f"val/{k}": v for k, v in h.validation.items()},
        }


def _rmse_text(rmse: float | None) -> str:
    return f"rmse {rmse:.4f}  " if rmse is not None else ""


def _seconds(t: float) -> str:
    return f"{t:.1f}" if t >= 1 else f"{t:.2f}"
