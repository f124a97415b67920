"""From ``flatbma train`` to the first step: each pre-flight check runs once, the data are read once and the network
is built once — for the checks and both stages of a two-stage run (:func:`flatbma.experiment.run.build.prepare`)."""

from __future__ import annotations

import collections
import contextlib
from pathlib import Path

from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.run import build, pipeline, prior, stage, validate
from flatbma.experiment.run.pipeline import train

TWO_STAGES = {
    "seed": 1,
    "method": {"name": "fp-bma", "rank": 2},
    "prior": {"method": {"name": "swag", "rank": 2, "start_step": 2, "collect_every": 1}, "epochs": 1, "min_std": 0.05},
    "data": {"name": "digits", "k_shot": 10, "batch_size": 25, "test_limit": 50},
    "model": {"name": "mlp", "width": 8},
    "optim": {"lr": 0.01},
    "train": {"epochs": 1, "progress": False},
    "eval": {"num_samples": 2},
}


def test_a_two_stage_run_reads_its_data_and_builds_its_network_once(tmp_path, monkeypatch):
    calls: collections.Counter[str] = collections.Counter()

    def counted(module, name, key=None):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[key(*args) if key else name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for module in (build, validate):
        counted(module, "load_data")
        counted(module, "build_network")
    for module in (pipeline, stage):
        counted(module, "check_available")
        counted(module, "check_run_dir", key=lambda run_dir, *_: f"check_run_dir {Path(run_dir).name}")
    for module in (pipeline, stage, prior):
        real_hold = module.hold

        @contextlib.contextmanager
        def hold(directory, command, real_hold=real_hold, **kwargs):
            calls[f"hold {Path(directory).name}"] += 1
            with real_hold(directory, command, **kwargs):
                yield

        monkeypatch.setattr(module, "hold", hold)

    cfg = config_from_dict({**TWO_STAGES, "output_dir": str(tmp_path / "run")})
    trained = train(cfg, evaluate=False)
    assert trained.state.step == 4  # k-shot 100 images of batch 25: 4 steps, after the first stage's 4
    assert calls == {
        "load_data": 1,
        "build_network": 1,
        "check_available": 1,
        "check_run_dir run": 1,
        "hold run": 1,
        "hold prior": 1,
    }
