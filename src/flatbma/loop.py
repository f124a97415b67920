"""The one training loop. It trains any :class:`~flatbma.types.Transform`; it knows no method by name.

It can stop anywhere (a crash, SIGKILL) and continue bit-identically from its last checkpoint's
:class:`Position` (epoch, batches applied, data-order generator state, global RNG states).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from flatbma.errors import DivergenceError, FlatbmaError
from flatbma.progress import current
from flatbma.types import Batch, State, StepOutput, Transform, training_batch


@dataclass
class EpochLog:
    """Mean training loss and accuracy (of the unperturbed pass) over one epoch.

    With soft targets (``[batch, classes]`` probabilities) accuracy is the agreement of the logits' top class with
    the targets' most probable class. Regression targets leave ``accuracy`` 0; ``loss`` is the Gaussian NLL and
    ``rmse`` ``√((1/n) Σᵢ (μ(xᵢ) − yᵢ)²)`` of the mean output ``μ`` over the epoch's examples (else ``None``).

    ``stats``: each step statistic (:attr:`~flatbma.types.StepOutput.stats`, e.g. ``ascent/mean_shift``) averaged
    over the steps that reported it. ``validation``: values measured after the epoch (early stopping's), or empty.
    """

    epoch: int
    loss: float
    accuracy: float
    steps: int
    stats: dict[str, float] = field(default_factory=dict)
    validation: dict[str, float] = field(default_factory=dict)
    rmse: float | None = None

    def record(self) -> dict[str, Any]:
        """The epoch as a JSON-ready dict; ``stats``, ``validation`` and ``rmse`` only when there are any."""
        out: dict[str, Any] = {"epoch": self.epoch, "loss": self.loss, "accuracy": self.accuracy, "steps": self.steps}
        if self.rmse is not None:
            out["rmse"] = self.rmse
        if self.stats:
            out["stats"] = dict(self.stats)
        if self.validation:
            out["validation"] = dict(self.validation)
        return out


@dataclass
class History:
    """Per-epoch training logs."""

    epochs: list[EpochLog] = field(default_factory=list)


@dataclass(frozen=True)
class Position:
    """Where training stands, enough to continue it exactly.

    Attributes:
        epoch: index of the current epoch (0-based); equals ``epochs`` when training is complete.
        batch: batches of that epoch already applied.
        loader_rng: state of the loader's shuffling generator at the start of the epoch (or ``None``).
        torch_rng: global CPU RNG state after the last applied step.
        cuda_rng: global CUDA RNG states, when CUDA is initialized.
        partial: running sums ``(loss·n, correct, n)`` of the current epoch (regression: ``correct`` is the sum of
            squared errors of the mean).
        stats: running sums ``(name, sum, steps)`` of the current epoch's step statistics.
    """

    epoch: int
    batch: int
    loader_rng: torch.Tensor | None
    torch_rng: torch.Tensor
    cuda_rng: tuple[torch.Tensor, ...] | None = None
    partial: tuple[float, float, float] = (0.0, 0.0, 0.0)
    stats: tuple[tuple[str, float, int], ...] = ()


def _loader_generator(loader: Iterable[Batch]) -> torch.Generator | None:
    generator = getattr(loader, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


def _here(
    epoch: int, batch: int, loader_rng: torch.Tensor | None, partial: tuple, sums: Mapping[str, list] | None = None
) -> Position:
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else None
    stats = tuple((k, float(s), int(n)) for k, (s, n) in (sums or {}).items())
    return Position(epoch, batch, loader_rng, torch.get_rng_state(), cuda, partial, stats)


def _epoch_batches(loader: Iterable[Batch], resume: Position | None) -> tuple[Iterator[Batch], torch.Tensor | None]:
    """An iterator over the epoch's batches, fast-forwarded past the ones ``resume`` already applied."""
    generator = _loader_generator(loader)
    if resume is not None and resume.loader_rng is not None and generator is not None:
        generator.set_state(resume.loader_rng)
    start_rng = generator.get_state() if generator is not None else None
    iterator = iter(loader)
    if resume is not None:
        for _ in range(resume.batch):  # data order and augmentation draws as in the interrupted run
            next(iterator)
        torch.set_rng_state(resume.torch_rng)
        if resume.cuda_rng is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(resume.cuda_rng))
    return iterator, start_rng


