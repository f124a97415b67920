"""Re-derive a finished comparison's findings and reports from its ``results.json`` alone, without retraining.

    .venv/bin/python scripts/refind.py RESULTS_JSON [--out DIR]

Recomputes ``results["findings"]`` with the current code (:func:`flatbma.experiment.report.findings.findings`,
as ``flatbma compare`` does after its last row) and writes the documents ``flatbma compare`` writes beside it
(:func:`flatbma.experiment.report.documents.write_reports`: ``results.csv``, ``figures/``, ``report.md``,
``report.html``), all generated from the results' rows. Every other key of ``results.json`` (the rows, the
config, ``created``) is written back unchanged, in ``flatbma compare``'s format (sorted keys, indent 2), so a
diff of it shows the findings alone. Without ``--out`` the files beside ``RESULTS_JSON`` are rewritten in
place; with it they go to ``DIR`` (created) and ``RESULTS_JSON`` is left as it was.

For committed study outputs whose run directories are gone (docs/*-study/): a new finding's field or
wording reaches them with this command (e.g. the detectable difference, :func:`flatbma.stats.detectable_difference`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from flatbma.errors import FlatbmaError
from flatbma.experiment.report.documents import write_reports
from flatbma.experiment.report.findings import findings
from flatbma.experiment.run.checkpoint import atomic_write_json


def refind(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` with its ``findings`` generated anew; ``None`` when every row diverged (as ``flatbma compare``)."""
    rows = results.get("runs")
    if not isinstance(rows, list) or not rows:
        raise FlatbmaError("results has no runs: give the results.json that flatbma compare wrote")
    measured = any(isinstance(row, dict) and "error" not in row for row in rows)
    return {**results, "findings": findings(results) if measured else None}


def main(argv: list[str] | None = None) -> int:
    """Rewrite the findings of ``RESULTS_JSON`` and its documents; ``2`` with one line on bad input."""
    parser = argparse.ArgumentParser(prog="refind", description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a results.json written by flatbma compare")
    parser.add_argument("--out", type=Path, help="write into this folder (default: beside RESULTS_JSON)")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else args.results.parent
    try:
        results = json.loads(args.results.read_text())
        if not isinstance(results, dict):
            raise FlatbmaError(f"{args.results} holds no results dict")
        results = refind(results)
        atomic_write_json(out / "results.json", results)
        written = write_reports(results, out) if results["findings"] is not None else {}
    except (OSError, ValueError, FlatbmaError) as e:  # json.JSONDecodeError is a ValueError
        print(f"refind: error: {e}", file=sys.stderr)
        return 2
    found = results["findings"] or {}
    n = len(found.get("comparisons", [])) + len(found.get("pairs", []))
    print(f"wrote {out / 'results.json'} ({n} paired differences), " + ", ".join(sorted(written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
