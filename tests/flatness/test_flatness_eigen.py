import warnings

import pytest
import torch

from flatbma.flatness import ConvergenceWarning, hessian_eigenvalues, hvp_fn, lanczos, power_iteration
from tests.flatness.problems import make_problem, quadratic_problem

# distinct, with a negative eigenvalue larger in magnitude than λ_1: "largest" means algebraic
SPECTRUM = [9.0, 6.5, 4.0, 3.0, 2.5, 1.0, 0.5, 0.1, -0.3, -2.0, -12.0] + [0.01 * i for i in range(9)]


@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_quadratic_with_known_spectrum(method):
    model, loss_fn, batch, _ = quadratic_problem(SPECTRUM)
    # power iteration runs on A + 12 I, where λ_5/λ_4 = 14.5/15: it needs many more products
    tol, max_iter = (1e-9, 100) if method == "lanczos" else (1e-6, 1000)
    ev = hessian_eigenvalues(model, batch, k=5, loss_fn=loss_fn, method=method, tol=tol, max_iter=max_iter)
    assert ev.dtype == torch.float64
    expected = torch.tensor([9.0, 6.5, 4.0, 3.0, 2.5], dtype=torch.float64)
    torch.testing.assert_close(ev, expected, rtol=10 * tol, atol=0)


def test_lanczos_finds_repeated_eigenvalues_after_an_invariant_krylov_space():
    # three distinct values: the start vector's Krylov space is invariant after 3 steps; the top 5
    # need four copies of 3, found in restarted blocks
    lam = [5.0] + [3.0] * 10 + [1.0] * 9
    model, loss_fn, batch, a = quadratic_problem(lam, seed=1)
    for dtype in (torch.float64, torch.float32):
        model, loss_fn, batch, a = quadratic_problem(lam, seed=1, dtype=dtype)
        op = hvp_fn(model, batch, loss_fn=loss_fn)
        res = lanczos(op, op.dim, 5, tol=1e-6, eps=op.eps, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(
            res.eigenvalues, torch.tensor([5.0, 3, 3, 3, 3], dtype=torch.float64), rtol=1e-5, atol=0
        )
        assert res.converged
    ev = hessian_eigenvalues(model, batch, k=5, loss_fn=loss_fn, method="power", tol=1e-5)
    torch.testing.assert_close(ev, torch.tensor([5.0, 3, 3, 3, 3], dtype=torch.float64), rtol=1e-4, atol=0)


def test_generic_solvers_return_orthonormal_eigenvectors_with_true_residuals():
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(60, 60, generator=g, dtype=torch.float64))
    lam = torch.linspace(-3, 10, 60, dtype=torch.float64) ** 3 / 100
    a = (q * lam) @ q.T
    # deflation with eigenvectors that have residuals ~tol limits what power iteration can reach
    for solver, tol in ((lanczos, 1e-10), (power_iteration, 1e-8)):
        res = solver(lambda v: a @ v, 60, 4, tol=tol, max_iter=1000, generator=g)
        assert res.converged
        torch.testing.assert_close(res.eigenvalues, lam.flip(0)[:4], rtol=tol, atol=0)
        y = res.eigenvectors
        torch.testing.assert_close(y @ y.T, torch.eye(4, dtype=torch.float64), atol=1e-7, rtol=0)
        true_res = torch.linalg.vector_norm(y @ a - res.eigenvalues[:, None] * y, dim=1)
        assert (true_res <= (1.01 if solver is lanczos else 10) * tol * res.eigenvalues.abs()).all()
    # Lanczos needs far fewer products than deflated power iteration
    n_l = lanczos(lambda v: a @ v, 60, 4, tol=1e-8, generator=g).num_matvecs
    n_p = power_iteration(lambda v: a @ v, 60, 4, tol=1e-8, max_iter=1000, generator=g).num_matvecs
    assert n_l < n_p / 3


