"""The memory-bounding paths of the Hessian: thick-restart Lanczos, chunked gradient graphs, blocked dots.

Each is checked against a known answer (a dense eigendecomposition or Hessian) or, where the maths is
unchanged, against the unbounded path bit for bit.
"""

import importlib
import math

import pytest
import torch
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.flatness import CPU_CHUNK_SIZE, default_basis_size, hessian_eigenvalues, hvp_fn, lanczos
from flatbma.flatness import hvp as hvp_module
from tests.flatness.problems import make_problem, quadratic_problem

lanczos_module = importlib.import_module("flatbma.flatness.lanczos")


def _operator(lam, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(len(lam), len(lam), generator=g, dtype=torch.float64))
    return (q * lam) @ q.T


@pytest.mark.parametrize("basis_size", [7, 9, 12])
def test_thick_restart_matches_the_dense_eigendecomposition(basis_size):
    # a slowly decaying spectrum with a negative end: the top-5 need more products than the basis holds
    lam = torch.linspace(-3, 10, 200, dtype=torch.float64) ** 3 / 100
    a = _operator(lam)
    res = lanczos(lambda v: a @ v, 200, 5, tol=1e-10, max_iter=2000, basis_size=basis_size)
    assert res.converged and res.num_matvecs > basis_size  # it restarted
    torch.testing.assert_close(res.eigenvalues, lam.flip(0)[:5], rtol=1e-10, atol=0)
    y = res.eigenvectors
    torch.testing.assert_close(y @ y.T, torch.eye(5, dtype=torch.float64), atol=1e-7, rtol=0)
    # the residual estimate β|e_mᵀ s_i| of the restarted recurrence is the true residual
    true_res = torch.linalg.vector_norm(y @ a - res.eigenvalues[:, None] * y, dim=1)
    assert (true_res <= 1.01e-10 * res.eigenvalues.abs()).all()
    torch.testing.assert_close(true_res, res.residuals, rtol=1e-3, atol=1e-12)


def test_thick_restart_finds_repeated_eigenvalues_after_an_invariant_krylov_space():
    # as in test_flatness_eigen, with a basis of k + 2 vectors: invariant spaces and restarts together
    lam = [5.0] + [3.0] * 10 + [1.0] * 9
    for dtype in (torch.float64, torch.float32):
        model, loss_fn, batch, _ = quadratic_problem(lam, seed=1, dtype=dtype)
        op = hvp_fn(model, batch, loss_fn=loss_fn)
        res = lanczos(op, op.dim, 5, tol=1e-6, eps=op.eps, generator=torch.Generator().manual_seed(0), basis_size=7)
        torch.testing.assert_close(
            res.eigenvalues, torch.tensor([5.0, 3, 3, 3, 3], dtype=torch.float64), rtol=1e-5, atol=0
        )
        assert res.converged


def test_a_bound_that_is_not_reached_gives_the_unbounded_numbers_bit_for_bit():
    lam = torch.linspace(-3, 10, 60, dtype=torch.float64) ** 3 / 100
    a = _operator(lam)
    runs = [
        lanczos(lambda v: a @ v, 60, 4, tol=1e-8, generator=torch.Generator().manual_seed(3), basis_size=b)
        for b in (None, 40)
    ]
    assert runs[0].num_matvecs < 40
    assert torch.equal(runs[0].eigenvalues, runs[1].eigenvalues)
    assert torch.equal(runs[0].eigenvectors, runs[1].eigenvectors)


def test_float32_hessian_with_a_bounded_basis_matches_the_dense_eigenvalues():
    p = make_problem(torch.float32)
    ref = torch.linalg.eigvalsh(p.dense_hessian().double()).flip(0)[:5]
    for basis_size in (7, default_basis_size(5), None):
        ev = hessian_eigenvalues(p.model, p.batches, k=5, basis_size=basis_size)
        assert ((ev - ref).abs() / ref.abs()).max() < 1e-4


