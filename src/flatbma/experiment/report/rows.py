"""The rows of a comparison's results: its runs, the metrics read from them, their statistics and numbers.

Input is the ``results.json`` dict written by ``flatbma compare``::

    {"config_hash": str, "config": {...}, "compare": {..., "reference": str | null, "pairs": [[a, b], ...]},
     "created": str,
     "runs": [{"method": str, "seed": int, "run_dir": str,
               "accuracy", "nll", "ece", "aece", "brier": float,
               "lambda1", "lambda1_std", "lambda1_over_lambda5", "distribution_lambda1",
               "lambda1_summary": {"n", "mean", "std", "median", "interval": {"low", "high", "level"}, "method"},
               "lambda1_at_mean", "hessian_trace": float, "lambda1_unconverged": int | list,
               "hessian_examples": int, "bn_statistics": str,
               "width": {"trace_cov", "median_std": float, "exact": bool},
               "repeatability": {"agree": bool, "first": {summary}, "second": {summary}},
               "sam_sharpness": float | null, "train_time_s", "eval_time_s": float,
               "bma_curve": {"num_samples": [...], "accuracy": [...], "nll": [...], "ece": [...]},
               "reliability": {"bin_edges": [n+1], "count": [n], "confidence": [n], "accuracy": [n]},
               "corruptions": {name: {severity: {"accuracy", "nll", "ece"}}},
               "landscape": {"alphas": [...], "mean": [...], "std": [...]} | null,
               "diagnostics": {"prior_precision", "log_evidence", "effective_params": float} (Laplace only)}, ...]}

A row whose training diverged (a *failed row*) has only ``{"method", "method_options", "optim", "prior",
"seed", "run_dir", "error": str}``: :func:`read_runs` leaves it out of every mean, interval, figure and paired
difference, and :func:`diverged_lines` names the seeds that diverged. Any field may be missing or null: tables
then show "–" and a figure without data is skipped with a note.

Per method and metric, over the seeds whose run has the value: the mean ± sample std and Student's t interval
(95%), clipped to the metric's range (:attr:`Metric.bounds`); with one seed, the value alone (docs/methods.md §9).
A run's λ₁ is the median over its posterior samples (:data:`LAMBDA1`); the Brier score sums over all classes, so
on a binary problem it is twice scikit-learn's ``brier_score_loss`` (docs/methods.md §7).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flatbma.checks import is_number
from flatbma.errors import FlatbmaError
from flatbma.likelihood import Likelihood
from flatbma.metric_names import NAMES, Group, name, test_keys
from flatbma.stats import LEVEL as STATS_LEVEL
from flatbma.stats import Interval, Method, Summary, median_interval, summarize

__all__ = [
    "COMPARED",
    "LEVEL",
    "MISSING",
    "Metric",
    "Run",
    "as_number",
    "by_method",
    "clipped",
    "corruption_average",
    "decimals_for",
    "diverged_lines",
    "failed_runs",
    "format_number",
    "format_value",
    "get_path",
    "lambda1_median_interval",
    "lambda1_values",
    "mean_of_present",
    "read_runs",
    "run_lambda1",
    "run_lambda1_median",
    "seed_counts",
    "severities_of",
    "spread_text",
    "summary_cell",
    "summary_of",
    "to_number",
    "width_field",
]


MISSING = "–"
"""What a table shows for a value no run has."""

LEVEL = STATS_LEVEL
"""Confidence level of every interval of the report (:data:`flatbma.stats.LEVEL`, 0.95)."""

ONE_SEED = "one seed; no interval"
"""What the cells of a comparison with one seed per method hold: each run's value, no spread, no interval."""

Run = Mapping[str, Any]


# --------------------------------------------------------------------------------------------------
# reading the results


def read_runs(results: Mapping[str, Any]) -> list[Run]:
    """The runs with numbers of a ``results.json`` dict, each checked to be a dict with a ``method`` name.

    Raises:
        FlatbmaError: if ``results`` is not a dict, has no runs, or a run has no method name, or every run failed.
    """
    runs = _all_runs(results)
    measured = [run for run in runs if not _failed(run)]
    if not measured:
        raise FlatbmaError(
            f"every run of results diverged ({runs[0]['method']} seed {runs[0].get('seed')}: {runs[0]['error']}): "
            "there is nothing to report; lower the learning rate (or the method's step) and compare again"
        )
    return measured


def failed_runs(results: Mapping[str, Any]) -> list[Run]:
    """The failed rows of a ``results.json`` dict: those with an ``error`` (their training diverged)."""
    return [run for run in _all_runs(results) if _failed(run)]


def _failed(run: Run) -> bool:
    return isinstance(run.get("error"), str)


