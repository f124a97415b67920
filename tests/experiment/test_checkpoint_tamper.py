"""Checkpoints say who wrote them; tampered, foreign or damaged ones, full disks and read-only file systems
end in one line; stale temporary files go; outputs get the umask's mode; ``--resume --set`` changes the
learning rate, epochs, cadence or evaluation of a run and records it.

Every refusal goes through :func:`flatbma.experiment.cli.main` (one line ``flatbma: error: ...``, exit 2)
or :func:`~flatbma.experiment.run.checkpoint.load_position` (only :class:`FlatbmaError`). Runs are tiny
(digits, a 4-unit MLP, 2 epochs of 19 steps).
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.run.build import build_experiment
from flatbma.experiment.run.checkpoint import load_checkpoint, load_position
from flatbma.experiment.run.pipeline import load_run_config
from flatbma.experiment.run.provenance import template
from flatbma.loop import fit
from flatbma.optim import SGD
from flatbma.params import Objective, model_buffers, trainable_params
from tests.helpers import DONE

CKPT = "checkpoint.safetensors"
CONFIG = {
    "seed": 0,
    "method": {"name": "sam", "rho": 0.05},
    "data": {"name": "digits", "batch_size": 64},
    "model": {"name": "mlp", "width": 4},
    "optim": {"lr": 0.05, "schedule": "constant"},
    "train": {"epochs": 2, "checkpoint_every": 7, "progress": False},
    "eval": {"num_samples": 1},
}
STEPS_PER_EPOCH = 19  # digits: 1198 training images in batches of 64
METHODS = {
    "sam": {"name": "sam", "rho": 0.05},
    "swag": {"name": "swag", "rank": 2, "start_step": 0, "collect_every": 5},
    "sgld": {"name": "sgld", "burn_in": 5, "thin": 5},  # its state grows: it keeps samples in aux
}


def _cfg(out: Path, **sections) -> dict:
    cfg = json.loads(json.dumps(CONFIG))
    for key, value in sections.items():
        merge = isinstance(value, dict) and key != "method"
        cfg[key] = {**cfg.get(key, {}), **value} if merge else value
    return {**cfg, "output_dir": str(out)}


def _write(path: Path, cfg: dict) -> str:
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def _error(capsys, *argv: str) -> str:
    code, err = _run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("flatbma: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Finished runs of SAM, SWAG and SGLD on the same model."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, method in METHODS.items():
        config = _write(root / f"{name}.yaml", _cfg(root / name, method=method))
        assert main(["train", "--config", config]) in DONE
        out[name] = root / name
    return out


def _copy(run: Path, tmp_path: Path, name: str = "copy") -> Path:
    dst = tmp_path / name
    shutil.copytree(run, dst)
    return dst


def _rewrite(path: Path, *, tensors=None, meta=None) -> None:
    """Rewrite the checkpoint at ``path`` with ``tensors(dict)`` / ``meta(dict)`` applied in place."""
    data = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
    if tensors is not None:
        tensors(data)
    if meta is not None:
        meta(metadata)
    save_file(data, str(path), metadata=metadata)


# ---------------------------------------------------------------------------------------------------
# who wrote it


@pytest.mark.parametrize("command", ["evaluate", "resume"])
def test_a_swag_checkpoint_in_a_sam_run_is_refused_naming_both(runs, tmp_path, capsys, command):
    run = _copy(runs["sam"], tmp_path)
    shutil.copy(runs["swag"] / CKPT, run / CKPT)
    argv = ["evaluate", str(run)] if command == "evaluate" else ["train", "--resume", str(run)]
    msg = _error(capsys, *argv)
    assert f"checkpoint {run / CKPT} was written by method 'swag' but this run is 'sam'" in msg


def _before_the_records(meta: dict) -> None:
    """A checkpoint of an older layout: no record of who wrote it, its config, data or environment (format v1)."""
    for key in ("written_by", "config", "data", "environment"):
        meta.pop(key)
    meta["format"] = "flatbma-state-v1"


@pytest.mark.parametrize("command", ["evaluate", "resume"])
def test_a_checkpoint_of_an_older_layout_is_refused_in_one_line(runs, tmp_path, capsys, command):
    """flatbma has no release: a checkpoint an older version wrote is refused by its format tag, never read by
    guess; and one of today's format without the record of who wrote it (an edit) is refused too."""
    for name, edit, expected in (
        ("older", _before_the_records, "(format tag 'flatbma-state-v1', not flatbma-state-v2)"),
        ("unsigned", lambda meta: meta.pop("written_by"), "does not record who wrote it"),
    ):
        run = _copy(runs["sam"], tmp_path, name)
        _rewrite(run / CKPT, meta=edit)
        argv = ["evaluate", str(run)] if command == "evaluate" else ["train", "--resume", str(run)]
        msg = _error(capsys, *argv)
        assert f"{run / CKPT} " in msg and expected in msg


