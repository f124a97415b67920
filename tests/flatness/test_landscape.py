import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from flatbma.bn import eval_mode
from flatbma.errors import FlatbmaError
from flatbma.flatness import (
    loss_along,
    loss_along_samples,
    loss_surface,
    plot_landscape_1d,
    plot_landscape_2d,
    posterior_landscape,
    random_direction,
    top_eigen_direction,
)
from flatbma.params import flatten
from tests.flatness.problems import make_problem, quadratic_problem

SPECTRUM = [7.0, 3.0, 2.0, 1.0, 0.5, -1.0, 0.25, 0.1]
ALPHAS = torch.linspace(-1.5, 1.5, 13, dtype=torch.float64)


def _quadratic(w, a):
    return 0.5 * w @ a @ w


def test_curve_along_top_eigenvector_of_a_quadratic_is_the_parabola():
    model, loss_fn, batch, a = quadratic_problem(SPECTRUM, seed=3)
    lam1, direction = top_eigen_direction(model, batch, loss_fn=loss_fn, tol=1e-12)
    assert lam1 == pytest.approx(7.0, rel=1e-10)
    v = flatten(direction)
    assert float(v.norm()) == pytest.approx(1.0, rel=1e-12)
    evals, evecs = torch.linalg.eigh(a)
    assert float((v @ evecs[:, -1]).abs()) == pytest.approx(1.0, abs=1e-10)
    assert v[v.abs().argmax()] > 0  # the sign convention

    # at the minimum w = 0: f(α) = ½ λ₁ α² exactly
    at_min = loss_along(model, batch, {"w": torch.zeros_like(model.w)}, direction, ALPHAS, loss_fn=loss_fn)
    torch.testing.assert_close(at_min, 0.5 * 7.0 * ALPHAS**2, rtol=1e-12, atol=1e-12)

    # anywhere: f(α) = L(w) + α λ₁ vᵀw + ½ λ₁ α²
    w = model.w.detach()
    curve = loss_along(model, batch, None, direction, ALPHAS, loss_fn=loss_fn)
    expected = _quadratic(w, a) + ALPHAS * 7.0 * (v @ w) + 0.5 * 7.0 * ALPHAS**2
    torch.testing.assert_close(curve, expected, rtol=1e-10, atol=1e-12)
    assert curve.dtype == torch.float64 and curve.shape == ALPHAS.shape


def test_top_eigen_direction_of_an_mlp_matches_the_dense_hessian(problem):
    lam1, direction = top_eigen_direction(problem.model, problem.batches, tol=1e-10, max_iter=219)
    evals, evecs = torch.linalg.eigh(problem.dense_hessian())
    assert lam1 == pytest.approx(float(evals[-1]), rel=1e-8)
    assert float((flatten(direction) @ evecs[:, -1]).abs()) == pytest.approx(1.0, abs=1e-6)
    assert list(direction) == [k for k, _ in problem.model.named_parameters()]


def test_surface_of_a_quadratic_equals_the_quadratic_form():
    model, loss_fn, batch, a = quadratic_problem(SPECTRUM, seed=1)
    d1 = random_direction(model, seed=1, filter_normalized=False)
    d2 = random_direction(model, seed=2, filter_normalized=False)
    betas = torch.linspace(-1.0, 2.0, 7, dtype=torch.float64)
    surface = loss_surface(model, batch, None, d1, d2, ALPHAS, betas, loss_fn=loss_fn)
    assert surface.shape == (len(ALPHAS), len(betas))
    w = model.w.detach()
    for i, al in enumerate(ALPHAS):
        for j, be in enumerate(betas):
            p = w + al * d1["w"] + be * d2["w"]
            assert float(surface[i, j]) == pytest.approx(float(_quadratic(p, a)), rel=1e-12, abs=1e-12)
    # the slice β = 0 is the 1-D curve along d1
    torch.testing.assert_close(surface[:, 2], loss_along(model, batch, None, d1, ALPHAS, loss_fn=loss_fn))


