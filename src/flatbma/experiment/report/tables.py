"""The tables of a comparison's report: results with intervals, paired differences, flatness, corruptions.

Over 500 lines on purpose: every table shares one layout (:class:`Table`, the cell text, the bold-best rule,
the one-seed titles, the empty-column rule) and each is a short function over it.

Input is the ``results.json`` dict of ``flatbma compare`` as read by :mod:`flatbma.experiment.report.rows`;
:func:`report_tables` and :func:`summary_table` lay out the tables, :mod:`flatbma.experiment.report.documents`
writes them. Paired differences are tabled against the reference and for each ``compare.pairs`` entry ``a − b``.
With one seed per method the cells are the runs' values and the titles say "one seed; no interval". The Brier
score sums over all classes (:data:`BRIER_NOTE`).
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flatbma import likelihood as likelihoods
from flatbma.experiment.report.findings import (
    Comparison,
    comparisons,
    detectable_text,
    difference_text,
    pair_comparisons,
    pairs_of,
    reference_of,
)
from flatbma.experiment.report.repeatability import repeatability_lines
from flatbma.experiment.report.rows import (
    COMPARED,
    CORRUPTION_METRICS,
    EXTRA_METRICS,
    FLATNESS_METRICS,
    LAMBDA1,
    LAMBDA1_MEAN,
    LEVEL,
    MISSING,
    RMSE,
    SUMMARY_METRICS,
    TEMPERATURE_METRICS,
    TRACE_COV,
    Metric,
    Run,
    as_number,
    by_method,
    corruption_average,
    decimals_for,
    diverged_lines,
    failed_runs,
    format_number,
    format_value,
    get_path,
    lambda1_median_interval,
    mean_of_present,
    read_runs,
    run_lambda1,
    run_lambda1_median,
    seed_counts,
    severities_of,
    spread_text,
    summary_cell,
    summary_of,
    width_field,
)
from flatbma.flatness.posterior import HEAVY_TAIL_FACTOR, repeatable
from flatbma.health import MARK, flagged_line, is_flagged
from flatbma.stats import POWER, Summary

__all__ = ["Table", "report_tables", "summary_table"]


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
    """Rows holding the best mean of a column (all of them when tied).

    None without a better end or a rival, and none unless every row with a value has two or more seeds:
    one run's value is no evidence that a method is best.
    """
    if any(s is not None and s.n < 2 for s in stats):
        return []
    means = {i: s.mean for i, s in enumerate(stats) if s is not None and math.isfinite(s.mean)}
    if metric.best is None or len(means) < 2:
        return []
    best = metric.best(means.values())
    return [i for i, m in means.items() if m == best]


def _cell(metric: Metric, runs: Sequence[Run], stats: Summary | None) -> str:
    """A cell of a metric table; a lone run's median λ₁ with its bootstrap interval over the run's samples."""
    text = summary_cell(stats)
    if metric is LAMBDA1 and stats is not None and stats.n == 1:
        (run,) = [r for r in runs if metric.get(r) is not None]
        interval = lambda1_median_interval(run)
        if interval is not None:
            decimals = decimals_for(stats.mean)
            text += f" [{format_number(interval.low, decimals)}, {format_number(interval.high, decimals)}]"
    return text


def _metric_table(title: str, groups: dict[str, list[Run]], metrics: Sequence[Metric], note: str) -> Table:
    stats = [[summary_of([m.get(r) for r in runs], m.bounds) for m in metrics] for runs in groups.values()]
    rows = [
        [method, str(len(runs)), *(_cell(m, runs, st) for m, st in zip(metrics, row))]
        for (method, runs), row in zip(groups.items(), stats)
    ]
    bold = {(i, j + 2) for j, m in enumerate(metrics) for i in _best_rows([row[j] for row in stats], m)}
    return Table(title, ["method", "seeds", *(m.label for m in metrics)], rows, note, frozenset(bold))


def _summary_metrics(runs: Sequence[Run]) -> tuple[Metric, ...]:
    """The predictive metrics, then the flatness ones some run has (λ₁ always with the width beside it)."""
    flat = [m for m in FLATNESS_METRICS if any(m.get(r) is not None for r in runs)]
    if (LAMBDA1 in flat or LAMBDA1_MEAN in flat) and TRACE_COV not in flat:
        flat.insert(flat.index(LAMBDA1_MEAN if LAMBDA1_MEAN in flat else LAMBDA1) + 1, TRACE_COV)
    recorded = next((r["likelihood"] for r in runs if isinstance(r, Mapping) and r.get("likelihood")), None)
    return (*SUMMARY_METRICS[likelihoods.recorded(recorded)], *flat)


BOUNDS_NOTE = (
    "Intervals of bounded metrics are clipped to their range (accuracy, ECE, AECE in [0, 1]; Brier in [0, 2]; "
    "NLL, tr Σ and times ≥ 0); λ₁, the top eigenvalue of a Hessian that can be indefinite, is never clipped."
)
"""How the report treats an interval that reaches past a metric's range."""


