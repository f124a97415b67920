"""Hypothesis fuzz of the two remaining hostile inputs of issue #13: YAML aliases and full disks.

* **Anchors and aliases.** Random alias graphs — chains of anchors whose lists repeat the one before
  ``w`` times over ``d`` levels (billion laughs when ``w**d`` is large), merge keys, aliases reused in
  several fields — in random places of a real config. The loader must either build the document or
  refuse it with one :class:`~flatbma.errors.FlatbmaError` line, quickly, and it refuses exactly the
  documents whose expansion exceeds :data:`~flatbma.experiment.config.parse.MAX_YAML_NODES` values (counted
  here independently, from the generated structure).
* **Full disks.** A tiny ``flatbma train`` whose ``k``-th file write fails (``os.fsync`` of the
  temporary file, or its creation) with a random ``errno`` of a failing disk. The command must end with
  exit code 2 and one ``flatbma: error:`` line, leave no temporary file, and the run must then finish —
  ``--resume`` from its checkpoint when one was written, else a fresh ``--force`` run — with the very
  numbers of an uninterrupted run.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.parse import MAX_YAML_NODES, load_yaml
from tests.experiment.test_hostile_inputs import _cli
from tests.helpers import DONE

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------------
# anchors and aliases


def _anchor_sizes(width: int, depth: int) -> list[int]:
    """Expanded sizes of a chain's anchors: ``1``, then ``1 + width·(the one before)`` (a list counts itself)."""
    sizes = [1]
    for _ in range(1, depth):
        sizes.append(1 + width * sizes[-1])
    return sizes


def _chain(width: int, depth: int, name: str) -> str:
    """YAML flow text of an anchor chain: ``&n0 "x"``, then ``&n{i}`` a list of ``width`` aliases of ``n{i-1}``."""
    parts = [f'&{name}0 "x"'] + [f"&{name}{i} [{', '.join([f'*{name}{i - 1}'] * width)}]" for i in range(1, depth)]
    return "[" + ", ".join(parts) + "]"


@st.composite
def alias_documents(draw: st.DrawFn) -> tuple[str, int]:
    """A config-shaped YAML document holding alias chains, and its expanded size in values.

    The size counts every node — scalar, sequence, mapping, keys included — with aliases expanded: the
    convention of :func:`flatbma.experiment.config.parse.load_yaml`'s budget, computed here from the generated
    structure rather than from the parsed node graph.
    """
    chains = draw(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 8)), min_size=1, max_size=3))
    uses = draw(st.lists(st.integers(0, len(chains) - 1), max_size=3))
    merge = draw(st.booleans())
    lines = ["seed: 0", "output_dir: out"]
    size = 1 + 4  # the document's mapping; two keys, two values
    for i, (width, depth) in enumerate(chains):
        lines.append(f"chain{i}: {_chain(width, depth, f'c{i}_')}")
        size += 2 + sum(_anchor_sizes(width, depth))  # the key, the list, its anchors
    for j, i in enumerate(uses):  # the last anchor of a chain, used again in another field
        width, depth = chains[i]
        lines.append(f"use{j}: *c{i}_{depth - 1}")
        size += 1 + _anchor_sizes(width, depth)[-1]
    if merge:
        lines.append("base: &base {lr: 0.1, momentum: 0.9}")  # key + mapping of two pairs: 1 + 5
        lines.append("optim: {<<: *base, lr: 0.05}")  # key + mapping of (<<, base) and (lr, 0.05): 1 + 1 + 1 + 5 + 2
        size += 6 + 10
    return "\n".join(lines) + "\n", size


@SETTINGS
@given(doc=alias_documents())
def test_alias_graphs_are_built_or_refused_by_their_expanded_size(doc: tuple[str, int]) -> None:
    text, size = doc
    try:  # no clock: a graph refused only after expanding it would not finish here (its size is exponential)
        value = load_yaml(text, "c.yaml")
    except FlatbmaError as e:
        message = str(e)
        assert "\n" not in message and len(message) <= 400, message
        assert size > MAX_YAML_NODES, (size, message)  # refused: exactly the documents over the budget
    else:
        assert size <= MAX_YAML_NODES, size
        assert isinstance(value, dict) and value["seed"] == 0
        if "optim" in value:
            assert value["optim"] == {"lr": 0.05, "momentum": 0.9}  # the merge key, then the override


