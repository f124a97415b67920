"""Reports of a comparison: tables (mean ± std over seeds), figures, CSV, Markdown and HTML.

Input is the ``results.json`` dict written by ``flatbma compare``::

    {"config_hash": str, "config": {...}, "created": str,
     "runs": [{"method": str, "seed": int, "run_dir": str,
               "accuracy", "nll", "ece", "aece", "brier": float,
               "lambda1", "lambda1_std", "lambda1_over_lambda5", "distribution_lambda1",
               "sam_sharpness": float | null, "train_time_s", "eval_time_s": float,
               "bma_curve": {"num_samples": [...], "accuracy": [...], "nll": [...], "ece": [...]},
               "reliability": {"bin_edges": [n+1], "count": [n], "confidence": [n], "accuracy": [n]},
               "corruptions": {name: {severity: {"accuracy", "nll", "ece"}}},
               "landscape": {"alphas": [...], "mean": [...], "std": [...]} | null}, ...]}

Any field may be missing or null: tables then show "–" and a figure without data is skipped with a
note. Aggregates over the seeds of a method are the mean and the sample standard deviation
(``ddof = 1``) of the runs that have the value; with one such run only the mean is shown.

:func:`write_reports` writes, into one folder, ``results.csv`` (one row per run, flat columns),
``figures/*.png``, ``report.md`` (tables, and the figures by relative path) and ``report.html``, which
is self-contained: its figures are embedded as base64 PNG data URIs. Figures need matplotlib
(``pip install flatbma[plots]``).
"""

from __future__ import annotations

import base64
import csv
import html
import io
import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from flatbma import plotting
from flatbma.checks import is_number
from flatbma.errors import FlatbmaError
from flatbma.experiment.checkpoint import atomic_write_bytes

__all__ = [
    "FIGURES",
    "FigureSpec",
    "Stats",
    "Table",
    "bma_curve_figure",
    "corruption_figure",
    "csv_rows",
    "lambda1_figure",
    "landscape_curves",
    "landscape_figure",
    "reliability_figure",
    "report_tables",
    "summary_table",
    "write_reports",
]

MISSING = "–"
"""What a table shows for a value no run has."""

SUMMARY_METRICS: tuple[tuple[str, str], ...] = (
    ("accuracy", "accuracy"),
    ("nll", "NLL"),
    ("ece", "ECE"),
    ("aece", "AECE"),
    ("brier", "Brier"),
    ("lambda1", "λ₁"),
    ("lambda1_over_lambda5", "λ₁/λ₅"),
)
EXTRA_METRICS: tuple[tuple[str, str], ...] = (
    ("distribution_lambda1", "λ₁ of the mean Hessian"),
    ("sam_sharpness", "SAM sharpness"),
    ("train_time_s", "train time (s)"),
    ("eval_time_s", "eval time (s)"),
)
CORRUPTION_METRICS: tuple[tuple[str, str], ...] = (("accuracy", "accuracy"), ("nll", "NLL"), ("ece", "ECE"))
_STRUCTURED = ("bma_curve", "reliability", "corruptions", "landscape")

Run = Mapping[str, Any]


# --------------------------------------------------------------------------------------------------
# reading the results


def _runs(results: Mapping[str, Any]) -> list[Run]:
    if not isinstance(results, Mapping):
        raise FlatbmaError(f"results must be a dict as written to results.json, not {type(results).__name__}")
    runs = results.get("runs")
    if not isinstance(runs, Sequence) or isinstance(runs, str) or not runs:
        raise FlatbmaError("results has no runs: run `flatbma compare` first (results.json needs a non-empty 'runs')")
    for i, run in enumerate(runs):
        if not isinstance(run, Mapping) or not isinstance(run.get("method"), str):
            raise FlatbmaError(f"results['runs'][{i}] must be a dict with a 'method' name")
    return list(runs)