@pytest.mark.parametrize(
    ("method", "hvp"), [("lanczos", "double_backward"), ("lanczos", "func"), ("power", "double_backward")]
)
def test_mlp_top5_match_dense_eigvalsh(problem, method, hvp):
    ref = torch.linalg.eigvalsh(problem.dense_hessian()).flip(0)[:5]
    # λ_min ≈ −0.45 makes power iteration run on A + 0.45 I (ratio λ_5/λ_4 ≈ 0.98 there): a residual
    # tolerance of 1e-3 already gives eigenvalues to ~1e-5 (the error is ~ residual² / gap)
    tol, max_iter = (1e-4, 100) if method == "lanczos" else (1e-3, 600)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        ev = hessian_eigenvalues(
            problem.model, problem.batches, k=5, method=method, hvp=hvp, tol=tol, max_iter=max_iter
        )
    assert ((ev - ref).abs() / ref.abs()).max() < 1e-4


def test_mlp_float32_top5_within_1e_4(problem):
    p = make_problem(torch.float32)
    ref = torch.linalg.eigvalsh(p.dense_hessian().double()).flip(0)[:5]
    ev = hessian_eigenvalues(p.model, p.batches, k=5)
    assert ((ev - ref).abs() / ref.abs()).max() < 1e-4
    assert p.model.training


def test_subset_eigenvalues_are_those_of_the_block(problem):
    names = ["2.weight", "3.weight", "3.bias"]
    ref = torch.linalg.eigvalsh(problem.dense_hessian(names=names)).flip(0)[:3]
    ev = hessian_eigenvalues(problem.model, problem.batches, k=3, params=names, tol=1e-8)
    torch.testing.assert_close(ev, ref, rtol=1e-7, atol=0)
    full = torch.linalg.eigvalsh(problem.dense_hessian()).flip(0)[:3]
    assert not torch.allclose(ev, full, rtol=1e-3)


def test_seed_reproducible_and_warns_when_unconverged(problem):
    a = hessian_eigenvalues(problem.model, problem.batches, k=3, seed=5)
    b = hessian_eigenvalues(problem.model, problem.batches, k=3, seed=5)
    assert torch.equal(a, b)
    with pytest.warns(ConvergenceWarning, match="max_iter=5"):
        hessian_eigenvalues(problem.model, problem.batches, k=3, max_iter=5, tol=1e-12)


def test_eigenvalues_at_a_posterior_sample(problem):
    g = torch.Generator().manual_seed(4)
    sample = {
        k: v.detach() + 0.2 * torch.randn(v.shape, generator=g, dtype=v.dtype)
        for k, v in problem.model.named_parameters()
    }
    sample.update({k: v.clone() for k, v in problem.model.named_buffers()})
    sample["3.running_var"] = sample["3.running_var"] * 1.5
    ref = torch.linalg.eigvalsh(problem.dense_hessian(weights=sample)).flip(0)[:2]
    ev = hessian_eigenvalues(problem.model, problem.batches, k=2, weights=sample, tol=1e-8)
    torch.testing.assert_close(ev, ref, rtol=1e-7, atol=0)


def test_lanczos_flags_each_eigenvalue_and_can_stay_silent():
    """λ₁ = 50 is far from the rest and converges in a few steps; λ₂ ≈ λ₃ (gap 1e-4) do not by then."""
    lam = torch.tensor([50.0, 1.0, 0.9999] + [0.5 - 0.01 * i for i in range(30)], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(len(lam), len(lam), generator=g, dtype=torch.float64))
    a = (q * lam) @ q.T
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        res = lanczos(lambda v: a @ v, len(lam), 2, tol=1e-8, max_iter=6, generator=g, warn=False)
    assert res.converged_each.tolist() == [True, False] and not res.converged
    assert float(res.eigenvalues[0]) == pytest.approx(50.0, rel=1e-8)
    rel = res.residuals / res.eigenvalues.abs()
    assert bool(rel[0] <= 1e-8) and bool(rel[1] > 1e-8)
    with pytest.warns(ConvergenceWarning):
        lanczos(lambda v: a @ v, len(lam), 2, tol=1e-8, max_iter=6, generator=torch.Generator().manual_seed(0))
    done = power_iteration(lambda v: a @ v, len(lam), 1, tol=1e-6, max_iter=200, generator=g)
    assert done.converged_each.tolist() == [True]
