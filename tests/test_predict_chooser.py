"""The automatic BMA path (``batched=None``): the numbers of the path it chose, chosen once per key, RNG alone.

Behaviour only, through :func:`flatbma.batching.decision`: no test times anything or replaces the chooser's
clock or private functions. That the automatic path is never slower than the slower path is measured by
``bench/bma.py`` (``auto_vs_fastest``), side by side.
"""

import contextlib
import random
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from flatbma import batching
from flatbma.bn import eval_mode
from flatbma.models import build_model
from flatbma.posteriors.mc_dropout import mc_dropout_mode
from flatbma.predict import sample_log_probs
from flatbma.transfer import subset_names


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


class Counted(Elementwise):
    """:class:`Elementwise` that counts its forward calls (a batched call of a chunk counts once)."""

    def __init__(self, n: int = 5) -> None:
        super().__init__(n)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def test_auto_gives_the_numbers_of_both_paths_where_they_agree():
    model = Elementwise()
    samples = jittered(model, 6, seed=1)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        loop = sample_log_probs(model, samples, x, batched=False)
        vmap = sample_log_probs(model, samples, x, batched=True)
        assert batching.decision(model, samples, x) is None  # forced paths choose nothing
        first = sample_log_probs(model, samples, x)
        second = sample_log_probs(model, samples, x)
    assert torch.equal(loop, vmap)  # the premise: here the timing cannot change the numbers
    assert torch.equal(first, loop) and torch.equal(second, loop)
    assert batching.decision(model, samples, x).by == "probe"  # bit-identical paths: the faster one


def test_a_choice_once_made_runs_the_chosen_path_alone():
    model = Counted()
    samples = jittered(model, 4, seed=5)
    x4, x3 = torch.randn(4, 5), torch.randn(3, 5)
    with torch.no_grad():
        sample_log_probs(model, samples, x4)  # the first call of a key checks and probes: extra passes
        choice = batching.decision(model, samples, x4)
        model.calls = 0
        sample_log_probs(model, samples, x4, batched=choice.batched)
        alone = model.calls
        for inputs in (x4, torch.randn(4, 5)):  # the same key: other values of the same shape
            model.calls = 0
            sample_log_probs(model, samples, inputs)
            assert model.calls == alone
        model.calls = 0
        sample_log_probs(model, samples, x3)  # another key (the batch shape): checked and probed again
        assert model.calls > alone
        assert batching.decision(model, samples, x3) is not None
        assert batching.decision(model, samples[:3], x4) is None  # another number of samples: not yet


def test_samples_that_cannot_be_stacked_give_the_loops_numbers():
    model = Elementwise()
    samples, x = jittered(model, 4, seed=11), torch.randn(4, 5)
    with torch.no_grad():
        sample_log_probs(model, samples, x)  # makes and keeps the choice of this key
        # sample 0's layout (the key) unchanged, a later sample of another dtype: never stacked
        odd = [*samples[:3], {k: v.double() for k, v in samples[3].items()}]
        assert torch.equal(sample_log_probs(model, odd, x), sample_log_probs(model, odd, x, batched=False))


def test_the_probe_leaves_every_rng_alone():
    model = Elementwise()
    samples = jittered(model, 4, seed=6)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(8))
    generator = torch.Generator().manual_seed(7)
    states = (torch.get_rng_state(), generator.get_state(), random.getstate())
    with torch.no_grad():
        sample_log_probs(model, samples, x)
    assert batching.decision(model, samples, x).by == "probe"  # it did probe: scrambled copies, timed rounds
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
            second = sample_log_probs(model, fresh, x, batched=batched)  # None: the kept choice
            choice = batching.decision(model, samples, x)
        return first, second, torch.get_rng_state(), fresh, choice

    auto = run(None)
    choice = auto[4]
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
