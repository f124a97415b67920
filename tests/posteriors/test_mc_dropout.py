import json
import math

import pytest
import torch
import yaml
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.run.checkpoint import save_state
from flatbma.methods import METHODS
from flatbma.models import MLP
from flatbma.optim import SAM, SGD
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import mc_dropout, point
from flatbma.predict import bma_log_probs, evaluate
from flatbma.types import prediction_mode
from tests.helpers import load_state, tiny_bn_net, toy_batch


def plain_net():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def trained(net, method_ascent=None, steps=5, rate=0.3):
    obj = Objective(model=net)
    method = mc_dropout.build(obj, SGD(lr=0.1), method_ascent, rate=rate)
    net.train()
    state = method.init(trainable_params(net), model_buffers(net))
    for i in range(steps):
        state, _ = method.update(state, toy_batch(seed=i))
    return method, state


def test_dropout_is_inserted_before_the_classifier_when_absent():
    net = plain_net()
    linear = net[2]
    x = toy_batch()[0]
    before = net.eval()(x)
    method = mc_dropout.build(Objective(model=net), SGD(lr=0.1), rate=0.25)
    assert isinstance(net[2], nn.Sequential) and net[2][1] is linear
    assert isinstance(net[2][0], nn.Dropout) and net[2][0].p == 0.25
    assert list(trainable_params(net)) == ["0.weight", "0.bias", "2.1.weight", "2.1.bias"]
    torch.testing.assert_close(net.eval()(x), before)  # same function in eval mode
    state = method.init(trainable_params(net), {})
    assert set(state.params) == {"0.weight", "0.bias", "2.1.weight", "2.1.bias"}
    # parameters taken before build have stale names: a clear error
    with pytest.raises(FlatbmaError, match="after building"):
        method.init({"0.weight": net[0].weight, "2.weight": linear.weight}, {})
    # building again finds the active dropout layer and inserts nothing
    mc_dropout.build(Objective(model=net), SGD(lr=0.1), rate=0.25)
    assert net[2][1] is linear and "2.1.1.weight" not in dict(net.named_parameters())


def test_existing_dropout_layers_are_overridden_or_kept():
    net = MLP(6, 3, hidden=(8, 8), dropout=0.0)
    mc_dropout.build(Objective(model=net), SGD(lr=0.1), rate=0.2)
    assert [m.p for m in net.modules() if isinstance(m, nn.Dropout)] == [0.2, 0.2]
    assert "classifier.weight" in dict(net.named_parameters())  # nothing inserted

    net = MLP(6, 3, hidden=(8, 8), dropout=0.4)
    mc_dropout.build(Objective(model=net), SGD(lr=0.1), rate=0.2, override_existing=False)
    assert [m.p for m in net.modules() if isinstance(m, nn.Dropout)] == [0.4, 0.4]
    assert "classifier.weight" in dict(net.named_parameters())

    # kept rates that are all 0 leave the network deterministic: a dropout layer is inserted
    net = MLP(6, 3, hidden=(8,), dropout=0.0)
    mc_dropout.build(Objective(model=net), SGD(lr=0.1), rate=0.2, override_existing=False)
    assert [m.p for m in net.modules() if isinstance(m, nn.Dropout)] == [0.0, 0.2]
    assert "classifier.1.weight" in dict(net.named_parameters())


@pytest.mark.parametrize("ascent", [None, SAM(rho=0.1)])
def test_update_is_the_point_update_on_the_dropout_network(ascent):
    torch.manual_seed(0)
    net = tiny_bn_net()
    obj = Objective(model=net)
    method = mc_dropout.build(obj, SGD(lr=0.1), ascent, rate=0.5)
    reference = point.build(obj, SGD(lr=0.1), ascent)
    net.train()
    a = method.init(trainable_params(net), model_buffers(net))
    b = reference.init(trainable_params(net), model_buffers(net))
    for i in range(3):
        torch.manual_seed(100 + i)
        a, out_a = method.update(a, toy_batch(seed=i))
        torch.manual_seed(100 + i)
        b, out_b = reference.update(b, toy_batch(seed=i))
        torch.testing.assert_close(out_a.loss, out_b.loss)
    for k in a.params:
        torch.testing.assert_close(a.params[k], b.params[k])
    for k in a.buffers:
        torch.testing.assert_close(a.buffers[k], b.buffers[k])


def test_f_mc_dropout_draws_a_fresh_mask_in_the_second_sam_pass():
    net = plain_net()
    obj = Objective(model=net)
    method = mc_dropout.build(obj, SGD(lr=0.1), SAM(rho=0.05), rate=0.5)
    masks = []
    net[2][0].register_forward_hook(lambda m, inp, out: masks.append(out == 0))
    net.train()
    state = method.init(trainable_params(net), {})
    method.update(state, toy_batch())
    assert len(masks) == 2  # the ascent pass and the descent pass
    assert not torch.equal(masks[0], masks[1])


