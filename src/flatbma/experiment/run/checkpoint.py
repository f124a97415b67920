"""Saving and loading method states without unpickling: safetensors tensors + JSON metadata.

A checkpoint is one ``.safetensors`` file: the state's ``params/…``, ``buffers/…`` and ``aux/…`` tensors, with
``step`` and a format tag in its string metadata, written to a temporary name and renamed. A run's checkpoint also
holds the loop position, the training history, who wrote it and the run it belongs to (:func:`save_position`);
:func:`load_position` checks all of it, refusing another run's, an altered or a damaged checkpoint in one line
(docs/reliability.md). ``--resume --set`` may change only the keys of :data:`RESUMABLE`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import Tensor

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.parse import shown
from flatbma.experiment.run.provenance import WRITTEN_BY, Provenance, Template, check_provenance
from flatbma.loop import EpochLog, History, Position
from flatbma.state_io import (
    FORMAT,
    SECTIONS,
    TEMP_NAME,
    atomic_write_bytes,
    checksum_problem,
    clip,
    dtype_name,
    encode_state,
    in_order,
    sealed,
    state_digest,
    structure_problem,
)
from flatbma.state_io import write_error as write_error
from flatbma.types import State

# ---------------------------------------------------------------------------------------------------
# writing files


def atomic_write_json(path: Path, obj: Any, *, note: str = "") -> None:
    """Write ``obj`` as indented JSON atomically (:func:`atomic_write_bytes`)."""
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode(), note=note)


def write_sealed_json(path: Path, obj: dict[str, Any], *, note: str = "") -> None:
    """Write the record ``obj`` sealed with its checksum (:func:`flatbma.state_io.sealed`), atomically.

    For the caches a result is read from (``metrics.json``, ``compare.json``, ``row_error.json``,
    ``candidate.json``): read back, they must carry their seal.
    """
    atomic_write_json(path, sealed(obj), note=note)


CHECKPOINT_NAME = "checkpoint.safetensors"
"""A run directory's checkpoint (:data:`flatbma.experiment.run.stage.CHECKPOINT_FILE`)."""


def remove_stale_temps(directory: str | Path) -> list[Path]:
    """Remove the temporary files (``.<name>.<random>.tmp``) that killed writes left in ``directory``.

    Call it on one process holding the directory's lock (:func:`flatbma.experiment.run.lock.hold`): only then is
    a temporary file stale. Returns the files removed; those that cannot be removed are left.
    """
    removed = []
    try:
        candidates = [p for p in Path(directory).iterdir() if TEMP_NAME.match(p.name)]
    except OSError:  # no such directory yet, or unreadable: nothing of ours is there
        return removed
    for path in candidates:
        try:
            if path.is_file() and not path.is_symlink():
                path.unlink()
                removed.append(path)
        except OSError:
            pass
    return removed


# ---------------------------------------------------------------------------------------------------
# states


def save_state(
    state: State,
    path: str | Path,
    metadata: dict[str, str] | None = None,
    extra: dict[str, Tensor] | None = None,
) -> None:
    """Save ``state`` atomically to ``path`` (safetensors).

    ``metadata``: extra string metadata (JSON text for structured values); ``extra``: tensors stored under
    ``extra/<key>`` (e.g. RNG states), read back by :func:`load_checkpoint`.

    Raises:
        FlatbmaError: the file cannot be written (the message says which checkpoint at ``path`` is intact).
    """
    path = Path(path)
    data = encode_state(state, metadata, extra)
    try:
        atomic_write_bytes(path, data)
    except FlatbmaError as e:
        raise FlatbmaError(f"{e}; {_intact(path)}") from None


def _intact(path: Path) -> str:
    """What a failed write of the checkpoint ``path`` left: the one before it (its step), or none."""
    meta = checkpoint_metadata(path)
    step = meta.get("step") if meta is not None else None
    return f"the last checkpoint at step {step} is intact" if step is not None else "no checkpoint was written yet"


