"""Tests of flatbma.metrics: hand-computed cases, independent numpy implementations, sklearn AUROC."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from flatbma import metrics as M
from flatbma.errors import FlatbmaError


# --------------------------------------------------------------------------------------------------
# helpers: data and independent reference implementations (numpy, written from the definitions)
# --------------------------------------------------------------------------------------------------
def _random_case(n: int = 600, c: int = 7, seed: int = 0, dtype: torch.dtype = torch.float64):
    """BMA-like log-probs (log-mean-exp of 5 softmaxes) and labels that are partly calibrated."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, n, c, generator=g, dtype=torch.float64) * 2.0
    lp = torch.logsumexp(torch.log_softmax(logits, -1), 0) - math.log(5)
    # labels: sampled from a sharpened predictive for half of the rows, uniform for the rest
    sharp = torch.softmax(2.0 * lp, -1)
    y = torch.multinomial(sharp, 1, generator=g).squeeze(1)
    noise = torch.randint(0, c, (n,), generator=g)
    y = torch.where(torch.rand(n, generator=g) < 0.5, y, noise)
    return lp.to(dtype), y


def _np_stats(lp: torch.Tensor, y: torch.Tensor):
    p = np.exp(lp.double().numpy())
    yy = y.numpy()
    conf = p.max(1)
    correct = (p.argmax(1) == yy).astype(np.float64)
    return p, yy, conf, correct


def _np_ece(lp, y, n_bins):
    _, _, conf, correct = _np_stats(lp, y)
    total = 0.0
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        mask = (conf > lo) & (conf <= hi)
        if b == 0:
            mask |= conf <= 0.0
        if b == n_bins - 1:
            mask |= conf > 1.0
        if mask.any():
            total += mask.mean() * abs(correct[mask].mean() - conf[mask].mean())
    return total


def _np_adaptive_ece(lp, y, n_bins):
    _, _, conf, correct = _np_stats(lp, y)
    order = np.argsort(conf, kind="stable")
    total = 0.0
    for chunk in np.array_split(order, n_bins):
        if chunk.size:
            total += chunk.size / conf.size * abs(correct[chunk].mean() - conf[chunk].mean())
    return total


def _tiny_case():
    """Four rows with probabilities that survive exp(log(p)) exactly in float64.

    row  p                y  pred  correct  conf   -log p_y      brier
    0    [0.5, 0.5]       0  0     1        0.5    log 2         0.25 + 0.25
    1    [0.75, 0.25]     1  0     0        0.75   log 4         0.5625 + 0.5625
    2    [0, 1]           1  1     1        1.0    0             0
    3    [0.25, 0.75]     1  1     1        0.75   log(4/3)      0.0625 + 0.0625
    """
    p = torch.tensor([[0.5, 0.5], [0.75, 0.25], [0.0, 1.0], [0.25, 0.75]], dtype=torch.float64)
    lp = p.log()
    assert torch.equal(lp.exp(), p)  # precondition: the edge confidences are exact
    return lp, torch.tensor([0, 1, 1, 1])


# --------------------------------------------------------------------------------------------------
# binning rule
# --------------------------------------------------------------------------------------------------
def test_bin_index_edges():
    conf = torch.tensor([0.0, 0.1, 0.25, 0.3, 0.5, 0.6, 0.75, 0.9, 1.0, -1e-12, 1.0 + 1e-12])
    assert M.bin_index(conf, 4).tolist() == [0, 0, 0, 1, 1, 2, 2, 3, 3, 0, 3]
    assert M.bin_index(conf, 1).tolist() == [0] * conf.numel()
    # 15 bins: 0 goes in the first bin and 1.0 in the last
    assert M.bin_index(torch.tensor([0.0, 1.0]), 15).tolist() == [0, 14]


def test_bin_index_rejects_bad_n_bins():
    with pytest.raises(FlatbmaError, match="n_bins"):
        M.bin_index(torch.tensor([0.5]), 0)


