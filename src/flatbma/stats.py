"""Summary statistics with intervals: what a number in a report or README carries.

* :func:`summarize` — mean, std, median and a ``level`` interval of the mean: Student's t ``x̄ ± t_{1−α/2, n−1} s/√n``
  (a few seeds), or the seeded bootstrap percentile interval (many heavy-tailed values; Efron & Tibshirani 1993).
* :func:`median_interval` — the seeded bootstrap percentile interval of the median.
* :func:`paired_difference` — the mean of paired differences ``d_i = a_i − b_i`` with its t interval and
  the smallest difference the pairs could have detected (:func:`detectable_difference`). An interval including 0
  reads "no difference larger than δ₈₀ detected" (:func:`verdict`), never "no difference" (docs/methods.md §9).

With one value the interval, the standard deviation and the detectable difference are ``None``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

import numpy as np
from scipy import optimize as _scipy_optimize
from scipy import stats as _scipy_stats

from flatbma.errors import FlatbmaError

__all__ = [
    "LEVEL",
    "POWER",
    "Difference",
    "Interval",
    "Method",
    "Summary",
    "detectable_difference",
    "median_interval",
    "paired_difference",
    "paired_t_power",
    "summarize",
    "verdict",
]


LEVEL = 0.95
"""Confidence level of an interval (and ``1 − LEVEL``: the size of the test that reads it) unless told otherwise."""

POWER = 0.8
"""The power at which :func:`detectable_difference` states what a comparison could have detected."""


class Method(str, Enum):
    """How :func:`summarize` builds the interval of the mean (strings and members are both accepted)."""

    T = "t"
    BOOTSTRAP = "bootstrap"


@dataclass(frozen=True)
class Interval:
    """A two-sided interval ``[low, high]`` at confidence ``level``."""

    low: float
    high: float
    level: float

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies in the closed interval."""
        return self.low <= value <= self.high

    def overlaps(self, other: Interval) -> bool:
        """Whether the two intervals share a point."""
        return self.low <= other.high and other.low <= self.high