def checkpoint_metadata(path: str | Path) -> dict[str, str] | None:
    """The string metadata of the checkpoint at ``path`` (its tensors are not read); ``None`` if unreadable."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError, RuntimeError):
        return None


def load_checkpoint(path: str | Path, device: str = "cpu") -> tuple[State, dict[str, str], dict[str, Tensor]]:
    """Load ``(state, metadata, extra tensors)`` saved by :func:`save_state`, its checksums checked."""
    path = Path(path)
    tensors, meta = _read(path)
    state, extra = _sections(tensors, meta, path, device)
    check_intact(tensors, meta, path)
    return state, meta, extra


def verify_checkpoint(path: str | Path) -> None:
    """Raise :class:`FlatbmaError` unless the checkpoint at ``path`` reads and matches its checksums."""
    tensors, meta = _read(Path(path))
    check_intact(tensors, meta, path)


def _read(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The CPU tensors and metadata of the flatbma state file at ``path`` (not yet checked against its checksums)."""
    if path.is_dir():
        raise FlatbmaError(f"checkpoint {path} is a directory, not a checkpoint file: restore the run's checkpoint")
    if not path.is_file():
        what = "is not a regular file" if os.path.lexists(path) else "does not exist"
        raise FlatbmaError(f"checkpoint {path} {what}: train first (flatbma train --config ...)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise FlatbmaError(
            f"checkpoint {path} is not a readable safetensors file ({clip(str(e))}); it may be truncated or "
            "corrupted: delete it and resume from an earlier checkpoint or retrain"
        ) from None
    if meta.get("format") != FORMAT:
        raise FlatbmaError(
            f"{path} is not a checkpoint this flatbma reads (format tag {shown(meta.get('format'))}, not {FORMAT}): "
            "an older flatbma's or another tool's; train the run again"
        )
    return tensors, meta


def _sections(
    tensors: dict[str, Tensor], meta: dict[str, str], path: Path, device: str
) -> tuple[State, dict[str, Tensor]]:
    """The state (on ``device``) and the extra CPU tensors of a state file's ``tensors`` and ``meta``."""
    sections: dict[str, dict] = {s: {} for s in (*SECTIONS, "extra")}
    for key, value in tensors.items():
        section, _, name = key.partition("/")
        if section not in sections:
            raise FlatbmaError(f"{path}: unexpected tensor {shown(key)}; the file is not a flatbma checkpoint")
        sections[section][name] = value if section == "extra" else value.to(device)
    extra = sections.pop("extra")
    try:
        order = json.loads(meta.get("order", "{}"))
        sections = {name: in_order(section, order.get(name, [])) for name, section in sections.items()}
    except (ValueError, AttributeError, TypeError):
        raise FlatbmaError(f"{path}: the checkpoint metadata is damaged (key order unreadable)") from None
    try:
        step = int(meta["step"])
    except (KeyError, ValueError):
        raise FlatbmaError(f"{path}: the checkpoint metadata has no valid step; the file is damaged") from None
    return State(step=step, **sections), extra


def check_intact(tensors: Mapping[str, Tensor], meta: Mapping[str, str], path: str | Path) -> None:
    """Raise :class:`FlatbmaError` unless a state file's CPU ``tensors`` and ``meta`` match its recorded checksums."""
    problem = checksum_problem(tensors, meta)
    if problem:
        raise FlatbmaError(
            f"checkpoint {path} is damaged: {problem} (an edit, or a changed bit on the disk); restore it from a "
            "copy, or train again"
        )


def checkpoint_record(meta: Mapping[str, str] | None) -> dict[str, Any] | None:
    """Which checkpoint has the metadata ``meta``: ``{"step", "checksum"}`` (``None`` for no or unreadable metadata).

    ``checksum``: the short hash of its recorded checksums (:func:`flatbma.state_io.state_digest`). Records
    computed from a checkpoint carry this, so they are never taken for another's.
    """
    try:
        step = int(meta["step"]) if meta is not None else None
    except (KeyError, ValueError):
        step = None
    return {"step": step, "checksum": state_digest(meta)} if step is not None else None


def position_text(meta: Mapping[str, str], epochs: int) -> str:
    """Where the checkpoint with metadata ``meta`` stands, for a message: ``"epoch 12 of 60 (step 483)"``."""
    epoch, step = (meta.get(k, "?") for k in ("epoch", "step"))
    shown_epoch = epoch if epoch.isdigit() else shown(epoch, 12)
    return f"epoch {shown_epoch} of {epochs} (step {step if step.isdigit() else shown(step, 12)})"


def at_end(meta: Mapping[str, str] | None, epochs: int) -> bool:
    """Whether the checkpoint with metadata ``meta`` stands at the end of a run of ``epochs`` epochs (batch 0)."""
    try:
        return meta is not None and int(meta["epoch"]) == epochs and int(meta["batch"]) == 0
    except (KeyError, ValueError):
        return False