BRIER_NOTE = (
    "Brier: Σ_c (p_c − 1[y = c])² summed over all classes, in [0, 2] (on two classes twice scikit-learn's "
    "brier_score_loss, which scores the positive class only)."
)
"""The Brier column's caption: flatbma's convention (:func:`flatbma.metrics.brier`) against scikit-learn's."""


REGRESSION_NOTE = (
    "Regression (a Gaussian likelihood): NLL of the mixture predictive (1/M) Σ_m N(y; μ_m, σ_m²), in nats per "
    "example (a density's: it can be negative); RMSE and MAE of its mean; coverage α: the share of test targets "
    "inside its central α interval (α is ideal); calibration error: the mean |coverage − α| over α = 0.05 … 0.95; "
    "targets in standard deviations of the training targets."
)
"""The summary table's caption for a regression comparison (:data:`.rows.REGRESSION_METRICS`)."""


def _summary(groups: dict[str, list[Run]]) -> Table:
    runs = [r for rs in groups.values() for r in rs]
    metrics = _summary_metrics(runs)
    note = "BMA metrics on the test set."
    one_seed = seed_counts(groups)[1] == 1
    if one_seed:
        note += " One seed per method: each cell is that run's value, with no spread and no interval over seeds."
    else:
        note += f" Per method over its seeds: mean ± std [{LEVEL:.0%} Student t interval of the mean]."
    if RMSE in metrics:
        note += f" {REGRESSION_NOTE}"
    else:
        note += f" {BRIER_NOTE}"
    if LAMBDA1 in metrics or LAMBDA1_MEAN in metrics:
        note += (
            " λ₁: top Hessian eigenvalue of the training loss at a posterior sample; λ₁ median: the median over "
            "the run's samples"
            + (f" [its bootstrap {LEVEL:.0%} interval]" if one_seed else "")
            + ", what to read (one sharp sample can make the mean many times every other sample's λ₁); λ₁ mean: "
            "the mean over the run's samples, beside it (details in the flatness table); tr Σ: the posterior's "
            "width, read beside λ₁ (– : not measured)."
        )
    if not one_seed:
        note += f" {BOUNDS_NOTE}"
    fewest, most = seed_counts(groups)
    if most == 1:
        note += " No cell is marked best: with one seed there is no interval to tell a best from noise."
    else:
        classifier = "higher accuracy; lower NLL, ECE, AECE, Brier"
        ends = "lower NLL, RMSE, MAE, calibration error" if RMSE in metrics else classifier
        note += f" Bold: the best mean of a column with a better end ({ends})"
        note += "." if fewest >= 2 else ", only where every method with a value has two or more seeds."
    table = _metric_table(f"Results ({spread_text(groups)})", groups, metrics, note)
    flagged = {m: [r for r in runs if is_flagged(r.get("health"))] for m, runs in groups.items()}
    if not any(flagged.values()):
        return table
    rows = [[f"{row[0]} {MARK}" if flagged[row[0]] else row[0], *row[1:]] for row in table.rows]
    lines = tuple(flagged_line(m, r) for m, rs in flagged.items() for r in rs)
    note = f"{table.note} {MARK}: a method with a run flagged by the training-health rules (listed below)."
    return dataclasses.replace(table, rows=rows, note=note, lines=lines)


