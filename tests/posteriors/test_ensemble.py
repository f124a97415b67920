import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from flatbma.data import load_dataset
from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.run.checkpoint import load_checkpoint, save_state
from flatbma.methods import METHODS
from flatbma.models import MLP, build_model, classifier_of
from flatbma.optim import SAM, SGD, Adam
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import ensemble, members, multi, point
from flatbma.predict import evaluate
from flatbma.transfer import Subset, restrict_trainable, subset_names
from tests.helpers import load_state, tiny_bn_net, toy_batch
from tests.posteriors.fixtures import make_ensemble_fixtures as fixtures


def member(state, m, section="params"):
    return members.member(m, getattr(state, section))


def test_members_are_independent_initializations_and_the_template_is_restored():
    torch.manual_seed(0)
    net = tiny_bn_net()
    with torch.no_grad():  # a non-default BatchNorm layer in the given model
        net[1].running_mean.fill_(5.0)
        net[1].weight.fill_(2.0)
    template = {k: v.clone() for k, v in net.state_dict().items()}
    params, buffers = trainable_params(net), model_buffers(net)
    method = ensemble.build(Objective(model=net), SGD(lr=0.1), size=3, seed=7)
    state = method.init(params, buffers)
    for k, v in net.state_dict().items():
        assert torch.equal(v, template[k])
    assert set(state.params) == {f"member{m}/{k}" for m in range(3) for k in params}
    assert set(state.aux) == {f"member{m}/optimizer/momentum/{k}" for m in range(3) for k in params}
    for k in params:
        assert torch.equal(member(state, 0)[k], params[k])
    for k in ("0.weight", "0.bias", "3.weight", "3.bias"):  # the random (Linear) initializations differ
        assert not torch.equal(member(state, 1)[k], params[k])
        assert not torch.equal(member(state, 1)[k], member(state, 2)[k])
    # re-initialized BatchNorm layers start afresh (γ = 1, fresh statistics); member 0 keeps the given ones
    assert torch.equal(member(state, 1)["1.weight"], torch.ones(8))
    assert torch.equal(member(state, 0, "buffers")["1.running_mean"], torch.full((8,), 5.0))
    assert torch.equal(member(state, 1, "buffers")["1.running_mean"], torch.zeros(8))
    # the draws are a function of the seed only (the global RNG is neither used nor advanced)
    rng = torch.get_rng_state()
    again = method.init(params, buffers)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(again.params[k], state.params[k]) for k in state.params)
    other = ensemble.build(Objective(model=net), SGD(lr=0.1), size=3, seed=8).init(params, buffers)
    assert not torch.equal(other.params["member1/0.weight"], state.params["member1/0.weight"])
    # the fresh draws follow PyTorch's default nn.Linear init: U(−1/√fan_in, 1/√fan_in)
    assert member(state, 1)["0.weight"].abs().max() <= 1 / math.sqrt(6)


def test_only_fully_trainable_modules_are_reinitialized():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    net[0].requires_grad_(False)  # a frozen (pretrained) part: shared, not in the state
    net[2].bias.requires_grad_(False)  # partly trainable module: its trainable weight is shared too
    params = trainable_params(net)
    assert set(params) == {"2.weight", "4.weight", "4.bias"}
    state = ensemble.build(Objective(model=net), SGD(lr=0.1), size=2).init(params, {})
    assert "member1/0.weight" not in state.params
    assert torch.equal(state.params["member1/2.weight"], params["2.weight"])
    assert not torch.equal(state.params["member1/4.weight"], params["4.weight"])


