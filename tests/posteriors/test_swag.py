import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

import flatbma
from flatbma.bn import recompute_bn_statistics
from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.run.checkpoint import save_state
from flatbma.methods import METHODS, parse_method
from flatbma.models.small import SmallCNN
from flatbma.named import part, typed
from flatbma.optim import SAM, SGD
from flatbma.params import Objective, trainable_params
from flatbma.posteriors import point, swag
from flatbma.predict import evaluate
from tests.helpers import Scripted, TwoTensors, load_state, quadratic_objective, tiny_bn_net, toy_batch

# ----------------------------------------------------------------------------- helpers


def _scripted_run(num_updates, *, rank, start_step, collect_every, seed=0):
    g = torch.Generator().manual_seed(seed)
    iterates = [
        {
            "w": torch.randn(2, 3, generator=g, dtype=torch.float64),
            "b": torch.randn(4, generator=g, dtype=torch.float64),
        }
        for _ in range(num_updates)
    ]
    model = TwoTensors()
    objective = Objective(model=model, loss_fn=lambda out, y: out.square().mean())
    method = swag.build(objective, Scripted(iterates), rank=rank, start_step=start_step, collect_every=collect_every)
    state = method.init(trainable_params(model), {})
    batch = (torch.ones(3, 3, dtype=torch.float64), torch.zeros(3))
    for _ in range(num_updates):
        state, _ = method.update(state, batch)
    # snapshots: after update s = t+1 with s > start and (s - start) % every == 0, in sorted-name order (b, w)
    snaps = np.stack(
        [
            np.concatenate([iterates[t]["b"].numpy().ravel(), iterates[t]["w"].numpy().ravel()])
            for t in range(num_updates)
            if t + 1 > start_step and (t + 1 - start_step) % collect_every == 0
        ]
    )
    return state, snaps


def _numpy_deviations(snaps):
    return np.stack([snaps[i] - snaps[: i + 1].mean(0) for i in range(len(snaps))])


# ----------------------------------------------------------------------------- collection


def test_moments_of_a_known_sequence_of_iterates_equal_numpy():
    state, snaps = _scripted_run(14, rank=3, start_step=3, collect_every=2)
    assert len(snaps) == 5  # updates 5, 7, 9, 11, 13
    assert int(state.aux["swag/n_collected"]) == 5 and state.aux["swag/n_collected"].ndim == 0
    m = swag.swag_moments(state)
    assert m.names == ("b", "w")
    np.testing.assert_allclose(m.mean.numpy(), snaps.mean(0), rtol=1e-13, atol=1e-15)
    m2 = ((snaps - snaps.mean(0)) ** 2).sum(0)
    np.testing.assert_allclose(state.aux["swag/m2/b"].numpy(), m2[:4], rtol=1e-12)
    np.testing.assert_allclose(state.aux["swag/m2/w"].numpy().ravel(), m2[4:], rtol=1e-12)
    np.testing.assert_allclose(m.variance.numpy(), np.maximum(snaps.var(0), 1e-30), rtol=1e-10)
    np.testing.assert_allclose(state.aux["swag/mean/w"].numpy().ravel(), snaps.mean(0)[4:], rtol=1e-13)
    # deviations w_i - (running mean including w_i), the last K = 3 of them, oldest first
    np.testing.assert_allclose(m.deviations.numpy(), _numpy_deviations(snaps)[-3:], rtol=1e-12, atol=1e-14)


def test_variance_keeps_float32_accuracy_for_weights_near_one():
    """BatchNorm scales ≈ 1 moving by ~1e-4: ``mean(w²) − w̄²`` cancels to noise in float32, Welford does not."""
    g = np.random.default_rng(0)
    snaps = (1.0 + 1e-4 * g.standard_normal((40, 6))).astype(np.float32)
    objective = quadratic_objective(torch.eye(6), torch.zeros(6), torch.zeros(6))
    method = swag.build(objective, SGD(lr=0.1), rank=3, start_step=0, collect_every=10)
    state = method.init(trainable_params(objective.model), {})
    aux = dict(state.aux)
    moments = typed(swag.Moments, part(swag.SWAG, aux))  # the same tensors as aux's
    for w in snaps:
        swag._collect({"w": torch.from_numpy(w)}, moments)
    variance = swag.swag_moments(replace(state, aux=aux)).variance.numpy()
    np.testing.assert_allclose(variance, snaps.astype(np.float64).var(0), rtol=1e-3)


