"""Logs to watch: a line per epoch without a terminal, ``--quiet``, ``log.csv`` in step with resume, TensorBoard."""

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from flatbma import progress
from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.config.sections import TrainConfig, TrainLog
from flatbma.experiment.run import stage
from flatbma.experiment.run.logs import COLUMNS, CSV_FILE, read_csv
from flatbma.experiment.run.pipeline import train

EPOCHS = 3
TINY = {
    "seed": 0,
    "method": {"name": "sgd"},
    "data": {"name": "digits", "batch_size": 128, "test_limit": 200},
    "model": {"name": "mlp", "width": 16},
    "optim": {"lr": 0.05},  # cosine to 0 over the run
    "train": {"epochs": EPOCHS},  # progress: true, log: [csv] by default
    "eval": {"num_samples": 1},
}
EPOCH_LINE = re.compile(
    r"epoch (\d+)/(\d+)  loss (\d+\.\d{4})  acc (\d\.\d{3})  lr (\S+)  (\d+\.\d+) s"
)  # e.g. "epoch 3/60  loss 0.4123  acc 0.871  lr 0.0432  12.3 s"


def _flatbma(*args):
    """``flatbma ARGS`` in a subprocess whose stderr is a pipe (not a terminal), as under CI or nohup."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "flatbma", *args], capture_output=True, text=True, env=env, timeout=600
    )


def _config(tmp_path, cfg=TINY, name="c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _cosine(lr, step, total):
    return lr * 0.5 * (1 + math.cos(math.pi * step / total))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny run trained by ``flatbma train`` without a terminal, and the same with ``--quiet``."""
    tmp = tmp_path_factory.mktemp("logging")
    cfg = _config(tmp)
    loud = _flatbma("train", "--config", cfg, "--set", f"output_dir={tmp / 'loud'}")
    quiet = _flatbma("train", "--config", cfg, "--set", f"output_dir={tmp / 'quiet'}", "--quiet")
    return tmp, loud, quiet


def test_train_without_a_terminal_prints_one_line_per_epoch(trained):
    tmp, loud, _ = trained
    assert loud.returncode == 0, loud.stderr
    lines = loud.stderr.splitlines()
    epoch_lines = [line for line in lines if line.startswith("epoch ")]
    assert len(epoch_lines) == EPOCHS, loud.stderr
    history = json.loads((tmp / "loud" / "metrics.json").read_text())["history"]
    steps_per_epoch = history[0]["steps"]
    for i, (line, h) in enumerate(zip(epoch_lines, history), 1):
        m = EPOCH_LINE.fullmatch(line)
        assert m, line
        assert (int(m[1]), int(m[2])) == (i, EPOCHS)
        assert m[3] == f"{h['loss']:.4f}" and m[4] == f"{h['accuracy']:.3f}"
        expected_lr = _cosine(0.05, i * steps_per_epoch - 1, EPOCHS * steps_per_epoch)  # the epoch's last step
        assert float(m[5]) == pytest.approx(expected_lr, rel=1e-3)
    # no bar without a terminal (no carriage returns), and the evaluation says what it did and how long it took
    assert "\r" not in loud.stderr
    assert re.search(r"^BMA: 1 sample on the test set in \d+\.\d s$", loud.stderr, re.M), loud.stderr
    # the results stay on stdout
    assert "wrote" in loud.stdout and "epoch" not in loud.stdout