@dataclass(frozen=True)
class Summary:
    """Mean, spread and interval of ``n`` finite values.

    ``std`` (``ddof = 1``) and ``interval`` (of the mean, built by ``method``) are ``None`` when ``n = 1``.
    """

    n: int
    mean: float
    std: float | None
    median: float
    interval: Interval | None
    method: Method

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (the interval as ``low``/``high``/``level``)."""
        out = asdict(self)
        out["method"] = self.method.value
        return out


def _values(values: Sequence[float], what: str) -> np.ndarray:
    x = np.asarray([float(v) for v in values], dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise FlatbmaError(f"{what}: need at least one value")
    if not np.isfinite(x).all():
        raise FlatbmaError(f"{what}: values must be finite (leave unconverged or failed measurements out)")
    return x


def _check_level(level: float) -> None:
    if not 0 < level < 1:
        raise FlatbmaError(f"level must be in (0, 1), got {level!r}")


def _t_interval(x: np.ndarray, level: float) -> Interval:
    n = x.size
    half = float(_scipy_stats.t.ppf(0.5 + level / 2, n - 1)) * float(x.std(ddof=1)) / math.sqrt(n)
    mean = float(x.mean())
    return Interval(mean - half, mean + half, level)


def summarize(
    values: Sequence[float],
    *,
    level: float = LEVEL,
    method: Method | str = Method.T,
    resamples: int = 2000,
    seed: int = 0,
) -> Summary:
    """Mean, std, median and a ``level`` interval of the mean of ``values``.

    ``method``: ``"t"`` (Student's t) or ``"bootstrap"`` (percentile bootstrap of the mean, ``resamples``
    resamples seeded with ``seed``).
    """
    try:  # checks.parse_choice's wording (stats cannot import checks)
        method = Method(method)
    except ValueError:
        names = ", ".join(repr(m.value) for m in Method)
        raise FlatbmaError(f"summarize: method must be one of {names}, got {method!r}.") from None
    _check_level(level)
    x = _values(values, "summarize")
    n = x.size
    interval = None
    if n > 1:
        if method is Method.T or float(x.std()) == 0.0:
            interval = _t_interval(x, level)
        else:
            result = _scipy_stats.bootstrap(
                (x,),
                np.mean,
                confidence_level=level,
                n_resamples=resamples,
                method="percentile",
                rng=np.random.default_rng(seed),
            )
            ci = result.confidence_interval
            interval = Interval(float(ci.low), float(ci.high), level)
    return Summary(
        n=n,
        mean=float(x.mean()),
        std=float(x.std(ddof=1)) if n > 1 else None,
        median=float(np.median(x)),
        interval=interval,
        method=method,
    )


def median_interval(
    values: Sequence[float], *, level: float = LEVEL, resamples: int = 2000, seed: int = 0
) -> Interval | None:
    """The ``level`` percentile-bootstrap interval of the median of ``values``; ``None`` for one value.

    ``resamples`` resamples seeded with ``seed``; values that are all equal give the point ``[x, x]``.
    """
    _check_level(level)
    x = _values(values, "median_interval")
    if x.size < 2:
        return None
    if float(x.std()) == 0.0:
        return Interval(float(x[0]), float(x[0]), level)
    result = _scipy_stats.bootstrap(
        (x,),
        np.median,
        confidence_level=level,
        n_resamples=resamples,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    ci = result.confidence_interval
    return Interval(float(ci.low), float(ci.high), level)


@dataclass(frozen=True)
class Difference:
    """A paired difference ``mean(a − b)`` with its t interval and the smallest difference it could detect.

    ``significant``: whether the interval excludes 0; ``detectable``: :func:`detectable_difference` of these
    pairs. With one pair ``interval`` and ``detectable`` are ``None`` and ``significant`` is ``False``.
    """

    n: int
    mean: float
    interval: Interval | None
    significant: bool
    detectable: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values."""
        return asdict(self)


def paired_difference(
    a: Sequence[float], b: Sequence[float], *, level: float = LEVEL, power: float = POWER
) -> Difference:
    """``mean(a_i − b_i)`` over pairs (e.g. two methods on the same seeds) with Student's t interval."""
    _check_level(level)
    x, y = _values(a, "paired_difference"), _values(b, "paired_difference")
    if x.size != y.size:
        raise FlatbmaError(f"paired_difference: {x.size} values against {y.size}; pair them by seed")
    d = x - y
    interval = _t_interval(d, level) if d.size > 1 else None
    significant = interval is not None and not interval.contains(0.0)
    std = float(d.std(ddof=1)) if d.size > 1 else 0.0
    detectable = detectable_difference(std, int(d.size), level=level, power=power)
    return Difference(
        n=int(d.size), mean=float(d.mean()), interval=interval, significant=significant, detectable=detectable
    )


def _check_power(power: float, level: float) -> None:
    if not 1 - level < power < 1:
        raise FlatbmaError(
            f"power must be in ({1 - level:g}, 1): above the test's size 1 − level, which it has at no difference; "
            f"got {power!r}"
        )


def _positive_count(n: int) -> int:
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise FlatbmaError(f"the number of pairs must be a positive integer, got {n!r}")
    return int(n)


