"""What a comparison keeps on disk between its runs: row caches, candidates' scores, and when they are reused.

A row's measurements are cached beside its run in ``compare.json`` (:data:`RUN_CACHE`) with the key of the
comparison's measurement settings (:meth:`~flatbma.experiment.study.plan.Plan.row_key`) and the record of
the checkpoint and data they were computed from (:func:`source`); a candidate's validation score in
``candidate.json`` (:data:`CANDIDATE_FILE`). A damaged file is refused by name (:func:`read_cache`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.parse import load_yaml
from flatbma.experiment.config.run_config import RunConfig
from flatbma.experiment.run.checkpoint import atomic_write_bytes, checkpoint_metadata, checkpoint_record
from flatbma.experiment.run.evaluate import metric_keys
from flatbma.experiment.run.lock import LOCK_FILE
from flatbma.experiment.run.stage import CHECKPOINT_FILE, CONFIG_FILE, METRICS_FILE, finished_run
from flatbma.state_io import seal_problem

COMPARE_CONFIG = "compare_config.yaml"
"""The comparison's record of its config and study in its output directory (written first, by rank 0)."""
RUN_CACHE = "compare.json"
"""A row's cache in its directory: the row key, the record of what it was measured from, and the row."""
CANDIDATE_FILE = "candidate.json"
"""A candidate's validation score, in its run directory, beside the resolved config it belongs to."""


def cached_result(row_dir: Path, row_key: str) -> dict[str, Any]:
    """The row another process wrote into ``row_dir`` (its ``compare.json``)."""
    cached = read_cache(row_dir / RUN_CACHE, is_row_cache, sealed=True)
    if not isinstance(cached, dict) or cached.get("fingerprint") != row_key or "result" not in cached:
        raise FlatbmaError(
            f"{row_dir / RUN_CACHE} holds no result of this comparison although another process finished that "
            "run: put output_dir on a file system that every process shares"
        )
    return cached["result"]


def read_cache(path: Path, check: Callable[[Any], bool], *, sealed: bool = False) -> Any:
    """What ``path`` (a file of an earlier compare) holds, or ``None`` if it does not exist.

    ``check`` says whether the content has the shape flatbma writes there. A file that cannot be read, is not
    JSON or YAML, or fails ``check`` is refused by name, so a damaged directory never goes unnoticed. A ``sealed``
    record's seal must match (:func:`flatbma.state_io.seal_problem`): an edited number is refused like a damaged file.
    """
    if not path.exists():
        return None
    try:
        text = path.read_text()
        content = load_yaml(text, str(path)) if path.suffix == ".yaml" else json.loads(text)
    except (OSError, ValueError, RecursionError, yaml.YAMLError) as e:  # ValueError: not JSON or UTF-8, a YAML bomb
        raise _damaged(path, str(e).splitlines()[0] if str(e).strip() else type(e).__name__) from None
    if not check(content):
        raise _damaged(path, "not what flatbma writes there")
    problem = seal_problem(content) if sealed else None
    if problem:
        raise _damaged(path, problem)
    return content


def _damaged(path: Path, why: str) -> FlatbmaError:
    if path.name == COMPARE_CONFIG:  # without it the directory is no longer a compare directory (outdir module)
        way_out = "pass --force to start the comparison over in this directory, or choose another output_dir"
    else:
        way_out = "delete it (that part is redone), or pass --force to start the comparison over"
    return FlatbmaError(f"{path} is damaged ({why[:100]}): {way_out}")


def is_compare_config(content: Any) -> bool:
    """A ``compare_config.yaml``: a mapping with the comparison's fingerprint."""
    return isinstance(content, dict) and isinstance(content.get("fingerprint"), str)