def diverged_lines(results: Mapping[str, Any]) -> list[str]:
    """One line per method with failed rows: how many of its seeds diverged, which, and why (the first error)."""
    runs = _all_runs(results)
    lines = []
    for method, failed in by_method([r for r in runs if _failed(r)]).items():
        total = sum(1 for r in runs if r["method"] == method)
        seeds = ", ".join(str(r.get("seed")) for r in failed)
        lines.append(
            f"{method}: {len(failed)} of {total} seed{'s' if total != 1 else ''} diverged (seed "
            f"{seeds}; left out of every mean and paired difference): {failed[0]['error']}"
        )
    return lines


def _all_runs(results: Mapping[str, Any]) -> list[Run]:
    """Every row of a ``results.json`` dict, failed ones included, each checked to be a dict with a ``method``."""
    if not isinstance(results, Mapping):
        raise FlatbmaError(f"results must be a dict as written to results.json, not {type(results).__name__}")
    runs = results.get("runs")
    if not isinstance(runs, Sequence) or isinstance(runs, str) or not runs:
        raise FlatbmaError("results has no runs: run `flatbma compare` first (results.json needs a non-empty 'runs')")
    for i, run in enumerate(runs):
        if not isinstance(run, Mapping) or not isinstance(run.get("method"), str):
            raise FlatbmaError(f"results['runs'][{i}] must be a dict with a 'method' name")
    return list(runs)


