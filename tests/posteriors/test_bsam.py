"""Bayesian SAM (Möllenhoff & Khan 2023)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from flatbma.errors import FlatbmaError
from flatbma.experiment.run.checkpoint import save_state
from flatbma.gaussian import section, standard_normal_like
from flatbma.methods import METHODS, parse_method
from flatbma.named import part, typed
from flatbma.optim import SAM, SGD, Adam, constant
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import bsam
from flatbma.rng import SEED_KEY, seeded_generator
from tests.helpers import load_state, tiny_bn_net, toy_batch, train_via_cli


def _grad(model, w, batch):
    w = {k: v.detach().requires_grad_(True) for k, v in w.items()}
    loss = F.cross_entropy(functional_call(model, w, (batch[0],)), batch[1])
    return dict(zip(w, torch.autograd.grad(loss, list(w.values()))))


def test_update_follows_algorithm_1():
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    n, factor, lam, rho, b1, b2, gamma, lr = 40, 2.0, 5.0, 0.05, 0.8, 0.9, 0.1, 0.3
    obj = Objective(model=model, num_data=n)
    method = bsam.build(
        obj,
        SGD(lr=lr),
        rho=rho,
        prior_precision=lam,
        beta1=b1,
        beta2=b2,
        damping=gamma,
        init_precision=2.0,
        data_factor=factor,
    )
    state = method.init(trainable_params(model), {})
    N = factor * n
    delta = lam / N
    m = {k: v.clone() for k, v in section(state.params, "mean").items()}
    s = {k: v.clone() for k, v in section(state.params, "precision").items()}
    gm = {k: torch.zeros_like(v) for k, v in m.items()}
    for step in range(2):
        batch = toy_batch(seed=step)
        z = standard_normal_like(m, seeded_generator(state.aux[SEED_KEY], step, "cpu"))
        g = _grad(model, {k: m[k] + z[k] / torch.sqrt(N * s[k]) for k in m}, batch)
        g_eps = _grad(model, {k: m[k] + rho * g[k] / s[k] for k in m}, batch)
        for k in m:
            gm[k] = b1 * gm[k] + (1 - b1) * (g_eps[k] + delta * m[k])
            s[k] = b2 * s[k] + (1 - b2) * (s[k].sqrt() * g[k].abs() + delta + gamma)
            m[k] = m[k] - lr * gm[k] / s[k]
        state, _ = method.update(state, batch)
        for k in m:
            torch.testing.assert_close(state.params[f"mean/{k}"], m[k])
            torch.testing.assert_close(state.params[f"precision/{k}"], s[k])
            torch.testing.assert_close(state.aux[f"bsam/momentum/{k}"], gm[k])
        assert typed(bsam.Momentum, part(bsam.NAME, state.aux)).momentum.keys() == gm.keys()  # its typed state


def test_bsam_improves_on_a_toy_classification_problem():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(200, 2, generator=g)
    y = (X[:, 0] + 0.5 * X[:, 1] > 0).long()
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    obj = Objective(model=model, num_data=200)
    method = bsam.build(obj, SGD(lr=constant(0.5)), rho=0.01, prior_precision=1.0)
    state = method.init(trainable_params(model), {})

    def mean_loss(st):
        return float(F.cross_entropy(functional_call(model, section(st.params, "mean"), (X,)), y))

    before = mean_loss(state)
    for _ in range(300):
        state, _ = method.update(state, (X, y))
    after = mean_loss(state)
    assert after < 0.15 * before, (before, after)
    # the BMA of posterior samples classifies the training data
    samples = method.sample(state, 20, torch.Generator().manual_seed(0))
    probs = torch.stack([functional_call(model, w, (X,)).softmax(-1) for w in samples]).mean(0)
    assert (probs.argmax(-1) == y).float().mean() > 0.95
    # the posterior contracted where the data are informative: s grew beyond γ + δ
    assert float(section(state.params, "precision")["weight"].min()) > 0.1


def test_sample_variance_is_one_over_n_s():
    model = nn.Linear(3, 2)
    n, factor = 50, 4.0
    method = bsam.build(Objective(model=model, num_data=n), SGD(), data_factor=factor)
    g = torch.Generator().manual_seed(0)
    theta = {
        "mean/weight": torch.randn(2, 3, generator=g),
        "mean/bias": torch.randn(2, generator=g),
        "precision/weight": torch.rand(2, 3, generator=g) * 2 + 0.05,
        "precision/bias": torch.rand(2, generator=g) * 2 + 0.05,
    }
    state = method.init(theta, {})
    samples = method.sample(state, 20000, torch.Generator().manual_seed(1))
    for k in ("weight", "bias"):
        w = torch.stack([s[k] for s in samples])
        expected_var = 1 / (factor * n * theta[f"precision/{k}"])
        assert ((w.mean(0) - theta[f"mean/{k}"]).abs() / expected_var.sqrt()).max() < 0.05
        assert ((w.var(0) / expected_var) - 1).abs().max() < 0.05  # ≈ 5 standard errors
    torch.testing.assert_close(
        bsam.posterior_std(theta, factor * n)["bias"] ** 2, 1 / (factor * n * theta["precision/bias"])
    )


def test_save_load_sample_and_resume_are_exact(tmp_path):
    torch.manual_seed(0)
    model = tiny_bn_net()
    model.train()
    method = bsam.build(Objective(model=model, num_data=64), Adam(lr=0.1))
    state = method.init(trainable_params(model), model_buffers(model))
    state, _ = method.update(state, toy_batch(seed=0))
    assert int(state.buffers["1.num_batches_tracked"]) == 1  # running statistics: first pass only
    state, _ = method.update(state, toy_batch(seed=1))
    save_state(state, tmp_path / "s.safetensors")
    loaded = load_state(tmp_path / "s.safetensors")
    a = method.sample(state, 2, torch.Generator().manual_seed(3))
    b = method.sample(loaded, 2, torch.Generator().manual_seed(3))
    for wa, wb in zip(a, b):
        assert set(wa) == set(model.state_dict())
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    s1, _ = method.update(state, toy_batch(seed=2))
    s2, _ = method.update(loaded, toy_batch(seed=2))
    assert all(torch.equal(s1.params[k], s2.params[k]) for k in s1.params)


def test_options_ascent_and_registry():
    obj = Objective(model=nn.Linear(2, 2))
    with pytest.raises(FlatbmaError, match="own SAM-type ascent"):
        bsam.build(obj, SGD(), SAM())
    with pytest.raises(FlatbmaError, match=r"method\.beta2"):
        bsam.build(obj, SGD(), beta2=1.0)
    with pytest.raises(FlatbmaError, match=r"method\.damping"):
        bsam.build(obj, SGD(), damping=0.0)
    with pytest.raises(FlatbmaError, match=r"method\.rho"):
        bsam.build(obj, SGD(), rho=-0.1)
    with pytest.raises(FlatbmaError, match="learning_rate"):
        bsam.build(obj, object())
    assert METHODS["bsam"].ascent is None and METHODS["bsam"].family.build is bsam.build
    cfg = parse_method({"name": "bsam", "rho": 0.02, "prior_precision": 25})
    assert cfg.ascent is None and cfg.options["rho"] == 0.02 and cfg.options["prior_precision"] == 25.0


@pytest.mark.slow
def test_trains_on_digits_via_cli(tmp_path):
    cfg = {
        "seed": 0,
        "method": {"name": "bsam"},
        "data": {"name": "digits", "batch_size": 64},
        "model": {"name": "mlp"},
        "optim": {"name": "sgd", "lr": 2.0},
        "train": {"epochs": 3, "progress": False},
        "eval": {"num_samples": 3},
    }
    out, metrics = train_via_cli(tmp_path, cfg)
    assert metrics["accuracy"] > 0.85, metrics["accuracy"]
    losses = [h["loss"] for h in metrics["history"]]
    assert losses[-1] < 0.5 * losses[0]
