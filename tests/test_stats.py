"""flatbma.stats against scipy and hand computations."""

import math
import statistics

import numpy as np
import pytest
from scipy import stats as scipy_stats

from flatbma.errors import FlatbmaError
from flatbma.stats import Interval, Method, median_interval, paired_difference, summarize, verdict

VALUES = [0.71, 0.74, 0.69, 0.77, 0.72]


def test_t_summary_matches_a_hand_t_interval():
    s = summarize(VALUES)
    n = len(VALUES)
    mean, sd = statistics.mean(VALUES), statistics.stdev(VALUES)
    half = 2.7764451051977987 * sd / math.sqrt(n)  # t_{0.975, 4} from tables
    assert (s.n, s.method) == (n, Method.T)
    assert s.mean == pytest.approx(mean, abs=1e-15)
    assert s.std == pytest.approx(sd, abs=1e-15)
    assert s.median == statistics.median(VALUES)
    assert (s.interval.low, s.interval.high) == pytest.approx((mean - half, mean + half), abs=1e-12)
    assert s.interval.level == 0.95
    lo, hi = scipy_stats.t.interval(0.9, n - 1, loc=mean, scale=sd / math.sqrt(n))
    other = summarize(VALUES, level=0.9)
    assert (other.interval.low, other.interval.high) == pytest.approx((lo, hi), abs=1e-12)


def test_one_value_has_no_spread_and_no_interval():
    s = summarize([3.5])
    assert (s.n, s.mean, s.median, s.std, s.interval) == (1, 3.5, 3.5, None, None)
    assert s.to_dict() == {"n": 1, "mean": 3.5, "std": None, "median": 3.5, "interval": None, "method": "t"}


def test_bootstrap_interval_is_scipys_percentile_bootstrap_and_is_seeded():
    x = np.random.default_rng(3).lognormal(size=12)  # heavy-tailed, like λ₁ of posterior samples
    s = summarize(x, method="bootstrap", resamples=999, seed=5)
    ref = scipy_stats.bootstrap(
        (x,), np.mean, confidence_level=0.95, n_resamples=999, method="percentile", rng=np.random.default_rng(5)
    ).confidence_interval
    assert (s.interval.low, s.interval.high) == pytest.approx((ref.low, ref.high), abs=1e-12)
    assert summarize(x, method=Method.BOOTSTRAP, resamples=999, seed=5) == s
    assert s.interval.low < x.mean() < s.interval.high
    assert s.to_dict()["interval"] == {"low": s.interval.low, "high": s.interval.high, "level": 0.95}
    # equal values: no resampling spread, the degenerate interval at the value
    flat = summarize([2.0, 2.0, 2.0], method="bootstrap")
    assert (flat.interval.low, flat.interval.high) == (2.0, 2.0)


def test_paired_difference_matches_scipy_ttest_rel():
    a = [0.80, 0.84, 0.78, 0.83]
    b = [0.79, 0.80, 0.77, 0.80]
    d = paired_difference(a, b)
    ci = scipy_stats.ttest_rel(a, b).confidence_interval(0.95)
    assert d.n == 4
    assert d.mean == pytest.approx(statistics.mean(x - y for x, y in zip(a, b)), abs=1e-15)
    assert (d.interval.low, d.interval.high) == pytest.approx((ci.low, ci.high), abs=1e-12)
    assert d.significant == (not ci.low <= 0 <= ci.high)
    ci90 = scipy_stats.ttest_rel(a, b).confidence_interval(0.9)
    d90 = paired_difference(a, b, level=0.9)
    assert (d90.interval.low, d90.interval.high) == pytest.approx((ci90.low, ci90.high), abs=1e-12)


def test_significance_and_verdict():
    better = paired_difference([1.0, 1.1, 0.9], [2.0, 2.05, 2.0])  # a clearly lower
    assert better.significant and better.interval.high < 0
    assert verdict(better, lower_is_better=True) == "better"
    assert verdict(better, lower_is_better=False) == "worse"
    noisy = paired_difference([1.0, 3.0, 0.5], [1.5, 1.0, 1.2])
    assert noisy.interval.contains(0.0) and not noisy.significant
    assert verdict(noisy, lower_is_better=True) == "no significant difference"
    one = paired_difference([1.0], [5.0])
    assert (one.n, one.mean, one.interval, one.significant) == (1, -4.0, None, False)
    assert verdict(one, lower_is_better=True) == "no significant difference"
    same = paired_difference([1.0, 2.0], [1.0, 2.0])  # identical runs: interval [0, 0], not significant
    assert (same.interval.low, same.interval.high, same.significant) == (0.0, 0.0, False)


def test_interval_helpers():
    i = Interval(-1.0, 2.0, 0.95)
    assert i.contains(0.0) and i.contains(2.0) and not i.contains(2.5)
    assert i.overlaps(Interval(2.0, 3.0, 0.95)) and not i.overlaps(Interval(2.5, 3.0, 0.95))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: summarize([]), "at least one value"),
        (lambda: summarize([1.0, float("nan")]), "finite"),
        (lambda: summarize([1.0, 2.0], level=1.0), "level"),
        (lambda: summarize([1.0, 2.0], method="normal"), "'t', 'bootstrap'"),
        (lambda: paired_difference([1.0, 2.0], [1.0]), "pair them by seed"),
        (lambda: paired_difference([1.0, math.inf], [1.0, 2.0]), "finite"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(FlatbmaError, match=match):
        call()


def test_median_interval_covers_the_median_of_a_heavy_tailed_law_where_the_mean_has_none():
    """The percentile bootstrap of the median, checked against the truth: a Cauchy law has median 0 (and no mean).

    Over 200 samples of 15 values its 95% interval holds 0 close to 95% of the time (the percentile bootstrap
    of a median of 15 undercovers a little: 90.5% with these draws; the bound allows 85%), and one huge value
    barely moves it.
    """
    rng = np.random.default_rng(1)
    covered = 0
    for i in range(200):
        x = rng.standard_cauchy(15)
        interval = median_interval(x, resamples=500, seed=i)
        covered += interval.contains(0.0)
        assert interval.low <= float(np.median(x)) <= interval.high
    assert 0.85 <= covered / 200 <= 0.995
    values = [1650.0, 1790.0, 1880.0, 1926.0, 1926.0, 2010.0, 2240.0]
    calm, heavy = median_interval(values), median_interval([*values, 278_000.0])
    assert heavy.high < 3000 and heavy.low >= calm.low  # one sharp sample: the mean's interval would reach 10⁵
    assert median_interval(values, seed=3) == median_interval(values, seed=3)  # seeded
    assert median_interval([2.0]) is None and median_interval([2.0, 2.0]) == Interval(2.0, 2.0, 0.95)
