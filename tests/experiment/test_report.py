import base64
import copy
import csv
import math
import statistics
import sys

import pytest

from flatbma.errors import FlatbmaError
from flatbma.experiment.report import (
    FIGURES,
    MISSING,
    bma_curve_figure,
    corruption_figure,
    lambda1_figure,
    landscape_curves,
    landscape_figure,
    reliability_figure,
    summary_table,
    write_reports,
)

PNG = b"\x89PNG\r\n\x1a\n"
CORRUPTIONS = ("gaussian_noise", "contrast")
SEVERITIES = ("1", "3")


def _run(method, seed, k):
    """A run whose numbers are simple functions of (method index k, seed), so tests can recompute them."""
    acc = 0.80 + 0.05 * k + 0.01 * seed
    return {
        "method": method,
        "seed": seed,
        "run_dir": f"runs/{method}/seed{seed}",
        "accuracy": acc,
        "nll": 0.60 - 0.1 * k + 0.03 * seed,
        "ece": 0.05 - 0.01 * k + 0.002 * seed,
        "aece": 0.04 + 0.001 * seed,
        "brier": 0.30 - 0.02 * k + 0.005 * seed,
        "lambda1": 120.0 - 40.0 * k + 7.0 * seed,
        "lambda1_std": 5.0 + seed,
        "lambda1_over_lambda5": 3.0 + 0.5 * seed,
        "distribution_lambda1": 100.0 - 30.0 * k,
        "sam_sharpness": 0.01 * (seed + 1),
        "train_time_s": 10.0 + seed,
        "eval_time_s": 2.0,
        "bma_curve": {
            "num_samples": [1, 2, 5, 10],
            "accuracy": [acc - 0.03, acc - 0.02, acc - 0.01, acc],
            "nll": [0.9, 0.8, 0.7, 0.6 + 0.01 * seed],
            "ece": [0.08, 0.07, 0.06, 0.05],
        },
        "reliability": {
            "bin_edges": [0.0, 0.25, 0.5, 0.75, 1.0],
            "count": [0, 10, 30, 60],
            "confidence": [None, 0.4, 0.63, 0.9],
            "accuracy": [None, 0.35, 0.6, 0.88 + 0.01 * seed],
        },
        "corruptions": {
            name: {
                sev: {
                    "accuracy": acc - 0.1 * int(sev) - 0.02 * j,
                    "nll": 0.6 + 0.2 * int(sev) + 0.05 * j + 0.01 * seed,
                    "ece": 0.05 + 0.01 * int(sev) + 0.003 * j * seed,
                }
                for sev in SEVERITIES
            }
            for j, name in enumerate(CORRUPTIONS)
        },
        "landscape": {
            "alphas": [-1.0, 0.0, 1.0],
            "mean": [2.0 + seed, 0.5, 2.5 - k],
            "std": [0.2, 0.1 * seed, 0.3],
        },
    }


def _results():
    return {
        "config_hash": "abc123",
        "config": {"data": {"name": "digits"}, "train": {"epochs": 2}},
        "created": "2024-01-01T00:00:00",
        "runs": [_run(m, s, k) for k, m in enumerate(["SWAG", "F-SWAG"]) for s in (0, 1)],
    }


def _table_rows(markdown, title):
    """{method: [cells]} of the Markdown table under the heading ``## {title}``."""
    lines = markdown.splitlines()
    start = lines.index(f"## {title}") + 2
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def _parse(cell):
    mean, _, std = cell.partition(" ± ")
    return float(mean), (float(std) if std else None)


def _check_cell(cell, values):
    """The printed mean ± std equal the hand-computed ones to the printed precision."""
    mean, std = _parse(cell)
    decimals = len(cell.split(" ± ")[0].partition(".")[2])
    tol = 0.5 * 10**-decimals + 1e-12
    assert mean == pytest.approx(statistics.mean(values), abs=tol, rel=0)
    assert std == pytest.approx(statistics.stdev(values), abs=tol, rel=0)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    results = _results()
    return results, out, write_reports(results, out)


def test_every_file_is_written(written):
    results, out, files = written
    expected = {"results.csv", "report.md", "report.html"} | {f"figures/{f.name}.png" for f in FIGURES}
    assert set(files) == expected
    for rel, path in files.items():
        assert path == out / rel and path.is_file() and path.stat().st_size > 0
        if rel.endswith(".png"):
            assert path.read_bytes()[:8] == PNG