# --------------------------------------------------------------------------------------------------
# hand-computed tiny cases
# --------------------------------------------------------------------------------------------------
def test_tiny_case_by_hand():
    lp, y = _tiny_case()
    assert M.accuracy(lp, y) == 0.75
    assert M.nll(lp, y) == pytest.approx((5 * math.log(2) - math.log(3)) / 4, rel=1e-15)
    assert M.brier(lp, y) == pytest.approx(1.75 / 4, rel=1e-15)
    # bins of width 1/4: conf 0.5 → bin 1 (acc 1), 0.75 ×2 → bin 2 (acc 0.5), 1.0 → bin 3 (acc 1)
    assert M.ece(lp, y, n_bins=4) == pytest.approx(0.25 * 0.5 + 0.5 * 0.25, rel=1e-15)
    # equal mass: sorted (stable) rows 0, 1, 3, 2
    assert M.adaptive_ece(lp, y, n_bins=2) == pytest.approx((0.25 + 0.25) / 4, rel=1e-15)
    assert M.adaptive_ece(lp, y, n_bins=3) == pytest.approx((0.25 + 0.25 + 0.0) / 4, rel=1e-15)
    assert M.adaptive_ece(lp, y, n_bins=4) == pytest.approx((0.5 + 0.75 + 0.25) / 4, rel=1e-15)
    assert M.adaptive_ece(lp, y, n_bins=8) == M.adaptive_ece(lp, y, n_bins=4)  # empty chunks add 0
    # with one bin both ECEs are |accuracy − mean confidence|
    assert M.ece(lp, y, n_bins=1) == pytest.approx(abs(0.75 - 3.0 / 4), abs=1e-15)
    assert M.adaptive_ece(lp, y, n_bins=1) == M.ece(lp, y, n_bins=1)


def test_tiny_reliability_diagram():
    lp, y = _tiny_case()
    rd = M.reliability_diagram(lp, y, n_bins=4)
    assert set(rd) == {"bin_edges", "count", "confidence", "accuracy"}
    assert rd["bin_edges"].tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert rd["count"].tolist() == [0.0, 1.0, 2.0, 1.0]
    assert math.isnan(rd["confidence"][0]) and math.isnan(rd["accuracy"][0])
    assert rd["confidence"][1:].tolist() == [0.5, 0.75, 1.0]
    assert rd["accuracy"][1:].tolist() == [1.0, 0.5, 1.0]


def test_confidence_one_goes_in_last_bin_and_bin_edges():
    # C = 4, confidences 1.0 (one-hot) and 0.5; with 4 bins they land in bins 3 and 1
    p = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.25, 0.25, 0.0]], dtype=torch.float64)
    rd = M.reliability_diagram(p.log(), torch.tensor([0, 1]), n_bins=4)
    assert rd["count"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert M.ece(p.log(), torch.tensor([0, 1]), n_bins=4) == pytest.approx(0.5 * 0.5)


def test_nll_finite_with_zero_prob_on_wrong_class_and_inf_on_true_class():
    lp = torch.log(torch.tensor([[0.0, 0.3, 0.7], [0.2, 0.8, 0.0]], dtype=torch.float64))
    y = torch.tensor([2, 1])
    expected = -(math.log(0.7) + math.log(0.8)) / 2
    assert M.nll(lp, y) == pytest.approx(expected, rel=1e-14)
    for fn in (M.accuracy, M.brier, M.ece, M.adaptive_ece):
        assert math.isfinite(fn(lp, y))
    assert M.nll(lp, torch.tensor([0, 1])) == math.inf
    s = M.StreamingMetrics(3)
    s.update(lp, torch.tensor([0, 1]))
    assert s.compute()["nll"] == math.inf


def test_accuracy_ties_go_to_lowest_index():
    lp = torch.full((1, 4), -math.log(4), dtype=torch.float64)
    assert M.accuracy(lp, torch.tensor([0])) == 1.0
    assert M.accuracy(lp, torch.tensor([3])) == 0.0


def test_predictive_entropy():
    c = 5
    uniform = torch.full((1, c), -math.log(c), dtype=torch.float64)
    onehot = torch.log(torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]], dtype=torch.float64))
    h = M.predictive_entropy(torch.cat([uniform, onehot]))
    assert h.dtype == torch.float64
    assert h.tolist() == pytest.approx([math.log(c), 0.0], abs=1e-15)
    lp, _ = _random_case(n=50, c=c, dtype=torch.float32)
    p = np.exp(lp.double().numpy())
    np.testing.assert_allclose(M.predictive_entropy(lp).numpy(), -(p * np.log(p)).sum(1), rtol=1e-12)


