"""IVON (Shen et al. 2024): checked against the authors' package ``ivon-opt`` and against known answers."""

import dataclasses
import importlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

import flatbma
from flatbma import named
from flatbma.errors import FlatbmaError
from flatbma.experiment.config.run_config import config_from_dict, load_config
from flatbma.experiment.run.checkpoint import save_state
from flatbma.experiment.run.pipeline import train
from flatbma.experiment.run.validate import validate_run
from flatbma.gaussian import marginal_variance as lowrank_variance
from flatbma.gaussian import section
from flatbma.methods import METHODS, parse_method
from flatbma.optim import SAM, SGD, Adam, FisherBall, cosine
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import ivon
from flatbma.rng import SEED_KEY, seeded_generator
from tests.helpers import interrupt_after_first_epoch, load_state, tiny_bn_net, toy_batch

STEPS = 24


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(STEPS)]


@pytest.mark.parametrize("mc_samples", [1, 2])
@pytest.mark.parametrize("clip_radius", [None, 0.05])
def test_means_and_hessians_equal_the_reference_ivon_opt(mc_samples, clip_radius, monkeypatch):
    """The same model, batches, schedule and noise through flatbma and ``ivon.IVON`` (ivon-opt 0.1.3) for 24 steps.

    The reference draws its noise with ``torch.randn(d)`` from torch's global generator, once per sample; it is
    handed flatbma's draws (the generator of ``(rng/seed, step)``, one ``[d]`` draw per sample in sorted-name order,
    permuted to the module's parameter order), so both take the same samples.
    """
    reference = importlib.import_module("ivon")  # ivon-opt, a dev dependency (pyproject's dev extra)
    model = _net()
    names = [n for n, _ in model.named_parameters()]
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    ess, hess_init, beta2, wd, momentum = 50.0, 0.3, 0.9, 1e-2, 0.8
    sgd = SGD(lr=cosine(0.05, STEPS), momentum=momentum, weight_decay=wd)
    options = {"ess": ess, "hess_init": hess_init, "beta2": beta2, "mc_samples": mc_samples, "clip_radius": clip_radius}
    method = ivon.build(Objective(model=model, num_data=100), sgd, **options)
    state = method.init(trainable_params(model), {})

    ref_model = _net()
    optimizer = reference.IVON(
        ref_model.parameters(),
        lr=0.05,
        ess=ess,
        hess_init=hess_init,
        beta1=momentum,
        beta2=beta2,
        weight_decay=wd,
        mc_samples=mc_samples,
        clip_radius=clip_radius if clip_radius is not None else float("inf"),
    )
    clipped = total = 0
    for step, (x, y) in enumerate(_batches()):
        generator = seeded_generator(state.aux[SEED_KEY], step, "cpu")
        draws = [torch.randn(sum(sizes.values()), generator=generator) for _ in range(mc_samples)]
        before = {n: v.clone() for n, v in section(state.params, "mean").items()}
        state, out = method.update(state, (x, y))

        queue = [_in_module_order(z, sizes, names) for z in draws]
        optimizer.param_groups[0]["lr"] = sgd.learning_rate(step)
        losses = []
        with monkeypatch.context() as patched:
            patched.setattr(torch, "randn", lambda *a, queue=queue, **k: queue.pop(0))
            for _ in range(mc_samples):
                with optimizer.sampled_params(train=True):
                    optimizer.zero_grad()
                    loss = F.cross_entropy(ref_model(x), y)
                    loss.backward()
                losses.append(loss.detach())
            optimizer.step()
        assert not queue
        torch.testing.assert_close(out.loss, torch.stack(losses).mean())
        means = section(state.params, "mean")
        for n, p in ref_model.named_parameters():
            torch.testing.assert_close(means[n], p.detach(), rtol=1e-5, atol=1e-6)
        ref_hess = optimizer.param_groups[0]["hess"]
        ours = torch.cat([section(state.params, "hess")[n].reshape(-1) for n in names])
        torch.testing.assert_close(ours, ref_hess, rtol=1e-5, atol=1e-6)
        g = named.typed(
            ivon.Momentum, named.part(ivon.NAME, state.aux)
        ).momentum  # the typed state: ivon/momentum/<name>
        ours = torch.cat([g[n].reshape(-1) for n in names])
        torch.testing.assert_close(ours, optimizer.param_groups[0]["momentum"], rtol=1e-5, atol=1e-6)
        if clip_radius is not None:
            moved = torch.cat([(means[n] - before[n]).abs().reshape(-1) for n in names])
            lr_t = sgd.learning_rate(step) * (hess_init + wd)
            assert float(moved.max()) <= lr_t * clip_radius + 1e-7  # float32 rounding of m
            clipped += int((moved >= lr_t * clip_radius - 1e-7).sum())
            total += moved.numel()
    assert clip_radius is None or 0 < clipped < total, (clipped, total)  # the radius bound some coordinates