def by_method(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Runs grouped by method, methods in order of appearance, runs sorted by seed."""
    out: dict[str, list[Run]] = {}
    for run in runs:
        out.setdefault(run["method"], []).append(run)
    return {
        m: sorted(rs, key=lambda r: (as_number(r.get("seed")) is None, as_number(r.get("seed")) or 0.0))
        for m, rs in out.items()
    }


def as_number(value: Any) -> float | None:
    """A number, or ``None`` for null, missing and non-numeric values."""
    if not is_number(value):
        return None
    return float(value)


def get_path(mapping: Any, *keys: Any) -> Any:
    """``mapping[k1][k2]…`` or ``None`` where a level is missing or not a dict."""
    for k in keys:
        if not isinstance(mapping, Mapping):
            return None
        mapping = mapping.get(k)
    return mapping


def run_lambda1(run: Run) -> float | None:
    """A run's mean λ₁ over its posterior samples (``lambda1``, the mean of ``lambda1_summary``)."""
    return as_number(run.get("lambda1"))


def run_lambda1_median(run: Run) -> float | None:
    """A run's λ₁: the median over its posterior samples (``lambda1_summary.median``)."""
    return as_number(get_path(run, "lambda1_summary", "median"))


def lambda1_values(run: Run) -> list[float]:
    """The converged per-sample λ₁ of a run (``hessian_top_eigenvalues`` and their convergence flags)."""
    spectra, converged = run.get("hessian_top_eigenvalues"), run.get("hessian_eigenvalue_converged")
    if not isinstance(spectra, Sequence) or not isinstance(converged, Sequence) or len(spectra) != len(converged):
        return []
    out = []
    for spectrum, flags in zip(spectra, converged):
        if isinstance(spectrum, Sequence) and spectrum and isinstance(flags, Sequence) and flags and flags[0] is True:
            value = as_number(spectrum[0])
            if value is not None and math.isfinite(value):
                out.append(value)
    return out


def lambda1_median_interval(run: Run) -> Interval | None:
    """The bootstrap interval (level 95%, seed 0) of a run's median λ₁ over its converged per-sample values.

    ``None`` when the run does not record two or more of them, or when their median is not the run's
    recorded median (values of another measurement).
    """
    values = lambda1_values(run)
    median = run_lambda1_median(run)
    if len(values) < 2 or median is None or not math.isclose(statistics.median(values), median, rel_tol=1e-9):
        return None
    return median_interval(values, level=LEVEL, seed=0)


def _key(name: str) -> Callable[[Run], float | None]:
    return lambda run: as_number(run.get(name))


def width_field(name: str) -> Callable[[Run], float | None]:
    """The getter of ``run["width"][name]`` (the posterior width, e.g. ``trace_cov``), ``None`` when missing."""
    return lambda run: as_number(get_path(run, "width", name))


@dataclass(frozen=True)
class Metric:
    """A number per run that the report aggregates over seeds and compares between methods.

    Attributes:
        key: its name in ``results["findings"]``.
        label: its column header.
        get: its value in one run (``None`` when the run lacks it).
        lower: what a significantly lower value means ("better", "worse", "flatter", "narrower"); ``""``: not compared.
        higher: what a significantly higher value means.
        bounds: ``(low, high)``: the range the metric's definition confines it to (``None``: unbounded);
            intervals are clipped to it (:func:`summary_of`).
        reads: how to read a difference when neither end is better (``""``: from ``lower``/``higher``).
    """

    key: str
    label: str
    get: Callable[[Run], float | None]
    lower: str = ""
    higher: str = ""
    bounds: tuple[float | None, float | None] = (None, None)
    reads: str = ""

    @property
    def best(self) -> Callable[[Sequence[float]], float] | None:
        """``min`` or ``max``: which end of a column is best; ``None`` when neither end is better."""
        return min if self.lower == "better" else max if self.higher == "better" else None

    @property
    def reading(self) -> str:
        """How to read a difference: ``"lower is better"``, ``"higher is better"``, ``"lower is flatter"``.

        A metric with its own :attr:`reads` (a coverage, best at its level): that.
        """
        if self.reads:
            return self.reads
        return "higher is better" if self.higher == "better" else f"lower is {self.lower}"


def _from_table(key: str, group: Group, get: Callable[[Run], float | None] | None = None) -> Metric:
    """The report's metric of the table's row ``key`` in ``group`` (:mod:`flatbma.metric_names`), read by ``get``."""
    n = name(key, group)
    return Metric(n.key, n.label, get or _key(key), n.lower, n.higher, n.bounds, n.reads)


NONNEGATIVE = (0.0, None)

ACCURACY, NLL, ECE, AECE, BRIER = (_from_table(k, Group.CLASSIFIER) for k in test_keys(Group.CLASSIFIER))
LAMBDA1 = _from_table("lambda1", Group.FLATNESS, run_lambda1_median)
"""A run's λ₁: the median over its posterior samples (unbounded: a Hessian's top eigenvalue can be negative)."""
LAMBDA1_MEAN = _from_table("lambda1_mean", Group.FLATNESS, run_lambda1)
"""The mean over the samples, shown beside the median, never compared (one sharp sample can dominate it)."""
TRACE_COV = _from_table("trace_cov", Group.FLATNESS, width_field("trace_cov"))
RATIO = _from_table("lambda1_over_lambda5", Group.FLATNESS)

PREDICTIVE_METRICS: tuple[Metric, ...] = (ACCURACY, NLL, ECE, AECE, BRIER)
REGRESSION_METRICS: tuple[Metric, ...] = tuple(_from_table(k, Group.REGRESSION) for k in test_keys(Group.REGRESSION))
"""The test metrics of a regression run (``model.likelihood: gaussian``): the mixture predictive's
(:func:`flatbma.regression.mixture_metrics`); a coverage is best at its level, so no end of it is better."""
RMSE, MAE, CALIBRATION_ERROR = (m for m in REGRESSION_METRICS if m.key in ("rmse", "mae", "calibration_error"))
SUMMARY_METRICS: dict[Likelihood, tuple[Metric, ...]] = {
    Likelihood.CATEGORICAL: PREDICTIVE_METRICS,
    Likelihood.GAUSSIAN: REGRESSION_METRICS,
}
"""The summary table's predictive columns by the runs' likelihood (:mod:`flatbma.likelihood`)."""
COVERAGE = {m.key.removeprefix("coverage_"): m for m in REGRESSION_METRICS if m.key.startswith("coverage_")}
"""A regression run's coverage of the mixture's central intervals; best at its level, so no end is better: a
significant difference reads "covers less" or "covers more" (which is closer to the level is in the table)."""
FLATNESS_METRICS: tuple[Metric, ...] = (LAMBDA1, LAMBDA1_MEAN, TRACE_COV, RATIO)
COMPARED: tuple[Metric, ...] = (
    *(ACCURACY, NLL, RMSE, MAE, COVERAGE["0.9"], CALIBRATION_ERROR, ECE, BRIER),
    *(LAMBDA1, TRACE_COV),
)
"""The metrics compared with the reference, in the order of the findings (λ₁ followed by its width); a pair is
compared on those both runs measured (a classifier's: accuracy, NLL, ECE, Brier; a regression run's: NLL, RMSE,
MAE, coverage 0.9, calibration error)."""
EXTRA_METRICS: tuple[Metric, ...] = tuple(_from_table(n.key, Group.OTHER) for n in NAMES if n.group is Group.OTHER)


def _scaled_key(name: str) -> Callable[[Run], float | None]:
    return lambda run: as_number(get_path(run, "temperature_scaled", name))


TEMPERATURE = Metric("temperature", "T", _key("temperature"), bounds=NONNEGATIVE)
TEMPERATURE_METRICS: tuple[Metric, ...] = (
    TEMPERATURE,
    *(dataclasses.replace(m, get=_scaled_key(m.key)) for m in PREDICTIVE_METRICS),
)
"""The temperature fitted on the validation split, and the BMA metrics of the test set at that temperature."""
CORRUPTION_METRICS: tuple[Metric, ...] = (ACCURACY, NLL, ECE)


# --------------------------------------------------------------------------------------------------
# statistics and numbers


def summary_of(
    values: Sequence[float | None], bounds: tuple[float | None, float | None] = (None, None)
) -> Summary | None:
    """Mean, std and 95% t interval of the values that are present (:func:`flatbma.stats.summarize`).

    ``None`` when no value is present. A non-finite value (a diverged run's NLL) gives its mean without spread
    or interval rather than being dropped; the interval is clipped to ``bounds``.
    """
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    if not all(math.isfinite(x) for x in xs):
        mean = math.fsum(xs) / len(xs)
        return Summary(len(xs), mean, None, mean, None, Method.T)
    stats = summarize(xs, level=LEVEL, method=Method.T)
    return dataclasses.replace(stats, interval=clipped(stats.interval, bounds))


def clipped(interval: Interval | None, bounds: tuple[float | None, float | None]) -> Interval | None:
    """``interval`` cut to ``bounds`` (``None`` ends: no bound there)."""
    if interval is None:
        return None
    low, high = bounds
    return Interval(
        interval.low if low is None else max(low, interval.low),
        interval.high if high is None else min(high, interval.high),
        interval.level,
    )


def mean_of_present(values: Sequence[float | None]) -> float | None:
    """The mean of the values that are present (:func:`summary_of`), ``None`` when none is."""
    stats = summary_of(values)
    return stats.mean if stats is not None else None


def decimals_for(x: float) -> int | None:
    """Decimals that show ``x`` with about 4 significant digits (at most 4); ``None``: use scientific."""
    if x == 0 or not math.isfinite(x):
        return 4
    if abs(x) >= 1e6 or abs(x) < 1e-3:
        return None
    return min(4, max(0, 3 - math.floor(math.log10(abs(x)))))


def format_number(x: float, decimals: int | None = 4) -> str:
    """``x`` with ``decimals`` decimals, in scientific notation for ``None``; ``inf``/``nan`` as themselves."""
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3e}" if decimals is None else f"{x:.{decimals}f}"


