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

Any field may be missing or null (results of older versions lack the flatness protocol's keys):
tables then show "–" and a figure without data is skipped with a note.

Statistics (:mod:`flatbma.stats`, level 95%), per method and metric, over the seeds whose run has the
value: with two or more, the mean ± the sample standard deviation (``ddof = 1``) and Student's t
interval of the mean, ``x̄ ± t_{0.975, n−1} s/√n``; with one seed, the value alone (titles say
"one seed; no interval", never "mean ± std").

Brier score: as :func:`flatbma.metrics.brier`, summed over all classes, ``(1/n) Σ_i Σ_c (p_ic − 1[y_i = c])²``
— on a binary problem twice scikit-learn's ``brier_score_loss`` (which scores the positive class only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flatbma.checks import is_number
from flatbma.errors import FlatbmaError
from flatbma.stats import Interval, Method, Summary, summarize

__all__ = [
    "COMPARED",
    "LEVEL",
    "MISSING",
    "Metric",
    "Run",
    "as_number",
    "by_method",
    "corruption_average",
    "decimals_for",
    "format_number",
    "format_value",
    "get_path",
    "mean_of_present",
    "read_runs",
    "run_lambda1",
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

LEVEL = 0.95
"""Confidence level of every interval of the report."""

ONE_SEED = "one seed; no interval"
"""What the cells of a comparison with one seed per method hold: each run's value, no spread, no interval."""

Run = Mapping[str, Any]


# --------------------------------------------------------------------------------------------------
# reading the results


def read_runs(results: Mapping[str, Any]) -> list[Run]:
    """The runs of a ``results.json`` dict, each checked to be a dict with a ``method`` name.

    Raises:
        FlatbmaError: if ``results`` is not a dict, has no runs, or a run has no method name.
    """
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
    """A run's λ₁: the mean over its posterior samples (``lambda1_summary``, else the older ``lambda1``)."""
    summary = as_number(get_path(run, "lambda1_summary", "mean"))
    return summary if summary is not None else as_number(run.get("lambda1"))


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
        lower: what a significantly lower value means ("better", "worse", "flatter", "narrower");
            ``""``: not compared.
        higher: what a significantly higher value means.
    """

    key: str
    label: str
    get: Callable[[Run], float | None]
    lower: str = ""
    higher: str = ""

    @property
    def best(self) -> Callable[[Sequence[float]], float] | None:
        """``min`` or ``max``: which end of a column is best; ``None`` when neither end is better."""
        return min if self.lower == "better" else max if self.higher == "better" else None

    @property
    def reading(self) -> str:
        """How to read a difference: ``"lower is better"``, ``"higher is better"``, ``"lower is flatter"``."""
        return "higher is better" if self.higher == "better" else f"lower is {self.lower}"


def _lower_better(key: str, label: str, get: Callable[[Run], float | None] | None = None) -> Metric:
    return Metric(key, label, get or _key(key), lower="better", higher="worse")


ACCURACY = Metric("accuracy", "accuracy", _key("accuracy"), lower="worse", higher="better")
NLL = _lower_better("nll", "NLL")
ECE = _lower_better("ece", "ECE")
AECE = _lower_better("aece", "AECE")
BRIER = _lower_better("brier", "Brier")
LAMBDA1 = Metric("lambda1", "λ₁", run_lambda1, lower="flatter", higher="sharper")
TRACE_COV = Metric("trace_cov", "tr Σ", width_field("trace_cov"), lower="narrower", higher="wider")
RATIO = Metric("lambda1_over_lambda5", "λ₁/λ₅", _key("lambda1_over_lambda5"))

PREDICTIVE_METRICS: tuple[Metric, ...] = (ACCURACY, NLL, ECE, AECE, BRIER)
FLATNESS_METRICS: tuple[Metric, ...] = (LAMBDA1, TRACE_COV, RATIO)
COMPARED: tuple[Metric, ...] = (ACCURACY, NLL, ECE, BRIER, LAMBDA1, TRACE_COV)
"""The metrics compared with the reference, in the order of the findings (λ₁ followed by its width)."""
EXTRA_METRICS: tuple[Metric, ...] = (
    Metric("distribution_lambda1", "λ₁ of the mean Hessian", _key("distribution_lambda1")),
    Metric("sam_sharpness", "SAM sharpness", _key("sam_sharpness")),
    Metric("train_time_s", "train time (s)", _key("train_time_s")),
    Metric("eval_time_s", "eval time (s)", _key("eval_time_s")),
)
CORRUPTION_METRICS: tuple[Metric, ...] = (ACCURACY, NLL, ECE)


# --------------------------------------------------------------------------------------------------
# statistics and numbers


def summary_of(values: Sequence[float | None]) -> Summary | None:
    """Mean, std and 95% t interval of the values that are present (:func:`flatbma.stats.summarize`).

    ``None`` when no value is present. A non-finite value (a diverged run's NLL) gives its mean
    without spread or interval rather than being dropped.
    """
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    if not all(math.isfinite(x) for x in xs):
        mean = math.fsum(xs) / len(xs)
        return Summary(len(xs), mean, None, mean, None, Method.T)
    return summarize(xs, level=LEVEL, method=Method.T)


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