def test_compare_prints_a_line_per_epoch_of_every_run_and_per_run(tmp_path):
    """#35: a comparison's training is no longer silent between "train: ... 15 epochs of 4 steps" and its end."""
    cfg = {
        **TINY,
        "output_dir": str(tmp_path / "cmp"),
        "compare": {
            "methods": [{"name": "sgd"}],
            "seeds": [0, 1],
            "bma_curve": [1],
            "flatness": False,
            "landscape": False,
        },
    }
    out = _flatbma("compare", "--config", _config(tmp_path, cfg))
    assert out.returncode == 0, out.stderr
    epochs = [line for line in out.stderr.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2 * EPOCHS and epochs[0].startswith(f"epoch 1/{EPOCHS}  loss "), out.stderr
    assert re.search(r"^train: sgd, \d+ epochs in \d+\.\d s$", out.stderr, re.M), out.stderr  # the training phase
    assert re.search(r"^compare: \[2/2\] sgd seed 1 done in ", out.stderr, re.M), out.stderr
    assert len(read_csv(tmp_path / "cmp" / "runs" / "sgd" / "seed1" / CSV_FILE)) == EPOCHS  # the epochs: in log.csv


def test_quiet_prints_nothing_on_success_and_changes_no_number(trained):
    tmp, loud, quiet = trained
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    assert "wrote" in quiet.stdout  # --quiet silences progress, not the result
    a = json.loads((tmp / "loud" / "metrics.json").read_text())
    b = json.loads((tmp / "quiet" / "metrics.json").read_text())
    for key in ("accuracy", "nll", "ece", "brier"):
        assert a[key] == b[key]
    assert a["history"] == b["history"]


def test_quiet_still_prints_errors(tmp_path):
    bad = _flatbma("train", "--config", str(tmp_path / "missing.yaml"), "--quiet")
    assert bad.returncode == 2
    assert bad.stderr.startswith("flatbma: error: ") and len(bad.stderr.splitlines()) == 1


def test_log_csv_holds_the_history_of_metrics_json(trained):
    tmp, _, _ = trained
    path = tmp / "loud" / CSV_FILE
    text = path.read_text()
    assert text.splitlines()[0] == ",".join(COLUMNS)
    assert text.count("epoch,") == 1  # one header
    assert "\r" not in text  # plain newlines: `tail -f log.csv` reads clean
    rows = read_csv(path)
    history = json.loads((tmp / "loud" / "metrics.json").read_text())["history"]
    assert [{k: r[k] for k in ("epoch", "loss", "accuracy", "steps")} for r in rows] == history  # exactly
    total = EPOCHS * history[0]["steps"]
    step = 0
    for r in rows:
        step += r["steps"]
        assert r["lr"] == pytest.approx(_cosine(0.05, step - 1, total), rel=1e-12)
        assert r["time_s"] is not None and r["time_s"] >= 0
    # --quiet silences the terminal, not the log
    assert [r["loss"] for r in read_csv(tmp / "quiet" / CSV_FILE)] == [h["loss"] for h in history]


# ---------------------------------------------------------------------------------------------------
# resume: log.csv equals the history of the checkpoint it continues from


RESUME = {**TINY, "train": {"epochs": 4, "progress": False}}


def _snapshot_at_epoch(monkeypatch, epoch, copy_to, *, crash=False):
    """Copy the checkpoint written at the end of ``epoch`` to ``copy_to``; with ``crash``, die right after it."""
    save = stage.save_position

    def wrapped(path, state, position, *args, **kwargs):
        save(path, state, position, *args, **kwargs)
        if position.epoch == epoch and position.batch == 0:
            shutil.copy(path, copy_to)
            if crash:  # killed between the checkpoint and its log row
                raise KeyboardInterrupt

    monkeypatch.setattr(stage, "save_position", wrapped)


def _reference(tmp_path):
    cfg = config_from_dict({**RESUME, "output_dir": str(tmp_path / "ref")})
    train(cfg)
    return read_csv(tmp_path / "ref" / CSV_FILE)


def _numbers(rows):
    return [{k: r[k] for k in ("epoch", "loss", "accuracy", "steps", "lr")} for r in rows]


def test_resume_drops_the_rows_past_its_checkpoint(tmp_path, monkeypatch):
    ref = _reference(tmp_path)
    run_dir = tmp_path / "run"
    cfg = config_from_dict({**RESUME, "output_dir": str(run_dir)})
    with monkeypatch.context() as m:
        _snapshot_at_epoch(m, 2, tmp_path / "epoch2.safetensors")
        train(cfg)
    first = read_csv(run_dir / CSV_FILE)
    assert len(first) == 4
    # back to the checkpoint of epoch 2: the log has two epochs more than the checkpoint
    shutil.copy(tmp_path / "epoch2.safetensors", run_dir / "checkpoint.safetensors")
    (run_dir / "metrics.json").unlink()
    train(cfg, resume=True)
    text = (run_dir / CSV_FILE).read_text()
    assert text.count("epoch,") == 1
    rows = read_csv(run_dir / CSV_FILE)
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4]  # epochs 3 and 4 once each, as trained again
    assert _numbers(rows) == _numbers(ref)  # resumed bit-identically, logged exactly
    assert [r["time_s"] for r in rows[:2]] == [r["time_s"] for r in first[:2]]  # rows before it are kept
    history = json.loads((run_dir / "metrics.json").read_text())["history"]
    assert [{k: r[k] for k in ("epoch", "loss", "accuracy", "steps")} for r in rows] == history