def _in_module_order(z: torch.Tensor, sizes: dict, names: list) -> torch.Tensor:
    """flatbma's ``[d]`` draw (names in sorted order) in the module's parameter order."""
    parts, offset = {}, 0
    for n in sorted(sizes):
        parts[n] = z[offset : offset + sizes[n]]
        offset += sizes[n]
    return torch.cat([parts[n] for n in names])


def test_on_a_quadratic_the_hessian_estimate_converges_to_the_true_diagonal():
    """Linear regression, full batch: ``E[ĥ] = diag H`` (Stein's lemma), ``m`` → the ridge solution (H + δI)⁻¹Xᵀy/n.

    ``ĥ_i = H_ii z_i² + H_ii (m − ŵ)_i z_i/σ_i`` for ``H`` diagonal (``ŵ`` the least-squares solution): unbiased,
    with a variance that grows with ``(m − ŵ)/σ``, which a small ``δ`` keeps small. The time average of ``h`` over
    3000 steps then has a relative standard deviation of about ``√(2/3000) ≈ 0.026``.
    """
    g = torch.Generator().manual_seed(0)
    n, scales = 200, torch.tensor([0.5, 1.0, 2.0, 3.0])
    q, _ = torch.linalg.qr(torch.randn(n, 4, generator=g))
    x = q * scales * n**0.5  # H = XᵀX/n = diag(scales²)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 1.5]) + 0.1 * torch.randn(n, generator=g)
    model = nn.Linear(4, 1, bias=False)
    objective = Objective(model=model, num_data=n, loss_fn=lambda out, t: 0.5 * F.mse_loss(out.squeeze(-1), t))
    delta, ess = 1e-3, 500.0
    method = ivon.build(objective, SGD(lr=0.02, momentum=0.9, weight_decay=delta), ess=ess, beta2=0.99, hess_init=5.0)
    torch.manual_seed(3)
    state = method.init(trainable_params(model), {})
    estimates = []
    for step in range(4000):
        state, _ = method.update(state, (x, y))
        if step >= 1000:
            estimates.append(section(state.params, "hess")["weight"].clone())
    hessian = x.T @ x / n
    torch.testing.assert_close(torch.stack(estimates).mean(0)[0], hessian.diagonal(), rtol=0.1, atol=0)
    ridge = torch.linalg.solve(hessian + delta * torch.eye(4), x.T @ y / n)
    h = section(state.params, "hess")["weight"]
    expected = 1 / (ess * (h + delta))  # σ² = 1/(λ(h + δ)), exactly
    assert ((section(state.params, "mean")["weight"][0] - ridge).abs() < expected[0].sqrt()).all()  # within σ
    assert torch.equal(method.marginal_variance(state)["weight"], expected)
    torch.testing.assert_close(lowrank_variance(method.can.gaussian(state))["weight"], expected)
    draws = torch.stack([w["weight"] for w in method.sample(state, 20000, torch.Generator().manual_seed(1))])
    assert ((draws.var(0) / expected) - 1).abs().max() < 0.05  # ≈ 5 standard errors
    assert ((draws.mean(0) - section(state.params, "mean")["weight"]).abs() / expected.sqrt()).max() < 0.05


