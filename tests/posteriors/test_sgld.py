import dataclasses
import json
import math

import pytest
import torch
import yaml
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.run.checkpoint import save_state
from flatbma.methods import METHODS, parse_method
from flatbma.named import part, typed
from flatbma.optim import SAM, SGD, Adam
from flatbma.params import Objective, trainable_params
from flatbma.posteriors import sgld
from tests.helpers import load_state, tiny_bn_net, toy_batch

# A 2-D Gaussian target N(μ, Σ): U(w) = ½ (w − μ)ᵀ P (w − μ), P = Σ⁻¹ (n = 1, flat prior).
MU = torch.tensor([1.0, -2.0], dtype=torch.float64)
SIGMA = torch.tensor([[1.0, 0.5], [0.5, 2.0]], dtype=torch.float64)
PRECISION = torch.linalg.inv(SIGMA)
NO_DATA = (torch.zeros(1, 1), torch.zeros(1))


class Chains(nn.Module):
    """``C`` independent copies of a 2-D weight; the potential is a sum over chains, so SGLD on the
    product space runs ``C`` independent chains at once (vectorized)."""

    def __init__(self, chains: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(chains, 2, dtype=torch.float64))

    def forward(self, x):
        return self.w


def gaussian_objective(chains: int) -> Objective:
    def loss_fn(w, y):
        d = w - MU
        pd = d[:, :1] * PRECISION[0] + d[:, 1:] * PRECISION[1]  # d @ P without BLAS (2 columns)
        return 0.5 * (pd * d).sum()

    return Objective(model=Chains(chains), loss_fn=loss_fn, num_data=1)


def run_chain(method, obj, steps):
    state = method.init(trainable_params(obj.model), {})
    for _ in range(steps):
        state, _ = method.update(state, NO_DATA)
    return state


def pooled(state):
    """All stored iterates of all chains: ``[S·C, 2]``."""
    return sgld.stored_samples(state)["w"].reshape(-1, 2)


def mean_and_cov(x):
    m = x.mean(0)
    d = x - m
    return m, d.T @ d / (len(x) - 1)


FLAT = {"prior_std": math.inf, "lr_scale": "potential"}


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sgld_recovers_the_mean_and_tempered_covariance_of_a_gaussian(temperature):
    # ε = 0.02: the discretization inflates the covariance by (I − εP/2)⁻¹, at most 1.3 % here.
    # 4000 chains × 10 samples thinned by 60 steps after 700 burn-in steps (≥ 6 relaxation times 1/(ε λ_min(P))
    # of the slowest direction): the MC standard error of the covariance is ≤ 1.5 %; tolerance 5 % of max Σ.
    obj = gaussian_objective(4000)
    method = sgld.build(obj, SGD(lr=0.02), temperature=temperature, burn_in=700, thin=60, max_samples=10, **FLAT)
    state = run_chain(method, obj, 700 + 10 * 60)
    assert int(state.aux[sgld.COUNT_KEY]) == 10
    mean, cov = mean_and_cov(pooled(state))
    torch.testing.assert_close(mean, MU, atol=0.05, rtol=0)
    torch.testing.assert_close(cov, temperature * SIGMA, atol=0.05 * temperature * SIGMA.max(), rtol=0)


