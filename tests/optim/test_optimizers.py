import math

import pytest
import torch

from flatbma.optim import SAM, SGD, Adam, SAMOptimizer, cosine, disable_running_stats, enable_running_stats
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import point
from tests.helpers import tiny_bn_net, toy_batch


def _reference_run(net, opt, batches, closure_kind="plain"):
    net.train()
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return dict(net.named_parameters())


def _functional_run(net, optimizer, batches, ascent=None):
    obj = Objective(model=net)
    net.train()
    method = point.build(obj, optimizer, ascent)
    state = method.init(trainable_params(net), model_buffers(net))
    for batch in batches:
        state, _ = method.update(state, batch)
    return state


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_matches_torch_sgd(nesterov):
    batches = [toy_batch(seed=s) for s in range(5)]
    torch.manual_seed(1)
    net = tiny_bn_net()
    ref_net = tiny_bn_net()
    ref_net.load_state_dict(net.state_dict())
    kw = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=nesterov)
    state = _functional_run(net, SGD(**kw), batches)
    ref = _reference_run(ref_net, torch.optim.SGD(ref_net.parameters(), **kw), batches)
    for k, v in ref.items():
        torch.testing.assert_close(state.params[k], v.detach())


def test_adam_matches_torch_adamw():
    batches = [toy_batch(seed=s) for s in range(5)]
    net = tiny_bn_net()
    ref_net = tiny_bn_net()
    ref_net.load_state_dict(net.state_dict())
    state = _functional_run(net, Adam(lr=0.01, weight_decay=0.1), batches)
    ref = _reference_run(ref_net, torch.optim.AdamW(ref_net.parameters(), lr=0.01, weight_decay=0.1), batches)
    for k, v in ref.items():
        torch.testing.assert_close(state.params[k], v.detach())


def test_drop_in_sam_optimizer_matches_functional_sam():
    batches = [toy_batch(seed=s) for s in range(4)]
    net = tiny_bn_net()
    ref_net = tiny_bn_net()
    ref_net.load_state_dict(net.state_dict())
    state = _functional_run(net, SGD(lr=0.1, momentum=0.9), batches, SAM(rho=0.1))

    opt = SAMOptimizer(ref_net.parameters(), torch.optim.SGD, ascent=SAM(rho=0.1), lr=0.1, momentum=0.9)
    ref_net.train()
    loss_fn = torch.nn.functional.cross_entropy
    for x, y in batches:
        loss_fn(ref_net(x), y).backward()
        opt.first_step(zero_grad=True)
        disable_running_stats(ref_net)
        loss_fn(ref_net(x), y).backward()
        opt.second_step(zero_grad=True)
        enable_running_stats(ref_net)
    for k, v in ref_net.named_parameters():
        torch.testing.assert_close(state.params[k], v.detach())
    for k, v in ref_net.named_buffers():
        torch.testing.assert_close(state.buffers[k], v)


def test_sam_optimizer_closure_step_and_state_dict():
    net = tiny_bn_net()
    opt = SAMOptimizer(net.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    x, y = toy_batch()

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        return loss

    losses = [opt.step(closure).item() for _ in range(20)]
    assert losses[-1] < losses[0]
    sd = opt.state_dict()
    assert any("momentum_buffer" in s for s in sd["state"].values())
    # a scheduler drives the shared param groups
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step(closure)
    sched.step()
    assert opt.base_optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    opt2 = SAMOptimizer(net.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.base_optimizer.state is opt2.state


def test_cosine_schedule():
    s = cosine(1.0, total_steps=10, warmup_steps=2)
    assert s(0) == pytest.approx(0.5)
    assert s(1) == pytest.approx(1.0)
    assert s(2) == pytest.approx(1.0)
    assert s(6) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(10) == pytest.approx(0.0, abs=1e-12)