def format_value(x: float | None) -> str:
    """``x`` with about 4 significant digits; ``–`` for ``None``."""
    return MISSING if x is None else format_number(x, decimals_for(x))


def _interval_text(interval: Interval, decimals: int | None) -> str:
    return f"[{format_number(interval.low, decimals)}, {format_number(interval.high, decimals)}]"


def summary_cell(stats: Summary | None) -> str:
    """``mean ± std [low, high]`` with the decimals that suit the mean; the mean alone for one value."""
    if stats is None:
        return MISSING
    decimals = decimals_for(stats.mean)
    mean = format_number(stats.mean, decimals)
    if stats.std is None:
        return mean
    text = f"{mean} ± {format_number(stats.std, decimals)}"
    return text if stats.interval is None else f"{text} {_interval_text(stats.interval, decimals)}"


def seed_counts(groups: Mapping[str, Sequence[Run]]) -> tuple[int, int]:
    """``(fewest, most)`` runs (seeds) of a method among ``groups`` (:func:`by_method`)."""
    counts = [len(rs) for rs in groups.values()]
    return min(counts), max(counts)


def spread_text(groups: Mapping[str, Sequence[Run]], *, interval: bool = True) -> str:
    """What a cell holds, for a title: "one seed; no interval", "mean ± std and 95% t interval over 3 seeds", ..."""
    low, high = seed_counts(groups)
    if high == 1:
        return ONE_SEED
    what = f"mean ± std and {LEVEL:.0%} t interval" if interval else "mean ± std"
    if low == high:
        return f"{what} over {high} seeds"
    return f"{what} over seeds; a method with one seed: its value alone"


# --------------------------------------------------------------------------------------------------
# corrupted test sets


def severities_of(runs: Sequence[Run]) -> list[str]:
    """Every corruption severity some run was evaluated at, as text, in numeric order."""
    found: dict[str, None] = {}
    for run in runs:
        for per_severity in (run.get("corruptions") or {}).values():
            if isinstance(per_severity, Mapping):
                found.update(dict.fromkeys(str(s) for s in per_severity))
    return sorted(found, key=lambda s: (to_number(s) is None, to_number(s) or 0.0, s))


def to_number(text: str) -> float | None:
    """``float(text)``, or ``None`` when ``text`` is not a number."""
    try:
        return float(text)
    except ValueError:
        return None


def corruption_average(run: Run, severity: str, metric: str) -> float | None:
    """Mean of ``metric`` over the corruptions evaluated at ``severity`` in one run."""
    corruptions = run.get("corruptions")
    if not isinstance(corruptions, Mapping):
        return None
    return mean_of_present([as_number(get_path(per, severity, metric)) for per in corruptions.values()])
