"""FisherBall's float32 solve against the float64 reference: the error bound of ``float32_error`` and its fallback."""

from __future__ import annotations

import pytest
import torch

from flatbma.errors import FlatbmaError
from flatbma.gaussian import geometry
from flatbma.optim import FisherBall
from flatbma.optim.fisher_ball import (
    GRAM_BLOCK,
    SolvePrecision,
    _dot,
    _rotation,
    float32_error,
    gram,
    natural_gradient,
    solve_covariance_fisher,
    whitened_fisher_product,
)

U32 = torch.finfo(torch.float32).eps / 2


def _problem(seed: int, spread: float) -> tuple[dict, dict]:
    """``θ`` in float64 with factor columns of scales ``e^(spread·N(0,1))`` times σ and per-coordinate noise."""
    g = torch.Generator().manual_seed(seed)
    d = int(torch.randint(50, 2500, (1,), generator=g))
    k = int(torch.randint(2, 9, (1,), generator=g))
    log_std = torch.rand(d, generator=g, dtype=torch.float64) * 8 - 9
    columns = torch.exp(spread * torch.randn(k, 1, generator=g, dtype=torch.float64))
    coordinates = torch.exp(torch.randn(d, generator=g, dtype=torch.float64))
    factor = torch.randn(k, d, generator=g, dtype=torch.float64) * log_std.exp() * columns * coordinates
    theta = {"mean/w": torch.randn(d, generator=g, dtype=torch.float64), "log_std/w": log_std, "factor/w": factor}
    grads = {key: torch.randn(v.shape, generator=g, dtype=torch.float64) for key, v in theta.items()}
    return theta, grads


def _single(geo):
    return geo._replace(ut=geo.ut.float(), pt=geo.pt.float())


@pytest.mark.parametrize("spread", [0.0, 1.0, 4.0])
def test_a_float32_product_is_within_the_bound_of_the_float64_one(spread):
    # ‖f̂ − F̃_λy‖ ≤ λ·float32_error·‖y‖ = c·u₃₂(1 + a)²‖y‖, on operands whose scales span e^±6 per entry
    for seed in range(12):
        theta, _ = _problem(seed, spread)
        geo = geometry(theta, torch.float64, cache=False)
        k, d = geo.ut.shape
        g = torch.Generator().manual_seed(100 + seed)
        y = torch.randn(k + 1, d, generator=g, dtype=torch.float64)
        y *= torch.exp(2 * torch.randn(k + 1, d, generator=g, dtype=torch.float64))
        exact = whitened_fisher_product(geo, y, torch.empty_like(y), damping=1e-2)
        y32 = y.float()
        weight = (1 - 2 * geo.w).float()
        got = whitened_fisher_product(_single(geo), y32, torch.empty_like(y32), damping=1e-2, diagonal_weight=weight)
        error = float((got.double() - exact).norm() / y.norm())
        assert error <= 1e-2 * float32_error(geo, 1e-2), (seed, spread, error)
        assert error > 0  # float32 really ran


@pytest.mark.parametrize("spread", [0.0, 1.0, 4.0])
def test_a_float32_solve_moves_the_float64_one_by_at_most_the_bound_per_iteration(spread):
    for seed in range(6):
        theta, grads = _problem(seed, spread)
        geo = geometry(theta, torch.float64, cache=False)
        g_cov = torch.cat([grads["log_std/w"][None], grads["factor/w"]])
        g_cov[1:] -= _rotation(geo.u, g_cov[1:]) @ geo.u
        delta = float32_error(geo, 1e-2)
        for iterations in (1, 3, 8):
            exact = solve_covariance_fisher(geo, g_cov, damping=1e-2, cg_iters=iterations).x
            got = solve_covariance_fisher(geo, g_cov, damping=1e-2, cg_iters=iterations, dtype=torch.float32).x
            assert got.dtype == torch.float64
            change = float((got - exact).norm() / exact.norm())
            if delta < 0.5:
                assert change <= iterations * delta / (1 - delta), (seed, spread, iterations, change, delta)
            else:  # the bound says nothing: the float32 solve is not used there (below)
                assert change < 1


