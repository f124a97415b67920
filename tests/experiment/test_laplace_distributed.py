"""Laplace under ``train.parallel: data`` with 2 gloo processes equals one process (diag and KFAC curvature).

This file is also the torchrun worker (``_worker``). Each process accumulates the mean curvature of its shard,
averaged over the processes and weighted by its batch size, and counts its own examples: the accumulators
and counters are those of one process halved, ``H = (n/n_seen)·Σ_seen`` the same (float32 rows, float64 sums).
The post-hoc form (``start_step: 0``) compares the curvature at the same weights; the MAP phase is data
parallel as the point methods' (``tests/experiment/test_distributed.py``).
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.parallel import processes
from flatbma.experiment.run.checkpoint import load_checkpoint
from flatbma.experiment.run.pipeline import train
from flatbma.posteriors import laplace
from tests.experiment.torchrun_helpers import torchrun

BASE = {
    "seed": 0,
    "data": {"name": "digits", "k_shot": 20, "batch_size": 40, "test_limit": 200},  # 200 images: 5 steps/epoch
    "model": {"name": "mlp"},  # no BatchNorm: one and two processes are comparable
    "optim": {"lr": 0.05},
    "train": {"epochs": 1, "progress": False, "device": "cpu"},
    "eval": {"num_samples": 2},
}
HESSIANS = ("diag", "kfac")
PREDICTIVE = {"diag": "glm", "kfac": "probit"}
"""KFAC's samples ``U_B[Z ⊘ √(baᵀ/T+δ)]U_Aᵀ`` depend on the eigenvectors' signs, which round-off may flip: two
processes draw other (equally distributed) samples. The probit predictive is a continuous function of ``H``."""


def _config(hessian: str, output_dir: Path) -> dict:
    method = {"name": "laplace", "hessian": hessian, "start_step": 0, "predictive": PREDICTIVE[hessian]}
    return {**BASE, "method": method, "output_dir": str(output_dir)}


def _worker(root: Path) -> None:
    with processes.process_group(torch.device("cpu")):
        me = processes.rank()
        for hessian in HESSIANS:
            train(config_from_dict(_config(hessian, root / (hessian if me == 0 else f"{hessian}-rank1"))))


@pytest.mark.slow
def test_two_processes_give_the_curvature_and_metrics_of_one():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        torchrun(str(Path(__file__).resolve()), str(root / "many"))
        for hessian in HESSIANS:
            assert not (root / "many" / f"{hessian}-rank1").exists(), "rank 1 wrote files"
            train(config_from_dict(_config(hessian, root / "one" / hessian)))
            one, _, _ = load_checkpoint(root / "one" / hessian / "checkpoint.safetensors")
            many, _, _ = load_checkpoint(root / "many" / hessian / "checkpoint.safetensors")
            assert one.aux.keys() == many.aux.keys() and one.step == many.step == 10
            c_one, c_many = laplace.curvature_of(one), laplace.curvature_of(many)
            seen_one, seen_many = int(c_one.seen), int(c_many.seen)
            assert seen_one == 400 and seen_many == 200  # two epochs; each process counts its own shard
            pairs = [*zip(c_one.curvature.items(), c_many.curvature.values()), (("nll", c_one.nll), c_many.nll)]
            for (key, value), theirs in pairs:
                torch.testing.assert_close(
                    theirs / seen_many, value / seen_one, rtol=1e-6, atol=1e-12, msg=f"{hessian} {key}"
                )
            ma = json.loads((root / "one" / hessian / "metrics.json").read_text())
            mb = json.loads((root / "many" / hessian / "metrics.json").read_text())
            assert mb["world_size"] == 2 and ma["n"] == mb["n"] > 0
            for key in ("accuracy", "nll", "ece", "brier"):
                assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-6), (hessian, key)
            for key, value in ma["diagnostics"].items():
                assert mb["diagnostics"][key] == pytest.approx(value, rel=1e-6), (hessian, key)


if __name__ == "__main__":  # the torchrun worker of the test above
    _worker(Path(sys.argv[1]))
