"""Mean-field and low-rank Gaussian VI and their flat-seeking (SAM) variants."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.distributions import LowRankMultivariateNormal, MultivariateNormal, Normal, kl_divergence
from torch.func import functional_call

from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.run.checkpoint import save_state
from flatbma.gaussian import GaussianNoise, section
from flatbma.methods import METHODS, parse_method
from flatbma.optim import SAM, SGD, Adam, FisherBall, cosine
from flatbma.params import Objective, flatten, model_buffers, trainable_params, unflatten
from flatbma.posteriors import fp_bma, lowrank_vi, mfvi
from flatbma.posteriors.gaussian_vi import elbo_value_and_grad
from tests.helpers import load_state, tiny_bn_net, toy_batch

# ------------------------------------------------------------------------------------------------
# helpers


def _tiny_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(3, 4, generator=g) * 0.5, "fc.bias": torch.randn(3, generator=g) * 0.5}


def _mf_theta(seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    p = _tiny_params(seed)
    theta = {f"mean/{k}": v for k, v in p.items()}
    theta.update({f"rho/{k}": torch.randn(v.shape, generator=g) * 0.3 - 1.0 for k, v in p.items()})
    return theta


def _lr_theta(seed=0, k=4):
    g = torch.Generator().manual_seed(seed + 200)
    p = _tiny_params(seed)
    theta = {f"mean/{n}": v for n, v in p.items()}
    theta.update({f"log_std/{n}": torch.randn(v.shape, generator=g) * 0.3 - 1.0 for n, v in p.items()})
    theta.update({f"factor/{n}": torch.randn((k, *v.shape), generator=g) * 0.4 for n, v in p.items()})
    return theta


def _dense_lowrank(theta):
    """Σ = ½(diag σ² + L Lᵀ/(K−1)) assembled independently of lowrank_vi (flatten order)."""
    names = list(section(theta, "mean"))
    k = theta[f"factor/{names[0]}"].shape[0]
    sigma = torch.cat([theta[f"log_std/{n}"].exp().reshape(-1) for n in names])
    L = torch.cat([theta[f"factor/{n}"].reshape(k, -1) for n in names], dim=1).T  # [d, K]
    return 0.5 * (torch.diag(sigma**2) + L @ L.T / (k - 1)), L, sigma


def _lr_kl_dense(theta, prior_std):
    cov, _, _ = _dense_lowrank(theta)
    mu = flatten(section(theta, "mean"))
    d = mu.numel()
    s2 = prior_std**2
    return 0.5 * (torch.trace(cov) / s2 + mu @ mu / s2 - d + d * math.log(s2) - torch.logdet(cov))


def _mf_kl_torch(theta, prior_std):
    mean, rho = section(theta, "mean"), section(theta, "rho")
    return sum(kl_divergence(Normal(mean[k], F.softplus(rho[k])), Normal(0.0, prior_std)).sum() for k in mean)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.tanh(x))


def _tiny_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(10, 4, generator=g), torch.randint(0, 3, (10,), generator=g)


# ------------------------------------------------------------------------------------------------
# KL divergences


def test_mfvi_kl_matches_torch_distributions():
    theta = _mf_theta()
    torch.testing.assert_close(mfvi.kl_divergence(theta, 0.7), _mf_kl_torch(theta, 0.7))


def test_mfvi_kl_gradient_is_divided_by_num_data_exactly_once():
    # A loss that ignores the weights leaves only the KL term: grad = κ ∇KL / n, analytically
    # ∂KL/∂μ = μ/s²,  ∂KL/∂ρ = (σ/s² − 1/σ)·sigmoid(ρ).
    n, s, kappa = 37, 0.7, 0.5
    model = _Tiny()
    obj = Objective(model=model, loss_fn=lambda out, y: 0.0 * out.sum(), num_data=n)
    theta = _mf_theta()
    mean, rho = section(theta, "mean"), section(theta, "rho")
    family = mfvi.MeanFieldGaussian(init_std=0.1, prior_std=s)
    noise = family.noise(theta, torch.Generator().manual_seed(0))
    _, _, grads = elbo_value_and_grad(obj, family, theta, {}, _tiny_batch(), [noise], kl_weight=kappa)
    for k in mean:
        sigma = F.softplus(rho[k])
        torch.testing.assert_close(grads[f"mean/{k}"], kappa * mean[k] / s**2 / n)
        torch.testing.assert_close(grads[f"rho/{k}"], kappa * (sigma / s**2 - 1 / sigma) * torch.sigmoid(rho[k]) / n)
    # and the method applies it once: one SGD step of size 1 moves θ by exactly −κ∇KL/n
    method = mfvi.build(obj, SGD(lr=1.0, momentum=0.0), prior_std=s, kl_weight=kappa, variance_step="plain")
    state = method.init(theta, {})
    before = {k: v.clone() for k, v in state.params.items()}
    state, _ = method.update(state, _tiny_batch())
    for k, g in grads.items():
        torch.testing.assert_close(before[k] - state.params[k], g)


def test_lowrank_kl_matches_dense_and_torch_distributions():
    theta = _lr_theta(k=4)  # d = 15
    s = 0.8
    kl = lowrank_vi.kl_divergence(theta, s)
    torch.testing.assert_close(kl, _lr_kl_dense(theta, s), rtol=1e-5, atol=1e-5)
    _, L, sigma = _dense_lowrank(theta)
    mu = flatten(section(theta, "mean"))
    q = LowRankMultivariateNormal(mu, L / math.sqrt(2 * 3), 0.5 * sigma**2)
    p = MultivariateNormal(torch.zeros_like(mu), s**2 * torch.eye(mu.numel()))
    torch.testing.assert_close(kl, kl_divergence(q, p), rtol=1e-4, atol=1e-4)
    # gradients too (double precision so that the dense log-det is exact enough)
    th64 = {k: v.double().requires_grad_(True) for k, v in theta.items()}
    g_fast = torch.autograd.grad(lowrank_vi.kl_divergence(th64, s), list(th64.values()))
    g_dense = torch.autograd.grad(_lr_kl_dense(th64, s), list(th64.values()))
    for a, b in zip(g_fast, g_dense):
        torch.testing.assert_close(a, b)


def test_dense_covariance_matches_the_definition():
    theta = _lr_theta(k=3)
    torch.testing.assert_close(lowrank_vi.dense_covariance(theta), _dense_lowrank(theta)[0])


# ------------------------------------------------------------------------------------------------
# samplers


def test_lowrank_sampler_has_the_stated_mean_and_covariance():
    theta = _lr_theta(k=3)
    cov, _, _ = _dense_lowrank(theta)
    mu = flatten(section(theta, "mean"))
    std = cov.diagonal().sqrt()
    names = list(section(theta, "mean"))  # the layout of dense_covariance: sorted names

    def check(w, tol):
        # mean: z₂ has mean 0 (a mean-1 z₂ would shift it by L·1/√(2(K−1)), ~0.8 std here)
        assert ((w.mean(0) - mu).abs() / std).max() < tol
        assert ((torch.cov(w.T) - cov) / std.outer(std)).abs().max() < tol

    # the formula, on 200k batched draws (tolerance ≈ 9 standard errors of a correlation)
    g = torch.Generator().manual_seed(0)
    z1 = {k: torch.randn(200_000, *v.shape, generator=g) for k, v in section(theta, "mean").items()}
    z2 = torch.randn(200_000, 3, generator=g)
    batched = lowrank_vi.sample_weights(theta, z1, z2)
    check(torch.cat([batched[k].reshape(200_000, -1) for k in names], dim=1), 0.02)
    one = lowrank_vi.sample_weights(theta, {k: v[2] for k, v in z1.items()}, z2[2])
    for k in one:
        torch.testing.assert_close(batched[k][2], one[k])
    # the posterior's sample() with its own noise draws (≈ 5 standard errors)
    method = lowrank_vi.build(Objective(model=_Tiny()), Adam(), rank=3)
    samples = method.sample(method.init(theta, {}), 2000, torch.Generator().manual_seed(1))
    check(torch.stack([flatten({k: s[k] for k in names}) for s in samples]), 0.11)


def test_mfvi_sampler_moments():
    theta = _mf_theta()
    method = mfvi.build(Objective(model=_Tiny()), Adam())
    samples = method.sample(method.init(theta, {}), 4000, torch.Generator().manual_seed(1))
    w = torch.stack([s["fc.bias"] for s in samples])
    sigma = F.softplus(theta["rho/fc.bias"])
    assert ((w.mean(0) - theta["mean/fc.bias"]).abs() / sigma).max() < 0.1
    assert ((w.std(0) / sigma) - 1).abs().max() < 0.06


def test_init_centres_q_at_the_model_weights():
    model = _Tiny()
    w0 = trainable_params(model)
    st = mfvi.build(Objective(model=model), Adam(), init_std=0.01).init(w0, {})
    torch.testing.assert_close(F.softplus(st.params["rho/fc.weight"]), torch.full((3, 4), 0.01))
    torch.testing.assert_close(st.params["mean/fc.weight"], w0["fc.weight"])
    st = lowrank_vi.build(Objective(model=model), Adam(), rank=4, init_std=0.01).init(w0, {})
    assert st.params["factor/fc.weight"].shape == (4, 3, 4)
    torch.testing.assert_close(st.params["mean/fc.bias"], w0["fc.bias"])
    # E[Σ] = init_std² I: the average marginal variance is close to 1e-4
    var = lowrank_vi.dense_covariance(st.params).diagonal()
    assert 0.5e-4 < var.mean() < 1.5e-4


# ------------------------------------------------------------------------------------------------
# the gradient: plain ELBO and the flat-seeking composition


def _hand_mf_weights(theta, noise):
    return {k: theta[f"mean/{k}"] + F.softplus(theta[f"rho/{k}"]) * z for k, z in noise.z1.items()}


def _hand_lr_weights(theta, noise):
    k = noise.z2.numel()
    out = {}
    for n, z in noise.z1.items():
        low = (noise.z2.reshape(k, *([1] * z.dim())) * theta[f"factor/{n}"]).sum(0)
        out[n] = theta[f"mean/{n}"] + (theta[f"log_std/{n}"].exp() * z + low / math.sqrt(k - 1)) / math.sqrt(2)
    return out


FAMILIES = {
    "mfvi": (_mf_theta, lambda: mfvi.MeanFieldGaussian(0.1, 0.9), _hand_mf_weights),
    "lowrank": (lambda: _lr_theta(k=3), lambda: lowrank_vi.LowRankGaussian(3, 0.1, 0.9), _hand_lr_weights),
}


def _explicit_noise(theta, gen):
    z1 = {k: torch.randn(v.shape, generator=gen) for k, v in section(theta, "mean").items()}
    factors = section(theta, "factor")
    z2 = torch.randn(next(iter(factors.values())).shape[0], generator=gen) if factors else None
    return GaussianNoise(z1, z2)


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("rho", [None, 0.3])
def test_theta_gradient_equals_hand_composed_vjp(name, rho):
    make_theta, make_family, hand_weights = FAMILIES[name]
    theta, family = make_theta(), make_family()
    model = _Tiny()
    n, kappa = 50, 0.7
    obj = Objective(model=model, num_data=n)
    batch = _tiny_batch()
    gen = torch.Generator().manual_seed(3)
    noises = [_explicit_noise(theta, gen) for _ in range(2)]
    ascent = SAM(rho=rho) if rho else None
    loss, _, grads = elbo_value_and_grad(obj, family, theta, {}, batch, noises, ascent=ascent, kl_weight=kappa)

    leaves = {k: v.clone().requires_grad_(True) for k, v in theta.items()}

    def data_loss(w):
        return F.cross_entropy(functional_call(model, w, (batch[0],)), batch[1])

    total = {k: torch.zeros_like(v) for k, v in theta.items()}
    losses = []
    for noise in noises:
        w = hand_weights(leaves, noise)
        w0 = {k: v.detach().requires_grad_(True) for k, v in w.items()}
        loss0 = data_loss(w0)
        losses.append(loss0.detach())
        g = dict(zip(w0, torch.autograd.grad(loss0, list(w0.values()))))
        if rho:
            norm = torch.sqrt(sum((v**2).sum() for v in g.values()))
            w1 = {k: (w0[k] + rho * g[k] / norm).detach().requires_grad_(True) for k in w0}
            g = dict(zip(w1, torch.autograd.grad(data_loss(w1), list(w1.values()))))
        vjp = torch.autograd.grad(list(w.values()), list(leaves.values()), [g[k] for k in w], allow_unused=True)
        for (k, _), v in zip(leaves.items(), vjp):
            if v is not None:
                total[k] += v / len(noises)
    kl = _mf_kl_torch(leaves, 0.9) if name == "mfvi" else _lr_kl_dense(leaves, 0.9)
    for (k, _), v in zip(leaves.items(), torch.autograd.grad(kappa * kl / n, list(leaves.values()))):
        total[k] += v
    for k in theta:
        torch.testing.assert_close(grads[k], total[k], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss, torch.stack(losses).mean())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_without_ascent_the_gradient_is_the_elbo_gradient(name):
    make_theta, make_family, hand_weights = FAMILIES[name]
    theta, family = make_theta(), make_family()
    model = _Tiny()
    obj = Objective(model=model, num_data=20)
    batch = _tiny_batch(1)
    noises = [family.noise(theta, torch.Generator().manual_seed(s)) for s in range(3)]
    _, _, grads = elbo_value_and_grad(obj, family, theta, {}, batch, noises)
    leaves = {k: v.clone().requires_grad_(True) for k, v in theta.items()}
    elbo = family.kl(leaves) / 20
    for noise in noises:
        w = hand_weights(leaves, noise)
        elbo = elbo + F.cross_entropy(functional_call(model, w, (batch[0],)), batch[1]) / 3
    expected = dict(zip(leaves, torch.autograd.grad(elbo, list(leaves.values()))))
    for k in theta:
        torch.testing.assert_close(grads[k], expected[k], rtol=1e-4, atol=1e-6)


def _zero_loss(logits, labels):
    """A loss whose gradient is exactly 0 (so only the weight decay moves θ)."""
    return 0.0 * logits.sum()


_DECAY_VARIANTS = {
    "mfvi": lambda obj, opt: mfvi.build(obj, opt, kl_weight=0.0),
    "f-mfvi": lambda obj, opt: mfvi.build(obj, opt, SAM(rho=0.1), kl_weight=0.0),
    "lowrank-vi": lambda obj, opt: lowrank_vi.build(obj, opt, rank=4, kl_weight=0.0),
    "fp-bma": lambda obj, opt: lowrank_vi.build(obj, opt, FisherBall(gamma=0.1), rank=4, kl_weight=0.0),
    "fp-bma with prior": lambda obj, opt: fp_bma.build_with_prior(
        obj, opt, FisherBall(gamma=0.1), _lr_theta(seed=5), rank=4, kl_weight=0.0
    ),
}


@pytest.mark.parametrize("variant", list(_DECAY_VARIANTS))
@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_weight_decay_acts_on_the_mean_only(variant, optim):
    """With a zero data gradient and no KL, log σ / ρ and L stay put and μ decays by the SGD / AdamW formula."""
    lr, wd, steps = 0.1, 0.05, 4
    optimizer = SGD(lr=lr, momentum=0.9, weight_decay=wd) if optim == "sgd" else Adam(lr=lr, weight_decay=wd)
    method = _DECAY_VARIANTS[variant](Objective(model=_Tiny(), loss_fn=_zero_loss, num_data=10), optimizer)
    theta0 = _mf_theta() if "mfvi" in variant else _lr_theta()
    state = method.init({k: v.clone() for k, v in theta0.items()}, {})
    for _ in range(steps):
        state, _ = method.update(state, _tiny_batch())
    means = {k: v.clone().requires_grad_(True) for k, v in theta0.items() if k.startswith("mean/")}
    ref_cls = torch.optim.SGD if optim == "sgd" else torch.optim.AdamW
    ref = ref_cls(means.values(), lr=lr, weight_decay=wd, **({"momentum": 0.9} if optim == "sgd" else {}))
    for _ in range(steps):
        for v in means.values():
            v.grad = torch.zeros_like(v)
        ref.step()
    for k, v in theta0.items():
        if k in means:
            torch.testing.assert_close(state.params[k], means[k].detach(), rtol=1e-6, atol=0)
            assert not torch.equal(state.params[k], v)  # it did decay
        else:  # log σ, ρ and the factor: untouched
            torch.testing.assert_close(state.params[k], v, rtol=0, atol=0)


def test_batchnorm_statistics_are_updated_once_per_step():
    torch.manual_seed(0)
    model = tiny_bn_net()
    model.train()
    obj = Objective(model=model, num_data=16)
    family = mfvi.MeanFieldGaussian(0.05, 1.0)
    theta = family.init_theta(trainable_params(model), torch.Generator())
    buffers = model_buffers(model)
    expected = {k: v.clone() for k, v in buffers.items()}
    batch = toy_batch()
    noises = [family.noise(theta, torch.Generator().manual_seed(s)) for s in range(3)]
    # one train-mode forward at the first sample, from the same starting statistics
    functional_call(model, {**mfvi.reparameterize(theta, noises[0].z1), **expected}, (batch[0],))
    elbo_value_and_grad(obj, family, theta, buffers, batch, noises, ascent=SAM(rho=0.1))
    for k in buffers:
        torch.testing.assert_close(buffers[k], expected[k])
    assert int(buffers["1.num_batches_tracked"]) == 1


# ------------------------------------------------------------------------------------------------
# convergence to a known posterior


def test_mfvi_recovers_the_bayesian_linear_regression_posterior():
    # y = Xw + N(0, σₙ²), prior N(0, s²I). With the per-example Gaussian NLL as loss, n·L_S is the
    # negative log-likelihood, so the ELBO optimum of the mean-field family is the exact posterior
    # mean with variances 1/diag(P), P = XᵀX/σₙ² + I/s² (the mean-field optimum for a Gaussian).
    n, d, noise_std, s = 20, 3, 0.5, 1.0
    g = torch.Generator().manual_seed(1)
    X = torch.randn(n, d, generator=g)
    y = X @ torch.tensor([1.0, -2.0, 0.5]) + noise_std * torch.randn(n, generator=g)
    P = X.T @ X / noise_std**2 + torch.eye(d) / s**2
    post_mean = torch.linalg.solve(P, X.T @ y / noise_std**2)
    post_std = 1 / P.diagonal().sqrt()

    def gaussian_nll(out, target):
        return (
            0.5 * (out.squeeze(-1) - target) ** 2 / noise_std**2 + 0.5 * math.log(2 * math.pi * noise_std**2)
        ).mean()

    model = nn.Linear(d, 1, bias=False)
    obj = Objective(model=model, loss_fn=gaussian_nll, num_data=n)
    steps = 500
    method = mfvi.build(obj, Adam(lr=cosine(0.05, steps)), num_mc_samples=4, init_std=0.1, prior_std=s)
    state = method.init(trainable_params(model), {})
    for _ in range(steps):
        state, _ = method.update(state, (X, y))
    mean = state.params["mean/weight"][0]
    std = F.softplus(state.params["rho/weight"][0])
    # tolerance: 0.2 posterior standard deviations for the mean, 12% for the standard deviations
    assert ((mean - post_mean).abs() / post_std).max() < 0.2, (mean, post_mean)
    assert ((std / post_std) - 1).abs().max() < 0.12, (std, post_std)


# ------------------------------------------------------------------------------------------------
# SWAG initialization


def test_init_from_swag_reproduces_the_swag_covariance():
    # flat SWAG vectors follow the model's parameter order; keep it sorted here so that it is also
    # the layout of dense_covariance
    params = _tiny_params()
    like = {"fc.bias": params["fc.bias"], "fc.weight": params["fc.weight"]}
    d, k, scale = 15, 4, 0.5
    g = torch.Generator().manual_seed(5)
    mean = torch.randn(d, generator=g)
    var = torch.rand(d, generator=g) + 0.1
    dev = torch.randn(k, d, generator=g)
    theta = lowrank_vi.init_from_swag(mean, var, dev, like, scale=scale)
    swag_cov = scale * 0.5 * (torch.diag(var) + dev.T @ dev / (k - 1))
    torch.testing.assert_close(lowrank_vi.dense_covariance(theta), swag_cov)
    torch.testing.assert_close(flatten(section(theta, "mean")), mean)
    # dict inputs by parameter name give the same θ
    dev_dict = {"fc.bias": dev[:, :3], "fc.weight": dev[:, 3:].reshape(k, 3, 4)}
    theta2 = lowrank_vi.init_from_swag(unflatten(mean, like), unflatten(var, like), dev_dict, like, scale=scale)
    for key in theta:
        torch.testing.assert_close(theta2[key], theta[key])
    # the posterior starts from it (rank must match)
    method = lowrank_vi.build(Objective(model=_Tiny()), Adam(), rank=k)
    state = method.init(theta, {})
    torch.testing.assert_close(lowrank_vi.dense_covariance(state.params), swag_cov)
    with pytest.raises(FlatbmaError, match=r"method\.rank is 5"):
        lowrank_vi.build(Objective(model=_Tiny()), Adam(), rank=5).init(theta, {})
    with pytest.raises(FlatbmaError, match="at least 2"):
        lowrank_vi.init_from_swag(mean, var, dev[:1], like)


# ------------------------------------------------------------------------------------------------
# state: save → load → sample, resume


@pytest.mark.parametrize("module", [mfvi, lowrank_vi])
@pytest.mark.parametrize("ascent", [None, SAM(rho=0.05)])
def test_save_load_sample_and_resume_are_exact(tmp_path, module, ascent):
    torch.manual_seed(0)
    model = tiny_bn_net()
    model.train()
    obj = Objective(model=model, num_data=64)
    method = module.build(obj, Adam(lr=1e-2), ascent, num_mc_samples=2, init_std=0.05)
    state = method.init(trainable_params(model), model_buffers(model))
    for seed in range(3):
        state, _ = method.update(state, toy_batch(seed=seed))
    save_state(state, tmp_path / "s.safetensors")
    loaded = load_state(tmp_path / "s.safetensors")
    a = method.sample(state, 3, torch.Generator().manual_seed(7))
    b = method.sample(loaded, 3, torch.Generator().manual_seed(7))
    for wa, wb in zip(a, b):
        assert wa.keys() == wb.keys() and set(model.state_dict()) == set(wa)
        for k in wa:
            assert torch.equal(wa[k], wb[k])
    assert not torch.equal(a[0]["0.weight"], a[1]["0.weight"])
    # one more step from the original and from the loaded state: identical (same training noise)
    s1, _ = method.update(state, toy_batch(seed=9))
    s2, _ = method.update(loaded, toy_batch(seed=9))
    for k in s1.params:
        assert torch.equal(s1.params[k], s2.params[k])


# ------------------------------------------------------------------------------------------------
# options and registry


def test_options_are_validated_with_config_keys():
    obj = Objective(model=_Tiny())
    with pytest.raises(FlatbmaError, match=r"method\.rank must be an integer >= 2"):
        lowrank_vi.build(obj, Adam(), rank=1)
    with pytest.raises(FlatbmaError, match=r"method\.num_mc_samples"):
        mfvi.build(obj, Adam(), num_mc_samples=0)
    with pytest.raises(FlatbmaError, match=r"method\.init_std"):
        mfvi.build(obj, Adam(), init_std=0.0)
    with pytest.raises(FlatbmaError, match=r"method\.prior_std"):
        lowrank_vi.build(obj, Adam(), prior_std=-1.0)
    with pytest.raises(FlatbmaError, match=r"method\.kl_weight"):
        mfvi.build(obj, Adam(), kl_weight=-0.1)
    with pytest.raises(FlatbmaError, match="init_std"):
        parse_method({"name": "mfvi", "init_sdt": 0.1})


def test_flat_variants_are_the_same_family_with_sam():
    assert METHODS["f-mfvi"].family.build is METHODS["mfvi"].family.build is mfvi.build
    assert METHODS["f-lowrank-vi"].family.build is METHODS["lowrank-vi"].family.build is lowrank_vi.build
    assert METHODS["f-mfvi"].ascent is SAM and METHODS["mfvi"].ascent is None
    cfg = parse_method({"name": "f-lowrank-vi", "rank": 3, "rho": 0.1})
    assert cfg.options["rank"] == 3 and cfg.ascent == SAM(rho=0.1)
    assert cfg.build(Objective(model=_Tiny()), Adam()).recompute_bn


# ------------------------------------------------------------------------------------------------
# end to end on digits


def _cli_run(tmp_path, method, lr, epochs=3):
    cfg = {
        "seed": 0,
        "method": method,
        "data": {"name": "digits", "batch_size": 64},
        "model": {"name": "mlp"},
        "optim": {"name": "adam", "lr": lr, "weight_decay": 0.0},
        "train": {"epochs": epochs, "progress": False},
        "eval": {"num_samples": 3},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    assert main(["train", "--config", str(path), "--set", f"output_dir={out}"]) == 0
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "lr", "min_acc"),
    [
        ({"name": "mfvi"}, 0.01, 0.9),
        ({"name": "f-mfvi", "rho": 0.05}, 0.01, 0.9),
        ({"name": "lowrank-vi", "rank": 3}, 0.003, 0.8),
        ({"name": "f-lowrank-vi", "rank": 3, "rho": 0.05}, 0.003, 0.8),
    ],
)
def test_trains_on_digits_via_cli(tmp_path, capsys, method, lr, min_acc):
    metrics = _cli_run(tmp_path, method, lr)
    assert metrics["accuracy"] > min_acc, metrics["accuracy"]
    assert metrics["history"][-1]["loss"] < metrics["history"][0]["loss"]


def test_kl_between_two_lowrank_gaussians_matches_torch_with_narrow_triangular_solves(monkeypatch):
    """``kl_lowrank`` against torch.distributions' dense KL; its triangular solves take ``K_p`` columns, never ``d``.

    cuBLAS's triangular solve with ``d`` right-hand sides took 6.5 s per call on an H200 for ResNet-18's 11.2M
    weights (docs/gpu.md): ``tr(XᵀC⁻¹X)`` of a wide ``X`` is formed from ``XXᵀ`` instead.
    """
    from flatbma.gaussian import dense_covariance, kl_lowrank

    g = torch.Generator().manual_seed(3)

    def theta(k):
        return {
            "mean/w": torch.randn(40, generator=g, dtype=torch.float64),
            "log_std/w": torch.randn(40, generator=g, dtype=torch.float64) * 0.3 - 1.0,
            "factor/w": torch.randn(k, 40, generator=g, dtype=torch.float64) * 0.4,
        }

    q, p = theta(4), theta(3)
    columns = []
    solve = torch.linalg.solve_triangular
    monkeypatch.setattr(
        torch.linalg, "solve_triangular", lambda a, b, **kw: columns.append(b.shape[1]) or solve(a, b, **kw)
    )
    kl = kl_lowrank(q, p)
    assert columns and max(columns) <= 3
    expected = kl_divergence(
        MultivariateNormal(q["mean/w"], dense_covariance(q)), MultivariateNormal(p["mean/w"], dense_covariance(p))
    )
    assert float(kl) == pytest.approx(float(expected), rel=1e-10)
