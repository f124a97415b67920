"""Curvature estimators against dense references: diagonal, empirical Fisher, full (primal and dual).

References come from ``torch.func.jacrev`` and an explicit ``Λ = diag p − ppᵀ`` (tests/curvature/reference.py),
``torch.autograd.functional.hessian`` of the summed loss, and flatbma.flatness's Hessian-vector products.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from flatbma.curvature import DiagBlock, estimator
from flatbma.errors import FlatbmaError
from tests.curvature.reference import (
    block_slices,
    buffers_of,
    dense_ggn,
    flat,
    images,
    params_of,
    per_example_grads,
    per_example_jacobians,
    tiny_cnn,
)

F64 = torch.float64


def _run(est, params, buffers, x, y, splits=(None,)):
    acc = est.init()
    start = 0
    for stop in (*splits[:-1], x.shape[0]) if splits != (None,) else (x.shape[0],):
        acc = est.accumulate(acc, params, buffers, x[start:stop], y[start:stop], offset=start)
        start = stop
    return acc


def test_diag_ggn_is_the_diagonal_of_the_dense_ggn():
    model = tiny_cnn()
    params, buffers = params_of(model), buffers_of(model)
    x, y = images(6)
    est = estimator("diag", "ggn", model, params, num_data=6, num_classes=3, chunk=4)
    acc = _run(est, params, buffers, x, y)
    dense = dense_ggn(model, params, buffers, x)
    torch.testing.assert_close(flat({n: acc[f"diag/{n}"] for n in params}), dense.diagonal(), rtol=1e-10, atol=1e-14)


def test_diag_ef_is_the_sum_of_squared_per_example_gradients():
    model = tiny_cnn()
    params, buffers = params_of(model), buffers_of(model)
    x, y = images(6)
    est = estimator("diag", "ef", model, params, num_data=6, num_classes=3)
    acc = _run(est, params, buffers, x, y)
    grads = per_example_grads(model, params, buffers, x, y)
    torch.testing.assert_close(flat({n: acc[f"diag/{n}"] for n in params}), grads.square().sum(0), rtol=0, atol=1e-12)


def _softmax_regression(features=4, classes=3, n=8):
    torch.manual_seed(2)
    model = nn.Linear(features, classes).to(F64)
    x = torch.randn(n, features, dtype=F64)
    y = torch.randint(0, classes, (n,))
    return model, x, y


def test_full_ggn_of_a_model_linear_in_its_parameters_is_the_exact_hessian():
    model, x, y = _softmax_regression()
    params = params_of(model)
    est = estimator("full", "ggn", model, params, num_data=8, num_classes=3)
    assert est.form == "full"
    acc = _run(est, params, {}, x, y, splits=(3, 5, None))
    names = sorted(params)
    shapes = [params[n].shape for n in names]

    def loss(vec):
        p = dict(
            zip(names, (piece.view(s) for piece, s in zip(vec.split([s.numel() for s in shapes]), shapes)), strict=True)
        )
        return F.cross_entropy(functional_call(model, p, (x,)), y, reduction="sum")

    exact = torch.autograd.functional.hessian(loss, flat(params))
    torch.testing.assert_close(acc["full"], exact, rtol=1e-10, atol=1e-13)


def test_full_ggn_of_a_tanh_mlp_is_j_lambda_j():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).to(F64)
    params = params_of(model)
    x, y = torch.randn(7, 3, dtype=F64), torch.randint(0, 3, (7,))
    est = estimator("full", "ggn", model, params, num_data=7, num_classes=3)
    acc = _run(est, params, {}, x, y)
    ggn = dense_ggn(model, params, {}, x)
    torch.testing.assert_close(acc["full"], ggn, rtol=1e-10, atol=1e-13)
    names = sorted(params)
    shapes = [params[n].shape for n in names]

    def loss(vec):
        pieces = vec.split([s.numel() for s in shapes])
        p = {n: piece.view(s) for n, piece, s in zip(names, pieces, shapes, strict=True)}
        return F.cross_entropy(functional_call(model, p, (x,)), y, reduction="sum")

    exact = torch.autograd.functional.hessian(loss, flat(params))
    print(f"tanh MLP: ‖GGN − Hessian‖ / ‖Hessian‖ = {float((ggn - exact).norm() / exact.norm()):.3f} (reported only)")


def test_full_ef_is_the_sum_of_per_example_gradient_outer_products():
    model = tiny_cnn()
    params, buffers = params_of(model), buffers_of(model)
    x, y = images(5)
    est = estimator("full", "ef", model, params, num_data=5, num_classes=3)
    acc = _run(est, params, buffers, x, y, splits=(2, None))
    grads = per_example_grads(model, params, buffers, x, y)
    torch.testing.assert_close(acc["full"], grads.mT @ grads, rtol=0, atol=1e-12)


def test_full_ggn_matches_the_flatness_hessian_operator_on_a_linear_model():
    from flatbma.flatness import hvp_fn

    model, x, y = _softmax_regression()
    model = model.float()
    params = params_of(model)
    est = estimator("full", "ggn", model, params, num_data=8, num_classes=3)
    acc = _run(est, params, {}, x.float(), y)
    op = hvp_fn(model, (x.float(), y))
    v = torch.randn(op.dim, dtype=torch.float32)
    names = list(op.point)
    # the operator's flat order is the model's; ours is sorted by name
    perm = torch.cat([torch.arange(s.start, s.stop) for s in (block_slices(params)[n] for n in names)])
    ours = (acc["full"][perm][:, perm] @ v.double()).float()
    torch.testing.assert_close(ours, 8 * op(v), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("hessian", ["diag", "kfac", "full-primal", "full-dual"])
def test_one_batch_equals_three_uneven_batches(hessian):
    model = tiny_cnn()
    params, buffers = params_of(model), buffers_of(model)
    x, y = images(7)
    kind, max_full = (hessian, 4096) if "full" not in hessian else ("full", 4096 if hessian == "full-primal" else 21)
    est = estimator(kind, "ggn", model, params, num_data=7, num_classes=3, max_full=max_full)
    assert est.form == {"full-primal": "full", "full-dual": "dual"}.get(hessian, hessian)
    one = _run(est, params, buffers, x, y)
    three = _run(est, params, buffers, x, y, splits=(1, 4, None))
    assert list(one) == list(three) == sorted(one)
    for k in one:
        assert one[k].dtype == torch.float64
        torch.testing.assert_close(one[k], three[k], rtol=0, atol=1e-12)


def test_fewer_examples_seen_than_data_rescale_to_the_data_size():
    model = tiny_cnn()
    params, buffers = params_of(model), buffers_of(model)
    x, y = images(6)
    est = estimator("diag", "ggn", model, params, num_data=10, num_classes=3)
    acc = _run(est, params, buffers, x, y)
    blocks = est.blocks(acc, n_seen=6, num_data=10)
    for n in params:
        block = blocks.block(n)
        assert isinstance(block, DiagBlock)
        torch.testing.assert_close(block.h, acc[f"diag/{n}"] * 10 / 6, rtol=1e-15, atol=0)
    kfac = estimator("kfac", "ggn", model, params, num_data=10, num_classes=3)
    acc = _run(kfac, params, buffers, x, y)
    kron = kfac.blocks(acc, n_seen=6, num_data=10).block("5.weight")
    a = acc["kfac/A/5.weight"] / 6
    b = acc["kfac/B/5.weight"] * 10 / 6
    rebuilt = torch.kron(kron.u_b @ torch.diag(kron.b) @ kron.u_b.mT, kron.u_a @ torch.diag(kron.a) @ kron.u_a.mT)
    torch.testing.assert_close(rebuilt, torch.kron(b, a), rtol=0, atol=1e-12)


def test_reduce_is_applied_to_the_mean_increment_and_weighted_by_the_batch_size():
    model = tiny_cnn()
    params, buffers = params_of(model), buffers_of(model)
    x, y = images(4)
    est = estimator("kfac", "ggn", model, params, num_data=4, num_classes=3)
    plain = _run(est, params, buffers, x, y)
    seen = []

    def reduce(tensors):
        seen.append({k: v.clone() for k, v in tensors.items()})
        return {k: 2 * v for k, v in tensors.items()}

    doubled = est.accumulate(est.init(), params, buffers, x, y, offset=0, reduce=reduce)
    for k in plain:
        torch.testing.assert_close(seen[0][k], plain[k] / 4, rtol=1e-15, atol=0)
        torch.testing.assert_close(doubled[k], 2 * plain[k], rtol=1e-15, atol=0)


def test_dual_rows_sit_in_their_examples_slots_and_refuse_data_parallelism():
    model, x, y = _softmax_regression(features=6, classes=3, n=4)
    params = params_of(model)
    est = estimator("full", "ggn", model, params, num_data=4, num_classes=3, max_full=12)
    assert est.form == "dual" and not est.data_parallel and not est.blockwise
    acc = est.accumulate(est.init(), params, {}, x[2:3], y[2:3], offset=2)
    assert acc["rows"][:6].abs().max() == 0 and acc["rows"][9:].abs().max() == 0
    jac = per_example_jacobians(model, params, {}, x[2:3])[0]
    p = F.softmax(model(x[2:3]), -1)[0]
    lam = torch.diag(p) - torch.outer(p, p)
    torch.testing.assert_close(acc["rows"][6:9].mT @ acc["rows"][6:9], jac.mT @ lam @ jac, rtol=1e-12, atol=1e-14)
    with pytest.raises(FlatbmaError, match=r"train\.parallel: data"):
        est.accumulate(acc, params, {}, x, y, offset=0, reduce=lambda t: t)
    with pytest.raises(FlatbmaError, match="num_data"):
        est.accumulate(acc, params, {}, x, y, offset=1)


def test_bad_requests_are_refused_in_one_line():
    model = tiny_cnn()
    params = params_of(model)
    cases = [
        (dict(hessian="full", max_full=10), "hessian: kfac or diag"),
        (dict(hessian="ful"), "Did you mean 'full'"),
        (dict(hessian="diag", curvature="fisher"), "curvature must be one of"),
        (dict(hessian="diag", num_data=0), "num_data must be a positive integer"),
        (dict(hessian="diag", params={"nope": torch.zeros(1)}), "no parameter 'nope'"),
    ]
    for kwargs, match in cases:
        args = dict(hessian="diag", curvature="ggn", params=params, num_data=5, num_classes=3, max_full=4096) | kwargs
        with pytest.raises(FlatbmaError, match=match) as err:
            estimator(args.pop("hessian"), args.pop("curvature"), model, args.pop("params"), **args)
        assert "\n" not in str(err.value)
    est = estimator("diag", "ggn", model, params, num_data=5, num_classes=3)
    with pytest.raises(FlatbmaError, match="0 examples seen"):
        est.blocks(est.init(), 0, 5)
    with pytest.raises(FlatbmaError, match=r"logits \[batch, 4\]"):
        estimator("diag", "ggn", model, params, num_data=5, num_classes=4).accumulate(
            est.init(), params, buffers_of(model), *images(2), offset=0
        )


def test_float32_parameters_accumulate_in_float64_and_rows_keep_their_dtype():
    model, x, y = _softmax_regression()
    model = model.float()
    params = params_of(model)
    diag = estimator("diag", "ggn", model, params, num_data=8, num_classes=3)
    assert all(v.dtype == F64 for v in diag.init().values())
    dual = estimator("full", "ggn", model, params, num_data=2, num_classes=3, max_full=6)
    assert dual.init()["rows"].dtype == torch.float32
    blocks = diag.blocks(_run(diag, params, {}, x.float(), y), 8, 8)
    assert blocks.sample(1, 1.0, 1.0, None)[0]["weight"].dtype == torch.float32
    assert blocks.marginal_variance(1.0, 1.0)["weight"].dtype == torch.float32