def test_resume_writes_the_row_a_crash_left_out(tmp_path, monkeypatch):
    ref = _reference(tmp_path)
    run_dir = tmp_path / "run"
    cfg = config_from_dict({**RESUME, "output_dir": str(run_dir)})
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        _snapshot_at_epoch(m, 3, tmp_path / "epoch3.safetensors", crash=True)
        train(cfg)
    assert [r["epoch"] for r in read_csv(run_dir / CSV_FILE)] == [1, 2]  # epoch 3 is in the checkpoint only
    train(cfg, resume=True)
    rows = read_csv(run_dir / CSV_FILE)
    assert _numbers(rows) == _numbers(ref)
    assert rows[2]["time_s"] is None  # rewritten from the checkpoint's history: its time is unknown
    assert rows[3]["time_s"] is not None


def test_rows_before_a_resume_keep_the_learning_rate_they_trained_with(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    cfg = config_from_dict({**RESUME, "output_dir": str(run_dir)})
    save = stage.save_position

    def die_at_epoch_3(path, state, position, *args, **kwargs):
        if position.epoch == 3:
            raise KeyboardInterrupt  # killed before the checkpoint of epoch 3
        save(path, state, position, *args, **kwargs)

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(stage, "save_position", die_at_epoch_3)
        train(cfg)
    before = read_csv(run_dir / CSV_FILE)
    assert [r["epoch"] for r in before] == [1, 2]
    slower = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=0.01))  # `--resume --set optim.lr=0.01`
    train(slower, resume=True)
    rows = read_csv(run_dir / CSV_FILE)
    steps = rows[0]["steps"]
    assert [r["lr"] for r in rows[:2]] == [r["lr"] for r in before]  # as they trained
    assert rows[1]["lr"] == pytest.approx(_cosine(0.05, 2 * steps - 1, 4 * steps), rel=1e-12)
    assert rows[3]["lr"] == pytest.approx(_cosine(0.01, 4 * steps - 1, 4 * steps), rel=1e-12)


def test_a_fresh_run_starts_a_fresh_log(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir).mkdir()
    (run_dir / CSV_FILE).write_text("epoch,loss\n1,9\n2,9\n3,9\n4,9\n5,9\n")  # a stale or foreign file
    cfg = config_from_dict({**RESUME, "train": {"epochs": 2, "progress": False}, "output_dir": str(run_dir)})
    train(cfg, force=True)
    assert [r["epoch"] for r in read_csv(run_dir / CSV_FILE)] == [1, 2]


def test_no_log_when_train_log_is_empty(tmp_path):
    cfg = {**RESUME, "train": {"epochs": 1, "progress": False, "log": []}, "output_dir": str(tmp_path / "run")}
    train(config_from_dict(cfg))
    assert not (tmp_path / "run" / CSV_FILE).exists()


# ---------------------------------------------------------------------------------------------------
# train.log and TensorBoard


def test_train_log_is_a_list_of_known_logs():
    assert TrainConfig().log == (TrainLog.CSV,)  # on by default
    assert TrainConfig(log=["tensorboard", "csv", "csv"]).log == (TrainLog.TENSORBOARD, TrainLog.CSV)
    with pytest.raises(FlatbmaError, match=r"train\.log must be a list"):
        config_from_dict({"method": {"name": "sgd"}, "train": {"log": "csv"}})
    with pytest.raises(FlatbmaError, match=r"train\.log\[1\] must be one of 'csv', 'tensorboard', got 'wandb'"):
        config_from_dict({"method": {"name": "sgd"}, "train": {"log": ["csv", "wandb"]}})
    resolved = config_from_dict({"method": {"name": "sgd"}, "train": {"log": ["csv", "tensorboard"]}}).to_dict()
    assert resolved["train"]["log"] == ["csv", "tensorboard"]  # as YAML reads it back
    assert yaml.safe_load(yaml.safe_dump(resolved)) == resolved


