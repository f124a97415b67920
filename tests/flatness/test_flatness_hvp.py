import pytest
import torch
from torch import nn

from flatbma.flatness import HVPMethod, hvp_fn
from tests.flatness.problems import make_problem

METHODS = ["double_backward", "func"]


def _vectors(d, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(d, generator=g, dtype=torch.float64) for _ in range(n)]


@pytest.mark.parametrize("method", METHODS)
def test_hvp_equals_dense_hessian_times_v_over_unequal_batches(problem, method):
    H = problem.dense_hessian()
    op = hvp_fn(problem.model, problem.batches, hvp=method)
    assert op.dim == H.shape[0] == 219
    for v in _vectors(op.dim):
        torch.testing.assert_close(op(v), H @ v, rtol=1e-10, atol=1e-12)
    assert op.num_products == 3


@pytest.mark.parametrize("method", METHODS)
def test_batch_accumulation_equals_full_batch(problem, method):
    # one (x, y) batch takes the cached-graph path for double backward; three batches do not
    full = hvp_fn(problem.model, (problem.x, problem.y), hvp=method)
    parts = hvp_fn(problem.model, problem.batches, hvp=method)
    for v in _vectors(full.dim):
        torch.testing.assert_close(parts(v), full(v), rtol=1e-10, atol=1e-12)


