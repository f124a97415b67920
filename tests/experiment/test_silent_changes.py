"""Issue #38 (hardening round 4): nothing a refused command or an edited file can change silently.

Every numbered case of the issue, as data beside the earlier probes (:mod:`tests.experiment.test_hostile_inputs`,
whose tiny finished runs and helpers it shares): each failed on the main of before the change and passes now.

* :data:`ROWS`: command lines through ``flatbma.experiment.cli.main`` in-process, each refused in one line
  (exit code 2, at most :data:`SHORT` characters once its paths are taken out), every file of the row's
  directory byte-identical afterwards (``untouched``) — case 1 (a refused ``--resume --set``), 3 (a hand-edited
  ``config.yaml``), 4 (an edited ``compare.json``, a row's damaged checkpoint), 6 (a finished run's truncated
  or missing checkpoint), 7 (a current-format checkpoint without checksums), 10 (messages that fit their
  cause), 11 (``warmup_epochs`` longer than the run);
* the cases that need more than one command or a second process, each a test of its own below: 2 (only regular
  files are written), 5 (the lock against its deletion and hard links), 6 (``metrics.json`` rebuilt), 8 (health
  rules of regression), 9 (every batch's labels), 10 (divergence advice), 11 (exit status of a flagged run,
  a newline in ``output_dir``, ``load_posterior`` into another architecture, SIGTERM during start-up).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from flatbma.errors import DivergenceError, FlatbmaError
from flatbma.experiment.run.lock import LOCK_FILE
from tests.experiment.test_checkpoint_tamper import _rewrite
from tests.experiment.test_hostile_inputs import (
    CKPT,
    COMPARE,
    ROW,
    Ctx,
    _cli,
    _config,
    _write,
    assert_one_line,
    contents,
    made,  # noqa: F401  (the module's finished SAM and SWAG runs)
)
from tests.helpers import DONE, held_by_another_process

SHORT = 200
"""The longest error line, once the paths it names are taken out."""


def _short(line: str, *roots: Path) -> str:
    """``line`` with every path under ``roots`` replaced by ``P``, for its length."""
    for root in roots:
        line = re.sub(re.escape(str(root)) + r"[^\s:;,'()]*", "P", line)
    return line


# ---------------------------------------------------------------------------------------------------
# the rows


def resume_set(*items: str) -> Callable[[Ctx], list[str]]:
    """``train --resume`` of a copy of the SAM run with ``--set`` items."""

    def argv(ctx: Ctx) -> list[str]:
        return ["train", "--resume", str(ctx.copy("sam")), *(a for item in items for a in ("--set", item))]

    return argv


def evaluate_with_config(**changes: Any) -> Callable[[Ctx], list[str]]:
    """``evaluate`` of a copy of the SAM run whose ``config.yaml`` has ``changes`` (dotted keys) written into it."""

    def argv(ctx: Ctx) -> list[str]:
        run = ctx.copy("sam")
        _edit_config(run, changes)
        return ["evaluate", str(run)]

    return argv


def _edit_config(run: Path, changes: dict[str, Any]) -> dict[str, Any]:
    """``run``'s ``config.yaml`` with ``changes`` (dotted keys) written into it by hand; returns it (``output_dir``:
    the run's place)."""
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    for key, value in changes.items():
        section, _, name = key.rpartition(".")
        (cfg[section] if section else cfg)[name] = value
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return {**cfg, "output_dir": str(run)}


def edited_then_trained(**changes: Any) -> Callable[[Ctx], list[str]]:
    """``train --config`` of a finished run's ``config.yaml`` edited by hand (the config file says the same)."""

    def argv(ctx: Ctx) -> list[str]:
        run = ctx.copy("sam")
        cfg = _edit_config(run, changes)
        return ["train", "--config", _write(ctx.tmp / "edited.yaml", cfg)]

    return argv


def compare_edited_row(ctx: Ctx) -> list[str]:
    out, again = ctx.compare()
    row = out / ROW / "compare.json"
    cached = json.loads(row.read_text())
    cached["result"]["accuracy"] = min(cached["result"]["accuracy"] + 0.6, 1.0)
    row.write_text(json.dumps(cached, indent=2, sort_keys=True) + "\n")
    return again


