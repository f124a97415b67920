import dataclasses
import math

import pytest
import torch

from flatbma import packed
from flatbma.errors import FlatbmaError
from flatbma.gaussian import theta_layout
from flatbma.optim import SAM, SGD, Adam, SAMOptimizer, cosine, disable_running_stats, enable_running_stats
from flatbma.optim.sgd import _decayed_views, with_decay_mask
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
    for k, v in ref.items():  # bit for bit: point methods decay every weight, exactly as PyTorch does
        torch.testing.assert_close(state.params[k], v.detach(), rtol=0, atol=0)


def test_adam_matches_torch_adamw():
    batches = [toy_batch(seed=s) for s in range(5)]
    net = tiny_bn_net()
    ref_net = tiny_bn_net()
    ref_net.load_state_dict(net.state_dict())
    state = _functional_run(net, Adam(lr=0.01, weight_decay=0.1), batches)
    ref = _reference_run(ref_net, torch.optim.AdamW(ref_net.parameters(), lr=0.01, weight_decay=0.1), batches)
    for k, v in ref.items():
        torch.testing.assert_close(state.params[k], v.detach(), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# weight decay restricted by a mask (variational parameters: decay the mean only)


def _theta(seed=0, k=3):
    g = torch.Generator().manual_seed(seed)
    names = {"a.weight": (3, 4), "a.bias": (3,), "b.weight": (2, 3)}
    theta = {f"mean/{n}": torch.randn(s, generator=g) for n, s in names.items()}
    theta.update({f"log_std/{n}": torch.randn(s, generator=g) - 2 for n, s in names.items()})
    theta.update({f"factor/{n}": torch.randn((k, *s), generator=g) * 0.1 for n, s in names.items()})
    return theta


def _is_mean(key):
    return key.startswith("mean/")


def _run(optimizer, theta, grads, layout):
    params = packed.pack(theta, layout) if layout is not None else {k: v.clone() for k, v in theta.items()}
    state = optimizer.init(params)
    for step, g in enumerate(grads):
        state = optimizer.apply(params, packed.pack(g, layout) if layout is not None else g, state, step)
    return {k: v.clone() for k, v in params.items()}


@pytest.mark.parametrize("packed_theta", [True, False])
@pytest.mark.parametrize(
    "optimizer",
    [
        SGD(lr=0.1, momentum=0.9, weight_decay=0.3),
        SGD(lr=0.1, momentum=0.9, weight_decay=0.3, nesterov=True),
        SGD(lr=0.1, momentum=0.0, weight_decay=0.3),
        Adam(lr=0.1, weight_decay=0.3),
    ],
)
def test_a_decay_mask_restricts_weight_decay_to_the_selected_keys(optimizer, packed_theta):
    theta = _theta()
    layout = theta_layout(theta) if packed_theta else None
    gen = torch.Generator().manual_seed(1)
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in theta.items()} for _ in range(4)]
    masked = _run(with_decay_mask(optimizer, _is_mean), theta, grads, layout)
    everywhere = _run(optimizer, theta, grads, layout)
    nowhere = _run(dataclasses.replace(optimizer, weight_decay=0.0), theta, grads, layout)
    for k in theta:  # bit for bit: a key is updated exactly as with or without decay
        expected = everywhere[k] if _is_mean(k) else nowhere[k]
        torch.testing.assert_close(masked[k], expected, rtol=0, atol=0)
        assert not torch.equal(everywhere[k], nowhere[k])


def test_the_packed_mean_is_decayed_as_one_slice_of_the_buffer():
    layout = theta_layout(_theta())
    d = sum(math.prod(s) for k, s in zip(layout.keys, layout.shapes, strict=True) if k.startswith("mean/"))
    assert _decayed_views(layout, _is_mean) == (((d,), (1,), 0),)  # row 0 of [K+2, d]: one kernel
    i = layout.keys.index("factor/a.bias")  # a strided view ([K, 3] with row stride d) is taken as it is
    expected = ((tuple(layout.shapes[i]), layout.strides[i], layout.offsets[i]),)
    assert _decayed_views(layout, lambda k: k == "factor/a.bias") == expected


def test_with_decay_mask_combines_masks_and_refuses_what_it_cannot_restrict():
    first = with_decay_mask(SGD(weight_decay=0.1), _is_mean)
    both = with_decay_mask(first, lambda k: k.endswith("weight"))
    assert [both.decay_mask(k) for k in ("mean/a.weight", "mean/a.bias", "log_std/a.weight")] == [True, False, False]

    @dataclasses.dataclass(frozen=True)
    class Plain:
        weight_decay: float = 0.0

    assert with_decay_mask(Plain(), _is_mean) == Plain()  # no decay to restrict
    with pytest.raises(FlatbmaError, match="cannot be restricted to the mean"):
        with_decay_mask(Plain(weight_decay=0.1), _is_mean)


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
