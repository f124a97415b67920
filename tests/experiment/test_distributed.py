"""Data-parallel training under torchrun (gloo on CPU): two processes reproduce one process.

The multi-process parts launch ``python -m torch.distributed.run`` (= ``torchrun``) in a subprocess:
the CLI itself for SGD, and this file as the worker script (``_worker``) for SAM, SWAG, FP-BMA, IVON, a
crash + resume of SGLD and ``evaluate``. Tolerances: parameters and method state within
``atol = rtol = 1e-5`` of one process (float32; only the summation order of the gradient differs:
the mean of two shard means instead of one mean), BMA metrics within ``rel 1e-5``.
"""

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.data import DataLoader

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.parallel import loaders, processes
from flatbma.experiment.run.checkpoint import load_checkpoint
from flatbma.experiment.run.lock import LOCK_FILE
from flatbma.experiment.run.pipeline import train
from tests.experiment.torchrun_helpers import ROOT, crash_after, torchrun

BASE = {
    "seed": 0,
    "data": {"name": "digits", "batch_size": 64},  # 1198 examples: 18 full batches + 46 = 23 + 23
    "model": {"name": "mlp"},  # no BatchNorm, no dropout: one and two processes are comparable
    "optim": {"lr": 0.05},
    "train": {"epochs": 2, "progress": False, "device": "cpu"},
    "eval": {"num_samples": 1},
}
METHODS = {
    "sgd": ({"name": "sgd"}, 1),
    "sam": ({"name": "sam", "rho": 0.05}, 1),
    "swag": ({"name": "swag", "rank": 3, "start_step": 0, "collect_every": 4}, 4),
    "fp-bma": ({"name": "fp-bma", "rank": 2}, 4),
    "ivon": ({"name": "ivon", "beta2": 0.99}, 4),  # ĝ and ĥ of the global batch: the reference's sync=True
}
# SGLD on a BatchNorm CNN with augmentation, killed after its 4th checkpoint (mid epoch 2), resumed.
RESUME = {
    **BASE,
    "method": {"name": "sgld", "burn_in": 10, "thin": 5},
    "data": {"name": "digits", "batch_size": 64, "augment": True},
    "model": {"name": "cnn", "width": 4},
    "train": {"epochs": 3, "progress": False, "device": "cpu", "checkpoint_every": 7},
    "eval": {"num_samples": 3},
}
CRASH_AFTER = 4
METRIC_KEYS = ("accuracy", "nll", "ece", "aece", "brier")
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _config(method: str, output_dir) -> dict:
    options, num_samples = METHODS[method]
    cfg = copy.deepcopy(BASE)
    cfg.update(method=dict(options), output_dir=str(output_dir))
    cfg["eval"]["num_samples"] = num_samples
    return cfg


def _assert_same_run(one: Path, many: Path) -> None:
    """Same parameters and method state (TOL) and the same metrics (rel 1e-5) in two run directories."""
    a, _, _ = load_checkpoint(one / "checkpoint.safetensors")
    b, _, _ = load_checkpoint(many / "checkpoint.safetensors")
    assert a.step == b.step > 0
    for section in ("params", "aux", "buffers"):
        x, y = getattr(a, section), getattr(b, section)
        assert x.keys() == y.keys()
        for k in x:
            torch.testing.assert_close(y[k], x[k], **TOL, msg=f"{section}/{k}")
    ma = json.loads((one / "metrics.json").read_text())
    mb = json.loads((many / "metrics.json").read_text())
    assert mb["world_size"] == 2 and "world_size" not in ma
    assert ma["n"] == mb["n"] == 599 and ma["steps"] == mb["steps"]
    for key in METRIC_KEYS:
        assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-7), key
    for ha, hb in zip(ma["history"], mb["history"], strict=True):  # per-epoch means of the global batches
        assert hb["steps"] == ha["steps"]
        assert hb["loss"] == pytest.approx(ha["loss"], rel=1e-5)
        assert hb["accuracy"] == pytest.approx(ha["accuracy"], rel=1e-5)


# --------------------------------------------------------------------------------------------------
# data sharding (one process)


def _single_process_batches(n, batch_size, generator):
    drop_last = n > batch_size and n % batch_size == 1  # flatbma.experiment.parallel.loaders.seeded_loader's rule
    loader = DataLoader(range(n), batch_size=batch_size, shuffle=True, generator=generator, drop_last=drop_last)
    return [b.tolist() for b in loader]


