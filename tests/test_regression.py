"""Regression with a Gaussian likelihood: the NLL and the mixture metrics against hand-computed answers and scipy;
every method fits a regression network on scikit-learn's bundled diabetes data (offline) through ``fit_posterior``;
the methods that cannot (Laplace's softmax Gauss-Newton) refuse in one line."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import norm
from sklearn.datasets import load_diabetes
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

import flatbma
from flatbma.errors import FlatbmaError
from flatbma.regression import Gaussian, mixture_metrics

# --- the likelihood ------------------------------------------------------------------------------------------


def test_the_gaussian_nll_by_hand_and_against_torch_distributions():
    fixed = Gaussian(noise_std=2.0)
    out = torch.tensor([[1.0]], dtype=torch.float64)
    # y = 3, μ = 1, σ = 2: ½ log(2π·4) + (2)²/(2·4)
    assert float(fixed(out, torch.tensor([3.0], dtype=torch.float64))) == pytest.approx(
        0.5 * math.log(8 * math.pi) + 0.5
    )
    learned = Gaussian()
    s = math.log(math.expm1(1.0 - 1e-6))  # softplus(s) + 1e-6 = 1
    out = torch.tensor([[0.5, s]], dtype=torch.float64)
    assert float(learned(out, torch.tensor([2.5], dtype=torch.float64))) == pytest.approx(
        0.5 * math.log(2 * math.pi) + 2.0
    )
    g = torch.Generator().manual_seed(0)
    outputs, y = torch.randn(50, 2, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)
    mean, var = learned.moments(outputs)
    expected = -torch.distributions.Normal(mean, var.sqrt()).log_prob(y)
    torch.testing.assert_close(learned.nll(outputs, y), expected)
    assert learned.outputs == 2 and fixed.outputs == 1
    with pytest.raises(FlatbmaError, match=r"y.squeeze\(1\)"):
        learned(outputs, y[:, None])  # [B, 1] targets would broadcast to [B, B] silently
    with pytest.raises(FlatbmaError, match="needs 1"):
        fixed.moments(outputs)
    with pytest.raises(FlatbmaError, match="positive number"):
        Gaussian(noise_std=0.0)


def test_mixture_metrics_by_hand():
    # one sample, y = μ + σ: NLL ½ log(2πσ²) + ½; F(y) = Φ(1) = 0.841: outside the central 50% interval, inside 90%
    out = mixture_metrics(torch.tensor([[1.0]]), torch.tensor([[4.0]]), torch.tensor([3.0]))
    assert out["nll"] == pytest.approx(0.5 * math.log(8 * math.pi) + 0.5)
    assert (out["coverage_0.5"], out["coverage_0.9"], out["coverage_0.95"]) == (0.0, 1.0, 1.0)
    assert (out["rmse"], out["mae"], out["epistemic_var"], out["aleatoric_var"]) == (2.0, 2.0, 0.0, 4.0)
    assert out["mean_std"] == 2.0 and (out["n"], out["num_samples"]) == (1, 1)
    # two samples μ = (0, 2), σ² = (1, 1), y = 1: epistemic (1/2)(1 + 1) = 1, mean 1, F(y) = ½(Φ(1) + Φ(−1)) = ½
    two = mixture_metrics(torch.tensor([[0.0], [2.0]]), torch.ones(2, 1), torch.tensor([1.0]))
    assert (two["epistemic_var"], two["rmse"], two["coverage_0.5"]) == (1.0, 0.0, 1.0)
    assert two["mean_std"] == pytest.approx(math.sqrt(2.0))
    assert two["nll"] == pytest.approx(-math.log(norm.pdf(1.0)), rel=1e-12)


def test_mixture_metrics_against_scipy_and_calibration_of_a_true_model():
    g = torch.Generator().manual_seed(1)
    mu = torch.randn(5, 300, generator=g, dtype=torch.float64)
    var = torch.rand(5, 300, generator=g, dtype=torch.float64) + 0.1
    y = torch.randn(300, generator=g, dtype=torch.float64)
    out = mixture_metrics(mu, var, y)
    m, v, t = mu.numpy(), var.numpy(), y.numpy()
    assert out["nll"] == pytest.approx(-np.log(norm.pdf(t, m, np.sqrt(v)).mean(0)).mean(), rel=1e-12)
    pit = norm.cdf(t, m, np.sqrt(v)).mean(0)
    for level in (0.5, 0.9, 0.95):
        assert out[f"coverage_{level:g}"] == pytest.approx((np.abs(pit - 0.5) <= level / 2).mean())
    assert out["rmse"] == pytest.approx(np.sqrt(((m.mean(0) - t) ** 2).mean()))
    # data drawn from the predictive itself: every central interval covers its level
    truth = mixture_metrics(torch.zeros(1, 20000), torch.ones(1, 20000), torch.randn(20000, generator=g))
    assert truth["calibration_error"] < 0.01 and truth["coverage_0.9"] == pytest.approx(0.9, abs=0.01)


# --- every method on the diabetes data -----------------------------------------------------------------------


def _diabetes():
    """scikit-learn's bundled diabetes data (442 patients, 10 features), standardized on a 342-example train split."""
    data = load_diabetes()
    x, y = torch.tensor(data.data, dtype=torch.float32), torch.tensor(data.target, dtype=torch.float32)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = perm[:342], perm[342:]
    x = (x - x[train].mean(0)) / x[train].std(0)
    y = (y - y[train].mean()) / y[train].std()
    loader = DataLoader(TensorDataset(x[train], y[train]), batch_size=32, shuffle=True)
    return loader, DataLoader(TensorDataset(x[test], y[test]), batch_size=100)