def test_uncertainty_decomposition_by_hand():
    log = math.log
    # example 0: two confident samples that disagree -> aleatoric 0, total = epistemic = log 2
    # example 1: two identical uniform samples -> aleatoric = total = log 2, epistemic 0
    # example 2: p1 = (0.8, 0.2), p2 = (0.4, 0.6): BMA (0.6, 0.4)
    p = torch.tensor([[[1.0, 0.0], [0.5, 0.5], [0.8, 0.2]], [[0.0, 1.0], [0.5, 0.5], [0.4, 0.6]]], dtype=torch.float64)
    out = M.uncertainty_decomposition(p.log())
    h = lambda *q: -sum(x * log(x) for x in q if x > 0)  # noqa: E731
    total = [log(2), log(2), h(0.6, 0.4)]
    aleatoric = [0.0, log(2), (h(0.8, 0.2) + h(0.4, 0.6)) / 2]
    assert out["total"].tolist() == pytest.approx(total, abs=1e-15)
    assert out["aleatoric"].tolist() == pytest.approx(aleatoric, abs=1e-15)
    assert out["epistemic"].tolist() == pytest.approx([t - a for t, a in zip(total, aleatoric)], abs=1e-15)
    assert out["epistemic"][2] == pytest.approx(0.0863, abs=1e-4)  # 0.6730 - (0.5004 + 0.6730) / 2 by hand


def test_uncertainty_decomposition_against_numpy_and_its_identities():
    lps = torch.log_softmax(torch.randn(7, 40, 5, generator=torch.Generator().manual_seed(2)), -1)
    out = M.uncertainty_decomposition(lps)
    p = lps.double().exp().numpy()
    pbar = p.mean(0)
    np.testing.assert_allclose(out["total"].numpy(), -(pbar * np.log(pbar)).sum(1), rtol=1e-12)
    np.testing.assert_allclose(out["aleatoric"].numpy(), -(p * np.log(p)).sum(2).mean(0), rtol=1e-12)
    assert bool((out["epistemic"] > 0).all())  # Jensen: strictly, for samples that differ
    torch.testing.assert_close(out["total"], M.predictive_entropy(torch.logsumexp(lps, 0) - math.log(7)))
    one = M.uncertainty_decomposition(lps[:1])
    assert torch.equal(one["epistemic"], torch.zeros(40, dtype=torch.float64))  # one sample: nothing epistemic
    with pytest.raises(FlatbmaError, match=r"\[num_samples, batch, num_classes\]"):
        M.uncertainty_decomposition(lps[0])
    with pytest.raises(FlatbmaError, match="not normalized"):
        M.uncertainty_decomposition(lps + 1.0)


def test_ood_auroc_by_hand_with_ties():
    h_in = torch.tensor([0.0, 1.0])
    h_out = torch.tensor([1.0, 2.0])
    # pairs (in, out): (0,1) 1, (0,2) 1, (1,1) ½, (1,2) 1
    assert M.ood_auroc(h_in, h_out) == 3.5 / 4
    assert M.ood_auroc(h_out, h_in) == 0.5 / 4
    assert M.ood_auroc(torch.tensor([1.0]), torch.tensor([1.0])) == 0.5