def test_sigma_starts_at_its_init_and_the_default_ess_is_the_data_size():
    model = _net()
    method = ivon.build(Objective(model=model, num_data=80), SGD(weight_decay=0.02), hess_init=0.5)
    state = method.init(trainable_params(model), {})
    for v in method.marginal_variance(state).values():
        torch.testing.assert_close(v, torch.full_like(v, 1 / (80 * (0.5 + 0.02))))
    assert all(torch.equal(method.mean(state)[n], p) for n, p in model.named_parameters())


def test_f_ivon_feeds_the_gradient_at_the_perturbed_sample():
    """One step of f-ivon equals IVON's update with ĝ = ∇L(θ + ε), ε = ρ∇L(θ)/‖∇L(θ)‖, in ĝ and in ĥ."""
    model, batch = _net(), toy_batch(n=16, in_features=5)
    rho, ess, delta, lr = 0.05, 40.0, 1e-2, 0.1
    method = ivon.build(Objective(model=model), SGD(lr=lr, momentum=0.9, weight_decay=delta), SAM(rho), ess=ess)
    state = method.init(trainable_params(model), {})
    m = {k: v.clone() for k, v in section(state.params, "mean").items()}
    sigma = {k: v.sqrt() for k, v in method.marginal_variance(state).items()}
    z = torch.randn(sum(v.numel() for v in m.values()), generator=seeded_generator(state.aux[SEED_KEY], 0, "cpu"))
    noise, offset = {}, 0
    for k in sorted(m):
        noise[k] = z[offset : offset + m[k].numel()].view_as(m[k]) * sigma[k]
        offset += m[k].numel()
    theta = {k: m[k] + noise[k] for k in m}
    g = _grad(model, theta, batch)
    norm = torch.sqrt(sum((v**2).sum() for v in g.values()))
    g_eps = _grad(model, {k: theta[k] + rho * g[k] / (norm + 1e-12) for k in m}, batch)
    state, _ = method.update(state, batch)
    for k in m:
        hess_hat = g_eps[k] * noise[k] * ess * (1.0 + delta)
        h = 0.99999 * 1.0 + 1e-5 * hess_hat + 0.5 * 1e-10 * (1.0 - hess_hat) ** 2 / (1.0 + delta)
        momentum = 0.1 * g_eps[k]
        step = (momentum / 0.1 + delta * m[k]) / (h + delta)
        torch.testing.assert_close(section(state.params, "hess")[k], h)
        torch.testing.assert_close(section(state.params, "mean")[k], m[k] - lr * (1.0 + delta) * step)


def _grad(model, w, batch):
    w = {k: v.detach().requires_grad_(True) for k, v in w.items()}
    loss = F.cross_entropy(functional_call(model, w, (batch[0],)), batch[1])
    return dict(zip(w, torch.autograd.grad(loss, list(w.values()))))


def test_save_load_sample_and_resume_are_exact(tmp_path):
    torch.manual_seed(0)
    model = tiny_bn_net()
    model.train()
    method = parse_method({"name": "f-ivon", "mc_samples": 2, "beta2": 0.9}).build(
        Objective(model=model, num_data=64), SGD(lr=0.1, weight_decay=1e-3)
    )
    state = method.init(trainable_params(model), model_buffers(model))
    state, _ = method.update(state, toy_batch(seed=0))
    assert int(state.buffers["1.num_batches_tracked"]) == 1  # running statistics: the first sample's pass only
    state, _ = method.update(state, toy_batch(seed=1))
    save_state(state, tmp_path / "s.safetensors")
    loaded = load_state(tmp_path / "s.safetensors")
    a = method.sample(state, 2, torch.Generator().manual_seed(3))
    b = method.sample(loaded, 2, torch.Generator().manual_seed(3))
    for wa, wb in zip(a, b):
        assert set(wa) == set(model.state_dict())
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    s1, o1 = method.update(state, toy_batch(seed=2))
    s2, o2 = method.update(loaded, toy_batch(seed=2))
    assert torch.equal(o1.loss, o2.loss)
    for part in ("params", "aux", "buffers"):
        x, y = getattr(s1, part), getattr(s2, part)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), part


