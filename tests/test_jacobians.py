"""flatbma.jacobians against per-example loops of torch.autograd and the explicit cross-entropy Hessian."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call

from flatbma.jacobians import ce_gradient, ce_sqrt_hessian, jacobian, rows
from tests.curvature.reference import buffers_of, ce_hessian, images, params_of, tiny_cnn


def _fn(model, buffers):
    return lambda p, x: functional_call(model, {**buffers, **p}, (x,))


def test_rows_equal_a_loop_of_vector_jacobian_products():
    model = tiny_cnn()
    params, buffers = params_of(model), buffers_of(model)
    x, _ = images(5)
    g = torch.Generator().manual_seed(3)
    cot = torch.randn(5, 2, 3, generator=g, dtype=torch.float64)
    out = rows(_fn(model, buffers), params, x, cot, chunk=2)
    for i in range(5):
        for k in range(2):
            leaves = {n: v.clone().requires_grad_(True) for n, v in params.items()}
            f = functional_call(model, {**buffers, **leaves}, (x[i : i + 1],))[0]
            grads = torch.autograd.grad(f @ cot[i, k], list(leaves.values()))
            for n, grad in zip(leaves, grads, strict=True):
                torch.testing.assert_close(out[n][i, k], grad, rtol=0, atol=1e-12)


def test_jacobian_equals_jacrev_per_example():
    model = tiny_cnn()
    params, buffers = params_of(model), buffers_of(model)
    x, _ = images(3)
    jac = jacobian(_fn(model, buffers), params, x)
    for i in range(3):
        ref = torch.func.jacrev(lambda p, xi=x[i]: functional_call(model, {**buffers, **p}, (xi[None],))[0])(params)
        for n in params:
            assert jac[n].shape == (3, 3, *params[n].shape)
            torch.testing.assert_close(jac[n][i], ref[n], rtol=0, atol=1e-12)


def test_ce_sqrt_hessian_factors_the_softmax_hessian():
    logits = torch.randn(6, 5, dtype=torch.float64) * 3
    root = ce_sqrt_hessian(logits)
    torch.testing.assert_close(root @ root.mT, ce_hessian(logits), rtol=0, atol=1e-15)


def test_ce_gradient_is_the_gradient_of_the_summed_cross_entropy():
    logits = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 5, (6,))
    (grad,) = torch.autograd.grad(F.cross_entropy(logits, y, reduction="sum"), logits)
    torch.testing.assert_close(ce_gradient(logits, y), grad, rtol=0, atol=1e-15)
