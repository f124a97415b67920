"""The loop's host reads: on a GPU it reads its losses every ``CHECK_EVERY`` steps, with the same divergence report.

A GPU is not needed to check the logic: the loop's GPU behaviour (``_lazy``) is forced on the CPU, and the
host reads it makes are counted by the tensor methods that read a value (each one a synchronization on a
GPU; ``tests/test_cuda.py`` counts the real ones with ``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from flatbma import loop
from flatbma.errors import DivergenceError
from flatbma.methods import parse_method
from flatbma.optim import SGD
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.types import StepOutput
from tests.helpers import tiny_bn_net, toy_batch

READS = ("item", "__float__", "__bool__", "__int__", "tolist")


def _setup(name: str = "sgd", n: int = 64 * 8):
    torch.manual_seed(0)
    model = tiny_bn_net()
    method = parse_method(name).build(Objective(model, num_data=n), SGD(lr=0.1, momentum=0.9))
    x, y = toy_batch(n=n)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    return method, method.init(trainable_params(model), model_buffers(model)), loader


def _diverging(method, at_step: int):
    """``method`` whose loss reads NaN from step ``at_step`` on (the state itself keeps training)."""

    def update(state, batch):
        state, out = method.update(state, batch)
        loss = out.loss if state.step < at_step else out.loss * float("nan")
        return state, StepOutput(loss, out.logits, out.stats)

    return dataclasses.replace(method, update=update)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_lazy_check_reports_the_same_step_and_keeps_the_same_checkpoint(monkeypatch, lazy):
    monkeypatch.setattr(loop, "_lazy", lambda device: lazy)
    method, state, loader = _setup()
    saved = []
    with pytest.raises(DivergenceError) as e:
        loop.fit(
            _diverging(method, 45),
            state,
            loader,
            epochs=2,
            checkpoint=lambda s, p, h: saved.append(s.step),
            checkpoint_every=10,
            progress=False,
        )
    assert str(e.value) == "the training loss became nan at step 45 (epoch 1)"
    assert saved == [10, 20, 30, 40]  # never a state after the non-finite loss


def test_lazy_sums_equal_eager_ones(monkeypatch):
    histories = {}
    for lazy in (False, True):
        monkeypatch.setattr(loop, "_lazy", lambda device, lazy=lazy: lazy)
        method, state, loader = _setup("sam")
        _, history = loop.fit(method, state, loader, epochs=2, progress=False)
        histories[lazy] = [h.record() for h in history.epochs]
    assert histories[True] == histories[False]


def test_a_steady_training_step_reads_nothing_from_the_device(monkeypatch):
    """With the GPU behaviour, SGD and SAM steps read no value: only the checks every CHECK_EVERY steps do."""
    monkeypatch.setattr(loop, "_lazy", lambda device: True)
    originals = {r: getattr(torch.Tensor, r) for r in READS}
    counts: collections.Counter = collections.Counter()

    def counting(read, counts=counts, originals=originals):
        def wrapped(self, *args):
            counts[read] += 1
            return originals[read](self, *args)

        return wrapped

    for name in ("sgd", "sam"):
        method, state, _ = _setup(name)
        x, y = toy_batch(n=64 * 8)
        batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, len(y), 8)]  # no loader: its own reads aside
        counts.clear()
        for read in READS:
            monkeypatch.setattr(torch.Tensor, read, counting(read))
        loop.fit(method, state, batches, epochs=1, progress=False)  # 64 steps
        for read in READS:
            monkeypatch.setattr(torch.Tensor, read, originals[read])
        checks = 64 // loop.CHECK_EVERY
        assert sum(counts.values()) == checks + 2, (name, counts)  # one per check; the epoch end's two sums
