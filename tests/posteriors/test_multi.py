"""``multi``: a uniform mixture of M independently trained posteriors of any family (MultiSWAG, Multi-FP-BMA)."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.methods import METHODS, parse_method
from flatbma.optim import SGD, Adam, FisherBall
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import lowrank_vi, members, multi, swag
from flatbma.predict import evaluate
from flatbma.rng import draw_seed, seeded_generator
from tests.helpers import tiny_bn_net, toy_batch

SECTIONS = ("params", "buffers", "aux")


def _dropout_net():
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3))


def _families():
    return {
        "swag": lambda obj: swag.build(obj, SGD(lr=0.1, momentum=0.9), rank=3, start_step=0, collect_every=2),
        "fp-bma": lambda obj: lowrank_vi.build(obj, Adam(lr=0.01), FisherBall(gamma=0.01), rank=3),
    }


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", ["swag", "fp-bma"])
def test_one_member_is_the_family_bit_for_bit(family):
    runs = []
    for wrap in (False, True):
        torch.manual_seed(0)
        net = _dropout_net().train()
        obj = Objective(model=net)
        base = _families()[family](obj)
        method = multi.build(obj, base, members=1, seed=4) if wrap else base
        state = method.init(trainable_params(net), model_buffers(net))
        for i in range(8):
            state, out = method.update(state, toy_batch(seed=i))
        own = members.member_state(0, state) if wrap else state
        runs.append((own, out, method.sample(state, 4, torch.Generator().manual_seed(1)), method, state))
        runs[-1] += (torch.get_rng_state(),)
    (a, out_a, samples_a, base, sa, rng_a), (b, out_b, samples_b, wrapped, sb, rng_b) = runs
    assert wrapped.can.members == 1 and wrapped.recompute_bn == base.recompute_bn
    for section in SECTIONS:
        assert _equal(getattr(a, section), getattr(b, section)), section
    assert a.step == b.step == 8 and torch.equal(rng_a, rng_b)
    assert torch.equal(out_a.loss, out_b.loss)
    assert torch.equal(F.log_softmax(out_a.logits, -1), out_b.logits)  # the mixture's log-predictive
    assert len(samples_a) == len(samples_b) == 4 and all(map(_equal, samples_a, samples_b))
    assert _equal(base.mean(sa), wrapped.mean(sb))
    assert _equal(base.marginal_variance(sa), wrapped.marginal_variance(sb))


def test_mixture_sampling_and_bma_are_the_manual_mixture_of_independently_trained_members():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    obj = Objective(model=net)
    base = swag.build(obj, SGD(lr=0.1, momentum=0.9), rank=3, start_step=0, collect_every=2)
    params, buffers = trainable_params(net), model_buffers(net)
    method = multi.build(obj, base, members=3, seed=5)
    state = method.init(params, buffers)
    batches = [toy_batch(seed=i) for i in range(12)]
    for batch in batches:
        state, _ = method.update(state, batch)
    # manual: each member trained on its own, one after the other, from the documented initialization
    manual = []
    for m, (p, b) in enumerate(members.member_initializations(net, params, buffers, 3, 5)):
        own = base.init(p, b)
        for batch in batches:
            own, _ = base.update(own, batch)
        manual.append(own)
        for section in SECTIONS:
            assert _equal(getattr(members.member_state(m, state), section), getattr(own, section)), (m, section)
    assert len({float(s.params["0.weight"].sum()) for s in manual}) == 3  # three different members
    # round-robin: member m gives ceil((n - m)/M) samples, each from its own generator
    n = 7
    samples = method.sample(state, n, torch.Generator().manual_seed(2))
    seed = draw_seed(torch.Generator().manual_seed(2))
    drawn = [base.sample(manual[m], math.ceil((n - m) / 3), seeded_generator(seed, m)) for m in range(3)]
    assert [len(d) for d in drawn] == [3, 2, 2]
    expected = [drawn[i % 3][i // 3] for i in range(n)]
    assert len(samples) == n and all(map(_equal, samples, expected))
    # the BMA of the mixture's samples is the equal-weight mixture of the members' predictive densities
    x, y = toy_batch(n=40, seed=99)
    bma = evaluate(net, samples, [(x, y)], num_classes=3)
    log_probs = torch.stack([F.log_softmax(torch.func.functional_call(net, w, (x,)), -1) for w in expected])
    nll = -(torch.logsumexp(log_probs, 0) - math.log(n)).gather(1, y[:, None]).mean()
    assert bma["nll"] == pytest.approx(float(nll), rel=1e-5)
    # a split state samples its own members only, the same samples
    part = method.sample(method.can.split(state, [1]), n, torch.Generator().manual_seed(2))
    assert len(part) == 2 and all(map(_equal, part, drawn[1]))


class DoubleWell(nn.Module):
    """One weight ``w``; with :func:`_double_well_loss` the loss ``(w² − 1)² + ξ·w`` has basins at ``w ≈ ±1``."""

    def __init__(self, w0: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w0]))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.w.uniform_(-2.0, 2.0)

    def forward(self, x):
        return self.w.expand(x.shape[0], 1)


def _double_well_loss(out, y):
    w = out[:, 0]
    return ((w**2 - 1) ** 2 + y * w).mean()


def _double_well(members_: int):
    obj = Objective(model=DoubleWell(0.8), loss_fn=_double_well_loss)
    base = swag.build(obj, SGD(lr=0.05), rank=4, collect_every=1, start_step=50)
    method = multi.build(obj, base, members=members_, seed=0)
    state = method.init(trainable_params(obj.model), {})
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        xi = 0.3 * torch.randn(8, generator=g)
        state, _ = method.update(state, (torch.zeros(8, 1), xi))
    return method, state


def test_the_mixture_covers_both_basins_where_one_member_covers_one():
    single, s1 = _double_well(1)
    mixture, s4 = _double_well(4)
    starts = [
        float(p["w"]) for p, _ in members.member_initializations(DoubleWell(0.8), {"w": torch.tensor([0.8])}, {}, 4, 0)
    ]
    assert min(starts) < 0 < max(starts)  # the seed puts initializations on both sides of the barrier
    g = torch.Generator().manual_seed(0)
    one = torch.cat([w["w"] for w in single.sample(s1, 200, g)])
    both = torch.cat([w["w"] for w in mixture.sample(s4, 200, g)])
    assert (one > 0).all() and (one - 1).abs().max() < 0.5  # one basin, around w = +1
    for sign in (1, -1):  # the mixture has samples around each basin, as many as its members there
        near = ((both - sign).abs() < 0.5).float().mean()
        assert near >= 0.2
    assert ((both.abs() - 1).abs() < 0.5).all()
    # widths: one member's is its own small variance; the mixture's is dominated by the basins' spread
    v1, v4 = float(single.marginal_variance(s1)["w"]), float(mixture.marginal_variance(s4)["w"])
    assert v1 < 0.05 < 0.5 < v4
    assert float(mixture.mean(s4)["w"]) == pytest.approx(float(both.mean()), abs=0.2)


def test_mean_and_variance_hooks_match_an_independent_computation():
    mixture, state = _double_well(4)
    mus, variances = [], []
    for m in range(4):
        moments = swag.swag_moments(members.member_state(m, state))
        d = moments.deviations.double()
        variance = 0.5 * (moments.variance.double() + (d * d).sum(0) / (d.shape[0] - 1))
        mus.append(moments.mean.double())
        variances.append(variance)
    mu = torch.stack(mus)
    # the law of total variance, written out: E[w²] − E[w]², E[w²] = (1/M) Σ (var_m + μ_m²)
    second = (torch.stack(variances) + mu**2).mean(0)
    expected = second - mu.mean(0) ** 2
    assert float(mixture.mean(state)["w"]) == pytest.approx(float(mu.mean()), rel=1e-6)
    assert float(mixture.marginal_variance(state)["w"]) == pytest.approx(float(expected), rel=1e-5)
    # and against the mixture's own samples (a Monte-Carlo check of the same two moments)
    draws = torch.cat([w["w"] for w in mixture.sample(state, 40000, torch.Generator().manual_seed(3))]).double()
    assert float(draws.mean()) == pytest.approx(float(mu.mean()), abs=0.02)
    assert float(draws.var()) == pytest.approx(float(expected), rel=0.03)
    # with BatchNorm: trained weights averaged over the members, buffers those of member 0
    torch.manual_seed(0)
    net = tiny_bn_net().train()
    obj = Objective(model=net)
    method = multi.build(obj, swag.build(obj, SGD(lr=0.1), rank=2, start_step=0, collect_every=1), members=2, seed=1)
    state = method.init(trainable_params(net), model_buffers(net))
    for i in range(4):
        state, _ = method.update(state, toy_batch(seed=i))
    mean = method.mean(state)
    member = swag.build(obj, SGD(lr=0.1), rank=2, start_step=0, collect_every=10)
    m0, m1 = (member.mean(members.member_state(m, state)) for m in range(2))
    for k in trainable_params(net):
        torch.testing.assert_close(mean[k], (m0[k] + m1[k]) / 2)
    for k in model_buffers(net):
        assert torch.equal(mean[k], m0[k])


def test_split_states_train_their_members_as_the_full_state():
    torch.manual_seed(0)
    net = _dropout_net().train()
    obj = Objective(model=net)
    method = multi.build(obj, _families()["fp-bma"](obj), members=3, seed=3)
    full = method.init(trainable_params(net), model_buffers(net))
    parts = [method.can.split(full, [0, 2]), method.can.split(full, [1])]
    parts = [
        dataclasses.replace(p, **{s: {k: v.clone() for k, v in getattr(p, s).items()} for s in SECTIONS}) for p in parts
    ]
    for step in range(3):
        rng = torch.get_rng_state()
        full, _ = method.update(full, toy_batch(seed=step))
        for i, part in enumerate(parts):
            torch.set_rng_state(rng)
            parts[i], _ = method.update(part, toy_batch(seed=step))
    for part in parts:
        for section in SECTIONS:
            for k, v in getattr(part, section).items():
                assert torch.equal(v, getattr(full, section)[k]), (section, k)


def test_options_and_nesting_are_refused_with_their_keys():
    obj = Objective(model=tiny_bn_net())
    base = swag.build(obj, SGD(lr=0.1), start_step=0, collect_every=10)
    with pytest.raises(FlatbmaError, match=r"method\.members"):
        multi.build(obj, base, members=0)
    with pytest.raises(FlatbmaError, match="nesting"):
        multi.build(obj, multi.build(obj, base, members=2), members=2)
    with pytest.raises(FlatbmaError, match=r"one posterior per member: got 1 for method\.members=2"):
        multi.build(obj, [base], members=2)
    start = members.prefixed(0, trainable_params(obj.model))  # a posterior of one member for a mixture of two
    with pytest.raises(FlatbmaError, match=r"the start holds members \[0\] but method.members is 2"):
        multi.build(obj, base, members=2, seed=0).init(start, {})
    with pytest.raises(FlatbmaError, match=r"method\.of\.bogus"):
        parse_method({"name": "multi", "of": {"name": "swag", "bogus": 1}})
    with pytest.raises(FlatbmaError, match=r"method\.of must name"):
        parse_method("multi").build(obj, SGD(lr=0.1))


def test_registry_names_and_defaults():
    for name in ("multi", "multiswag", "multi-fp-bma"):
        assert name in METHODS
    assert parse_method("multiswag").options["of"] == parse_method("swag")
    cfg = parse_method({"name": "multi", "members": 5, "of": {"name": "fp-bma", "gamma": 0.01}})
    assert cfg.options["members"] == 5 and cfg.options["of"].ascent.gamma == 0.01
    assert cfg.to_dict()["of"]["name"] == "fp-bma"
    assert parse_method(cfg.to_dict()) == cfg  # the resolved section reads back as the same method


DIGITS = {
    "seed": 0,
    "data": {"name": "digits", "batch_size": 64, "test_limit": 200},
    "model": {"name": "mlp", "width": 32},
    "optim": {"name": "adam", "lr": 0.01},
    "train": {"epochs": 2, "progress": False, "device": "cpu"},
    "eval": {"num_samples": 5},
}


def test_cli_lists_describes_and_trains_multi_of_swag(tmp_path, capsys):
    assert main(["methods"]) == 0
    listed = capsys.readouterr().out
    assert all(f"\n{name} " in listed for name in ("multi", "multiswag", "multi-fp-bma"))
    assert main(["methods", "multi"]) == 0
    assert "of " in capsys.readouterr().out
    method = {"name": "multi", "members": 2, "of": {"name": "swag", "rank": 2, "start_step": 0, "collect_every": 5}}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**DIGITS, "method": method}))
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--set", f"output_dir={out}"]) == 0, capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_samples"] == 5 and metrics["accuracy"] > 0.7
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["method"]["of"]["name"] == "swag" and written["method"]["of"]["rank"] == 2


def test_a_run_checks_the_members_method_under_its_keys_and_its_prior_under_method_of(tmp_path, capsys):
    method = {"name": "multi", "members": 2, "of": {"name": "swag", "rank": 20}}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**DIGITS, "method": method, "output_dir": str(tmp_path / "run")}))
    assert main(["train", "--config", str(cfg)]) != 0
    assert "method.of.rank" in capsys.readouterr().err
    prior = {"method": {"name": "swag", "rank": 2}, "epochs": 1}
    with pytest.raises(FlatbmaError, match=r"method\.of\.rank \(5\) must equal prior\.method\.rank \(2\)"):
        config_from_dict({**DIGITS, "method": {"name": "multi-fp-bma"}, "prior": prior})
    with pytest.raises(FlatbmaError, match=r"method\.of 'swag' takes no Gaussian prior"):
        config_from_dict({**DIGITS, "method": {"name": "multiswag"}, "prior": prior})
    with pytest.raises(FlatbmaError, match=r"method\.of must name"):
        config_from_dict({**DIGITS, "method": {"name": "multi"}, "prior": prior})