def test_rate_zero_is_the_point_estimate():
    torch.manual_seed(0)
    net = plain_net()
    method = mc_dropout.build(Objective(model=net), SGD(lr=0.1), rate=0.0)
    assert "2.weight" in dict(net.named_parameters())  # no layer inserted for rate 0
    state = method.init(trainable_params(net), {})
    samples = method.sample(state, 3, torch.Generator().manual_seed(0))
    x = toy_batch()[0]
    with method.predict_mode(net):
        outs = [torch.func.functional_call(net, s, (x,)) for s in samples]
    torch.testing.assert_close(outs[0], outs[2])


def test_predict_mode_keeps_only_dropout_stochastic_and_restores_modes():
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3))
    method = mc_dropout.build(Objective(model=net), SGD(lr=0.1), rate=0.3)
    net.train()
    net[1].eval()  # a mixed mode, to check that each module's own mode comes back
    with method.predict_mode(net):
        assert not net.training and not net[1].training and net[3].training
    assert net.training and not net[1].training and net[3].training and net[4].training


def test_mc_average_of_masked_passes_is_the_deterministic_network():
    # inverted dropout before a linear layer: E_z[W (z ⊙ h)/(1 − p)] + b = W h + b, so the mean of
    # the logits over M masks approaches the eval-mode logits with standard error O(1/√M).
    torch.manual_seed(0)
    net = plain_net()
    method = mc_dropout.build(Objective(model=net), SGD(lr=0.1), rate=0.3)
    x = toy_batch(n=4)[0]
    exact = net.eval()(x).detach()
    state = method.init(trainable_params(net), {})
    samples = method.sample(state, 4000, torch.Generator().manual_seed(0))
    with torch.no_grad(), method.predict_mode(net):
        outs = torch.stack([torch.func.functional_call(net, s, (x,)) for s in samples])
    assert outs.std(0).min() > 0.01  # the passes differ
    stderr = outs.std(0) / math.sqrt(len(samples))
    assert ((outs.mean(0) - exact).abs() < 5 * stderr).all()


def test_evaluation_is_reproducible_for_a_seed_and_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(0)
    net = plain_net()
    method, state = trained(net)
    loader = [toy_batch(n=32, seed=s) for s in range(3)]

    def bma(seed):
        samples = method.sample(state, 8, torch.Generator().manual_seed(seed))
        with method.predict_mode(net, torch.Generator().manual_seed(seed)):
            return torch.cat([bma_log_probs(net, samples, x) for x, _ in loader])

    rng = torch.get_rng_state()
    a, b, c = bma(0), bma(0), bma(1)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # the same after a save → load round trip
    save_state(state, tmp_path / "s.safetensors")
    loaded = load_state(tmp_path / "s.safetensors")
    s1 = method.sample(state, 3, torch.Generator().manual_seed(0))
    s2 = method.sample(loaded, 3, torch.Generator().manual_seed(0))
    for w1, w2 in zip(s1, s2):
        assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    m1 = evaluate(net, s1, loader, num_classes=3, mode=prediction_mode(method, 0))
    torch.manual_seed(123)  # the global stream does not matter
    m2 = evaluate(net, s2, loader, num_classes=3, mode=prediction_mode(method, 0))
    assert m1 == m2


@pytest.mark.parametrize("rate", [1.0, -0.1, float("nan"), True, "0.1"])
def test_bad_rate_names_its_key(rate):
    with pytest.raises(FlatbmaError, match=r"method\.rate"):
        mc_dropout.build(Objective(model=plain_net()), SGD(lr=0.1), rate=rate)


def test_bare_linear_model_is_a_clear_error():
    with pytest.raises(FlatbmaError, match=r"bare nn\.Linear"):
        mc_dropout.build(Objective(model=nn.Linear(3, 2)), SGD(lr=0.1))


def test_registry():
    assert METHODS["mc-dropout"].family.build is mc_dropout.build and METHODS["mc-dropout"].ascent is None
    assert METHODS["f-mc-dropout"].family.build is mc_dropout.build and METHODS["f-mc-dropout"].ascent is SAM
    assert set(METHODS["mc-dropout"].family_options()) == {"rate", "override_existing"}


DIGITS = {
    "seed": 0,
    "data": {"name": "digits", "batch_size": 64, "test_limit": 200},
    "model": {"name": "mlp", "width": 32},
    "optim": {"name": "adam", "lr": 0.03},
    "train": {"epochs": 3, "progress": False, "device": "cpu"},
    "eval": {"num_samples": 4},
}


@pytest.mark.parametrize("method", [{"name": "mc-dropout", "rate": 0.2}, {"name": "f-mc-dropout", "rho": 0.05}])
def test_cli_trains_on_digits_and_reevaluates_identically(tmp_path, capsys, method):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**DIGITS, "method": method}))
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--set", f"output_dir={out}"]) == 0, capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_samples"] == 4 and metrics["accuracy"] > 0.7
    assert main(["evaluate", str(out)]) == 0, capsys.readouterr().err
    again = json.loads((out / "metrics.json").read_text())
    assert all(again[k] == metrics[k] for k in ("accuracy", "nll", "ece", "brier"))
