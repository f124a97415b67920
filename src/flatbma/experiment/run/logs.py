"""The training logs of a run: a line per epoch on ``stderr``, ``log.csv`` and TensorBoard (``train.log``).

An :class:`EpochLogger` is called at every checkpoint (on rank 0) with the history saved. A log always equals the
history of the checkpoint it continues from: on ``--resume`` ``log.csv`` keeps its rows up to the checkpoint's last
finished epoch, rows it lacks are written from the history, and TensorBoard hides later events (``purge_step``).
A row: the epoch's mean training loss and accuracy (of the unperturbed pass; a regression run's RMSE) and steps,
the learning rate at its last step, and its wall time (empty for a row rewritten from a checkpoint).
"""

from __future__ import annotations

import csv
import importlib
import io
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.sections import TrainLog
from flatbma.experiment.run.checkpoint import atomic_write_bytes, write_error
from flatbma.loop import History
from flatbma.state_io import append_bytes
from flatbma.training import EpochLines

CSV_FILE = "log.csv"
TENSORBOARD_DIR = "tensorboard"
COLUMNS = ("epoch", "loss", "accuracy", "steps", "lr", "time_s")
"""The first columns of ``log.csv``; after them come the run's step statistics (``ascent/mean_shift``) and
validation values (``val/nll``) in the order first seen, empty in the rows before they appeared."""
REGRESSION_COLUMNS = ("epoch", "loss", "rmse", "steps", "lr", "time_s")
"""The first columns of a regression run's ``log.csv`` (``model.likelihood: gaussian``): its targets have no
accuracy; ``rmse`` is the epoch's training RMSE of the mean (:attr:`~flatbma.loop.EpochLog.rmse`)."""


def check_available(logs: Iterable[TrainLog]) -> None:
    """Refuse ``train.log`` entries whose package is missing (TensorBoard's), before anything is trained.

    Raises:
        FlatbmaError: naming the optional extra that installs it.
    """
    if TrainLog.TENSORBOARD in tuple(logs):
        try:
            importlib.import_module("torch.utils.tensorboard")
        except ImportError as e:
            raise FlatbmaError(
                f"train.log: tensorboard needs the tensorboard package ({e}): pip install 'flatbma[tensorboard]', "
                "or drop it (--set train.log=[csv])"
            ) from None


class EpochLogger(EpochLines):
    """Logs each finished epoch of a run: its line (:class:`~flatbma.training.EpochLines`), ``log.csv``, TensorBoard.

    Call it with the history after every checkpoint: it logs the epochs not logged yet. Create it before the loop,
    or at its first checkpoint with ``started`` (the first epoch's time counts from then), and :meth:`close` it
    after. ``logs``: the ``train.log`` files to write into ``run_dir``; ``lines``: the arguments of
    :class:`~flatbma.training.EpochLines` (``accuracy=False``: :data:`REGRESSION_COLUMNS`).
    """

    def __init__(self, run_dir: Path, logs: Sequence[TrainLog], **lines: Any) -> None:
        super().__init__(**lines)
        self._csv: Path | None = None
        self._writer: Any = None
        rows = [dict(row) for row in self.rows]
        self._first = COLUMNS if lines.get("accuracy", True) else REGRESSION_COLUMNS
        self._columns = _columns(rows, self._first)
        if TrainLog.CSV in logs:
            self._csv = run_dir / CSV_FILE
            _restart_csv(self._csv, rows, self._columns)
        if TrainLog.TENSORBOARD in logs:
            check_available(logs)
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the events an earlier writer logged at epochs >= 1; the history's
            # epochs are logged again below, so the log shows exactly the resumed run
            self._writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=1)
            for row in rows:
                self._scalars(row)
            self._writer.flush()

    def logged(self, history: History, i: int, row: dict[str, Any]) -> None:
        """Write the epoch's row to ``log.csv`` and TensorBoard."""
        if self._csv is not None:
            self._write_row(history, i, row)
        if self._writer is not None:
            self._scalars(row)
            self._writer.flush()

    def _write_row(self, history: History, i: int, row: dict[str, Any]) -> None:
        """Append ``row`` to ``log.csv``; when it has a column the file lacks, write the file anew with it."""
        try:
            columns = _columns([row], self._columns)
            if columns != self._columns:
                self._columns = columns
                rows = [self.row(history.epochs, j, None) for j in range(i)]
                _restart_csv(self._csv, [*rows, row], columns, keep_time=row["epoch"])
                return
            line = io.StringIO()
            csv.writer(line, lineterminator="\n").writerow(["" if row.get(c) is None else row[c] for c in columns])
            append_bytes(self._csv, line.getvalue().encode())  # only ever a regular file of its own
        except OSError as e:
            raise write_error(self._csv, e, f"the checkpoint of epoch {row['epoch']} is intact") from None

    def close(self) -> None:
        """Flush and close the TensorBoard writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _scalars(self, row: dict[str, Any]) -> None:
        for key in (*self._first[1:3], "lr", "time_s", *(c for c in row if c not in self._first)):
            if row[key] is not None:
                name = key if "/" in key else f"train/{key}"
                self._writer.add_scalar(name, row[key], global_step=row["epoch"])


def _columns(rows: Iterable[dict[str, Any]], columns: Sequence[str]) -> tuple[str, ...]:
    """``columns`` followed by the keys of ``rows`` it lacks, in the order first seen."""
    out = list(columns)
    for row in rows:
        out.extend(k for k in row if k not in out)
    return tuple(out)


def _restart_csv(path: Path, rows: list[dict[str, Any]], columns: Sequence[str], keep_time: int | None = None) -> None:
    """Write ``path`` anew: the header and ``rows`` (the resumed history), with what ``path`` recorded of them.

    An epoch ``path`` has a row of keeps its learning rate (a resume may have changed ``optim.lr``) and time; the
    others get the current schedule's rate and no time, except epoch ``keep_time``, written as ``rows`` has it.
    """
    recorded = _recorded(path)
    out = io.StringIO(newline="")
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        if row["epoch"] != keep_time:
            lr, row["time_s"] = recorded.get(row["epoch"], (row["lr"], None))
            row["lr"] = lr if lr is not None else row["lr"]
        writer.writerow(["" if row.get(c) is None else row[c] for c in columns])
    atomic_write_bytes(path, out.getvalue().encode())


def _recorded(path: Path) -> dict[int, tuple[float | None, float | None]]:
    """``{epoch: (lr, time_s)}`` of an existing ``log.csv`` (empty when there is none or it cannot be read)."""
    try:
        return {int(r["epoch"]): (r["lr"], r["time_s"]) for r in read_csv(path)}
    except (OSError, KeyError, ValueError, TypeError, csv.Error, UnicodeDecodeError):
        return {}


def read_csv(path: str | Path) -> list[dict[str, float | int | None]]:
    """The rows of a ``log.csv``: ``epoch`` and ``steps`` as integers, the others as floats (``None`` when empty).

    Raises:
        ValueError: a file whose columns do not start with :data:`COLUMNS` (or :data:`REGRESSION_COLUMNS`).
    """
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        columns = tuple(reader.fieldnames or ())
        if columns[: len(COLUMNS)] not in (COLUMNS, REGRESSION_COLUMNS):
            raise ValueError(f"{path} is not a flatbma log.csv (columns {reader.fieldnames})")
        return [{c: _cell(c, r[c]) for c in columns} for r in reader]


def _cell(column: str, text: str | None) -> float | int | None:
    if text in ("", None):
        return None
    return int(text) if column in ("epoch", "steps") else float(text)