def test_each_member_takes_its_own_point_update_and_the_output_is_the_ensemble():
    torch.manual_seed(0)
    net = tiny_bn_net()
    net.train()
    obj = Objective(model=net)
    opt, ascent = SGD(lr=0.1, momentum=0.9), SAM(rho=0.05)
    method = ensemble.build(obj, opt, ascent, size=3)
    state = method.init(trainable_params(net), model_buffers(net))
    refs = [point.build(obj, opt, ascent) for _ in range(3)]
    ref_states = [r.init(member(state, m), member(state, m, "buffers")) for m, r in enumerate(refs)]
    for i in range(3):
        batch = toy_batch(seed=i)
        state, out = method.update(state, batch)
        outs = []
        for m, r in enumerate(refs):
            ref_states[m], o = r.update(ref_states[m], batch)
            outs.append(o)
        torch.testing.assert_close(out.loss, torch.stack([o.loss for o in outs]).mean())
        log_probs = torch.stack([F.log_softmax(o.logits, -1) for o in outs])
        torch.testing.assert_close(out.logits, torch.logsumexp(log_probs, 0) - math.log(3))
    for m in range(3):
        for section in ("params", "buffers"):
            for k, v in getattr(ref_states[m], section).items():
                torch.testing.assert_close(member(state, m, section)[k], v)
        for k, v in ref_states[m].aux.items():
            torch.testing.assert_close(member(state, m, "aux")[k], v)
    assert state.step == 3


SECTIONS = ("params", "buffers", "aux")
FIXTURES = Path(__file__).parent / "fixtures"


def _same(a, b):
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _same_states(a, b):
    return a.step == b.step and all(_same(getattr(a, sec), getattr(b, sec)) for sec in SECTIONS)


@pytest.mark.parametrize("size", [1, 3])
def test_an_ensemble_is_multi_of_point_estimates_bit_for_bit(size):
    """Same seed, same states, outputs, samples and global stream; only the closed-form mean and variance are
    left out; one member is seeded as any member (``seed_single``), where plain ``multi`` runs the point itself."""
    runs = {}
    for name in ("ensemble", "multi", "multi-unseeded"):
        torch.manual_seed(0)
        net = fixtures.net().train()
        obj, opt, ascent = Objective(model=net), SGD(lr=0.1, momentum=0.9), SAM(rho=0.05)
        if name == "ensemble":
            method = ensemble.build(obj, opt, ascent, size=size)
        else:
            seeded = name == "multi"
            method = multi.build(obj, point.build(obj, opt, ascent), members=size, seed_single=seeded)
        state = method.init(trainable_params(net), model_buffers(net))  # seed None: drawn from the global stream
        outs = []
        for i in range(4):
            state, out = method.update(state, toy_batch(seed=i))
            outs.append(out)
        samples = method.sample(state, 5, torch.Generator().manual_seed(1))
        runs[name] = (method, state, outs, samples, torch.get_rng_state())
    (ens, a, outs_a, samples_a, rng_a), (mix, b, outs_b, samples_b, rng_b) = runs["ensemble"], runs["multi"]
    assert _same_states(a, b) and torch.equal(rng_a, rng_b)
    for x, y in zip(outs_a, outs_b, strict=True):
        assert torch.equal(x.loss, y.loss) and torch.equal(x.logits, y.logits)
    assert len(samples_a) == len(samples_b) == size and all(map(_same, samples_a, samples_b))
    assert ens.can.members == mix.can.members == size and ens.recompute_bn == mix.recompute_bn is False
    assert ens.mean is ens.marginal_variance is None  # the members are samples: no closed-form mean or width
    assert mix.mean is not None and mix.marginal_variance is not None
    _, c, _, _, rng_c = runs["multi-unseeded"]
    if size == 1:  # the point estimate itself, on the global generators: other dropout masks, another stream
        assert not torch.equal(rng_a, rng_c) and not _same(a.params, c.params)
    else:  # seed_single changes nothing for more members
        assert _same_states(a, c) and torch.equal(rng_a, rng_c)


def _close(a, b, ordered=True):
    """Same keys (in the same order when ``ordered``) and dtypes; integer tensors equal, floats to float32 rounding.

    CPU kernels and thread counts move the last bits of a reduction: the fixtures' weights equal these bit for bit
    only on the machine and thread count that wrote them.
    """
    assert list(a) == list(b) if ordered else sorted(a) == sorted(b)
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
        else:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("size", [1, 2])
