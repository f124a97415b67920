"""The documents of a comparison: ``results.csv``, ``figures/*.png``, ``report.md`` and a self-contained HTML report.

:func:`write_reports` writes them into one folder; ``report.html`` embeds its figures as base64 PNG data URIs.
Figures need matplotlib (``pip install flatbma[plots]``).
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from flatbma.experiment.report.figures import FIGURES, FigureSpec
from flatbma.experiment.report.findings import findings, pairs_of, reference_of
from flatbma.experiment.report.rows import MISSING, Run, by_method, failed_runs, read_runs, seed_counts
from flatbma.experiment.report.tables import Table, report_tables
from flatbma.state_io import atomic_write_bytes, write_error
from flatbma.stats import POWER

__all__ = ["csv_rows", "write_reports"]


# --------------------------------------------------------------------------------------------------
# CSV


_STRUCTURED = ("bma_curve", "reliability", "corruptions", "landscape")


def csv_rows(results: Mapping[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """``(columns, rows)``: one flat row per run.

    Scalars keep their key; dicts are flattened with dotted keys (``method_options.rank``,
    ``lambda1_summary.interval.low``), lists written as JSON; the BMA curve becomes ``bma_<metric>_m<M>``,
    corruptions ``corr_<name>_s<severity>_<metric>``. The reliability diagram and landscape curve are left out
    (see ``results.json``). Columns are the union over runs in order of appearance, empty where a run lacks one.
    """
    rows = [_flat_run(run) for run in read_runs(results)]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return columns, rows


def _flat_run(run: Run) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in run.items():
        if key in _STRUCTURED:
            continue
        _flatten(str(key), value, out)
    curve = run.get("bma_curve")
    if isinstance(curve, Mapping):
        sizes = curve.get("num_samples") or []
        for metric, values in curve.items():
            if metric == "num_samples" or not isinstance(values, Sequence):
                continue
            for m, v in zip(sizes, values):
                out[f"bma_{metric}_m{m}"] = v
    corruptions = run.get("corruptions")
    if isinstance(corruptions, Mapping):
        for name, per_severity in corruptions.items():
            for severity, metrics in (per_severity or {}).items():
                for metric, v in (metrics or {}).items():
                    out[f"corr_{name}_s{severity}_{metric}"] = v
    return out


def _flatten(key: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for sub, v in value.items():
            _flatten(f"{key}.{sub}", v, out)
    else:
        out[key] = value if _is_scalar(value) else json.dumps(value)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _csv_text(results: Mapping[str, Any]) -> str:
    columns, rows = csv_rows(results)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in columns})
    return buf.getvalue()


# --------------------------------------------------------------------------------------------------
# documents


def write_reports(results: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``results.csv``, ``figures/<name>.png``, ``report.md`` and a self-contained ``report.html``.

    The findings are generated anew from ``results`` (the ``results.json`` dict, :func:`findings`), never copied
    from it. ``out_dir`` is created if missing; a figure skipped for lack of data has its stale PNG removed.

    Returns:
        The written files by path relative to ``out_dir`` (``"results.csv"``, ``"report.md"``,
        ``"report.html"``, ``"figures/<name>.png"``).

    Raises:
        FlatbmaError: if ``results`` has no runs or an unknown ``compare.reference``, or matplotlib is missing.
    """
    out_dir = Path(out_dir)
    tables = report_tables(results)
    found = findings(results)
    figures: list[tuple[FigureSpec, bytes | None]] = [(spec, spec.draw(results)) for spec in FIGURES]
    written: dict[str, Path] = {}

    def put(rel: str, data: bytes) -> None:
        path = out_dir / rel
        atomic_write_bytes(path, data)  # creates its folder; a failed write is one FlatbmaError line
        written[rel] = path

    put("results.csv", _csv_text(results).encode())
    for spec, png in figures:
        rel = f"figures/{spec.name}.png"
        if png is not None:
            put(rel, png)
        else:
            try:
                (out_dir / rel).unlink(missing_ok=True)
            except OSError as e:
                raise write_error(out_dir / rel, e) from None
    put("report.md", _markdown(results, found, tables, figures).encode())
    put("report.html", _html(results, found, tables, figures).encode())
    return written


def _header_lines(results: Mapping[str, Any]) -> list[tuple[str, str]]:
    runs = read_runs(results)
    groups = by_method(runs)
    seeds = sorted({str(r.get("seed")) for r in runs if r.get("seed") is not None}, key=lambda s: (len(s), s))
    lines = [
        ("config hash", str(results.get("config_hash") or MISSING)),
        ("created", str(results.get("created") or MISSING)),
        ("runs", f"{len(runs)} ({len(groups)} methods: {', '.join(groups)}; seeds: {', '.join(seeds) or MISSING})"),
        ("reference", reference_of(results, groups)),
    ]
    failed = failed_runs(results)
    if failed:
        shown = ", ".join(f"{r['method']} seed {r.get('seed')}" for r in failed)
        lines.append(("diverged", f"{len(failed)} (failed rows, in no mean or paired difference: {shown})"))
    pairs = pairs_of(results, groups)
    if pairs:
        lines.append(("pairs", ", ".join(f"{a} − {b}" for a, b in pairs)))
    return lines