# --------------------------------------------------------------------------------------------------
# offline metrics against independent implementations
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_offline_against_numpy(dtype):
    lp, y = _random_case(dtype=dtype)
    p, yy, _, correct = _np_stats(lp, y)
    onehot = np.eye(p.shape[1])[yy]
    assert M.accuracy(lp, y) == pytest.approx(correct.mean(), rel=1e-15)
    assert M.nll(lp, y) == pytest.approx(-lp.double().numpy()[np.arange(yy.size), yy].mean(), rel=1e-13)
    assert M.brier(lp, y) == pytest.approx(((p - onehot) ** 2).sum(1).mean(), rel=1e-13)
    for n_bins in (1, 4, 10, 15, 37):
        assert M.ece(lp, y, n_bins) == pytest.approx(_np_ece(lp, y, n_bins), abs=1e-13)
        assert M.adaptive_ece(lp, y, n_bins) == pytest.approx(_np_adaptive_ece(lp, y, n_bins), abs=1e-13)
    assert M.ece(lp, y) == pytest.approx(_np_ece(lp, y, 15), abs=1e-13)  # default n_bins = 15
    rd = M.reliability_diagram(lp, y, 15)
    assert rd["count"].sum() == y.numel()
    np.testing.assert_allclose(
        (rd["count"] / y.numel() * (rd["accuracy"] - rd["confidence"]).abs()).nansum().item(),
        M.ece(lp, y),
        rtol=1e-12,
    )


def test_float32_and_float64_inputs_agree():
    lp, y = _random_case(dtype=torch.float64)
    lp32 = lp.float()
    assert M.nll(lp32, y) == pytest.approx(M.nll(lp, y), rel=1e-6)
    assert M.brier(lp32, y) == pytest.approx(M.brier(lp, y), rel=1e-6)
    assert M.accuracy(lp32, y) == M.accuracy(lp, y)


def test_binary_brier_is_twice_sklearns_brier_score_loss():
    # flatbma sums the squared error over both classes (the multi-class definition); scikit-learn's
    # binary brier_score_loss scores the positive class only, so the two differ by exactly a factor 2
    from sklearn.metrics import brier_score_loss

    lp, y = _random_case(n=500, c=2, seed=3)
    p1 = lp.exp()[:, 1].numpy()
    assert M.brier(lp, y) == pytest.approx(2 * brier_score_loss(y.numpy(), p1), rel=1e-12)
    streaming = M.StreamingMetrics(2)
    streaming.update(lp, y)
    assert streaming.compute()["brier"] == pytest.approx(2 * brier_score_loss(y.numpy(), p1), rel=1e-12)


def test_ood_auroc_equals_sklearn():
    g = torch.Generator().manual_seed(1)
    for n_in, n_out, rounding in [(300, 200, None), (500, 50, 1), (40, 400, 0)]:
        h_in = torch.rand(n_in, generator=g, dtype=torch.float64) * 2.0
        h_out = torch.rand(n_out, generator=g, dtype=torch.float64) * 2.0 + 0.5
        if rounding is not None:  # create many ties
            h_in, h_out = h_in.round(decimals=rounding), h_out.round(decimals=rounding)
        scores = torch.cat([h_in, h_out]).numpy()
        truth = np.r_[np.zeros(n_in), np.ones(n_out)]
        assert M.ood_auroc(h_in, h_out) == pytest.approx(roc_auc_score(truth, scores), rel=0, abs=1e-14)


# --------------------------------------------------------------------------------------------------
# streaming
# --------------------------------------------------------------------------------------------------
def _batchings(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(0, n + 1, (9,), generator=g)).values.tolist()
    irregular = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]  # contains empty batches
    return {
        "one": [n],
        "ones": [1] * n,
        "sevens": [7] * (n // 7) + ([n % 7] if n % 7 else []),
        "irregular": irregular,
    }


def _stream(lp, y, sizes, **kw):
    s = M.StreamingMetrics(lp.shape[1], **kw)
    for lp_b, y_b in zip(torch.split(lp, sizes), torch.split(y, sizes), strict=True):
        s.update(lp_b, y_b)
    return s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_streaming_equals_offline_for_any_batching(dtype):
    lp, y = _random_case(n=400, dtype=dtype)
    offline = {
        "accuracy": M.accuracy(lp, y),
        "nll": M.nll(lp, y),
        "ece": M.ece(lp, y, 10),
        "brier": M.brier(lp, y),
    }
    for name, sizes in _batchings(lp.shape[0]).items():
        got = _stream(lp, y, sizes, n_bins=10).compute()
        assert set(got) == {"accuracy", "nll", "ece", "aece", "brier", "n"}, name
        assert got["n"] == lp.shape[0]
        for key, value in offline.items():
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-14), (name, key)


