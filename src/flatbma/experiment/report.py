"""Reports of a comparison: tables with intervals, paired differences, generated findings, figures, CSV, Markdown, HTML.

Input is the ``results.json`` dict written by ``flatbma compare``, read by
:mod:`flatbma.experiment.rows` (its runs, the metrics, their statistics and numbers); the methods
are compared and the findings written by :mod:`flatbma.experiment.findings`, the figures drawn by
:mod:`flatbma.experiment.figures`. This module lays out the tables and writes the documents.

:func:`write_reports` writes, into one folder, ``results.csv`` (one row per run, flat columns),
``figures/*.png``, ``report.md`` (findings, tables, and the figures by relative path) and
``report.html``, which is self-contained: its figures are embedded as base64 PNG data URIs. The paired
differences are tabled against the reference and, with ``compare.pairs``, for each listed pair ``a − b``
("Paired differences", :func:`flatbma.experiment.findings.pair_comparisons`). In every
table the best mean of a column with a better end (higher accuracy; lower NLL, ECE, AECE, Brier) is
bold. With one seed per method the cells are the runs' values and the titles say "one seed; no
interval". The Brier score sums over all classes (:data:`BRIER_NOTE`). Figures need matplotlib
(``pip install flatbma[plots]``).
"""

from __future__ import annotations

import base64
import csv
import dataclasses
import html
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from flatbma.experiment.checkpoint import atomic_write_bytes, write_error
from flatbma.experiment.figures import FIGURES, FigureSpec
from flatbma.experiment.findings import (
    Comparison,
    comparisons,
    difference_text,
    findings,
    pair_comparisons,
    pairs_of,
    reference_of,
)
from flatbma.experiment.health import MARK, flagged_line, is_flagged
from flatbma.experiment.rows import (
    COMPARED,
    CORRUPTION_METRICS,
    EXTRA_METRICS,
    FLATNESS_METRICS,
    LAMBDA1,
    LEVEL,
    MISSING,
    PREDICTIVE_METRICS,
    TRACE_COV,
    Metric,
    Run,
    as_number,
    by_method,
    corruption_average,
    decimals_for,
    format_number,
    format_value,
    get_path,
    mean_of_present,
    read_runs,
    run_lambda1,
    seed_counts,
    severities_of,
    spread_text,
    summary_cell,
    summary_of,
    width_field,
)
from flatbma.stats import Summary

__all__ = [
    "Table",
    "csv_rows",
    "report_tables",
    "summary_table",
    "write_reports",
]


# --------------------------------------------------------------------------------------------------
# tables