def check_compatible(state: State, reference: State, path: str | Path) -> State:
    """The loaded ``state`` in the layout of ``reference``; a :class:`FlatbmaError` unless it has its structure.

    ``reference``: the state the run's method initializes for its model. Same names, dtypes and shapes; only a
    sampler's parameter stacks may be added to ``aux`` (:func:`flatbma.state_io.structure_problem`).
    """
    problem = structure_problem(state, reference)
    if problem:
        raise FlatbmaError(
            f"{path} does not fit this run ({problem}): it was written for another method "
            "or model, or altered; restore the run's own checkpoint or train again"
        )
    return state


# ---------------------------------------------------------------------------------------------------
# the loop position


@dataclass(frozen=True)
class RunRecord:
    """What a run's checkpoint records of the run that wrote it, beyond :class:`Provenance`.

    Attributes:
        config: the run's resolved config without ``output_dir`` and logs
            (:func:`flatbma.experiment.config.run_config.run_identity`).
        data: the fingerprint of its training data (:func:`flatbma.experiment.run.build.data_fingerprint`);
            ``None`` where it is not checked.
        environment: the library versions of the writing process; recorded, never checked.
    """

    config: Mapping[str, Any]
    data: str | None
    environment: Mapping[str, Any] | None = None


ENVIRONMENT_KEY = "environment"
"""Metadata key of the library versions a checkpoint was written with (:class:`RunRecord`, JSON)."""
CONFIG_KEY = "config"
"""Metadata key of the resolved config a checkpoint was written with (:class:`RunRecord`, JSON)."""
DATA_KEY = "data"
"""Metadata key of the fingerprint of the data a checkpoint's run trained on (:class:`RunRecord`)."""


def save_position(
    path: Path,
    state: State,
    position: Position,
    history: History,
    written_by: Provenance,
    run: RunRecord,
) -> None:
    """Save ``state`` with its loop ``position``, ``history``, ``written_by`` and ``run``, for :func:`load_position`."""
    extra = {"torch_rng": position.torch_rng}
    if position.loader_rng is not None:
        extra["loader_rng"] = position.loader_rng
    for i, rng in enumerate(position.cuda_rng or ()):
        extra[f"cuda_rng/{i}"] = rng
    meta = {
        "epoch": str(position.epoch),
        "batch": str(position.batch),
        "partial": json.dumps(list(position.partial)),
        "history": json.dumps([h.record() for h in history.epochs]),
    }
    if position.stats:  # only then: a method without step statistics records none
        meta["stats"] = json.dumps([list(entry) for entry in position.stats])
    meta[WRITTEN_BY] = written_by.to_json()
    meta[CONFIG_KEY] = json.dumps(run.config, sort_keys=True, default=str)
    if run.data is not None:
        meta[DATA_KEY] = run.data
    if run.environment is not None:
        meta[ENVIRONMENT_KEY] = json.dumps(dict(run.environment), sort_keys=True, default=str)
    save_state(state, path, meta, extra)


def load_position(
    path: Path, template: Template, *, continuing: RunRecord | None = None
) -> tuple[State, Position, History]:
    """``(state, position, history)`` saved by :func:`save_position`, checked against the run's ``template``.

    Each check refuses with one :class:`FlatbmaError` line naming both sides: who wrote it (:func:`check_provenance`),
    every tensor's name, dtype and shape (:func:`check_compatible`), the RNG states and position
    (:func:`check_position`), with ``continuing`` (``train --resume``) the config and data
    (:func:`check_continuation`), last the checksums (:func:`check_intact`). The state is on ``template.device``.
    """
    tensors, meta = _read(path)
    state, extra = _sections(tensors, meta, path, str(template.device))
    check_provenance(meta, template.provenance, path)
    state = check_compatible(state, template.state, path)
    try:
        cuda = tuple(extra[f"cuda_rng/{i}"] for i in range(sum(k.startswith("cuda_rng/") for k in extra))) or None
        position = Position(
            epoch=_integer(meta["epoch"]),
            batch=_integer(meta["batch"]),
            loader_rng=extra.get("loader_rng"),
            torch_rng=extra["torch_rng"],
            cuda_rng=cuda,
            partial=tuple(json.loads(meta["partial"])),
            stats=_stat_sums(json.loads(meta.get("stats", "[]"))),
        )
        history = History([_epoch_log(h) for h in json.loads(meta["history"])])
    except (KeyError, ValueError, TypeError):
        raise FlatbmaError(f"{path} has no resumable position (written by another tool?); train again") from None
    known = {"torch_rng", "loader_rng"} | {f"cuda_rng/{i}" for i in range(len(cuda or ()))}
    unexpected = sorted(set(extra) - known)
    if unexpected:
        raise _bad_position(path, f"unexpected tensor extra/{unexpected[0]}")
    check_position(state, position, template, path)
    if continuing is not None:
        check_continuation(meta, continuing, path)
    check_intact(tensors, meta, path)
    return state, position, history