def test_the_ensemble_trains_and_resumes_the_states_written_before_it_was_multi(size):
    """``fixtures/ensemble-size*.safetensors`` were written by the ensemble's own loops (commit a82f138): the
    composition draws the same members, steps and seeds (the same dropout masks, the same global stream) from
    scratch, and continues such a file as they did."""
    old, _, extra = load_checkpoint(FIXTURES / f"ensemble-size{size}.safetensors")
    after = {s: {k.split("/", 2)[2]: v for k, v in extra.items() if k.startswith(f"after/{s}/")} for s in SECTIONS}
    torch.manual_seed(0)
    net = fixtures.net().train()
    method = fixtures.method(net, size)
    state = method.init(trainable_params(net), model_buffers(net))
    assert list(old.aux) == list(state.aux)  # the fixture's keys: the composed layout (its docstring)
    for s in range(2):
        state, _ = method.update(state, toy_batch(seed=s))
    assert state.step == old.step == 2
    for sec in SECTIONS:
        _close(getattr(state, sec), getattr(old, sec))
    for start in (state, old):  # the state trained here, and the one read from the old file
        torch.manual_seed(1)
        new, out = method.update(start, toy_batch(seed=2))
        assert new.step == 3 and torch.equal(torch.get_rng_state(), extra["rng"])  # one draw per step, as before
        for sec in SECTIONS:
            _close(getattr(new, sec), after[sec], ordered=False)  # extra tensors are stored by name
        _close({"loss": out.loss.reshape(1), "logits": out.logits}, {k: extra[k] for k in ("loss", "logits")})


def test_sample_returns_the_first_n_members():
    net = tiny_bn_net()
    method = ensemble.build(Objective(model=net), SGD(lr=0.1), size=4)
    state = method.init(trainable_params(net), model_buffers(net))
    all_members = method.sample(state, 30, None)
    assert len(all_members) == 4
    assert set(all_members[0]) == set(trainable_params(net)) | set(model_buffers(net))
    two = method.sample(state, 2, None)
    assert all(torch.equal(two[m][k], all_members[m][k]) for m in range(2) for k in two[m])
    with pytest.raises(FlatbmaError, match="num_samples"):
        method.sample(state, 0, None)


def test_save_load_sample_is_identical(tmp_path):
    net = tiny_bn_net()
    net.train()
    method = ensemble.build(Objective(model=net), Adam(lr=0.01), size=2)
    state = method.init(trainable_params(net), model_buffers(net))
    for i in range(3):
        state, _ = method.update(state, toy_batch(seed=i))
    save_state(state, tmp_path / "s.safetensors")
    loaded = load_state(tmp_path / "s.safetensors")
    for a, b in zip(method.sample(state, 2, None), method.sample(loaded, 2, None)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # training resumes identically from the loaded state (each member's Adam moments were saved)
    s1, _ = method.update(state, toy_batch(seed=9))
    s2, _ = method.update(loaded, toy_batch(seed=9))
    assert all(torch.equal(s1.params[k], s2.params[k]) for k in s1.params)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"size": 0}, "method.size"),
        ({"size": True}, "method.size"),
        ({"size": 2.5}, "method.size"),
        ({"seed": -1}, "method.seed"),
    ],
)
def test_bad_options_name_their_key(options, key):
    with pytest.raises(FlatbmaError, match=key.replace(".", r"\.")):
        ensemble.build(Objective(model=tiny_bn_net()), SGD(lr=0.1), **options)


def test_registry():
    assert METHODS["ensemble"].family.build is ensemble.build and METHODS["ensemble"].ascent is None
    assert METHODS["f-ensemble"].family.build is ensemble.build and METHODS["f-ensemble"].ascent is SAM
    assert set(METHODS["ensemble"].family_options()) == {"size", "seed"}


def test_bma_nll_beats_the_mean_member_nll_on_digits():
    splits = load_dataset("digits")
    x_train, y_train = splits.train.images, splits.train.labels
    test = [(splits.test.images, splits.test.labels)]
    torch.manual_seed(0)
    net = MLP(64, 10, hidden=(32,))
    net.train()
    method = ensemble.build(Objective(model=net), Adam(lr=0.01), size=3)
    state = method.init(trainable_params(net), model_buffers(net))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):  # epochs
        for idx in torch.randperm(len(y_train), generator=g).split(64):
            state, _ = method.update(state, (x_train[idx], y_train[idx]))
    members = method.sample(state, 3, None)
    single = [evaluate(net, [w], test, num_classes=10) for w in members]
    bma = evaluate(net, members, test, num_classes=10)
    nlls = [m["nll"] for m in single]
    assert min(m["accuracy"] for m in single) > 0.85
    assert len({round(n, 6) for n in nlls}) == 3  # the members differ
    # NLL of the mixture < mean member NLL (Jensen, strict when members disagree), by a visible margin
    assert bma["nll"] < sum(nlls) / len(nlls) - 1e-3  # here ≈ 0.302 vs 0.308
    assert bma["accuracy"] > 0.85