DIVERGED = "diverged"
"""What the summary table shows in place of the numbers of a method whose every seed diverged."""


def _with_diverged(table: Table, results: Mapping[str, Any]) -> Table:
    """The summary ``table`` with the failed rows said: a "diverged" row for a method with no seed left, a line each."""
    lines = diverged_lines(results)
    if not lines:
        return table
    shown = {row[0].removesuffix(f" {MARK}") for row in table.rows}
    gone = [m for m in by_method(failed_runs(results)) if m not in shown]
    rows = [*table.rows, *([m, *[DIVERGED] * (len(table.header) - 1)] for m in gone)]
    note = f"{table.note} Diverged seeds (listed below) are failed rows, left out of every mean."
    return dataclasses.replace(table, rows=rows, note=note, lines=(*lines, *table.lines))


def summary_table(results: Mapping[str, Any]) -> str:
    """The main table as Markdown: per method, accuracy … λ₁ and its width over seeds (bold: best)."""
    table = _with_diverged(_summary(by_method(read_runs(results))), results)
    return table.markdown() + "".join(f"\n- {line}" for line in diverged_lines(results))


def _difference_header(metrics: Sequence[Metric]) -> list[str]:
    """Per metric of a paired-difference table its column, then its detectable difference's."""
    return [label for m in metrics for label in (m.label, f"{m.label} detectable")]


def _difference_cells(found: Sequence[Comparison], metrics: Sequence[Metric], i: int, bold: set) -> list[str]:
    """Row ``i`` of a paired-difference table after its name: the seeds, then per metric ``mean [interval]``.

    Each metric's cell is followed by its detectable difference's (:func:`detectable_text`). ``found`` holds the
    row's comparisons; the cells whose interval excludes 0 are added to ``bold``.
    """
    mine = {c.metric.key: c for c in found}
    cells = []
    for j, metric in enumerate(metrics):
        c = mine.get(metric.key)
        if c is None:
            cells += [MISSING, MISSING]
        elif c.difference is None:
            cells += ["not compared", MISSING]
        else:
            shown = difference_text(c.difference) + ("" if c.claimed else " (one seed)")
            cells += [shown, detectable_text(c.difference)]
            if c.difference.significant:
                bold.add((i, 2 * j + 2))
    n = max((c.difference.n for c in mine.values() if c.difference is not None), default=0)
    return [str(n), *cells]


DETECTABLE_NOTE = (
    f"Detectable: the smallest true mean difference that a two-sided paired t test at {1 - LEVEL:.0%} detects "
    f"with {POWER:.0%} power over these seeds, from the paired differences' standard deviation s and number n "
    f"(the noncentral t; about (t_{{{(1 + LEVEL) / 2:g}, n−1}} + t_{{{POWER:g}, n−1}}) s/√n); a difference whose "
    "interval includes 0 rules out only differences larger than it."
)
"""The paired-difference tables' caption of their detectable columns (:func:`flatbma.stats.detectable_difference`)."""


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
        ["method", "seeds", *_difference_header(metrics)],
        rows,
        "Per seed the method's value minus the reference's (the same seed: the same k-shot training set and "
        "initialization), then the mean and Student t interval over the seeds both ran. Bold: the interval "
        f"excludes 0. λ₁ is compared only on seeds where both runs report their width (tr Σ). {DETECTABLE_NOTE}",
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
        ["pair", "seeds", *_difference_header(metrics)],
        rows,
        "compare.pairs: per seed a's value minus b's (the same seed: the same k-shot training set and "
        "initialization), then the mean and Student t interval over the seeds both ran; seeds only one of them "
        "ran are left out. Bold: the interval excludes 0. λ₁ is compared only on seeds where both runs report "
        f"their width (tr Σ). {DETECTABLE_NOTE}",
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