def test_deviation_ring_buffer_keeps_the_last_k():
    state, snaps = _scripted_run(14, rank=3, start_step=3, collect_every=2)
    devs = _numpy_deviations(snaps)
    raw = state.aux["swag/deviations"].numpy()
    assert raw.shape == (3, 10)
    # snapshot n goes to slot n mod K: slots hold snapshots 3, 4, 2 (0-based)
    np.testing.assert_allclose(raw, devs[[3, 4, 2]], rtol=1e-12, atol=1e-14)
    # before the buffer is full only the collected rows are used
    state, snaps = _scripted_run(8, rank=3, start_step=3, collect_every=2)
    m = swag.swag_moments(state)
    assert len(snaps) == 2 and m.deviations.shape == (2, 10)
    np.testing.assert_allclose(m.deviations.numpy(), _numpy_deviations(snaps), rtol=1e-12, atol=1e-14)


def test_start_step_zero_collects_from_the_first_window():
    state, snaps = _scripted_run(6, rank=2, start_step=0, collect_every=1)
    assert len(snaps) == 6 and int(state.aux["swag/n_collected"]) == 6


# ----------------------------------------------------------------------------- sampling


def _hand_built(d=5, k=3, n_collected=7, scale=0.7, diagonal_only=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    objective = quadratic_objective(
        torch.eye(d, dtype=torch.float64), torch.zeros(d), torch.zeros(d, dtype=torch.float64)
    )
    method = swag.build(
        objective, SGD(lr=0.1), rank=k, scale=scale, start_step=0, collect_every=10, diagonal_only=diagonal_only
    )
    state = method.init(trainable_params(objective.model), {})
    mean = torch.randn(d, generator=g, dtype=torch.float64)
    var = torch.rand(d, generator=g, dtype=torch.float64) + 0.1
    dev = torch.randn(k, d, generator=g, dtype=torch.float64)
    aux = {
        **state.aux,
        "swag/mean/w": mean,
        "swag/m2/w": var * n_collected,
        "swag/n_collected": torch.tensor(n_collected),
    }
    if not diagonal_only:
        aux["swag/deviations"] = dev
    return method, replace(state, aux=aux), mean, var, dev


def _check_gaussian(samples, mean, cov):
    x = torch.stack([s["w"] for s in samples])
    n = len(x)
    emp_mean, emp_cov = x.mean(0), torch.cov(x.T)
    sd_mean = (cov.diagonal() / n).sqrt()
    assert ((emp_mean - mean).abs() <= 5 * sd_mean).all(), (emp_mean - mean) / sd_mean
    v = cov.diagonal()
    sd_cov = ((v[:, None] * v[None, :] + cov**2) / n).sqrt()  # std of the sample covariance entries
    assert ((emp_cov - cov).abs() <= 5 * sd_cov).all(), (emp_cov - cov) / sd_cov


def test_samples_have_the_analytic_mean_and_covariance():
    method, state, mean, var, dev = _hand_built(scale=0.7)
    samples = method.sample(state, 20_000, torch.Generator().manual_seed(0))
    cov = 0.7 * 0.5 * (torch.diag(var) + dev.T @ dev / (3 - 1))
    _check_gaussian(samples, mean, cov)
    # the analytic accessors agree with what is sampled
    theta = method.can.gaussian(state)  # the low-rank VI layout: the same Gaussian
    factor = theta["factor/w"].reshape(3, 5).T
    sigma2 = theta["log_std/w"].exp() ** 2
    torch.testing.assert_close(0.5 * (torch.diag(sigma2) + factor @ factor.T / (3 - 1)), cov)
    torch.testing.assert_close(theta["mean/w"], mean)


def test_diagonal_only_and_too_few_deviations():
    method, state, mean, var, _ = _hand_built(scale=2.0, diagonal_only=True)
    assert "swag/deviations" not in state.aux
    samples = method.sample(state, 10_000, torch.Generator().manual_seed(1))
    _check_gaussian(samples, mean, 2.0 * 0.5 * torch.diag(var))
    # 2 snapshots with rank 3: the two stored deviations with K_eff - 1 = 1 in the denominator
    method, state, mean, var, dev = _hand_built(n_collected=2, scale=1.0)
    samples = method.sample(state, 10_000, torch.Generator().manual_seed(2))
    _check_gaussian(samples, mean, 0.5 * (torch.diag(var) + dev[:2].T @ dev[:2] / 1))


def test_sampling_is_reproducible_and_uses_only_the_generator():
    method, state, *_ = _hand_built()
    a = method.sample(state, 3, torch.Generator().manual_seed(5))
    torch.manual_seed(123)
    b = method.sample(state, 3, torch.Generator().manual_seed(5))
    assert all(torch.equal(x["w"], y["w"]) for x, y in zip(a, b))
    assert not torch.equal(a[0]["w"], a[1]["w"])


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"rank": 1}, "method.rank"),
        ({"rank": 2.5}, "method.rank"),
        ({"scale": 0.0}, "method.scale"),
        ({"start_step": -1}, "method.start_step"),
        ({"collect_every": 0}, "method.collect_every"),
    ],
)
def test_bad_options_name_their_key(options, key):
    objective = Objective(model=tiny_bn_net())
    with pytest.raises(FlatbmaError, match=re.escape(key)):
        swag.build(objective, SGD(), **{"start_step": 0, "collect_every": 10, **options})