@pytest.mark.parametrize(
    ("n", "batch_size", "world"),
    [(1198, 64, 1), (1198, 64, 2), (1198, 48, 3), (65, 8, 1), (66, 8, 2), (69, 8, 4), (37, 8, 4), (5, 8, 1), (7, 8, 2)],
)
def test_shards_reproduce_the_single_process_batches(n, batch_size, world):
    sizes = loaders.global_batch_sizes(n, batch_size, world)
    reference_gen = torch.Generator().manual_seed(7)
    generators = [torch.Generator().manual_seed(7) for _ in range(world)]
    shard_loaders = [
        DataLoader(
            range(n),
            batch_sampler=loaders.ShardedBatchSampler(n, batch_size, generator=g, rank=r, world_size=world),
            generator=g,
        )
        for r, g in enumerate(generators)
    ]
    for _epoch in range(2):  # the generator advances as in one process, epoch after epoch
        reference = _single_process_batches(n, batch_size, reference_gen)
        shards = [[b.tolist() for b in loader] for loader in shard_loaders]
        assert all(len(s) == len(sizes) for s in shards)
        assert len(reference) - len(sizes) == (world > 1 and len(reference[-1]) // world < 2 and len(reference) > 1)
        for i, size in enumerate(sizes):
            assert all(len(s[i]) == size // world for s in shards)  # equal shards, contiguous in rank order
            joined = [j for s in shards for j in s[i]]
            assert joined == reference[i][:size] and len(reference[i]) - size < world
        for g in generators:
            assert torch.equal(g.get_state(), reference_gen.get_state())


def test_global_batch_sizes_and_errors():
    assert loaders.global_batch_sizes(1198, 64, 2) == [64] * 18 + [46]
    assert loaders.global_batch_sizes(1198, 48, 3) == [48] * 24 + [45]
    assert loaders.global_batch_sizes(67, 8, 4) == [8] * 8  # 3 left: < 2 per process, dropped
    assert loaders.global_batch_sizes(65, 8, 1) == [8] * 8  # one process drops a batch of 1 (as before)
    assert loaders.global_batch_sizes(5, 8, 2) == [4]
    with pytest.raises(FlatbmaError, match=r"data\.batch_size is the global batch .* divisible by the 3"):
        loaders.global_batch_sizes(100, 64, 3)
    with pytest.raises(FlatbmaError, match="fewer than the 4 processes"):
        loaders.global_batch_sizes(3, 8, 4)
    assert loaders.shard_bounds(599, 2, 0) == (0, 300) and loaders.shard_bounds(599, 2, 1) == (300, 599)
    assert [loaders.shard_bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_one_process_helpers_are_no_ops():
    assert processes.world_size() == 1 and processes.rank() == 0 and processes.is_main()
    assert not processes.is_distributed()
    grads = {"w": torch.ones(3)}
    assert processes.all_reduce_mean(grads)["w"] is grads["w"]
    assert not processes.init_from_env(torch.device("cpu"))  # WORLD_SIZE unset: nothing to join


# --------------------------------------------------------------------------------------------------
# two processes vs one


def test_torchrun_cli_trains_like_one_process_and_only_rank0_writes(tmp_path):
    one, many = tmp_path / "one", tmp_path / "many"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(_config("sgd", one)))
    train(config_from_dict(_config("sgd", one)))
    out = torchrun("-m", "flatbma", "train", "--config", str(cfg), "--set", f"output_dir={many}")
    assert out.stdout.count("wrote ") == 1 and out.stdout.count("accuracy=") == 1  # rank 0 prints
    expected = ["checkpoint.safetensors", "config.yaml", "log.csv", "metrics.json"]
    assert sorted(p.name for p in many.iterdir() if p.name != LOCK_FILE) == expected
    _assert_same_run(one, many)


def _worker(root: Path) -> None:
    """Run under torchrun (2 processes): SAM, SWAG, FP-BMA, IVON; SGLD crash + resume; evaluate; replica check."""
    from flatbma import training
    from flatbma.experiment.run import stage
    from flatbma.experiment.run.pipeline import evaluate_run, load_run_config
    from flatbma.types import State

    with processes.process_group(torch.device("cpu")):
        me = processes.rank()
        for method in ("sam", "swag", "fp-bma", "ivon"):
            # rank 1 is given a directory of its own: it must never be created
            train(config_from_dict(_config(method, root / (method if me == 0 else f"{method}-rank1"))))
        evaluated = evaluate_run(root / "sam")  # every rank reads the run directory
        if me == 0:
            (root / "evaluated.json").write_text(json.dumps(evaluated))

        cfg = config_from_dict({**RESUME, "output_dir": str(root / "ref")})
        train(cfg)
        real_save = stage.save_position
        with crash_after(training, CRASH_AFTER) as calls:

            def slow_save(*args):  # rank 0 writes late: the others must still resume from this checkpoint
                time.sleep(0.5 if len(calls) == CRASH_AFTER - 1 else 0.0)
                real_save(*args)

            stage.save_position = slow_save
            try:
                train(config_from_dict({**RESUME, "output_dir": str(root / "crashed")}))
            finally:
                stage.save_position = real_save
        if me == 0:
            (root / "crash-position.json").write_text(
                json.dumps(load_checkpoint(root / "crashed/checkpoint.safetensors")[1])
            )
        train(load_run_config(root / "crashed"), resume=True)

        diverged = State(params={"w": torch.full((2,), float(me))}, step=5)
        try:
            processes.check_replicas(diverged)
            message = None
        except FlatbmaError as e:
            message = str(e)
        if me == 0:
            (root / "replicas.json").write_text(json.dumps({"error": message}))


@pytest.mark.slow
def test_torchrun_matches_one_process_for_sam_swag_fpbma_ivon_and_resumes_exactly(tmp_path):
    many = tmp_path / "many"
    torchrun(str(Path(__file__).resolve()), str(many))
    for method in ("sam", "swag", "fp-bma", "ivon"):
        assert not (many / f"{method}-rank1").exists(), "rank 1 wrote files"
        train(config_from_dict(_config(method, tmp_path / "one" / method)))
        _assert_same_run(tmp_path / "one" / method, many / method)

    # evaluate under torchrun (test set split 300 / 299) = the metrics of training
    evaluated = json.loads((many / "evaluated.json").read_text())
    trained = json.loads((many / "sam" / "metrics.json").read_text())
    for key in METRIC_KEYS:
        assert evaluated[key] == pytest.approx(trained[key], rel=1e-12)

    # crash mid-epoch, resume: the same parameters, SGLD samples and RNG as the uninterrupted run
    position = json.loads((many / "crash-position.json").read_text())
    assert int(position["step"]) == 21 and int(position["batch"]) == 2  # epoch 2 (19 steps per epoch)
    ref, _, ref_extra = load_checkpoint(many / "ref" / "checkpoint.safetensors")
    res, _, res_extra = load_checkpoint(many / "crashed" / "checkpoint.safetensors")
    assert ref.step == res.step == 57
    for section in ("params", "aux"):
        x, y = getattr(ref, section), getattr(res, section)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), section
    for k in ref.buffers:  # BatchNorm statistics: averaged over ranks, EMA linear ⇒ equal up to rounding
        torch.testing.assert_close(res.buffers[k], ref.buffers[k], atol=1e-6, rtol=1e-6)
    assert torch.equal(ref_extra["torch_rng"], res_extra["torch_rng"])
    ma = json.loads((many / "ref" / "metrics.json").read_text())
    mb = json.loads((many / "crashed" / "metrics.json").read_text())
    for key in METRIC_KEYS:
        assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-7), key
    for ha, hb in zip(ma["history"], mb["history"], strict=True):
        assert hb == pytest.approx(ha, rel=1e-9)

    error = json.loads((many / "replicas.json").read_text())["error"]
    assert error is not None and "'params/w'" in error and "step 5" in error