@settings(SETTINGS, max_examples=30)
@given(width=st.integers(2, 12), depth=st.integers(6, 12), field=st.sampled_from(["optim.lr", "seed", "method.rho"]))
def test_alias_bombs_in_typed_fields_are_one_line_errors(tmp_path: Path, width: int, depth: int, field: str) -> None:
    chain = _chain(width, depth, "b")
    cfg: dict[str, Any] = {
        "seed": 0,
        "output_dir": str(tmp_path / "run"),
        "method": {"name": "sam", "rho": 0.05},
        "data": {"name": "digits", "k_shot": 10},
        "model": {"name": "mlp", "width": 4},
        "optim": {"lr": 0.05},
    }
    section, _, key = field.rpartition(".")
    (cfg[section] if section else cfg)[key] = "@CHAIN@"
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(cfg).replace('"@CHAIN@"', chain))
    code, err = _cli(["train", "--config", str(path)])
    assert code == 2 and err.count("\n") == 1 and err.startswith("flatbma: error: "), err
    assert len(err) <= 400 and "Traceback" not in err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------
# full disks

RUN: dict[str, Any] = {
    "seed": 0,
    "method": {"name": "sgd"},
    "data": {"name": "digits", "k_shot": 10, "batch_size": 25, "test_limit": 100},
    "model": {"name": "mlp", "width": 4},
    "optim": {"lr": 0.05},
    "train": {"epochs": 2, "checkpoint_every": 4, "progress": False, "log": []},  # checkpoints at steps 4, 8
    "eval": {"num_samples": 1},
}
DISK_ERRORS = [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``metrics.json`` of the uninterrupted run."""
    root = tmp_path_factory.mktemp("reference")
    path = root / "c.yaml"
    path.write_text(yaml.safe_dump({**RUN, "output_dir": str(root / "run")}))
    code, err = _cli(["train", "--config", str(path), "--quiet"])
    assert code in DONE, err
    return json.loads((root / "run" / "metrics.json").read_text())


def _numbers(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: metrics[k] for k in ("accuracy", "nll", "ece", "brier")} | {"history": metrics.get("history")}


@settings(SETTINGS, max_examples=8)
@given(nth=st.integers(1, 4), error=st.sampled_from(DISK_ERRORS), at_creation=st.booleans())
def test_a_failing_disk_at_any_write_is_one_line_and_the_run_finishes_the_same(
    tmp_path_factory: pytest.TempPathFactory, reference: dict[str, Any], nth: int, error: int, at_creation: bool
) -> None:
    root = tmp_path_factory.mktemp("disk")
    run = root / "run"
    path = root / "c.yaml"
    path.write_text(yaml.safe_dump({**RUN, "output_dir": str(run)}))
    calls: list[int] = []
    real_fsync, real_mkstemp = os.fsync, tempfile.mkstemp

    def fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == nth:
            raise OSError(error, os.strerror(error))
        real_fsync(fd)

    def mkstemp(*args: Any, **kwargs: Any) -> tuple[int, str]:
        calls.append(0)
        if len(calls) == nth:
            raise OSError(error, os.strerror(error))
        return real_mkstemp(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        if at_creation:
            mp.setattr(tempfile, "mkstemp", mkstemp)
        else:
            mp.setattr(os, "fsync", fsync)
        code, err = _cli(["train", "--config", str(path), "--quiet"])
    # config.yaml, the checkpoints of steps 4 and 8, metrics.json: the nth of them failed
    assert code == 2 and err.count("\n") == 1 and err.startswith("flatbma: error: "), err
    assert "Traceback" not in err and str(run) in err
    assert not list(run.glob(".*.tmp")) if run.exists() else True  # the failed write left no temporary file
    if (run / "checkpoint.safetensors").exists():
        argv = ["train", "--resume", str(run), "--quiet"]
    else:
        argv = ["train", "--config", str(path), "--force", "--quiet"]
    code, err = _cli(argv)
    assert code in DONE, err
    assert _numbers(json.loads((run / "metrics.json").read_text())) == _numbers(reference)