def _conv_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3, bias=True)
    )


def test_filter_normalization_gives_every_filter_the_norm_of_its_weights():
    model = _conv_net()
    d = random_direction(model, seed=5)
    params = dict(model.named_parameters())
    assert list(d) == list(params)  # parameters only, no BatchNorm buffers
    for name, w in params.items():
        assert d[name].shape == w.shape and d[name].dtype == w.dtype
        if w.dim() >= 2:
            dn = d[name].reshape(w.shape[0], -1).norm(dim=1)
            wn = w.detach().reshape(w.shape[0], -1).norm(dim=1)
            torch.testing.assert_close(dn, wn, rtol=1e-6, atol=0)
        else:  # biases and BatchNorm scale/shift: left out, as in Li et al.'s plots
            assert not d[name].any()
    copied = random_direction(model, seed=5, bias_bn="weights")
    torch.testing.assert_close(copied["0.bias"], params["0.bias"].detach())
    torch.testing.assert_close(copied["0.weight"], d["0.weight"])

    # scaling a filter of the weights scales that filter of the direction, nothing else
    scaled = {k: v.detach().clone() for k, v in params.items()}
    scaled["0.weight"][1] *= 10.0
    ds = random_direction(scaled, list(params), seed=5)
    torch.testing.assert_close(ds["0.weight"][1], 10.0 * d["0.weight"][1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ds["0.weight"][[0, 2, 3]], d["0.weight"][[0, 2, 3]])
    torch.testing.assert_close(ds["4.weight"], d["4.weight"])


def test_random_direction_is_reproducible_and_unnormalized_on_request():
    model = _conv_net()
    a, b = random_direction(model, seed=0), random_direction(model, seed=0)
    c = random_direction(model, seed=1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["4.weight"], c["4.weight"])
    raw = random_direction(model, ["4.weight", "4.bias"], seed=0, filter_normalized=False)
    assert list(raw) == ["4.weight", "4.bias"] and raw["4.bias"].any()
    g = torch.Generator().manual_seed(0)  # the plain draw, tensor by tensor in order
    torch.testing.assert_close(raw["4.weight"], torch.randn(3, 64, generator=g, dtype=torch.float64).float())
    # a sample dict holds buffers too: its floating tensors, or the named ones
    sample = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert "1.running_mean" in random_direction(sample)
    assert "1.num_batches_tracked" not in random_direction(sample)
    with pytest.raises(FlatbmaError, match=r"Did you mean '4\.weight'"):
        random_direction(model, ["4.weigth"])
    with pytest.raises(FlatbmaError, match="bias_bn must be one of"):
        random_direction(model, bias_bn="drop")


def test_loss_along_a_bn_mlp_is_the_eval_mode_loss_over_all_batches():
    problem = make_problem()
    model = problem.model
    d = random_direction(model, seed=0)
    curve = loss_along(model, problem.batches, None, d, [-0.5, 0.0, 0.25])
    assert model.training  # mode restored
    with eval_mode(model), torch.no_grad():
        for k, al in enumerate([-0.5, 0.0, 0.25]):
            w = {n: p + al * d[n] for n, p in model.named_parameters()}
            ref = F.cross_entropy(functional_call(model, w, (problem.x,)), problem.y)
            assert float(curve[k]) == pytest.approx(float(ref), rel=1e-12)
    # a single batch and a DataLoader-like list give the same mean loss
    one = loss_along(model, (problem.x, problem.y), None, d, [-0.5, 0.0, 0.25])
    torch.testing.assert_close(one, curve, rtol=1e-12, atol=0)


def test_posterior_landscape_mean_and_std_over_samples():
    problem = make_problem()
    model = problem.model
    base = {**{k: v.detach() for k, v in model.named_parameters()}, **dict(model.named_buffers())}
    names = [k for k, _ in model.named_parameters()]
    direction = random_direction(base, names, seed=3)
    alphas = torch.linspace(-1, 1, 5)

    same = posterior_landscape(model, problem.batches, [base, dict(base), dict(base)], direction, alphas)
    assert torch.equal(same.std, torch.zeros(5, dtype=torch.float64))
    torch.testing.assert_close(same.mean, loss_along(model, problem.batches, base, direction, alphas))

    g = torch.Generator().manual_seed(0)
    samples = [
        {**base, **{k: base[k] + 0.1 * torch.randn(base[k].shape, generator=g, dtype=base[k].dtype) for k in names}}
        for _ in range(4)
    ]
    per_sample = torch.stack([loss_along(model, problem.batches, s, direction, alphas) for s in samples])
    torch.testing.assert_close(loss_along_samples(model, problem.batches, samples, direction, alphas), per_sample)
    mean, std = posterior_landscape(model, problem.batches, samples, direction, alphas)  # as `flatbma compare` does
    torch.testing.assert_close(mean, per_sample.mean(0))
    torch.testing.assert_close(std, per_sample.std(0, unbiased=True))
    assert (std > 0).all()
    one = posterior_landscape(model, problem.batches, samples[:1], direction, alphas)
    assert torch.equal(one.std, torch.zeros(5, dtype=torch.float64))


def test_landscape_input_errors():
    model, loss_fn, batch, _ = quadratic_problem(SPECTRUM)
    d = random_direction(model, filter_normalized=False)
    with pytest.raises(FlatbmaError, match="alphas must be a non-empty"):
        loss_along(model, batch, None, d, [], loss_fn=loss_fn)
    with pytest.raises(FlatbmaError, match="alphas must be finite"):
        loss_along(model, batch, None, d, [0.0, float("nan")], loss_fn=loss_fn)
    with pytest.raises(FlatbmaError, match="has shape"):
        loss_along(model, batch, None, {"w": torch.zeros(3, dtype=torch.float64)}, [0.0], loss_fn=loss_fn)
    with pytest.raises(FlatbmaError, match="not a parameter of the model"):
        loss_along(model, batch, None, {"v": d["w"]}, [0.0], loss_fn=loss_fn)
    with pytest.raises(FlatbmaError, match="does not have"):
        loss_along(model, batch, {"x": d["w"]}, d, [0.0], loss_fn=loss_fn)
    with pytest.raises(FlatbmaError, match="at least one sample"):
        posterior_landscape(model, batch, [], d, [0.0], loss_fn=loss_fn)
    with pytest.raises(FlatbmaError, match="empty"):
        loss_along(model, [], None, d, [0.0], loss_fn=loss_fn)


def _is_png(path):
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plots_write_png_files(tmp_path):
    alphas = torch.linspace(-1, 1, 11)
    curves = {
        "SWAG": (alphas, alphas**2, 0.1 * torch.ones(11)),
        "F-SWAG": (alphas.tolist(), (0.5 * alphas**2).tolist(), None),
    }
    p1 = plot_landscape_1d(curves, tmp_path / "sub" / "curve.png", title="1-D")
    assert p1 == tmp_path / "sub" / "curve.png" and _is_png(p1)
    betas = torch.linspace(-1, 1, 9)
    surface = alphas[:, None] ** 2 + 2 * betas[None, :] ** 2
    p2 = plot_landscape_2d(alphas, betas, surface, tmp_path / "surface.png")
    assert _is_png(p2)
    with pytest.raises(FlatbmaError, match="surface must have shape"):
        plot_landscape_2d(alphas, betas, surface.T, tmp_path / "bad.png")
    with pytest.raises(FlatbmaError, match="3 losses but 2"):
        plot_landscape_1d({"x": ([0, 1, 2], [0, 1, 2], [0, 1])}, tmp_path / "bad.png")


def test_plots_without_matplotlib_say_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(FlatbmaError, match=r"pip install flatbma\[plots\]"):
        plot_landscape_1d({"a": ([0, 1], [0, 1], None)}, tmp_path / "x.png")
