"""Summary statistics with intervals: what a number in a report or README carries.

* :func:`summarize` — mean, standard deviation, median and a two-sided ``level`` interval for the mean
  of a sample: Student's t interval ``x̄ ± t_{1−α/2, n−1} s/√n`` (for a few seeds), or the
  bootstrap percentile interval (for many heavy-tailed values, e.g. λ₁ of posterior samples;
  Efron & Tibshirani 1993, §13) via :func:`scipy.stats.bootstrap`, seeded, so the same values
  give the same interval.
* :func:`median_interval` — the seeded bootstrap percentile interval of the median (Efron & Tibshirani
  1993, §13), the summary of a heavy-tailed sample that one large value cannot move.
* :func:`paired_difference` — the mean of paired differences ``d_i = a_i − b_i`` (the same seed for
  both methods) with its t interval, and whether it excludes 0. A difference whose interval includes
  0 is "no significant difference" (:func:`verdict`).

With one value the interval is ``None`` (nothing is claimed), and so is the standard deviation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

import numpy as np
from scipy import stats as _scipy_stats

from flatbma.errors import FlatbmaError

__all__ = [
    "Difference",
    "Interval",
    "Method",
    "Summary",
    "median_interval",
    "paired_difference",
    "summarize",
    "verdict",
]


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

    Attributes:
        n: number of values.
        mean: their mean.
        std: sample standard deviation (``ddof = 1``); ``None`` when ``n = 1``.
        median: their median.
        interval: ``level`` interval of the mean; ``None`` when ``n = 1``.
        method: how the interval was built.
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
    level: float = 0.95,
    method: Method | str = Method.T,
    resamples: int = 2000,
    seed: int = 0,
) -> Summary:
    """Mean, std, median and a ``level`` interval of the mean of ``values``.

    Args:
        values: finite numbers (at least one).
        level: confidence level of the interval.
        method: ``"t"`` (Student's t) or ``"bootstrap"`` (percentile bootstrap of the mean with
            ``resamples`` resamples drawn by a generator seeded with ``seed``).
        resamples: bootstrap resamples.
        seed: bootstrap seed.
    """
    try:  # checks.parse_choice's wording; stats sits beside checks in the layers, so it cannot import it
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
    values: Sequence[float], *, level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> Interval | None:
    """The ``level`` percentile-bootstrap interval of the median of ``values``; ``None`` for one value.

    ``resamples`` resamples drawn by a generator seeded with ``seed`` (the same values give the same
    interval); values that are all equal give the point ``[x, x]``.
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
    """A paired difference ``mean(a − b)`` with its t interval.

    Attributes:
        n: number of pairs.
        mean: mean difference.
        interval: its ``level`` interval (``None`` with one pair).
        significant: whether the interval excludes 0 (``False`` with one pair).
    """

    n: int
    mean: float
    interval: Interval | None
    significant: bool

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values."""
        return asdict(self)


def paired_difference(a: Sequence[float], b: Sequence[float], *, level: float = 0.95) -> Difference:
    """``mean(a_i − b_i)`` over pairs (e.g. two methods on the same seeds) with Student's t interval."""
    _check_level(level)
    x, y = _values(a, "paired_difference"), _values(b, "paired_difference")
    if x.size != y.size:
        raise FlatbmaError(f"paired_difference: {x.size} values against {y.size}; pair them by seed")
    d = x - y
    interval = _t_interval(d, level) if d.size > 1 else None
    significant = interval is not None and not interval.contains(0.0)
    return Difference(n=int(d.size), mean=float(d.mean()), interval=interval, significant=significant)


def verdict(difference: Difference, lower_is_better: bool) -> str:
    """``"better"``, ``"worse"`` or ``"no significant difference"`` for ``a`` against ``b``."""
    if not difference.significant:
        return "no significant difference"
    return "better" if (difference.mean < 0) == lower_is_better else "worse"
