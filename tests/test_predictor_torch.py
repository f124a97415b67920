"""The predictor in torch code (issue #35): ``bma(x)``, ``bma.as_module()`` and ``bma.calibrate(val)``, each
equal to the predictor's own path bit for bit, and ``calibrate`` equal to ``flatbma compare``'s temperature."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flatbma
from flatbma import BMA
from flatbma.calibration import fit_temperature, scale
from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.run.evaluate import CLEAN_KEYS
from flatbma.experiment.run.pipeline import load_run, load_run_config
from flatbma.predict import bma_log_probs


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, :3] + 0.3 * x[:, 3:] + 0.5 * torch.randn(n, 3, generator=g)).argmax(1)


@pytest.fixture(scope="module")
def swag() -> BMA:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    loader = DataLoader(TensorDataset(*_data(240, 0)), batch_size=48, shuffle=True)
    options = dict(rank=3, start_step=10, collect_every=2)
    return flatbma.fit_posterior(model, loader, "swag", epochs=5, lr=0.05, num_samples=5, progress=False, **options)


def test_calling_the_predictor_gives_the_mean_of_the_samples_probabilities(swag):
    x = _data(50, 3)[0]
    probs = swag(x)
    assert torch.equal(probs, swag.predict_proba(x))
    model = swag.model
    model.eval()
    manual = torch.stack([torch.func.functional_call(model, w, (x,)).softmax(-1) for w in swag.samples]).mean(0)
    torch.testing.assert_close(probs, manual, rtol=1e-5, atol=1e-6)  # (1/M) Σ softmax, computed in log space
    assert torch.equal(probs.log(), bma_log_probs(model, swag.samples, x).exp().log())


def test_the_module_is_the_predictor_in_torch_code(swag):
    x, y = _data(50, 3)
    module = swag.as_module()
    out = module(x)
    assert torch.equal(out, swag.predict_log_proba(x)) and torch.equal(out.exp(), swag(x))
    assert list(module.parameters()) == [] and list(module.buffers()) == [] and module.state_dict() == {}
    assert not out.requires_grad
    module.train()
    assert torch.equal(module(x), out)  # its mode is a flag: the BMA predicts in its own mode
    with torch.no_grad():
        assert torch.equal(nn.Sequential(nn.Identity(), module.eval())(x), out)
    assert module.to("cpu") is module and torch.equal(module.cpu()(x), out)
    nll = swag.evaluate([(x, y)])["nll"]
    assert F.cross_entropy(module(x), y).item() == pytest.approx(nll, rel=1e-5)  # log-probabilities are logits
    with pytest.raises(FlatbmaError, match="cannot become float64"):
        module.double()
    assert "BMA(swag" in repr(module)


def test_calibrate_fits_the_temperature_of_the_untempered_predictive_and_everything_uses_it(swag, tmp_path):
    val, test = _data(80, 7), _data(60, 8)
    untempered = swag.predict_log_proba(test[0])
    val_log_probs = swag.predict_log_proba(val[0])
    t = swag.calibrate(DataLoader(TensorDataset(*val), batch_size=32))
    try:
        assert t == swag.temperature == fit_temperature(val_log_probs, val[1]) and t != 1.0
        assert swag.calibrate([val]) == t  # refitting starts from the untempered predictive
        scaled = scale(untempered, t)
        assert torch.equal(swag.predict_log_proba(test[0]), scaled)
        assert torch.equal(swag(test[0]), scaled.exp()) and torch.equal(swag.as_module()(test[0]), scaled)
        assert swag.evaluate([test])["nll"] == pytest.approx(F.nll_loss(scaled, test[1]).item(), rel=1e-6)
        swag.save(tmp_path / "p.safetensors")
        again = flatbma.load_posterior(tmp_path / "p.safetensors", swag.model, swag.train_loader)
        assert again.temperature == t and torch.equal(again.predict_log_proba(test[0]), scaled)
        with pytest.raises(FlatbmaError, match="soft targets"):
            swag.calibrate([(val[0], F.one_hot(val[1], 3).float())])
        with pytest.raises(FlatbmaError, match="empty"):
            swag.calibrate([])
        with pytest.raises(FlatbmaError, match="temperature must be a positive number"):
            swag.temperature = 0.0
    finally:
        swag.temperature = 1.0


COMPARE = {
    "seed": 1,
    "data": {"name": "digits", "batch_size": 25, "eval_batch_size": 60, "k_shot": 20, "val_per_class": 5},
    "model": {"name": "cnn", "width": 4},
    "optim": {"lr": 0.05},
    "train": {"epochs": 4, "progress": False},
    "eval": {"num_samples": 4},
    "compare": {
        "methods": [{"name": "swag", "rank": 3, "start_step": 2, "collect_every": 1}],
        "seeds": [1],
        "flatness": False,
        "landscape": False,
        "corruptions": [],
        "bma_curve": [4],
    },
}


def test_calibrate_gives_the_temperature_and_scaled_metrics_of_flatbma_compare(tmp_path, capsys):
    config = {**COMPARE, "output_dir": str(tmp_path / "out")}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert main(["compare", "--config", str(tmp_path / "c.yaml"), "--quiet"]) == 0, capsys.readouterr().err
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    assert row["accuracy"] > 0.5 and 0.1 < row["temperature"] < 10 and row["temperature"] != 1.0  # a real fit
    exp, state = load_run(load_run_config(row["run_dir"]))
    cfg = exp.config
    bma = BMA(exp.model, exp.method, state, exp.bn_loader, num_samples=cfg.eval.num_samples, seed=cfg.seed)
    assert bma.recompute_bn  # the CNN's BatchNorm: every SWAG sample gets statistics of its own, as compare's do
    assert bma.calibrate(exp.val_loader) == row["temperature"]
    scaled = bma.evaluate(exp.test_loader)
    for key in CLEAN_KEYS:
        assert scaled[key] == row["temperature_scaled"][key], key
