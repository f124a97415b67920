"""Paired comparisons of the methods of a comparison, and the findings generated from them.

Every other method against the reference (``compare.reference``, default the first method), and each listed pair
``a − b`` of ``compare.pairs``, on every metric of :data:`~flatbma.experiment.report.rows.COMPARED`: the paired
differences ``d_s = x_s − x_s(reference)`` over the seeds both ran, their mean, 95% t interval (clipped to
``±(high − low)`` for a metric bounded to ``[low, high]``) and detectable difference
(:func:`flatbma.stats.detectable_difference`). A finding (:func:`findings`) says "better"/"worse" (or "flatter",
"narrower", "covers more", …) when the interval excludes 0, else "no difference larger than δ detected"; with one
seed nothing is claimed. λ₁ is compared only where both runs report their width, and its line is followed by the
width's (the rules and their reasons: docs/methods.md §9).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flatbma.errors import FlatbmaError, suggest
from flatbma.experiment.config.parse import shown
from flatbma.experiment.report.rows import (
    COMPARED,
    LAMBDA1,
    LEVEL,
    MISSING,
    TRACE_COV,
    Metric,
    Run,
    by_method,
    clipped,
    decimals_for,
    diverged_lines,
    failed_runs,
    format_number,
    get_path,
    read_runs,
    seed_counts,
)
from flatbma.health import flagged_line, is_flagged
from flatbma.stats import POWER, Difference, paired_difference

__all__ = [
    "Comparison",
    "check_pairs",
    "comparisons",
    "detectable_text",
    "difference_text",
    "findings",
    "pair_comparisons",
    "pairs_of",
    "reference_of",
]


# --------------------------------------------------------------------------------------------------
# writing a difference


def _signed(x: float, decimals: int | None) -> str:
    """``x`` with an explicit sign (``+``, or the minus sign ``−``); no sign when it rounds to 0."""
    text = format_number(abs(x), decimals)
    if math.isfinite(x) and float(text) == 0.0:
        return text
    return ("−" if x < 0 else "+") + text


def _minus(text: str) -> str:
    """A leading ``-`` as the minus sign ``−``."""
    return "−" + text[1:] if text.startswith("-") else text


def _difference_decimals(d: Difference) -> int | None:
    """Decimals that show an interval's half-width with 2 significant digits (mean alone: 4 digits)."""
    if d.interval is None or d.interval.high == d.interval.low or not math.isfinite(d.interval.high - d.interval.low):
        return decimals_for(d.mean)
    half = (d.interval.high - d.interval.low) / 2
    if half < 1e-6 or max(abs(d.interval.low), abs(d.interval.high)) >= 1e6:
        return None
    return min(8, max(0, 1 - math.floor(math.log10(half))))


def difference_text(d: Difference) -> str:
    """``+0.031 [0.012, 0.050]`` (``−`` for negative numbers); the mean alone with one pair."""
    decimals = _difference_decimals(d)
    mean = _signed(d.mean, decimals)
    if d.interval is None:
        return mean
    low, high = (_minus(format_number(v, decimals)) for v in (d.interval.low, d.interval.high))
    return f"{mean} [{low}, {high}]"


def detectable_text(d: Difference) -> str:
    """The detectable difference with the decimals of :func:`difference_text`'s; ``–`` with one pair."""
    if d.detectable is None:
        return MISSING
    return format_number(d.detectable, _difference_decimals(d))


def _null_verdict(d: Difference) -> str:
    """What a difference whose interval includes 0 says: ``no difference larger than δ detected``."""
    return f"no difference larger than {detectable_text(d)} detected"


# --------------------------------------------------------------------------------------------------
# paired differences and findings