def test_csv_has_one_flat_row_per_run_with_every_key(written):
    results, out, _ = written
    with open(out / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 4
    run = results["runs"][0]
    scalar_keys = [k for k, v in run.items() if not isinstance(v, dict)]
    for key in scalar_keys:
        assert key in rows[0], key
    for name in CORRUPTIONS:
        for sev in SEVERITIES:
            for metric in ("accuracy", "nll", "ece"):
                col = f"corr_{name}_s{sev}_{metric}"
                assert float(rows[0][col]) == run["corruptions"][name][sev][metric]
    assert float(rows[0]["bma_nll_m10"]) == run["bma_curve"]["nll"][3]
    for row, r in zip(rows, results["runs"]):
        assert (row["method"], int(row["seed"])) == (r["method"], r["seed"])
        assert float(row["accuracy"]) == r["accuracy"]  # full precision


def test_html_is_self_contained(written):
    _, out, files = written
    text = (out / "report.html").read_text()
    n_figures = sum(rel.startswith("figures/") for rel in files)
    assert text.count("data:image/png;base64,") == n_figures == len(FIGURES)
    assert 'src="figures/' not in text and "http://" not in text and "https://" not in text
    first = text.split("data:image/png;base64,")[1].split('"')[0]
    assert base64.b64decode(first)[:8] == PNG
    assert "<table>" in text and "F-SWAG" in text


def test_markdown_tables_hold_mean_and_std_over_seeds(written):
    results, out, _ = written
    md = (out / "report.md").read_text()
    for rel in (f"figures/{f.name}.png" for f in FIGURES):
        assert f"]({rel})" in md
    rows = _table_rows(md, "Results (mean ± std over seeds)")
    assert set(rows) == {"SWAG", "F-SWAG"}
    for method, row in rows.items():
        runs = [r for r in results["runs"] if r["method"] == method]
        assert row["seeds"] == "2"
        for key, label in [("accuracy", "accuracy"), ("nll", "NLL"), ("ece", "ECE"), ("aece", "AECE")]:
            _check_cell(row[label], [r[key] for r in runs])
        _check_cell(row["Brier"], [r["brier"] for r in runs])
        _check_cell(row["λ₁"], [r["lambda1"] for r in runs])
        _check_cell(row["λ₁/λ₅"], [r["lambda1_over_lambda5"] for r in runs])
    # SWAG: accuracy 0.80, 0.81 -> 0.8050 ± 0.0071 exactly as printed
    assert rows["SWAG"]["accuracy"] == "0.8050 ± 0.0071"
    assert rows["SWAG"]["λ₁"] == "123.5 ± 4.9"  # 120 and 127: about 4 significant digits
    assert rows["SWAG"]["AECE"] == "0.0405 ± 0.0007"
    assert summary_table(results) in md

    # corruptions: per run the mean over corruptions at a severity, then mean ± std over seeds
    for metric, label in [("accuracy", "accuracy"), ("nll", "NLL"), ("ece", "ECE")]:
        title = f"Corrupted test sets: {label} (mean over corruptions, mean ± std over seeds)"
        crow = _table_rows(md, title)
        for method, row in crow.items():
            runs = [r for r in results["runs"] if r["method"] == method]
            per_sev = {
                s: [statistics.mean(r["corruptions"][c][s][metric] for c in CORRUPTIONS) for r in runs]
                for s in SEVERITIES
            }
            for s in SEVERITIES:
                _check_cell(row[f"severity {s}"], per_sev[s])
            overall = [statistics.mean(per_sev[s][i] for s in SEVERITIES) for i in range(len(runs))]
            _check_cell(row["all severities"], overall)


def test_nulls_and_missing_fields_are_tolerated(tmp_path):
    results = _results()
    # a method with one seed and nothing but accuracy; nulls in another run
    results["runs"].append({"method": "SGLD", "seed": 0, "accuracy": 0.7, "nll": None, "lambda1": None})
    results["runs"][0].update(lambda1=None, landscape=None, reliability=None, corruptions={})
    results["runs"][1]["corruptions"]["contrast"]["3"]["nll"] = None
    files = write_reports(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    rows = _table_rows(md, "Results (mean ± std over seeds)")
    assert rows["SGLD"]["accuracy"] == "0.7000"  # one seed: the mean only
    assert rows["SGLD"]["NLL"] == MISSING and rows["SGLD"]["λ₁"] == MISSING
    assert rows["SWAG"]["λ₁"] == "127.0"  # the one seed that has it
    assert len(list(csv.DictReader(open(tmp_path / "results.csv")))) == 5
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") == sum(rel.startswith("figures/") for rel in files)

    # nothing to draw: every figure skipped with a note, stale PNGs removed
    bare = {"runs": [{"method": "SGD", "seed": 0, "accuracy": 0.5}, {"method": "SGD", "seed": 1}]}
    (tmp_path / "figures" / "lambda1.png").write_bytes(b"stale")
    files = write_reports(bare, tmp_path)
    assert not any(rel.startswith("figures/") for rel in files)
    assert not (tmp_path / "figures" / "lambda1.png").exists()
    md = (tmp_path / "report.md").read_text()
    assert md.count("_Skipped:") == len(FIGURES)
    assert "data:image/png" not in (tmp_path / "report.html").read_text()
    assert all(f(bare) is None for f in (reliability_figure, bma_curve_figure, lambda1_figure, corruption_figure))
    assert landscape_figure(bare) is None


def test_figure_functions_return_png_bytes():
    results = _results()
    for spec in FIGURES:
        png = spec.draw(results)
        assert isinstance(png, bytes) and png[:8] == PNG and len(png) > 2000, spec.name


def test_landscape_seeds_are_pooled_by_the_law_of_total_variance():
    results = _results()
    curves = landscape_curves(results)
    alphas, mean, std = curves["SWAG (2 seeds)"]
    assert alphas == [-1.0, 0.0, 1.0]
    # seeds 0 and 1 at α = -1: means 2 and 3, stds 0.2 and 0.2
    assert mean[0] == pytest.approx(2.5)
    assert std[0] == pytest.approx(math.sqrt(0.2**2 + 0.25))
    # at α = 0: means equal, stds 0 and 0.1
    assert std[1] == pytest.approx(math.sqrt(0.01 / 2))
    # a seed with other alphas is left out
    other = copy.deepcopy(results)
    other["runs"][1]["landscape"]["alphas"] = [-2.0, 0.0, 2.0]
    assert "SWAG (1 seed)" in landscape_curves(other)


def test_bad_results_and_missing_matplotlib(tmp_path, monkeypatch):
    with pytest.raises(FlatbmaError, match="no runs"):
        write_reports({"runs": []}, tmp_path)
    with pytest.raises(FlatbmaError, match="'method'"):
        summary_table({"runs": [{"seed": 0}]})
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(FlatbmaError, match=r"pip install flatbma\[plots\]"):
        write_reports(_results(), tmp_path)
