"""The rows a running (or stopped) ``flatbma compare`` has measured so far, as Markdown.

Per row label the means over the seeds done, each row's paired differences against a reference row over the
seeds both have (``mean [95% t interval]``, ``ns`` where it includes 0, and the smallest difference a two-sided
paired t test at 5% detects with 80% power over those seeds: :func:`flatbma.stats.detectable_difference`), and
every selection candidate's ascent step size.

    .venv/bin/python scripts/compare_progress.py OUTPUT_DIR CONFIG [REFERENCE]

Reads only the row caches (``runs/*/seed*/compare.json``) that ``flatbma compare`` writes as each row finishes;
the finished comparison's ``results.json`` and report replace what this prints (docs/studies/fpbma.md quotes it
as interim).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from flatbma.experiment.report.rows import (
    ACCURACY,
    ECE,
    LAMBDA1,
    NLL,
    TEMPERATURE_METRICS,
    TRACE_COV,
    Metric,
    as_number,
    get_path,
)
from flatbma.experiment.study.plan import load_plan
from flatbma.stats import Difference, paired_difference

KL_FROM_START = Metric("kl_from_start", "KL(q_T ‖ q_0)", lambda run: as_number(run.get("kl_from_start")))
MEAN_SHIFT = Metric(
    "mean_shift", "‖δμ‖₂ per step", lambda run: as_number(get_path(run, "step_stats", "ascent/mean_shift", "median"))
)
SCALED_NLL = next(m for m in TEMPERATURE_METRICS if m.key == "nll")
METRICS: tuple[Metric, ...] = (
    ACCURACY,
    NLL,
    ECE,
    dataclasses.replace(SCALED_NLL, label="NLL (T-scaled)"),
    LAMBDA1,
    TRACE_COV,
    KL_FROM_START,
    MEAN_SHIFT,
)
"""The report's metrics (:mod:`flatbma.experiment.report.rows`), then how far training and each ascent step moved q."""
COMPARED = METRICS[:6]


def value(run: dict[str, Any], metric: Metric) -> float:
    """``metric`` of one run (NaN when the run has none)."""
    found = metric.get(run)
    return math.nan if found is None else found


def difference_cell(d: Difference) -> str:
    """``mean [low, high]``, ``ns`` where the interval includes 0, then ``detectable δ`` (4 significant digits)."""
    low, high = (d.interval.low, d.interval.high) if d.interval is not None else (math.nan, math.nan)
    detectable = math.nan if d.detectable is None else d.detectable
    return f"{d.mean:+.4g} [{low:+.4g}, {high:+.4g}]{'' if d.significant else ' ns'}, detectable {detectable:.4g}"


def main(out: str, config: str, reference: str = "lowrank-vi") -> None:
    """Print the tables of the comparison ``config`` whose output directory is ``out``."""
    plan = load_plan(config, [f"output_dir={out}"])
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    for job in plan.jobs():
        cache = job.row_dir / "compare.json"
        if cache.exists():
            rows.setdefault(job.label, {})[job.seed] = json.loads(cache.read_text())["result"]
    print("| row | seeds | " + " | ".join(m.label for m in METRICS) + " |\n|---|:-:|" + ":-:|" * len(METRICS))
    for label, by in rows.items():
        means = [sum(value(r, m) for r in by.values()) / len(by) for m in METRICS]
        print(f"| {label} | {len(by)} | " + " | ".join(f"{m:.4g}" for m in means) + " |")
    header = " | ".join(m.label for m in COMPARED)
    print(f"\n| row − {reference} | seeds | {header} |\n|---|:-:|" + ":-:|" * len(COMPARED))
    base = rows.get(reference, {})
    for label, by in rows.items():
        seeds = sorted(set(by) & set(base))
        if label == reference or len(seeds) < 2:
            continue
        cells = [
            difference_cell(paired_difference([value(by[s], m) for s in seeds], [value(base[s], m) for s in seeds]))
            for m in COMPARED
        ]
        print(f"| {label} | {len(seeds)} | " + " | ".join(cells) + " |")
    for job in plan.jobs():  # every selection candidate: how far its ascent moved q (its metrics.json)
        for cand in job.candidates if job.selects else ():
            run_dir = Path(cand.config.output_dir)
            metrics = run_dir / "metrics.json"
            record = json.loads(metrics.read_text()) if metrics.exists() else {}
            error = run_dir / "candidate.json"
            failed = error.exists() and json.loads(error.read_text()).get("error")
            shift, moved = value(record, MEAN_SHIFT), value(record, KL_FROM_START)
            print(
                f"candidate {job.label} seed {job.seed} {cand.options}: median ‖δμ‖₂ {shift:.3g}, "
                f"KL(q_T ‖ q_0) {moved:.3g}{', diverged' if failed else ''}"
            )
    for label, by in rows.items():
        chosen = {s: (r.get("selection") or {}).get("chosen") for s, r in sorted(by.items())}
        if any(chosen.values()):
            print(f"\n{label}, chosen on validation: {chosen}")


if __name__ == "__main__":
    main(*sys.argv[1:])
