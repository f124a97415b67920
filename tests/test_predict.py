import math

import pytest
import torch
from torch import nn

from flatbma.calibration import scale
from flatbma.errors import FlatbmaError
from flatbma.metrics import StreamingMetrics
from flatbma.predict import bma_log_probs, evaluate, log_mean_exp, predict, rescaled_metrics, stream_metrics


class Fixed(nn.Module):
    """Returns the logits stored in its parameter for every input (one row per input index)."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(logits)

    def forward(self, x):
        return self.table[x.long()]


def test_bma_is_log_of_mean_softmax():
    g = torch.Generator().manual_seed(0)
    samples = [{"table": torch.randn(5, 4, generator=g, dtype=torch.float64)} for _ in range(7)]
    model = Fixed(torch.zeros(5, 4, dtype=torch.float64))
    x = torch.arange(5)
    got = bma_log_probs(model, samples, x)
    expected = torch.stack([torch.softmax(s["table"], -1) for s in samples]).mean(0).log()
    torch.testing.assert_close(got, expected)


def test_bma_of_one_sample_is_its_log_softmax():
    logits = torch.randn(3, 4)
    model = Fixed(logits)
    torch.testing.assert_close(bma_log_probs(model, [{"table": logits}], torch.arange(3)), logits.log_softmax(-1))


def test_bma_stays_finite_when_one_sample_gives_probability_zero():
    # sample 1 puts (numerically) zero mass on class 0; sample 2 does not: the BMA must not be -inf
    a = torch.tensor([[-1e4, 0.0]])
    b = torch.tensor([[0.0, 0.0]])
    model = Fixed(a)
    out = bma_log_probs(model, [{"table": a}, {"table": b}], torch.zeros(1))
    assert torch.isfinite(out).all()
    assert out[0, 0].item() == pytest.approx(math.log(0.25), rel=1e-6)


def test_log_mean_exp_extreme_values():
    a = torch.tensor([[-1000.0], [-1000.0 + math.log(3.0)]])
    assert log_mean_exp(a).item() == pytest.approx(-1000.0 + math.log(2.0))


def test_predict_restores_training_mode_and_needs_samples():
    model = Fixed(torch.zeros(2, 3))
    model.train()
    loader = [(torch.arange(2), torch.tensor([0, 1]))]
    out = list(predict(model, [{"table": torch.zeros(2, 3)}], loader))
    assert out[0][0].shape == (2, 3)
    assert model.training
    with pytest.raises(FlatbmaError, match="at least one posterior sample"):
        bma_log_probs(model, [], torch.arange(2))


def test_stream_metrics_gives_every_prefix_bma_in_one_pass():
    """The state of the first m samples equals ``evaluate`` on those m samples alone, bit for bit."""
    g = torch.Generator().manual_seed(3)
    samples = [{"table": torch.randn(40, 5, generator=g, dtype=torch.float64)} for _ in range(6)]
    model = Fixed(torch.zeros(40, 5, dtype=torch.float64))
    labels = torch.randint(0, 5, (40,), generator=g)
    loader = [(torch.arange(i, i + 8), labels[i : i + 8]) for i in range(0, 40, 8)]
    states = stream_metrics(model, samples, loader, num_classes=5, n_bins=7, sizes=(2, 4, 99))
    assert list(states) == [2, 4, 6]  # 99 is cut to M = 6, which is always there
    for m, state in states.items():
        alone = evaluate(model, samples[:m], loader, num_classes=5, n_bins=7)
        assert {**state.compute(), "num_samples": m} == alone
    scaled = stream_metrics(model, samples, loader, num_classes=5, n_bins=7, temperature=2.5)[6]
    by_hand = StreamingMetrics(num_classes=5, n_bins=7)
    for x, y in loader:
        by_hand.update(scale(bma_log_probs(model, samples, x), 2.5), y)
    assert scaled.compute() == by_hand.compute()
    kept = []  # the full BMA's predictives of the unscaled pass, rescaled afterwards: the same state
    plain = stream_metrics(model, samples, loader, num_classes=5, n_bins=7, sizes=(2,), keep=kept)
    assert len(kept) == len(loader) and all(torch.equal(y, b[1]) for (_, y), b in zip(kept, loader))
    assert rescaled_metrics(kept, 2.5, num_classes=5, n_bins=7).compute() == scaled.compute()
    assert rescaled_metrics(kept, 1.0, num_classes=5, n_bins=7).compute() == plain[6].compute()
    with pytest.raises(FlatbmaError, match="at least one posterior sample"):
        stream_metrics(model, [], loader, num_classes=5)
