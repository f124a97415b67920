"""Re-derive a finished comparison's findings and reports from its ``results.json`` alone, without retraining.

    .venv/bin/python scripts/refind.py RESULTS_JSON [--out DIR]
    .venv/bin/python scripts/refind.py BATCH1/results.json BATCH2/results.json ... --out DIR


Recomputes ``results["findings"]`` with the current code (:func:`flatbma.experiment.report.findings.findings`,
as ``flatbma compare`` does after its last row) and writes the documents ``flatbma compare`` writes beside it
(:func:`flatbma.experiment.report.documents.write_reports`: ``results.csv``, ``figures/``, ``report.md``,
``report.html``), all generated from the results' rows. Every other key of ``results.json`` (the rows, the
config, ``created``) is written back unchanged, in ``flatbma compare``'s format (sorted keys, indent 2), so a
diff of it shows the findings alone. Without ``--out`` the files beside ``RESULTS_JSON`` are rewritten in
place; with it they go to ``DIR`` (created) and ``RESULTS_JSON`` is left as it was.

**Seed batches of one study.** Several ``results.json`` of the same comparison run on different seeds (a long
study run in batches, e.g. across sessions from one pinned commit: ``--set compare.seeds=[5,6,7]``) are merged
into one: they must hold the same config but for ``output_dir`` and ``compare.seeds`` (each batch its own
folder) and the same compare section but for its seeds, and no (method, seed) row twice; the rows are
concatenated, ``compare.seeds`` is their union, ``created`` the latest batch's and ``batches`` records each
batch's ``config_hash``, ``output_dir``, seeds and ``created``; then the findings are generated as above from
all the rows.
``--out`` is required then, and the batches are left as they were.

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


def merge(batches: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """One results dict from seed batches of one comparison (module docstring); refused with one line otherwise."""
    first = batches[0]
    for results, name in zip(batches, names, strict=True):
        if not isinstance(results.get("runs"), list) or not isinstance(results.get("compare"), dict):
            raise FlatbmaError(
                f"{name} has no runs or compare section: give results.json files that flatbma compare wrote"
            )
    seen: dict[tuple[Any, Any], str] = {}
    for results, name in zip(batches, names, strict=True):
        if _study(results) != _study(first):
            raise FlatbmaError(
                f"{name} holds another config than {names[0]} (beyond output_dir and compare.seeds): not one study"
            )
        rest = {k: v for k, v in results["compare"].items() if k != "seeds"}
        if rest != {k: v for k, v in first["compare"].items() if k != "seeds"}:
            raise FlatbmaError(f"{name}'s compare section differs from {names[0]}'s beyond its seeds: not one study")
        for row in results["runs"]:
            key = (row.get("label", row.get("method")), row.get("seed"))
            if key in seen:
                raise FlatbmaError(
                    f"{key[0]} seed {key[1]} is in both {seen[key]} and {name}: merge batches of other seeds"
                )
            seen[key] = name
    seeds = sorted({s for results in batches for s in results["compare"].get("seeds", [])})
    return {
        **first,
        "runs": [row for results in batches for row in results["runs"]],
        "compare": {**first["compare"], "seeds": seeds},
        "created": max(str(results.get("created", "")) for results in batches),
        "batches": [
            {
                "config_hash": results.get("config_hash"),
                "output_dir": (results.get("config") or {}).get("output_dir"),
                "seeds": results["compare"].get("seeds"),
                "created": results.get("created"),
            }
            for results in batches
        ],
    }


def _study(results: dict[str, Any]) -> dict[str, Any]:
    """A batch's config without what differs between batches of one study: its output_dir and compare.seeds.

    Its ``config_hash`` covers both, so it differs between batches and cannot tell a batch from another study.
    """
    config = {k: v for k, v in (results.get("config") or {}).items() if k != "output_dir"}
    if isinstance(config.get("compare"), dict):
        config["compare"] = {k: v for k, v in config["compare"].items() if k != "seeds"}
    return config


def main(argv: list[str] | None = None) -> int:
    """Rewrite the findings of ``RESULTS_JSON`` and its documents; ``2`` with one line on bad input."""
    parser = argparse.ArgumentParser(prog="refind", description=__doc__.splitlines()[0])
    parser.add_argument(
        "results", type=Path, nargs="+", help="a results.json written by flatbma compare (or seed batches)"
    )
    parser.add_argument("--out", type=Path, help="write into this folder (default: beside RESULTS_JSON)")
    args = parser.parse_args(argv)
    if len(args.results) > 1 and args.out is None:
        print(
            "refind: error: merging seed batches needs --out DIR (the batches are left as they were)", file=sys.stderr
        )
        return 2
    out = args.out if args.out is not None else args.results[0].parent
    try:
        batches = []
        for path in args.results:
            batch = json.loads(path.read_text())
            if not isinstance(batch, dict):
                raise FlatbmaError(f"{path} holds no results dict")
            batches.append(batch)
        results = batches[0] if len(batches) == 1 else merge(batches, [str(p) for p in args.results])
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
