"""Blocks (log det, sampler, marginal and functional variance) against the dense precision ``P = H/T + diag δ``.

The dense ``H`` is assembled from the accumulators (``diag h``, ``B ⊗ A``, the dense blocks, ``WᵀW``), not
from the eigendecompositions under test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatbma.curvature import effective_parameters, estimator
from flatbma.errors import FlatbmaError
from flatbma.gaussian import standard_normal_like
from tests.curvature.reference import block_slices, buffers_of, flat, images, params_of, tiny_cnn

F64 = torch.float64
T = 0.7
FORMS = {"diag": ("diag", 4096), "kfac": ("kfac", 4096), "full": ("full", 4096), "dual": ("full", 20)}


def _setup(form, n=4, seen=4, num_data=6):
    model = tiny_cnn()
    params, buffers = params_of(model), buffers_of(model)
    x, y = images(n)
    hessian, max_full = FORMS[form]
    est = estimator(hessian, "ggn", model, params, num_data=num_data, num_classes=3, max_full=max_full)
    assert est.form == form
    acc = est.init()
    acc = est.accumulate(acc, params, buffers, x[:seen], y[:seen], offset=0)
    return est, params, acc, est.blocks(acc, seen, num_data), num_data / seen, seen


def _dense_h(est, params, acc, scale, seen) -> torch.Tensor:
    d = sum(v.numel() for v in params.values())
    h = torch.zeros(d, d, dtype=F64)
    slices = block_slices(params)
    for key, value in acc.items():
        if key == "full":
            h += scale * value
        elif key == "rows":
            h += scale * value.mT @ value
        elif key.startswith("diag/"):
            sl = slices[key[5:]]
            h[sl, sl] += torch.diag(scale * value.reshape(-1))
        elif key.startswith("dense/"):
            sl = slices[key[6:]]
            h[sl, sl] += scale * value
        elif key.startswith("kfac/B/"):
            name = key[7:]
            sl = slices[name]
            h[sl, sl] += torch.kron(scale * value, acc[f"kfac/A/{name}"] / seen)
    return h


def _deltas(blocks):
    return {g: 0.5 + 0.3 * i for i, g in enumerate(blocks.names)}


def _dense_delta(blocks, params, deltas) -> torch.Tensor:
    slices = block_slices(params)
    out = torch.zeros(sum(v.numel() for v in params.values()), dtype=F64)
    for g in blocks.names:
        for name in blocks.params_of(g):
            out[slices[name]] = deltas[g]
    return out


@pytest.fixture(params=list(FORMS))
def case(request):
    est, params, acc, blocks, scale, seen = _setup(request.param)
    h = _dense_h(est, params, acc, scale, seen)
    deltas = _deltas(blocks)
    precision = h / T + torch.diag(_dense_delta(blocks, params, deltas))
    return request.param, params, blocks, deltas, precision


def test_logdet_equals_torch_logdet(case):
    _, _, blocks, deltas, precision = case
    assert blocks.logdet(deltas, T) == pytest.approx(float(torch.logdet(precision)), rel=1e-12, abs=1e-10)


def test_the_samplers_linear_map_has_covariance_p_inverse(case):
    _, params, blocks, deltas, precision = case
    names = sorted(params)
    d = precision.shape[0]
    columns = []
    for j in range(d):
        e = torch.zeros(d, dtype=F64)
        e[j] = 1.0
        z = dict(
            zip(
                names,
                (piece.view(params[n].shape) for n, piece in zip(names, e.split([params[n].numel() for n in names]))),
                strict=True,
            )
        )
        columns.append(flat(blocks.scale_noise(z, deltas, T)))
    s = torch.stack(columns, dim=1)
    torch.testing.assert_close(s @ s.mT, torch.linalg.inv(precision), rtol=0, atol=1e-12)


def test_marginal_and_functional_variance_equal_the_dense_inverse(case):
    _, params, blocks, deltas, precision = case
    cov = torch.linalg.inv(precision)
    torch.testing.assert_close(flat(blocks.marginal_variance(deltas, T)), cov.diagonal(), rtol=0, atol=1e-12)
    g = torch.Generator().manual_seed(5)
    jac = {n: torch.randn(2, 3, *v.shape, generator=g, dtype=F64) for n, v in params.items()}
    jf = torch.cat([jac[n].reshape(2, 3, -1) for n in sorted(params)], dim=-1)
    ref = torch.einsum("bci,ij,bcj->bc", jf, cov, jf)
    torch.testing.assert_close(blocks.functional_variance(jac, deltas, T), ref, rtol=1e-10, atol=1e-12)


def test_samples_are_the_linear_map_of_standard_normal_noise_in_sorted_name_order(case):
    _, params, blocks, deltas, _ = case
    draws = blocks.sample(2, deltas, T, torch.Generator().manual_seed(11))
    g = torch.Generator().manual_seed(11)
    for draw in draws:
        z = standard_normal_like({n: params[n] for n in sorted(params)}, g)
        ref = blocks.scale_noise(z, deltas, T)
        assert list(draw) == sorted(params)
        for n in params:
            torch.testing.assert_close(draw[n], ref[n], rtol=0, atol=0)


def test_the_dual_form_equals_the_primal_form():
    _, params, _, primal, _, _ = _setup("full")
    _, _, _, dual, _, _ = _setup("dual")
    assert dual.eigenvalues("full").numel() < dual.dim("full") == primal.dim("full")
    assert dual.logdet(0.8, T) == pytest.approx(primal.logdet(0.8, T), rel=1e-12)
    for n, v in primal.marginal_variance(0.8, T).items():
        torch.testing.assert_close(dual.marginal_variance(0.8, T)[n], v, rtol=1e-9, atol=1e-12)
    jac = {n: torch.randn(2, 3, *v.shape, dtype=F64) for n, v in params.items()}
    torch.testing.assert_close(
        dual.functional_variance(jac, 0.8, T), primal.functional_variance(jac, 0.8, T), rtol=1e-9, atol=1e-12
    )
    top = torch.sort(primal.eigenvalues("full"), descending=True).values[: dual.eigenvalues("full").numel()]
    torch.testing.assert_close(torch.sort(dual.eigenvalues("full"), descending=True).values, top, rtol=1e-9, atol=1e-10)


def test_effective_parameters_are_the_trace_of_h_over_p():
    est, params, acc, blocks, scale, seen = _setup("kfac")
    h = _dense_h(est, params, acc, scale, seen) / T
    gamma = torch.trace(h @ torch.linalg.inv(h + 0.4 * torch.eye(h.shape[0], dtype=F64)))
    assert effective_parameters(blocks, 0.4, T) == pytest.approx(float(gamma), rel=1e-10)


def test_bad_precisions_and_temperatures_are_refused():
    _, _, _, blocks, _, _ = _setup("diag")
    with pytest.raises(FlatbmaError, match="positive and finite"):
        blocks.logdet(-1.0, 1.0)
    with pytest.raises(FlatbmaError, match="no value for block"):
        blocks.logdet({"5.weight": 1.0}, 1.0)
    with pytest.raises(FlatbmaError, match="temperature must be a positive number"):
        blocks.marginal_variance(1.0, 0.0)


@pytest.mark.slow
def test_empirical_covariance_of_samples_matches_p_inverse():
    torch.manual_seed(8)
    model = nn.Linear(3, 3).to(F64)
    params = params_of(model)
    x, y = torch.randn(10, 3, dtype=F64), torch.randint(0, 3, (10,))
    est = estimator("kfac", "ggn", model, params, num_data=10, num_classes=3)
    acc = est.accumulate(est.init(), params, {}, x, y, offset=0)
    blocks = est.blocks(acc, 10, 10)
    cov = torch.linalg.inv(_dense_h(est, params, acc, 1.0, 10) + 0.5 * torch.eye(12, dtype=F64))
    draws = torch.stack([flat(s) for s in blocks.sample(20000, 0.5, 1.0, torch.Generator().manual_seed(0))])
    emp = draws.mT @ draws / draws.shape[0]
    se = ((cov.diagonal()[:, None] * cov.diagonal()[None, :] + cov.square()) / draws.shape[0]).sqrt()
    assert ((emp - cov).abs() <= 4 * se).all()