def fit(
    method: Transform,
    state: State,
    loader: Iterable[Batch],
    *,
    epochs: int,
    device: torch.device | str = "cpu",
    resume: Position | None = None,
    checkpoint: Callable[[State, Position, History], None] | None = None,
    checkpoint_every: int = 0,
    progress: bool = True,
    history: History | None = None,
    after_epoch: Callable[[State, History], None] | None = None,
    stop: Callable[[History], bool] | None = None,
    regression: bool = False,
    num_classes: int | None = None,
) -> tuple[State, History]:
    """Run ``state, out = method.update(state, batch)`` over ``epochs`` passes of ``loader``.

    Step statistics are averaged into :attr:`EpochLog.stats`; losses are summed and checked as :class:`_Running` says.

    Args:
        method: any transform (optimizer or posterior).
        state: its initial (or resumed) state.
        loader: re-iterable of ``(x, y)`` or dict batches (:func:`flatbma.types.split_batch`), ``y`` integer labels
            or class probabilities; moved to ``device`` here. Exact resumption reads its shuffling generator from
            ``loader.generator`` (a DataLoader's).
        epochs: total number of epochs.
        device: where batches go.
        resume: the checkpoint position to continue from (with the ``state`` and ``history`` saved with it).
        checkpoint: ``checkpoint(state, position, history)``, called after every epoch and every
            ``checkpoint_every`` steps, always with a state whose losses were all finite.
        checkpoint_every: step interval of intra-epoch checkpoints (0 = epoch ends only).
        progress: a progress bar on a terminal, unless quiet (:mod:`flatbma.progress`).
        history: the history to append to.
        after_epoch: ``after_epoch(state, history)``, called after each epoch is appended and before its
            checkpoint; it may add the epoch's ``validation`` values (early stopping).
        stop: ``stop(history)``, asked before every epoch; training ends when it says so. It must depend on the
            history alone, so a resumed run stops where the uninterrupted one did.
        regression: every epoch records its ``rmse`` (also inferred from float targets that are not probabilities).
        num_classes: check every batch's integer labels lie in ``[0, num_classes)`` (:func:`check_labels`), so a
            bad label is a :class:`~flatbma.errors.FlatbmaError`, not a device-side assert; ``None``: unchecked.

    Raises:
        DivergenceError: a non-finite loss (``cause="inputs"`` if the inputs held NaN/inf) or a failed linear solve.
        FlatbmaError: a label out of range (with ``num_classes``).
    """
    history = history if history is not None else History()
    total = _length(loader)
    reporter = current()
    start_epoch = resume.epoch if resume is not None else 0
    for epoch in range(start_epoch, epochs):
        if stop is not None and stop(history):
            break
        batches, start_rng = _epoch_batches(loader, resume)
        running = _Running(resume, device, epoch)
        applied = resume.batch if resume is not None else 0
        resume = None
        bar = reporter.bar(batches, total=total, initial=applied, desc=f"epoch {epoch + 1}/{epochs}", enabled=progress)
        for batch in bar:
            x, y = training_batch(batch) if isinstance(batch, Mapping) else batch  # a dict: its x and y keys
            if num_classes is not None:
                check_labels(y, num_classes, applied + 1, epoch + 1)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            try:
                state, out = method.update(state, (x, y))
            except torch.linalg.LinAlgError:  # e.g. a covariance that is no longer positive definite
                running.check()  # a non-finite loss of an earlier step is what went wrong first
                raise DivergenceError(
                    f"a linear solve failed at step {state.step + 1} (epoch {epoch + 1}): the covariance is no longer "
                    "positive definite",
                    cause="solve",
                ) from None
            except Exception:
                running.check()
                raise
            running.add(state.step, out, y, x)
            applied += 1
            if not getattr(bar, "disable", False):  # a bar on a terminal: its loss is read every step
                bar.set_postfix(loss=f"{running.mean_loss():.4f}", refresh=False)
            if checkpoint is not None and checkpoint_every and state.step % checkpoint_every == 0:
                running.check()
                checkpoint(state, _here(epoch, applied, start_rng, running.partial(), running.sums()), history)
        running.check()
        loss_sum, correct, count = running.partial()
        means = {k: s / n for k, (s, n) in running.sums().items()}
        score = correct / max(count, 1)
        if regression or running.regression:
            history.epochs.append(EpochLog(epoch + 1, loss_sum / max(count, 1), 0.0, applied, means, rmse=score**0.5))
        else:
            history.epochs.append(EpochLog(epoch + 1, loss_sum / max(count, 1), score, applied, means))
        if after_epoch is not None:
            after_epoch(state, history)
        if checkpoint is not None:
            generator = _loader_generator(loader)
            next_rng = generator.get_state() if generator is not None else None
            checkpoint(state, _here(epoch + 1, 0, next_rng, (0.0, 0.0, 0.0)), history)
    return state, history


def check_labels(y: Tensor, num_classes: int, batch: int, epoch: int) -> None:
    """Raise :class:`FlatbmaError` unless the integer labels ``y`` lie in ``[0, num_classes)`` (soft targets pass).

    One minimum and maximum over the batch, on the device where it lies.
    """
    if y.is_floating_point() or y.numel() == 0:
        return
    low, high = torch.aminmax(y)
    if int(low) < 0 or int(high) >= num_classes:
        bad = int(y[(y < 0) | (y >= num_classes)][0])  # the first, in the batch's order
        raise FlatbmaError(
            f"label {bad} is out of range (batch {batch} of epoch {epoch}): the model returns {num_classes} logits "
            f"per example, so labels must be class indices in [0, {num_classes})"
        )


