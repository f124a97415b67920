"""The batched (vmap) BMA path against the per-sample loop, its chunking, automatic choice and fallback."""


import pytest
import torch
from torch import nn

from flatbma import batching
from flatbma.errors import FlatbmaError
from flatbma.models import build_model
from flatbma.predict import evaluate, sample_log_probs


def perturbed_samples(model: nn.Module, num: int, seed: int, *, params: bool = True) -> list[dict[str, torch.Tensor]]:
    """``num`` weight dicts: parameters jittered (unless ``params=False``) and BatchNorm statistics
    changed per sample, so every sample has its own buffers."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num):
        w = {}
        for k, v in model.named_parameters():
            noise = 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)
            w[k] = v.detach() + noise if params else v.detach().clone()
        for k, v in model.named_buffers():
            if k.endswith("running_var"):
                w[k] = v * (0.5 + torch.rand(v.shape, generator=g, dtype=v.dtype))
            elif k.endswith("running_mean"):
                w[k] = v + 0.2 * torch.randn(v.shape, generator=g, dtype=v.dtype)
            else:
                w[k] = v.clone()
        samples.append(w)
    return samples


FAMILIES = {
    # name: (build_model kwargs, input shape, dtype): float64 where it is cheap, so that the paths
    # agree to 1e-10; MobileNetV2's float64 convolutions are slow on the CPU, it runs in float32
    "mlp": (dict(name="mlp", in_channels=1, image_size=8, width=16), (1, 8, 8), torch.float64),
    "cnn": (dict(name="cnn", in_channels=1, image_size=8, width=4), (1, 8, 8), torch.float64),
    "resnet18": (dict(name="resnet18", in_channels=3, image_size=8, width=8), (3, 8, 8), torch.float64),
    "mobilenet_v2": (dict(name="mobilenet_v2", in_channels=3, image_size=16), (3, 16, 16), torch.float32),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_equals_loop_on_every_model_family(family):
    kwargs, shape, dtype = FAMILIES[family]
    model = build_model(**kwargs, num_classes=5, seed=0).to(dtype).eval()
    samples = perturbed_samples(model, 4, seed=1)
    x = torch.randn(3, *shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    with torch.no_grad():
        loop = sample_log_probs(model, samples, x, batched=False)
        batched = sample_log_probs(model, samples, x, batched=True)
    assert batched.shape == loop.shape == (4, 3, 5)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(batched, loop, rtol=tol, atol=tol)
    assert (loop[0] - loop[1]).abs().max() > 1e-3  # the samples really differ


def test_per_sample_buffers_are_stacked():
    # equal parameters, different BatchNorm statistics: only stacked buffers can tell the samples apart
    model = build_model("cnn", num_classes=3, in_channels=1, image_size=8, width=4, seed=0).double().eval()
    samples = perturbed_samples(model, 4, seed=3, params=False)
    x = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        batched = sample_log_probs(model, samples, x, batched=True)
        loop = sample_log_probs(model, samples, x, batched=False)
    torch.testing.assert_close(batched, loop, rtol=1e-10, atol=1e-10)
    for m in range(1, 4):
        assert (batched[m] - batched[0]).abs().max() > 1e-3


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 10])
def test_chunks_of_any_size_give_the_loop_result(chunk_size):
    model = build_model("resnet18", num_classes=4, in_channels=1, image_size=8, width=8, seed=0).double().eval()
    samples = perturbed_samples(model, 7, seed=5)  # 7 = 3 + 3 + 1 for chunk_size 3
    x = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    with torch.no_grad():
        loop = sample_log_probs(model, samples, x, batched=False)
        batched = sample_log_probs(model, samples, x, batched=True, chunk_size=chunk_size)
    torch.testing.assert_close(batched, loop, rtol=1e-10, atol=1e-10)


class _Square(torch.autograd.Function):
    """An autograd.Function without ``setup_context``: functorch refuses to vmap it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class Unbatchable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return _Square.apply(self.linear(x))


class CallsItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x) * self.linear.bias.abs().sum().item()


def _linear_samples(model: nn.Module, num: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        {k: v.detach() + torch.randn(v.shape, generator=g) for k, v in model.named_parameters()} for _ in range(num)
    ]


def test_fallback_gives_the_loop_result_and_is_remembered():
    model = Unbatchable()
    samples = _linear_samples(model, 5)
    x = torch.randn(8, 4)
    with torch.no_grad():
        expected = sample_log_probs(model, samples, x, batched=False)
        model.calls = 0
        first = sample_log_probs(model, samples, x)
        assert model.calls == 1 + 1 + 5  # shape-only probe on meta, one traced vmap attempt, the loop
        model.calls = 0
        second = sample_log_probs(model, samples, x)
        assert model.calls == 5  # the failure is cached: no second attempt
        assert torch.equal(first, expected) and torch.equal(second, expected)
        with pytest.raises(FlatbmaError, match="vmap cannot evaluate Unbatchable"):
            sample_log_probs(model, samples, x, batched=True)


def test_model_calling_item_gives_the_loop_result():
    model = CallsItem()
    samples = _linear_samples(model, 4)
    x = torch.randn(8, 4)
    with torch.no_grad():
        expected = sample_log_probs(model, samples, x, batched=False)
        torch.testing.assert_close(sample_log_probs(model, samples, x), expected)
        torch.testing.assert_close(sample_log_probs(model, samples, x, chunk_size=2), expected)


