"""Early stopping on validation (``train.early_stopping``): evaluate, keep the best state, stop on patience.

The loop calls :meth:`Monitor.after_epoch` after every epoch (before its checkpoint) and :meth:`Monitor.stop`
before every epoch. All the rule needs is in the checkpoint's history and in ``best.safetensors``, written before
the checkpoint that records it, so a resumed run evaluates, keeps and stops exactly as the uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.sections import EarlyStopping
from flatbma.experiment.parallel import processes
from flatbma.experiment.run.build import Experiment
from flatbma.experiment.run.checkpoint import check_compatible, load_checkpoint, save_state
from flatbma.experiment.run.evaluate import validation_metrics
from flatbma.experiment.run.provenance import Template
from flatbma.loop import History
from flatbma.types import State

BEST_FILE = "best.safetensors"
"""The state of the best validation evaluation, in the run directory."""


def best_epoch(history: History, options: EarlyStopping) -> int | None:
    """The epoch of the best evaluation in ``history`` (smallest criterion, first on ties), or ``None``."""
    key = options.criterion.value
    scored = [(h.validation[key], h.epoch) for h in history.epochs if key in h.validation]
    return min(scored)[1] if scored else None


def stopped(history: History, options: EarlyStopping) -> bool:
    """Whether ``patience`` epochs have passed since the best evaluation of ``history``."""
    best = best_epoch(history, options)
    return best is not None and history.epochs[-1].epoch - best >= options.patience


@dataclass
class Monitor:
    """Early stopping of stage ``exp`` by ``options`` (``train.early_stopping``), :data:`BEST_FILE` in ``run_dir``."""

    exp: Experiment
    options: EarlyStopping
    run_dir: Path

    @property
    def path(self) -> Path:
        """The best state's file."""
        return self.run_dir / BEST_FILE

    def after_epoch(self, state: State, history: History) -> None:
        """Evaluate the epoch just appended (every ``every`` epochs and the last); save the state if best."""
        epoch = history.epochs[-1]
        if epoch.epoch % self.options.every and epoch.epoch != self.exp.config.epochs:
            return
        try:
            epoch.validation = validation_metrics(self.exp, state, self.options.samples)
        except FlatbmaError as e:  # e.g. SWAG before its first snapshots: it has no posterior to evaluate yet
            raise FlatbmaError(
                f"train.early_stopping evaluates the posterior after epoch {epoch.epoch}, and it cannot be sampled "
                f"yet ({e}): evaluate later (train.early_stopping.every), or train this method without early stopping"
            ) from None
        if best_epoch(history, self.options) == epoch.epoch and processes.is_main():
            save_state(state, self.path, {"epoch": str(epoch.epoch), "step": str(state.step)})

    def stop(self, history: History) -> bool:
        """Whether training ends before the next epoch (:func:`stopped`)."""
        return stopped(history, self.options)

    def best(self, state: State, history: History, template: Template) -> State:
        """The state to evaluate: the best evaluation's (read back and checked), or ``state`` when that is the last."""
        best = best_epoch(history, self.options)
        if best is None or best == history.epochs[-1].epoch:
            return state
        kept, meta, _ = load_checkpoint(self.path, device=str(template.device))
        if meta.get("epoch") != str(best):
            raise FlatbmaError(
                f"{self.path} holds the state of epoch {meta.get('epoch')}, but the history's best evaluation is "
                f"epoch {best}: the run directory was altered; train again (--force)"
            )
        return check_compatible(kept, template.state, self.path)

    def record(self, history: History) -> dict[str, Any]:
        """What ``metrics.json`` records of the rule: the criterion, the best epoch and value, the last epoch."""
        best = best_epoch(history, self.options)
        key = self.options.criterion.value
        value = next((h.validation[key] for h in history.epochs if h.epoch == best), None)
        return {
            "criterion": key,
            "patience": self.options.patience,
            "best_epoch": best,
            "best_value": value,
            "epochs_trained": history.epochs[-1].epoch if history.epochs else 0,
            "stopped_early": stopped(history, self.options) and history.epochs[-1].epoch < self.exp.config.epochs,
        }
