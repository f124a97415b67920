"""The claims study's two verdict tables (docs/studies/claims.md) from a finished comparison's ``results.json``.

    .venv/bin/python scripts/claims_tables.py docs/claims-study/scratch/results.json
    .venv/bin/python scripts/claims_tables.py docs/claims-study/transfer/results.json --without-flagged

Takes the paired differences of the config's ``compare.pairs`` as the report computes them from the rows, and
prints two markdown tables:

1. **FP-BMA's claim**: each FP-BMA arm against low-rank VI and against its width-matched twin (``twin@<arm>``):
   accuracy, NLL, λ₁ median, tr Σ.
2. **The flat-seeking claim**: each F-X − X: accuracy, NLL, Brier, λ₁ median, tr Σ, and X's own λ₁ median and tr Σ
   (mean over its seeds), for scale.

A cell is the mean paired difference a − b with its 95% t interval over the seeds both ran, **bold** when the
interval excludes 0; otherwise it is followed by ``δ₈₀``, the smallest difference those seeds could have detected
(two-sided 5%, 80% power: :func:`flatbma.stats.detectable_difference`). The numbers are the report's own
(:func:`flatbma.experiment.report.findings.difference_text`), so the tables and ``report.md`` agree digit for digit.

``--without-flagged`` is a sensitivity analysis: it drops every row that the training-health rules flag
(:mod:`flatbma.health`: its training loss rose, its BMA fell below its MAP, ...) before pairing, so a pair is taken
over the seeds on which neither arm's fit failed. The tables without it, over every seed run, are the study's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flatbma.errors import FlatbmaError
from flatbma.experiment.report.findings import Comparison, detectable_text, difference_text, pair_comparisons
from flatbma.experiment.report.rows import ACCURACY, BRIER, LAMBDA1, NLL, TRACE_COV, Metric, Run, by_method, read_runs
from flatbma.experiment.report.tables import Table
from flatbma.health import is_flagged

FPBMA_METRICS = (ACCURACY, NLL, LAMBDA1, TRACE_COV)
FLAT_METRICS = (ACCURACY, NLL, BRIER, LAMBDA1, TRACE_COV)
FLAT_PREFIX = "f-"
TWIN = "twin@"


def cell(found: Comparison | None) -> str:
    """``**mean [low, high]**`` when the interval excludes 0, else ``mean [low, high] (δ₈₀ d)``; ``—`` when absent.

    A difference that is 0 on every seed (MC dropout's tr Σ: no weight covariance is measured) reads ``0 on every
    seed``.
    """
    if found is None or found.difference is None:
        return "—"
    d = found.difference
    if d.mean == 0 and d.interval is not None and d.interval.low == d.interval.high == 0:
        return "0 on every seed"
    text = difference_text(d)
    return f"**{text}**" if d.significant else f"{text} (δ₈₀ {detectable_text(d)})"


def _mean(runs: Sequence[Run], metric: Metric) -> str:
    values = [v for v in map(metric.get, runs) if v is not None]
    return f"{statistics.fmean(values):.3g}" if values else "—"


def tables(results: Mapping[str, Any], *, without_flagged: bool = False) -> tuple[str, str]:
    """``(FP-BMA's table, the flat-seeking table)`` as markdown: the pairs the comparison lists, in its order.

    The differences are the report's own (:func:`~flatbma.experiment.report.findings.pair_comparisons`, the
    "Paired differences" table of report.md), computed from the results' rows; ``without_flagged``: from its rows
    that the training-health rules do not flag (module docstring).
    """
    if not isinstance(results, Mapping) or not results.get("findings", {}).get("pairs"):
        raise FlatbmaError(
            "the results hold no paired differences (findings.pairs): not a finished comparison with compare.pairs "
            "(flatbma compare writes them after its last row; scripts/refind.py merges seed batches)"
        )
    if without_flagged:
        results = {**results, "runs": [r for r in results.get("runs", []) if not is_flagged(r.get("health"))]}
    pairs: dict[tuple[str, str], dict[str, Comparison]] = {}
    for found in pair_comparisons(results):
        pairs.setdefault((found.method, found.reference), {})[found.metric.key] = found
    runs = by_method(read_runs(results))

    fpbma = [(a, b) for a, b in pairs if a.startswith("fp-bma") and (b == "lowrank-vi" or b == TWIN + a)]
    flat = [(a, b) for a, b in pairs if a == FLAT_PREFIX + b]
    fpbma_table = Table(
        "FP-BMA's claim",
        ["pair", *(m.label for m in FPBMA_METRICS)],
        [[f"{a} − {b}", *(cell(pairs[a, b].get(m.key)) for m in FPBMA_METRICS)] for a, b in fpbma],
    )
    flat_table = Table(
        "The flat-seeking claim",
        ["pair", *(m.label for m in FLAT_METRICS), f"X's {LAMBDA1.label}", f"X's {TRACE_COV.label}"],
        [
            [
                f"{a} − {b}",
                *(cell(pairs[a, b].get(m.key)) for m in FLAT_METRICS),
                _mean(runs.get(b, []), LAMBDA1),
                _mean(runs.get(b, []), TRACE_COV),
            ]
            for a, b in flat
        ],
    )
    return fpbma_table.markdown(), flat_table.markdown()


def main(argv: list[str] | None = None) -> int:
    """Print both tables of ``RESULTS_JSON``; 2 with one line on stderr when it is not a finished comparison's."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a finished comparison's results.json")
    parser.add_argument(
        "--without-flagged", action="store_true", help="drop the rows the training-health rules flag (a sensitivity)"
    )
    args = parser.parse_args(argv)
    try:
        fpbma, flat = tables(json.loads(args.results.read_text()), without_flagged=args.without_flagged)
    except (OSError, ValueError, KeyError, FlatbmaError) as e:
        print(f"claims_tables: error: {e}", file=sys.stderr)
        return 2
    over = "common seeds whose rows no health rule flags" if args.without_flagged else "common seeds"
    print(f"FP-BMA's claim (a − b, mean [95% t interval] over {over})\n\n{fpbma}\n")
    print(f"The flat-seeking claim (F-X − X; X's λ₁ median and tr Σ: its mean over seeds)\n\n{flat}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
