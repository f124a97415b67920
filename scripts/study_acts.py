"""Did every arm of a finished comparison act? From its ``results.json`` alone, one markdown table.

    .venv/bin/python scripts/study_acts.py RESULTS_JSON [--control lowrank-vi sgd] [--min-kl 50]

A study of a family that does not move measures nothing (issue #34), so each arm's row says, over its seeds
(median [min, max]):

- ``kl_from_start``: KL(q ‖ q's start) in nats for the variational families (how far q moved);
- the width: median marginal σ and tr Σ of the posterior (``width``), and for a Gaussian VI arm its median σ over
  its ``init_std`` (does σ leave its initial value?); a zero width is a posterior that collapsed to a point. An arm
  that starts at its prior stage's fit (``prior.init``, σ floored at ``prior.min_std``) never had ``init_std`` as
  its σ: its ratio is left out (``—``);
- ``chosen``: what validation picked among the arm's candidates (``selection.chosen``), counted over seeds;
- ``λ₁ unconverged``: Hessian–vector power iterations that stopped before their tolerance, over all samples;
- ``twin factor``: a width twin's scale on its reference's trace (``width_matched.factor``).

Then the study's two checks: every variational arm moved more than ``--min-kl`` nats on every seed, and the
positive control — the first ``--control`` arm's mean accuracy inside the second's 95% t interval over seeds
(a Gaussian that fails in the regime cannot show an ascent's gain).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from flatbma.errors import FlatbmaError
from flatbma.stats import summarize


def _spread(values: list[float]) -> str:
    """``median [min, max]`` of ``values`` with 3 significant digits; ``—`` for none."""
    if not values:
        return "—"
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    if len(ordered) == 1:
        return f"{median:.3g}"
    return f"{median:.3g} [{ordered[0]:.3g}, {ordered[-1]:.3g}]"


def arms(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The measured rows by arm (``method``: the label), in the order the arms first appear; diverged rows left out."""
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if isinstance(row, dict) and "error" not in row:
            out.setdefault(row["method"], []).append(row)
    return out


def acts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's evidence of acting (module docstring), from its rows over seeds."""
    kl = [r["kl_from_start"] for r in rows if r.get("kl_from_start") is not None]
    width = [r["width"] for r in rows if isinstance(r.get("width"), dict)]
    ratio = [
        r["width"]["median_std"] / r["method_options"]["init_std"]
        for r in rows
        if isinstance(r.get("width"), dict)
        and r["width"].get("median_std") is not None
        and isinstance(r.get("method_options"), dict)
        and r["method_options"].get("init_std")
        and not (isinstance(r.get("prior"), dict) and r["prior"].get("init"))  # started at the prior's fit
    ]
    chosen = Counter(
        ", ".join(f"{k}={v}" for k, v in sorted(r["selection"]["chosen"].items()))
        for r in rows
        if isinstance(r.get("selection"), dict) and r["selection"].get("chosen")
    )
    twins = [r["width_matched"]["factor"] for r in rows if isinstance(r.get("width_matched"), dict)]
    return {
        "seeds": len(rows),
        "kl_from_start": kl,
        "median_std": [w["median_std"] for w in width if w.get("median_std") is not None],
        "trace_cov": [w["trace_cov"] for w in width if w.get("trace_cov") is not None],
        "std_over_init": ratio,
        "chosen": dict(chosen),
        "unconverged": sum(len(r.get("lambda1_unconverged") or []) for r in rows),
        "samples": sum(int(r.get("flatness_samples") or 0) for r in rows),
        "twin_factor": twins,
    }


def control(by_arm: dict[str, list[dict[str, Any]]], arm: str, baseline: str) -> str:
    """The positive control's line: ``arm``'s mean accuracy against ``baseline``'s 95% t interval over seeds."""
    for name in (arm, baseline):
        if len(by_arm.get(name, [])) < 2:
            held = len(by_arm.get(name, []))
            raise FlatbmaError(f"the positive control needs {name!r} on at least 2 seeds; the results hold {held}")
    mean = sum(r["accuracy"] for r in by_arm[arm]) / len(by_arm[arm])
    base = summarize([r["accuracy"] for r in by_arm[baseline]])
    low, high = base.interval.low, base.interval.high
    met = mean >= low
    return (
        f"positive control: {arm}'s accuracy {mean:.4f} {'≥' if met else '<'} the low end of {baseline}'s 95% "
        f"interval [{low:.4f}, {high:.4f}] ({len(by_arm[baseline])} seeds): {'met' if met else 'NOT met'}"
    )


def table(results: dict[str, Any], min_kl: float, pair: tuple[str, str] | None) -> str:
    """The markdown table and the study's checks (module docstring)."""
    by_arm = arms(results.get("runs") or [])
    if not by_arm:
        raise FlatbmaError("results has no measured runs: give the results.json that flatbma compare wrote")
    lines = [
        "| arm | seeds | KL(q ‖ start), nats | median σ | σ / init_std | tr Σ | chosen on validation | "
        "λ₁ unconverged | twin factor |",
        "|---|:-:|:-:|:-:|:-:|:-:|:-:|:-:|:-:|",
    ]
    anchored = []
    for name, rows in by_arm.items():
        a = acts(rows)
        chosen = "; ".join(f"{k} ×{n}" for k, n in sorted(a["chosen"].items())) or "—"
        lines.append(
            f"| {name} | {a['seeds']} | {_spread(a['kl_from_start'])} | {_spread(a['median_std'])} | "
            f"{_spread(a['std_over_init'])} | {_spread(a['trace_cov'])} | {chosen} | "
            f"{a['unconverged']} of {a['samples']} | {_spread(a['twin_factor'])} |"
        )
        if a["kl_from_start"] and min(a["kl_from_start"]) <= min_kl and not a["twin_factor"]:
            anchored.append(f"{name} ({min(a['kl_from_start']):.3g})")
    lines.append("")
    lines.append(
        f"q moved more than {min_kl:g} nats on every seed of every variational arm"
        if not anchored
        else f"moved no more than {min_kl:g} nats on some seed: {', '.join(anchored)}"
    )
    if pair is not None:
        lines.append(control(by_arm, *pair))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); 2 with one line on stderr for what is not a results.json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--control", nargs=2, metavar=("ARM", "BASELINE"), help="e.g. lowrank-vi sgd")
    parser.add_argument("--min-kl", type=float, default=50.0)
    args = parser.parse_args(argv)
    try:
        results = json.loads(args.results.read_text())
        print(table(results, args.min_kl, tuple(args.control) if args.control else None))
    except (OSError, ValueError, FlatbmaError) as exc:
        print(f"study_acts: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
