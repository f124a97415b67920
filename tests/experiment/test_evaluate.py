"""Evaluation does not depend on what ran before in the process: in-process results equal those from disk.

``flatbma compare`` measures the experiment and state it just trained; ``flatbma evaluate`` rebuilds the
experiment and reads the checkpoint. On a BatchNorm CNN with augmentation, for SWAG (BatchNorm recomputed
for every sample, posterior samples drawn twice for the flatness protocol's repeat) and MC dropout (masks
drawn at prediction), both must give the same numbers bit for bit.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.run.evaluate import CLEAN_KEYS, measure
from flatbma.experiment.run.pipeline import evaluate_run, load_run, train

SWAG_CNN = {
    "seed": 3,
    "method": {"name": "swag", "rank": 3, "start_step": 4, "collect_every": 2},
    "data": {
        "name": "digits",
        "k_shot": 20,
        "val_per_class": 3,
        "augment": True,
        "batch_size": 32,
        "eval_batch_size": 100,
        "test_limit": 150,
    },
    "model": {"name": "cnn", "width": 4},
    "optim": {"lr": 0.05},
    "train": {"epochs": 3, "progress": False},
    "eval": {"num_samples": 3, "flatness_samples": 3, "hessian_examples": 30, "hessian_max_iter": 6, "trace_probes": 2},
}

MEASURES = {
    "bma_curve": (1, 2, 3),
    "corruptions": ("gaussian_noise",),
    "severities": (3,),
    "corruption_samples": 2,
    "flatness": True,
    "landscape": True,
}


def _without_times(result: dict) -> dict:
    return {k: v for k, v in result.items() if not k.endswith("_time_s")}


@pytest.mark.parametrize(
    "method",
    [
        SWAG_CNN["method"],  # BatchNorm recomputed per sample, two draws of samples
        {"name": "mc-dropout"},  # dropout masks at prediction from the global RNG
    ],
)
def test_measurements_in_process_equal_those_from_disk_bit_for_bit(tmp_path: Path, method: dict) -> None:
    raw = copy.deepcopy(SWAG_CNN)
    raw["output_dir"] = str(tmp_path / "run")
    raw["method"] = method
    raw["model"]["dropout"] = 0.2
    cfg = config_from_dict(raw)
    trained = train(cfg, evaluate=True)
    exp = trained.experiment
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in exp.model.modules())
    assert exp.method.recompute_bn or exp.method.predict_mode is not None
    # training advanced the loader's generator and the global RNG past the state evaluation starts from
    fresh = torch.Generator().manual_seed(cfg.seed)
    assert not torch.equal(exp.train_loader.generator.get_state(), fresh.get_state())
    assert not torch.equal(torch.get_rng_state(), exp.rng.cpu)

    in_process = measure(exp, trained.state, **MEASURES)
    from_disk = measure(*load_run(cfg), **MEASURES)
    assert _without_times(in_process) == _without_times(from_disk)
    assert in_process["temperature"] is not None and in_process["corruptions"]["gaussian_noise"]

    evaluated = evaluate_run(cfg.output_dir)  # `flatbma evaluate RUN_DIR`
    for key in (*CLEAN_KEYS, "n", "num_samples"):
        assert trained.metrics[key] == evaluated[key] == in_process.get(key, evaluated[key]), key


def test_evaluation_leaves_the_global_rng_as_it_found_it(tmp_path: Path) -> None:
    raw = copy.deepcopy(SWAG_CNN)
    raw["output_dir"] = str(tmp_path / "run")
    raw["train"]["epochs"] = 1
    raw["method"]["start_step"] = 1
    raw["method"]["rank"] = 2  # the 2 snapshots of 6 updates (a rank above them is refused before training)
    cfg = config_from_dict(raw)
    trained = train(cfg, evaluate=False)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    measure(trained.experiment, trained.state, **{**MEASURES, "flatness": False, "corruptions": ()})
    assert torch.equal(torch.get_rng_state(), before)
