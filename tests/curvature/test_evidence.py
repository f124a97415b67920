"""The Laplace evidence against the closed form of Bayesian linear regression, and the prior-precision solve."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from flatbma.curvature import (
    DELTA_RANGE,
    Blocks,
    effective_parameters,
    estimator,
    log_evidence,
    optimize_prior,
    squared_error,
)
from flatbma.errors import FlatbmaError
from tests.curvature.reference import buffers_of, images, params_of, tiny_cnn

F64 = torch.float64
SIGMA = 0.5


def _regression(x, y, delta, hessian, w0=None):
    """Model ``y = W x`` at its MAP under ``N(W₀, δ⁻¹I)`` (``W₀ = w0``, default 0), the curvature blocks and
    ``Σ_i ℓ_i`` (with constants)."""
    n, p = x.shape
    m = y.shape[1]
    rhs = x.mT @ y / SIGMA**2 if w0 is None else x.mT @ y / SIGMA**2 + delta * w0.mT  # [p, m]
    w = torch.linalg.solve(x.mT @ x / SIGMA**2 + delta * torch.eye(p, dtype=F64), rhs).mT  # [m, p]
    model = nn.Linear(p, m, bias=False).to(F64)
    with torch.no_grad():
        model.weight.copy_(w)
    params = params_of(model)
    est = estimator(hessian, "ggn", model, params, num_data=n, num_classes=m, likelihood=squared_error(SIGMA))
    acc = est.accumulate(est.init(), params, {}, x[:7], y[:7], offset=0)
    acc = est.accumulate(acc, params, {}, x[7:], y[7:], offset=7)
    resid = y - x @ w.mT
    nll = float(resid.square().sum() / (2 * SIGMA**2) + n * m / 2 * math.log(2 * math.pi * SIGMA**2))
    return est.blocks(acc, n, n), params, nll


def _closed_form(x, y, delta, w0=None):
    """``Σ_j log N(y_j; X w₀_j, σ²I + XXᵀ/δ)``: the evidence of ``y = Wx + ε`` under ``W ~ N(W₀, δ⁻¹I)``."""
    cov = SIGMA**2 * torch.eye(x.shape[0], dtype=F64) + x @ x.mT / delta
    means = torch.zeros_like(y) if w0 is None else x @ w0.mT  # [n, m]
    return float(
        sum(
            torch.distributions.MultivariateNormal(means[:, j], covariance_matrix=cov).log_prob(y[:, j])
            for j in range(y.shape[1])
        )
    )


def _data(n=20, p=4, m=1, orthogonal=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if orthogonal:
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
        x = q[:, :p] * torch.arange(1, p + 1, dtype=F64)
    else:
        x = torch.randn(n, p, generator=g, dtype=F64)
    w = torch.randn(m, p, generator=g, dtype=F64)
    return x, x @ w.mT + SIGMA * torch.randn(n, m, generator=g, dtype=F64)


@pytest.mark.parametrize(
    ("hessian", "m", "orthogonal"), [("full", 1, False), ("diag", 1, True), ("kfac", 3, False), ("full", 3, False)]
)
@pytest.mark.parametrize("delta", [0.3, 4.0])
def test_laplace_evidence_of_bayesian_linear_regression_is_exact(hessian, m, orthogonal, delta):
    x, y = _data(m=m, orthogonal=orthogonal)
    blocks, params, nll = _regression(x, y, delta, hessian)
    assert log_evidence(blocks, params, nll, delta, 1.0) == pytest.approx(
        _closed_form(x, y, delta), rel=1e-12, abs=1e-10
    )


def test_the_prior_solve_finds_the_grid_maximum_and_mackays_fixed_point():
    x, y = _data(seed=3)
    blocks, params, nll = _regression(x, y, 1.0, "full")
    delta = optimize_prior(blocks, params, 1.0, "scalar")["full"]
    grid = torch.linspace(math.log(1e-3), math.log(1e3), 10_000, dtype=F64)
    values = torch.tensor([log_evidence(blocks, params, nll, math.exp(t), 1.0) for t in grid.tolist()], dtype=F64)
    spacing = float(grid[1] - grid[0])
    assert abs(math.log(delta) - float(grid[values.argmax()])) <= spacing
    assert log_evidence(blocks, params, nll, delta, 1.0) >= float(values.max()) - 1e-12
    gamma = effective_parameters(blocks, delta, 1.0)
    assert delta * float(params["weight"].square().sum()) == pytest.approx(gamma, rel=1e-8)


def _tiny_blocks(hessian="diag", temperature=1.0):
    model = tiny_cnn()
    params, buffers = params_of(model), buffers_of(model)
    x, y = images(5)
    est = estimator(hessian, "ggn", model, params, num_data=5, num_classes=3)
    acc = est.accumulate(est.init(), params, buffers, x, y, offset=0)
    return est, est.blocks(acc, 5, 5), params


@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_layerwise_is_the_separate_one_dimensional_solves(temperature):
    est, blocks, params = _tiny_blocks("kfac")
    layerwise = optimize_prior(blocks, params, temperature, "layerwise")
    assert list(layerwise) == list(blocks.names)
    for g in blocks.names:
        alone = Blocks({g: blocks.block(g)}, {n: blocks.dtypes[n] for n in blocks.params_of(g)})
        assert layerwise[g] == pytest.approx(optimize_prior(alone, params, temperature, "scalar")[g], rel=1e-12)
        sq = sum(float(params[n].square().sum()) for n in blocks.params_of(g))
        gamma = effective_parameters(alone, layerwise[g], temperature)
        assert layerwise[g] * sq == pytest.approx(gamma, rel=1e-8)
    scalar = optimize_prior(blocks, params, temperature, "scalar")
    assert len(set(scalar.values())) == 1
    delta = next(iter(scalar.values()))
    sq = sum(float(v.square().sum()) for v in params.values())
    assert delta * sq == pytest.approx(effective_parameters(blocks, delta, temperature), rel=1e-8)


def test_the_bracket_ends_when_the_evidence_is_monotone():
    est, blocks, params = _tiny_blocks()
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    assert set(optimize_prior(blocks, zeros, 1.0, "scalar").values()) == {DELTA_RANGE[1]}
    flat_blocks = est.blocks(est.init(), 5, 5)  # no curvature: γ ≡ 0
    assert set(optimize_prior(flat_blocks, params, 1.0, "layerwise").values()) == {DELTA_RANGE[0]}


def test_layerwise_is_refused_for_the_full_ggn():
    _, blocks, params = _tiny_blocks("full")
    with pytest.raises(FlatbmaError, match="prior_structure: scalar"):
        optimize_prior(blocks, params, 1.0, "layerwise")
    with pytest.raises(FlatbmaError, match="prior_structure must be one of"):
        optimize_prior(blocks, params, 1.0, "per-layer")


@pytest.mark.parametrize(
    ("hessian", "m", "orthogonal"), [("full", 1, False), ("diag", 1, True), ("kfac", 3, False), ("full", 3, False)]
)
@pytest.mark.parametrize("delta", [0.3, 4.0])
def test_the_evidence_with_a_shifted_prior_mean_is_exact_for_bayesian_linear_regression(hessian, m, orthogonal, delta):
    """Prior ``N(W₀, δ⁻¹I)`` (L2-SP): ``log Z`` with ``‖w* − w₀‖²`` equals ``log N(y; X W₀ᵀ, σ²I + XXᵀ/δ)``."""
    x, y = _data(m=m, orthogonal=orthogonal)
    w0 = 1.5 + torch.randn(m, x.shape[1], generator=torch.Generator().manual_seed(7), dtype=F64)
    blocks, params, nll = _regression(x, y, delta, hessian, w0)
    expected = _closed_form(x, y, delta, w0)
    assert log_evidence(blocks, params, nll, delta, 1.0, {"weight": w0}) == pytest.approx(
        expected, rel=1e-12, abs=1e-10
    )
    assert log_evidence(blocks, params, nll, delta, 1.0) != pytest.approx(expected, rel=1e-3)  # not the zero-mean one
    zeros = {"weight": torch.zeros_like(w0)}  # w₀ = 0 is the zero-mean prior, to the last bit
    assert log_evidence(blocks, params, nll, delta, 1.0, zeros) == log_evidence(blocks, params, nll, delta, 1.0)


def test_the_prior_solve_around_a_prior_mean_finds_the_grid_maximum_and_mackays_fixed_point():
    x, y = _data(seed=3)
    w0 = torch.full((1, x.shape[1]), 2.0, dtype=F64)
    blocks, params, nll = _regression(x, y, 1.0, "full", w0)
    prior_mean = {"weight": w0}
    delta = optimize_prior(blocks, params, 1.0, "scalar", prior_mean)["full"]
    grid = torch.linspace(math.log(1e-3), math.log(1e3), 10_000, dtype=F64)
    values = [log_evidence(blocks, params, nll, math.exp(t), 1.0, prior_mean) for t in grid.tolist()]
    assert abs(math.log(delta) - float(grid[int(torch.tensor(values).argmax())])) <= float(grid[1] - grid[0])
    gamma = effective_parameters(blocks, delta, 1.0)
    assert delta * float((params["weight"] - w0).square().sum()) == pytest.approx(gamma, rel=1e-8)
    assert delta != pytest.approx(optimize_prior(blocks, params, 1.0, "scalar")["full"], rel=1e-2)
    with pytest.raises(FlatbmaError, match=r"the prior mean has no entry for parameter\(s\) \['weight'\]"):
        optimize_prior(blocks, params, 1.0, "scalar", {})
