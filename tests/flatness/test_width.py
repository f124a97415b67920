"""The posterior width (tr Σ, median marginal std): exact hooks against dense covariances and Monte Carlo."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.flatness import sample_variance, width
from flatbma.gaussian import dense_covariance, marginal_variance
from flatbma.optim import SGD, Adam
from flatbma.params import Objective, flatten
from flatbma.posteriors import bsam, lowrank_vi, mc_dropout, mfvi, point, swag
from tests.helpers import Scripted, TwoTensors


def _objective() -> Objective:
    return Objective(model=TwoTensors(), loss_fn=lambda out, y: (out**2).mean())


BATCH = (torch.randn(3, 3, dtype=torch.float64), torch.zeros(3, dtype=torch.long))


def _width_of_dense(cov: torch.Tensor) -> tuple[float, float]:
    diag = cov.diagonal()
    return float(diag.sum()), float(diag.sqrt().median())


def _theta(seed: int = 0, rank: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"b": (4,), "w": (2, 3)}
    theta = {}
    for n, shape in shapes.items():
        theta[f"mean/{n}"] = torch.randn(shape, generator=g, dtype=torch.float64)
        theta[f"log_std/{n}"] = 0.3 * torch.randn(shape, generator=g, dtype=torch.float64) - 1.0
        theta[f"factor/{n}"] = 0.4 * torch.randn((rank, *shape), generator=g, dtype=torch.float64)
    return theta


def test_lowrank_width_is_that_of_the_dense_covariance():
    theta = _theta()
    method = lowrank_vi.build(_objective(), Adam(), rank=4)
    got = width(method.marginal_variance(method.init(theta, {})), exact=True, source="closed form")
    trace, median = _width_of_dense(dense_covariance(theta))
    assert got.trace_cov == pytest.approx(trace, rel=1e-12) and got.median_std == pytest.approx(median, rel=1e-12)
    assert got.exact and got.dim == 10
    v = marginal_variance(theta)  # by name, shaped like the parameter, in the dense (sorted) order
    torch.testing.assert_close(flatten({n: v[n] for n in ("b", "w")}), dense_covariance(theta).diagonal())


@pytest.mark.parametrize("diagonal_only", [False, True])
def test_swag_width_is_that_of_its_sampling_covariance(diagonal_only):
    g = torch.Generator().manual_seed(1)
    iterates = [
        {
            "w": torch.randn(2, 3, generator=g, dtype=torch.float64),
            "b": torch.randn(4, generator=g, dtype=torch.float64),
        }
        for _ in range(12)
    ]
    method = swag.build(
        _objective(), Scripted(iterates), rank=3, scale=0.7, start_step=0, collect_every=1, diagonal_only=diagonal_only
    )
    state = method.init({"w": torch.zeros(2, 3, dtype=torch.float64), "b": torch.zeros(4, dtype=torch.float64)}, {})
    for _ in range(12):
        state, _ = method.update(state, BATCH)
    v = method.marginal_variance(state)
    if diagonal_only:  # N(w̄, scale · ½ diag σ²)
        m = swag.swag_moments(state)
        expected = 0.7 / 2 * m.variance
    else:
        expected = dense_covariance(method.can.gaussian(state)).diagonal()
    torch.testing.assert_close(flatten({n: v[n] for n in ("b", "w")}), expected)
    mean = method.mean(state)
    torch.testing.assert_close(flatten({n: mean[n] for n in ("b", "w")}), swag.swag_moments(state).mean)


def test_the_sample_estimate_converges_to_the_exact_width():
    """A Gaussian with 20 000 samples: the per-coordinate variance is within a few standard errors."""
    theta = _theta(seed=2)
    method = lowrank_vi.build(_objective(), Adam(), rank=4)
    state = method.init(theta, {})
    n = 20_000
    samples = method.sample(state, n, torch.Generator().manual_seed(0))
    exact = method.marginal_variance(state)
    estimate = sample_variance(samples, ["b", "w"])
    for name in ("b", "w"):  # Var(v̂) = 2v²/(n−1) for Gaussian samples
        tolerance = 6 * math.sqrt(2 / (n - 1)) * exact[name]
        assert bool(((estimate[name] - exact[name]).abs() <= tolerance).all()), name
    a = width(exact, exact=True, source="closed form")
    b = width(estimate, exact=False, source="samples")
    assert b.trace_cov == pytest.approx(a.trace_cov, rel=0.05) and b.median_std == pytest.approx(a.median_std, rel=0.05)


def test_mean_field_and_bsam_widths_are_their_samplers_variances():
    weights = {"w": torch.randn(2, 3, dtype=torch.float64), "b": torch.randn(4, dtype=torch.float64)}
    for method in (mfvi.build(_objective(), Adam(), init_std=0.3), bsam.build(_objective(), SGD(), init_precision=2.0)):
        state = method.init(weights, {})
        samples = method.sample(state, 20_000, torch.Generator().manual_seed(0))
        exact = method.marginal_variance(state)
        estimate = sample_variance(samples, ["b", "w"])
        for name in ("b", "w"):
            torch.testing.assert_close(estimate[name], exact[name], rtol=0.06, atol=0.0)
        torch.testing.assert_close(method.mean(state)["w"], weights["w"])


def test_a_point_has_zero_width_and_is_its_own_mean():
    weights = {"w": torch.randn(2, 3, dtype=torch.float64), "b": torch.randn(4, dtype=torch.float64)}
    method = point.build(_objective(), SGD())
    state = method.init(weights, {})
    got = width(method.marginal_variance(state), exact=True, source="closed form")
    assert got.trace_cov == 0.0 and got.median_std == 0.0
    assert all(torch.equal(method.mean(state)[k], weights[k]) for k in weights)


def test_mc_dropout_width_is_the_variance_of_the_masked_weights():
    """``W diag(z)/(1−p)`` with ``z ~ Bernoulli(1−p)``: Monte Carlo against ``W² p/(1−p)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    method = mc_dropout.build(Objective(model=model), SGD(), rate=0.3)  # inserts Dropout(0.3) before "2"
    params = {k: v.detach() for k, v in model.named_parameters()}
    v = method.marginal_variance(method.init(params, {}))
    w = params["2.1.weight"]
    z = (torch.rand(50_000, 1, 4, dtype=torch.float64) > 0.3).double()
    torch.testing.assert_close(v["2.1.weight"], (w * z / 0.7).var(0), rtol=0.05, atol=1e-12)
    assert all(float(v[k].abs().max()) == 0.0 for k in ("0.weight", "0.bias", "2.1.bias"))


def test_width_rejects_bad_variances():
    with pytest.raises(FlatbmaError, match="at least one parameter"):
        width({}, exact=True, source="")
    with pytest.raises(FlatbmaError, match="finite and >= 0"):
        width({"a": torch.tensor([-1.0])}, exact=True, source="")
    one = sample_variance([{"a": torch.ones(3)}], ["a"])
    assert float(one["a"].abs().max()) == 0.0
