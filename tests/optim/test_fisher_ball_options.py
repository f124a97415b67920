"""FP-BMA's ascent in the weights' units (``radius``), on the mean alone (``blocks: mean``), along the authors'
score direction (``direction: score``), and the record of every step's size — each against a dense computation."""

import math

import pytest
import torch
from torch.distributions import MultivariateNormal

from flatbma.errors import FlatbmaError
from flatbma.gaussian import dense_covariance, kl_lowrank, log_density, score, section, step_size
from flatbma.methods import parse_method
from flatbma.optim import SAM, Amortized, FisherBall
from flatbma.optim.fisher_ball import DEFAULT_RADIUS
from flatbma.params import Objective, add, flatten
from flatbma.posteriors import lowrank_vi
from flatbma.posteriors.gaussian_vi import elbo_value_and_grad, theta_sharpness_value_and_grad
from tests.helpers import tiny_bn_net, toy_batch

SHAPES = {"fc.bias": (3,), "fc.weight": (3, 2)}  # d = 9, sorted names
K = 3


def _theta(seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = {}
    for n, shape in SHAPES.items():
        theta[f"mean/{n}"] = torch.randn(shape, generator=g, dtype=torch.float64) * 0.5
        theta[f"log_std/{n}"] = torch.randn(shape, generator=g, dtype=torch.float64) * 0.3 - 1.0
        theta[f"factor/{n}"] = torch.randn((K, *shape), generator=g, dtype=torch.float64) * 0.4
    return theta


def _flat(theta, prefix):
    return flatten(section(theta, prefix))


def _weights(seed=1):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g, dtype=torch.float64) for n, shape in SHAPES.items()}


def _dense_log_q(theta, weights):
    return MultivariateNormal(_flat(theta, "mean"), dense_covariance(theta)).log_prob(flatten(weights))


def _grads(seed=2):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in _theta().items()}


# ------------------------------------------------------------------------------------------------
# log q, its score, and the size of a step


def test_log_density_and_its_score_match_the_dense_gaussian():
    theta, w = _theta(), _weights()
    torch.testing.assert_close(log_density(theta, w), _dense_log_q(theta, w), rtol=1e-12, atol=1e-12)
    leaves = {k: v.clone().requires_grad_(True) for k, v in theta.items()}
    expected = torch.autograd.grad(_dense_log_q(leaves, w), list(leaves.values()))
    s = score(theta, w)  # rows [μ; log σ; L] in sorted name order
    names = list(SHAPES)
    by_key = {
        **{f"mean/{n}": s[0, o : o + math.prod(SHAPES[n])] for n, o in zip(names, (0, 3), strict=True)},
        **{f"log_std/{n}": s[1, o : o + math.prod(SHAPES[n])] for n, o in zip(names, (0, 3), strict=True)},
        **{f"factor/{n}": s[2:, o : o + math.prod(SHAPES[n])] for n, o in zip(names, (0, 3), strict=True)},
    }
    for (key, _), e in zip(leaves.items(), expected, strict=True):
        torch.testing.assert_close(by_key[key].reshape(e.shape), e, rtol=1e-10, atol=1e-10)
    # the mean block in closed form: Σ⁻¹(w − μ)
    sigma = dense_covariance(theta)
    by_hand = torch.linalg.solve(sigma, flatten(w) - _flat(theta, "mean"))
    torch.testing.assert_close(s[0], by_hand, rtol=1e-10, atol=1e-10)


