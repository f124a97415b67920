"""The figures of a comparison report, drawn with :mod:`flatbma.plotting` (``pip install flatbma[plots]``).

Each figure function takes the ``results.json`` dict (:mod:`flatbma.experiment.report.rows`) and returns the
PNG bytes, or ``None`` when no run has its data; :data:`FIGURES` lists them in the report's order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flatbma import plotting
from flatbma.experiment.report.rows import (
    ACCURACY,
    CORRUPTION_METRICS,
    ECE,
    LEVEL,
    NLL,
    Run,
    as_number,
    by_method,
    corruption_average,
    lambda1_median_interval,
    read_runs,
    run_lambda1,
    run_lambda1_median,
    seed_counts,
    severities_of,
    spread_text,
    summary_of,
    to_number,
)
from flatbma.stats import Summary

__all__ = [
    "FIGURES",
    "FigureSpec",
    "bma_curve_figure",
    "corruption_figure",
    "lambda1_figure",
    "landscape_curves",
    "landscape_figure",
    "reliability_figure",
]


_DPI = 100
"""Resolution of the report's own figures (the landscape figure keeps :func:`~flatbma.plotting.landscape_1d_png`'s)."""


def _figure(nrows: int, ncols: int, width: float, height: float) -> tuple[Any, list[Any]]:
    """:func:`flatbma.plotting.figure` of ``nrows × ncols`` panels of ``width × height`` inches."""
    return plotting.figure(nrows, ncols, width, height, what="report figures")


def _png(fig: Any) -> bytes:
    return plotting.png(fig, dpi=_DPI)


def _within(x: float, bounds: tuple[float | None, float | None]) -> float:
    """``x`` clipped to a metric's range (:attr:`~flatbma.experiment.report.rows.Metric.bounds`)."""
    low, high = bounds
    if low is not None:
        x = max(low, x)
    if high is not None:
        x = min(high, x)
    return x


def _band(
    ax: Any,
    xs: Sequence[float],
    stats: Sequence[Summary],
    label: str,
    bounds: tuple[float | None, float | None] = (None, None),
) -> None:
    means = [s.mean for s in stats]
    (line,) = ax.plot(xs, means, marker="o", markersize=3, label=label)
    if any(s.std is not None for s in stats):
        lo = [_within(s.mean - (s.std or 0.0), bounds) for s in stats]
        hi = [_within(s.mean + (s.std or 0.0), bounds) for s in stats]
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)


def reliability_figure(results: Mapping[str, Any]) -> bytes | None:
    """Reliability diagrams of the full BMA, one panel per method (its first seed), with the test examples per bin.

    ``None`` without data.
    """
    panels = []
    for method, runs in by_method(read_runs(results)).items():
        run = next((r for r in runs if _reliability(r) is not None), None)
        if run is not None:
            panels.append((method, run, _reliability(run)))
    if not panels:
        return None
    ncols = min(len(panels), 4)
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = _figure(nrows, ncols, 3.2, 3.2)
    for ax, (method, run, (edges, conf, acc, count)) in zip(axes, panels):
        centers = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
        widths = [b - a for a, b in itertools.pairwise(edges)]
        keep = [i for i in range(len(centers)) if acc[i] is not None and conf[i] is not None]
        ax.bar(
            [centers[i] for i in keep],
            [acc[i] for i in keep],
            [widths[i] for i in keep],
            color="tab:blue",
            edgecolor="k",
            linewidth=0.4,
            label="accuracy",
        )
        ax.bar(
            [centers[i] for i in keep],
            [conf[i] - acc[i] for i in keep],
            [widths[i] for i in keep],
            bottom=[acc[i] for i in keep],
            color="tab:red",
            alpha=0.3,
            hatch="//",
            linewidth=0.4,
            label="gap to confidence",
        )
        for i in keep:  # how many test examples each bar rests on
            if count[i] is not None:
                ax.text(
                    centers[i],
                    min(max(acc[i], conf[i]) + 0.02, 0.9),
                    f"{count[i]:g}",
                    ha="center",
                    va="bottom",
                    fontsize=6,
                    rotation=90 if len(centers) > 8 else 0,
                )
        ax.plot([0, 1], [0, 1], "k--", linewidth=0.8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ece = as_number(run.get("ece"))
        seed = run.get("seed")
        ax.set_title(f"{method} (seed {seed})" + (f"\nECE {ece:.4f}" if ece is not None else ""), fontsize=9)
        ax.set_xlabel("confidence")
        ax.set_ylabel("accuracy")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7, loc="upper left")
    return _png(fig)