def test_sgld_samples_kept_in_aux_are_its_own_state(runs, tmp_path, capsys):
    state, _, _ = load_checkpoint(runs["sgld"] / CKPT)
    assert any(k.startswith("sgld/samples/") for k in state.aux)  # entries its fresh state lacks
    run = _copy(runs["sgld"], tmp_path)
    assert _run(capsys, "train", "--resume", str(run))[0] in DONE
    _rewrite(run / CKPT, tensors=lambda t: t.update({"aux/samples/fc.bogus": torch.zeros(2, 3)}))
    assert "aux/samples/fc.bogus is unexpected" in _error(capsys, "evaluate", str(run))


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("method.rho", 0.1, "other sam options than this run's (rho=0.05 vs 0.1; checkpoint vs run)"),
        ("model.dropout", 0.5, "another model than this run's (model dropout=0.0 vs 0.5; checkpoint vs run)"),
    ],
)
def test_other_options_or_another_model_are_refused(runs, tmp_path, capsys, key, value, expected):
    """The state's tensors fit (same shapes), but the run's config is not the one that trained it."""
    run = _copy(runs["sam"], tmp_path)
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    section, name = key.split(".")
    resolved[section][name] = value
    (run / "config.yaml").write_text(yaml.safe_dump(resolved))
    assert expected in _error(capsys, "evaluate", str(run))


# ---------------------------------------------------------------------------------------------------
# tampered tensors and positions, each one line


def _set(**meta):
    return lambda m: m.update({k: str(v) for k, v in meta.items()})


def _retype(dtype):
    return lambda t: t.update({k: v.to(dtype) for k, v in t.items() if k.startswith("params/")})


TAMPERS = {
    "float16 params": (dict(tensors=_retype(torch.float16)), "params/features.1.weight is float16 instead of float32"),
    "int64 params": (dict(tensors=_retype(torch.int64)), "is int64 instead of float32"),
    "reshaped param": (
        dict(tensors=lambda t: t.update({"params/features.1.weight": t["params/features.1.weight"].reshape(-1)})),
        "params/features.1.weight has shape",
    ),
    "extra param": (dict(tensors=lambda t: t.update({"params/x": torch.zeros(1)})), "params/x is unexpected"),
    "step=-1000": (dict(meta=_set(step=-1000)), "step -1000 is not in [0, 38]"),
    "epoch=-3": (dict(meta=_set(epoch=-3)), "epoch -3 is not in [0, train.epochs=2]"),
    "batch=1000": (dict(meta=_set(epoch=1, batch=1000)), "batch 1000 of epoch 1 is not in [0, 19]"),
    "batch past the end": (dict(meta=_set(batch=3)), "batch 3 of epoch 2 is not in [0, 0]"),
    "partial of two": (dict(meta=_set(partial="[1.0, 2.0]")), "partial sums [1.0, 2.0]"),
    "partial text": (dict(meta=_set(partial='"abc"')), "partial sums"),
    "partial nan": (dict(meta=_set(partial="[NaN, 0, 0]")), "partial sums"),
    "correct > n": (dict(meta=_set(partial="[1.0, 5.0, 2.0]")), "partial sums"),
    "rng too short": (
        dict(tensors=lambda t: t.update({"extra/torch_rng": t["extra/torch_rng"][:100]})),
        "torch RNG state: uint8 (100,) instead of uint8 (5056,)",
    ),
    "rng int64": (
        dict(tensors=lambda t: t.update({"extra/torch_rng": t["extra/torch_rng"].long()})),
        "torch RNG state: int64",
    ),
    "rng garbage": (
        dict(tensors=lambda t: t.update({"extra/torch_rng": torch.zeros(5056, dtype=torch.uint8)})),
        "torch RNG state: Invalid mt19937 state",
    ),
    "loader rng missing": (dict(tensors=lambda t: t.pop("extra/loader_rng")), "no data-order RNG state"),
    "extra tensor": (dict(tensors=lambda t: t.update({"extra/x": torch.zeros(1)})), "unexpected tensor extra/x"),
    "history": (dict(meta=_set(history='[{"epoch": "x"}]')), "has no resumable position"),
    "written_by damaged": (dict(meta=_set(written_by="{")), "the record of who wrote it is damaged"),
}