DIGITS = {
    "seed": 0,
    "data": {"name": "digits", "batch_size": 64, "test_limit": 200},
    "model": {"name": "mlp", "width": 32},
    "optim": {"name": "adam", "lr": 0.03},
    "train": {"epochs": 2, "progress": False, "device": "cpu"},
    "eval": {"num_samples": 5},
}


@pytest.mark.parametrize("method", [{"name": "ensemble", "size": 3}, {"name": "f-ensemble", "size": 2, "rho": 0.05}])
def test_cli_trains_on_digits(tmp_path, capsys, method):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**DIGITS, "method": method}))
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--set", f"output_dir={out}"]) == 0, capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_samples"] == method["size"]  # capped at the ensemble size
    assert metrics["accuracy"] > 0.7


def test_default_member_seed_follows_the_run_seed():
    """``seed=None``: members 1..M−1 come from the global generator, so run seeds give different ensembles."""
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    method = ensemble.build(Objective(model=net), SGD(lr=0.1), size=3)
    params, buffers = trainable_params(net), model_buffers(net)
    inits = []
    for run_seed in (0, 0, 1):
        torch.manual_seed(run_seed)
        inits.append(method.init(params, buffers).params["member2/0.weight"])
    assert torch.equal(inits[0], inits[1]) and not torch.equal(inits[0], inits[2])


@pytest.mark.parametrize("num_classes", [10, 4])  # the head loaded with the rest, or re-initialized for 4 classes
def test_members_of_a_pretrained_network_keep_its_pretrained_layers_and_redraw_the_head(tmp_path, num_classes):
    """Transfer (norm+classifier trainable): member m ≥ 1 keeps the pretrained BatchNorm affine parameters and
    statistics of member 0 and re-draws only the classifier head; a network built from scratch re-draws every
    trainable module (as before)."""
    source = build_model("cnn", num_classes=10, in_channels=1, image_size=8, width=4, seed=1)
    with torch.no_grad():
        for t in [*source.parameters(), *source.buffers()]:
            if t.is_floating_point():
                t.add_(0.5)  # pretrained values unlike any fresh initialization (BN weight 1.5, bias 0.5, ...)
    path = tmp_path / "pretrained.pt"
    torch.save(source.state_dict(), path)
    net = build_model("cnn", num_classes=num_classes, in_channels=1, image_size=8, width=4, pretrained=path, seed=2)
    restrict_trainable(net, subset_names(net, Subset.NORM_CLASSIFIER))
    params, buffers = trainable_params(net), model_buffers(net)
    head = classifier_of(net)[0]
    (p0, b0), (p1, b1) = members.member_initializations(net, params, buffers, 2, seed=3)
    for k in params:
        if k.startswith(head + "."):
            assert not torch.equal(p1[k], p0[k]), k  # the head: a new draw
        else:
            assert torch.equal(p1[k], p0[k]) and torch.equal(p0[k], params[k]), k  # pretrained BN affine kept
    assert all(torch.equal(b1[k], b0[k]) for k in buffers)  # pretrained BN statistics kept
    bn = next(k for k in params if k.endswith("weight") and params[k].dim() == 1)
    assert torch.all(p1[bn] != 1.0)  # not reset to BatchNorm's fresh weight 1

    scratch = build_model("cnn", num_classes=num_classes, in_channels=1, image_size=8, width=4, seed=2)
    restrict_trainable(scratch, subset_names(scratch, Subset.NORM_CLASSIFIER))
    (_, _), (q1, _) = members.member_initializations(
        scratch, trainable_params(scratch), model_buffers(scratch), 2, seed=3
    )
    assert torch.equal(q1[bn], torch.ones_like(q1[bn]))  # from scratch: BatchNorm re-initialized (weight 1)