def test_step_size_is_the_mean_shift_the_exact_kl_and_the_mean_share():
    theta = _theta()
    delta = {k: 0.05 * v for k, v in _grads().items()}
    moved = add(theta, delta)
    size = step_size(theta, moved)
    d_mu = _flat(delta, "mean")
    torch.testing.assert_close(size["mean_shift"], torch.linalg.vector_norm(d_mu))
    torch.testing.assert_close(size["kl"], kl_lowrank(moved, theta).double())
    expected = 0.5 * d_mu @ torch.linalg.solve(dense_covariance(theta), d_mu)
    torch.testing.assert_close(size["kl_mean"], expected, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# the step's options


def test_radius_sets_the_mean_shift_along_the_same_direction_as_gamma():
    theta, g = _theta(), _grads()
    by_gamma = FisherBall(gamma=0.01, max_kl_ratio=math.inf).perturb(theta, g)
    by_radius = FisherBall(radius=0.3, max_kl_ratio=math.inf).perturb(theta, g)
    assert float(torch.linalg.vector_norm(_flat(by_radius, "mean"))) == pytest.approx(0.3, rel=1e-9)
    a, b = flatten(by_gamma), flatten(by_radius)
    assert float(a @ b / (a.norm() * b.norm())) == pytest.approx(1.0, abs=1e-12)  # the same δ, rescaled


def test_blocks_mean_moves_the_mean_alone_by_the_exact_kl_gamma():
    theta, g = _theta(), _grads()
    gamma = 0.2
    delta = FisherBall(gamma=gamma, blocks="mean").perturb(theta, g)
    assert all(float(delta[k].abs().max()) == 0.0 for k in delta if not k.startswith("mean/"))
    sigma = dense_covariance(theta)
    d_mu = _flat(delta, "mean")
    expected_direction = sigma @ _flat(g, "mean")  # Σ g_μ
    assert float(d_mu @ expected_direction / (d_mu.norm() * expected_direction.norm())) == pytest.approx(1.0)
    assert float(kl_lowrank(add(theta, delta), theta)) == pytest.approx(gamma, rel=1e-9)  # a mean shift is exact
    by_radius = FisherBall(radius=0.05, blocks="mean").perturb(theta, g)
    assert float(torch.linalg.vector_norm(_flat(by_radius, "mean"))) == pytest.approx(0.05, rel=1e-9)


def test_score_direction_is_a_euclidean_step_of_the_radius_per_block_along_the_score():
    theta, w = _theta(), _weights()
    rho = 0.1
    delta = FisherBall(radius=rho, direction="score").perturb_sample(theta, w)
    leaves = {k: v.clone().requires_grad_(True) for k, v in theta.items()}
    s = dict(zip(leaves, torch.autograd.grad(_dense_log_q(leaves, w), list(leaves.values())), strict=True))
    for prefix in ("mean", "log_std", "factor"):  # by hand: ρ·s_b/‖s_b‖, each block one vector over all weights
        block = torch.cat([s[k].reshape(-1) for k in sorted(s) if k.startswith(prefix + "/")])
        got = torch.cat([delta[k].reshape(-1) for k in sorted(delta) if k.startswith(prefix + "/")])
        torch.testing.assert_close(got, rho * block / block.norm(), rtol=1e-10, atol=1e-12)
    mean_only = FisherBall(radius=rho, direction="score", blocks="mean").perturb_sample(theta, w)
    assert float(torch.linalg.vector_norm(_flat(mean_only, "mean"))) == pytest.approx(rho)
    assert float(flatten({k: v for k, v in mean_only.items() if not k.startswith("mean/")}).abs().max()) == 0.0


def test_the_score_step_is_the_elbo_gradient_at_the_perturbed_theta_with_the_same_noise():
    torch.manual_seed(0)
    model = tiny_bn_net(in_features=4, classes=3).double()
    objective = Objective(model=model, num_data=16)
    family = lowrank_vi.LowRankGaussian(rank=3, init_std=0.05, prior_std=1.0)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    theta = family.init_theta(params, torch.Generator().manual_seed(1))
    noise = family.noise(theta, torch.Generator().manual_seed(2))
    x, y = toy_batch(n=16, in_features=4, classes=3)
    batch = (x.double(), y)
    ascent = FisherBall(radius=0.1, direction="score")
    record = {}
    model.train()
    loss, _, grads = theta_sharpness_value_and_grad(
        objective, family, theta, dict(buffers), batch, [noise], ascent=ascent, kl_weight=0.0, record=record
    )
    w = family.reparameterize(theta, noise)
    delta = ascent.perturb_sample(theta, w)
    expected_loss, _ = objective.loss(w, dict(buffers), batch)
    moved = add(theta, delta)
    _, _, expected = elbo_value_and_grad(objective, family, moved, dict(buffers), batch, [noise], kl_weight=0.0)
    assert float(loss) == pytest.approx(float(expected_loss))  # the step's loss: at θ, forward only
    for k in theta:
        torch.testing.assert_close(grads[k], expected[k])
    assert float(record["mean_shift"]) == pytest.approx(0.1)  # the record: this step's size
    assert float(record["kl"]) == pytest.approx(float(kl_lowrank(add(theta, delta), theta)))


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"gamma": 1.0, "radius": 0.1}, "not both"),
        ({"direction": "score"}, "give radius"),
        ({"radius": 0.1, "metric": "euclidean"}, "radius applies to metric: fisher"),
        ({"gamma": 1.0, "blocks": "mean", "metric": "euclidean"}, "blocks: mean applies"),
        ({"radius": -1.0}, "radius must be a positive number"),
        ({"direction": "uphill", "radius": 0.1}, "direction must be one of"),
    ],
)
def test_bad_option_combinations_are_refused_in_one_line(options, words):
    with pytest.raises(FlatbmaError, match=words):
        FisherBall(**options)