def test_csgld_recovers_the_gaussian_at_cycle_ends_and_explores_without_noise():
    # cycles of L = 400 steps, ε₀ = 0.25, exploration 0.5: the sampling stage integrates
    # Σε = L ε₀ ½(½ − 1/π) ≈ 9.1 time units, so each cycle end is equilibrated to e^{−2 λ_min(P) 9.1} ≈ 3e-4
    # (starting from the collapsed mode), and the vanishing step size at the cycle end removes the
    # discretization bias. 2 cycles × 8000 chains; tolerance 5 % of max Σ.
    cycle, chains = 400, 8000
    obj = gaussian_objective(chains)
    method = sgld.build_cyclical(
        obj, SGD(lr=0.25), cycle_length=cycle, exploration=0.5, samples_per_cycle=1, max_samples=10, **FLAT
    )
    state = run_chain(method, obj, cycle // 2)
    # the exploration stage is noise-free gradient descent: all chains have collapsed onto the mode μ
    torch.testing.assert_close(state.params["w"], MU.expand(chains, 2), atol=1e-6, rtol=0)
    assert int(state.aux[sgld.COUNT_KEY]) == 0
    for _ in range(cycle // 2 + cycle):
        state, _ = method.update(state, NO_DATA)
    assert int(state.aux[sgld.COUNT_KEY]) == 2  # one sample at the end of each cycle
    mean, cov = mean_and_cov(pooled(state))
    torch.testing.assert_close(mean, MU, atol=0.05, rtol=0)
    torch.testing.assert_close(cov, SIGMA, atol=0.05 * SIGMA.max(), rtol=0)


def test_sgld_step_is_the_langevin_update_with_the_prior_and_n():
    n, sigma, lr, temp = 50, 2.0, 0.1, 0.5
    w0 = torch.tensor([[0.3, -0.7]], dtype=torch.float64)
    obj = gaussian_objective(1)
    obj = Objective(model=obj.model, loss_fn=obj.loss_fn, num_data=n)
    obj.model.w.data.copy_(w0)
    for lr_scale, eps in (("potential", lr), ("mean", lr / n)):
        method = sgld.build(
            obj, SGD(lr=lr), prior_std=sigma, temperature=temp, lr_scale=lr_scale, burn_in=1000, thin=100
        )
        state = method.init(trainable_params(obj.model), {})
        torch.manual_seed(3)
        state, out = method.update(state, NO_DATA)
        torch.manual_seed(3)
        xi = torch.randn_like(w0)
        grad_u = n * (w0 - MU) @ PRECISION + w0 / sigma**2
        expected = w0 - eps * grad_u + math.sqrt(2 * eps * temp) * xi
        torch.testing.assert_close(state.params["w"], expected)
        torch.testing.assert_close(out.loss, 0.5 * (w0 - MU)[0] @ PRECISION @ (w0 - MU)[0])


def test_f_sgld_takes_the_sam_gradient_plus_noise():
    n, lr, rho = 10, 0.01, 0.3
    w0 = torch.tensor([[0.3, -0.7]], dtype=torch.float64)
    obj = gaussian_objective(1)
    obj = Objective(model=obj.model, loss_fn=obj.loss_fn, num_data=n)
    obj.model.w.data.copy_(w0)
    method = sgld.build(obj, SGD(lr=lr), SAM(rho=rho), prior_std=math.inf, lr_scale="potential", burn_in=1000, thin=100)
    state = method.init(trainable_params(obj.model), {})
    torch.manual_seed(5)
    state, _ = method.update(state, NO_DATA)
    torch.manual_seed(5)
    xi = torch.randn_like(w0)
    g = (w0 - MU) @ PRECISION
    perturbed = w0 + rho * g / g.norm()
    expected = w0 - lr * n * (perturbed - MU) @ PRECISION + math.sqrt(2 * lr) * xi
    torch.testing.assert_close(state.params["w"], expected)


def test_burn_in_thinning_and_ring_buffer():
    obj = gaussian_objective(1)
    method = sgld.build(obj, SGD(lr=0.01), burn_in=3, thin=2, max_samples=3)
    state = method.init(trainable_params(obj.model), {})
    history = []
    for _ in range(13):
        state, _ = method.update(state, NO_DATA)
        history.append(state.params["w"].clone())
    # stored after steps 5, 7, 9, 11, 13 (1-based); the ring keeps the last three, oldest first
    assert int(state.aux[sgld.COUNT_KEY]) == 5
    chain = typed(sgld.Chain, part(sgld.NAME, state.aux))  # its typed state: sgld/collected, sgld/samples/<name>
    assert int(chain.collected) == 5 and chain.samples["w"].shape == (3, 1, 2)
    assert chain.samples["w"] is state.aux["sgld/samples/w"]
    expected = torch.stack([history[8], history[10], history[12]])
    torch.testing.assert_close(sgld.stored_samples(state)["w"], expected)
    # sample: evenly spaced from the oldest to the latest (the latest for n = 1); n is capped
    picks = method.sample(state, 1, None)
    torch.testing.assert_close(picks[0]["w"], history[12])
    assert len(method.sample(state, 10, None)) == 3
    torch.testing.assert_close(torch.stack([s["w"] for s in method.sample(state, 2, None)]), expected[[0, 2]])


def test_a_chain_that_records_iterates_it_does_not_hold_is_refused_in_one_line():
    """A state whose ``sgld/collected`` counts iterates with no ``sgld/samples/`` entries (another layout's)."""
    obj = gaussian_objective(1)
    method = sgld.build(obj, SGD(lr=0.01), burn_in=1, thin=1, max_samples=3)
    state = method.init(trainable_params(obj.model), {})
    for _ in range(3):  # iterates stored after steps 2 and 3
        state, _ = method.update(state, NO_DATA)
    stale = {k: v for k, v in state.aux.items() if not k.startswith("sgld/samples/")}
    stale["samples/w"] = state.aux["sgld/samples/w"]
    for call in (lambda s: method.sample(s, 1, None), lambda s: method.update(s, NO_DATA)):
        with pytest.raises(FlatbmaError, match="records 2 stored iterates but holds none"):
            call(dataclasses.replace(state, aux=stale))


def test_csgld_stores_samples_per_cycle_evenly_in_the_sampling_stage():
    obj = gaussian_objective(1)
    # L = 10, exploration 0.4: sampling stage = positions 4..9; 3 samples, spacing 2 → positions 5, 7, 9
    method = sgld.build_cyclical(obj, SGD(lr=0.01), cycle_length=10, exploration=0.4, samples_per_cycle=3)
    state = method.init(trainable_params(obj.model), {})
    stored_at = []
    for t in range(20):
        before = int(state.aux[sgld.COUNT_KEY])
        state, _ = method.update(state, NO_DATA)
        if int(state.aux[sgld.COUNT_KEY]) > before:
            stored_at.append(t)
    assert stored_at == [5, 7, 9, 15, 17, 19]


def test_csgld_step_size_is_cosine_cyclical_with_noise_only_in_the_sampling_stage():
    obj = gaussian_objective(1)
    lr, cycle = 0.2, 8
    method = sgld.build_cyclical(
        obj, SGD(lr=lr), cycle_length=cycle, exploration=0.75, prior_std=math.inf, lr_scale="potential"
    )
    state = method.init(trainable_params(obj.model), {})
    for t in range(2 * cycle):
        w = state.params["w"].clone()
        torch.manual_seed(t)
        state, _ = method.update(state, NO_DATA)
        eps = lr / 2 * (math.cos(math.pi * (t % cycle) / cycle) + 1)
        expected = w - eps * (w - MU) @ PRECISION
        if t % cycle >= 6:  # sampling stage r ≥ 0.75: Langevin noise √(2ε) ξ
            torch.manual_seed(t)
            expected = expected + math.sqrt(2 * eps) * torch.randn_like(w)
        torch.testing.assert_close(state.params["w"], expected)


def test_no_samples_yet_is_a_clear_error():
    obj = gaussian_objective(1)
    method = sgld.build(obj, SGD(lr=0.01), burn_in=100, thin=10)
    state = run_chain(method, obj, 5)
    with pytest.raises(FlatbmaError, match=r"method\.burn_in"):
        method.sample(state, 3, None)
    method = sgld.build_cyclical(obj, SGD(lr=0.01), cycle_length=100)
    state = run_chain(method, obj, 5)
    with pytest.raises(FlatbmaError, match=r"method\.cycle_length"):
        method.sample(state, 3, None)


@pytest.mark.parametrize(
    ("builder", "options", "key"),
    [
        (sgld.build, {"temperature": 0.0}, "method.temperature"),
        (sgld.build, {"temperature": -1.0}, "method.temperature"),
        (sgld.build, {"prior_std": 0.0}, "method.prior_std"),
        (sgld.build, {"prior_std": float("nan")}, "method.prior_std"),
        (sgld.build, {"lr_scale": "datum"}, "method.lr_scale"),
        (sgld.build, {"burn_in": -1, "thin": 1}, "method.burn_in"),
        (sgld.build, {"burn_in": 0, "thin": 0}, "method.thin"),
        (sgld.build, {"max_samples": 0}, "method.max_samples"),
        (sgld.build_cyclical, {"cycle_length": 0}, "method.cycle_length"),
        (sgld.build_cyclical, {"exploration": 1.0}, "method.exploration"),
        (sgld.build_cyclical, {"cycle_length": 10, "exploration": 0.8, "samples_per_cycle": 3}, "samples_per_cycle"),
    ],
)
def test_bad_options_name_their_key(builder, options, key):
    with pytest.raises(FlatbmaError, match=key.replace(".", r"\.")):
        builder(gaussian_objective(1), SGD(lr=0.01), **options)


def test_registry_and_config_parsing():
    assert METHODS["sgld"].family.build is sgld.build and METHODS["sgld"].ascent is None
    assert METHODS["f-sgld"].family.build is sgld.build and METHODS["f-sgld"].ascent is SAM
    assert METHODS["csgld"].family.build is sgld.build_cyclical
    cfg = parse_method(yaml.safe_load("{name: csgld, cycle_length: 50, prior_std: .inf, lr_scale: potential}"))
    assert cfg.options["cycle_length"] == 50 and cfg.options["exploration"] == 0.8
    assert cfg.options["prior_std"] == math.inf
    with pytest.raises(FlatbmaError, match="lr_scale"):
        parse_method({"name": "sgld", "lr_scale": "means"})


def test_save_load_sample_is_identical_and_bn_is_recomputed(tmp_path):
    net = tiny_bn_net()
    net.train()
    obj = Objective(model=net, num_data=100)
    method = sgld.build(obj, Adam(lr=0.01), burn_in=2, thin=2, max_samples=3)
    assert method.recompute_bn
    state = method.init(trainable_params(net), dict(net.named_buffers()))
    for i in range(8):
        state, _ = method.update(state, toy_batch(seed=i))
    save_state(state, tmp_path / "s.safetensors")
    loaded = load_state(tmp_path / "s.safetensors")
    a = method.sample(state, 3, torch.Generator().manual_seed(0))
    b = method.sample(loaded, 3, torch.Generator().manual_seed(1))
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and set(x) == {*dict(net.named_parameters()), *dict(net.named_buffers())}
        for k in x:
            assert torch.equal(x[k], y[k])
    assert not torch.equal(a[0]["0.weight"], a[2]["0.weight"])


DIGITS = {
    "seed": 0,
    "data": {"name": "digits", "batch_size": 64, "test_limit": 200},
    "model": {"name": "mlp", "width": 32},
    "optim": {"lr": 0.5, "schedule": "constant"},  # lr_scale "mean": ε = lr/n on U, an SGD-like step
    "train": {"epochs": 3, "progress": False, "device": "cpu"},
    "eval": {"num_samples": 4},
}


@pytest.mark.parametrize(
    "method",
    [
        {"name": "sgld", "burn_in": 19, "thin": 9},  # 3 epochs × 19 steps: stored after steps 28, 37, 46, 55
        {"name": "csgld", "cycle_length": 19, "exploration": 0.5, "samples_per_cycle": 2},  # 3 cycles × 2
        {"name": "f-sgld", "burn_in": 19, "thin": 9, "rho": 0.05},
    ],
)
def test_cli_trains_on_digits(tmp_path, capsys, method):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**DIGITS, "method": method}))
    out = tmp_path / "run"
    code = main(["train", "--config", str(cfg), "--set", f"output_dir={out}"])
    assert code == 0, capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_samples"] == 4
    assert metrics["accuracy"] > 0.5  # chance is 0.1