def check_continuation(meta: Mapping[str, str], run: RunRecord, path: str | Path) -> None:
    """Raise :class:`FlatbmaError` unless ``run`` may continue from the checkpoint whose metadata is ``meta``.

    Its config may differ from the recorded one only in :data:`RESUMABLE` keys and its data must be the recorded
    data: anything else would train a mix of two runs.
    """
    recorded = config_record(meta)
    if recorded is None:
        raise FlatbmaError(f"checkpoint {path}: its record of the config it was written with is missing or damaged")
    edited = {k: v for k, v in config_changes(recorded, json_config(run.config)).items() if not resumable(k)}
    if edited:
        detail = clip(", ".join(f"{k}={shown(a, 20)} vs {shown(b, 20)}" for k, (a, b) in edited.items()), 60)
        raise FlatbmaError(
            f"checkpoint {path} was written with another config than its run directory's config.yaml now holds "
            f"({detail}; checkpoint vs config.yaml): restore config.yaml, or train a new run"
        )
    data = meta.get(DATA_KEY)
    if data is not None and run.data is not None and data != run.data:
        raise FlatbmaError(
            f"checkpoint {path} was trained on other data than the data set now holds (fingerprint "
            f"{shown(data, 20)} vs {run.data}): its files changed since; restore them, or train a new run (--force)"
        )


def config_record(meta: Mapping[str, str] | None) -> dict[str, Any] | None:
    """The run config a checkpoint's metadata records (:class:`RunRecord`); ``None``: none, or damaged."""
    if meta is None or CONFIG_KEY not in meta:
        return None
    try:
        recorded = json.loads(meta[CONFIG_KEY])
    except ValueError:
        return None
    return recorded if isinstance(recorded, dict) else None


def json_config(config: Mapping[str, Any]) -> Any:
    """A run identity (:func:`~flatbma.experiment.config.run_config.run_identity`) as its JSON record reads back."""
    return json.loads(json.dumps(config, default=str))


def _integer(text: str) -> int:
    value = int(text)
    if str(value) != text.strip():  # int() also reads "1_000" and "+3"
        raise ValueError(text)
    return value


def history_of(meta: Mapping[str, str] | None) -> History | None:
    """The training history recorded in a checkpoint's metadata; ``None`` when there is none or it is malformed."""
    try:
        return History([_epoch_log(h) for h in json.loads(meta["history"])]) if meta is not None else None
    except (KeyError, ValueError, TypeError):
        return None


def _epoch_log(record: Any) -> EpochLog:
    kinds = {"epoch": int, "loss": float, "accuracy": float, "steps": int}
    optional = {"stats", "validation"}  # named numbers (EpochLog.record leaves them out when empty)
    if not isinstance(record, dict) or not set(kinds) <= set(record) <= set(kinds) | optional | {"rmse"}:
        raise ValueError("history entry")
    if "rmse" in record and not _is_number(record["rmse"]):  # a regression run's (EpochLog.rmse)
        raise ValueError("rmse")
    for key, kind in kinds.items():
        value = record[key]
        if not _is_number(value) or (kind is int and not isinstance(value, int)):
            raise ValueError(key)
    for key in optional & set(record):
        values = record[key]
        if not (isinstance(values, dict) and all(isinstance(k, str) and _is_number(v) for k, v in values.items())):
            raise ValueError(key)
    return EpochLog(**record)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _stat_sums(entries: Any) -> tuple[tuple[str, float, int], ...]:
    """:attr:`Position.stats` from its JSON ``[[name, sum, steps], ...]``; ``ValueError`` when malformed."""
    if not isinstance(entries, list):
        raise ValueError("stats")
    out = []
    for entry in entries:
        ok = isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
        if not (ok and _is_number(entry[1]) and isinstance(entry[2], int) and not isinstance(entry[2], bool)):
            raise ValueError("stats")
        out.append((entry[0], float(entry[1]), entry[2]))
    return tuple(out)