def test_a_run_directory_of_a_config_without_train_log_is_the_same_run(tmp_path):
    cfg = config_from_dict({**RESUME, "output_dir": str(tmp_path)})
    older = cfg.to_dict()
    del older["train"]["log"]  # the logs are no part of a run's identity (run_identity)
    (tmp_path / stage.CONFIG_FILE).write_text(yaml.safe_dump(older))
    stage.check_run_dir(tmp_path, cfg.to_dict(), force=False)  # not "a different config"
    other = config_from_dict({**RESUME, "seed": 1, "output_dir": str(tmp_path)})
    with pytest.raises(FlatbmaError, match="different config"):
        stage.check_run_dir(tmp_path, other.to_dict(), force=False)


def test_tensorboard_without_its_package_is_refused_up_front(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # importing it raises ImportError
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    out_dir = tmp_path / "run"
    code = main(
        [
            "train",
            "--config",
            _config(tmp_path),
            "--set",
            f"output_dir={out_dir}",
            "--set",
            "train.log=[csv,tensorboard]",
        ]
    )
    _, err = capsys.readouterr()
    assert code == 2
    assert len(err.splitlines()) == 1
    assert err.startswith("flatbma: error: train.log: tensorboard needs the tensorboard package")
    assert "pip install 'flatbma[tensorboard]'" in err
    assert not out_dir.exists()  # nothing written, nothing trained


def test_tensorboard_events_hold_the_history(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
    cfg = {**RESUME, "train": {"epochs": 2, "progress": False, "log": ["tensorboard"]}, "output_dir": str(tmp_path)}
    train(config_from_dict(cfg))
    history = json.loads((tmp_path / "metrics.json").read_text())["history"]
    losses = {}
    for path in (tmp_path / "tensorboard").iterdir():
        for event in loader.EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == "train/loss":
                    losses[event.step] = value.tensor.float_val[0] if value.HasField("tensor") else value.simple_value
    assert losses == pytest.approx({h["epoch"]: h["loss"] for h in history}, rel=1e-6)  # float32 in the events
    assert not (tmp_path / CSV_FILE).exists()


# ---------------------------------------------------------------------------------------------------
# the one decision: terminal or not, quiet or not


def test_reporter_bars_on_a_terminal_lines_elsewhere_nothing_when_quiet(capsys):
    cases = {  # reporter: (bar shown, lines printed)
        progress.Reporter(terminal=True): (True, False),
        progress.Reporter(terminal=False): (False, True),
        progress.Reporter(terminal=True, quiet=True): (False, False),
        progress.Reporter(terminal=False, quiet=True): (False, False),
    }
    for reporter, (bar_shown, lines) in cases.items():
        bar = reporter.bar(range(3), desc="x")
        assert bar.disable is not bar_shown
        assert list(bar) == [0, 1, 2]  # a bar or not, the loop is the same
        with reporter.phase("flatness", f"{progress.count(8, 'sample')} λ₁"):
            pass
        reporter.line("epoch 1/2")
        err = capsys.readouterr().err
        if lines:
            assert err == "flatness: 8 samples λ₁ in 0.0 s\nepoch 1/2\n"
        else:
            assert "flatness" not in err and "epoch" not in err


def test_reporting_sets_the_reporter_for_the_block():
    assert not progress.current().quiet
    with progress.reporting(progress.Reporter(quiet=True)):
        assert progress.current().quiet
    assert not progress.current().quiet


@pytest.mark.parametrize("terminal", [True, False])
@pytest.mark.parametrize("quiet", [True, False])
def test_a_bar_draws_no_random_number(terminal, quiet, capsys):
    # every iterator of a DataLoader draws its base seed from the global generator: a bar that opened one more
    # (tqdm.auto's asyncio bar does) would shift MC dropout's masks and change the numbers
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(10.0)), batch_size=3)
    torch.manual_seed(0)
    plain = [b for b in loader]
    after_plain = torch.rand(3)
    torch.manual_seed(0)
    shown = list(progress.Reporter(terminal=terminal, quiet=quiet).bar(loader, desc="BMA"))
    assert torch.equal(torch.rand(3), after_plain)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(plain, shown))
    capsys.readouterr()