def _distinct(runs: Sequence[Run], key: str) -> list[str]:
    values = [run.get(key) for run in runs if run.get(key) is not None]
    return list(dict.fromkeys(v if isinstance(v, str) else json.dumps(v, sort_keys=True) for v in values))


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
        mean, median = run_lambda1(run), run_lambda1_median(run)
        low, high = as_number(get_path(summary, "interval", "low")), as_number(get_path(summary, "interval", "high"))
        decimals = decimals_for(mean) if mean is not None else 4
        around_median = lambda1_median_interval(run)
        median_decimals = decimals_for(median) if median is not None else 4
        samples = _count(summary.get("n")) or _count(run.get("flatness_samples"))
        unconverged = _count(run.get("lambda1_unconverged"))
        width = run.get("width") if isinstance(run.get("width"), Mapping) else {}
        trace = as_number(width.get("trace_cov"))
        rep = run.get("repeatability") if isinstance(run.get("repeatability"), Mapping) else {}
        agree = repeatable(rep)
        rows.append(
            [
                method,
                str(run.get("seed", MISSING)),
                format_value(median),
                MISSING
                if around_median is None
                else f"[{format_number(around_median.low, median_decimals)}, "
                f"{format_number(around_median.high, median_decimals)}]",
                format_value(mean),
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
                MISSING if agree is None else "yes" if agree else "no",
            ]
        )
    if any(isinstance(r.get("lambda1_summary"), Mapping) for _, r in runs):
        interval = f"{' and '.join(sorted(kinds)) or 'the'} {level} interval".replace("  ", " ")
        note = [
            "Per run: λ₁ of each posterior sample (top eigenvalue of the Hessian of the mean training loss), its "
            f"median with the bootstrap {LEVEL:.0%} interval of the median, and its mean with the {interval} of the "
            "mean over the run's samples; read the median (one sharp sample can make the mean many times every "
            "other sample's λ₁). Eigenvalues that did not converge are counted (unconverged), not averaged."
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
        "measurement (another measurement seed and samples) agrees within the interval of the mean, and the two "
        f"means, and the two medians, lie within a factor {HEAVY_TAIL_FACTOR:g} of each other (a heavy tail can make "
        "an interval wide enough to hold any repetition)."
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
    header = ["method", "seed", "λ₁ median", f"median's {LEVEL:.0%} interval", "λ₁ mean"]
    header += [f"mean's {level} interval".replace("  ", " "), "samples"]
    header += ["unconverged", "tr Σ", "median σ", "λ₁ at mean", "Hessian trace", "repeatable"]
    return Table(title, header, rows, " ".join(note), lines=tuple(repeatability_lines(groups)))


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
            row = [summary_of(per_run[s], metric.bounds) for s in severities]
            stats.append(row if len(severities) == 1 else [*row, summary_of(overall, metric.bounds)])
        rows = [[method, *map(summary_cell, row)] for method, row in zip(groups, stats)]
        columns = len(stats[0])
        bold = {(i, j + 1) for j in range(columns) for i in _best_rows([r[j] for r in stats], metric)}
        header = ["method", *(f"severity {s}" for s in severities)]  # one severity: its column is the average
        tables.append(
            Table(
                f"Corrupted test sets: {metric.label} (mean over corruptions; {spread_text(groups)})",
                header if len(severities) == 1 else [*header, "all severities"],
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
"""The OOD-detection table's columns (:mod:`flatbma.ood`)."""


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
    tables = [_with_diverged(_summary(groups), results)]
    for differences in (_differences_table(results, groups), _pairs_table(results, groups)):
        if differences is not None:
            tables.append(differences)
    flatness = _flatness_table(groups)
    if flatness is not None:
        tables.append(flatness)
    extra = [m for m in EXTRA_METRICS if any(m.get(r) is not None for r in runs)]  # no column of "–" only
    if extra:
        notes = {
            "distribution_lambda1": "λ₁ of the mean Hessian: top eigenvalue of the Hessian of E_q[L] (the averaged "
            "Hessian of the samples).",
            "sam_sharpness": "SAM sharpness: E_w[L(w + ρ g/‖g‖) − L(w)].",
        }
        tables.append(
            _metric_table(
                f"{'Flatness of the distribution and cost' if any(m.key in notes for m in extra) else 'Cost'} "
                f"({spread_text(groups)})",
                groups,
                extra,
                " ".join(notes[m.key] for m in extra if m.key in notes),
            )
        )
    for table in (_temperature_table(groups), _selection_table(groups)):
        if table is not None:
            tables.append(table)
    tables += _corruption_tables(runs, groups)
    ood = _ood_table(runs, groups)
    if ood is not None:
        tables.append(ood)
    return [_without_empty_columns(t) for t in tables]


def _without_empty_columns(table: Table, keep: tuple[str, ...] = (TRACE_COV.label,)) -> Table:
    """``table`` without the columns (after the first) in which every cell is "–" (bold cells renumbered).

    A column named in ``keep`` stays: the width tr Σ beside λ₁, whose "–" says that it was not measured.
    """
    kept = [0] + [
        j
        for j in range(1, len(table.header))
        if table.header[j] in keep or any(row[j] != MISSING for row in table.rows) or not table.rows
    ]
    if len(kept) == len(table.header):
        return table
    where = {j: k for k, j in enumerate(kept)}
    return dataclasses.replace(
        table,
        header=[table.header[j] for j in kept],
        rows=[[row[j] for j in kept] for row in table.rows],
        bold=frozenset((i, where[j]) for i, j in table.bold if j in where),
    )


def _temperature_table(groups: dict[str, list[Run]]) -> Table | None:
    """The temperature fitted on the validation split and the test metrics at it; ``None`` when no run has one."""
    if not any(TEMPERATURE_METRICS[1].get(r) is not None for rs in groups.values() for r in rs):
        return None
    note = (
        "Temperature scaling (Guo et al. 2017): T fitted to the BMA's validation NLL, then the test predictive "
        "softmax(log p / T); the results table above is at T = 1 (no scaling). "
        + ("" if seed_counts(groups)[1] == 1 else BOUNDS_NOTE)
    )
    return _metric_table(
        f"Temperature-scaled test metrics ({spread_text(groups)})", groups, TEMPERATURE_METRICS, note.strip()
    )


def _options_text(options: Any) -> str:
    """``rho=0.05, lr=0.01`` of a candidate's options (``–`` when it has none)."""
    if not isinstance(options, Mapping) or not options:
        return MISSING
    return ", ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in options.items())


def _selection_table(groups: dict[str, list[Run]]) -> Table | None:
    """Per (method, seed) with candidates: the one chosen on validation data and every candidate's score."""
    rows = []
    for method, runs in groups.items():
        for run in runs:
            chosen = get_path(run, "selection", "chosen")
            candidates = get_path(run, "selection", "candidates")
            if not isinstance(candidates, Sequence) or isinstance(candidates, str):
                continue
            scores = []
            for c in candidates:
                if not isinstance(c, Mapping):
                    continue
                score = as_number(c.get("val_nll"))
                value = format_value(score) if score is not None else "diverged" if c.get("error") else MISSING
                mark = " (chosen)" if c.get("options") == chosen else ""
                scores.append(f"{_options_text(c.get('options'))}: {value}{mark}")
            best = next((c for c in candidates if isinstance(c, Mapping) and c.get("options") == chosen), {})
            rows.append(
                [
                    method,
                    str(run.get("seed", MISSING)),
                    _options_text(chosen),
                    format_value(as_number(best.get("val_nll"))),
                    str(len(scores)),
                    "; ".join(scores) or MISSING,
                ]
            )
    if not rows:
        return None
    return Table(
        "Hyperparameters chosen on the validation split",
        ["method", "seed", "chosen", "validation NLL", "candidates", "every candidate's validation NLL"],
        rows,
        "Per (method, seed) the candidate with the lowest validation NLL (the BMA's NLL on the validation split) "
        "is the row measured on the test set; the others never see it. diverged: training failed, never chosen.",
    )


# --------------------------------------------------------------------------------------------------
# CSV
