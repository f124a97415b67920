"""Crash safety: SIGKILL a training process mid-epoch, resume, and get bit-identical results."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

from flatbma.experiment.run.checkpoint import load_checkpoint

CONFIG = {
    "seed": 3,
    "method": {"name": "sam", "rho": 0.05},
    "data": {"name": "digits", "batch_size": 32, "augment": True},
    "model": {"name": "cnn", "width": 8},
    "optim": {"lr": 0.05},
    "train": {"epochs": 6, "checkpoint_every": 7, "progress": False},
    "eval": {"num_samples": 1},
}


def _train(*args):
    # one thread: identical arithmetic in every process, and no OpenMP spinning on a busy machine
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "flatbma", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _checkpoint_step(path):
    try:
        _, meta, _ = load_checkpoint(path)
    except Exception:
        return -1, -1
    return int(meta["step"]), int(meta["batch"])


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_is_bit_identical(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = _train("--config", str(cfg), "--set", f"output_dir={ref_dir}")
    _, err = ref.communicate(timeout=600)
    assert ref.returncode == 0, err

    proc = _train("--config", str(cfg), "--set", f"output_dir={run_dir}")
    ckpt = run_dir / "checkpoint.safetensors"
    deadline = time.time() + 600
    # wait for an intra-epoch checkpoint past the first epoch (42 steps per epoch), then kill
    while time.time() < deadline:
        step, batch = _checkpoint_step(ckpt)
        if step > 42 and batch > 0:
            break
        if proc.poll() is not None:
            pytest.fail(f"training ended before it could be killed: {proc.stderr.read()}")
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "metrics.json").exists()
    _, meta, _ = load_checkpoint(ckpt)
    assert int(meta["batch"]) > 0, "the kill should land mid-epoch"

    resumed = _train("--resume", str(run_dir))
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err

    a = load_file(str(ref_dir / "checkpoint.safetensors"))
    b = load_file(str(ckpt))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ma = json.loads((ref_dir / "metrics.json").read_text())
    mb = json.loads((run_dir / "metrics.json").read_text())
    for key in ("accuracy", "nll", "ece", "aece", "brier", "steps", "history"):
        assert ma[key] == mb[key], key