def test_the_score_direction_refuses_amortizing_and_several_samples():
    with pytest.raises(FlatbmaError, match="no second pass to amortize"):
        Amortized(FisherBall(radius=0.1, direction="score"), ascent_every=5)
    with pytest.raises(FlatbmaError, match="num_mc_samples"):
        parse_method({"name": "fp-bma", "radius": 0.1, "direction": "score", "num_mc_samples": 2}).build(
            Objective(model=tiny_bn_net()), SAM(rho=0.1)
        )
    with pytest.raises(FlatbmaError, match="perturb_sample"):
        FisherBall(radius=0.1, direction="score").perturb(_theta(), _grads())


def test_sections_without_the_new_options_resolve_exactly_as_before():
    # runs resolved before radius/direction/blocks existed must stay the same runs (compare reuses them)
    section = parse_method({"name": "fp-bma", "rank": 5, "gamma": 0.01}).to_dict()
    assert section == {
        "name": "fp-bma",
        "rank": 5,
        "num_mc_samples": 1,
        "init_std": 1e-3,
        "prior_std": 1.0,
        "kl_weight": 1.0,
        "variance_step": "natural",  # a family option (issue #35)
        "gamma": 0.01,
        "metric": FisherBall().metric,
        "cg_iters": 20,
        "cg_tol": 1e-3,
        "damping": 1e-2,
        "eta": 1.0,
        "max_kl_ratio": 2.0,
    }
    with_radius = parse_method({"name": "fp-bma", "radius": 0.05, "blocks": "mean"}).to_dict()
    assert with_radius["gamma"] is None and with_radius["radius"] == 0.05 and with_radius["blocks"] == "mean"
    assert "direction" not in with_radius


def test_the_default_step_is_sams_radius_in_the_weights_units_in_every_metric():
    # issue #22: the former default gamma = 0.01 moved the mean by ~0.001 on the transfer demo; the default is
    # now SAM's rho = 0.05 in the weights' units, whatever q's width
    theta, g = _theta(), _grads()
    default = FisherBall()
    assert default.radius == DEFAULT_RADIUS == 0.05 and default.gamma is None and default.rho == 0.05
    step = FisherBall(max_kl_ratio=math.inf).perturb(theta, g)  # (the trust region may only shorten it)
    assert float(torch.linalg.vector_norm(_flat(step, "mean"))) == pytest.approx(0.05, rel=1e-6)
    assert float(torch.linalg.vector_norm(_flat(default.perturb(theta, g), "mean"))) <= 0.05 + 1e-9
    for metric in ("euclidean", "data-fisher"):  # a ball of radius sqrt(2 gamma) in their own metric
        ball = FisherBall(metric=metric)
        assert ball.radius is None and ball.rho == pytest.approx(0.05, rel=1e-12)
    section = parse_method({"name": "fp-bma"}).to_dict()
    assert section["gamma"] is None and section["radius"] == 0.05
    # an explicit gamma keeps its meaning (and its resolved config: the studies' runs are reused)
    assert parse_method({"name": "fp-bma", "gamma": 0.01}).to_dict()["gamma"] == 0.01