DIGITS = {
    "seed": 1,
    "method": {"name": "ivon", "beta2": 0.99},
    "data": {"name": "digits", "batch_size": 128},
    "model": {"name": "mlp", "width": 16},
    "optim": {"lr": 0.2, "weight_decay": 1e-3},
    "train": {"epochs": 2, "progress": False},
    "eval": {"num_samples": 2},
}


def test_a_run_stopped_after_an_epoch_resumes_bit_identically(tmp_path, monkeypatch):
    cfg = config_from_dict(DIGITS)
    reference = train(dataclasses.replace(cfg, output_dir=str(tmp_path / "ref")), evaluate=False)
    stopped = dataclasses.replace(cfg, output_dir=str(tmp_path / "run"))
    interrupt_after_first_epoch(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        train(stopped, evaluate=False)
    resumed = train(stopped, resume=True, evaluate=False)
    for part in ("params", "buffers", "aux"):
        a, b = getattr(reference.state, part), getattr(resumed.state, part)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    hess = section(reference.state.params, "hess")
    assert max(float((v - 1.0).abs().max()) for v in hess.values()) > 0.1  # h (so σ) moved from h₀ = 1


def test_refusals_name_what_to_change():
    obj = Objective(model=_net())
    with pytest.raises(FlatbmaError, match=r"its own optimizer.*set optim\.name: sgd"):
        ivon.build(obj, Adam())
    with pytest.raises(FlatbmaError, match="Nesterov"):
        ivon.build(obj, SGD(nesterov=True))
    with pytest.raises(FlatbmaError, match="on the sampled weights"):
        ivon.build(obj, SGD(), FisherBall())
    for option, value in (("hess_init", 0.0), ("beta2", 1.0), ("mc_samples", 0), ("ess", -1.0), ("clip_radius", 0)):
        with pytest.raises(FlatbmaError, match=rf"method\.{option}"):
            ivon.build(obj, SGD(), **{option: value})
    assert METHODS["ivon"].family.build is ivon.build and METHODS["ivon"].ascent is None
    assert METHODS["f-ivon"].family.build is ivon.build and METHODS["f-ivon"].ascent is SAM
    assert METHODS["ivon"].family.gaussian and METHODS["f-ivon"].family.gaussian


def test_fit_posterior_trains_ivon_and_load_posterior_predicts_the_same(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))
    options = {"epochs": 2, "lr": 0.1, "beta2": 0.9, "num_samples": 3, "progress": False}
    bma = flatbma.fit_posterior(tiny_bn_net(), loader, "ivon", **options)
    assert bma.method_config["name"] == "ivon" and bma.method_config["beta2"] == 0.9
    path = tmp_path / "ivon.safetensors"
    bma.save(path)
    again = flatbma.load_posterior(path, tiny_bn_net(), loader)
    assert torch.equal(again.predict_log_proba(x), bma.predict_log_proba(x))
    with pytest.raises(FlatbmaError, match="its own optimizer"):
        flatbma.fit_posterior(tiny_bn_net(), loader, "ivon", epochs=1, optim={"name": "adam"}, progress=False)


def test_the_demo_with_method_ivon_validates_and_builds(tmp_path):
    """``flatbma train --config demo --set method.name=ivon``: the demo's checks before training pass, and IVON
    builds with the demo's optim section (SGD: β₁ = momentum 0.9, δ = weight_decay 1e-4). It is run, not only
    validated, by the study's pilot (configs/ivon-study.yaml)."""
    demo = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    cfg = load_config(demo, ["method.name=ivon", f"output_dir={tmp_path / 'run'}"])
    assert cfg.method.name == "ivon" and cfg.optim.momentum == 0.9
    validate_run(cfg)
    method = cfg.method.build(Objective(model=_net(), num_data=100), cfg.optim.build(steps_per_epoch=4, epochs=15))
    state = method.init(trainable_params(_net()), {})
    expected = 1 / (100 * (1.0 + cfg.optim.weight_decay))  # λ = N = 100 images, h₀ = 1
    assert all(torch.allclose(v, torch.full_like(v, expected)) for v in method.marginal_variance(state).values())