# --------------------------------------------------------------------------------------------------
# a stopped process: the others end with one line naming it (flatbma.experiment.parallel.liveness)

_STOPPING_WORKER = """
import dataclasses, os, signal, sys
from pathlib import Path
from flatbma.experiment import cli
from flatbma.experiment.parallel import loaders, processes
from flatbma import training

config, pidfile = sys.argv[1:]
real_fit = training.fit

def fit(method, *args, **kwargs):  # rank 1 stops itself (SIGSTOP) before its third step
    def update(state, batch):
        if processes.rank() == 1 and state.step == 2:
            Path(pidfile).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return method.update(state, batch)
    return real_fit(dataclasses.replace(method, update=update), *args, **kwargs)

training.fit = fit
code = cli.main(["train", "--config", config])
Path(pidfile).with_name(f"exit{processes.rank()}").write_text(str(code))
sys.exit(code)
"""


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_with_a_line_naming_it(tmp_path):
    (tmp_path / "worker.py").write_text(_STOPPING_WORKER)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(_config("sgd", tmp_path / "run")))
    pidfile, logs = tmp_path / "rank1.pid", tmp_path / "logs"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "FLATBMA_COLLECTIVE_TIMEOUT": "4",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["--log-dir", str(logs), "--redirects", "3", str(tmp_path / "worker.py"), str(tmp_path / "c.yaml")]
    launcher = subprocess.Popen(
        [*cmd, str(pidfile)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline, stopped, exit0 = time.monotonic() + 50, False, tmp_path / "exit0"
        while time.monotonic() < deadline and not exit0.exists():  # a wait, not a timed assertion
            time.sleep(0.2)
            stopped = stopped or pidfile.exists()
        assert stopped, "rank 1 never stopped"
        assert exit0.read_text() == "2"  # rank 0 ended with flatbma's exit code for errors
    finally:
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGKILL)  # the stopped rank: torchrun ends the job then
        try:
            launcher.communicate(timeout=60)
        finally:
            launcher.kill()
    stderr0 = "".join(p.read_text() for p in logs.glob("*/attempt_0/0/stderr.log"))  # rank 0's
    lines = [line for line in stderr0.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("flatbma: error: rank 1 did not answer within 4 s"), stderr0
    assert not (tmp_path / "exit1").exists()  # rank 1 never got to answer
    assert not (tmp_path / "run" / "metrics.json").exists()


if __name__ == "__main__":  # the torchrun worker of the test above
    _worker(Path(sys.argv[1]))