def test_both_implementations_agree_in_float32():
    p = make_problem(torch.float32)
    a = hvp_fn(p.model, p.batches, hvp=HVPMethod.DOUBLE_BACKWARD)
    b = hvp_fn(p.model, iter(p.batches), hvp="func")  # a one-shot iterator is read once
    for v in _vectors(a.dim):
        hv = a(v)
        assert hv.dtype == torch.float64  # returned in the dtype of v
        torch.testing.assert_close(b(v), hv, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(b(v), hv, rtol=1e-4, atol=1e-6)  # iterated again


def test_eval_mode_is_used_and_restored_and_buffers_untouched(problem):
    bn = problem.model[3]
    stats = (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
    op = hvp_fn(problem.model, problem.batches)
    v = _vectors(op.dim, 1)[0]
    hv = op(v)
    assert problem.model.training
    torch.testing.assert_close(hv, problem.dense_hessian() @ v)  # the reference uses eval mode
    for before, after in zip(stats, (bn.running_mean, bn.running_var, bn.num_batches_tracked)):
        assert torch.equal(before, after)


@pytest.mark.parametrize("method", METHODS)
def test_subset_by_names_gives_the_hessian_block(problem, method):
    names = ["2.weight", "5.bias"]
    H = problem.dense_hessian()
    full = dict(problem.model.named_parameters())
    sizes = [v.numel() for v in full.values()]
    offsets = dict(zip(full, torch.tensor([0, *sizes[:-1]]).cumsum(0).tolist()))
    idx = torch.cat([torch.arange(offsets[k], offsets[k] + full[k].numel()) for k in names])
    block = H[idx][:, idx]
    op = hvp_fn(problem.model, problem.batches, params=names, hvp=method)
    assert list(op.point) == names and op.dim == idx.numel()
    for v in _vectors(op.dim):
        torch.testing.assert_close(op(v), block @ v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(problem.dense_hessian(names=names), block)


def test_weights_dict_with_buffers_is_the_evaluation_point(problem):
    # a posterior sample: parameters and buffers by module name, different from the model's own
    g = torch.Generator().manual_seed(3)
    sample = {
        k: v.detach() + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype)
        for k, v in problem.model.named_parameters()
    }
    sample["3.running_mean"] = torch.full((8,), 0.2, dtype=torch.float64)
    sample["3.running_var"] = torch.full((8,), 1.7, dtype=torch.float64)
    sample["3.num_batches_tracked"] = torch.tensor(5)
    H = problem.dense_hessian(weights=sample)
    op = hvp_fn(problem.model, problem.batches, weights=sample)
    v = _vectors(op.dim, 1)[0]
    torch.testing.assert_close(op(v), H @ v, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(H, problem.dense_hessian())
    # a params dict is the point itself and overrides weights
    sub = {"5.weight": sample["5.weight"] * 2}
    op = hvp_fn(problem.model, problem.batches, params=sub, weights=sample)
    Hs = problem.dense_hessian(names=["5.weight"], weights={**sample, **sub})
    v = _vectors(op.dim, 1)[0]
    torch.testing.assert_close(op(v), Hs @ v, rtol=1e-10, atol=1e-12)


def test_frozen_parameters_are_left_out_by_default():
    p = make_problem()
    for q in p.model[0].parameters():
        q.requires_grad_(False)
    op = hvp_fn(p.model, p.batches)
    assert "0.weight" not in op.point and op.dim == 219 - 72


def test_unflatten_round_trip(problem):
    op = hvp_fn(problem.model, problem.batches, params=["0.bias", "5.weight"])
    v = torch.arange(op.dim, dtype=torch.float64)
    parts = op.unflatten(v)
    assert parts["0.bias"].shape == (12,) and parts["5.weight"].shape == (3, 8)
    assert torch.equal(op.flatten(parts), v)


def test_dataloader_input(problem):
    ds = torch.utils.data.TensorDataset(problem.x, problem.y)
    loader = torch.utils.data.DataLoader(ds, batch_size=16)  # batches 16, 16, 8
    op = hvp_fn(problem.model, loader, hvp="func")
    v = _vectors(op.dim, 1)[0]
    torch.testing.assert_close(op(v), problem.dense_hessian() @ v, rtol=1e-10, atol=1e-12)


def test_module_with_unused_parameter_warns():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(3, 2)
            self.unused = nn.Linear(3, 2)

        def forward(self, x):
            return self.used(x)

    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    with pytest.warns(UserWarning, match="does not depend on 2 chosen"):
        hvp_fn(Net(), (x, y))


@pytest.mark.parametrize("method", METHODS)
def test_products_under_no_grad(problem, method):
    v = _vectors(219, 1)[0]
    expected = problem.dense_hessian() @ v
    with torch.no_grad():
        op = hvp_fn(problem.model, problem.batches, hvp=method)
        torch.testing.assert_close(op(v), expected, rtol=1e-10, atol=1e-12)


def test_frozen_convolutions_and_eval_batch_norms_give_the_same_products_and_are_restored():
    """Strided, dilated, grouped frozen convolutions (odd sizes) and eval-mode BatchNorm (with and without
    affine parameters) go through the lean second-order graph; PyTorch's forward-over-reverse is the reference."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.Tanh(),
        nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=8, bias=False),
        nn.BatchNorm2d(8, affine=False),
        nn.Tanh(),
        nn.Conv2d(8, 4, 1, stride=2, padding="valid"),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 3),
    ).double()
    with torch.no_grad():
        for bn in (model[1], model[4]):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    model.train()  # the operator evaluates in eval mode and restores the mode
    x = torch.randn(6, 3, 11, 9, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    names = [n for n, _ in model.named_parameters() if n.split(".")[0] in ("1", "9")]
    op = hvp_fn(model, (x, y), params=names)  # cached graph (one batch)
    parts = hvp_fn(model, [(x[:4], y[:4]), (x[4:], y[4:])], params=names)  # graph per product
    reference = hvp_fn(model, (x, y), params=names, hvp="func")  # forward-over-reverse: PyTorch's own ops
    assert len(op._frozen_convs) == 3 and len(op._batch_norms) == 2
    for v in _vectors(op.dim):
        torch.testing.assert_close(op(v), reference(v), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(parts(v), reference(v), rtol=1e-10, atol=1e-12)
    assert not any("_conv_forward" in vars(m) or "forward" in vars(m) for m in model.modules())
    assert model.training and model[1].training
    # a trained convolution keeps PyTorch's backward
    trained = hvp_fn(model, (x, y), params=["0.weight", "1.weight"])
    assert model[0] not in trained._frozen_convs and len(trained._frozen_convs) == 2


class _Dicts(torch.utils.data.Dataset):
    """``(x, y)`` rows as dicts under ``keys`` (what a Hugging Face style dataset yields)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, keys: tuple[str, str]) -> None:
        self.x, self.y, self.keys = x, y, keys

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {self.keys[0]: self.x[i], self.keys[1]: self.y[i], "id": torch.tensor(i)}


def test_dict_batches_measure_as_the_same_pairs():
    """λ₁, the trace, SAM sharpness and the loss along a direction read dict batches as training does."""
    from torch.utils.data import DataLoader, TensorDataset

    from flatbma.errors import FlatbmaError
    from flatbma.flatness import hessian_eigenvalues, hessian_trace, loss_along, sam_sharpness

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 5, generator=g), torch.randint(0, 3, (40,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    pairs = DataLoader(TensorDataset(x, y), batch_size=16)
    weights = dict(model.named_parameters())
    direction = {k: torch.ones_like(v) for k, v in weights.items()}
    want = hessian_eigenvalues(model, pairs, k=2, seed=3)
    for keys in (("x", "y"), ("image", "label"), ("pixel_values", "labels")):
        dicts = DataLoader(_Dicts(x, y, keys), batch_size=16)
        assert torch.equal(hessian_eigenvalues(model, dicts, k=2, seed=3), want), keys
    dicts = DataLoader(_Dicts(x, y, ("x", "y")), batch_size=16)
    assert (
        hessian_trace(model, dicts, num_samples=4, seed=1).trace
        == hessian_trace(model, pairs, num_samples=4, seed=1).trace
    )
    assert torch.equal(sam_sharpness(model, [weights], dicts), sam_sharpness(model, [weights], pairs))
    alphas = [-0.1, 0.0, 0.1]
    assert torch.equal(
        loss_along(model, dicts, None, direction, alphas), loss_along(model, pairs, None, direction, alphas)
    )
    one = {"x": x, "y": y}  # one dict batch, as one (x, y) batch
    assert torch.equal(hessian_eigenvalues(model, one, k=2, seed=3), hessian_eigenvalues(model, (x, y), k=2, seed=3))
    with pytest.raises(FlatbmaError, match="must hold its targets under one of the keys y, label"):
        hessian_eigenvalues(model, [{"x": x}])
