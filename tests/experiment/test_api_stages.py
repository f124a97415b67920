"""``fit_posterior``'s two stages and post-hoc fits (issue #35): FP-BMA's SWAG-prior pipeline from Python gives
``flatbma train``'s state and metrics bit for bit; post-hoc Laplace is the curvature pass on the given weights."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flatbma
from flatbma.errors import FlatbmaError
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.run.build import build_experiment
from flatbma.experiment.run.pipeline import load_run, train
from flatbma.loop import fit
from flatbma.optim import SGD
from flatbma.posteriors import laplace

SWAG = {"name": "swag", "rank": 3, "start_step": 2, "collect_every": 1}
TWO_STAGES = {
    "seed": 3,
    "method": {"name": "fp-bma", "rank": 3},
    "prior": {"method": SWAG, "epochs": 3, "min_std": 0.02},
    "data": {"name": "digits", "k_shot": 10, "batch_size": 25, "eval_batch_size": 25, "test_limit": 100},
    "model": {"name": "cnn", "width": 4},
    "optim": {"lr": 0.05},
    "train": {"epochs": 3, "progress": False},
    "eval": {"num_samples": 3},
}


def test_the_two_stage_pipeline_from_python_is_flatbma_trains(tmp_path):
    raw = {**copy.deepcopy(TWO_STAGES), "output_dir": str(tmp_path / "run")}
    cfg = config_from_dict(raw)
    cli = train(cfg)  # SWAG into run/prior, then FP-BMA with its prior, started there; evaluated
    _, cli_state = load_run(cfg)

    exp = build_experiment(cfg)  # the same data, a fresh network at the same initial weights, a fresh loader
    bma = flatbma.fit_posterior(
        exp.model,
        exp.train_loader,
        dict(raw["method"]),
        epochs=3,
        optim=raw["optim"],
        seed=cfg.seed,
        num_samples=cfg.eval.num_samples,
        recompute_bn=True,  # what flatbma train reports
        prior=raw["prior"],
        progress=False,
    )
    for section in ("params", "buffers", "aux"):
        ours, theirs = getattr(bma.state, section), getattr(cli_state, section)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), section
    ours = bma.evaluate(exp.test_loader)
    for key in ("accuracy", "nll", "ece", "aece", "brier"):
        assert ours[key] == cli.metrics[key], key
    assert cli.metrics["kl_from_start"] > 0 and cli.metrics["accuracy"] > 0.5  # a real fit, moved from its start


def test_a_two_stage_section_is_checked_before_anything_trains():
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    loader = [(torch.randn(8, 4), torch.arange(8) % 3)] * 2
    stage = {"method": {"name": "sgd"}, "epochs": 1}
    with pytest.raises(FlatbmaError, match=r"prior\.method 'sgd' is not a low-rank plus diagonal Gaussian"):
        flatbma.fit_posterior(model, loader, "fp-bma", epochs=1, prior=stage, progress=False)
    stage = {"method": {"name": "swag", "rank": 5, "start_step": 0, "collect_every": 1}, "epochs": 1}
    with pytest.raises(FlatbmaError, match=r"prior\.method\.rank"):  # fp-bma's default rank is not the prior's
        flatbma.fit_posterior(model, loader, "fp-bma", epochs=1, rank=3, prior=stage, progress=False)
    with pytest.raises(FlatbmaError, match=r"prior\.epochs"):  # 2 updates give no 5 snapshots
        flatbma.fit_posterior(model, loader, "fp-bma", epochs=1, rank=5, prior=stage, progress=False)
    with pytest.raises(FlatbmaError, match=r"above .* where SGD on the KL to the fitted prior diverges"):
        stage = {"method": {"name": "swag", "rank": 2, "start_step": 0, "collect_every": 1}, "epochs": 1}
        flatbma.fit_posterior(model, loader, "fp-bma", epochs=1, lr=10.0, rank=2, prior=stage, progress=False)


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, :3] + 0.3 * x[:, 3:] + 0.5 * torch.randn(n, 3, generator=g)).argmax(1)


def _trained() -> tuple[nn.Module, DataLoader]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    loader = DataLoader(TensorDataset(*_data(240, 0)), batch_size=48, shuffle=True)
    flatbma.fit_posterior(model, loader, "sgd", epochs=5, lr=0.05, progress=False)  # the module holds its MAP
    return model, loader


def test_posthoc_laplace_is_the_curvature_pass_on_the_given_weights():
    model, loader = _trained()
    given = copy.deepcopy(model.state_dict())
    bma = flatbma.fit_posterior(model, loader, "laplace", posthoc=True, prior_precision=1.0, progress=False)
    assert bma.method_config["start_step"] == 0 and [row["epoch"] for row in bma.history] == [1]  # one pass
    assert all(torch.equal(bma.state.params[k], given[k]) for k in bma.state.params)  # no MAP update

    manual = copy.deepcopy(model)  # the family by hand: start_step 0, one epoch of curvature at the weights
    manual.load_state_dict(given)
    objective = flatbma.Objective(manual, num_data=240)
    method = laplace.build(objective, SGD(lr=0.05), start_step=0, prior_precision=1.0)
    state = method.init(flatbma.trainable_params(manual), flatbma.model_buffers(manual))
    torch.manual_seed(0)  # fit_posterior's seed: the loader's order (the sum over the epoch does not depend on it)
    state, _ = fit(method, state, loader, epochs=1, progress=False)
    x = _data(50, 9)[0]
    theirs = flatbma.BMA(manual, method, state, num_samples=bma.num_samples).predict_proba(x)
    assert torch.equal(bma.predict_proba(x), theirs)


def test_posthoc_swag_collects_from_the_first_update_at_a_held_rate_and_others_refuse():
    model, loader = _trained()
    bma = flatbma.fit_posterior(
        model, loader, "swag", posthoc=True, epochs=2, lr=0.01, rank=3, collect_every=1, progress=False
    )
    assert bma.method_config["start_step"] == 0
    assert {row["lr"] for row in bma.history} == {0.01}  # swa_lr: held from the first update
    with pytest.raises(FlatbmaError, match="no MAP phase to skip"):
        flatbma.fit_posterior(model, loader, "mfvi", posthoc=True, epochs=1, progress=False)
    with pytest.raises(FlatbmaError, match="start_step=4 is given too"):
        flatbma.fit_posterior(model, loader, "swag", posthoc=True, epochs=2, start_step=4, progress=False)
    with pytest.raises(FlatbmaError, match="epochs is required"):
        flatbma.fit_posterior(model, loader, "swag", progress=False)
