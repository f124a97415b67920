"""The rows a running (or stopped) ``flatbma compare`` has measured so far, as Markdown.

Per row label the means over the seeds done, each row's paired differences against a reference row over the
seeds both have, and every selection candidate's ascent step size.

    .venv/bin/python scripts/compare_progress.py OUTPUT_DIR CONFIG [REFERENCE]

Reads only the row caches (``runs/*/seed*/compare.json``) that ``flatbma compare`` writes as each row finishes;
the finished comparison's ``results.json`` and report replace what this prints (docs/studies/fpbma.md quotes it
as interim).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from flatbma.experiment.study.plan import load_plan
from flatbma.stats import paired_difference

KEYS = ("accuracy", "nll", "ece", "ts_nll", "lambda1_median", "trace", "kl_from_start", "mean_shift")


def value(row: dict[str, Any], key: str) -> float:
    """One number of a row (NaN when the row has none)."""
    found: Any
    if key == "lambda1_median":
        found = (row.get("lambda1_summary") or {}).get("median")
    elif key == "trace":
        found = (row.get("width") or {}).get("trace_cov")
    elif key.startswith("ts_"):
        found = (row.get("temperature_scaled") or {}).get(key[3:])
    elif key == "mean_shift":
        found = ((row.get("step_stats") or {}).get("ascent/mean_shift") or {}).get("median")
    else:
        found = row.get(key)
    return float(found) if isinstance(found, int | float) else math.nan


def main(out: str, config: str, reference: str = "lowrank-vi") -> None:
    """Print the tables of the comparison ``config`` whose output directory is ``out``."""
    plan = load_plan(config, [f"output_dir={out}"])
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    for job in plan.jobs():
        cache = job.row_dir / "compare.json"
        if cache.exists():
            rows.setdefault(job.label, {})[job.seed] = json.loads(cache.read_text())["result"]
    print("| row | seeds | " + " | ".join(KEYS) + " |\n|---|:-:|" + ":-:|" * len(KEYS))
    for label, by in rows.items():
        means = [sum(value(r, k) for r in by.values()) / len(by) for k in KEYS]
        print(f"| {label} | {len(by)} | " + " | ".join(f"{m:.4g}" for m in means) + " |")
    compared = KEYS[:6]
    print(f"\n| row − {reference} | seeds | " + " | ".join(compared) + " |\n|---|:-:|" + ":-:|" * len(compared))
    base = rows.get(reference, {})
    for label, by in rows.items():
        seeds = sorted(set(by) & set(base))
        if label == reference or len(seeds) < 2:
            continue
        cells = []
        for k in compared:
            d = paired_difference([value(by[s], k) for s in seeds], [value(base[s], k) for s in seeds])
            low, high = (d.interval.low, d.interval.high) if d.interval is not None else (math.nan, math.nan)
            cells.append(f"{d.mean:+.4g} [{low:+.4g}, {high:+.4g}]{'' if d.significant else ' ns'}")
        print(f"| {label} | {len(seeds)} | " + " | ".join(cells) + " |")
    for job in plan.jobs():  # every selection candidate: how far its ascent moved q (its metrics.json)
        for cand in job.candidates if job.selects else ():
            run_dir = Path(cand.config.output_dir)
            metrics = run_dir / "metrics.json"
            record = json.loads(metrics.read_text()) if metrics.exists() else {}
            error = run_dir / "candidate.json"
            failed = error.exists() and json.loads(error.read_text()).get("error")
            shift = value(record, "mean_shift")
            print(
                f"candidate {job.label} seed {job.seed} {cand.options}: median ‖δμ‖₂ {shift:.3g}, "
                f"KL(q_T ‖ q_0) {value(record, 'kl_from_start'):.3g}{', diverged' if failed else ''}"
            )
    for label, by in rows.items():
        chosen = {s: (r.get("selection") or {}).get("chosen") for s, r in sorted(by.items())}
        if any(chosen.values()):
            print(f"\n{label}, chosen on validation: {chosen}")


if __name__ == "__main__":
    main(*sys.argv[1:])
