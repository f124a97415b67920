"""The report's words on measurement repeatability: whether a repeated λ₁ measurement repeated, and why not.

A run with ``eval.repeatability`` measures λ₁ twice (another measurement seed and another draw of samples);
:func:`flatbma.flatness.posterior.repeatable` decides what repeats (docs/methods.md §8.7).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flatbma.experiment.report.rows import MISSING, Run, as_number, decimals_for, format_number, format_value, get_path
from flatbma.flatness.posterior import HEAVY_TAIL_FACTOR, repeatable

__all__ = ["repeat_disagreement", "repeatability_lines"]


def _summary_text(summary: Any) -> str:
    """``mean [low, high]`` of a :class:`~flatbma.stats.Summary` given as its dict."""
    mean = as_number(get_path(summary, "mean"))
    if mean is None:
        return MISSING
    decimals = decimals_for(mean)
    low, high = as_number(get_path(summary, "interval", "low")), as_number(get_path(summary, "interval", "high"))
    text = format_number(mean, decimals)
    return (
        text
        if low is None or high is None
        else f"{text} [{format_number(low, decimals)}, {format_number(high, decimals)}]"
    )


def repeatability_lines(groups: dict[str, list[Run]]) -> list[str]:
    """One "measurement repeatability" line per method that repeated its measurement."""
    lines = []
    for method, runs in groups.items():
        reps = [(r.get("seed"), r["repeatability"]) for r in runs if isinstance(r.get("repeatability"), Mapping)]
        if not reps:
            continue
        agree = sum(repeatable(rep) is True for _, rep in reps)
        head = (
            ("repeatable" if agree else "not repeatable")
            if len(reps) == 1
            else f"repeatable on {agree} of {len(reps)} seeds"
        )
        details = "; ".join(f"seed {seed}: {_repeat_text(rep)}" for seed, rep in reps)
        lines.append(
            f"measurement repeatability, {method}: {head} (λ₁ measured, then measured again with another "
            f"measurement seed and samples: mean [interval], median — {details})"
        )
    return lines


def _repeat_text(rep: Mapping[str, Any]) -> str:
    """``mean [low, high], median m vs …`` of a repeated measurement, and why it is not repeatable."""
    first, second = rep.get("first"), rep.get("second")
    text = " vs ".join(
        _summary_text(part)
        + (
            f", median {format_value(as_number(get_path(part, 'median')))}"
            if get_path(part, "median") is not None
            else ""
        )
        for part in (first, second)
    )
    why = _not_repeatable_because(rep)
    return f"{text}{f' ({why})' if why else ''}"


def repeat_disagreement(record: Any) -> str | None:
    """One line saying that a repeated λ₁ measurement (``repeatability`` of a run) did not repeat; ``None`` if it did.

    The rule is :func:`flatbma.flatness.posterior.repeatable`.
    """
    if not isinstance(record, Mapping) or repeatable(record) is not False:
        return None
    return (
        f"λ₁ measured again (another measurement seed and samples) does not repeat: {_repeat_text(record)}; "
        "read the median, or measure more samples (eval.flatness_samples)"
    )


def _not_repeatable_because(rep: Mapping[str, Any]) -> str:
    """Why a repeated measurement is not repeatable (:func:`flatbma.flatness.posterior.repeatable`); "" if it is."""
    if repeatable(rep) is not False:
        return ""
    if rep.get("agree") is not True:
        return "the means differ by more than their intervals allow"
    ratios = {
        what: (as_number(get_path(rep, "first", key)), as_number(get_path(rep, "second", key)))
        for what, key in (("means", "mean"), ("medians", "median"))
    }
    far = [
        f"{what} {format_value(a)} and {format_value(b)}"
        for what, (a, b) in ratios.items()
        if a is not None
        and b is not None
        and not (a * b > 0 and max(abs(a), abs(b)) <= HEAVY_TAIL_FACTOR * min(abs(a), abs(b)))
        and a != b
    ]
    return (
        f"heavy tail: {' and '.join(far)} differ by more than a factor {HEAVY_TAIL_FACTOR:g}, although within the "
        "intervals"
    )