@pytest.mark.parametrize("case", list(TAMPERS))
def test_tampered_checkpoints_are_one_line_refusals(runs, tmp_path, capsys, case):
    """The tampered checkpoints of issue #13 (before: RuntimeError, ValueError, TypeError, StopIteration, or
    ``epoch=-3`` training extra epochs)."""
    changes, expected = TAMPERS[case]
    run = _copy(runs["sam"], tmp_path)
    (run / "metrics.json").unlink()
    _rewrite(run / CKPT, **changes)
    assert expected in _error(capsys, "train", "--resume", str(run))
    assert not (run / "metrics.json").exists()


@pytest.fixture(scope="module")
def sam_template(runs):
    return template(build_experiment(load_run_config(runs["sam"])))


DTYPES = [torch.float16, torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool]
META_VALUES = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["", "nan", "1e3", "+3", "1_0", "[]", "{}", "null", "[0, 0, 0]", "[1, 2, 3]", '"x"']),
    st.lists(
        st.one_of(st.floats(allow_nan=True), st.integers(-5, 5), st.booleans(), st.none(), st.text(max_size=2)),
        max_size=4,
    ).map(json.dumps),
    st.text(max_size=8),
)


@st.composite
def tampers(draw, keys: list[str], epochs: int):
    """One or two changes: a tensor's dtype or shape, a dropped or added tensor, a metadata value."""
    ops = []
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(["dtype", "shape", "drop", "add", "meta", "meta", "position"]))
        key = draw(st.sampled_from(keys))
        if kind == "dtype":
            ops.append(("dtype", key, draw(st.sampled_from(DTYPES))))
        elif kind == "shape":
            ops.append(("shape", key, draw(st.sampled_from(["flat", "unsqueeze", "shorter", "longer"]))))
        elif kind in ("drop", "add"):
            ops.append((kind, key, None))
        elif kind == "meta":
            name = draw(st.sampled_from(["step", "epoch", "batch", "partial", "history", "written_by", "order"]))
            ops.append(("meta", name, draw(META_VALUES)))
        else:  # a position near the edges of its range
            name = draw(st.sampled_from(["step", "epoch", "batch"]))
            ops.append(("meta", name, str(draw(st.integers(-2, 2 * epochs * STEPS_PER_EPOCH + 2)))))
    return ops


def _apply(ops, tensors: dict, meta: dict) -> None:
    for kind, key, arg in ops:
        if kind == "meta":
            meta[key] = arg
        elif key not in tensors:
            continue
        elif kind == "dtype":
            tensors[key] = tensors[key].to(arg)
        elif kind == "shape":
            flat = tensors[key].reshape(-1)
            shaped = {
                "flat": flat,
                "unsqueeze": tensors[key].unsqueeze(0),
                "shorter": flat[: max(flat.numel() - 1, 0)],
                "longer": torch.cat([flat, flat[:1]]),
            }
            tensors[key] = shaped[arg]
        elif kind == "drop":
            del tensors[key]
        else:
            tensors[f"{key}.extra"] = torch.zeros(2)


def test_fuzzed_checkpoints_load_only_in_range_or_raise_flatbma_error(runs, sam_template, tmp_path):
    """Hypothesis: dtype, shape and position fuzz. A loaded checkpoint fits the template and lies in range."""
    good = runs["sam"] / CKPT
    tensors = load_file(str(good))
    with safe_open(str(good), framework="pt") as f:
        meta = dict(f.metadata())
    path = tmp_path / CKPT
    t = sam_template

    @settings(deadline=None, max_examples=150, suppress_health_check=list(HealthCheck))
    @given(ops=tampers(sorted(tensors), t.epochs))
    def check(ops):
        data, metadata = dict(tensors), dict(meta)
        _apply(ops, data, metadata)
        save_file(data, str(path), metadata=metadata)
        try:
            state, position, history = load_position(path, t)
        except FlatbmaError as e:
            assert "\n" not in str(e) and len(str(e)) < 600
            return
        for section in ("params", "buffers", "aux"):
            have, want = getattr(state, section), getattr(t.state, section)
            assert have.keys() == want.keys()
            assert all(have[k].dtype == want[k].dtype and have[k].shape == want[k].shape for k in want)
        assert 0 <= state.step <= t.epochs * t.batches
        assert 0 <= position.epoch <= t.epochs and 0 <= position.batch <= t.batches
        assert len(position.partial) == 3 and position.torch_rng.shape == (5056,)
        torch.Generator().set_state(position.torch_rng)

    check()