def paired_t_power(delta: float, std: float, n: int, *, level: float = LEVEL) -> float:
    """The power of the two-sided paired t test at size ``α = 1 − level`` against a true mean difference ``delta``.

    With normal differences of standard deviation ``std``, ``T = d̄ √n / s`` is noncentral t ``T′`` with
    ``ν = n − 1`` and ``λ = delta √n / std`` (Johnson, Kotz & Balakrishnan 1995, ch. 31); the power is

        P(|T′| > t_{1−α/2, ν}) = P(T′_λ > t_{1−α/2, ν}) + P(T′_{−λ} > t_{1−α/2, ν})

    (``α`` at ``delta = 0``).

    Raises:
        FlatbmaError: on ``n < 2`` (no test), a negative or non-finite ``std``, a non-finite ``delta``.
    """
    _check_level(level)
    n = _positive_count(n)
    if n < 2:
        raise FlatbmaError("paired_t_power: one pair has no t test (no spread); need at least two")
    if not (math.isfinite(std) and std >= 0) or not math.isfinite(delta):
        raise FlatbmaError(f"paired_t_power: need a finite delta and a finite std ≥ 0, got {delta!r} and {std!r}")
    if std == 0:
        return 1.0 if delta != 0 else 1 - level
    return _power(abs(delta) * math.sqrt(n) / std, n - 1, level)


def _power(nc: float, df: int, level: float) -> float:
    """``P(|T′| > t_{(1+level)/2, df})``, ``T′`` noncentral t with ``df`` degrees of freedom, noncentrality ``nc``."""
    critical = float(_scipy_stats.t.ppf(0.5 + level / 2, df))
    return float(_scipy_stats.nct.sf(critical, df, nc) + _scipy_stats.nct.sf(critical, df, -nc))


def detectable_difference(std: float, n: int, *, level: float = LEVEL, power: float = POWER) -> float | None:
    """The smallest mean difference that ``n`` pairs with spread ``std`` detect with probability ``power``.

    For the two-sided paired t test at size ``α = 1 − level`` (the one the ``level`` interval reads), ``ν = n − 1``:

        δ_power = min{δ > 0 : P(|T′| > t_{1−α/2, ν}) ≥ power},   T′ ~ noncentral t(ν, δ √n / s)

    solved for the noncentrality ``λ*`` by Brent's method, then ``δ = λ* s / √n`` (not the usual approximation,
    14% low at ``n = 2``: docs/methods.md §9). ``std``: the paired differences' ``s`` (``ddof = 1``); ``power`` in
    ``(1 − level, 1)``.

    Returns:
        ``δ`` in the differences' units; ``0.0`` for ``std = 0``; ``None`` for one pair (no test).

    Raises:
        FlatbmaError: on a negative or non-finite ``std``, ``n < 1``, or ``level``/``power`` out of range.
    """
    _check_level(level)
    _check_power(power, level)
    n = _positive_count(n)
    if not (math.isfinite(std) and std >= 0):
        raise FlatbmaError(f"detectable_difference: std must be a finite number ≥ 0, got {std!r}")
    if n < 2:
        return None
    if std == 0:
        return 0.0
    return _noncentrality(n - 1, level, power) * float(std) / math.sqrt(n)


@functools.lru_cache(maxsize=256)
def _noncentrality(df: int, level: float, power: float) -> float:
    """``λ*`` with ``P(|T′_λ*| > t_{(1+level)/2, df}) = power`` (:func:`_power` rises with ``λ`` from ``1 − level``)."""
    high = float(_scipy_stats.t.ppf(0.5 + level / 2, df) + _scipy_stats.t.ppf(power, df))  # the approximation's λ
    while _power(high, df, level) < power:
        high *= 2
    return float(_scipy_optimize.brentq(lambda nc: _power(nc, df, level) - power, 0.0, high, xtol=1e-13, rtol=1e-15))


def verdict(difference: Difference, lower_is_better: bool) -> str:
    """``"better"``, ``"worse"`` or ``"no difference larger than δ detected"`` for ``a`` against ``b``.

    ``δ`` is :attr:`Difference.detectable` to 3 significant digits; one pair gives "no comparison claimed (one pair)".
    """
    if not difference.significant:
        if difference.detectable is None:
            return "no comparison claimed (one pair)"
        return f"no difference larger than {difference.detectable:.3g} detected"
    return "better" if (difference.mean < 0) == lower_is_better else "worse"