@dataclass(frozen=True)
class Comparison:
    """One method against the reference (or ``a`` against ``b`` of a listed pair) on one metric, over common seeds.

    Attributes:
        method: the method's label (``a`` of a pair).
        reference: the label it is compared with: the reference, or ``b`` of a pair.
        metric: what is compared.
        seeds: the seeds of the pairs (both runs have the value; for λ₁ both also have their width).
        difference: ``mean(x_s − x_s(reference))`` with its t interval and detectable difference (``None``
            without pairs).
        verdict: "better", "worse", "flatter", …, "no difference larger than δ detected", or why none is claimed.
    """

    method: str
    reference: str
    metric: Metric
    seeds: tuple[Any, ...]
    difference: Difference | None
    verdict: str

    @property
    def claimed(self) -> bool:
        """Whether the comparison has the two or more pairs a verdict needs."""
        return self.difference is not None and self.difference.n >= 2

    @property
    def text(self) -> str:
        """The finding as one line, written from the numbers."""
        head = f"{self.method} vs {self.reference}: {self.metric.label}"
        d = self.difference
        if d is None:
            return f"{head}: {self.verdict}"
        if d.n < 2:
            return f"{head} {difference_text(d)} (one seed): {self.verdict}"
        return f"{head} {difference_text(d)} over {d.n} seeds ({self.metric.reading}): {self.verdict}"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values: the numbers, the verdict and :attr:`text`."""
        d = self.difference
        interval = d.interval if d is not None else None
        return {
            "method": self.method,
            "reference": self.reference,
            "metric": self.metric.key,
            "label": self.metric.label,
            "seeds": list(self.seeds),
            "n": d.n if d is not None else 0,
            "mean": d.mean if d is not None else None,
            "interval": (
                {"low": interval.low, "high": interval.high, "level": interval.level} if interval is not None else None
            ),
            "significant": bool(d is not None and d.significant),
            "detectable": d.detectable if d is not None else None,
            "reading": self.metric.reading,
            "verdict": self.verdict,
            "text": self.text,
        }


NOT_CLAIMED_ONE_SEED = "no comparison claimed (one seed)"
DETECTABLE = (
    "the smallest true mean difference that the two-sided paired t test at size 1 − level detects with the "
    "given power over the seeds compared, from the paired differences' standard deviation s and number n: "
    "δ = λ* s/√n, with λ* solving P(|T′| > t_{1−α/2, n−1}) = power for T′ noncentral t(n − 1, λ*)"
)
"""How ``findings["detectable_difference"]`` defines each comparison's ``detectable``."""
NO_WIDTH = "not compared: the posterior width tr Σ is not measured beside it"


def reference_of(results: Mapping[str, Any], groups: Mapping[str, Sequence[Run]]) -> str:
    """``compare.reference`` of ``results``, default the first method of ``groups`` (:func:`by_method`).

    Raises:
        FlatbmaError: if no run of ``results`` has that label.
    """
    reference = get_path(results, "compare", "reference")
    if reference is None or _only_diverged(results, groups, reference):  # no numbers to compare against
        return next(iter(groups))
    if reference not in groups:
        raise FlatbmaError(
            f"compare.reference {reference!r} is not one of the compared methods ({', '.join(groups)}): "
            "set it to one of them, or remove it to compare against the first"
        )
    return str(reference)