def _reliability(
    run: Run,
) -> tuple[list[float], list[float | None], list[float | None], list[float | None]] | None:
    """``(bin edges, confidence, accuracy, count)`` of a run's reliability diagram (counts ``None`` if absent)."""
    rel = run.get("reliability")
    if not isinstance(rel, Mapping):
        return None
    edges = [as_number(e) for e in rel.get("bin_edges") or []]
    conf = [as_number(c) for c in rel.get("confidence") or []]
    acc = [as_number(a) for a in rel.get("accuracy") or []]
    count = [as_number(c) for c in rel.get("count") or []]
    n = len(edges) - 1
    if n < 1 or None in edges or len(conf) != n or len(acc) != n:
        return None
    if all(a is None for a in acc):
        return None
    return edges, conf, acc, count if len(count) == n else [None] * n


def _curve_stats(runs: Sequence[Run], metric: str) -> tuple[list[float], list[Summary]]:
    """Mean ± std over seeds of a BMA-curve metric at every number of samples any seed has."""
    per_m: dict[float, list[float | None]] = {}
    for run in runs:
        curve = run.get("bma_curve")
        if not isinstance(curve, Mapping):
            continue
        values = curve.get(metric) or []
        for m, v in zip(curve.get("num_samples") or [], values):
            if as_number(m) is not None:
                per_m.setdefault(as_number(m), []).append(as_number(v))
    xs = sorted(m for m, vs in per_m.items() if summary_of(vs) is not None)
    return xs, [summary_of(per_m[m]) for m in xs]


def bma_curve_figure(results: Mapping[str, Any]) -> bytes | None:
    """NLL, accuracy and ECE of the BMA vs number of samples ``M`` (mean ± std over seeds); ``None`` without data."""
    groups = by_method(read_runs(results))
    metrics = (NLL, ACCURACY, ECE)
    curves = {m: {k.key: _curve_stats(rs, k.key) for k in metrics} for m, rs in groups.items()}
    if not any(xs for per in curves.values() for xs, _ in per.values()):
        return None
    fig, axes = _figure(1, len(metrics), 3.6, 3.0)
    all_m = [x for per in curves.values() for xs, _ in per.values() for x in xs]
    for ax, metric in zip(axes, metrics):
        for method, per in curves.items():
            xs, stats = per[metric.key]
            if xs:
                _band(ax, xs, stats, method, metric.bounds)
        ax.set_xlabel("number of BMA samples M")
        ax.set_ylabel(metric.label)
        if min(all_m) > 0 and max(all_m) / min(all_m) >= 10:
            ax.set_xscale("log")
        ticks = sorted(set(all_m))
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _png(fig)


def _run_interval(run: Run) -> tuple[float, float] | None:
    """A run's interval over its samples: the bootstrap interval of its median λ₁.

    A run that records no median: its mean ± the std over samples.
    """
    if run_lambda1_median(run) is None:
        mean, std = run_lambda1(run), as_number(run.get("lambda1_std"))
        return (mean - std, mean + std) if mean is not None and std is not None else None
    interval = lambda1_median_interval(run)
    return (interval.low, interval.high) if interval is not None else None


def _errorbar(center: float, interval: tuple[float, float] | None) -> list[list[float]] | None:
    if interval is None:
        return None
    return [[max(0.0, center - interval[0])], [max(0.0, interval[1] - center)]]


def _run_value(run: Run) -> float | None:
    """What a run's dot shows: its median λ₁ over samples, else (a run that records no median) its mean."""
    median = run_lambda1_median(run)
    return median if median is not None else run_lambda1(run)