def _bad_position(path: Path, problem: str) -> FlatbmaError:
    return FlatbmaError(
        f"checkpoint {path} holds an impossible loop position ({problem}): it was altered or damaged, or written "
        "for another config; restore the run's own checkpoint or train again"
    )


def _valid_generator_state(state: Tensor, like: Tensor) -> str | None:
    """Why ``state`` cannot be a CPU generator's state like ``like`` (``None`` when it can)."""
    if state.dtype != like.dtype or tuple(state.shape) != tuple(like.shape):
        return f"{dtype_name(state)} {tuple(state.shape)} instead of {dtype_name(like)} {tuple(like.shape)}"
    try:
        torch.Generator().set_state(state)
    except RuntimeError as e:
        return str(e).splitlines()[0] if str(e).strip() else "rejected by torch"
    return None


def check_position(state: State, position: Position, template: Template, path: Path) -> None:
    """Raise :class:`FlatbmaError` unless ``position`` is a place in the run ``template`` describes.

    ``step >= 0`` (at most ``epochs · batches``); ``epoch`` in ``[0, epochs]``; ``batch`` in
    ``[0, batches]`` and 0 at ``epoch == epochs``; ``partial`` three finite numbers ``(loss·n, correct,
    n)`` with ``0 <= correct <= n``; the CPU and data-order generator states of the size and dtype
    torch uses, and accepted by a generator; CUDA generator states 1-d ``uint8`` tensors.
    """
    steps = template.epochs * template.batches if template.batches is not None else None
    if state.step < 0 or (steps is not None and state.step > steps):
        bound = f"[0, {steps}]" if steps is not None else ">= 0"
        raise _bad_position(path, f"step {state.step} is not in {bound}")
    if not 0 <= position.epoch <= template.epochs:
        raise _bad_position(path, f"epoch {position.epoch} is not in [0, train.epochs={template.epochs}]")
    top = template.batches if position.epoch < template.epochs else 0
    if position.batch < 0 or (top is not None and position.batch > top):
        raise _bad_position(path, f"batch {position.batch} of epoch {position.epoch} is not in [0, {top}]")
    partial = position.partial
    numbers = len(partial) == 3 and all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in partial
    )
    if not numbers or not 0 <= partial[1] <= partial[2]:
        raise _bad_position(path, f"partial sums {shown(list(partial))} are not (loss·n, correct, n)")
    why = _valid_generator_state(position.torch_rng, torch.get_rng_state())
    if why is not None:
        raise _bad_position(path, f"torch RNG state: {why}")
    if template.loader_rng is not None:
        if position.loader_rng is None:
            raise _bad_position(path, "no data-order RNG state")
        why = _valid_generator_state(position.loader_rng, template.loader_rng)
        if why is not None:
            raise _bad_position(path, f"data-order RNG state: {why}")
    for rng in position.cuda_rng or ():
        if rng.dtype != torch.uint8 or rng.dim() != 1 or rng.numel() == 0:
            raise _bad_position(path, f"CUDA RNG state of {dtype_name(rng)} {tuple(rng.shape)}, not 1-d uint8")


def load_run_state(path: Path, template: Template) -> State:
    """The state of a run's checkpoint, every check of :func:`load_position` passed (for evaluation)."""
    return load_position(path, template)[0]


# ---------------------------------------------------------------------------------------------------
# the keys a --resume may change


RESUMABLE = (
    "optim.lr",
    "optim.schedule",
    "optim.warmup_epochs",
    "train.epochs",
    "train.checkpoint_every",
    "train.progress",
    "train.log",
    "train.device",
    "eval.*",
)
"""The config keys ``flatbma train --resume RUN --set key=value`` may change (``train.epochs`` not below those
done): they change how training goes on, not what the saved state means. Another ``train.device`` continues the
same state with that device's arithmetic and generator."""


def resumable(key: str) -> bool:
    """Whether a ``--resume --set`` may change ``key`` (a dotted config key; :data:`RESUMABLE`)."""
    return any(key == k or (k.endswith(".*") and key.startswith(k[:-1])) for k in RESUMABLE)


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (old, new)}`` for every leaf of two resolved configs that differs."""
    changes: dict[str, tuple[Any, Any]] = {}
    for key in sorted({*old, *new}, key=str):
        a, b = old.get(key), new.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            changes.update(config_changes(a, b, f"{prefix}{key}."))
        elif a != b or type(a) is not type(b):
            changes[f"{prefix}{key}"] = (a, b)
    return changes