def _by_method(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Runs grouped by method, methods in order of appearance, runs sorted by seed."""
    out: dict[str, list[Run]] = {}
    for run in runs:
        out.setdefault(run["method"], []).append(run)
    return {
        m: sorted(rs, key=lambda r: (_num(r.get("seed")) is None, _num(r.get("seed")) or 0.0)) for m, rs in out.items()
    }


def _num(value: Any) -> float | None:
    """A number, or ``None`` for null, missing and non-numeric values."""
    if not is_number(value):
        return None
    return float(value)


def _get(mapping: Any, *keys: Any) -> Any:
    """``mapping[k1][k2]…`` or ``None`` where a level is missing or not a dict."""
    for k in keys:
        if not isinstance(mapping, Mapping):
            return None
        mapping = mapping.get(k)
    return mapping


@dataclass(frozen=True)
class Stats:
    """Mean and sample standard deviation (``None`` for one value) of ``n`` values."""

    mean: float
    std: float | None
    n: int


def _stats(values: Sequence[float | None]) -> Stats | None:
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    mean = math.fsum(xs) / len(xs)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None
    return Stats(mean, std, len(xs))


def _mean(values: Sequence[float | None]) -> float | None:
    stats = _stats(values)
    return stats.mean if stats is not None else None


def _decimals(x: float) -> int | None:
    """Decimals that show ``x`` with about 4 significant digits (at most 4); ``None``: use scientific."""
    if x == 0 or not math.isfinite(x):
        return 4
    if abs(x) >= 1e6 or abs(x) < 1e-3:
        return None
    return min(4, max(0, 3 - math.floor(math.log10(abs(x)))))


def _fmt(x: float, decimals: int | None = 4) -> str:
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3e}" if decimals is None else f"{x:.{decimals}f}"


def _cell(stats: Stats | None) -> str:
    """``mean ± std``, both with the decimals that suit the mean; ``–`` when no run has the value."""
    if stats is None:
        return MISSING
    decimals = _decimals(stats.mean)
    mean = _fmt(stats.mean, decimals)
    return mean if stats.std is None else f"{mean} ± {_fmt(stats.std, decimals)}"


def _corruption_note(sizes: list[float]) -> str:
    """The caption of the corruption tables: how many posterior samples the BMA on corrupted data used."""
    if not sizes:
        return ""
    if len(sizes) == 1:
        return f"BMA of the first {sizes[0]:g} posterior samples."
    fewer = ", ".join(f"{n:g}" for n in sizes[:-1])
    return f"BMA of the first {sizes[-1]:g} posterior samples ({fewer} for methods that have fewer)."


def _severities(runs: Sequence[Run]) -> list[str]:
    found: dict[str, None] = {}
    for run in runs:
        for per_severity in (run.get("corruptions") or {}).values():
            if isinstance(per_severity, Mapping):
                found.update(dict.fromkeys(str(s) for s in per_severity))
    return sorted(found, key=lambda s: (_to_number(s) is None, _to_number(s) or 0.0, s))


def _to_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _corruption_average(run: Run, severity: str, metric: str) -> float | None:
    """Mean of ``metric`` over the corruptions evaluated at ``severity`` in one run."""
    corruptions = run.get("corruptions")
    if not isinstance(corruptions, Mapping):
        return None
    stats = _stats([_num(_get(per, severity, metric)) for per in corruptions.values()])
    return stats.mean if stats is not None else None


# --------------------------------------------------------------------------------------------------
# tables


@dataclass(frozen=True)
class Table:
    """A table of strings, rendered to Markdown or HTML."""

    title: str
    header: list[str]
    rows: list[list[str]]
    note: str = ""

    def markdown(self) -> str:
        """GitHub-flavoured Markdown (``|`` in cells escaped)."""

        def line(cells: Sequence[str]) -> str:
            return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

        lines = [line(self.header), "|" + "|".join(["---"] + [":-:"] * (len(self.header) - 1)) + "|"]
        return "\n".join(lines + [line(r) for r in self.rows])

    def html(self) -> str:
        """An HTML ``<table>`` with escaped cells."""
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in self.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _metric_table(title: str, groups: dict[str, list[Run]], metrics: Sequence[tuple[str, str]], note: str) -> Table:
    rows = [
        [method, str(len(runs))] + [_cell(_stats([_num(r.get(key)) for r in runs])) for key, _ in metrics]
        for method, runs in groups.items()
    ]
    return Table(title, ["method", "seeds"] + [label for _, label in metrics], rows, note)


def _summary(groups: dict[str, list[Run]]) -> Table:
    return _metric_table(
        "Results (mean ± std over seeds)",
        groups,
        SUMMARY_METRICS,
        "BMA metrics on the test set; λ₁ and λ₁/λ₅: top Hessian eigenvalues of sampled models, averaged "
        "over samples, then over seeds.",
    )


def summary_table(results: Mapping[str, Any]) -> str:
    """The main table as Markdown: per method, mean ± std over seeds of accuracy … λ₁/λ₅."""
    return _summary(_by_method(_runs(results))).markdown()


def report_tables(results: Mapping[str, Any]) -> list[Table]:
    """Every table of the report: the summary, flatness/cost extras and, with corruptions, one per metric."""
    runs = _runs(results)
    groups = _by_method(runs)
    tables = [_summary(groups)]
    if any(_num(r.get(k)) is not None for r in runs for k, _ in EXTRA_METRICS):
        tables.append(
            _metric_table(
                "Flatness of the distribution and cost (mean ± std over seeds)",
                groups,
                EXTRA_METRICS,
                "λ₁ of the mean Hessian: top eigenvalue of the Hessian of E_q[L] (the averaged Hessian of the "
                "samples); SAM sharpness: E_w[L(w + ρ g/‖g‖) − L(w)].",
            )
        )
    severities = _severities(runs)
    if severities:
        sizes = sorted({n for r in runs if (n := _num(r.get("corruption_samples"))) is not None})
        note = _corruption_note(sizes)
        for key, label in CORRUPTION_METRICS:
            rows = []
            for method, rs in groups.items():
                per_run = {s: [_corruption_average(r, s, key) for r in rs] for s in severities}
                overall = [_mean([per_run[s][i] for s in severities]) for i in range(len(rs))]
                rows.append([method, *(_cell(_stats(per_run[s])) for s in severities), _cell(_stats(overall))])
            tables.append(
                Table(
                    f"Corrupted test sets: {label} (mean over corruptions, mean ± std over seeds)",
                    ["method", *(f"severity {s}" for s in severities), "all severities"],
                    rows,
                    note,
                )
            )
    return tables


# --------------------------------------------------------------------------------------------------
# CSV


def csv_rows(results: Mapping[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """``(columns, rows)``: one flat row per run.

    Scalars keep their key; other dicts are flattened one level (``method_options.rank``); the BMA
    curve becomes ``bma_<metric>_m<M>``, corruptions ``corr_<name>_s<severity>_<metric>``. The
    reliability diagram and the landscape curve are left out (see ``results.json``). Columns are
    the union over runs in order of appearance; a run without a column leaves it empty.
    """
    rows = [_flat_run(run) for run in _runs(results)]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return columns, rows


def _flat_run(run: Run) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in run.items():
        if key in _STRUCTURED:
            continue
        if isinstance(value, Mapping):
            for sub, v in value.items():
                out[f"{key}.{sub}"] = v if _is_scalar(v) else json.dumps(v)
        else:
            out[key] = value if _is_scalar(value) else json.dumps(value)
    curve = run.get("bma_curve")
    if isinstance(curve, Mapping):
        sizes = curve.get("num_samples") or []
        for metric, values in curve.items():
            if metric == "num_samples" or not isinstance(values, Sequence):
                continue
            for m, v in zip(sizes, values):
                out[f"bma_{metric}_m{m}"] = v
    corruptions = run.get("corruptions")
    if isinstance(corruptions, Mapping):
        for name, per_severity in corruptions.items():
            for severity, metrics in (per_severity or {}).items():
                for metric, v in (metrics or {}).items():
                    out[f"corr_{name}_s{severity}_{metric}"] = v
    return out


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _csv_text(results: Mapping[str, Any]) -> str:
    columns, rows = csv_rows(results)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in columns})
    return buf.getvalue()


# --------------------------------------------------------------------------------------------------
# figures


_DPI = 100
"""Resolution of the report's own figures (the landscape figure keeps :func:`~flatbma.plotting.landscape_1d_png`'s)."""


def _figure(nrows: int, ncols: int, width: float, height: float) -> tuple[Any, list[Any]]:
    """:func:`flatbma.plotting.figure` of ``nrows × ncols`` panels of ``width × height`` inches."""
    return plotting.figure(nrows, ncols, width, height, what="report figures")


def _png(fig: Any) -> bytes:
    return plotting.png(fig, dpi=_DPI)


def _band(ax: Any, xs: Sequence[float], stats: Sequence[Stats], label: str) -> None:
    means = [s.mean for s in stats]
    (line,) = ax.plot(xs, means, marker="o", markersize=3, label=label)
    if any(s.std is not None for s in stats):
        lo = [s.mean - (s.std or 0.0) for s in stats]
        hi = [s.mean + (s.std or 0.0) for s in stats]
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)


def reliability_figure(results: Mapping[str, Any]) -> bytes | None:
    """Reliability diagrams of the full BMA, one panel per method (its first seed); ``None`` without data."""
    panels = []
    for method, runs in _by_method(_runs(results)).items():
        run = next((r for r in runs if _reliability(r) is not None), None)
        if run is not None:
            panels.append((method, run, _reliability(run)))
    if not panels:
        return None
    ncols = min(len(panels), 4)
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = _figure(nrows, ncols, 3.2, 3.2)
    for ax, (method, run, (edges, conf, acc)) in zip(axes, panels):
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
        ax.plot([0, 1], [0, 1], "k--", linewidth=0.8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ece = _num(run.get("ece"))
        seed = run.get("seed")
        ax.set_title(f"{method} (seed {seed})" + (f"\nECE {ece:.4f}" if ece is not None else ""), fontsize=9)
        ax.set_xlabel("confidence")
        ax.set_ylabel("accuracy")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7, loc="upper left")
    return _png(fig)


def _reliability(run: Run) -> tuple[list[float], list[float | None], list[float | None]] | None:
    rel = run.get("reliability")
    if not isinstance(rel, Mapping):
        return None
    edges = [_num(e) for e in rel.get("bin_edges") or []]
    conf = [_num(c) for c in rel.get("confidence") or []]
    acc = [_num(a) for a in rel.get("accuracy") or []]
    n = len(edges) - 1
    if n < 1 or None in edges or len(conf) != n or len(acc) != n:
        return None
    if all(a is None for a in acc):
        return None
    return edges, conf, acc


def _curve_stats(runs: Sequence[Run], metric: str) -> tuple[list[float], list[Stats]]:
    """Mean ± std over seeds of a BMA-curve metric at every number of samples any seed has."""
    per_m: dict[float, list[float | None]] = {}
    for run in runs:
        curve = run.get("bma_curve")
        if not isinstance(curve, Mapping):
            continue
        values = curve.get(metric) or []
        for m, v in zip(curve.get("num_samples") or [], values):
            if _num(m) is not None:
                per_m.setdefault(_num(m), []).append(_num(v))
    xs = sorted(m for m, vs in per_m.items() if _stats(vs) is not None)
    return xs, [_stats(per_m[m]) for m in xs]


def bma_curve_figure(results: Mapping[str, Any]) -> bytes | None:
    """NLL, accuracy and ECE of the BMA vs number of samples ``M`` (mean ± std over seeds); ``None`` without data."""
    groups = _by_method(_runs(results))
    metrics = (("nll", "NLL"), ("accuracy", "accuracy"), ("ece", "ECE"))
    curves = {m: {k: _curve_stats(rs, k) for k, _ in metrics} for m, rs in groups.items()}
    if not any(xs for per in curves.values() for xs, _ in per.values()):
        return None
    fig, axes = _figure(1, len(metrics), 3.6, 3.0)
    all_m = [x for per in curves.values() for xs, _ in per.values() for x in xs]
    for ax, (key, label) in zip(axes, metrics):
        for method, per in curves.items():
            xs, stats = per[key]
            if xs:
                _band(ax, xs, stats, method)
        ax.set_xlabel("number of BMA samples M")
        ax.set_ylabel(label)
        if min(all_m) > 0 and max(all_m) / min(all_m) >= 10:
            ax.set_xscale("log")
        ticks = sorted(set(all_m))
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _png(fig)


def lambda1_figure(results: Mapping[str, Any]) -> bytes | None:
    """λ₁ per method: bar = mean over seeds ± std over seeds; dots = runs ± std over their samples."""
    groups = _by_method(_runs(results))
    methods = [m for m, rs in groups.items() if any(_num(r.get("lambda1")) is not None for r in rs)]
    if not methods:
        return None
    fig, (ax,) = _figure(1, 1, max(4.0, 1.0 + 0.9 * len(methods)), 3.4)
    for i, method in enumerate(methods):
        runs = [r for r in groups[method] if _num(r.get("lambda1")) is not None]
        s = _stats([_num(r.get("lambda1")) for r in runs])
        ax.bar(i, s.mean, 0.6, yerr=s.std or 0.0, capsize=4, color="tab:blue", alpha=0.5)
        offsets = [0.0] if len(runs) == 1 else [-0.2 + 0.4 * j / (len(runs) - 1) for j in range(len(runs))]
        for off, r in zip(offsets, runs):
            ax.errorbar(
                i + off,
                _num(r.get("lambda1")),
                yerr=_num(r.get("lambda1_std")) or 0.0,
                fmt="o",
                color="k",
                markersize=3,
                capsize=2,
                linewidth=0.8,
            )
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels(methods, rotation=20, ha="right")
    ax.set_ylabel("λ₁ (top Hessian eigenvalue)")
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def corruption_figure(results: Mapping[str, Any]) -> bytes | None:
    """BMA accuracy/NLL/ECE vs corruption severity (0 = clean), mean over corruptions ± std over seeds."""
    runs = _runs(results)
    severities = [s for s in _severities(runs) if _to_number(s) is not None]
    if not severities:
        return None
    groups = _by_method(runs)
    fig, axes = _figure(1, len(CORRUPTION_METRICS), 3.6, 3.0)
    for ax, (key, label) in zip(axes, CORRUPTION_METRICS):
        for method, rs in groups.items():
            xs, stats = [], []
            clean = _stats([_num(r.get(key)) for r in rs])
            if clean is not None:
                xs.append(0.0)
                stats.append(clean)
            for s in severities:
                st = _stats([_corruption_average(r, s, key) for r in rs])
                if st is not None:
                    xs.append(float(s))
                    stats.append(st)
            if xs:
                _band(ax, xs, stats, method)
        ax.set_xticks([0.0, *(float(s) for s in severities)])
        ax.set_xlabel("severity (0 = clean)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _png(fig)


def landscape_curves(results: Mapping[str, Any]) -> dict[str, tuple[list[float], list[float], list[float]]]:
    """Per method ``{label: (alphas, mean, std)}`` of the 1-D posterior loss landscapes, pooled over seeds.

    Each run holds the mean ``m_s(α)`` and standard deviation ``σ_s(α)`` over its samples; the seeds of
    a method (those with the alphas of its first seed) are pooled as an equal mixture: mean
    ``m = mean_s m_s`` and std ``√(mean_s σ_s² + mean_s (m_s − m)²)`` (the law of total variance,
    population variance over seeds). Methods without a landscape are left out.
    """
    curves = {}
    for method, runs in _by_method(_runs(results)).items():
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
    alphas = [_num(a) for a in land.get("alphas") or []]
    mean = [_num(m) for m in land.get("mean") or []]
    std = land.get("std")
    std = [_num(s) or 0.0 for s in std] if isinstance(std, Sequence) else [0.0] * len(mean)
    if not alphas or len(alphas) != len(mean) or len(std) != len(mean) or None in alphas or None in mean:
        return None
    return alphas, mean, std


@dataclass(frozen=True)
class FigureSpec:
    """One figure of the report: file stem, caption, the function drawing it, why it may be missing."""

    name: str
    title: str
    draw: Callable[[Mapping[str, Any]], bytes | None]
    missing: str


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec(
        "reliability",
        "Reliability diagrams (full BMA, first seed)",
        reliability_figure,
        "no run has a reliability diagram",
    ),
    FigureSpec(
        "bma_curve",
        "BMA quality vs number of samples (mean ± std over seeds)",
        bma_curve_figure,
        "no run has a BMA curve",
    ),
    FigureSpec(
        "lambda1",
        "Top Hessian eigenvalue λ₁ per method",
        lambda1_figure,
        "no run has λ₁ (flatness was not measured)",
    ),
    FigureSpec(
        "corruptions",
        "Accuracy, NLL and ECE vs corruption severity",
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


# --------------------------------------------------------------------------------------------------
# documents


def write_reports(results: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``results.csv``, ``figures/<name>.png``, ``report.md`` and a self-contained ``report.html``.

    Args:
        results: the ``results.json`` dict (see the module docstring).
        out_dir: the folder to write into (created if missing). A figure that is skipped for lack
            of data has its stale PNG from an earlier report removed.

    Returns:
        The written files by path relative to ``out_dir`` (``"results.csv"``, ``"report.md"``,
        ``"report.html"``, ``"figures/<name>.png"``).

    Raises:
        FlatbmaError: if ``results`` has no runs, or matplotlib is missing.
    """
    out_dir = Path(out_dir)
    tables = report_tables(results)
    figures: list[tuple[FigureSpec, bytes | None]] = [(spec, spec.draw(results)) for spec in FIGURES]
    written: dict[str, Path] = {}

    def put(rel: str, data: bytes) -> None:
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
        written[rel] = path

    put("results.csv", _csv_text(results).encode())
    for spec, png in figures:
        rel = f"figures/{spec.name}.png"
        if png is not None:
            put(rel, png)
        else:
            (out_dir / rel).unlink(missing_ok=True)
    put("report.md", _markdown(results, tables, figures).encode())
    put("report.html", _html(results, tables, figures).encode())
    return written