def _flip_a_bit(path: Path) -> None:
    """One bit of the last tensor byte of the safetensors file at ``path`` flipped (its data sits at the end)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def compare_damaged_checkpoint(ctx: Ctx) -> list[str]:
    out, again = ctx.compare()
    _flip_a_bit(out / ROW / CKPT)
    return again


def finished_without_checkpoint(how: str) -> Callable[[Ctx], list[str]]:
    def argv(ctx: Ctx) -> list[str]:
        run = ctx.copy("sam")
        ckpt = run / CKPT
        if how == "truncated":
            ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
        else:
            ckpt.unlink()
        return ["train", "--config", _write(ctx.tmp / "c.yaml", _config(run))]

    return argv


def without_checksums(tensors: Callable[[dict], None] | None = None) -> Callable[[Ctx], list[str]]:
    def argv(ctx: Ctx) -> list[str]:
        run = ctx.copy("sam")
        _rewrite(run / CKPT, tensors=tensors, meta=lambda meta: meta.pop("checksums"))
        return ["evaluate", str(run)]

    return argv


def _tripled(tensors: dict) -> None:
    tensors.update({k: v * 3 for k, v in tensors.items() if k.startswith("params/")})


def damaged_metrics(ctx: Ctx) -> list[str]:
    run = ctx.copy("sam")
    (run / "metrics.json").write_text('{"accuracy": 0.9')
    return ["train", "--config", _write(ctx.tmp / "c.yaml", _config(run))]


def edited_metrics(ctx: Ctx) -> list[str]:
    run = ctx.copy("sam")
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["accuracy"] = 0.99
    (run / "metrics.json").write_text(json.dumps(metrics))
    return ["train", "--config", _write(ctx.tmp / "c.yaml", _config(run))]


def checkpoint_a_directory(ctx: Ctx) -> list[str]:
    run = ctx.copy("sam")
    (run / CKPT).unlink()
    (run / CKPT).mkdir()
    return ["evaluate", str(run)]


def symlinked_output_dir(target: str) -> Callable[[Ctx], list[str]]:
    """``output_dir`` a symbolic link to itself (a loop) or to nothing (dangling)."""

    def argv(ctx: Ctx) -> list[str]:
        link = ctx.tmp / "link"
        link.symlink_to(link if target == "loop" else ctx.tmp / "nowhere")
        return ["train", "--config", _write(ctx.tmp / "c.yaml", _config(link))]

    return argv


def fifo_output(name: str) -> Callable[[Ctx], list[str]]:
    """``evaluate`` of a copy of the SAM run whose ``name`` is a FIFO (replaced by a file before)."""

    def argv(ctx: Ctx) -> list[str]:
        run = ctx.copy("sam")
        (run / name).unlink()
        os.mkfifo(run / name)
        return ["evaluate", str(run)]

    return argv


@dataclass(frozen=True)
class Row:
    """A case of the issue: ``argv`` builds its input in the row's directory and returns the command line;
    ``expected`` is in the one error line. Every file of the row's directory is left byte-identical."""

    id: str
    argv: Callable[[Ctx], list[str]]
    expected: str


