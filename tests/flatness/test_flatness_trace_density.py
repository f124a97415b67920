import math

import pytest
import torch

from flatbma.flatness import (
    hessian_trace,
    hutchinson_trace,
    hvp_fn,
    spectral_density,
    stochastic_lanczos_quadrature,
)
from flatbma.flatness.hutchinson import rademacher


def test_hessian_trace_within_three_standard_errors(problem):
    H = problem.dense_hessian()
    est = hessian_trace(problem.model, problem.batches, num_samples=60, seed=1)
    assert est.samples.shape == (60,)
    assert est.stderr > 0
    assert abs(est.trace - float(H.trace())) < 3 * est.stderr
    # the standard error is the sample std over √m
    assert math.isclose(est.stderr, float(est.samples.std()) / math.sqrt(60))


def test_hutchinson_standard_error_matches_the_rademacher_variance():
    # Var[zᵀAz] = 2 Σ_{i≠j} A_ij² for Rademacher z: the estimator's spread over repeats and its own
    # standard error both match √(Var/m)
    g = torch.Generator().manual_seed(0)
    b = torch.randn(30, 30, generator=g, dtype=torch.float64)
    a = b + b.T
    var = 2 * (a.square().sum() - a.diag().square().sum())
    m = 20
    ests = [hutchinson_trace(lambda v: a @ v, 30, num_samples=m, generator=g) for _ in range(300)]
    traces = torch.tensor([e.trace for e in ests])
    expected_se = math.sqrt(var / m)
    assert abs(float(traces.mean()) - float(a.trace())) < 4 * expected_se / math.sqrt(300)
    assert abs(float(traces.std()) / expected_se - 1) < 0.15
    assert abs(sum(e.stderr**2 for e in ests) / 300 / expected_se**2 - 1) < 0.1


def test_rademacher_entries():
    z = rademacher(1000, torch.Generator().manual_seed(0))
    assert z.dtype == torch.float64 and set(z.tolist()) == {-1.0, 1.0}
    assert abs(float(z.mean())) < 0.1


def test_slq_density_integrates_to_one_and_its_mean_is_trace_over_d(problem):
    H = problem.dense_hessian()
    d = H.shape[0]
    dens = spectral_density(problem.model, problem.batches, num_vectors=6, num_steps=40, seed=0)
    assert dens.nodes.shape == (6, 40) and dens.dim == d
    torch.testing.assert_close(dens.weights.sum(), torch.tensor(1.0, dtype=torch.float64))
    # the mean is a Hutchinson estimate of tr(H)/d with the same probes
    hutch = hutchinson_trace(
        hvp_fn(problem.model, problem.batches), d, num_samples=6, generator=torch.Generator().manual_seed(0)
    )
    assert math.isclose(dens.trace(), hutch.trace, rel_tol=1e-9)
    assert abs(dens.mean() - float(H.trace()) / d) < 3 * hutch.stderr / d
    # the nodes lie inside the spectrum
    ev = torch.linalg.eigvalsh(H)
    assert float(dens.nodes.min()) >= float(ev[0]) - 1e-9 and float(dens.nodes.max()) <= float(ev[-1]) + 1e-9


def test_slq_quadrature_is_exact_for_low_degree_moments():
    # with m steps, Σ τ_j θ_j^p = vᵀ A^p v for p ≤ 2m − 1 (Gauss quadrature)
    g = torch.Generator().manual_seed(2)
    b = torch.randn(50, 50, generator=g, dtype=torch.float64)
    a = (b + b.T) / 10
    gen = torch.Generator().manual_seed(7)
    dens = stochastic_lanczos_quadrature(lambda v: a @ v, 50, num_vectors=1, num_steps=4, generator=gen)
    v = rademacher(50, torch.Generator().manual_seed(7)) / math.sqrt(50)
    for p in range(1, 8):
        exact = float(v @ torch.linalg.matrix_power(a, p) @ v)
        assert math.isclose(dens.moment(p), exact, rel_tol=1e-8, abs_tol=1e-12), p


def test_slq_stops_at_an_invariant_krylov_space():
    # three distinct eigenvalues: the quadrature is exact after 3 steps and the rest is padding
    lam = torch.tensor([4.0] * 5 + [1.0] * 5 + [-2.0] * 5, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(15, 15, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    a = (q * lam) @ q.T
    dens = stochastic_lanczos_quadrature(
        lambda v: a @ v, 15, num_vectors=2, num_steps=10, generator=torch.Generator().manual_seed(1)
    )
    live = dens.nodes[dens.weights > 0]
    assert live.numel() == 6
    torch.testing.assert_close(live.sort().values, torch.tensor([-2.0, -2, 1, 1, 4, 4], dtype=torch.float64))
    assert float(dens.weights.sum()) == pytest.approx(1.0, rel=1e-12)