def _header_lines(results: Mapping[str, Any]) -> list[tuple[str, str]]:
    runs = _runs(results)
    methods = list(_by_method(runs))
    return [
        ("config hash", str(results.get("config_hash") or MISSING)),
        ("created", str(results.get("created") or MISSING)),
        ("runs", f"{len(runs)} ({len(methods)} methods: {', '.join(methods)})"),
    ]


def _config_text(results: Mapping[str, Any]) -> str:
    shown = {k: results[k] for k in ("config", "compare") if results.get(k)}
    return yaml.safe_dump(shown, sort_keys=False, allow_unicode=True) if shown else ""


def _markdown(results: Mapping[str, Any], tables: list[Table], figures: list[tuple[FigureSpec, bytes | None]]) -> str:
    out = ["# flatbma comparison", ""]
    out += [f"- **{k}**: {v}" for k, v in _header_lines(results)]
    for table in tables:
        out += ["", f"## {table.title}", "", table.markdown()]
        if table.note:
            out += ["", f"_{table.note}_"]
    out += ["", "## Figures"]
    for spec, png in figures:
        out += ["", f"### {spec.title}", ""]
        out.append(f"![{spec.title}](figures/{spec.name}.png)" if png is not None else f"_Skipped: {spec.missing}._")
    config = _config_text(results)
    if config:
        out += ["", "## Configuration", "", "```yaml", config.rstrip(), "```"]
    return "\n".join(out) + "\n"


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 75em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: center; }
th { background: #f2f2f2; } td:first-child { text-align: left; font-weight: 600; }
figure { margin: 1em 0; } figcaption { font-weight: 600; margin-bottom: 0.3em; }
img { max-width: 100%; } .note { color: #555; font-style: italic; } pre { background: #f7f7f7; padding: 1em; }
"""


def _html(results: Mapping[str, Any], tables: list[Table], figures: list[tuple[FigureSpec, bytes | None]]) -> str:
    e = html.escape
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>flatbma comparison</title>',
        f"<style>{_CSS}</style></head><body>",
        "<h1>flatbma comparison</h1><ul>",
        *(f"<li><b>{e(k)}</b>: {e(v)}</li>" for k, v in _header_lines(results)),
        "</ul>",
    ]
    for table in tables:
        out += [f"<h2>{e(table.title)}</h2>", table.html()]
        if table.note:
            out.append(f'<p class="note">{e(table.note)}</p>')
    out.append("<h2>Figures</h2>")
    for spec, png in figures:
        if png is None:
            out.append(f'<h3>{e(spec.title)}</h3><p class="note">Skipped: {e(spec.missing)}.</p>')
        else:
            data = base64.b64encode(png).decode("ascii")
            out.append(
                f'<figure><figcaption>{e(spec.title)}</figcaption><img alt="{e(spec.title)}" '
                f'src="data:image/png;base64,{data}"></figure>'
            )
    config = _config_text(results)
    if config:
        out.append(f"<h2>Configuration</h2><details><summary>config</summary><pre>{e(config)}</pre></details>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