ROWS = [
    # 1. a refused --resume --set changes nothing; evaluate validates what it reads
    Row("1-resume-n_bins-1e9", resume_set("eval.n_bins=1000000000"), "eval.n_bins=1000000000 is more than the 100"),
    Row("1-resume-n_bins-200", resume_set("eval.n_bins=200"), "eval.n_bins=200 is more than the 100 test examples"),
    Row("1-resume-ood-absent", resume_set("eval.ood=cifar10"), "eval.ood 'cifar10': the data set cannot be read"),
    Row("1-resume-tensorboard", resume_set("train.log=[tensorboard]"), "train.log: tensorboard needs the tensorboard"),
    Row("1-resume-epochs-and-n_bins", resume_set("train.epochs=3", "eval.n_bins=500"), "eval.n_bins=500 is more"),
    Row(
        "1-evaluate-n_bins",
        evaluate_with_config(**{"eval.n_bins": 10**9}),
        "eval.n_bins=1000000000 is more than the 100",
    ),
    Row(
        "1-evaluate-ood-absent",
        lambda ctx: ["evaluate", str(ctx.copy("sam")), "--ood", "cifar10"],
        "eval.ood 'cifar10': the data set cannot be read",
    ),
    # 2. only regular files are replaced
    Row("2-evaluate-metrics.json-fifo", fifo_output("metrics.json"), "metrics.json is not a regular file"),
    # 3. a hand-edited config.yaml is not the finished run
    Row("3-edited-seed", edited_then_trained(seed=1), "config.yaml is not the config its checkpoint was trained with"),
    Row(
        "3-edited-lr",
        edited_then_trained(**{"optim.lr": 0.5}),
        "config.yaml is not the config its checkpoint was trained with (optim.lr=0.05 vs 0.5",
    ),
    Row("3-evaluate-edited-seed", evaluate_with_config(seed=1), "another config than its run directory's config.yaml"),
    # 4. a row's compare.json and checkpoint are verified
    Row("4-compare.json-edited", compare_edited_row, "compare.json is damaged (it does not match its checksum)"),
    Row("4-row-checkpoint-bit", compare_damaged_checkpoint, "does not match its checksum"),
    # 6. a finished run's checkpoint truncated or missing
    Row("6-truncated-checkpoint", finished_without_checkpoint("truncated"), "finished run, but its checkpoint"),
    Row("6-missing-checkpoint", finished_without_checkpoint("missing"), "finished run, but its checkpoint"),
    # 7. a current-format checkpoint without its checksums
    Row("7-no-checksums", without_checksums(), "records no checksums"),
    Row("7-no-checksums-weights-x3", without_checksums(_tripled), "records no checksums"),
    # 10. messages that fit their cause
    Row("10-damaged-metrics.json", damaged_metrics, "but its metrics.json is damaged"),
    Row("10-edited-metrics.json", edited_metrics, "but its metrics.json is damaged"),
    Row("10-checkpoint-a-directory", checkpoint_a_directory, "is a directory, not a checkpoint file"),
    Row("10-output_dir-symlink-loop", symlinked_output_dir("loop"), "is a symbolic link that leads nowhere"),
    Row("10-output_dir-dangling-symlink", symlinked_output_dir("dangling"), "is a symbolic link that leads nowhere"),
    # 11. minor
    Row(
        "11-warmup-longer-than-the-run",
        lambda ctx: ctx.train(optim={"warmup_epochs": 100}),
        "optim.warmup_epochs=100 is longer than the 2 epochs",
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_a_refused_command_changes_nothing(row: Row, made: dict[str, Path], tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    monkeypatch.chdir(tmp_path)
    own = tmp_path / "row"
    own.mkdir()
    argv = row.argv(Ctx(own, made, monkeypatch))
    before = contents(own)
    code, err = _cli([*argv, "--quiet"])
    line = assert_one_line(code, err, row.expected)
    assert len(_short(line, own)) <= SHORT, line
    assert contents(own) == before, "a refused command changed files"
    assert not list(own.rglob("*.tmp"))


# ---------------------------------------------------------------------------------------------------
# 2. only regular files are ever written or replaced


@pytest.fixture(scope="module")
def bma() -> Any:
    import flatbma

    x, y = torch.randn(32, 5, generator=torch.Generator().manual_seed(0)), torch.arange(32) % 3
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    return flatbma.fit_posterior(net, loader, "sgd", epochs=1, num_samples=1)


def _special_files(tmp_path: Path) -> dict[str, Path]:
    """A FIFO, a symbolic link to ``/dev/null`` and (as root) a character device: none a regular file."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to-null").symlink_to("/dev/null")
    out = {"fifo": tmp_path / "fifo", "symlink-to-device": tmp_path / "to-null"}
    if os.geteuid() == 0:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        out["device"] = tmp_path / "null"
    return out


def test_bma_save_replaces_only_regular_files(bma: Any, tmp_path: Path) -> None:
    """Case 2: ``bma.save('/dev/full')`` replaced the device node with a 12 KB file (as root); a FIFO likewise."""
    for kind, path in _special_files(tmp_path).items():
        before = os.lstat(path)
        with pytest.raises(FlatbmaError) as info:
            bma.save(path)
        after = os.lstat(path)
        assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev), kind
        assert str(path) in str(info.value) and "regular file" in str(info.value), str(info.value)
    assert not list(tmp_path.glob(".*.tmp"))
    # a hard-linked file is replaced by the new one under its name; the other name keeps its bytes
    (tmp_path / "kept").write_bytes(b"precious")
    os.link(tmp_path / "kept", tmp_path / "bma.safetensors")
    bma.save(tmp_path / "bma.safetensors")
    assert (tmp_path / "kept").read_bytes() == b"precious"


# ---------------------------------------------------------------------------------------------------
# 5. the lock holds against its own deletion; a hard-linked lock file is never emptied


def test_deleting_the_lock_file_of_a_held_run_lets_no_second_writer_in(made, tmp_path, capsys) -> None:  # noqa: F811
    """Case 5: with ``.flatbma-lock`` deleted during a run, a second writer got in (``log.csv`` with every epoch
    twice)."""
    run = tmp_path / "run"
    shutil.copytree(made["sam"], run)
    before = contents(run)
    with held_by_another_process(run):
        (run / LOCK_FILE).unlink()
        code, err = _cli(["evaluate", str(run), "--quiet"])
        assert_one_line(code, err, "is in use by")
    assert {k: v for k, v in contents(run).items() if not k.endswith(LOCK_FILE)} == {
        k: v for k, v in before.items() if not k.endswith(LOCK_FILE)
    }


def test_a_hard_linked_lock_file_is_never_emptied(made, tmp_path) -> None:  # noqa: F811
    run = tmp_path / "run"
    shutil.copytree(made["sam"], run)
    (tmp_path / "precious").write_bytes(b"precious")
    (run / LOCK_FILE).unlink()
    os.link(tmp_path / "precious", run / LOCK_FILE)  # as in a run directory copied with cp -al
    code, err = _cli(["evaluate", str(run), "--quiet"])
    assert code in DONE and (tmp_path / "precious").read_bytes() == b"precious", err
    assert (run / LOCK_FILE).stat().st_nlink == 1


# ---------------------------------------------------------------------------------------------------
# 6. metrics.json rebuilt from the checkpoint and log.csv


def test_a_lost_metrics_json_is_rebuilt_with_everything_the_run_recorded(made, tmp_path) -> None:  # noqa: F811
    run = tmp_path / "run"
    shutil.copytree(made["sam"], run)
    original = json.loads((run / "metrics.json").read_text())
    (run / "metrics.json").unlink()
    code, err = _cli(["evaluate", str(run), "--quiet"])
    assert code in DONE, err
    rebuilt = json.loads((run / "metrics.json").read_text())
    for key in ("history", "environment", "method", "seed", "steps", "health", "accuracy", "nll"):
        assert rebuilt.get(key) == original[key], key
    times = [float(r["time_s"]) for r in _csv_rows(run / "log.csv")]
    assert rebuilt["train_time_s"] == pytest.approx(sum(times))
    before = contents(run)
    code, err = _cli(["train", "--config", _write(tmp_path / "c.yaml", _config(run)), "--quiet"])
    assert code in DONE and contents(run) == before, err  # the rebuilt run is finished: nothing trained


def _csv_rows(path: Path) -> list[dict[str, str]]:
    import csv

    with path.open() as f:
        return list(csv.DictReader(f))


def test_rebuilt_health_keeps_the_loss_rise_of_the_history(made, tmp_path) -> None:  # noqa: F811
    """An FP-BMA run whose loss rose 13,306x came back flagged only ``at_chance``: the rebuilt health reads the
    checkpoint's history, so a rise in it is flagged again."""
    from flatbma.health import assess

    run = tmp_path / "run"
    shutil.copytree(made["sam"], run)
    history = json.loads((run / "metrics.json").read_text())["history"]
    rising = [{**h, "loss": h["loss"] * (1 + 10 * i)} for i, h in enumerate(history)]
    assert "loss_rise" in assess(rising, None)["flags"]
    (run / "metrics.json").unlink()
    assert _cli(["evaluate", str(run), "--quiet"])[0] in DONE
    assert json.loads((run / "metrics.json").read_text())["health"]["first_loss"] == history[0]["loss"]


# ---------------------------------------------------------------------------------------------------
# 8. health rules of a regression run


REGRESSION = {
    "seed": 0,
    "method": {"name": "sgd"},
    "data": {"name": "diabetes", "batch_size": 64},
    "model": {"name": "mlp", "width": 8, "likelihood": "gaussian"},
    "optim": {"lr": 0.01},
    "train": {"epochs": 4, "progress": False},
    "eval": {"num_samples": 1},
}


def _fit(rmse: float, test_rmse: float, std: float = 1.0) -> dict[str, Any]:
    return {
        "regression": {"data": "training", "examples": 353, "rmse": rmse, "target_std": std, "test_rmse": test_rmse}
    }


def _rmse(*values: float) -> list[dict[str, float]]:
    return [{"epoch": i + 1, "loss": 1.0, "rmse": value} for i, value in enumerate(values)]


@pytest.mark.parametrize(
    ("history", "fit", "flags"),
    [
        (_rmse(0.954, 0.621), _fit(0.62, 0.76), []),  # diabetes, SGD at lr 0.01
        (_rmse(0.95, 0.93), _fit(0.935, 1.0), []),  # two epochs of an 8-unit MLP: little, but learned
        (_rmse(0.991, 0.991), _fit(0.991, 1.014), ["learned_nothing"]),  # lr 1e-9: R² 0.018 from its start alone
        (_rmse(2.0, 1.05), _fit(1.02, 1.1), ["at_mean_predictor"]),  # no better than predicting the mean
        (_rmse(0.9, 0.5), _fit(0.5, 31.6), ["rmse_blowup"]),  # adam at lr 1
        (_rmse(630.0, 20.0), _fit(20.0, 67.6), ["at_mean_predictor", "rmse_blowup"]),
        (_rmse(0.9), _fit(0.9, 1.0), []),  # one epoch: nothing to compare
    ],
)
def test_the_regression_rules(history: list, fit: dict[str, Any], flags: list[str]) -> None:
    from flatbma.health import assess

    health = assess(history, fit)
    assert health["flags"] == flags and health["ok"] is (not flags)


def test_a_regression_run_that_learned_nothing_is_flagged(tmp_path: Path) -> None:
    """Case 8: test RMSE 31.6 (adam, lr 1), 67.6 (swag, scale 1000) and lr 1e-9 all had ``health.ok: true``."""
    cfg = {**REGRESSION, "optim": {"lr": 1.0e-9}, "output_dir": str(tmp_path / "run")}
    code, err = _cli(["train", "--config", _write(tmp_path / "c.yaml", cfg), "--quiet"])
    health = json.loads((tmp_path / "run" / "metrics.json").read_text())["health"]
    assert health["ok"] is False and "learned_nothing" in health["flags"], health
    assert code == 3 and "learned nothing" in err, err


# ---------------------------------------------------------------------------------------------------
# 9. every batch's labels


def test_an_out_of_range_label_after_the_first_batch_is_one_flatbma_error() -> None:
    import flatbma

    g = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    batches = [(torch.randn(8, 5, generator=g), torch.arange(8) % 3) for _ in range(3)]
    batches[2] = (batches[2][0], batches[2][1] + 5)
    with pytest.raises(FlatbmaError) as info:
        flatbma.fit_posterior(net, batches, "sgd", epochs=1)
    assert not isinstance(info.value, IndexError)
    assert str(info.value).startswith("label 5 is out of range"), str(info.value)
    assert "batch 3" in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------------
# 10. advice that names the setting that caused a divergence


def test_non_finite_inputs_are_named_not_the_learning_rate() -> None:
    import flatbma

    g = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    batches = [(torch.randn(8, 5, generator=g), torch.arange(8) % 3) for _ in range(3)]
    batches[1][0][3, 2] = float("nan")
    with pytest.raises(DivergenceError) as info:
        flatbma.fit_posterior(net, batches, "sgd", epochs=1)
    message = str(info.value)
    assert "the inputs hold NaN or inf" in message and "learning rate" not in message, message
    assert len(message) <= SHORT


def test_a_diverged_fp_bma_names_its_own_step_settings(tmp_path: Path) -> None:
    """FP-BMA at ``gamma: 1e4`` and ``init_std: 1`` said 'a linear solve failed … lower the learning rate' in 544
    characters; following it failed the same way. Now the method's settings come first, in one short line."""
    run = tmp_path / "run"
    cfg = _config(run, method={"name": "fp-bma", "rank": 2, "gamma": 1.0e4, "init_std": 1.0})
    code, err = _cli(["train", "--config", _write(tmp_path / "c.yaml", cfg), "--quiet"])
    line = assert_one_line(code, err, "a linear solve failed at step")
    assert "; lower method.init_std=1, method.gamma=10000 or optim.lr=0.05, then train again" in line, line
    assert len(_short(line, run)) <= SHORT, line


# ---------------------------------------------------------------------------------------------------
# 11. exit status of a flagged run; a newline in output_dir; another architecture; SIGTERM during start-up


COLLAPSING = {
    "seed": 0,
    "method": {"name": "sgd"},
    "data": {"name": "digits", "k_shot": 10, "batch_size": 25, "test_limit": 100},
    "model": {"name": "mlp", "width": 16},
    "optim": {"lr": 30.0},
    "train": {"epochs": 10, "progress": False},
    "eval": {"num_samples": 1},
}
"""Plain SGD at ``lr = 30`` on the digits MLP: its BMA predicts one class (``tests/experiment/test_health.py``)."""


def test_a_flagged_run_exits_3_and_says_so_in_whole_lines(tmp_path: Path) -> None:
    run = tmp_path / "a\nb"  # a newline in output_dir split the warning line
    config = _write(tmp_path / "c.yaml", {**COLLAPSING, "output_dir": str(run)})
    for argv in (["train", "--config", config], ["evaluate", str(run)], ["train", "--config", config]):
        code, err = _cli([*argv, "--quiet"])
        lines = err.splitlines()
        assert code == 3 and len(lines) == 1 and lines[0].startswith("flatbma: warning: "), (argv, code, err)
        assert "looks collapsed" in lines[0] and "a\\nb" in lines[0], lines[0]


def test_a_comparison_with_a_diverged_row_exits_3(tmp_path: Path) -> None:
    hot = {"name": "sgd", "label": "sgd-hot", "optim": {"lr": 1.0e6}}
    compare = {**COMPARE["compare"], "methods": [{"name": "sgd"}, hot]}
    config = _write(tmp_path / "c.yaml", {**COMPARE, "compare": compare, "output_dir": str(tmp_path / "out")})
    code, err = _cli(["compare", "--config", config, "--quiet"])
    assert code == 3 and "sgd-hot seed 0 diverged" in err, err


def test_load_posterior_into_another_architecture_is_refused(bma: Any, tmp_path: Path) -> None:
    import flatbma

    bma.save(tmp_path / "bma.safetensors")
    same = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    assert flatbma.load_posterior(tmp_path / "bma.safetensors", same).num_samples == 1
    other = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with pytest.raises(FlatbmaError) as info:
        flatbma.load_posterior(tmp_path / "bma.safetensors", other)
    assert "another architecture" in str(info.value) and "Tanh" in str(info.value), str(info.value)


SIGTERM_IN_IMPORTS = """
import builtins, os, signal, sys
from importlib.metadata import entry_points

real = builtins.__import__


def importing(name, *args, **kwargs):  # SIGTERM while flatbma imports torch, as a kill during start-up
    if name == "torch" and not getattr(importing, "sent", False):
        importing.sent = True
        os.kill(os.getpid(), signal.SIGTERM)
    return real(name, *args, **kwargs)


builtins.__import__ = importing
command = entry_points(group="console_scripts")["flatbma"].load()  # what the installed command runs
sys.argv = ["flatbma", "methods"]
sys.exit(command())
"""


def test_sigterm_during_start_up_is_one_line() -> None:
    """Case 11: SIGTERM while ``flatbma`` imports torch ended with 143 and no line (the command's handler was not
    installed yet). The installed ``flatbma`` command is run with SIGTERM sent as it imports torch."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SIGTERM_IN_IMPORTS], capture_output=True, text=True, env=env)
    assert done.returncode == 143, (done.returncode, done.stderr[-2000:])
    assert done.stderr.strip().splitlines() == ["flatbma: terminated (SIGTERM); finished checkpoints are kept"]


def test_an_accepted_resume_is_recorded_and_finishes_the_run_under_its_config(made, tmp_path) -> None:  # noqa: F811
    """Case 1, the other way round: an accepted ``--resume --set`` records its change, and the checkpoint records
    the config the run goes on with, so that the run counts as finished under it (nothing trained again)."""
    run = tmp_path / "run"
    shutil.copytree(made["sam"], run)
    code, err = _cli(["train", "--resume", str(run), "--set", "eval.n_bins=5", "--quiet"])
    assert code in DONE, err
    assert yaml.safe_load((run / "config.yaml").read_text())["eval"]["n_bins"] == 5
    assert json.loads((run / "resumes.json").read_text())[-1]["changed"] == {"eval.n_bins": {"old": 15, "new": 5}}
    before = contents(run)
    code, err = _cli(["train", "--config", _write(tmp_path / "c.yaml", _config(run, eval={"n_bins": 5})), "--quiet"])
    assert code in DONE and contents(run) == before, err