def test_streaming_reliability_equals_offline():
    lp, y = _random_case(n=300)
    s = _stream(lp, y, [100, 0, 150, 50])
    a, b = s.reliability(), M.reliability_diagram(lp, y)
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-12, atol=1e-14, equal_nan=True)


def test_streaming_aece_exact_when_each_fine_bin_holds_at_most_one_example():
    # C = 2, confidences at the centres of distinct fine bins (so no fine bin straddles a chunk)
    n_fine, n = 1000, 97
    g = torch.Generator().manual_seed(3)
    fine = torch.randperm(n_fine // 2 - 1, generator=g)[:n] + n_fine // 2 + 1
    conf = (fine.double() + 0.5) / n_fine
    lp = torch.stack([conf, 1 - conf], 1).log()
    y = torch.randint(0, 2, (n,), generator=g)
    for n_bins in (1, 5, 15, 96, 97, 200):
        for sizes in _batchings(n).values():
            s = _stream(lp, y, sizes, n_bins=n_bins, n_fine_bins=n_fine)
            want = M.adaptive_ece(lp, y, n_bins)
            assert s.compute()["aece"] == pytest.approx(want, rel=1e-12, abs=1e-14)


def test_streaming_aece_close_to_offline_on_random_data():
    lp, y = _random_case(n=3000, c=10, seed=5)
    n_bins, n_fine = 15, 1000
    want = M.adaptive_ece(lp, y, n_bins)
    got = _stream(lp, y, [1000, 1500, 500], n_bins=n_bins, n_fine_bins=n_fine).compute()["aece"]
    # documented bound: (2/n) Σ n_j over fine bins j that straddle an equal-mass chunk boundary
    conf = np.exp(lp.numpy()).max(1)
    fine_idx = np.clip(np.ceil(conf * n_fine) - 1, 0, n_fine - 1).astype(int)
    counts = np.bincount(fine_idx, minlength=n_fine)
    upper = np.cumsum(counts)
    lower = upper - counts
    ranks = np.cumsum([len(c) for c in np.array_split(np.arange(conf.size), n_bins)])[:-1]
    straddle = ((lower[:, None] < ranks) & (ranks < upper[:, None])).any(1)
    bound = 2.0 * counts[straddle].sum() / conf.size
    assert abs(got - want) <= bound + 1e-12
    assert abs(got - want) < 2e-3
    # finer histograms converge to the offline value
    fine_enough = _stream(lp, y, [3000], n_bins=n_bins, n_fine_bins=10**6).compute()["aece"]
    assert fine_enough == pytest.approx(want, abs=1e-6)


def test_merge_and_all_reduce_simulation_equal_whole():
    lp, y = _random_case(n=500)
    whole = _stream(lp, y, [500]).compute()
    first, second = _stream(lp[:180], y[:180], [180]), _stream(lp[180:], y[180:], [100, 220])
    merged = M.StreamingMetrics(lp.shape[1]).merge(first).merge(second).compute()
    # all_reduce(SUM) of state_tensors over "ranks", loaded into a fresh object
    states = [a + b for a, b in zip(first.state_tensors(), second.state_tensors(), strict=True)]
    assert all(t.dtype == torch.float64 for t in states)
    reduced = M.StreamingMetrics(lp.shape[1])
    reduced.load_state_tensors(states)
    for got in (merged, reduced.compute()):
        for key in whole:
            assert got[key] == pytest.approx(whole[key], rel=1e-12, abs=1e-14), key
    # state_tensors returns copies
    states[0].zero_()
    assert reduced.compute()["n"] == 500


def test_reset_and_empty():
    lp, y = _random_case(n=20)
    s = _stream(lp, y, [20])
    s.reset()
    with pytest.raises(FlatbmaError, match="update"):
        s.compute()
    s.update(lp[:0], y[:0])  # an empty batch is a no-op
    with pytest.raises(FlatbmaError, match="update"):
        s.compute()


def test_entropy_auroc_equals_sklearn():
    c = 10
    lp_in, _ = _random_case(n=2000, c=c, seed=7)
    g = torch.Generator().manual_seed(8)
    lp_out = torch.log_softmax(torch.randn(1500, c, generator=g, dtype=torch.float64) * 0.8, -1)
    # exact entropy 0 and log C (ties across the two sets)
    extremes = torch.stack([torch.full((c,), -math.log(c)), torch.log(torch.eye(c)[0])]).double()
    lp_in, lp_out = torch.cat([lp_in, extremes]), torch.cat([lp_out, extremes])
    h_in, h_out = M.predictive_entropy(lp_in), M.predictive_entropy(lp_out)
    truth = np.r_[np.zeros(h_in.numel()), np.ones(h_out.numel())]
    exact = roc_auc_score(truth, torch.cat([h_in, h_out]).numpy())
    assert M.ood_auroc(h_in, h_out) == pytest.approx(exact, rel=0, abs=1e-14)


def test_one_hot_soft_targets_equal_their_labels_exactly():
    lp, y = _random_case()
    q = torch.nn.functional.one_hot(y, 7).float()
    for fn in (M.accuracy, M.nll, M.brier, M.ece, M.adaptive_ece):
        assert fn(lp, q) == fn(lp, y), fn.__name__
    hard, soft = M.StreamingMetrics(7), M.StreamingMetrics(7)
    for part in torch.arange(600).split(97):
        hard.update(lp[part], y[part])
        soft.update(lp[part], q[part])
    assert soft.compute() == hard.compute()


def test_soft_targets_against_numpy():
    """NLL ``−Σ_c q_c log p_c`` (a zero ``q_c`` counts 0 where ``p_c = 0``), Brier ``Σ_c (p_c − q_c)²``."""
    lp, y = _random_case()
    g = torch.Generator().manual_seed(1)
    q = torch.softmax(3.0 * torch.randn(600, 7, generator=g, dtype=torch.float64), -1)
    q[:5] = torch.nn.functional.one_hot(y[:5], 7).double()  # zeros where p may be tiny
    p, qq = np.exp(lp.numpy()), q.numpy()
    assert M.nll(lp, q) == pytest.approx(float(-(qq * np.log(p)).sum(1).mean()), rel=1e-12)
    assert M.brier(lp, q) == pytest.approx(float(((p - qq) ** 2).sum(1).mean()), rel=1e-12)
    labels = q.argmax(1)
    assert M.accuracy(lp, q) == M.accuracy(lp, labels)
    assert M.ece(lp, q) == pytest.approx(_np_ece(lp, labels, 15), abs=1e-12)
    zero = torch.log(torch.tensor([[0.0, 0.4, 0.6]], dtype=torch.float64))
    assert M.nll(zero, torch.tensor([[0.0, 0.5, 0.5]])) == pytest.approx(-0.5 * math.log(0.24))
    assert M.nll(zero, torch.tensor([[0.1, 0.4, 0.5]])) == math.inf
    streaming = M.StreamingMetrics(7)
    for part in torch.arange(600).split(64):
        streaming.update(lp[part], q[part])
    got = streaming.compute()
    assert got["nll"] == pytest.approx(M.nll(lp, q), rel=1e-12)
    assert got["brier"] == pytest.approx(M.brier(lp, q), rel=1e-12)


# --------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------
def _bad_inputs():
    lp, y = _random_case(n=8, c=3)
    return [
        ((lp, y[:5]), "shape"),  # label count mismatch
        ((lp, y[:, None]), "shape"),  # labels 2-D
        ((lp[0], y[:1]), "shape"),  # log_probs 1-D
        ((lp, torch.full((8,), 3)), r"\[0, 2\]"),  # label = C
        ((lp, torch.full((8,), -1)), r"\[0, 2\]"),  # negative label
        ((lp, y.double()), "integer"),
        ((lp, y.bool()), "integer"),
        ((lp.exp(), y), "not normalized"),  # probabilities
        ((lp * 3.0 + 1.0, y), "not normalized"),  # logits
        ((torch.full((8, 3), -math.inf, dtype=torch.float64), y), "not normalized"),
        ((torch.where(torch.arange(3) == 1, math.nan, lp), y), "NaN"),
        ((lp.numpy(), y), "torch.Tensor"),
        ((lp, y.numpy()), "torch.Tensor"),
        ((lp[:0], y[:0]), "empty"),
        ((torch.zeros(8, 3, dtype=torch.int64), y), "floating"),
        ((lp, torch.full((8, 4), 0.25)), "shape"),  # soft targets of another number of classes
        ((lp, torch.full((8, 3), 0.5)), "class probabilities"),  # rows that do not sum to 1
        ((lp, torch.tensor([[1.5, -0.5, 0.0]] * 8)), "class probabilities"),  # a negative probability
    ]


@pytest.mark.parametrize("fn", [M.accuracy, M.nll, M.brier, M.ece, M.adaptive_ece, M.reliability_diagram])
def test_bad_inputs_raise(fn):
    for args, match in _bad_inputs():
        with pytest.raises(FlatbmaError, match=match):
            fn(*args)


@pytest.mark.parametrize("fn", [M.ece, M.adaptive_ece, M.reliability_diagram])
@pytest.mark.parametrize("n_bins", [0, -3, 2.5, True])
def test_bad_n_bins(fn, n_bins):
    lp, y = _random_case(n=8, c=3)
    with pytest.raises(FlatbmaError, match="n_bins"):
        fn(lp, y, n_bins)


def test_streaming_bad_inputs():
    lp, y = _random_case(n=8, c=3)
    for kwargs in ({"num_classes": 0}, {"num_classes": 3, "n_bins": 0}, {"num_classes": 3, "n_fine_bins": 0}):
        with pytest.raises(FlatbmaError, match="≥ 1"):
            M.StreamingMetrics(**kwargs)
    s = M.StreamingMetrics(4)
    with pytest.raises(FlatbmaError, match="num_classes=4"):
        s.update(lp, y)
    s3 = M.StreamingMetrics(3)
    for args, match in _bad_inputs():
        if match == "empty":
            continue  # empty batches are allowed when streaming
        with pytest.raises(FlatbmaError, match=match):
            s3.update(*args)
    with pytest.raises(FlatbmaError, match="same arguments"):
        s3.merge(M.StreamingMetrics(3, n_bins=10))
    with pytest.raises(FlatbmaError, match="StreamingMetrics"):
        s3.merge(object())  # type: ignore[arg-type]
    with pytest.raises(FlatbmaError, match="expects 3 tensors"):
        s3.load_state_tensors(s3.state_tensors()[:2])
    with pytest.raises(FlatbmaError, match="shape"):
        s3.load_state_tensors(M.StreamingMetrics(3, n_bins=10).state_tensors())


def test_auroc_bad_inputs():
    good = torch.rand(5)
    for bad, match in [
        (torch.rand(0), "empty"),
        (torch.rand(3, 2), "1-D"),
        (torch.tensor([0.1, math.nan]), "NaN"),
        (np.zeros(3), "torch.Tensor"),
    ]:
        with pytest.raises(FlatbmaError, match=match):
            M.ood_auroc(bad, good)
        with pytest.raises(FlatbmaError, match=match):
            M.ood_auroc(good, bad)