_FINDINGS_NOTE = (
    "Generated from the paired differences over seeds (method − reference, Student t interval at {level:.0%}); "
    "a difference whose interval includes 0 is written as no difference larger than δ detected, δ the smallest "
    "true difference that the paired t test at {size:.0%} detects with {power:.0%} power over those seeds "
    "(the paired-difference tables' detectable columns). λ₁ has no better end "
    "(lower: flatter) and is compared only with the width tr Σ beside it (lower: narrower)."
)
_ONE_SEED_FINDINGS_NOTE = (
    "One seed; no interval: a difference between methods is claimed only from paired differences over two or "
    "more seeds (Student t interval at {level:.0%})."
)


def _findings_note(results: Mapping[str, Any], level: float) -> str:
    """The caption of the findings: how they are made, or (one seed) why there are none."""
    groups = by_method(read_runs(results))
    if seed_counts(groups)[1] == 1:
        return _ONE_SEED_FINDINGS_NOTE.format(level=level)
    note = _FINDINGS_NOTE.format(level=level, size=1 - level, power=POWER)
    if pairs_of(results, groups):
        note = note.replace("(method − reference,", "(method − reference, and a − b for each pair of compare.pairs;")
    return note


def _config_text(results: Mapping[str, Any]) -> str:
    shown = {k: results[k] for k in ("config", "compare") if results.get(k)}
    return yaml.safe_dump(shown, sort_keys=False, allow_unicode=True) if shown else ""


def _markdown(
    results: Mapping[str, Any],
    found: Mapping[str, Any],
    tables: list[Table],
    figures: list[tuple[FigureSpec, bytes | None]],
) -> str:
    out = ["# flatbma comparison", ""]
    out += [f"- **{k}**: {v}" for k, v in _header_lines(results)]
    out += ["", "## Findings", "", *(f"- {line}" for line in found["text"])]
    out += ["", f"_{_findings_note(results, found['level'])}_"]
    for table in tables:
        out += ["", f"## {table.title}", "", table.markdown()]
        if table.note:
            out += ["", f"_{table.note}_"]
        if table.lines:
            out += ["", *(f"- {line}" for line in table.lines)]
    out += ["", "## Figures"]
    for spec, png in figures:
        caption = spec.caption(results)
        out += ["", f"### {caption}", ""]
        out.append(f"![{caption}](figures/{spec.name}.png)" if png is not None else f"_Skipped: {spec.missing}._")
    config = _config_text(results)
    if config:
        out += ["", "## Configuration", "", "```yaml", config.rstrip(), "```"]
    return "\n".join(out) + "\n"


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 75em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: center; }
th { background: #f2f2f2; } td:first-child { text-align: left; font-weight: 600; }
figure { margin: 1em 0; } figcaption { font-weight: 600; margin-bottom: 0.3em; }
img { max-width: 100%; } .note { color: #555; font-style: italic; } pre { background: #f7f7f7; padding: 1em; }
"""


def _html(
    results: Mapping[str, Any],
    found: Mapping[str, Any],
    tables: list[Table],
    figures: list[tuple[FigureSpec, bytes | None]],
) -> str:
    e = html.escape
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>flatbma comparison</title>',
        f"<style>{_CSS}</style></head><body>",
        "<h1>flatbma comparison</h1><ul>",
        *(f"<li><b>{e(k)}</b>: {e(v)}</li>" for k, v in _header_lines(results)),
        "</ul>",
        "<h2>Findings</h2><ul>",
        *(f"<li>{e(line)}</li>" for line in found["text"]),
        f'</ul><p class="note">{e(_findings_note(results, found["level"]))}</p>',
    ]
    for table in tables:
        out += [f"<h2>{e(table.title)}</h2>", table.html()]
        if table.note:
            out.append(f'<p class="note">{e(table.note)}</p>')
        if table.lines:
            out.append("<ul>" + "".join(f"<li>{e(line)}</li>" for line in table.lines) + "</ul>")
    out.append("<h2>Figures</h2>")
    for spec, png in figures:
        caption = spec.caption(results)
        if png is None:
            out.append(f'<h3>{e(caption)}</h3><p class="note">Skipped: {e(spec.missing)}.</p>')
        else:
            data = base64.b64encode(png).decode("ascii")
            out.append(
                f'<figure><figcaption>{e(caption)}</figcaption><img alt="{e(caption)}" '
                f'src="data:image/png;base64,{data}"></figure>'
            )
    config = _config_text(results)
    if config:
        out.append(f"<h2>Configuration</h2><details><summary>config</summary><pre>{e(config)}</pre></details>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
