"""KFAC factors against brute force (hand-written sums, patches by explicit loops) and the dense GGN where exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatbma.curvature import DiagBlock, KronBlock, estimator, squared_error
from flatbma.errors import FlatbmaError
from flatbma.jacobians import ce_sqrt_hessian
from tests.curvature.reference import block_slices, buffers_of, dense_ggn, params_of

F64 = torch.float64


def _kron(est, acc, name, n_seen, n):
    return torch.kron(acc[f"kfac/B/{name}"] * n / n_seen, acc[f"kfac/A/{name}"] / n_seen)


def test_linear_factors_equal_the_hand_written_sums():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(F64)
    params = params_of(model)
    x, y = torch.randn(6, 4, dtype=F64), torch.randint(0, 3, (6,))
    est = estimator("kfac", "ggn", model, params, num_data=6, num_classes=3)
    acc = est.accumulate(est.init(), params, {}, x, y, offset=0)
    assert set(acc) == {
        "kfac/A/0.weight",
        "kfac/B/0.weight",
        "dense/0.bias",
        "kfac/A/2.weight",
        "kfac/B/2.weight",
        "dense/2.bias",
    }
    with torch.no_grad():
        o = model[0](x)
        h = torch.tanh(o)
        s = ce_sqrt_hessian(model[2](h)).mT  # [n, K, C]: s_ik
    b2 = s  # ∂(sᵀf)/∂o₂ = s
    b0 = torch.einsum("nkc,cj,nj->nkj", s, model[2].weight.detach(), 1 - h.square())  # diag(1−tanh²) W₂ᵀ s
    torch.testing.assert_close(acc["kfac/A/0.weight"], x.mT @ x, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(acc["kfac/A/2.weight"], h.mT @ h, rtol=1e-12, atol=1e-14)
    for name, b in (("0", b0), ("2", b2)):
        bb = b.reshape(-1, b.shape[-1])
        torch.testing.assert_close(acc[f"kfac/B/{name}.weight"], bb.mT @ bb, rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(acc[f"dense/{name}.bias"], bb.mT @ bb, rtol=1e-10, atol=1e-14)


def test_ef_factor_of_the_last_layer_is_the_sum_of_gradient_outer_products():
    torch.manual_seed(1)
    model = nn.Linear(4, 3).to(F64)
    params = params_of(model)
    x, y = torch.randn(5, 4, dtype=F64), torch.randint(0, 3, (5,))
    est = estimator("kfac", "ef", model, params, num_data=5, num_classes=3)
    acc = est.accumulate(est.init(), params, {}, x, y, offset=0)
    g = F.softmax(model(x), -1).detach() - F.one_hot(y, 3).to(F64)
    torch.testing.assert_close(acc["kfac/B/weight"], g.mT @ g, rtol=1e-12, atol=1e-15)


def _patches_by_loops(x, kernel, stride, padding, dilation, out_hw):
    """``[n, T, C_in·k_h·k_w]`` patches, rows in the order of ``W.reshape(C_out, −1)``."""
    n, c_in, h, w = x.shape
    rows = torch.zeros(n, out_hw[0] * out_hw[1], c_in * kernel[0] * kernel[1], dtype=x.dtype)
    for oh in range(out_hw[0]):
        for ow in range(out_hw[1]):
            t = oh * out_hw[1] + ow
            col = 0
            for c in range(c_in):
                for kh in range(kernel[0]):
                    for kw in range(kernel[1]):
                        ih = oh * stride[0] - padding[0] + kh * dilation[0]
                        iw = ow * stride[1] - padding[1] + kw * dilation[1]
                        if 0 <= ih < h and 0 <= iw < w:
                            rows[:, t, col] = x[:, c, ih, iw]
                        col += 1
    return rows


def test_conv_factors_with_stride_padding_and_dilation_equal_brute_force():
    torch.manual_seed(2)
    conv = nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=(2, 1), dilation=(2, 1))
    post = nn.Sequential(nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 8, 3))
    model = nn.Sequential(conv, *post).to(F64)
    params = params_of(model)
    x, y = torch.randn(3, 2, 7, 7, dtype=F64), torch.randint(0, 3, (3,))
    est = estimator("kfac", "ggn", model, params, num_data=3, num_classes=3)
    acc = est.accumulate(est.init(), params, {}, x, y, offset=0)
    with torch.no_grad():
        o = model[0](x)
    assert o.shape[-2:] == (4, 8)
    patches = _patches_by_loops(x, (3, 2), (2, 1), (2, 1), (2, 1), (4, 8))
    a_ref = torch.einsum("nti,ntj->ij", patches, patches) / patches.shape[1]
    torch.testing.assert_close(acc["kfac/A/0.weight"], a_ref, rtol=1e-12, atol=1e-13)
    tail = nn.Sequential(*list(model)[1:])
    b_ref = torch.zeros(3, 3, dtype=F64)
    bias_ref = torch.zeros(3, 3, dtype=F64)
    for i in range(3):
        jac = torch.autograd.functional.jacobian(lambda oi: tail(oi[None])[0], o[i])  # [C, C_out, H, W]
        root = ce_sqrt_hessian(tail(o[i : i + 1]).detach())[0]
        b = torch.einsum("ck,cohw->kohw", root, jac).reshape(3, 3, -1)  # [K, C_out, T]
        b_ref += torch.einsum("kot,kpt->op", b, b)
        bias_ref += torch.einsum("ko,kp->op", b.sum(-1), b.sum(-1))
    torch.testing.assert_close(acc["kfac/B/0.weight"], b_ref, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(acc["dense/0.bias"], bias_ref, rtol=1e-10, atol=1e-13)


def _ggn_block(model, params, x, name, hessian=None):
    kwargs = {} if hessian is None else {"hessian": hessian}
    sl = block_slices(params)[name]
    return dense_ggn(model, params, {}, x, **kwargs)[sl, sl]


def test_kron_is_the_ggn_block_of_linear_layers_for_one_example():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(F64)
    params = params_of(model)
    x, y = torch.randn(1, 4, dtype=F64), torch.randint(0, 3, (1,))
    est = estimator("kfac", "ggn", model, params, num_data=1, num_classes=3)
    acc = est.accumulate(est.init(), params, {}, x, y, offset=0)
    for name in ("0.weight", "2.weight"):
        torch.testing.assert_close(_kron(est, acc, name, 1, 1), _ggn_block(model, params, x, name), rtol=0, atol=1e-12)
    torch.testing.assert_close(acc["dense/0.bias"], _ggn_block(model, params, x, "0.bias"), rtol=0, atol=1e-12)


def test_kron_is_the_ggn_block_of_a_conv_with_one_location_and_one_example():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3, 3)).to(F64)
    params = params_of(model)
    x, y = torch.randn(1, 2, 3, 3, dtype=F64), torch.randint(0, 3, (1,))
    est = estimator("kfac", "ggn", model, params, num_data=1, num_classes=3)
    acc = est.accumulate(est.init(), params, {}, x, y, offset=0)
    torch.testing.assert_close(
        _kron(est, acc, "0.weight", 1, 1), _ggn_block(model, params, x, "0.weight"), rtol=0, atol=1e-12
    )


def test_kron_is_exact_for_every_layer_of_a_deep_linear_net_under_squared_error():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 5, bias=False), nn.Linear(5, 3, bias=False), nn.Linear(3, 2, bias=False)).to(F64)
    params = params_of(model)
    x, y = torch.randn(7, 4, dtype=F64), torch.randn(7, 2, dtype=F64)
    est = estimator("kfac", "ggn", model, params, num_data=7, num_classes=2, likelihood=squared_error())
    acc = est.accumulate(est.init(), params, {}, x[:3], y[:3], offset=0)
    acc = est.accumulate(acc, params, {}, x[3:], y[3:], offset=3)
    identity = lambda logits: torch.eye(2, dtype=F64).expand(logits.shape[0], 2, 2)  # noqa: E731
    dense = dense_ggn(model, params, {}, x, hessian=identity)
    for name, sl in block_slices(params).items():
        torch.testing.assert_close(_kron(est, acc, name, 7, 7), dense[sl, sl], rtol=0, atol=1e-12)
    blocks = est.blocks(acc, 7, 7)
    kron = blocks.block("1.weight")
    assert isinstance(kron, KronBlock)
    sl = block_slices(params)["1.weight"]
    torch.testing.assert_close(
        torch.sort(kron.eigenvalues()).values, torch.linalg.eigvalsh(dense[sl, sl]), rtol=0, atol=1e-10
    )


def test_grouped_convolutions_fall_back_to_the_exact_diagonal_and_say_so():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Conv2d(2, 2, 3, groups=2), nn.Flatten(), nn.Linear(2 * 3 * 3, 3)).to(F64)
    params = params_of(model)
    x, y = torch.randn(4, 2, 5, 5, dtype=F64), torch.randint(0, 3, (4,))
    est = estimator("kfac", "ggn", model, params, num_data=4, num_classes=3)
    assert "0 (groups=2)" in est.describe() and "diagonal" in est.describe()
    acc = est.accumulate(est.init(), params, {}, x, y, offset=0)
    diag = estimator("diag", "ggn", model, params, num_data=4, num_classes=3)
    ref = diag.accumulate(diag.init(), params, {}, x, y, offset=0)
    for name in ("0.weight", "0.bias"):
        torch.testing.assert_close(acc[f"diag/{name}"], ref[f"diag/{name}"], rtol=1e-12, atol=0)
        assert isinstance(est.blocks(acc, 4, 4).block(name), DiagBlock)


def test_norm_parameters_get_the_exact_diagonal_beside_kronecker_blocks():
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).to(F64).eval()
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].weight.normal_()
    params, buffers = params_of(model), buffers_of(model)
    x, y = torch.randn(6, 4, dtype=F64), torch.randint(0, 3, (6,))
    est = estimator("kfac", "ggn", model, params, num_data=6, num_classes=3)
    assert est.diagonal == ("1.bias", "1.weight")
    acc = est.accumulate(est.init(), params, buffers, x, y, offset=0)
    dense = dense_ggn(model, params, buffers, x)
    for name in est.diagonal:
        sl = block_slices(params)[name]
        torch.testing.assert_close(acc[f"diag/{name}"], dense[sl, sl].diagonal(), rtol=1e-10, atol=1e-14)


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def test_a_layer_called_twice_is_refused():
    model = _Twice().to(F64)
    params = params_of(model)
    est = estimator("kfac", "ggn", model, params, num_data=2, num_classes=3)
    with pytest.raises(FlatbmaError, match="'lin' was called 2 times"):
        est.accumulate(est.init(), params, {}, torch.randn(2, 3, dtype=F64), torch.tensor([0, 1]), offset=0)