def test_float32_basis_restarts_on_a_generic_operator():
    # the basis (and the products) in float32: restarts keep the eigenvalues to the products' precision
    lam = torch.linspace(-3, 10, 300, dtype=torch.float64) ** 3 / 100
    a = _operator(lam).float()
    res = lanczos(
        lambda v: a @ v,
        300,
        3,
        tol=1e-4,
        max_iter=500,
        eps=torch.finfo(torch.float32).eps,
        dtype=torch.float32,
        basis_size=6,
        vectors=False,
    )
    assert res.converged and res.num_matvecs > 6 and res.eigenvectors is None
    assert ((res.eigenvalues - lam.flip(0)[:3]).abs() / lam.flip(0)[:3]).max() < 1e-4


def test_default_basis_size_and_its_checks():
    assert default_basis_size(1) == 8 and default_basis_size(5) == 8 and default_basis_size(10) == 13
    for bad in (6, 2, 7.5):
        with pytest.raises(FlatbmaError, match="basis_size"):
            lanczos(lambda v: v, 50, 5, basis_size=bad)


def test_blocked_float64_dot_and_norm_of_long_float32_vectors():
    g = torch.Generator().manual_seed(0)
    n = 5 * lanczos_module._BLOCK + 123
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    # exactly rounded references: float32 products are exact in float64, fsum rounds the sum once
    exact_dot = math.fsum(x * y for x, y in zip(a.double().tolist(), b.double().tolist()))
    exact_norm = math.sqrt(math.fsum(x * x for x in a.double().tolist()))
    assert lanczos_module._dot(a, b) == pytest.approx(exact_dot, rel=1e-13)
    assert lanczos_module._norm(a) == pytest.approx(exact_norm, rel=1e-13)
    short = a[:1000]  # one block: the unblocked computation itself
    assert lanczos_module._dot(short, short) == float(short.double() @ short.double())


@pytest.mark.parametrize("chunk_size", [1, 6, 13, None])
def test_chunked_products_equal_the_dense_hessian(problem, chunk_size):
    H = problem.dense_hessian()
    g = torch.Generator().manual_seed(0)
    for data in ((problem.x, problem.y), problem.batches):  # one cached batch; batches recomputed
        op = hvp_fn(problem.model, data, chunk_size=chunk_size)
        assert op.chunk_size == chunk_size
        for _ in range(2):
            v = torch.randn(op.dim, generator=g, dtype=torch.float64)
            torch.testing.assert_close(op(v), H @ v, rtol=1e-10, atol=1e-12)
    cached = hvp_fn(problem.model, (problem.x, problem.y), chunk_size=chunk_size)
    assert len(cached._cached) == (1 if chunk_size is None else -(-40 // chunk_size))


def test_chunks_are_as_equal_as_possible_and_auto_is_the_cpu_size(problem):
    op = hvp_fn(problem.model, (problem.x, problem.y), chunk_size=13)
    assert [n for n, _, _ in op._cached] == [10, 10, 10, 10]  # 40 examples, ⌈40/13⌉ = 4 chunks
    assert hvp_fn(problem.model, problem.batches).chunk_size == CPU_CHUNK_SIZE
    for bad in (0, -3, 2.5, "all", True):
        with pytest.raises(FlatbmaError, match="chunk_size"):
            hvp_fn(problem.model, problem.batches, chunk_size=bad)


def test_eval_batch_norm_graph_gives_addcmul_numbers_bit_for_bit(monkeypatch):
    # _ChannelAffine drops the copy x·1 from addcmul's backward: the product itself is unchanged
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
        model[1].weight.uniform_(0.5, 1.5)
    model.eval()
    x, y = torch.randn(8, 2, 6, 6), torch.randint(0, 3, (8,))
    v = torch.randn(sum(p.numel() for p in model.parameters()), generator=torch.Generator().manual_seed(0))
    lean = hvp_fn(model, (x, y))(v)

    def addcmul_batch_norm(module, x):  # the same affine map through addcmul's own backward
        scale = module.weight * torch.rsqrt(module.running_var + module.eps)
        shift = module.bias - module.running_mean * scale
        return torch.addcmul(shift.reshape(-1, 1, 1), x, scale.reshape(-1, 1, 1))

    monkeypatch.setattr(hvp_module, "_affine_batch_norm", addcmul_batch_norm)
    assert torch.equal(lean, hvp_fn(model, (x, y))(v))
