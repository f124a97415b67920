"""The claims study's two verdict tables (docs/studies/claims.md) from a finished comparison's ``results.json``.

    .venv/bin/python scripts/claims_tables.py docs/claims-study/scratch/results.json

Reads the paired differences ``flatbma compare`` wrote (``findings.pairs``, the config's ``compare.pairs``) and
prints two markdown tables:

1. **FP-BMA's claim**: each FP-BMA arm against low-rank VI and against its width-matched twin (``twin@<arm>``):
   accuracy, NLL, λ₁ median, tr Σ.
2. **The flat-seeking claim**: each F-X − X: accuracy, NLL, Brier, λ₁ median, tr Σ, and X's own λ₁ median and tr Σ
   (mean over its seeds), for scale.

A cell is the mean paired difference a − b with its 95% t interval over the seeds both ran, **bold** when the
interval excludes 0; otherwise it is followed by ``δ₈₀``, the smallest difference those seeds could have detected
(two-sided 5%, 80% power: :func:`flatbma.stats.detectable_difference`). The numbers are the report's own
(:func:`flatbma.experiment.report.findings.difference_text`), so the tables and ``report.md`` agree digit for digit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flatbma.errors import FlatbmaError
from flatbma.experiment.report.findings import detectable_text, difference_text
from flatbma.experiment.report.rows import by_method, read_runs, run_lambda1_median, width_field
from flatbma.stats import Difference, Interval

FPBMA_METRICS = ("accuracy", "nll", "lambda1", "trace_cov")
FLAT_METRICS = ("accuracy", "nll", "brier", "lambda1", "trace_cov")
LABELS = {"accuracy": "accuracy", "nll": "NLL", "brier": "Brier", "lambda1": "λ₁ median", "trace_cov": "tr Σ"}
FLAT_PREFIX = "f-"
TWIN = "twin@"


def _difference(found: Mapping[str, Any]) -> Difference:
    """A ``findings.pairs`` entry as the :class:`~flatbma.stats.Difference` the report formats."""
    interval = found.get("interval")
    return Difference(
        n=found["n"],
        mean=found["mean"],
        interval=Interval(interval["low"], interval["high"], interval["level"]) if interval else None,
        significant=bool(found["significant"]),
        detectable=found.get("detectable"),
    )


def cell(found: Mapping[str, Any] | None) -> str:
    """``**mean [low, high]**`` when the interval excludes 0, else ``mean [low, high] (δ₈₀ d)``; ``—`` when absent.

    A difference that is 0 on every seed (MC dropout's tr Σ: no weight covariance is measured) reads ``0 on every
    seed``.
    """
    if found is None:
        return "—"
    d = _difference(found)
    if d.mean == 0 and d.interval is not None and d.interval.low == d.interval.high == 0:
        return "0 on every seed"
    text = difference_text(d)
    return f"**{text}**" if d.significant else f"{text} (δ₈₀ {detectable_text(d)})"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---|" + ":-:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _mean(runs: Sequence[Mapping[str, Any]], get: Callable[[Mapping[str, Any]], float | None]) -> str:
    values = [v for v in map(get, runs) if v is not None]
    return f"{statistics.fmean(values):.3g}" if values else "—"


def tables(results: Mapping[str, Any]) -> tuple[str, str]:
    """``(FP-BMA's table, the flat-seeking table)`` as markdown: the pairs the comparison lists, in its order."""
    listed = results.get("findings", {}).get("pairs") if isinstance(results, Mapping) else None
    if not listed:
        raise FlatbmaError(
            "the results hold no paired differences (findings.pairs): not a finished comparison with compare.pairs "
            "(flatbma compare writes them after its last row; scripts/refind.py merges seed batches)"
        )
    pairs: dict[tuple[str, str], dict[str, Any]] = {}
    for found in listed:
        pairs.setdefault((found["method"], found["reference"]), {})[found["metric"]] = found
    runs = by_method(read_runs(results))

    fpbma = [(a, b) for a, b in pairs if a.startswith("fp-bma") and (b == "lowrank-vi" or b == TWIN + a)]
    fpbma_rows = [[f"{a} − {b}", *(cell(pairs[a, b].get(m)) for m in FPBMA_METRICS)] for a, b in fpbma]
    flat = [(a, b) for a, b in pairs if a == FLAT_PREFIX + b]
    flat_rows = [
        [
            f"{a} − {b}",
            *(cell(pairs[a, b].get(m)) for m in FLAT_METRICS),
            _mean(runs.get(b, []), run_lambda1_median),
            _mean(runs.get(b, []), width_field("trace_cov")),
        ]
        for a, b in flat
    ]
    return (
        _table(["pair", *(LABELS[m] for m in FPBMA_METRICS)], fpbma_rows),
        _table(["pair", *(LABELS[m] for m in FLAT_METRICS), "X's λ₁ median", "X's tr Σ"], flat_rows),
    )


def main(argv: list[str] | None = None) -> int:
    """Print both tables of ``RESULTS_JSON``; 2 with one line on stderr when it is not a finished comparison's."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a finished comparison's results.json")
    args = parser.parse_args(argv)
    try:
        fpbma, flat = tables(json.loads(args.results.read_text()))
    except (OSError, ValueError, KeyError, FlatbmaError) as e:
        print(f"claims_tables: error: {e}", file=sys.stderr)
        return 2
    print(f"FP-BMA's claim (a − b, mean [95% t interval] over common seeds)\n\n{fpbma}\n")
    print(f"The flat-seeking claim (F-X − X; X's λ₁ median and tr Σ: its mean over seeds)\n\n{flat}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