def test_registry_options():
    assert {"swag", "swag-diag", "f-swag"} <= set(METHODS)
    assert METHODS["f-swag"].family.build is swag.build and METHODS["f-swag"].ascent is SAM
    assert set(METHODS["swag-diag"].family_options()) == {"scale", "start_step", "collect_every"}
    cfg = parse_method({"name": "swag-diag", "collect_every": 3})
    method = cfg.build(Objective(model=tiny_bn_net()), SGD(), map_steps=40)  # start_step: null, resolved from 40
    assert "swag/deviations" not in method.init(trainable_params(tiny_bn_net()), {}).aux
    with pytest.raises(FlatbmaError, match=r"method\.rank"):
        parse_method({"name": "swag-diag", "rank": 4})
    with pytest.raises(FlatbmaError, match=r"method\.rank"):
        parse_method({"name": "swag", "rank": 1}).build(Objective(model=tiny_bn_net()), SGD(), map_steps=40)


def test_too_few_snapshots_at_sample_time():
    net = tiny_bn_net()
    method = swag.build(Objective(model=net), SGD(lr=0.01), start_step=3, collect_every=2)
    state = method.init(trainable_params(net), {k: v.clone() for k, v in net.named_buffers()})
    for _ in range(5):
        state, _ = method.update(state, toy_batch())
    assert int(state.aux["swag/n_collected"]) == 1
    with pytest.raises(FlatbmaError) as err:
        method.sample(state, 2, torch.Generator().manual_seed(0))
    msg = str(err.value)
    for text in ("collected 1 snapshot", "method.start_step=3", "method.collect_every=2", "train.epochs"):
        assert text in msg
    with pytest.raises(FlatbmaError, match="collected 1 snapshot"):
        swag.swag_moments(state)


# ----------------------------------------------------------------------------- training


def test_trajectory_is_the_point_update_and_f_swag_is_sam():
    batches = [toy_batch(seed=s) for s in range(6)]

    def run(build, ascent):
        torch.manual_seed(0)
        net = tiny_bn_net()
        options = {"start_step": 0, "collect_every": 10} if build is swag.build else {}
        method = build(Objective(model=net), SGD(lr=0.1), ascent, **options)
        state = method.init(trainable_params(net), {k: v.clone() for k, v in net.named_buffers()})
        for b in batches:
            state, _ = method.update(state, b)
        return state

    swag_sgd, swag_sam = run(swag.build, None), run(swag.build, SAM(rho=0.1))
    map_sgd, map_sam = run(point.build, None), run(point.build, SAM(rho=0.1))
    for k in map_sgd.params:
        torch.testing.assert_close(swag_sgd.params[k], map_sgd.params[k], rtol=0, atol=0)
        torch.testing.assert_close(swag_sam.params[k], map_sam.params[k], rtol=0, atol=0)
    assert not torch.equal(swag_sgd.params["0.weight"], swag_sam.params["0.weight"])
    own = part(swag.POINT, swag_sgd.aux)  # the point's state under its name (optax's named_chain)
    assert own.keys() == map_sgd.aux.keys() and all(torch.equal(own[k], map_sgd.aux[k]) for k in own)


def test_save_load_sample_is_identical(tmp_path):
    net = tiny_bn_net()
    net.train()
    method = swag.build(Objective(model=net), SGD(lr=0.05), rank=3, start_step=2, collect_every=1)
    state = method.init(trainable_params(net), {k: v.clone() for k, v in net.named_buffers()})
    for s in range(8):
        state, _ = method.update(state, toy_batch(seed=s))
    save_state(state, tmp_path / "s.safetensors")
    loaded = load_state(tmp_path / "s.safetensors")
    assert loaded.step == state.step and int(loaded.aux["swag/n_collected"]) == 6
    a = method.sample(state, 4, torch.Generator().manual_seed(7))
    b = method.sample(loaded, 4, torch.Generator().manual_seed(7))
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_samples_of_a_batchnorm_cnn_get_recomputed_statistics():
    torch.manual_seed(0)
    model = SmallCNN(in_channels=1, num_classes=3, width=4)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(4)]
    method = swag.build(Objective(model=model), SGD(lr=0.05), rank=4, start_step=4, collect_every=2)
    assert method.recompute_bn
    state = method.init(trainable_params(model), {k: v.clone() for k, v in model.named_buffers()})
    model.train()
    for _ in range(4):
        for b in batches:
            state, _ = method.update(state, b)
    assert int(state.aux["swag/n_collected"]) == 6
    samples = method.sample(state, 2, torch.Generator().manual_seed(0))
    fixed = [recompute_bn_statistics(model, w, batches) for w in samples]
    key = "features.0.1.running_mean"
    assert torch.equal(samples[0][key], state.buffers[key])  # sampled weights come with the iterate's stats
    assert not torch.allclose(fixed[0][key], state.buffers[key])
    assert not torch.allclose(fixed[0][key], fixed[1][key])
    assert not torch.equal(samples[0]["classifier.weight"], samples[1]["classifier.weight"])
    metrics = evaluate(model, fixed, batches, num_classes=3)
    assert metrics["num_samples"] == 2 and math.isfinite(metrics["nll"])


