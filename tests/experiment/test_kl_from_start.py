"""``kl_from_start``: KL(q_T ‖ q_0) of a low-rank VI / FP-BMA run, the same after an interrupted and resumed run."""

import dataclasses

import pytest
import torch

from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.run.build import build_experiment
from flatbma.experiment.run.pipeline import train
from flatbma.gaussian import kl_lowrank
from flatbma.params import model_buffers, trainable_params
from tests.helpers import interrupt_after_first_epoch


def _config(tmp_path, method, name="run"):
    return config_from_dict(
        {
            "seed": 1,
            "output_dir": str(tmp_path / name),
            "method": method,
            "data": {"name": "digits", "batch_size": 128},
            "model": {"name": "mlp", "width": 16},
            "optim": {"name": "adam", "lr": 0.01},
            "train": {"epochs": 2, "progress": False},
            "eval": {"num_samples": 2},
        }
    )


def test_kl_from_start_is_the_kl_between_the_final_and_the_initial_gaussian(tmp_path):
    cfg = _config(tmp_path, {"name": "fp-bma", "rank": 3, "gamma": 0.01})
    trained = train(cfg)
    kl = trained.metrics["kl_from_start"]
    # independently: q_0 is what the method's init draws right after a fresh build of the same config
    exp = build_experiment(cfg)
    start = exp.method.init(trainable_params(exp.model), model_buffers(exp.model))
    expected = float(kl_lowrank(trained.state.params, start.params))
    assert kl == pytest.approx(expected, rel=1e-12, abs=0.0)
    assert kl > 0


def test_kl_from_start_after_resume_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    cfg = _config(tmp_path, {"name": "lowrank-vi", "rank": 3}, "ref")
    reference = train(cfg).metrics["kl_from_start"]

    stopped = dataclasses.replace(cfg, output_dir=str(tmp_path / "run"))
    interrupt_after_first_epoch(monkeypatch)  # at an epoch end
    with pytest.raises(KeyboardInterrupt):
        train(stopped)
    resumed = train(stopped, resume=True).metrics["kl_from_start"]
    assert resumed == reference


SWAG = {"name": "swag", "rank": 2, "start_step": 1, "collect_every": 2}


@pytest.mark.parametrize("method", [{"name": "sgd"}, {"name": "mfvi"}, SWAG])
def test_only_low_rank_gaussian_runs_record_it(tmp_path, method):
    metrics = train(_config(tmp_path, method)).metrics
    assert "kl_from_start" not in metrics
    assert torch.isfinite(torch.tensor(metrics["nll"]))
