"""Changing a run's config on ``flatbma train --resume RUN --set key=value``: checked, and recorded in ``resumes.json``.

Only the keys of :data:`~flatbma.experiment.run.checkpoint.RESUMABLE` may change (:func:`resume_change`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flatbma
from flatbma.checks import is_int
from flatbma.errors import FlatbmaError
from flatbma.experiment.run.checkpoint import (
    RESUMABLE,
    atomic_write_json,
    checkpoint_metadata,
    config_changes,
    resumable,
)
from flatbma.methods import parse_method
from flatbma.state_io import clip
from flatbma.types import Phase

RESUMES_FILE = "resumes.json"
"""The run directory's record of the config changes made on ``--resume`` (:func:`append_resume`)."""


@dataclass(frozen=True)
class Resume:
    """A change of a run's config on ``--resume``, recorded in its ``resumes.json`` (:func:`append_resume`).

    Attributes:
        changed: ``{dotted key: (old, new)}``.
        step, epoch, batch: where the checkpoint it continues from stands (``None``: no checkpoint yet).
        resolved: the whole changed config, as its ``config.yaml`` is to hold it.
    """

    changed: Mapping[str, tuple[Any, Any]]
    step: int | None
    epoch: int | None
    batch: int | None
    resolved: Mapping[str, Any]

    def record(self) -> dict[str, Any]:
        """The entry of ``resumes.json``."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch": self.batch,
            "changed": {k: {"old": a, "new": b} for k, (a, b) in self.changed.items()},
            "flatbma": flatbma.__version__,
        }


def resume_change(checkpoint: Path, old: Mapping[str, Any], new: Mapping[str, Any]) -> Resume:
    """The :class:`Resume` from the resolved config ``old`` to ``new``, or a :class:`FlatbmaError`.

    Refused: a key outside :data:`RESUMABLE`, and ``train.epochs`` below the epochs the checkpoint
    has done (an epoch under way counts as done).
    """
    changed = config_changes(old, new)
    refused = [k for k in changed if not resumable(k)]
    if refused:
        raise FlatbmaError(
            f"--resume cannot change {clip(', '.join(refused), 80)} (it would change what the checkpoint's "
            f"state means); a resume may change only {', '.join(RESUMABLE)}: train a new run (--config ... "
            "--set ...) instead"
        )
    meta = checkpoint_metadata(checkpoint) if checkpoint.is_file() else None
    try:
        step, epoch, batch = (int(meta[k]) for k in ("step", "epoch", "batch")) if meta else (None, None, None)
    except (KeyError, ValueError):
        step = epoch = batch = None  # resuming reports the damage
    if "train.epochs" in changed and epoch is not None and batch is not None:
        done = epoch + (batch > 0)
        if changed["train.epochs"][1] < done:
            raise FlatbmaError(
                f"train.epochs={changed['train.epochs'][1]} is below the {done} epochs this run has done or begun: "
                f"use train.epochs >= {done}"
            )
        before = changed["train.epochs"][0]
        after = _phases_after(new)
        if after and is_int(before) and done > before:
            raise FlatbmaError(
                f"this run has begun the pass it takes after train.epochs={before} (its {after[0].name} phase), so "
                "--resume cannot change train.epochs any more: train a new run"
            )
    return Resume(changed=changed, step=step, epoch=epoch, batch=batch, resolved=dict(new))


def _phases_after(resolved: Mapping[str, Any]) -> tuple[Phase, ...]:
    """The phases the method of a resolved config takes after ``train.epochs`` (none when it cannot be read)."""
    try:
        return parse_method(resolved.get("method")).phases_after()
    except FlatbmaError:
        return ()


def append_resume(path: Path, resume: Resume) -> None:
    """Append ``resume`` to the JSON list at ``path`` (``resumes.json``; created when missing)."""
    try:
        history = json.loads(path.read_text()) if path.is_file() else []
    except (OSError, ValueError, UnicodeDecodeError):
        history = None
    if not isinstance(history, list):
        raise FlatbmaError(f"{path} is damaged (not a JSON list): delete it or restore it, then resume again")
    atomic_write_json(path, [*history, resume.record()])