def test_auto_precision_falls_back_to_float64_where_the_bound_exceeds_cg_tol():
    used = {True: 0, False: 0}
    for seed in range(16):
        theta, grads = _problem(seed, 4.0 if seed % 2 else 0.0)
        geo = geometry(theta, torch.float64, cache=False)
        single = float32_error(geo, 1e-2) <= 1e-3
        used[single] += 1
        reference, q64 = natural_gradient(theta, grads, damping=1e-2, cg_iters=20, cg_tol=1e-3)
        auto, q = natural_gradient(theta, grads, damping=1e-2, cg_iters=20, cg_tol=1e-3, precision="auto")
        same = all(torch.equal(auto[key], reference[key]) for key in reference)
        assert same != single, (seed, float32_error(geo, 1e-2))
        if single:
            for key in reference:
                rel = float((auto[key] - reference[key]).norm() / reference[key].norm())
                assert rel < 1e-2, (seed, key, rel)  # within the solve's own truncation (cg_tol = 1e-3)
            assert float(q) == pytest.approx(float(q64), rel=1e-3)
        # a fixed iteration count (cg_tol = 0) always runs in float64
        fixed, _ = natural_gradient(theta, grads, damping=1e-2, cg_iters=3, precision="auto")
        exact, _ = natural_gradient(theta, grads, damping=1e-2, cg_iters=3)
        assert all(torch.equal(fixed[key], exact[key]) for key in exact)
    assert used[True] and used[False]  # both branches were taken


def test_the_bound_grows_with_the_spread_of_the_factor_and_is_infinite_without_damping():
    theta, _ = _problem(0, 0.0)
    geo = geometry(theta, torch.float64, cache=False)
    assert float32_error(geo, 0.0) == float("inf")
    assert float32_error(geo, 1e-1) == pytest.approx(float32_error(geo, 1e-2) / 10)
    # isotropic large factor: a ≈ √K; one column 10⁴ times the others: a ≈ 10⁴
    d, k = 1000, 4
    g = torch.Generator().manual_seed(0)
    base = {"mean/w": torch.zeros(d, dtype=torch.float64), "log_std/w": torch.full((d,), -5.0, dtype=torch.float64)}
    factor = torch.randn(k, d, generator=g, dtype=torch.float64) * 0.1
    alike = geometry({**base, "factor/w": factor}, torch.float64, cache=False)
    spread = geometry({**base, "factor/w": factor * torch.tensor([[1e4], [1], [1], [1]])}, torch.float64, cache=False)
    assert float32_error(alike, 1e-2) < 4 * U32 * (1 + 2 * k**0.5) ** 2 / 1e-2
    assert float32_error(spread, 1e-2) > 1e3 * float32_error(alike, 1e-2)


def test_gram_and_dot_sum_float32_blocks_in_float64_within_the_block_bound():
    g = torch.Generator().manual_seed(1)
    for n in (7, GRAM_BLOCK, 3 * GRAM_BLOCK + 5, 40_000):
        a = torch.randn(3, n, generator=g) * torch.exp(torch.randn(3, n, generator=g))
        b = torch.randn(4, n, generator=g)
        exact = a.double() @ b.double().T  # products of float32 numbers are exact in float64
        bound = (GRAM_BLOCK * U32 + n * 2**-53) * (a.double().abs() @ b.double().abs().T)
        got = gram(a, b)
        assert got.dtype == torch.float64 and bool(((got - exact).abs() <= bound).all())
        dot = _dot(a[:1], b[:1])
        assert dot.dtype == torch.float64 and abs(float(dot - exact[0, 0])) <= float(bound[0, 0])
    a64 = torch.randn(2, 50, generator=g, dtype=torch.float64)
    assert torch.equal(gram(a64, a64), a64 @ a64.T)  # float64: the plain product


def test_the_precision_option_is_parsed_and_refused_in_one_line():
    assert FisherBall().precision is SolvePrecision.AUTO
    assert FisherBall(precision="float64").precision is SolvePrecision.FLOAT64
    with pytest.raises(FlatbmaError, match="precision"):
        FisherBall(precision="float16")