def lambda1_figure(results: Mapping[str, Any]) -> bytes | None:
    """λ₁ per method with its intervals; ``None`` when no run has λ₁.

    Bar: the mean over seeds of the runs' median λ₁ (else their mean), with its 95% t interval over two or more
    seeds (never clipped: λ₁ can be negative). Dots: each run's median with the bootstrap interval of the median;
    a bar marker: the run's mean over samples; a cross: λ₁ at the posterior mean. The axis is logarithmic when
    the values drawn are all positive and span more than a factor of 10.
    """
    groups = by_method(read_runs(results))
    methods = [m for m, rs in groups.items() if any(_run_value(r) is not None for r in rs)]
    if not methods:
        return None
    fig, (ax,) = _figure(1, 1, max(4.5, 1.0 + 0.9 * len(methods)), 3.6)
    medians = any(run_lambda1_median(r) is not None for rs in groups.values() for r in rs)
    shown: dict[str, Any] = {}
    drawn: list[float] = []
    for i, method in enumerate(methods):
        runs = [r for r in groups[method] if _run_value(r) is not None]
        s = summary_of([_run_value(r) for r in runs])
        interval = (s.interval.low, s.interval.high) if s.interval is not None else None
        shown["bar"] = ax.bar(i, s.mean, 0.6, yerr=_errorbar(s.mean, interval), capsize=4, color="tab:blue", alpha=0.4)
        offsets = [0.0] if len(runs) == 1 else [-0.2 + 0.4 * j / (len(runs) - 1) for j in range(len(runs))]
        for off, r in zip(offsets, runs):
            y = _run_value(r)
            drawn.append(y)
            shown["run"] = ax.errorbar(
                i + off,
                y,
                yerr=_errorbar(y, _run_interval(r)),
                fmt="o",
                color="k",
                markersize=3,
                capsize=2,
                linewidth=0.8,
            )
            mean = run_lambda1(r)
            if medians and mean is not None:
                (shown["mean"],) = ax.plot(i + off, mean, marker="_", color="tab:orange", markersize=9)
                drawn.append(mean)
            at_mean = as_number(r.get("lambda1_at_mean"))
            if at_mean is not None:
                (shown["at_mean"],) = ax.plot(i + off, at_mean, marker="x", color="tab:red", markersize=5)
    seeds = seed_counts(groups)[1] > 1
    what = "median" if medians else "mean"
    labels = {
        "bar": f"{what} over samples, mean over seeds ({LEVEL:.0%} t interval)" if seeds else f"λ₁ {what} (one seed)",
        "run": f"run: {what} over samples" + (" (bootstrap interval of the median)" if medians else " (± std)"),
        "mean": "run: mean over samples",
        "at_mean": "λ₁ at the posterior mean",
    }
    ax.legend([shown[k] for k in labels if k in shown], [v for k, v in labels.items() if k in shown], fontsize=7)
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels(methods, rotation=20, ha="right")
    heavy = min(drawn) > 0 and max(drawn) > 10 * min(drawn)  # λ₁ is heavy-tailed: one sample can dwarf the rest
    if heavy:
        ax.set_yscale("log")
    ax.set_ylabel("λ₁ (top Hessian eigenvalue)" + (", log scale" if heavy else ""))
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def corruption_figure(results: Mapping[str, Any]) -> bytes | None:
    """BMA accuracy/NLL/ECE vs corruption severity (0 = clean), mean over corruptions ± std over seeds.

    With one severity each method is a pair of points with error bars (side by side), not a line from clean.
    """
    runs = read_runs(results)
    severities = [s for s in severities_of(runs) if to_number(s) is not None]
    if not severities:
        return None
    groups = by_method(runs)
    single = len(severities) == 1
    fig, axes = _figure(1, len(CORRUPTION_METRICS), 3.6, 3.0)
    for ax, metric in zip(axes, CORRUPTION_METRICS):
        for j, (method, rs) in enumerate(groups.items()):
            xs, stats = [], []
            clean = summary_of([metric.get(r) for r in rs])
            if clean is not None:
                xs.append(0.0)
                stats.append(clean)
            for s in severities:
                st = summary_of([corruption_average(r, s, metric.key) for r in rs])
                if st is not None:
                    xs.append(float(s))
                    stats.append(st)
            if not xs:
                continue
            if single:
                off = (j - (len(groups) - 1) / 2) * 0.6 / max(len(groups), 1) * float(severities[0])
                ax.errorbar(
                    [x + off for x in xs],
                    [s.mean for s in stats],
                    yerr=[  # mean ± std, cut at the metric's range
                        [s.mean - _within(s.mean - (s.std or 0.0), metric.bounds) for s in stats],
                        [_within(s.mean + (s.std or 0.0), metric.bounds) - s.mean for s in stats],
                    ],
                    fmt="o",
                    markersize=4,
                    capsize=3,
                    label=method,
                )
            else:
                _band(ax, xs, stats, method, metric.bounds)
        ticks = [0.0, *(float(s) for s in severities)]
        ax.set_xticks(ticks, ["clean", *severities] if single else [f"{t:g}" for t in ticks])
        ax.set_xlabel("severity" if single else "severity (0 = clean)")
        ax.set_ylabel(metric.label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _png(fig)


def landscape_curves(results: Mapping[str, Any]) -> dict[str, tuple[list[float], list[float], list[float]]]:
    """Per method ``{label: (alphas, mean, std)}`` of the 1-D posterior loss landscapes, pooled over seeds.

    Each run holds the mean ``m_s(α)`` and std ``σ_s(α)`` over its samples; a method's seeds (those with the alphas
    of its first seed) are pooled as an equal mixture: mean ``m = mean_s m_s``, std
    ``√(mean_s σ_s² + mean_s (m_s − m)²)`` (law of total variance). Methods without a landscape are left out.
    """
    curves = {}
    for method, runs in by_method(read_runs(results)).items():
        found = [c for c in (_landscape(r) for r in runs) if c is not None]
        if not found:
            continue
        alphas = found[0][0]
        same = [c for c in found if c[0] == alphas]
        k = len(same)
        mean = [math.fsum(c[1][i] for c in same) / k for i in range(len(alphas))]
        var = [math.fsum(c[2][i] ** 2 + (c[1][i] - mean[i]) ** 2 for c in same) / k for i in range(len(alphas))]
        curves[f"{method} ({k} seed{'s' if k > 1 else ''})"] = (alphas, mean, [math.sqrt(v) for v in var])
    return curves


def landscape_figure(results: Mapping[str, Any]) -> bytes | None:
    """1-D posterior loss landscapes per method (:func:`landscape_curves`); ``None`` without data."""
    curves = landscape_curves(results)
    if not curves:
        return None
    return plotting.landscape_1d_png(
        curves,
        xlabel="α (filter-normalized random direction)",
        title="training loss of posterior samples (mean ± std)",
    )


def _landscape(run: Run) -> tuple[list[float], list[float], list[float]] | None:
    land = run.get("landscape")
    if not isinstance(land, Mapping):
        return None
    alphas = [as_number(a) for a in land.get("alphas") or []]
    mean = [as_number(m) for m in land.get("mean") or []]
    std = land.get("std")
    std = [as_number(s) or 0.0 for s in std] if isinstance(std, Sequence) else [0.0] * len(mean)
    if not alphas or len(alphas) != len(mean) or len(std) != len(mean) or None in alphas or None in mean:
        return None
    return alphas, mean, std


@dataclass(frozen=True)
class FigureSpec:
    """One figure of the report: file stem, caption, the function drawing it, why it may be missing.

    ``title`` may hold ``{spread}``, filled by :meth:`caption` with what the bands show
    ("mean ± std over seeds", or "one seed").
    """

    name: str
    title: str
    draw: Callable[[Mapping[str, Any]], bytes | None]
    missing: str

    def caption(self, results: Mapping[str, Any]) -> str:
        """The title for these results."""
        return self.title.format(spread=spread_text(by_method(read_runs(results)), interval=False))


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec(
        "reliability",
        "Reliability diagrams (full BMA, first seed; numbers: test examples per bin)",
        reliability_figure,
        "no run has a reliability diagram",
    ),
    FigureSpec(
        "bma_curve",
        "BMA quality vs number of samples ({spread})",
        bma_curve_figure,
        "no run has a BMA curve",
    ),
    FigureSpec(
        "lambda1",
        "Top Hessian eigenvalue λ₁ per method: the median over posterior samples with its intervals (the mean "
        "beside it)",
        lambda1_figure,
        "no run has λ₁ (flatness was not measured)",
    ),
    FigureSpec(
        "corruptions",
        "Accuracy, NLL and ECE vs corruption severity ({spread})",
        corruption_figure,
        "no corrupted test sets were evaluated",
    ),
    FigureSpec(
        "landscape",
        "1-D loss landscape of the posterior",
        landscape_figure,
        "no run has a loss landscape",
    ),
)