def is_row_cache(content: Any) -> bool:
    """A ``compare.json``: the row key (:meth:`Plan.row_key`, as "fingerprint") and the row with its test metrics."""
    if not (isinstance(content, dict) and isinstance(content.get("fingerprint"), str)):
        return False
    row = content.get("result")
    if not (isinstance(row, dict) and isinstance(row.get("method"), str)):
        return False
    return all(_is_number(row.get(k)) for k in metric_keys(row))


def is_candidate_record(content: Any) -> bool:
    """A ``candidate.json``: the candidate's resolved config, its validation NLL, train time and error."""
    return (
        isinstance(content, dict)
        and isinstance(content.get("config"), dict)
        and (content.get("val_nll") is None or _is_number(content["val_nll"]))
        and (content.get("error") is None or isinstance(content["error"], str))
        and {"val_nll", "train_time_s", "error"} <= set(content)
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_train_metrics(run_dir: Path) -> dict[str, Any]:
    """The ``metrics.json`` of a finished run that compare reuses."""
    return read_cache(run_dir / METRICS_FILE, lambda content: isinstance(content, dict), sealed=True) or {}


def finished(run_dir: Path, cfg: RunConfig, data: str | None = None) -> bool:
    """:func:`~flatbma.experiment.run.stage.finished_run` on the data of fingerprint ``data``.

    A damaged ``config.yaml`` or ``metrics.json`` in ``run_dir`` is refused by name first.
    """
    read_cache(run_dir / CONFIG_FILE, lambda content: isinstance(content, dict))
    read_train_metrics(run_dir)
    return finished_run(run_dir, cfg, data)


def source(run_dir: Path, data: str) -> dict[str, Any]:
    """What a row measured in ``run_dir`` is computed from: its run's checkpoint (record) and the data set."""
    return {"checkpoint": checkpoint_record(checkpoint_metadata(run_dir / CHECKPOINT_FILE)), "data": data}


def fresh(cached: Any, row_key: str, width_to: tuple[str, float] | None, source: dict[str, Any]) -> bool:
    """Whether a cached row belongs to this comparison and, width-matched, to the reference's current width.

    It must also have been measured from ``source`` (:func:`source`): the run's current checkpoint and the
    data set as it is now.
    """
    if not (isinstance(cached, dict) and cached.get("fingerprint") == row_key and "result" in cached):
        return False
    if any(cached.get(key) != value for key, value in source.items()):
        return False
    matched = cached["result"].get("width_matched")
    if width_to is None:
        return matched is None
    return isinstance(matched, dict) and (matched.get("to"), matched.get("reference_trace")) == width_to


ADOPTED_FROM = "adopted_from.txt"
"""In a run directory that :func:`adopt` filled: the directory it was copied from."""


def adopt(cfg: RunConfig, others: tuple[RunConfig, ...], data: str) -> None:
    """Copy into ``cfg``'s directory a finished run of the same config from ``others`` (a selection's candidate).

    Only into a directory that holds no checkpoint (nothing is overwritten). Each file is copied atomically,
    ``metrics.json`` — with the checkpoint, what makes the run count as finished — last, so an interrupted
    copy leaves no run that looks finished; the source is named in :data:`ADOPTED_FROM`.
    """
    run_dir = Path(cfg.output_dir)
    if (run_dir / CHECKPOINT_FILE).exists():
        return
    places = (Path(o.output_dir) for o in others)
    source = next((p for p in places if p != run_dir and finished(p, cfg, data)), None)
    if source is None:
        return
    skip = (METRICS_FILE, CANDIDATE_FILE, RUN_CACHE, LOCK_FILE)  # metrics.json last; not the source's row or lock
    files = sorted(f for f in source.iterdir() if f.is_file() and f.name not in skip and not f.name.endswith(".tmp"))
    run_dir.mkdir(parents=True, exist_ok=True)
    for f in [*files, source / METRICS_FILE]:
        atomic_write_bytes(run_dir / f.name, f.read_bytes())
    atomic_write_bytes(run_dir / ADOPTED_FROM, f"{source}\n".encode())
