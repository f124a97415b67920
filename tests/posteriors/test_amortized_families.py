"""Every family with an ascent step composes with Amortized: k = 1 is the full method bit for bit, and a
state saved in mid-cycle and loaded from its checkpoint file continues bit-identically."""

import pytest
import torch

from flatbma.experiment.run.checkpoint import check_compatible, save_state
from flatbma.optim import SAM, SGD, Adam, Amortized, FisherBall
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import ensemble, ivon, lowrank_vi, mfvi, point, sgld, swag
from tests.helpers import load_state


def _problem():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(12, 5, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(4)]
    return Objective(model=model.train(), num_data=200), batches


BUILDERS = {
    "sam": lambda obj, a: point.build(obj, SGD(lr=0.1, momentum=0.9), a),
    "f-swag": lambda obj, a: swag.build(obj, SGD(lr=0.1), a, rank=2, start_step=2, collect_every=1),
    "f-mfvi": lambda obj, a: mfvi.build(obj, Adam(lr=0.01), a, num_mc_samples=2),
    "fp-bma": lambda obj, a: lowrank_vi.build(obj, Adam(lr=0.01), a, rank=3),
    "f-sgld": lambda obj, a: sgld.build(obj, SGD(lr=1e-3), a, burn_in=2, thin=1),
    "f-ensemble": lambda obj, a: ensemble.build(obj, SGD(lr=0.1), a, size=2, seed=3),
    "f-ivon": lambda obj, a: ivon.build(obj, SGD(lr=0.1), a, mc_samples=2, beta2=0.9),
}
ASCENT = {"fp-bma": lambda: FisherBall(gamma=0.05)}


def _ascent(name):
    return ASCENT.get(name, lambda: SAM(0.05))()


def _train(name, ascent, steps, state=None, method=None):
    objective, batches = _problem()
    method = method or BUILDERS[name](objective, ascent)
    if state is None:
        torch.manual_seed(2)
        state = method.init(trainable_params(objective.model), model_buffers(objective.model))
    losses = []
    for t in range(state.step, state.step + steps):
        state, out = method.update(state, batches[t % len(batches)])
        losses.append(out.loss)
    return method, state, torch.stack(losses)


def _same(a, b):
    return set(a) >= set(b) and all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_step_is_the_full_method_bit_for_bit(name):
    _, full, full_losses = _train(name, _ascent(name), 6)
    _, every, losses = _train(name, Amortized(_ascent(name), ascent_every=1), 6)
    assert torch.equal(losses, full_losses)
    assert _same(every.params, full.params) and _same(every.buffers, full.buffers)
    assert _same(every.aux, full.aux)  # the same method state, plus the memory
    assert any("ascent/" in k for k in every.aux) and not any("ascent/" in k for k in full.aux)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_reuse_steps_differ_from_the_full_method_and_cost_one_pass(name, monkeypatch):
    objective, _ = _problem()
    calls = {"n": 0}
    real = Objective.value_and_grad

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Objective, "value_and_grad", counted)
    _, full, _ = _train(name, _ascent(name), 5)
    full_calls, calls["n"] = calls["n"], 0
    _, reused, _ = _train(name, Amortized(_ascent(name), ascent_every=5), 5)
    per_step = full_calls // 10  # the full method: two passes per step (per sample, per member)
    assert calls["n"] == per_step * 6  # one ascent step (two passes), four reuse steps (one each)
    assert not _same(reused.params, full.params)


@pytest.mark.parametrize("name", ["sam", "f-mfvi", "fp-bma", "f-ensemble"])
def test_resume_in_mid_cycle_is_bit_identical(name, tmp_path):
    ascent = Amortized(_ascent(name), ascent_every=5, ascent_fraction=0.5)
    _, straight, straight_losses = _train(name, ascent, 12)
    method, stopped, first = _train(name, ascent, 7)
    positions = [int(v) for k, v in stopped.aux.items() if "ascent/" in k and k.endswith("/position")]
    assert positions and all(p == 2 for p in positions)  # in mid-cycle: 7 = 5 + 2
    save_state(stopped, tmp_path / "state.safetensors")
    loaded = load_state(tmp_path / "state.safetensors")  # fresh tensors: packing and views are gone
    objective, _ = _problem()
    check_compatible(loaded, method.init(trainable_params(objective.model), model_buffers(objective.model)), "x")
    _, resumed, rest = _train(name, ascent, 5, state=loaded, method=method)
    assert torch.equal(torch.cat([first, rest]), straight_losses)
    assert _same(resumed.params, straight.params) and _same(resumed.aux, straight.aux)
