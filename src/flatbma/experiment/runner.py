"""The one training loop. It trains any :class:`~flatbma.types.Transform`; it knows no method by name."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from flatbma.errors import DivergenceError
from flatbma.types import Batch, State, Transform


@dataclass
class EpochLog:
    """Mean training loss and accuracy (of the unperturbed pass) over one epoch."""

    epoch: int
    loss: float
    accuracy: float
    steps: int


@dataclass
class History:
    """Per-epoch training logs."""

    epochs: list[EpochLog] = field(default_factory=list)


def fit(
    method: Transform,
    state: State,
    loader: Iterable[Batch],
    *,
    epochs: int,
    device: torch.device | str = "cpu",
    start_epoch: int = 0,
    checkpoint: Callable[[State, int], None] | None = None,
    checkpoint_every: int = 0,
    progress: bool = True,
    history: History | None = None,
) -> tuple[State, History]:
    """Run ``state, out = method.update(state, batch)`` over ``epochs`` passes of ``loader``.

    Args:
        method: any transform (optimizer or posterior).
        state: its initial (or resumed) state.
        loader: iterable of ``(x, y)`` batches; moved to ``device`` here.
        epochs: index of the last epoch to run (exclusive), counting from 0.
        device: where batches go.
        start_epoch: first epoch to run (for resumed runs).
        checkpoint: ``checkpoint(state, epoch)`` is called after every epoch and every
            ``checkpoint_every`` steps, always with a state whose losses were all finite.
        checkpoint_every: step interval of intra-epoch checkpoints (0 = epoch ends only).
        progress: show a progress bar with ETA (on a terminal; never in logs or pipes).
        history: a history to append to.

    Raises:
        DivergenceError: on a non-finite loss; nothing is checkpointed after the last good state.
    """
    history = history if history is not None else History()
    total = _length(loader)
    for epoch in range(start_epoch, epochs):
        loss_sum = correct = count = steps = 0.0
        bar = tqdm(
            loader,
            total=total,
            desc=f"epoch {epoch + 1}/{epochs}",
            disable=not progress or None,  # None: off when stderr is not a terminal
            leave=False,
            dynamic_ncols=True,
        )
        for x, y in bar:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            state, out = method.update(state, (x, y))
            loss = float(out.loss)
            if not math.isfinite(loss):
                raise DivergenceError(f"the training loss became {loss} at step {state.step} (epoch {epoch + 1})")
            loss_sum += loss * len(y)
            correct += float((out.logits.argmax(-1) == y).sum())
            count += len(y)
            steps += 1
            bar.set_postfix(loss=f"{loss_sum / count:.4f}", refresh=False)
            if checkpoint is not None and checkpoint_every and state.step % checkpoint_every == 0:
                checkpoint(state, epoch)
        history.epochs.append(EpochLog(epoch + 1, loss_sum / max(count, 1), correct / max(count, 1), int(steps)))
        if checkpoint is not None:
            checkpoint(state, epoch + 1)
    return state, history


def _length(loader: Iterable[Batch]) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None