def _net(outputs: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, outputs))


SWAG = {"start_step": 0, "rank": 12}
"""SWAG over all 121 updates: 12 snapshots, as many deviations (its default window, the last quarter, collects 3;
fit_posterior refuses a rank above the snapshots, as the CLI does)."""

SHORT = {
    "sgld": {"burn_in": 100, "thin": 10},
    "f-sgld": {"burn_in": 100, "thin": 10},
    "csgld": {"cycle_length": 60, "samples_per_cycle": 5, "lr": 0.1},  # two cycles: a larger step to explore
    "multi": {"of": {"name": "swag", **SWAG}, "members": 2},
    "swag": SWAG,
    "f-swag": SWAG,
    "multiswag": {"of": {"name": "swag", **SWAG}},
}
"""Options of the methods whose defaults collect too little in 11 epochs of 11 steps (or that need ``of``)."""

REFUSED = {"laplace", "f-laplace"}
"""Methods tied to the softmax: Laplace's curvature is the Gauss-Newton of the cross-entropy."""

FAST = ["sgd", "swag", "mfvi", "mc-dropout", "ensemble", "sgld", "fp-bma"]


def _every_method() -> list[str]:
    from flatbma.methods import METHODS

    return sorted(METHODS)


def _fit(method: str, loader, **kw):
    options = dict(SHORT.get(method, {}))
    lr = options.pop("lr", 0.01)
    return flatbma.fit_posterior(
        _net(), loader, method, epochs=11, lr=lr, likelihood="gaussian", num_samples=8, **options, **kw
    )


def _check_fits(method: str) -> None:
    train, test = _diabetes()
    if method in REFUSED:
        with pytest.raises(FlatbmaError, match="cross-entropy"):
            _fit(method, train)
        return
    metrics = _fit(method, train).evaluate(test)
    # the targets are standardized: predicting their mean gives RMSE ≈ 1 and NLL ≈ 1.42; a linear fit ≈ 0.70
    assert metrics["rmse"] < 0.9, (method, metrics)
    assert metrics["nll"] < 1.35, (method, metrics)
    assert 0.6 < metrics["coverage_0.9"] <= 1.0, (method, metrics)


@pytest.mark.parametrize("method", FAST)
def test_a_regression_network_fits_the_diabetes_data(method):
    _check_fits(method)


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in _every_method() if m not in FAST])
def test_every_other_method_fits_or_refuses_in_one_line(method):
    _check_fits(method)


def test_the_regression_bma_equals_the_mixture_of_its_samples_and_round_trips(tmp_path):
    train, test = _diabetes()
    bma = _fit("swag", train)
    x, y = next(iter(test))
    with torch.no_grad():
        outs = torch.stack([functional_call(bma.model, w, (x,)) for w in bma.samples])  # no dropout, no BatchNorm
    mean, var = Gaussian().moments(outs)
    torch.testing.assert_close(bma.evaluate(test)["nll"], mixture_metrics(mean, var, y)["nll"])
    pred = bma.predict_regression(x)
    torch.testing.assert_close(pred["mean"], mean.mean(0))
    torch.testing.assert_close(pred["aleatoric"], var.mean(0))
    torch.testing.assert_close(pred["epistemic"], mean.var(0, unbiased=False))
    torch.testing.assert_close(pred["std"] ** 2, pred["aleatoric"] + pred["epistemic"])
    assert torch.equal(bma.predict(x), pred["mean"])
    with pytest.raises(FlatbmaError, match="predict_regression"):
        bma.predict_proba(x)
    bma.save(tmp_path / "reg.safetensors")
    again = flatbma.load_posterior(tmp_path / "reg.safetensors", _net())
    assert again.likelihood == Gaussian() and torch.equal(again.predict(x), bma.predict(x))


def test_a_fixed_noise_uses_one_output_and_bad_regression_inputs_end_in_one_line():
    train, test = _diabetes()
    bma = flatbma.fit_posterior(_net(1), train, "sgd", epochs=5, lr=0.01, likelihood="gaussian", noise_std=0.7)
    assert torch.equal(bma.predict_regression(next(iter(test))[0])["aleatoric"], torch.full((100,), 0.49))
    with pytest.raises(FlatbmaError, match=r"must return \[2, 1\]"):
        flatbma.fit_posterior(_net(2), train, "sgd", epochs=1, likelihood="gaussian", noise_std=0.7)
    x, y = train.dataset.tensors
    integer = DataLoader(TensorDataset(x, (y > 0).long()), batch_size=32)
    with pytest.raises(FlatbmaError, match="floating point"):
        flatbma.fit_posterior(_net(), integer, "sgd", epochs=1, likelihood="gaussian")
    with pytest.raises(FlatbmaError, match="'categorical'"):
        flatbma.fit_posterior(_net(), train, "sgd", epochs=1, likelihood="normal")
    with pytest.raises(FlatbmaError, match="likelihood='gaussian'"):
        flatbma.fit_posterior(_net(), train, "sgd", epochs=1, noise_std=1.0)


def test_the_docs_regression_example_runs_as_written(capsys):
    text = (Path(__file__).resolve().parents[1] / "docs" / "python-api.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text[text.index("## Regression\n") :], flags=re.S)
    namespace: dict = {}
    exec(compile(block, "docs/python-api.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "rmse" in printed and namespace["metrics"]["rmse"] < 0.8 and namespace["metrics"]["nll"] < 1.2
    assert namespace["pred"]["std"].shape == (100,)
