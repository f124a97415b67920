"""Issue #23, items 1–7 and 11: no command destroys a finished or running run, a partial run is never taken
for a finished one, an altered checkpoint or config is refused, and changed data trains again.

Each test names the item of the issue it pins; each failed on main before the change (eebebaf). Runs are
tiny (digits, a 4-unit MLP, 2 epochs of 19 steps); the one second process (the lock's holder) is the real
thing only where two processes are the point.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml

from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.run.checkpoint import checkpoint_metadata, checkpoint_record, load_checkpoint
from flatbma.experiment.run.evaluate import CLEAN_KEYS
from flatbma.experiment.run.lock import LOCK_FILE
from flatbma.experiment.run.stage import finished_run
from flatbma.experiment.study.plan import load_plan
from flatbma.state_io import sealed
from tests.helpers import DONE, held_by_another_process, interrupt_after_first_epoch

CKPT = "checkpoint.safetensors"
STEPS_PER_EPOCH = 19  # digits: 1198 training images in batches of 64
CONFIG = {
    "seed": 0,
    "method": {"name": "sam", "rho": 0.05},
    "data": {"name": "digits", "batch_size": 64, "test_limit": 100},
    "model": {"name": "mlp", "width": 4},
    "optim": {"lr": 0.05, "schedule": "constant"},
    "train": {"epochs": 2, "progress": False},
    "eval": {"num_samples": 1},
}
COMPARE = {
    "compare": {"methods": [{"name": "sgd"}], "seeds": [0], "bma_curve": [1], "flatness": False, "landscape": False}
}
ROW = Path("runs/sgd/seed0")


def _write(path: Path, cfg: dict) -> str:
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _error(capsys, *argv: str) -> str:
    code, _, err = _run(capsys, *argv)
    lines = [line for line in err.strip().splitlines() if line.startswith("flatbma:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("flatbma: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _files(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``root`` (the lock file aside) with a hash of its bytes and its modification time."""
    return {
        str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """A finished run and an interrupted one (stopped after epoch 1 of 2), each with its config file."""
    root = tmp_path_factory.mktemp("runs")
    out = {"config": Path(_write(root / "c.yaml", {**CONFIG, "output_dir": str(root / "finished")}))}
    assert main(["train", "--config", str(out["config"])]) in DONE
    with pytest.MonkeyPatch.context() as m:
        interrupt_after_first_epoch(m)
        assert main(["train", "--config", str(out["config"]), "--set", f"output_dir={root / 'interrupted'}"]) == 130
    return {**out, "finished": root / "finished", "interrupted": root / "interrupted"}


def _copy(made: dict[str, Path], kind: str, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the ``kind`` run in ``tmp_path / kind`` and a config file naming it (its config moves with it)."""
    run = tmp_path / kind
    shutil.copytree(made[kind], run)
    return run, _write(tmp_path / f"{kind}.yaml", {**CONFIG, "output_dir": str(run)})


# ---------------------------------------------------------------------------------------------------
# item 1: train --config over a run of the same config


def test_training_a_finished_run_again_touches_nothing(made, tmp_path, capsys):
    """Item 1: the identical ``train --config`` over a finished run retrained it from step 0 (a kill 3 s in
    left a step-483 checkpoint under the finished run's metrics.json). Now: exit 0, nothing written."""
    run, config = _copy(made, "finished", tmp_path)
    before = _files(run)
    code, out, _ = _run(capsys, "train", "--config", config)
    assert code in DONE and f"{run} holds this run, finished: nothing trained or written" in out
    assert _files(run) == before
    # --force trains it again: a new checkpoint, the same numbers (one process, fixed seeds)
    metrics = json.loads((run / "metrics.json").read_text())
    assert _run(capsys, "train", "--config", config, "--force")[0] in DONE
    assert _files(run)[CKPT] != before[CKPT]
    again = json.loads((run / "metrics.json").read_text())
    assert {k: again[k] for k in CLEAN_KEYS} == {k: metrics[k] for k in CLEAN_KEYS}


def test_training_an_interrupted_run_again_is_refused_naming_resume(made, tmp_path, capsys):
    """Item 1: ``train --config`` over an interrupted run started it over instead of resuming it."""
    run, config = _copy(made, "interrupted", tmp_path)
    before = _files(run)
    msg = _error(capsys, "train", "--config", config)
    assert f"{run} holds an interrupted run of this config (its checkpoint stands at epoch 1 of 2 (step 19))" in msg
    assert f"continue it with 'flatbma train --resume {run}', or pass --force" in msg
    assert _files(run) == before
    assert _run(capsys, "train", "--resume", str(run))[0] in DONE  # the way out the line names
    assert finished_run(run, config_from_dict({**CONFIG, "output_dir": str(run)}))


# ---------------------------------------------------------------------------------------------------
# items 2 and 4: one process at a time


def test_evaluate_refuses_a_run_another_process_holds_and_keeps_its_temporary_files(made, tmp_path, capsys):
    """Item 2: ``evaluate`` of a run that trains removed the trainer's in-flight temporary file as "stale"
    (killing the training) and wrote metrics.json for the partial state."""
    run, _ = _copy(made, "finished", tmp_path)
    in_flight = run / ".checkpoint.safetensors.k2x9a0b7.tmp"
    in_flight.write_bytes(b"being written")
    before = _files(run)
    with held_by_another_process(run) as holder:
        msg = _error(capsys, "evaluate", str(run))
        assert msg.startswith(f"flatbma: error: {run} is in use by flatbma train (process {holder.pid}): wait until")
        assert _files(run) == before
    assert _run(capsys, "evaluate", str(run))[0] in DONE  # its holder gone, the file is stale: removed
    assert not in_flight.exists()


def test_evaluate_of_an_unfinished_run_says_so(made, tmp_path, capsys):
    """Item 2: ``evaluate`` of an interrupted run wrote a metrics.json for its partial state."""
    run, _ = _copy(made, "interrupted", tmp_path)
    msg = _error(capsys, "evaluate", str(run))
    assert f"{run} is unfinished: its checkpoint stands at epoch 1 of 2 (step 19)" in msg
    assert f"continue it with 'flatbma train --resume {run}'" in msg
    assert not (run / "metrics.json").exists()


def test_a_second_writer_is_refused_naming_the_holder_and_the_lock_dies_with_it(made, tmp_path, capsys):
    """Item 4: two identical ``train`` commands into one directory both ran (a log.csv of 118 rows instead of
    60; ``train`` + ``--resume`` at once: 95). The lock is ``fcntl.flock``: the kernel drops it with its
    holder, so a SIGKILLed process leaves nothing to clean up."""
    run, config = _copy(made, "interrupted", tmp_path)
    before = _files(run)
    compare_dir = tmp_path / "compare"
    compare_config = _write(tmp_path / "compare.yaml", {**CONFIG, **COMPARE, "output_dir": str(compare_dir)})
    with held_by_another_process(run, compare_dir) as holder:
        holding = f"is in use by flatbma train (process {holder.pid}): wait until it ends (or stop it)"
        assert f"{run} {holding}" in _error(capsys, "train", "--config", config, "--force")
        assert f"{run} {holding}" in _error(capsys, "train", "--resume", str(run))
        assert f"{compare_dir} {holding}" in _error(capsys, "compare", "--config", compare_config)
        assert _files(run) == before and _files(compare_dir) == {}
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=60)
        assert "is unfinished" in _error(capsys, "evaluate", str(run))  # the directory is free again


def test_the_lock_file_is_never_followed_and_a_refused_start_leaves_no_directory(made, tmp_path, capsys, monkeypatch):
    """The lock itself: a ``.flatbma-lock`` that links elsewhere is refused, its target untouched; a run that
    fails after taking the lock of a directory it created (here while building) leaves no directory."""
    run, _ = _copy(made, "finished", tmp_path)
    mine = tmp_path / "mine.txt"
    mine.write_text("mine")
    (run / LOCK_FILE).unlink(missing_ok=True)
    (run / LOCK_FILE).symlink_to(mine)
    assert f"{run / LOCK_FILE} is a symbolic link, not flatbma's lock file: remove it" in _error(
        capsys, "evaluate", str(run)
    )
    assert mine.read_text() == "mine"
    new = tmp_path / "new" / "run"

    def fails(*args, **kwargs):
        raise FlatbmaError("the build failed")

    monkeypatch.setattr("flatbma.experiment.run.stage.build_experiment", fails)
    config = _write(tmp_path / "new.yaml", {**CONFIG, "output_dir": str(new)})
    assert _error(capsys, "train", "--config", config) == "flatbma: error: the build failed"
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------------------------------------------
# item 3: a partially trained row is not finished


def test_compare_retrains_a_partially_trained_row(tmp_path, capsys, monkeypatch):
    """Item 3: compare killed at epoch 1 of 2 of a row, the row evaluated (metrics.json written, as main's
    ``evaluate`` did), compare run again: the partial row was reused as finished. Known answer: the row of
    an uninterrupted comparison."""
    config = {**CONFIG, **COMPARE}
    reference = _write(tmp_path / "ref.yaml", {**config, "output_dir": str(tmp_path / "ref")})
    assert _run(capsys, "compare", "--config", reference)[0] in DONE
    expected = json.loads((tmp_path / "ref" / "results.json").read_text())["runs"][0]

    out = tmp_path / "out"
    partial = _write(tmp_path / "out.yaml", {**config, "output_dir": str(out)})
    with monkeypatch.context() as m:
        interrupt_after_first_epoch(m)
        assert _run(capsys, "compare", "--config", partial)[0] == 130
    assert load_checkpoint(out / ROW / CKPT)[0].step == STEPS_PER_EPOCH
    metrics = json.loads((tmp_path / "ref" / ROW / "metrics.json").read_text())
    metrics.pop("checkpoint", None)  # what main's evaluate wrote: the partial state's numbers, no record
    (out / ROW / "metrics.json").write_text(json.dumps(sealed(metrics)))  # (sealed, as a current version writes)
    cfg = load_plan(partial).jobs()[0].candidates[0].config
    assert not finished_run(out / ROW, cfg)

    assert _run(capsys, "compare", "--config", partial)[0] in DONE
    (row,) = json.loads((out / "results.json").read_text())["runs"]
    assert {k: row[k] for k in CLEAN_KEYS} == {k: expected[k] for k in CLEAN_KEYS}
    assert load_checkpoint(out / ROW / CKPT)[0].step == 2 * STEPS_PER_EPOCH
    # metrics.json written from another checkpoint than the one there now is not finished either
    recorded = json.loads((out / ROW / "metrics.json").read_text())
    assert recorded["checkpoint"] == checkpoint_record(checkpoint_metadata(out / ROW / CKPT))
    assert finished_run(out / ROW, cfg)
    (out / ROW / "metrics.json").write_text(json.dumps({**recorded, "checkpoint": {"step": 38, "checksum": "0" * 16}}))
    assert not finished_run(out / ROW, cfg)


# ---------------------------------------------------------------------------------------------------
# items 5 and 6: integrity and the whole config


def _header(path: Path) -> tuple[bytearray, int, dict]:
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    return data, n, json.loads(data[8 : 8 + n])


def test_a_flipped_bit_in_a_checkpoint_is_refused_by_evaluate_and_resume(made, tmp_path, capsys):
    """Item 5: a one-bit flip in a checkpoint tensor was accepted by ``evaluate`` and ``--resume`` (nll 2.7e36
    written to metrics.json). A flip in its metadata (the history's numbers) is found the same way."""
    run, _ = _copy(made, "finished", tmp_path)
    pristine = (run / CKPT).read_bytes()
    data, n, header = _header(run / CKPT)
    name = "params/classifier.weight"
    data[8 + n + header[name]["data_offsets"][0] + 2] ^= 0x10
    (run / CKPT).write_bytes(bytes(data))
    before = _files(run)
    for argv in (["evaluate", str(run)], ["train", "--resume", str(run)]):
        msg = _error(capsys, *argv)
        assert f"checkpoint {run / CKPT} is damaged: tensor {name} does not match its checksum" in msg
    assert _files(run) == before

    data, n, header = _header(run / CKPT)
    data[:] = pristine
    text = data[8 : 8 + n].decode()
    at = text.index('\\"loss\\": ') + len('\\"loss\\": ') + 3  # a digit of the first epoch's loss
    digit = text[at]
    assert digit.isdigit()
    data[8 + at] = ord(str((int(digit) + 1) % 10))
    (run / CKPT).write_bytes(bytes(data))
    msg = _error(capsys, "evaluate", str(run))
    assert "is damaged: its metadata (step, position, records) does not match its checksum" in msg


def test_a_hand_edited_config_is_refused_on_resume(made, tmp_path, capsys):
    """Item 6: config.yaml edited by hand (data.batch_size 64 → 32) passed ``--resume`` and trained a mixed run."""
    run, _ = _copy(made, "interrupted", tmp_path)
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    resolved["data"]["batch_size"] = 32
    (run / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    before = _files(run)
    msg = _error(capsys, "train", "--resume", str(run))
    assert f"checkpoint {run / CKPT} was written with another config than its run directory's config.yaml" in msg
    assert "(data.batch_size=64 vs 32; checkpoint vs config.yaml)" in msg
    assert msg.endswith("restore config.yaml, or train a new run")
    assert _files(run) == before


# ---------------------------------------------------------------------------------------------------
# item 7: --force replaces a run only with the new run's first checkpoint


def test_force_writes_the_new_config_only_with_its_first_checkpoint(made, tmp_path, capsys):
    """Item 7: ``--force`` with a config that failed before its first checkpoint left config.yaml of the new
    method beside the old method's checkpoint and metrics, and named a ``--resume`` command that failed."""
    run, config = _copy(made, "finished", tmp_path)
    (run / "resumes.json").write_text("[]\n")  # the old run's record of its resumes
    before = _files(run)
    diverges = ["--set", "method={name: sgd}", "--set", "optim.lr=1.0e+30", "--force"]
    msg = _error(capsys, "train", "--config", config, *diverges)
    assert "no checkpoint was written yet" in msg and f"the run that was in {run} is left as it was" in msg
    assert "--resume" not in msg
    assert _files(run) == before
    assert _run(capsys, "evaluate", str(run))[0] in DONE  # the old run, whole

    assert _run(capsys, "train", "--config", config, "--set", "method={name: sgd}", "--force")[0] in DONE
    assert yaml.safe_load((run / "config.yaml").read_text())["method"]["name"] == "sgd"
    assert json.loads(checkpoint_metadata(run / CKPT)["written_by"])["method"] == "sgd"
    assert json.loads((run / "metrics.json").read_text())["method"] == "sgd"
    assert not (run / "resumes.json").exists()


# ---------------------------------------------------------------------------------------------------
# item 11: the data a row saw is part of its identity


def _idx_data(root: Path, flip_test_labels: bool = False) -> Path:
    """A two-class MNIST-format data set of 4x4 images whose class is their brightness (learnable in an epoch)."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", 64), ("t10k", 32)):
        labels = (np.arange(n) % 2).astype(np.uint8)
        images = (rng.integers(0, 100, (n, 4, 4)) + 150 * labels[:, None, None]).astype(np.uint8)
        if prefix == "t10k" and flip_test_labels:
            labels = 1 - labels
        for kind, array in (("images-idx3-ubyte", images), ("labels-idx1-ubyte", labels)):
            header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
            (root / f"{prefix}-{kind}").write_bytes(header + array.tobytes())
    return root


def _strip_records(row: Path) -> None:
    """The row's records as an older flatbma wrote them: without the checkpoint and data they were computed from,
    and unsealed."""
    for name, keys in (
        ("metrics.json", ["checkpoint", "checksum"]),
        ("compare.json", ["checkpoint", "data", "checksum"]),
    ):
        content = json.loads((row / name).read_text())
        (row / name).write_text(json.dumps({k: v for k, v in content.items() if k not in keys}))


def test_changed_data_trains_the_rows_again(tmp_path, capsys):
    """Item 11: data changed (here the test labels swapped) and ``compare`` run again reused the old rows.
    Known answer: on two classes with every test label swapped, the new accuracy is 1 − the old (the same
    training data trains the same weights). A row of an older version (no records, no seal) is refused by name,
    never reused by guess."""
    data = _idx_data(tmp_path / "data")
    shared = {**CONFIG, "data": {"name": "idx", "root": str(data), "batch_size": 16}, "train": {"epochs": 1}}
    out = tmp_path / "out"
    config = _write(tmp_path / "c.yaml", {**shared, **COMPARE, "output_dir": str(out)})
    assert _run(capsys, "compare", "--config", config)[0] in DONE
    (first,) = json.loads((out / "results.json").read_text())["runs"]
    trained = _files(out / ROW)

    _idx_data(data, flip_test_labels=True)
    assert _run(capsys, "compare", "--config", config)[0] in DONE
    (second,) = json.loads((out / "results.json").read_text())["runs"]
    assert _files(out / ROW)[CKPT][1] != trained[CKPT][1]  # trained again, on the data as it is now
    assert second["accuracy"] == pytest.approx(1 - first["accuracy"])
    _strip_records(out / ROW)
    before = _files(out / ROW)
    msg = _error(capsys, "compare", "--config", config)
    assert f"{out / ROW / 'metrics.json'} is damaged (it has no checksum" in msg and "delete it" in msg
    assert _files(out / ROW) == before

    # a finished run of ``train`` whose data changed is neither reused nor resumed
    run = tmp_path / "run"
    one = _write(tmp_path / "run.yaml", {**shared, "output_dir": str(run)})
    assert _run(capsys, "train", "--config", one)[0] in DONE
    _idx_data(data)
    assert "trained on other data (the data set changed since): pass --force" in _error(
        capsys, "train", "--config", one
    )
    assert "was trained on other data than the data set now holds" in _error(capsys, "train", "--resume", str(run))