def check_pairs(pairs: Any, labels: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``compare.pairs`` checked: each ``[a, b]`` two distinct labels of ``labels`` (the compared methods).

    Returns:
        The pairs as ``(a, b)`` tuples; ``()`` for ``None``.

    Raises:
        FlatbmaError: naming the first pair that is not two compared labels, pairs a method with itself or repeats one.
    """
    if pairs is None:
        return ()
    if not isinstance(pairs, Sequence) or isinstance(pairs, str):
        raise FlatbmaError(f"compare.pairs must be a list of [a, b] pairs of compared methods, got {shown(pairs)}")
    out = []
    for i, pair in enumerate(pairs):
        if not (
            isinstance(pair, Sequence)
            and not isinstance(pair, str)
            and len(pair) == 2
            and all(isinstance(label, str) for label in pair)
        ):
            raise FlatbmaError(
                f"compare.pairs[{i}] must be two method labels [a, b] (reported as a − b), got {shown(pair)}"
            )
        for label in pair:
            if label not in labels:
                raise FlatbmaError(
                    f"compare.pairs[{i}] names {shown(label)}, which is not a compared method ({', '.join(labels)})."
                    f"{suggest(label, labels)}"
                )
        if pair[0] == pair[1]:
            raise FlatbmaError(f"compare.pairs[{i}] compares {shown(pair[0])} with itself: name two different methods")
        if (pair[0], pair[1]) in out:
            raise FlatbmaError(f"compare.pairs[{i}] repeats an earlier pair {list(pair)}: list each pair once")
        out.append((str(pair[0]), str(pair[1])))
    return tuple(out)


def pairs_of(results: Mapping[str, Any], groups: Mapping[str, Sequence[Run]]) -> tuple[tuple[str, str], ...]:
    """``compare.pairs`` of ``results`` (:func:`check_pairs` against the methods of ``groups``); ``()`` without.

    A pair naming a method whose every seed diverged (no numbers) is left out.
    """
    pairs = get_path(results, "compare", "pairs")
    if isinstance(pairs, Sequence) and not isinstance(pairs, str):
        pairs = [p for p in pairs if not (isinstance(p, list) and any(_only_diverged(results, groups, m) for m in p))]
    return check_pairs(pairs, list(groups))


def _only_diverged(results: Mapping[str, Any], groups: Mapping[str, Sequence[Run]], method: Any) -> bool:
    """Whether ``method`` has rows in ``results`` and every one of them diverged (it is in no group)."""
    return isinstance(method, str) and method not in groups and any(r["method"] == method for r in failed_runs(results))


def _by_seed(runs: Sequence[Run], metric: Metric) -> dict[Any, float]:
    """``{seed: value}`` of the runs that have both (finite values only)."""
    out = {}
    for run in runs:
        value, seed = metric.get(run), run.get("seed")
        if seed is not None and value is not None and math.isfinite(value):
            out[seed] = value
    return out


def _compare(method: str, runs: Sequence[Run], reference: str, ref_runs: Sequence[Run], metric: Metric) -> Comparison:
    mine, theirs = _by_seed(runs, metric), _by_seed(ref_runs, metric)
    seeds = [s for s in theirs if s in mine]
    if metric is LAMBDA1:  # a flatness comparison is made only with the width beside it
        width_mine, width_theirs = _by_seed(runs, TRACE_COV), _by_seed(ref_runs, TRACE_COV)
        with_width = [s for s in seeds if s in width_mine and s in width_theirs]
        if seeds and not with_width:
            return Comparison(method, reference, metric, tuple(seeds), None, NO_WIDTH)
        seeds = with_width
    if not seeds:
        return Comparison(method, reference, metric, (), None, "not compared: no seed in common")
    d = paired_difference([mine[s] for s in seeds], [theirs[s] for s in seeds], level=LEVEL)
    low, high = metric.bounds
    if low is not None and high is not None:  # a difference of two values in [low, high] lies in ±(high − low)
        d = dataclasses.replace(d, interval=clipped(d.interval, (low - high, high - low)))
    if d.n < 2:
        verdict = NOT_CLAIMED_ONE_SEED
    elif not d.significant:
        verdict = _null_verdict(d)
    else:
        verdict = metric.lower if d.mean < 0 else metric.higher
    return Comparison(method, reference, metric, tuple(seeds), d, verdict)


def _on_every_metric(method: str, other: str, groups: Mapping[str, Sequence[Run]]) -> list[Comparison]:
    """``method`` − ``other`` on every metric of :data:`~flatbma.experiment.report.rows.COMPARED` both measured."""
    out = []
    for metric in COMPARED:
        if all(any(metric.get(r) is not None for r in groups[m]) for m in (method, other)):
            out.append(_compare(method, groups[method], other, groups[other], metric))
    return out


def comparisons(results: Mapping[str, Any]) -> list[Comparison]:
    """Every method against the reference on every metric of :data:`~flatbma.experiment.report.rows.COMPARED`.

    Raises:
        FlatbmaError: if ``results`` has no runs or its ``compare.reference`` is not among its methods.
    """
    groups = by_method(read_runs(results))
    reference = reference_of(results, groups)
    return [c for method in groups if method != reference for c in _on_every_metric(method, reference, groups)]


def pair_comparisons(results: Mapping[str, Any]) -> list[Comparison]:
    """Every pair ``(a, b)`` of ``compare.pairs`` as ``a − b`` (``reference``: b), metric by metric as the reference's.

    Raises:
        FlatbmaError: if ``results`` has no runs or a pair is not two distinct compared methods.
    """
    groups = by_method(read_runs(results))
    return [c for a, b in pairs_of(results, groups) for c in _on_every_metric(a, b, groups)]


def _lines(method: str, other: str, found: Sequence[Comparison]) -> list[str]:
    """The findings of ``method`` − ``other``: one line per metric, or one saying that nothing is claimed."""
    if not found:
        return []
    if not any(c.claimed for c in found):
        return [f"{method} vs {other}: fewer than two seeds in common: no comparison claimed"]
    return [c.text for c in found]


def findings(results: Mapping[str, Any]) -> dict[str, Any]:
    """The findings of a comparison, generated from the paired differences (JSON-ready).

    Returns:
        ``{"reference", "level", "power", "test", "detectable_difference", "claimed", "comparisons":
        [Comparison.to_dict()], "text": [lines]}``, with ``compare.pairs`` also ``"pairs"`` (each ``a − b``,
        ``reference`` = b), and when non-empty ``"diverged"`` and ``"health"``. ``text`` has one line per method with
        diverged seeds, then one per row flagged by :mod:`flatbma.health`, then one per comparison (the
        reference's, then the pairs'; a pair whose ``b`` is the reference adds none). A method sharing fewer than
        two seeds with its counterpart gets a line claiming nothing; with one seed overall, or one method, the
        comparisons are a single such line.
    """
    groups = by_method(read_runs(results))
    reference = reference_of(results, groups)
    pairs = pairs_of(results, groups)
    found = comparisons(results)
    paired = pair_comparisons(results)
    claimed = any(c.claimed for c in (*found, *paired))
    if len(groups) == 1:
        text = [f"One method ({reference}): there is nothing to compare."]
    elif seed_counts(groups)[1] == 1:
        text = [
            "One seed: no comparison between methods is claimed (a difference needs its interval over paired "
            "seeds: run at least two seeds)."
        ]
    else:
        text = []
        for method in groups:
            text += _lines(method, reference, [c for c in found if c.method == method])
        for a, b in pairs:
            if b != reference:
                text += _lines(a, b, [c for c in paired if (c.method, c.reference) == (a, b)])
    flagged = [(m, r) for m, runs in groups.items() for r in runs if is_flagged(r.get("health"))]
    text = diverged_lines(results) + [flagged_line(m, r) for m, r in flagged] + text
    out = {
        "reference": reference,
        "level": LEVEL,
        "power": POWER,
        "test": "paired differences over seeds (method − reference), Student t interval",
        "detectable_difference": DETECTABLE,
        "claimed": claimed,
        "comparisons": [c.to_dict() for c in found],
        "text": text,
    }
    if pairs:
        out["pairs"] = [c.to_dict() for c in paired]
    failed = failed_runs(results)
    if failed:
        out["diverged"] = [{"method": r["method"], "seed": r.get("seed"), "error": r["error"]} for r in failed]
    if flagged:
        out["health"] = [{"method": m, "seed": r.get("seed"), "flags": r["health"].get("flags")} for m, r in flagged]
    return out
