"""The automatic BMA path (``batched=None``): agreement check, timed probe, cache, RNG, exact results.

No test times anything: the probe's clock is replaced by a fake one that advances by a fixed cost
per call of each path.
"""

import contextlib
import importlib
import random
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from flatbma.bn import eval_mode
from flatbma.models import build_model
from flatbma.posteriors.mc_dropout import mc_dropout_mode
from flatbma.predict import sample_log_probs
from flatbma.transfer import subset_names

batching = importlib.import_module("flatbma.batching")


class Elementwise(nn.Module):
    """``relu(x·a + b)·c`` entry by entry: no sums, so the loop and vmap round alike by construction."""

    def __init__(self, n: int = 5) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(n, generator=g))
        self.b = nn.Parameter(torch.randn(n, generator=g))
        self.c = nn.Parameter(torch.randn(n, generator=g))

    def forward(self, x):
        return torch.relu(x * self.a + self.b) * self.c


def jittered(model: nn.Module, num: int, seed: int, names: set[str] | None = None) -> list[dict[str, torch.Tensor]]:
    """``num`` weight dicts: the parameters in ``names`` (all when ``None``) jittered, buffers copied."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num):
        w = {
            k: v.detach() + 0.05 * torch.randn(v.shape, generator=g) if names is None or k in names else v.detach()
            for k, v in model.named_parameters()
        }
        w.update({k: v.clone() for k, v in model.named_buffers()})
        samples.append(w)
    return samples


def choices(model: nn.Module) -> list:
    return list(batching._CHOICES.get(model, {}).values())


def fake_clock(monkeypatch, loop_seconds: float, vmap_seconds: float) -> list[str]:
    """Replace the probe's clock: every loop call costs ``loop_seconds``, every vmap call ``vmap_seconds``.

    Returns the list the paths append their names to when called.
    """
    now = [0.0]
    calls: list[str] = []
    real_loop, real_batched = batching._loop_log_probs, batching._batched_log_probs

    def loop(*args):
        calls.append("loop")
        now[0] += loop_seconds
        return real_loop(*args)

    def batched(*args):
        calls.append("vmap")
        now[0] += vmap_seconds
        return real_batched(*args)

    monkeypatch.setattr(batching, "_clock", lambda: now[0])
    monkeypatch.setattr(batching, "_loop_log_probs", loop)
    monkeypatch.setattr(batching, "_batched_log_probs", batched)
    return calls


@pytest.mark.parametrize(("loop_seconds", "vmap_seconds", "batched"), [(1.0, 3.0, False), (3.0, 1.0, True)])
def test_auto_follows_the_faster_path_where_the_paths_agree(monkeypatch, loop_seconds, vmap_seconds, batched):
    model = Elementwise()
    samples = jittered(model, 6, seed=1)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        loop = sample_log_probs(model, samples, x, batched=False)
        vmap = sample_log_probs(model, samples, x, batched=True)
        calls = fake_clock(monkeypatch, loop_seconds, vmap_seconds)
        first = sample_log_probs(model, samples, x)
        assert choices(model) == [batching._Choice(batched, "probe", (loop_seconds, vmap_seconds))]
        calls.clear()
        second = sample_log_probs(model, samples, x)
    assert calls == ["vmap" if batched else "loop"]  # cached: only the faster path runs
    assert torch.equal(loop, vmap)  # the premise: here the timing cannot change the numbers
    assert torch.equal(first, loop) and torch.equal(second, loop)


@pytest.mark.parametrize("where", ["everywhere", "real batch only"])
def test_paths_that_differ_in_one_bit_are_left_to_the_rule(monkeypatch, where):
    # vmap nudged by one ulp: the clock favours the loop, but only the (deterministic) footprint rule
    # may choose, and for this tiny model it batches
    model = Elementwise()
    samples = jittered(model, 6, seed=3)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(4))
    real_batched = batching._batched_log_probs

    def nudged(model_, samples_, inputs, chunk):
        out = real_batched(model_, samples_, inputs, chunk)
        return torch.nextafter(out, torch.full_like(out, -1.0)) if where == "everywhere" or inputs is x else out

    monkeypatch.setattr(batching, "_batched_log_probs", nudged)
    with torch.no_grad():
        forced = sample_log_probs(model, samples, x, batched=True)
        fake_clock(monkeypatch, loop_seconds=1.0, vmap_seconds=10.0)
        auto = sample_log_probs(model, samples, x)
        again = sample_log_probs(model, samples, x)
    assert choices(model) == [batching._Choice(True, "rule")]
    assert torch.equal(auto, forced) and torch.equal(again, forced)


def test_the_probe_runs_once_per_key(monkeypatch):
    probes = []
    real = batching._probe

    def spy(*args):
        probes.append(tuple(args[2].shape))
        return real(*args)

    monkeypatch.setattr(batching, "_probe", spy)
    model = Elementwise()
    samples = jittered(model, 4, seed=5)
    x4, x3 = torch.randn(4, 5), torch.randn(3, 5)
    with torch.no_grad():
        for _ in range(3):
            sample_log_probs(model, samples, x4)
        assert probes == [(4, 5)]
        sample_log_probs(model, samples, torch.randn(4, 5))  # other values, same key
        sample_log_probs(model, samples, x4, batched=True)  # forced paths never probe
        sample_log_probs(model, samples, x4, batched=False)
        assert probes == [(4, 5)]
        sample_log_probs(model, samples, x3)  # another batch shape
        sample_log_probs(model, samples[:3], x4)  # another number of samples
        sample_log_probs(model, samples, x4, chunk_size=2)  # another chunk size
        sample_log_probs(model, [{k: v.double() for k, v in w.items()} for w in samples], x4.double())
        sample_log_probs(Elementwise(), samples, x4)  # another model
        assert len(probes) == 6
        sample_log_probs(model, samples, x3)
        assert len(probes) == 6
        assert len(choices(model)) == 5


@pytest.mark.parametrize("cached_batched", [False, True])
def test_the_stacking_check_runs_only_where_the_samples_would_be_stacked(monkeypatch, cached_batched):
    """A cached choice of the loop skips the per-tensor check; one of vmap still refuses unstackable samples."""
    model = Elementwise()
    samples, x = jittered(model, 4, seed=11), torch.randn(4, 5)
    fake_clock(monkeypatch, loop_seconds=1.0 if cached_batched else 0.1, vmap_seconds=0.1 if cached_batched else 1.0)
    with torch.no_grad():
        sample_log_probs(model, samples, x)  # probes and caches the choice
    assert [c.batched for c in choices(model)] == [cached_batched]
    checked = []
    real = batching._stacking_problem
    monkeypatch.setattr(batching, "_stacking_problem", lambda s: checked.append(1) or real(s))
    with torch.no_grad():
        sample_log_probs(model, samples, x)
        assert len(checked) == int(cached_batched)
        # sample 0's layout (the key) unchanged, a later sample of another dtype: never stacked
        odd = [*samples[:3], {k: v.double() for k, v in samples[3].items()}]
        loop = batching._loop_log_probs(model, odd, x)
        assert torch.equal(sample_log_probs(model, odd, x), loop)


def test_the_probe_leaves_every_rng_alone():
    model = Elementwise()
    samples = jittered(model, 4, seed=6)
    generator = torch.Generator().manual_seed(7)
    states = (torch.get_rng_state(), generator.get_state(), random.getstate())
    with torch.no_grad():
        sample_log_probs(model, samples, torch.randn(4, 5, generator=torch.Generator().manual_seed(8)))
    assert [c.by for c in choices(model)] == ["probe"]  # it did probe: scrambled copies, two timed rounds
    assert torch.equal(torch.get_rng_state(), states[0])
    assert torch.equal(generator.get_state(), states[1])
    assert random.getstate() == states[2]


def _mlp() -> tuple[nn.Module, list, tuple]:
    model = build_model("mlp", num_classes=10, in_channels=1, image_size=8, seed=0)
    return model, jittered(model, 5, seed=9), (32, 1, 8, 8)


def _mc_dropout_mlp() -> tuple[nn.Module, list, tuple]:
    model = build_model("mlp", num_classes=10, in_channels=1, image_size=8, dropout=0.3, seed=0)
    return model, jittered(model, 5, seed=10), (32, 1, 8, 8)


def _cnn() -> tuple[nn.Module, list, tuple]:
    model = build_model("cnn", num_classes=5, in_channels=1, image_size=12, width=8, seed=0)
    return model, jittered(model, 5, seed=11), (16, 1, 12, 12)


def _transfer() -> tuple[nn.Module, list, tuple]:
    model = build_model("mobilenet_v2", num_classes=5, in_channels=3, image_size=16, seed=0)
    names = set(subset_names(model, "norm+classifier"))  # the rest is shared by every sample, as in transfer
    return model, jittered(model, 4, seed=12, names=names), (4, 3, 16, 16)


@contextlib.contextmanager
def train_mode(model: nn.Module):
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


SHIPPED = {
    # name: (model and samples, prediction mode, the decider when it does not depend on the platform)
    "mlp": (_mlp, eval_mode, None),
    "mlp, MC dropout": (_mc_dropout_mlp, mc_dropout_mode, "rule"),  # draws random numbers
    "cnn, BatchNorm": (_cnn, eval_mode, None),
    "cnn, train-mode BatchNorm": (_cnn, train_mode, "rule"),
    "mobilenet_v2, norm + classifier": (_transfer, eval_mode, None),
}


@pytest.mark.parametrize("name", list(SHIPPED))
def test_auto_equals_the_path_it_chose_bit_for_bit_on_the_shipped_models(name):
    build, mode, decider = SHIPPED[name]
    model, samples, shape = build()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(13))

    def run(batched):
        fresh = [{k: v.clone() for k, v in w.items()} for w in samples]  # train-mode BatchNorm updates them
        torch.manual_seed(14)
        with torch.no_grad(), mode(model):
            first = sample_log_probs(model, fresh, x, batched=batched)
            second = sample_log_probs(model, fresh, x, batched=batched)  # None: the cached choice
        return first, second, torch.get_rng_state(), fresh

    auto = run(None)
    (choice,) = choices(model)
    assert decider is None or choice.by == decider
    forced = run(choice.batched)
    assert torch.equal(auto[0], forced[0]) and torch.equal(auto[1], forced[1])
    assert torch.equal(auto[2], forced[2])  # the RNG where the chosen path alone leaves it
    assert all(torch.equal(a[k], f[k]) for a, f in zip(auto[3], forced[3], strict=True) for k in a)
    if choice.by == "probe":  # chosen by timing: then the other path gives the same bits
        other = run(not choice.batched)
        assert torch.equal(other[0], auto[0]) and torch.equal(other[1], auto[1])


def test_the_bma_bench_reports_every_path():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bma

    label, kwargs, _, shape = bma.CASES["mlp"]
    result = bma.bench_case(kwargs, 8, shape, num_samples=3, rounds=1, device="cpu")
    assert set(result["median"]) == {"loop", "vmap", "auto"}
    assert result["choice"].by in {"probe", "rule"}
    assert 0 < result["auto_vs_fastest"]