CHECK_EVERY = 32
"""On a GPU, the steps whose losses are read together (one synchronization); elsewhere every step's loss is read."""


def _lazy(device: torch.device | str) -> bool:
    """Whether the loop on ``device`` reads its losses every :data:`CHECK_EVERY` steps (a GPU), not every step."""
    return torch.device(device).type == "cuda"


class _Running:
    """An epoch's running sums — loss·n, correct predictions, n, every step statistic — and its divergence check.

    For regression targets the second sum is of the squared errors of the mean. The sums are float64 tensors added
    in step order: the same numbers on any device. On a GPU pending losses are read together, every
    :data:`CHECK_EVERY` steps and before every checkpoint and epoch end; on a CPU every loss is checked at once.
    Either way a non-finite loss is reported with its step and value, and the last checkpoint is the same.
    """

    def __init__(self, resume: Position | None, device: torch.device | str, epoch: int) -> None:
        self.lazy = _lazy(device)
        self.where = torch.device(device) if self.lazy else torch.device("cpu")
        loss, correct, count = resume.partial if resume is not None else (0.0, 0.0, 0.0)
        self.loss, self.correct, self.count = self._scalar(loss), self._scalar(correct), count
        self.stats = {k: [self._scalar(s), n] for k, s, n in resume.stats} if resume is not None else {}
        self.pending: list[tuple[int, Tensor, Tensor | None]] = []
        self.epoch = epoch
        self.regression = False

    def _scalar(self, value: float | Tensor) -> Tensor:
        if isinstance(value, Tensor):
            return value.detach().to(self.where, torch.float64).reshape(())
        # a float64 Python float, exactly; torch.full fills on the device (torch.tensor would copy, a synchronization)
        return torch.full((), float(value), dtype=torch.float64, device=self.where)

    def add(self, step: int, out: StepOutput, y: Tensor, x: Tensor | None = None) -> None:
        """Add one step's outputs (``step``: the state's step after it; ``x``: its inputs); check its loss off a GPU.

        Whether ``x`` was finite is kept beside the loss, so a non-finite loss caused by the data is reported as such.
        """
        loss = self._scalar(out.loss)
        finite = torch.isfinite(x).all() if x is not None and x.is_floating_point() else None  # read with the loss
        self.pending.append((step, loss, finite))
        self.loss += loss * len(y)
        soft = y.is_floating_point() and y.dim() == 2 and y.shape == out.logits.shape
        if soft:  # soft targets (class probabilities): their most probable class
            self.correct += (out.logits.argmax(-1) == y.argmax(-1)).sum().to(self.where)
        elif not y.is_floating_point():
            self.correct += (out.logits.argmax(-1) == y).sum().to(self.where)
        else:  # regression targets (a Gaussian likelihood): no accuracy, the squared errors of the mean
            self.regression = True
            error = out.logits.detach()[..., 0].to(torch.float64) - y.to(torch.float64)
            self.correct += (error**2).sum().to(self.where)
        self.count += len(y)
        for key, value in (out.stats or {}).items():
            total = self.stats.setdefault(key, [self._scalar(0.0), 0])
            total[0] += self._scalar(value)
            total[1] += 1
        if not self.lazy or len(self.pending) >= CHECK_EVERY:
            self.check()

    def check(self) -> None:
        """Raise :class:`DivergenceError` for the first unchecked non-finite loss (one host read)."""
        if not self.pending:
            return
        losses = torch.stack([loss for _, loss, _ in self.pending])
        steps = [step for step, _, _ in self.pending]
        inputs = [ok for _, _, ok in self.pending]
        self.pending = []
        finite = torch.isfinite(losses)
        if not bool(finite.all()):
            first = int((~finite).nonzero()[0, 0])
            value, where = float(losses[first]), f"step {steps[first]} (epoch {self.epoch + 1})"
            if inputs[first] is not None and not bool(inputs[first]):
                raise DivergenceError(
                    f"the inputs hold NaN or inf values at {where}, so the training loss became {value}: clean the "
                    "data (drop or impute those values)",
                    cause="inputs",
                )
            raise DivergenceError(f"the training loss became {value} at {where}")

    def mean_loss(self) -> float:
        """The mean loss so far (a host read)."""
        return float(self.loss) / self.count

    def partial(self) -> tuple[float, float, float]:
        """``(loss·n, correct, n)`` as floats, for a :class:`Position` (a host read)."""
        return float(self.loss), float(self.correct), self.count

    def sums(self) -> dict[str, tuple[float, int]]:
        """Every statistic's ``(sum, steps)`` as floats (a host read)."""
        return {k: (float(s), n) for k, (s, n) in self.stats.items()}


def _length(loader: Iterable[Batch]) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None