def test_lr_scale_is_an_enum_given_by_member_or_name():
    assert parse_method({"name": "sgld", "lr_scale": "potential"}).options["lr_scale"] is sgld.LrScale.POTENTIAL
    assert parse_method({"name": "csgld"}).options["lr_scale"] is sgld.LrScale.MEAN
    obj = dataclasses.replace(gaussian_objective(2), num_data=4)  # n > 1: the two scales differ
    chains = {}
    for scale in ("potential", sgld.LrScale.POTENTIAL, sgld.LrScale.MEAN):
        torch.manual_seed(0)  # the Langevin noise comes from the global generator
        method = sgld.build(obj, SGD(lr=1e-3), lr_scale=scale, burn_in=0, thin=1)
        chains[scale] = sgld.stored_samples(run_chain(method, obj, 3))["w"]
    assert torch.equal(chains["potential"], chains[sgld.LrScale.POTENTIAL])
    assert not torch.equal(chains["potential"], chains[sgld.LrScale.MEAN])


@pytest.mark.parametrize("steps", [8, 60, 380, 4001])
def test_auto_burn_in_and_thin_spread_the_kept_samples_over_the_second_half(steps):
    """``burn_in: auto`` is half the run, ``thin: auto`` spreads ``max_samples`` over the rest up to its end; the
    previous defaults (1000, 100) stored nothing in a run of fewer than 1,100 updates (digits: 380)."""
    from flatbma.methods import parse_method

    o = parse_method("sgld").resolved(steps).options
    assert o["burn_in"] == steps // 2 and o["thin"] == max(1, (steps - steps // 2) // 30)
    stored = sgld.samples_stored(steps, burn_in=o["burn_in"], thin=o["thin"])
    assert min(30, steps - steps // 2) <= stored < 60 and steps - (o["burn_in"] + stored * o["thin"]) < o["thin"]
    assert parse_method({"name": "sgld", "burn_in": 7, "thin": 3}).resolved(steps).options["thin"] == 3
    with pytest.raises(FlatbmaError, match=r"method.burn_in: auto is resolved from the run's length"):
        sgld.build(gaussian_objective(1), SGD(lr=0.01))
