"""flatbma.stats against scipy and hand computations."""

import math
import statistics

import numpy as np
import pytest
from scipy import integrate as scipy_integrate
from scipy import stats as scipy_stats

from flatbma.errors import FlatbmaError
from flatbma.stats import (
    LEVEL,
    POWER,
    Interval,
    Method,
    detectable_difference,
    median_interval,
    paired_difference,
    paired_t_power,
    summarize,
    verdict,
)
from tests.helpers import DETECTABLE_PER_S

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
    # d = (−0.5, 2.0, −0.7): s = 1.5044; with 3 pairs δ₈₀ = 3.264044 s = 4.91 (tests/helpers.py)
    assert noisy.detectable == pytest.approx(DETECTABLE_PER_S[3] * statistics.stdev([-0.5, 2.0, -0.7]), rel=1e-10)
    assert verdict(noisy, lower_is_better=True) == "no difference larger than 4.91 detected"
    one = paired_difference([1.0], [5.0])
    assert (one.n, one.mean, one.interval, one.significant, one.detectable) == (1, -4.0, None, False, None)
    assert verdict(one, lower_is_better=True) == "no comparison claimed (one pair)"
    same = paired_difference([1.0, 2.0], [1.0, 2.0])  # identical runs: interval [0, 0], not significant
    assert (same.interval.low, same.interval.high, same.significant, same.detectable) == (0.0, 0.0, False, 0.0)
    assert paired_difference([1.0, 2.0], [1.5, 2.0]).to_dict()["detectable"] == pytest.approx(
        DETECTABLE_PER_S[2] * statistics.stdev([-0.5, 0.0]), rel=1e-10
    )


def _power_by_definition(lam: float, n: int, alpha: float = 0.05) -> float:
    """The paired t test's power from the definition of the noncentral t, without scipy's ``nct``.

    ``T′ = (Z + λ)/√(V/ν)``, ``Z ~ N(0, 1)``, ``V ~ χ²_ν``, ``ν = n − 1``: conditioning on ``V = v``,
    ``P(|T′| > c) = ∫ [Φ(λ − c√(v/ν)) + Φ(−λ − c√(v/ν))] χ²_ν(v) dv`` with ``c = t_{1−α/2, ν}``.
    """
    nu = n - 1
    c = scipy_stats.t.ppf(1 - alpha / 2, nu)

    def given(v: float) -> float:
        shift = c * math.sqrt(v / nu)
        return (scipy_stats.norm.cdf(lam - shift) + scipy_stats.norm.cdf(-lam - shift)) * scipy_stats.chi2.pdf(v, nu)

    return scipy_integrate.quad(given, 0, math.inf, epsabs=1e-13, epsrel=1e-12, limit=200)[0]


HAND = DETECTABLE_PER_S  # by the integral of _power_by_definition, solved for 0.8 (tests/helpers.py)


@pytest.mark.parametrize("n", sorted(HAND))
def test_detectable_difference_against_hand_values(n):
    assert detectable_difference(1.0, n) == pytest.approx(HAND[n], rel=1e-10)
    assert detectable_difference(0.03, n) == pytest.approx(0.03 * HAND[n], rel=1e-10)  # in the metric's units
    assert _power_by_definition(HAND[n] * math.sqrt(n), n) == pytest.approx(0.8, abs=1e-9)
    assert paired_t_power(HAND[n], 1.0, n) == pytest.approx(0.8, abs=1e-9)


def test_power_against_g_power():
    """G*Power 3, one-sample t, two tails, d = 1/3, N = 25, α = 0.05: power 0.360 (tutorial "G*Power: t Tests")."""
    assert paired_t_power(5.0, 15.0, 25) == pytest.approx(0.360, abs=5e-4)
    assert paired_t_power(0.0, 1.0, 7) == pytest.approx(0.05, abs=1e-12)  # the test's size at no difference


def test_detectable_difference_has_its_power_by_simulation():
    """Monte Carlo: 40 000 studies of 5 pairs, d_i ~ N(δ₈₀, 1): the t test rejects in 80% of them (SE 0.002)."""
    n, trials = 5, 40_000
    delta = detectable_difference(1.0, n)
    d = np.random.default_rng(0).normal(delta, 1.0, size=(trials, n))
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(n))
    rejected = float(np.mean(np.abs(t) > scipy_stats.t.ppf(0.975, n - 1)))
    assert rejected == pytest.approx(0.8, abs=0.01)
    smaller = np.random.default_rng(1).normal(0.8 * delta, 1.0, size=(trials, n))  # a smaller δ: less power
    t = smaller.mean(axis=1) / (smaller.std(axis=1, ddof=1) / math.sqrt(n))
    assert float(np.mean(np.abs(t) > scipy_stats.t.ppf(0.975, n - 1))) < 0.75


def test_the_usual_approximation_holds_for_many_pairs():
    """``(t_{0.975, n−1} + t_{0.8, n−1}) s/√n`` within 0.03% of the exact value from n = 30 on; 14% low at n = 2."""
    for n in (30, 50, 100, 300, 1000):
        approx = (scipy_stats.t.ppf(0.975, n - 1) + scipy_stats.t.ppf(0.8, n - 1)) / math.sqrt(n)
        assert approx == pytest.approx(detectable_difference(1.0, n), rel=3e-4)
    approx = (scipy_stats.t.ppf(0.975, 1) + scipy_stats.t.ppf(0.8, 1)) / math.sqrt(2)
    assert approx / detectable_difference(1.0, 2) == pytest.approx(0.862, abs=1e-3)


def test_detectable_difference_level_power_and_edges():
    assert (LEVEL, POWER) == (0.95, 0.8)
    assert detectable_difference(1.0, 1) is None  # one pair: no test, nothing claimed
    assert detectable_difference(0.0, 6) == 0.0  # no spread: every difference is detected
    assert detectable_difference(1.0, 10, level=0.9) < detectable_difference(1.0, 10)  # a larger test size
    assert detectable_difference(1.0, 10, power=0.9) > detectable_difference(1.0, 10)
    d = paired_difference([0.1, 0.4, 0.3, 0.2], [0.2, 0.2, 0.2, 0.3], level=0.9, power=0.9)
    assert d.detectable == detectable_difference(statistics.stdev([-0.1, 0.2, 0.1, -0.1]), 4, level=0.9, power=0.9)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: detectable_difference(math.nan, 5), "finite"),
        (lambda: detectable_difference(math.inf, 5), "finite"),
        (lambda: detectable_difference(-1.0, 5), "finite number ≥ 0"),
        (lambda: detectable_difference(1.0, 0), "positive integer"),
        (lambda: detectable_difference(1.0, 2.5), "positive integer"),
        (lambda: detectable_difference(1.0, 5, power=0.05), "power must be in"),
        (lambda: detectable_difference(1.0, 5, power=1.0), "power must be in"),
        (lambda: detectable_difference(1.0, 5, level=1.5), "level"),
        (lambda: paired_t_power(1.0, 1.0, 1), "one pair"),
        (lambda: paired_t_power(math.nan, 1.0, 3), "finite"),
    ],
)
def test_detectable_difference_bad_input(call, match):
    with pytest.raises(FlatbmaError, match=match):
        call()


def test_detectable_difference_agrees_with_statsmodels():
    """An independent implementation, where installed (not a dependency: the hand values above stand alone)."""
    power = pytest.importorskip("statsmodels.stats.power")
    for n in (3, 5, 10, 40):
        effect = power.TTestPower().solve_power(nobs=n, alpha=0.05, power=0.8, alternative="two-sided")
        assert detectable_difference(1.0, n) == pytest.approx(effect, rel=1e-5)


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