# ----------------------------------------------------------------------------- CLI

DIGITS = {
    "seed": 0,
    "data": {"name": "digits", "batch_size": 64},
    "model": {"name": "mlp"},
    "optim": {"lr": 0.05, "schedule": "constant"},
    "train": {"epochs": 3, "progress": False},
    "eval": {"num_samples": 3},
}


@pytest.mark.parametrize(
    ("method", "model"),
    [
        ({"name": "swag", "rank": 5, "start_step": 25, "collect_every": 4}, {"name": "cnn", "width": 4}),
        ({"name": "swag-diag", "start_step": 25, "collect_every": 4}, {"name": "mlp"}),
        ({"name": "f-swag", "rho": 0.05, "rank": 5, "start_step": 25, "collect_every": 4}, {"name": "mlp"}),
    ],
)
def test_cli_trains_swag_on_digits(tmp_path, capsys, method, model):
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({**DIGITS, "method": method, "model": model}))
    out_dir = tmp_path / "run"
    code = main(["train", "--config", str(cfg_path), "--set", f"output_dir={out_dir}"])
    assert code == 0, capsys.readouterr().err
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["num_samples"] == 3 and metrics["accuracy"] > 0.6, metrics  # digits: chance is 0.1
    state = load_state(out_dir / "checkpoint.safetensors")
    steps_per_epoch = metrics["history"][0]["steps"]
    assert int(state.aux["swag/n_collected"]) == (3 * steps_per_epoch - 25) // 4
    assert ("swag/deviations" in state.aux) == (method["name"] != "swag-diag")


# ----------------------------------------------------------------------------- collect_every: auto


@pytest.mark.parametrize("steps", [80, 81, 97, 380, 1000, 4097])
@pytest.mark.parametrize(("name", "rank"), [("swag", 20), ("swag", 5), ("swag-diag", None)])
def test_auto_collects_rank_snapshots_spread_over_the_window_to_its_end(steps, name, rank):
    """``collect_every: auto`` (the default) over the last quarter: at least ``K`` snapshots, fewer than ``2K``, the
    last within ``collect_every`` updates of the run's end, the first within ``collect_every`` of the window's start."""
    section = {"name": name, **({"rank": rank} if rank is not None else {})}
    k = rank if rank is not None else swag.AUTO_SNAPSHOTS
    options = parse_method(section).resolved(steps).options
    start, every = options["start_step"], options["collect_every"]
    assert start == steps - steps // 4 and every == max(1, (steps // 4) // k)
    n = swag.snapshots(steps, start_step=start, collect_every=every)
    assert k <= n < 2 * k
    assert steps - (start + n * every) < every  # the last snapshot: within one interval of the end


def test_an_integer_collect_every_is_kept_and_auto_needs_the_run_length():
    for every in (1, 10):
        assert parse_method({"name": "swag", "collect_every": every}).resolved(380).options["collect_every"] == every
    multiswag = parse_method({"name": "multiswag"}).resolved(380).options["of"].options
    assert (multiswag["start_step"], multiswag["collect_every"]) == (285, 4)  # 95 window updates // 20
    with pytest.raises(FlatbmaError, match=r"collect_every: auto .* give collect_every$"):
        swag.build(Objective(model=tiny_bn_net()), SGD(lr=0.1), start_step=3)


def test_auto_trains_rank_snapshots_through_fit_posterior():
    """The issue-35 case in small: the default SWAG on a run of 80 updates is not refused and collects ``rank``."""
    x, y = toy_batch(n=160, seed=3)
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    bma = flatbma.fit_posterior(tiny_bn_net(), loader, "swag", epochs=8, lr=0.05, progress=False)
    assert int(bma.state.aux[swag.N_COLLECTED]) == 20
    assert bma.method_config["collect_every"] == 1 and bma.method_config["start_step"] == 60