def test_footprint_rule_on_cpu():
    # the rule decides wherever the two paths may differ (tests/test_predict_chooser.py): here the models are
    # in training mode, their BatchNorm updating its statistics; batching.decision reports the choice and, by
    # its key's chunk size, the automatic chunk
    with torch.no_grad():
        small = build_model("cnn", num_classes=3, in_channels=1, image_size=8, width=4, seed=0).train()
        samples, x = perturbed_samples(small, 6, seed=0), torch.randn(4, 1, 8, 8)
        sample_log_probs(small, samples, x)
        choice = batching.decision(small, samples, x, chunk_size=6)  # all samples in one chunk
        assert choice is not None and choice.by == "rule" and choice.batched  # overhead-dominated: batched
        large = build_model("cnn", num_classes=3, in_channels=1, image_size=28, seed=0).train()
        samples, x = perturbed_samples(large, 2, seed=0), torch.randn(64, 1, 28, 28)
        sample_log_probs(large, samples, x)
        choice = batching.decision(large, samples, x)
        assert choice is not None and choice.by == "rule" and not choice.batched  # 64 images of 32×28×28: the loop
        one, x = perturbed_samples(small, 1, seed=0), torch.randn(4, 1, 8, 8)
        sample_log_probs(small, one, x)
        assert batching.decision(small, one, x) is None  # a single sample is never batched: nothing to choose


def test_automatic_chunk_size_respects_the_activation_budget(monkeypatch):
    model = build_model("cnn", num_classes=3, in_channels=1, image_size=8, width=4, seed=0).double().eval()
    samples = perturbed_samples(model, 5, seed=0)
    x = torch.randn(4, 1, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        expected = sample_log_probs(model, samples, x, batched=False)
        # widest layer: 4 images × 4 channels × 8 × 8 = 1024 float64 values per sample
        weight_bytes = sum(t.numel() * t.element_size() for t in samples[0].values())
        monkeypatch.setattr(batching, "ACTIVATION_BUDGET_BYTES", 2 * (1024 * 8 + weight_bytes))
        torch.testing.assert_close(sample_log_probs(model, samples, x), expected)
        assert batching.decision(model, samples, x, chunk_size=2) is not None  # the automatic chunk was 2
        torch.testing.assert_close(sample_log_probs(model, samples, x, batched=True), expected)


def test_samples_that_cannot_be_stacked_use_the_loop():
    model = nn.Sequential(nn.Linear(4, 3))
    samples = [{"0.weight": torch.randn(3, 4)}, {"0.weight": torch.randn(3, 4), "0.bias": torch.randn(3)}]
    x = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(
            sample_log_probs(model, samples, x), sample_log_probs(model, samples, x, batched=False)
        )
        with pytest.raises(FlatbmaError, match="other keys"):
            sample_log_probs(model, samples, x, batched=True)


@pytest.mark.parametrize(("batched", "chunk_size"), [("yes", None), (None, 0), (None, True), (True, 2.0)])
def test_invalid_options_are_rejected(batched, chunk_size):
    model = nn.Linear(4, 3)
    with pytest.raises(FlatbmaError, match=r"batched|chunk_size"):
        sample_log_probs(
            model, [dict(model.named_parameters())], torch.randn(2, 4), batched=batched, chunk_size=chunk_size
        )


def test_active_dropout_draws_independent_masks_per_sample():
    # MC dropout predicts with dropout in train mode: vmap must not share one mask across samples
    model = build_model("mlp", num_classes=3, in_channels=1, image_size=4, width=32, dropout=0.5, seed=0).train()
    samples = [{k: v.detach() for k, v in model.named_parameters()}] * 4
    x = torch.randn(2, 1, 4, 4)
    with torch.no_grad():
        torch.manual_seed(11)
        out = sample_log_probs(model, samples, x, batched=True)
        torch.manual_seed(11)
        again = sample_log_probs(model, samples, x, batched=True)
    assert torch.equal(out, again)  # reproducible for a fixed seed
    for m in range(1, 4):
        assert not torch.allclose(out[m], out[0])


def test_train_mode_batchnorm_matches_the_loop():
    model = build_model("cnn", num_classes=3, in_channels=1, image_size=8, width=4, seed=0).double().train()
    samples = perturbed_samples(model, 3, seed=8)
    x = torch.randn(6, 1, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        batched = sample_log_probs(model, samples, x, batched=True)
        loop = sample_log_probs(model, [{k: v.clone() for k, v in w.items()} for w in samples], x, batched=False)
    torch.testing.assert_close(batched, loop, rtol=1e-10, atol=1e-10)


def test_evaluate_gives_the_same_metrics_on_both_paths():
    model = build_model("cnn", num_classes=3, in_channels=1, image_size=8, width=4, seed=0).double()
    samples = perturbed_samples(model, 4, seed=9)
    g = torch.Generator().manual_seed(10)
    loader = [
        (torch.randn(5, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g))
        for _ in range(3)
    ]
    loop = evaluate(model, samples, loader, num_classes=3, batched=False)
    batched = evaluate(model, samples, loader, num_classes=3, batched=True, chunk_size=3)
    assert batched.keys() == loop.keys()
    for key, value in loop.items():
        assert batched[key] == pytest.approx(value, rel=1e-9, abs=1e-12)