@dataclass(frozen=True)
class Table:
    """A table of strings, rendered to Markdown or HTML.

    Attributes:
        title: its heading.
        header: column names.
        rows: cells, row by row.
        note: a caption under it.
        bold: ``(row, column)`` of the cells shown bold (e.g. the best of a column).
        lines: lines listed under it (e.g. the measurement repeatability of each method).
    """

    title: str
    header: list[str]
    rows: list[list[str]]
    note: str = ""
    bold: frozenset[tuple[int, int]] = frozenset()
    lines: tuple[str, ...] = ()

    def markdown(self) -> str:
        """GitHub-flavoured Markdown (``|`` in cells escaped, bold cells in ``**``)."""

        def line(cells: Sequence[str], i: int = -1) -> str:
            shown = [f"**{c}**" if (i, j) in self.bold else c for j, c in enumerate(cells)]
            return "| " + " | ".join(c.replace("|", "\\|") for c in shown) + " |"

        lines = [line(self.header), "|" + "|".join(["---"] + [":-:"] * (len(self.header) - 1)) + "|"]
        return "\n".join(lines + [line(r, i) for i, r in enumerate(self.rows)])

    def html(self) -> str:
        """An HTML ``<table>`` with escaped cells (bold cells in ``<b>``)."""

        def cell(text: str, bold: bool) -> str:
            return f"<td><b>{html.escape(text)}</b></td>" if bold else f"<td>{html.escape(text)}</td>"

        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.header)
        body = "".join(
            "<tr>" + "".join(cell(c, (i, j) in self.bold) for j, c in enumerate(r)) + "</tr>"
            for i, r in enumerate(self.rows)
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _best_rows(stats: Sequence[Summary | None], metric: Metric) -> list[int]:
    """Rows holding the best mean of a column (all of them when tied); none without a better end or rival."""
    means = {i: s.mean for i, s in enumerate(stats) if s is not None and math.isfinite(s.mean)}
    if metric.best is None or len(means) < 2:
        return []
    best = metric.best(means.values())
    return [i for i, m in means.items() if m == best]


def _metric_table(title: str, groups: dict[str, list[Run]], metrics: Sequence[Metric], note: str) -> Table:
    stats = [[summary_of([m.get(r) for r in runs]) for m in metrics] for runs in groups.values()]
    rows = [[method, str(len(runs)), *map(summary_cell, row)] for (method, runs), row in zip(groups.items(), stats)]
    bold = {(i, j + 2) for j, m in enumerate(metrics) for i in _best_rows([row[j] for row in stats], m)}
    return Table(title, ["method", "seeds", *(m.label for m in metrics)], rows, note, frozenset(bold))


def _summary_metrics(runs: Sequence[Run]) -> tuple[Metric, ...]:
    """The predictive metrics, then the flatness ones some run has (λ₁ always with the width beside it)."""
    flat = [m for m in FLATNESS_METRICS if any(m.get(r) is not None for r in runs)]
    if LAMBDA1 in flat and TRACE_COV not in flat:
        flat.insert(1, TRACE_COV)
    return (*PREDICTIVE_METRICS, *flat)


BRIER_NOTE = (
    "Brier: Σ_c (p_c − 1[y = c])² summed over all classes, in [0, 2] (on two classes twice scikit-learn's "
    "brier_score_loss, which scores the positive class only)."
)
"""The Brier column's caption: flatbma's convention (:func:`flatbma.metrics.brier`) against scikit-learn's."""


def _summary(groups: dict[str, list[Run]]) -> Table:
    runs = [r for rs in groups.values() for r in rs]
    metrics = _summary_metrics(runs)
    note = "BMA metrics on the test set."
    one_seed = seed_counts(groups)[1] == 1
    if one_seed:
        note += " One seed per method: each cell is that run's value, with no spread and no interval."
    else:
        note += f" Per method over its seeds: mean ± std [{LEVEL:.0%} Student t interval of the mean]."
    note += f" {BRIER_NOTE}"
    if LAMBDA1 in metrics:
        note += (
            " λ₁: top Hessian eigenvalue of the training loss at a posterior sample, mean over the run's samples "
            "(details in the flatness table); tr Σ: the posterior's width, read beside λ₁ (– : not measured)."
        )
    best = "value" if one_seed else "mean"
    note += f" Bold: the best {best} of a column with a better end (higher accuracy; lower NLL, ECE, AECE, Brier)."
    table = _metric_table(f"Results ({spread_text(groups)})", groups, metrics, note)
    flagged = {m: [r for r in runs if is_flagged(r.get("health"))] for m, runs in groups.items()}
    if not any(flagged.values()):
        return table
    rows = [[f"{row[0]} {MARK}" if flagged[row[0]] else row[0], *row[1:]] for row in table.rows]
    lines = tuple(flagged_line(m, r) for m, rs in flagged.items() for r in rs)
    note = f"{table.note} {MARK}: a method with a run flagged by the training-health rules (listed below)."
    return dataclasses.replace(table, rows=rows, note=note, lines=lines)


def summary_table(results: Mapping[str, Any]) -> str:
    """The main table as Markdown: per method, accuracy … λ₁ and its width over seeds (bold: best)."""
    return _summary(by_method(read_runs(results))).markdown()


def _difference_cells(found: Sequence[Comparison], metrics: Sequence[Metric], i: int, bold: set) -> list[str]:
    """Row ``i`` of a paired-difference table after its name: the seeds, then per metric ``mean [interval]``.

    ``found`` holds the row's comparisons; the cells whose interval excludes 0 are added to ``bold``.
    """
    mine = {c.metric.key: c for c in found}
    cells = []
    for j, metric in enumerate(metrics):
        c = mine.get(metric.key)
        if c is None:
            cells.append(MISSING)
        elif c.difference is None:
            cells.append("not compared")
        else:
            cells.append(difference_text(c.difference) + ("" if c.claimed else " (one seed)"))
            if c.difference.significant:
                bold.add((i, j + 2))
    n = max((c.difference.n for c in mine.values() if c.difference is not None), default=0)
    return [str(n), *cells]


def _differences_table(results: Mapping[str, Any], groups: dict[str, list[Run]]) -> Table | None:
    """Every method − the reference per metric, with intervals; ``None`` when no pair of two seeds exists."""
    found = comparisons(results)
    if not any(c.claimed for c in found):
        return None
    reference = reference_of(results, groups)
    metrics = [m for m in COMPARED if any(c.metric is m for c in found)]
    rows: list[list[str]] = []
    bold: set[tuple[int, int]] = set()
    for method in groups:
        mine = [c for c in found if c.method == method]
        if mine:
            rows.append([method, *_difference_cells(mine, metrics, len(rows), bold)])
    return Table(
        f"Paired differences from {reference} (method − {reference}: mean [{LEVEL:.0%} t interval] over common seeds)",
        ["method", "seeds", *(m.label for m in metrics)],
        rows,
        "Per seed the method's value minus the reference's (the same seed: the same k-shot training set and "
        "initialization), then the mean and Student t interval over the seeds both ran. Bold: the interval "
        "excludes 0. λ₁ is compared only on seeds where both runs report their width (tr Σ).",
        frozenset(bold),
    )


def _pairs_table(results: Mapping[str, Any], groups: dict[str, list[Run]]) -> Table | None:
    """Every pair ``a − b`` of ``compare.pairs`` per metric, with intervals; ``None`` when none has two seeds."""
    found = pair_comparisons(results)
    if not any(c.claimed for c in found):
        return None
    metrics = [m for m in COMPARED if any(c.metric is m for c in found)]
    rows: list[list[str]] = []
    bold: set[tuple[int, int]] = set()
    for a, b in pairs_of(results, groups):
        mine = [c for c in found if (c.method, c.reference) == (a, b)]
        if mine:
            rows.append([f"{a} − {b}", *_difference_cells(mine, metrics, len(rows), bold)])
    return Table(
        f"Paired differences (each listed pair a − b: mean [{LEVEL:.0%} t interval] over common seeds)",
        ["pair", "seeds", *(m.label for m in metrics)],
        rows,
        "compare.pairs: per seed a's value minus b's (the same seed: the same k-shot training set and "
        "initialization), then the mean and Student t interval over the seeds both ran; seeds only one of them "
        "ran are left out. Bold: the interval excludes 0. λ₁ is compared only on seeds where both runs report "
        "their width (tr Σ).",
        frozenset(bold),
    )


def _count(value: Any) -> int | None:
    """A count given as a number or as the list of the items counted."""
    if isinstance(value, (list, tuple)):
        return len(value)
    number = as_number(value)
    return int(number) if number is not None else None


def _scalar(value: Any) -> float | None:
    """A number, or the ``mean``/``estimate``/``value`` of a dict holding one."""
    if isinstance(value, Mapping):
        return next(
            (as_number(value[k]) for k in ("mean", "estimate", "value") if as_number(value.get(k)) is not None), None
        )
    return as_number(value)


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


def _distinct(runs: Sequence[Run], key: str) -> list[str]:
    values = [run.get(key) for run in runs if run.get(key) is not None]
    return list(dict.fromkeys(v if isinstance(v, str) else json.dumps(v, sort_keys=True) for v in values))


def _repeatability_lines(groups: dict[str, list[Run]]) -> list[str]:
    """One "measurement repeatability" line per method that repeated its measurement."""
    lines = []
    for method, runs in groups.items():
        reps = [(r.get("seed"), r["repeatability"]) for r in runs if isinstance(r.get("repeatability"), Mapping)]
        if not reps:
            continue
        agree = sum(rep.get("agree") is True for _, rep in reps)
        head = (
            ("agrees" if agree else "does not agree") if len(reps) == 1 else f"agrees on {agree} of {len(reps)} seeds"
        )
        details = "; ".join(
            f"seed {seed}: {_summary_text(rep.get('first'))} vs {_summary_text(rep.get('second'))}"
            for seed, rep in reps
        )
        lines.append(
            f"measurement repeatability, {method}: {head} within the reported interval "
            f"(λ₁ measured, then measured again with another measurement seed and samples — {details})"
        )
    return lines


def _has_flatness(run: Run) -> bool:
    return run_lambda1(run) is not None or isinstance(run.get("lambda1_summary"), Mapping)


def _flatness_table(groups: dict[str, list[Run]]) -> Table | None:
    """Per run: λ₁ over the posterior samples with its interval, convergence, the width beside it, λ₁ at the mean."""
    runs = [(m, r) for m, rs in groups.items() for r in rs if _has_flatness(r)]
    if not runs:
        return None
    levels = {as_number(get_path(r, "lambda1_summary", "interval", "level")) for _, r in runs} - {None}
    kinds = {str(get_path(r, "lambda1_summary", "method")) for _, r in runs if get_path(r, "lambda1_summary", "method")}
    level = f"{levels.pop():.0%}" if len(levels) == 1 else ""
    rows = []
    for method, run in runs:
        summary = run.get("lambda1_summary") if isinstance(run.get("lambda1_summary"), Mapping) else {}
        mean = run_lambda1(run)
        low, high = as_number(get_path(summary, "interval", "low")), as_number(get_path(summary, "interval", "high"))
        decimals = decimals_for(mean) if mean is not None else 4
        samples = _count(summary.get("n")) or _count(run.get("flatness_samples"))
        unconverged = _count(run.get("lambda1_unconverged"))
        width = run.get("width") if isinstance(run.get("width"), Mapping) else {}
        trace = as_number(width.get("trace_cov"))
        agree = get_path(run, "repeatability", "agree")
        rows.append(
            [
                method,
                str(run.get("seed", MISSING)),
                format_value(mean),
                format_value(as_number(summary.get("median"))),
                MISSING
                if low is None or high is None
                else f"[{format_number(low, decimals)}, {format_number(high, decimals)}]",
                MISSING if samples is None else str(samples),
                (
                    str(unconverged)
                    if unconverged is not None
                    else "some"
                    if run.get("hessian_converged") is False
                    else MISSING
                ),
                MISSING if trace is None else ("≈" if width.get("exact") is False else "") + format_value(trace),
                format_value(as_number(width.get("median_std"))),
                format_value(as_number(run.get("lambda1_at_mean"))),
                format_value(_scalar(run.get("hessian_trace"))),
                MISSING if not isinstance(agree, bool) else "yes" if agree else "no",
            ]
        )
    if any(isinstance(r.get("lambda1_summary"), Mapping) for _, r in runs):
        interval = f"{' and '.join(sorted(kinds)) or 'the'} {level} interval".replace("  ", " ")
        note = [
            "Per run: λ₁ of each posterior sample (top eigenvalue of the Hessian of the mean training loss), its "
            f"mean, median and {interval} of the mean over the run's samples; eigenvalues that did not converge "
            "are counted (unconverged), not averaged."
        ]
    else:
        note = [
            "Per run: λ₁ of each posterior sample (top eigenvalue of the Hessian of the mean training loss), mean over "
            "the run's samples. These results predate the flatness protocol: no median or interval, and "
            "eigenvalues that did not converge (unconverged: some) are averaged in."
        ]
    examples, bn = _distinct([r for _, r in runs], "hessian_examples"), _distinct([r for _, r in runs], "bn_statistics")
    if examples:
        note.append(f"Hessian on {' or '.join(examples)} training examples.")
    if bn:
        note.append(f"BatchNorm statistics: {'; '.join(bn)}.")
    note.append(
        "tr Σ and median σ: the posterior's width over the Bayesian subset (exact for Gaussians; ≈: estimated from "
        "samples); λ₁ at mean: λ₁ at the posterior mean; Hessian trace: Hutchinson's estimate; repeatable: a second "
        "measurement (another measurement seed and samples) agrees within the interval."
    )
    if all(width_field("trace_cov")(r) is None for _, r in runs):
        note.append(
            "No run reports its width: these λ₁ are not compared between methods (a wider posterior puts samples in "
            "sharper places whatever its flatness)."
        )
    title = "Flatness per run" + (
        " (one protocol for every method)"
        if any(isinstance(r.get("lambda1_summary"), Mapping) for _, r in runs)
        else ""
    )
    header = ["method", "seed", "λ₁ mean", "λ₁ median", f"λ₁ {level} interval".replace("  ", " "), "samples"]
    header += ["unconverged", "tr Σ", "median σ", "λ₁ at mean", "Hessian trace", "repeatable"]
    return Table(title, header, rows, " ".join(note), lines=tuple(_repeatability_lines(groups)))


def _corruption_note(sizes: list[float]) -> str:
    """The caption of the corruption tables: how many posterior samples the BMA on corrupted data used."""
    if not sizes:
        return ""
    if len(sizes) == 1:
        return f"BMA of the first {sizes[0]:g} posterior samples."
    fewer = ", ".join(f"{n:g}" for n in sizes[:-1])
    return f"BMA of the first {sizes[-1]:g} posterior samples ({fewer} for methods that have fewer)."


def _corruption_tables(runs: Sequence[Run], groups: dict[str, list[Run]]) -> list[Table]:
    severities = severities_of(runs)
    if not severities:
        return []
    sizes = sorted({n for r in runs if (n := as_number(r.get("corruption_samples"))) is not None})
    note = _corruption_note(sizes)
    tables = []
    for metric in CORRUPTION_METRICS:
        stats = []
        for rs in groups.values():
            per_run = {s: [corruption_average(r, s, metric.key) for r in rs] for s in severities}
            overall = [mean_of_present([per_run[s][i] for s in severities]) for i in range(len(rs))]
            stats.append([*(summary_of(per_run[s]) for s in severities), summary_of(overall)])
        rows = [[method, *map(summary_cell, row)] for method, row in zip(groups, stats)]
        bold = {(i, j + 1) for j in range(len(severities) + 1) for i in _best_rows([r[j] for r in stats], metric)}
        tables.append(
            Table(
                f"Corrupted test sets: {metric.label} (mean over corruptions; {spread_text(groups)})",
                ["method", *(f"severity {s}" for s in severities), "all severities"],
                rows,
                note,
                frozenset(bold),
            )
        )
    return tables


def _ood_getter(key: str) -> Any:
    return lambda run: as_number(get_path(run, "ood", key))


OOD_METRICS = (
    Metric("ood_auroc_entropy", "AUROC of entropy", _ood_getter("auroc_entropy"), lower="worse", higher="better"),
    Metric(
        "ood_auroc_mi",
        "AUROC of mutual information",
        _ood_getter("auroc_mutual_information"),
        lower="worse",
        higher="better",
    ),
    Metric("ood_entropy_in", "entropy, test", _ood_getter("entropy_in")),
    Metric("ood_entropy_out", "entropy, OOD", _ood_getter("entropy_out")),
    Metric("ood_mi_in", "mutual information, test", _ood_getter("mutual_information_in")),
    Metric("ood_mi_out", "mutual information, OOD", _ood_getter("mutual_information_out")),
)
"""The OOD-detection table's columns (:mod:`flatbma.experiment.ood`)."""


def _ood_table(runs: Sequence[Run], groups: dict[str, list[Run]]) -> Table | None:
    """OOD detection by the BMA's predictive entropy and mutual information, when the runs measured it."""
    sets = sorted({str(get_path(r, "ood", "set")) for r in runs if isinstance(r.get("ood"), Mapping)})
    if not sets:
        return None
    note = (
        "AUROC of telling the OOD set from the test set by the score (OOD positive; 0.5 is chance): the BMA's "
        "predictive entropy H[p̄] (total uncertainty) and its mutual information H[p̄] − E_w H[p_w] (epistemic "
        "part; 0 for a point estimate, – for the probit predictive). Mean scores in nats."
    )
    return _metric_table(
        f"Out-of-distribution detection: test set against {', '.join(sets)} ({spread_text(groups)})",
        groups,
        OOD_METRICS,
        note,
    )


def report_tables(results: Mapping[str, Any]) -> list[Table]:
    """Every table of the report: results, paired differences, flatness, distribution flatness and cost, corruptions."""
    runs = read_runs(results)
    groups = by_method(runs)
    tables = [_summary(groups)]
    for differences in (_differences_table(results, groups), _pairs_table(results, groups)):
        if differences is not None:
            tables.append(differences)
    flatness = _flatness_table(groups)
    if flatness is not None:
        tables.append(flatness)
    if any(m.get(r) is not None for r in runs for m in EXTRA_METRICS):
        tables.append(
            _metric_table(
                f"Flatness of the distribution and cost ({spread_text(groups)})",
                groups,
                EXTRA_METRICS,
                "λ₁ of the mean Hessian: top eigenvalue of the Hessian of E_q[L] (the averaged Hessian of the "
                "samples); SAM sharpness: E_w[L(w + ρ g/‖g‖) − L(w)].",
            )
        )
    ood = _ood_table(runs, groups)
    return tables + _corruption_tables(runs, groups) + ([ood] if ood is not None else [])


# --------------------------------------------------------------------------------------------------
# CSV


_STRUCTURED = ("bma_curve", "reliability", "corruptions", "landscape")


def csv_rows(results: Mapping[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """``(columns, rows)``: one flat row per run.

    Scalars keep their key; dicts are flattened with dotted keys (``method_options.rank``,
    ``lambda1_summary.interval.low``) and lists are written as JSON; the BMA
    curve becomes ``bma_<metric>_m<M>``, corruptions ``corr_<name>_s<severity>_<metric>``. The
    reliability diagram and the landscape curve are left out (see ``results.json``). Columns are
    the union over runs in order of appearance; a run without a column leaves it empty.
    """
    rows = [_flat_run(run) for run in read_runs(results)]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return columns, rows


def _flat_run(run: Run) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in run.items():
        if key in _STRUCTURED:
            continue
        _flatten(str(key), value, out)
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


def _flatten(key: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for sub, v in value.items():
            _flatten(f"{key}.{sub}", v, out)
    else:
        out[key] = value if _is_scalar(value) else json.dumps(value)


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
# documents


def write_reports(results: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``results.csv``, ``figures/<name>.png``, ``report.md`` and a self-contained ``report.html``.

    The findings are generated anew from ``results`` (:func:`findings`), never copied from it.

    Args:
        results: the ``results.json`` dict (see the module docstring).
        out_dir: the folder to write into (created if missing). A figure that is skipped for lack
            of data has its stale PNG from an earlier report removed.

    Returns:
        The written files by path relative to ``out_dir`` (``"results.csv"``, ``"report.md"``,
        ``"report.html"``, ``"figures/<name>.png"``).

    Raises:
        FlatbmaError: if ``results`` has no runs or an unknown ``compare.reference``, or matplotlib is missing.
    """
    out_dir = Path(out_dir)
    tables = report_tables(results)
    found = findings(results)
    figures: list[tuple[FigureSpec, bytes | None]] = [(spec, spec.draw(results)) for spec in FIGURES]
    written: dict[str, Path] = {}

    def put(rel: str, data: bytes) -> None:
        path = out_dir / rel
        atomic_write_bytes(path, data)  # creates its folder; a failed write is one FlatbmaError line
        written[rel] = path

    put("results.csv", _csv_text(results).encode())
    for spec, png in figures:
        rel = f"figures/{spec.name}.png"
        if png is not None:
            put(rel, png)
        else:
            try:
                (out_dir / rel).unlink(missing_ok=True)
            except OSError as e:
                raise write_error(out_dir / rel, e) from None
    put("report.md", _markdown(results, found, tables, figures).encode())
    put("report.html", _html(results, found, tables, figures).encode())
    return written


def _header_lines(results: Mapping[str, Any]) -> list[tuple[str, str]]:
    runs = read_runs(results)
    groups = by_method(runs)
    seeds = sorted({str(r.get("seed")) for r in runs if r.get("seed") is not None}, key=lambda s: (len(s), s))
    lines = [
        ("config hash", str(results.get("config_hash") or MISSING)),
        ("created", str(results.get("created") or MISSING)),
        ("runs", f"{len(runs)} ({len(groups)} methods: {', '.join(groups)}; seeds: {', '.join(seeds) or MISSING})"),
        ("reference", reference_of(results, groups)),
    ]
    pairs = pairs_of(results, groups)
    if pairs:
        lines.append(("pairs", ", ".join(f"{a} − {b}" for a, b in pairs)))
    return lines


_FINDINGS_NOTE = (
    "Generated from the paired differences over seeds (method − reference, Student t interval at {level:.0%}); "
    "a difference whose interval includes 0 is written as no significant difference. λ₁ has no better end "
    "(lower: flatter) and is compared only with the width tr Σ beside it (lower: narrower)."
)
_ONE_SEED_FINDINGS_NOTE = (
    "One seed; no interval: a difference between methods is claimed only from paired differences over two or "
    "more seeds (Student t interval at {level:.0%})."
)


def _findings_note(results: Mapping[str, Any], level: float) -> str:
    """The caption of the findings: how they are made, or (one seed) why there are none."""
    groups = by_method(read_runs(results))
    if seed_counts(groups)[1] == 1:
        return _ONE_SEED_FINDINGS_NOTE.format(level=level)
    note = _FINDINGS_NOTE.format(level=level)
    if pairs_of(results, groups):
        note = note.replace("(method − reference,", "(method − reference, and a − b for each pair of compare.pairs;")
    return note


def _config_text(results: Mapping[str, Any]) -> str:
    shown = {k: results[k] for k in ("config", "compare") if results.get(k)}
    return yaml.safe_dump(shown, sort_keys=False, allow_unicode=True) if shown else ""


def _markdown(
    results: Mapping[str, Any],
    found: Mapping[str, Any],
    tables: list[Table],
    figures: list[tuple[FigureSpec, bytes | None]],
) -> str:
    out = ["# flatbma comparison", ""]
    out += [f"- **{k}**: {v}" for k, v in _header_lines(results)]
    out += ["", "## Findings", "", *(f"- {line}" for line in found["text"])]
    out += ["", f"_{_findings_note(results, found['level'])}_"]
    for table in tables:
        out += ["", f"## {table.title}", "", table.markdown()]
        if table.note:
            out += ["", f"_{table.note}_"]
        if table.lines:
            out += ["", *(f"- {line}" for line in table.lines)]
    out += ["", "## Figures"]
    for spec, png in figures:
        caption = spec.caption(results)
        out += ["", f"### {caption}", ""]
        out.append(f"![{caption}](figures/{spec.name}.png)" if png is not None else f"_Skipped: {spec.missing}._")
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


def _html(
    results: Mapping[str, Any],
    found: Mapping[str, Any],
    tables: list[Table],
    figures: list[tuple[FigureSpec, bytes | None]],
) -> str:
    e = html.escape
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>flatbma comparison</title>',
        f"<style>{_CSS}</style></head><body>",
        "<h1>flatbma comparison</h1><ul>",
        *(f"<li><b>{e(k)}</b>: {e(v)}</li>" for k, v in _header_lines(results)),
        "</ul>",
        "<h2>Findings</h2><ul>",
        *(f"<li>{e(line)}</li>" for line in found["text"]),
        f'</ul><p class="note">{e(_findings_note(results, found["level"]))}</p>',
    ]
    for table in tables:
        out += [f"<h2>{e(table.title)}</h2>", table.html()]
        if table.note:
            out.append(f'<p class="note">{e(table.note)}</p>')
        if table.lines:
            out.append("<ul>" + "".join(f"<li>{e(line)}</li>" for line in table.lines) + "</ul>")
    out.append("<h2>Figures</h2>")
    for spec, png in figures:
        caption = spec.caption(results)
        if png is None:
            out.append(f'<h3>{e(caption)}</h3><p class="note">Skipped: {e(spec.missing)}.</p>')
        else:
            data = base64.b64encode(png).decode("ascii")
            out.append(
                f'<figure><figcaption>{e(caption)}</figcaption><img alt="{e(caption)}" '
                f'src="data:image/png;base64,{data}"></figure>'
            )
    config = _config_text(results)
    if config:
        out.append(f"<h2>Configuration</h2><details><summary>config</summary><pre>{e(config)}</pre></details>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