# ---------------------------------------------------------------------------------------------------
# full disks, read-only file systems, stale temporary files, file modes


def test_a_full_disk_while_training_is_one_line_and_the_last_checkpoint_resumes(runs, tmp_path, capsys, monkeypatch):
    """ENOSPC at the second checkpoint (step 14): simulated in ``os.fsync`` of its temporary file."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to tell the checkpoint's writes apart")
    out = tmp_path / "full"
    config = _write(tmp_path / "c.yaml", _cfg(out))
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(out / ".checkpoint.safetensors.")):
            calls.append(fd)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    msg = _error(capsys, "train", "--config", config)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert msg == (
        f"flatbma: error: no space left on {out / CKPT}: free space or choose another output_dir; "
        "the last checkpoint at step 7 is intact"
    )
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert load_checkpoint(out / CKPT)[0].step == 7
    assert _run(capsys, "train", "--resume", str(out))[0] in DONE  # space freed: the run resumes exactly
    a, b = load_file(str(runs["sam"] / CKPT)), load_file(str(out / CKPT))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_read_only_run_directory_is_one_line(runs, tmp_path):
    """A real read-only file system: the run directory bind-mounted read-only in a private mount namespace
    (root), or a directory without write permission (other users)."""
    run = _copy(runs["sam"], tmp_path)
    evaluate = [sys.executable, "-m", "flatbma", "evaluate", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    os.chmod(run, 0o500)
    try:
        if os.access(run, os.W_OK):  # root ignores the mode: mount it read-only instead
            if shutil.which("unshare") is None:
                pytest.skip("root, and no unshare to mount a read-only file system")
            script = (
                f"mount --bind {shlex.quote(str(run))} {shlex.quote(str(run))} && "
                f"mount -o remount,bind,ro {shlex.quote(str(run))} && exec {shlex.join(evaluate)}"
            )
            done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env)
            if "mount:" in done.stderr or "unshare:" in done.stderr:
                pytest.skip(f"cannot mount a read-only file system here: {done.stderr.strip()[:200]}")
            expected = f"cannot write {run / 'metrics.json'}: read-only file system: choose another output_dir"
        else:
            done = subprocess.run(evaluate, capture_output=True, text=True, env=env)
            expected = f"cannot write {run / 'metrics.json'}: permission denied"
    finally:
        os.chmod(run, 0o755)
    errors = [line for line in done.stderr.splitlines() if line.startswith("flatbma:")]  # progress lines aside
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert errors[0].startswith(f"flatbma: error: {expected}")


def test_stale_temp_files_are_removed_and_outputs_get_the_umask_mode(runs, tmp_path, capsys):
    run = _copy(runs["sam"], tmp_path)
    stale = [run / ".checkpoint.safetensors.k2x_9a0b.tmp", run / ".metrics.json.abcdefgh.tmp"]
    kept = [run / ".notes.tmp", run / "checkpoint.safetensors.abcdefgh.tmp", run / ".x.abcdefgh.tmp.bak"]
    for path in stale + kept:
        path.write_bytes(b"x" * 100)
    old = os.umask(0o027)
    try:
        assert _run(capsys, "train", "--resume", str(run))[0] in DONE  # finished: nothing to train, evaluated again
    finally:
        os.umask(old)
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)
    assert (run / "metrics.json").stat().st_mode & 0o777 == 0o640


# ---------------------------------------------------------------------------------------------------
# --resume --set


def test_resume_may_change_only_the_keys_that_keep_the_state_meaning(runs, tmp_path, capsys):
    run = _copy(runs["sam"], tmp_path)
    config = (run / "config.yaml").read_text()
    msg = _error(capsys, "train", "--resume", str(run), "--set", "model.width=8")
    assert "--resume cannot change model.width" in msg
    assert "a resume may change only optim.lr, optim.schedule, optim.warmup_epochs, train.epochs" in msg
    assert "--resume cannot change method.rho, seed" in _error(
        capsys, "train", "--resume", str(run), "--set", "method.rho=0.1", "--set", "seed=3"
    )
    assert "use train.epochs >= 2" in _error(capsys, "train", "--resume", str(run), "--set", "train.epochs=1")
    assert "drop --config" in _error(capsys, "train", "--resume", str(run), "--config", "x.yaml")
    assert (run / "config.yaml").read_text() == config and not (run / "resumes.json").exists()


def test_a_stopped_run_continues_with_a_lower_learning_rate_and_more_epochs(tmp_path, capsys):
    """Known answer: one uninterrupted fit whose learning rate drops from 0.05 to 0.01 after epoch 1."""
    one = _cfg(tmp_path / "run", train={"epochs": 1})
    assert _run(capsys, "train", "--config", _write(tmp_path / "c.yaml", one))[0] in DONE
    run = tmp_path / "run"
    argv = ["train", "--resume", str(run), "--set", "optim.lr=0.01", "--set", "train.epochs=2"]
    assert _run(capsys, *argv)[0] in DONE

    cfg = config_from_dict(_cfg(tmp_path / "reference", train={"epochs": 2}))
    exp = build_experiment(cfg)
    lr = lambda step: 0.05 if step < STEPS_PER_EPOCH else 0.01  # noqa: E731
    optimizer = SGD(lr=lr, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay)
    method = cfg.method.build(Objective(model=exp.model, num_data=len(exp.train_loader.dataset)), optimizer, None)
    exp.model.train()
    expected, _ = fit(
        method,
        method.init(trainable_params(exp.model), model_buffers(exp.model)),
        exp.train_loader,
        epochs=2,
        progress=False,
    )
    resumed = load_checkpoint(run / CKPT)[0]
    assert resumed.step == 2 * STEPS_PER_EPOCH
    for section in ("params", "buffers", "aux"):
        a, b = getattr(expected, section), getattr(resumed, section)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), section

    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["optim"]["lr"] == 0.01 and resolved["train"]["epochs"] == 2
    assert resolved["output_dir"] == str(run)
    [record] = json.loads((run / "resumes.json").read_text())
    assert record["changed"] == {"optim.lr": {"old": 0.05, "new": 0.01}, "train.epochs": {"old": 1, "new": 2}}
    assert (record["step"], record["epoch"], record["batch"]) == (STEPS_PER_EPOCH, 1, 0)
    assert _run(capsys, "evaluate", str(run))[0] in DONE  # the changed run is a run like any other


def test_a_diverged_run_names_the_resume_command_that_lowers_the_learning_rate(tmp_path, capsys):
    cfg = _cfg(tmp_path / "div", method={"name": "sgd"}, optim={"lr": 1e12}, train={"checkpoint_every": 1})
    msg = _error(capsys, "train", "--config", _write(tmp_path / "c.yaml", cfg))
    command = f"flatbma train --resume {tmp_path / 'div'} --set optim.lr=100000000000.0"
    assert f"the last checkpoint is kept: resume with '{command}' (if that diverges at once" in msg
    assert msg.endswith("train again with it)")
    again = _error(capsys, *shlex.split(command)[1:])  # the command is accepted; 1e11 diverges again
    assert "the training loss became" in again and "optim.lr=10000000000.0" in again
    [record] = json.loads((tmp_path / "div" / "resumes.json").read_text())
    assert record["changed"] == {"optim.lr": {"old": 1e12, "new": 1e11}}


def test_a_two_stage_run_refuses_changes_its_first_stage_shares(tmp_path, capsys):
    cfg = _cfg(
        tmp_path / "two",
        method={"name": "fp-bma", "rank": 2},
        prior={"method": {"name": "swag", "rank": 2, "start_step": 0, "collect_every": 5}, "epochs": 1},
        train={"epochs": 1},
    )
    assert _run(capsys, "train", "--config", _write(tmp_path / "c.yaml", cfg))[0] in DONE
    msg = _error(capsys, "train", "--resume", str(tmp_path / "two"), "--set", "optim.lr=0.01")
    assert "--resume cannot change optim.lr of this two-stage run: its first stage shares it" in msg
    assert _run(capsys, "train", "--resume", str(tmp_path / "two"), "--set", "train.epochs=2")[0] in DONE
    assert load_checkpoint(tmp_path / "two" / CKPT)[0].step == 2 * STEPS_PER_EPOCH
