import base64
import copy
import csv
import html
import json
import math
import re
import statistics
import sys

import pytest
import yaml
from scipy import stats as scipy_stats

from flatbma.errors import FlatbmaError
from flatbma.experiment.report import figures
from flatbma.experiment.report.documents import write_reports
from flatbma.experiment.report.figures import (
    FIGURES,
    bma_curve_figure,
    corruption_figure,
    lambda1_figure,
    landscape_curves,
    landscape_figure,
    reliability_figure,
)
from flatbma.experiment.report.findings import comparisons, findings
from flatbma.experiment.report.rows import MISSING
from flatbma.experiment.report.tables import summary_table
from tests.helpers import DETECTABLE_PER_S

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


def _table_rows(markdown, title, *, bold=False):
    """{method: {column: cell}} of the Markdown table under the heading ``## {title}`` (or the first one
    starting with ``title`` when it ends with "…"); bold markers removed unless ``bold``."""
    lines = markdown.splitlines()
    if title.endswith("…"):
        start = next(i for i, line in enumerate(lines) if line.startswith(f"## {title[:-1]}")) + 2
    else:
        start = lines.index(f"## {title}") + 2
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() if bold else c.strip().strip("*") for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def _parse(cell):
    """``mean ± std [low, high]`` -> (mean, std, (low, high)); missing parts are None."""
    head, _, interval = cell.partition(" [")
    mean, _, std = head.partition(" ± ")
    bounds = tuple(float(x) for x in interval.rstrip("]").split(", ")) if interval else None
    return float(mean), (float(std) if std else None), bounds


def _check_cell(cell, values):
    """The printed mean ± std [t interval] equal the hand-computed ones to the printed precision."""
    mean, std, bounds = _parse(cell)
    decimals = len(cell.split(" ± ")[0].partition(".")[2])
    tol = 0.5 * 10**-decimals + 1e-12
    n = len(values)
    assert mean == pytest.approx(statistics.mean(values), abs=tol, rel=0)
    assert std == pytest.approx(statistics.stdev(values), abs=tol, rel=0)
    half = scipy_stats.t.ppf(0.975, n - 1) * statistics.stdev(values) / math.sqrt(n)
    assert bounds == pytest.approx((statistics.mean(values) - half, statistics.mean(values) + half), abs=tol, rel=0)


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
    rows = _table_rows(md, "Results (mean ± std and 95% t interval over 2 seeds)")
    assert set(rows) == {"SWAG", "F-SWAG"}
    for method, row in rows.items():
        runs = [r for r in results["runs"] if r["method"] == method]
        assert row["seeds"] == "2"
        for key, label in [("accuracy", "accuracy"), ("nll", "NLL"), ("ece", "ECE"), ("aece", "AECE")]:
            _check_cell(row[label], [r[key] for r in runs])
        _check_cell(row["Brier"], [r["brier"] for r in runs])
        _check_cell(row["λ₁ mean"], [r["lambda1"] for r in runs])  # older results: no median, the mean alone
        assert "λ₁ median" not in row
        _check_cell(row["λ₁/λ₅"], [r["lambda1_over_lambda5"] for r in runs])
    # SWAG: accuracy 0.80, 0.81 -> 0.8050 ± 0.0071, t interval 0.805 ± 12.706 · 0.005 exactly as printed
    assert rows["SWAG"]["accuracy"] == "0.8050 ± 0.0071 [0.7415, 0.8685]"
    assert rows["SWAG"]["λ₁ mean"] == "123.5 ± 4.9 [79.0, 168.0]"  # 120 and 127: about 4 significant digits
    assert rows["SWAG"]["AECE"] == "0.0405 ± 0.0007 [0.0341, 0.0469]"
    assert rows["SWAG"]["tr Σ"] == MISSING  # the width beside λ₁, not measured in these results
    assert summary_table(results) in md

    # corruptions: per run the mean over corruptions at a severity, then mean ± std over seeds
    for metric, label in [("accuracy", "accuracy"), ("nll", "NLL"), ("ece", "ECE")]:
        title = f"Corrupted test sets: {label} (mean over corruptions; mean ± std and 95% t interval over 2 seeds)"
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
    rows = _table_rows(
        md, "Results (mean ± std and 95% t interval over seeds; a method with one seed: its value alone)"
    )
    assert rows["SGLD"]["accuracy"] == "0.7000"  # one seed: the value alone
    assert rows["SGLD"]["NLL"] == MISSING and rows["SGLD"]["λ₁ mean"] == MISSING
    assert rows["SWAG"]["λ₁ mean"] == "127.0"  # the one seed that has it
    assert len(list(csv.DictReader(open(tmp_path / "results.csv")))) == 5
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == sum(rel.startswith("figures/") for rel in files)

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
    assert findings(bare)["text"] == ["One method (SGD): there is nothing to compare."]
    assert "- One method (SGD): there is nothing to compare." in md


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


# --------------------------------------------------------------------------------------------------
# statistics: paired differences, findings, the flatness protocol

NOISE = (0.013, -0.021, 0.008, 0.017, -0.004)
METHODS = ("sgd", "swag", "fp-bma")


def _protocol_run(method, seed, k):
    """A run with the flatness protocol's keys; seed-to-seed noise that differs between methods."""
    e = NOISE[(seed + 2 * k) % len(NOISE)]
    lam = 1000.0 + 400.0 * k + 20000.0 * e
    return {
        "method": method,
        "seed": seed,
        "accuracy": 0.70 + 0.1 * k + e,  # a large shift against the noise: significant
        "nll": 0.90 - 0.002 * k + 3 * e,  # a small one: its interval includes 0
        "ece": 0.05 + 0.01 * k + e / 10,
        "aece": 0.04,
        "brier": 0.35 - 0.001 * k + e,
        "lambda1": lam,
        "lambda1_summary": {
            "n": 8,
            "mean": lam,
            "std": 300.0,
            "median": lam - 50.0,
            "interval": {"low": lam - 200.0, "high": lam + 260.0, "level": 0.95},
            "method": "bootstrap",
        },
        "lambda1_at_mean": lam / 2,
        "width": {"trace_cov": 2.0 + k + e, "median_std": 0.01 * (k + 1), "exact": k != 2},
        "repeatability": {
            "agree": seed != 1 or k != 2,
            "first": {"n": 8, "mean": lam, "interval": {"low": lam - 200.0, "high": lam + 260.0, "level": 0.95}},
            "second": {"n": 8, "mean": lam + 30, "interval": {"low": lam - 150.0, "high": lam + 300.0, "level": 0.95}},
        },
        "hessian_trace": 5000.0 + k,
        "lambda1_unconverged": k,
        "hessian_examples": 100,
        "bn_statistics": "recomputed on un-augmented training images in a fixed order",
    }


def _protocol_results(seeds=(0, 1, 2, 3), reference=None):
    runs = [_protocol_run(m, s, k) for k, m in enumerate(METHODS) for s in seeds]
    return {"compare": {"reference": reference}, "runs": runs}


def _values(results, method, metric):
    """{seed: value} of one method, read from the rows as a user would."""
    get = {
        "lambda1": lambda r: r["lambda1_summary"]["mean"],
        "trace_cov": lambda r: r["width"]["trace_cov"],
    }.get(metric, lambda r: r[metric])
    return {r["seed"]: get(r) for r in results["runs"] if r["method"] == method}


def test_paired_differences_match_scipy_ttest_rel():
    results = _protocol_results(reference="swag")
    found = findings(results)
    assert found["reference"] == "swag" and found["claimed"]
    assert {c["method"] for c in found["comparisons"]} == {"sgd", "fp-bma"}
    assert {c["metric"] for c in found["comparisons"]} == {"accuracy", "nll", "ece", "brier", "lambda1", "trace_cov"}
    verdicts = set()
    for c in found["comparisons"]:
        mine, ref = _values(results, c["method"], c["metric"]), _values(results, "swag", c["metric"])
        seeds = sorted(ref)
        a, b = [mine[s] for s in seeds], [ref[s] for s in seeds]
        ci = scipy_stats.ttest_rel(a, b).confidence_interval(0.95)
        assert c["seeds"] == seeds and c["n"] == 4
        assert c["mean"] == pytest.approx(statistics.mean(x - y for x, y in zip(a, b)), abs=1e-12)
        assert (c["interval"]["low"], c["interval"]["high"]) == pytest.approx((ci.low, ci.high), abs=1e-9)
        includes_zero = ci.low <= 0 <= ci.high
        assert c["significant"] == (not includes_zero)
        s = statistics.stdev(x - y for x, y in zip(a, b))
        assert c["detectable"] == pytest.approx(DETECTABLE_PER_S[4] * s, rel=1e-10)  # every difference carries it
        if includes_zero:
            assert re.fullmatch(r"no difference larger than [\d.]+ detected", c["verdict"]), c["verdict"]
        else:
            words = {
                "accuracy": ("worse", "better"),
                "lambda1": ("flatter", "sharper"),
                "trace_cov": ("narrower", "wider"),
            }.get(c["metric"], ("better", "worse"))
            assert c["verdict"] == words[c["mean"] > 0]
        verdicts.add(c["verdict"].split(" than ")[0])
    assert {"no difference larger", "better", "worse"} <= verdicts
    assert json.loads(json.dumps(found)) == found  # what results.json stores


def _number(text):
    return float(text.replace("−", "-").lstrip("+"))


FINDING = re.compile(
    r"^(?P<method>\S+) vs (?P<ref>\S+): (?P<label>.+?) (?P<mean>[+−]?[\d.]+) \[(?P<low>−?[\d.]+), (?P<high>−?[\d.]+)\]"
    r" over (?P<n>\d+) seeds \((?P<reading>[a-z ]+)\): (?P<verdict>.+)$"
)


def test_findings_text_is_written_from_the_numbers(tmp_path):
    results = _protocol_results(reference="swag")
    found = findings(results)
    assert found["text"] == [c["text"] for c in found["comparisons"]]
    for c in found["comparisons"]:
        m = FINDING.match(c["text"])
        assert m, c["text"]
        assert (m["method"], m["ref"], m["label"], int(m["n"])) == (c["method"], "swag", c["label"], c["n"])
        assert (m["reading"], m["verdict"]) == (c["reading"], c["verdict"])
        decimals = len(m["low"].partition(".")[2])
        tol = 0.5 * 10**-decimals + 1e-12
        for key, value in [("mean", c["mean"]), ("low", c["interval"]["low"]), ("high", c["interval"]["high"])]:
            assert _number(m[key]) == pytest.approx(value, abs=tol, rel=0)
        null = re.fullmatch(r"no difference larger than (?P<delta>[\d.]+) detected", m["verdict"])
        assert (null is not None) == (_number(m["low"]) <= 0 <= _number(m["high"]))
        if null:  # the detectable difference in the metric's units, with the interval's decimals
            assert len(null["delta"].partition(".")[2]) == decimals
            assert float(null["delta"]) == pytest.approx(c["detectable"], abs=tol, rel=0)
        assert "no significant difference" not in c["text"]
    # λ₁ is followed by its width, in the report as in results.json
    order = [(c["method"], c["metric"]) for c in found["comparisons"]]
    i = order.index(("fp-bma", "lambda1"))
    assert order[i + 1] == ("fp-bma", "trace_cov")
    write_reports(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    listed = md.split("## Findings\n\n")[1].split("\n\n")[0].splitlines()
    assert listed == [f"- {line}" for line in found["text"]]
    assert html.escape(found["text"][0]) in (tmp_path / "report.html").read_text()
    # the paired-difference table holds the same numbers
    rows = _table_rows(md, "Paired differences from swag …", bold=True)
    nll = next(c for c in found["comparisons"] if c["method"] == "sgd" and c["metric"] == "nll")
    cell = rows["sgd"]["NLL"]
    assert nll["text"].split(": NLL ")[1].startswith(cell.strip("*").split(" [")[0])
    for c in found["comparisons"]:  # beside each difference its detectable difference, in a column of its own
        shown = rows[c["method"]][f"{c['label']} detectable"]
        decimals = len(shown.partition(".")[2])
        assert _number(shown) == pytest.approx(c["detectable"], abs=0.5 * 10**-decimals + 1e-12, rel=0)
        if not c["significant"]:
            assert c["text"].endswith(f"no difference larger than {shown} detected")
    assert cell.startswith("**") == nll["significant"]


def test_reference_defaults_to_the_first_method_and_must_exist():
    results = _protocol_results()
    assert findings(results)["reference"] == "sgd"
    assert {c.method for c in comparisons(results)} == {"swag", "fp-bma"}
    results["compare"]["reference"] = "swg"
    with pytest.raises(FlatbmaError, match=r"compare\.reference 'swg' is not one of the compared methods"):
        findings(results)
    with pytest.raises(FlatbmaError, match=r"compare\.reference"):
        write_reports(results, "/nonexistent/never-written")


def test_compare_config_validates_the_reference(tmp_path):
    from flatbma.experiment.study.plan import CompareConfig, load_plan
    from flatbma.options import parse_dataclass

    methods = [{"name": "sgd"}, {"name": "swag"}, {"name": "sam", "label": "SAM-0.1"}]
    assert parse_dataclass(CompareConfig, {"methods": methods}, "compare").reference is None
    assert (
        parse_dataclass(CompareConfig, {"methods": methods, "reference": "SAM-0.1"}, "compare").reference == "SAM-0.1"
    )
    did_you_mean = r"compare\.reference 'swg' is not a compared method\. Did you mean 'swag'\?"
    with pytest.raises(FlatbmaError, match=did_you_mean):
        parse_dataclass(CompareConfig, {"methods": methods, "reference": "swg"}, "compare")
    with pytest.raises(FlatbmaError, match=r"compare\.reference must be"):
        parse_dataclass(CompareConfig, {"methods": methods, "reference": 3}, "compare")

    cfg = {
        "output_dir": str(tmp_path / "out"),
        "data": {"name": "digits", "k_shot": 5, "val_per_class": 1},
        "model": {"name": "mlp"},
        "compare": {"methods": methods, "reference": "swag", "quick": {"methods": ["sgd", "sam"]}},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    full = load_plan(path)
    assert full.compare.reference == "swag"
    quick = load_plan(path, quick=True)  # the reference is left out: the first kept method is the reference
    assert quick.compare.reference is None
    changed = load_plan(path, ["compare.reference=sgd"])
    assert changed.fingerprint() == full.fingerprint()  # the reference shapes the report, not the results


def test_one_seed_claims_nothing_and_never_says_mean_and_std(tmp_path):
    results = _protocol_results(seeds=(0,))
    found = findings(results)
    assert not found["claimed"]
    assert found["text"] == [
        "One seed: no comparison between methods is claimed (a difference needs its interval over paired seeds: "
        "run at least two seeds)."
    ]
    for c in found["comparisons"]:
        assert c["n"] == 1 and c["interval"] is None and not c["significant"]
        assert c["verdict"] == "no comparison claimed (one seed)"
    write_reports(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    page = (tmp_path / "report.html").read_text()
    assert "mean ± std" not in md and "mean ± std" not in page
    assert "## Results (one seed; no interval)" in md and "Paired differences" not in md
    rows = _table_rows(md, "Results (one seed; no interval)")
    assert rows["swag"]["accuracy"] == f"{0.80 + NOISE[2]:.4f}"  # the value alone
    assert "### BMA quality vs number of samples (one seed; no interval)" in md
    assert "each cell is that run's value, with no spread and no interval" in md
    assert "No cell is marked best" in md and "**" not in md.split("## Results")[1].split("\n_")[0]
    assert "_One seed; no interval: a difference between methods is claimed only" in md
    assert "One seed; no interval" in page and "Generated from the paired differences" not in page


def test_the_brier_column_says_it_sums_over_both_classes(written):
    results, out, _ = written
    for name in ("report.md", "report.html"):
        text = (out / name).read_text()
        assert "Brier: Σ_c (p_c − 1[y = c])² summed over all classes" in text
        assert "twice scikit-learn" in text and "brier_score_loss" in text


def test_a_method_with_one_common_seed_is_not_compared():
    results = _protocol_results(seeds=(0, 1, 2))
    results["runs"] = [r for r in results["runs"] if r["method"] != "fp-bma" or r["seed"] == 2]
    found = findings(results)
    assert "fp-bma vs sgd: fewer than two seeds in common: no comparison claimed" in found["text"]
    one = [c for c in found["comparisons"] if c["method"] == "fp-bma"]
    assert one and all(c["n"] == 1 and c["verdict"] == "no comparison claimed (one seed)" for c in one)
    assert any(line.startswith("swag vs sgd: accuracy") for line in found["text"])


def test_rows_without_the_protocol_keys(tmp_path):
    # older results (no width, no lambda1_summary): no median λ₁, so λ₁ is not compared (their mean is shown)
    found = findings(_results())
    assert not {"lambda1", "trace_cov"} & {c["metric"] for c in found["comparisons"]}
    # with medians but no width: λ₁ is not compared without the width beside it
    results = _protocol_results(seeds=(0, 1))
    for r in results["runs"]:
        del r["width"]
    lam = next(c for c in findings(results)["comparisons"] if c["metric"] == "lambda1")
    assert lam["verdict"] == "not compared: the posterior width tr Σ is not measured beside it"
    assert lam["n"] == 0 and lam["mean"] is None
    # a mix: one method reports its width, the other does not
    results = _protocol_results(seeds=(0, 1))
    for r in results["runs"]:
        if r["method"] == "swag":
            for key in ("width", "lambda1_summary", "repeatability", "lambda1_at_mean", "lambda1_unconverged"):
                del r[key]
    found = findings(results)
    verdicts = {(c["method"], c["metric"]): c["verdict"] for c in found["comparisons"]}
    assert ("swag", "lambda1") not in verdicts  # no median λ₁ in swag's rows: nothing to compare
    assert ("swag", "trace_cov") not in verdicts and ("fp-bma", "lambda1") in verdicts
    write_reports(results, tmp_path)
    rows = _table(tmp_path / "report.md", "Flatness per run …")
    swag = next(r for r in rows if r["method"] == "swag")
    assert swag["λ₁ mean"] == _four(results["runs"][2]["lambda1"]) and swag["tr Σ"] == MISSING
    assert swag["λ₁ median"] == MISSING and swag["repeatable"] == MISSING


def _four(x):
    """``x`` with 4 significant digits, as the tables print it (between 1e-3 and 1e6)."""
    return f"{x:.{min(4, max(0, 3 - math.floor(math.log10(abs(x)))))}f}"


def _table(path, title):
    """Rows of a Markdown table as dicts (several rows per method allowed)."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"## {title.rstrip('…')}")) + 2
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def test_flatness_table_shows_the_protocol(tmp_path):
    results = _protocol_results(seeds=(0, 1))
    write_reports(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    rows = _table(tmp_path / "report.md", "Flatness per run (one protocol for every method)")
    assert [(r["method"], r["seed"]) for r in rows] == [(m, str(s)) for m in METHODS for s in (0, 1)]
    run = results["runs"][5]  # fp-bma, seed 1
    row = rows[5]
    lam = run["lambda1_summary"]["mean"]
    assert row["λ₁ mean"] == _four(lam) and row["λ₁ median"] == _four(lam - 50)
    decimals = len(_four(lam).partition(".")[2])
    assert row["mean's 95% interval"] == f"[{lam - 200:.{decimals}f}, {lam + 260:.{decimals}f}]"
    assert "median's 95% interval" not in row  # no row records its per-sample values: no column of "–" only
    assert (row["samples"], row["unconverged"], row["repeatable"]) == ("8", "2", "no")
    assert row["tr Σ"] == f"≈{run['width']['trace_cov']:.3f}"  # estimated from samples (exact: false)
    assert rows[0]["tr Σ"] == f"{results['runs'][0]['width']['trace_cov']:.3f}"
    assert row["λ₁ at mean"] == _four(lam / 2) and row["Hessian trace"] == "5002"
    assert "Hessian on 100 training examples" in md and "un-augmented training images in a fixed order" in md
    assert "bootstrap 95% interval" in md
    assert "- measurement repeatability, sgd: repeatable on 2 of 2 seeds" in md
    assert "- measurement repeatability, fp-bma: repeatable on 1 of 2 seeds" in md
    # the summary table carries the width beside λ₁
    summary = _table_rows(md, "Results …")
    assert list(summary["sgd"])[7:10] == ["λ₁ median", "λ₁ mean", "tr Σ"]


def test_best_value_per_column_is_bold_respecting_its_direction(tmp_path):
    results = _protocol_results()
    write_reports(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    rows = _table_rows(md, "Results …", bold=True)
    means = {
        key: {m: statistics.mean(_values(results, m, key).values()) for m in METHODS}
        for key in ("accuracy", "nll", "ece", "brier", "lambda1")
    }
    for key, label, pick in [("accuracy", "accuracy", max), ("nll", "NLL", min), ("ece", "ECE", min)]:
        best = pick(means[key], key=means[key].get)
        for m in METHODS:
            assert rows[m][label].startswith("**") == (m == best), (label, m)
    assert not any(rows[m]["λ₁ median"].startswith("**") or rows[m]["tr Σ"].startswith("**") for m in METHODS)
    assert all(rows[m]["AECE"].startswith("**") for m in METHODS)  # a tie: every best is bold
    page = (tmp_path / "report.html").read_text()
    assert "<td><b>" in page


@pytest.fixture
def figures_as_objects(monkeypatch):
    """Figure functions return the matplotlib Figure instead of its PNG."""
    monkeypatch.setattr(figures, "_png", lambda fig: fig)


def test_lambda1_figure_draws_the_intervals(figures_as_objects):
    results = _protocol_results(seeds=(0, 1, 2))
    fig = lambda1_figure(results)
    (ax,) = fig.axes
    segments = [
        tuple(map(tuple, seg))
        for c in ax.containers
        if hasattr(c, "lines")
        for col in c.lines[2]
        for seg in col.get_segments()
    ]
    for m in METHODS:  # the bar's error bar: the t interval over seeds of the runs' medians
        medians = [r["lambda1_summary"]["median"] for r in results["runs"] if r["method"] == m]
        s = scipy_stats.t.interval(
            0.95, 2, loc=statistics.mean(medians), scale=statistics.stdev(medians) / math.sqrt(3)
        )
        assert any(seg[0][1] == pytest.approx(s[0]) and seg[1][1] == pytest.approx(s[1]) for seg in segments)


def test_reliability_diagrams_show_bin_counts(figures_as_objects):
    fig = reliability_figure(_results())
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["10", "30", "60"]  # the non-empty bins of the first seed


def test_a_single_severity_is_not_a_line_from_clean(figures_as_objects):
    results = _results()
    for run in results["runs"]:
        for per in run["corruptions"].values():
            del per["1"]
    fig = corruption_figure(results)
    for ax in fig.axes:
        assert all(line.get_linestyle() in ("None", "none", "") for line in ax.get_lines())
        assert [t.get_text() for t in ax.get_xticklabels()] == ["clean", "3"]
    fig = corruption_figure(_results())  # two severities: a curve over severities
    assert any(line.get_linestyle() == "-" for line in fig.axes[0].get_lines())


def test_lambda1_axis_is_logarithmic_only_when_the_runs_span_a_decade(figures_as_objects):
    results = _protocol_results(seeds=(0, 1, 2))
    assert lambda1_figure(results).axes[0].get_yscale() == "linear"
    values = [r["lambda1"] for r in results["runs"]]
    results["runs"][0]["lambda1"] = 11 * max(values)  # one heavy-tailed run mean
    results["runs"][0].pop("lambda1_summary", None)
    assert lambda1_figure(results).axes[0].get_yscale() == "log"


# --------------------------------------------------------------------------------------------------
# reports that cannot mislead (#25 item 4): the median λ₁, heavy tails, best marks, bounded intervals,
# selection and temperature, no empty or duplicate columns

# FP-BMA's per-sample λ₁ in the demo: one sharp sample at 278k, the others near 2k (README's numbers)
HEAVY = [1650.0, 1790.0, 1880.0, 1926.0, 1926.0, 2010.0, 2240.0, 278_000.0]


def _heavy_run(method, seed, values=HEAVY):
    """A protocol run whose per-sample λ₁ are recorded, as flatbma compare writes them."""
    import numpy as np

    summary = {
        "n": len(values),
        "mean": statistics.mean(values),
        "std": statistics.stdev(values),
        "median": statistics.median(values),
        "interval": {"low": 1640.0, "high": 105_786.0, "level": 0.95},
        "method": "bootstrap",
    }
    return {
        "method": method,
        "seed": seed,
        "accuracy": 0.9,
        "nll": 0.3,
        "lambda1": summary["mean"],
        "lambda1_summary": summary,
        "hessian_top_eigenvalues": [[v] for v in values] + [[9e9]],  # the last one did not converge
        "hessian_eigenvalue_converged": [[True] for _ in values] + [[False]],
        "width": {"trace_cov": 3.07, "median_std": 0.0072, "exact": True},
        "repeatability": {
            "agree": True,  # as recorded by flatbma before the heavy-tail rule: within the wide interval
            "first": summary,
            "second": {
                "n": 8,
                "mean": 1979.0,
                "median": 1900.0,
                "std": 400.0,
                "interval": {"low": 1463.0, "high": 2771.0, "level": 0.95},
                "method": "bootstrap",
            },
        },
        "_median_interval": scipy_stats.bootstrap(
            (np.asarray(values),),
            np.median,
            confidence_level=0.95,
            n_resamples=2000,
            method="percentile",
            rng=np.random.default_rng(0),
        ).confidence_interval,
    }


def test_the_lambda1_column_is_the_median_with_its_bootstrap_interval_and_the_mean_beside_it(tmp_path):
    run = _heavy_run("fp-bma", 0)
    ci = run.pop("_median_interval")
    results = {"runs": [run, {**_heavy_run("swag", 0, [1500.0, 1673.0, 1700.0, 1800.0]), "accuracy": 0.8}]}
    results["runs"][1].pop("_median_interval")
    write_reports(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    rows = _table_rows(md, "Results (one seed; no interval)")
    assert rows["fp-bma"]["λ₁ median"] == f"1926 [{ci.low:.0f}, {ci.high:.0f}]"  # not the mean 36,647
    assert rows["fp-bma"]["λ₁ mean"] == _four(statistics.mean(HEAVY))
    assert list(rows["fp-bma"])[-3:] == ["λ₁ median", "λ₁ mean", "tr Σ"]
    flat = _table(tmp_path / "report.md", "Flatness per run …")
    assert flat[0]["λ₁ median"] == "1926" and flat[0]["median's 95% interval"] == f"[{ci.low:.0f}, {ci.high:.0f}]"
    assert flat[0]["λ₁ mean"] == _four(statistics.mean(HEAVY)) and flat[0]["mean's 95% interval"] == "[1640, 105786]"
    # over seeds: the mean ± std [t interval] of the runs' medians; the findings compare medians too
    runs = [
        _heavy_run(m, s, [v * (1 + 0.1 * s + 0.3 * k) for v in HEAVY]) for k, m in enumerate(METHODS) for s in (0, 1, 2)
    ]
    for r in runs:
        r.pop("_median_interval")
    results = {"runs": runs}
    write_reports(results, tmp_path)
    rows = _table_rows((tmp_path / "report.md").read_text(), "Results …")
    _check_cell(rows["swag"]["λ₁ median"], [r["lambda1_summary"]["median"] for r in runs if r["method"] == "swag"])
    found = next(c for c in comparisons(results) if c.method == "swag" and c.metric.key == "lambda1")
    medians = {r["seed"]: r["lambda1_summary"]["median"] for r in runs}
    assert found.metric.label == "λ₁ median"
    assert found.difference.mean == pytest.approx(
        statistics.mean(r["lambda1_summary"]["median"] for r in runs if r["method"] == "swag")
        - statistics.mean(r["lambda1_summary"]["median"] for r in runs if r["method"] == "sgd")
    )
    assert medians


def test_lambda1_figure_draws_the_median_with_the_bootstrap_interval_of_the_median(figures_as_objects):
    run = _heavy_run("fp-bma", 0)
    ci = run.pop("_median_interval")
    fig = lambda1_figure({"runs": [run]})
    (ax,) = fig.axes
    segments = [
        tuple(map(tuple, seg))
        for c in ax.containers
        if hasattr(c, "lines")
        for col in c.lines[2]
        for seg in col.get_segments()
    ]
    assert any(seg[0][1] == pytest.approx(ci.low) and seg[1][1] == pytest.approx(ci.high) for seg in segments)
    points = [tuple(line.get_xydata()[0]) for line in ax.get_lines() if len(line.get_xydata()) == 1]
    assert (0.0, 1926.0) in points  # the run's dot: its median
    assert (0.0, pytest.approx(statistics.mean(HEAVY))) in points  # its mean, marked beside it
    bars = [p.get_height() for p in ax.patches]
    assert bars == [1926.0]  # not the mean 36,647
    assert "median" in " ".join(t.get_text() for t in ax.get_legend().get_texts())


def test_a_heavy_tail_is_not_repeatable(tmp_path):
    from flatbma.flatness.posterior import repeatability, repeatable

    run = _heavy_run("fp-bma", 0)
    run.pop("_median_interval")
    rep = run["repeatability"]
    fresh = repeatability(rep["first"], rep["second"], tol=1e-3)
    assert fresh["agree"] and not fresh["repeatable"]  # within the intervals, yet means 36,647 vs 1,979
    assert fresh["mean_ratio"] == pytest.approx(statistics.mean(HEAVY) / 1979.0)
    assert fresh["median_ratio"] == pytest.approx(1926.0 / 1900.0)
    assert repeatable(rep) is False  # a record written before the rule: the ratios from its summaries
    assert repeatable({**rep, "second": {**rep["first"]}}) is True
    assert repeatable({}) is None
    write_reports({"runs": [run]}, tmp_path)
    md = (tmp_path / "report.md").read_text()
    (row,) = _table(tmp_path / "report.md", "Flatness per run …")
    assert row["repeatable"] == "no"
    line = next(x for x in md.splitlines() if x.startswith("- measurement repeatability, fp-bma"))
    assert "fp-bma: not repeatable" in line and f"heavy tail: means {statistics.mean(HEAVY):.0f} and 1979" in line
    assert "differ by more than a factor 2" in line


def test_no_cell_is_marked_best_without_two_seeds(tmp_path):
    write_reports(_protocol_results(seeds=(0,)), tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "**" not in "\n".join(x for x in md.splitlines() if x.startswith("|"))
    assert "<td><b>" not in (tmp_path / "report.html").read_text()
    assert "No cell is marked best" in md
    # a method with one seed beside methods with three: no best in the columns it has a value in
    results = _protocol_results(seeds=(0, 1, 2))
    results["runs"] = [r for r in results["runs"] if r["method"] != "fp-bma" or r["seed"] == 0]
    write_reports(results, tmp_path)
    rows = _table_rows((tmp_path / "report.md").read_text(), "Results …", bold=True)
    assert not any(cell.startswith("**") for row in rows.values() for cell in row.values())


def test_intervals_of_bounded_metrics_are_clipped_to_their_range(tmp_path, monkeypatch):
    results = _results()
    for run, acc, ece in zip(results["runs"], (0.99, 1.0, 0.9, 0.95), (0.001, 0.02, 0.05, 0.06)):
        run.update(accuracy=acc, ece=ece, lambda1=5.0 if run["seed"] == 0 else 120.0)
    write_reports(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    rows = _table_rows(md, "Results (mean ± std and 95% t interval over 2 seeds)")
    assert rows["SWAG"]["accuracy"].endswith(", 1.0000]")  # t interval 0.995 ± 0.064, cut at 1
    assert rows["SWAG"]["ECE"].startswith("0.0105") and "[0.0000, " in rows["SWAG"]["ECE"]  # cut at 0
    assert rows["SWAG"]["λ₁ mean"].split(" [")[1].startswith("-")  # λ₁ is not bounded: never clipped
    assert "clipped to their range" in md and "λ₁, the top eigenvalue of a Hessian that can be indefinite" in md
    # the corruption tables too, and the figures' bands
    for table in ("accuracy", "ECE"):
        for row in _table_rows(md, f"Corrupted test sets: {table} …").values():
            for cell in list(row.values())[1:]:
                if " [" in cell:
                    low, high = _parse(cell)[2]
                    assert 0.0 <= low <= high <= 1.0
    monkeypatch.setattr(figures, "_png", lambda fig: fig)
    fig = bma_curve_figure(results)
    accuracy_axis = fig.axes[1]
    for band in accuracy_axis.collections:
        ys = [y for path in band.get_paths() for _, y in path.vertices]
        assert max(ys) <= 1.0 + 1e-12
    fig = corruption_figure(results)
    for ax in (fig.axes[0], fig.axes[2]):  # accuracy, ECE
        for band in ax.collections:
            ys = [y for path in band.get_paths() for _, y in path.vertices]
            assert min(ys) >= -1e-12 and max(ys) <= 1.0 + 1e-12


def _selected(run, chosen_rho):
    run["selection"] = {
        "criterion": "val_nll",
        "candidates": [
            {"options": {"rho": rho}, "val_nll": nll, "train_time_s": 1.0, "error": None}
            for rho, nll in ((0.01, 0.61), (0.05, 0.52), (0.1, 0.58))
        ]
        + [{"options": {"rho": 0.5}, "val_nll": None, "train_time_s": None, "error": "diverged at step 3"}],
        "chosen": {"rho": chosen_rho},
    }
    run["temperature"] = 1.7
    run["temperature_scaled"] = {"accuracy": run["accuracy"], "nll": 0.41, "ece": 0.012, "aece": 0.011, "brier": 0.2}
    return run


def test_the_chosen_candidates_and_temperature_scaled_metrics_are_in_the_report(tmp_path):
    results = _results()
    for run in results["runs"]:
        _selected(run, 0.05)
    write_reports(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    page = (tmp_path / "report.html").read_text()
    rows = _table(tmp_path / "report.md", "Hyperparameters chosen on the validation split")
    assert [(r["method"], r["seed"]) for r in rows] == [("SWAG", "0"), ("SWAG", "1"), ("F-SWAG", "0"), ("F-SWAG", "1")]
    assert rows[0]["chosen"] == "rho=0.05" and rows[0]["validation NLL"] == "0.5200" and rows[0]["candidates"] == "4"
    assert "rho=0.05: 0.5200 (chosen)" in rows[0]["every candidate's validation NLL"]
    assert "rho=0.5: diverged" in rows[0]["every candidate's validation NLL"]
    scaled = _table_rows(md, "Temperature-scaled test metrics …")
    assert scaled["SWAG"]["T"] == "1.700 ± 0.000 [1.700, 1.700]"
    assert scaled["SWAG"]["NLL"].startswith("0.4100") and scaled["SWAG"]["ECE"].startswith("0.0120")
    assert "Hyperparameters chosen on the validation split" in page and "Temperature-scaled test metrics" in page


def test_no_empty_or_duplicate_columns(tmp_path):
    results = _results()
    for run in results["runs"]:
        run["distribution_lambda1"] = None  # e.g. eval.distribution_spectrum off: every run lacks it
        for per in run["corruptions"].values():
            del per["1"]
    write_reports(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "λ₁ of the mean Hessian" not in md
    cost = _table_rows(md, "Flatness of the distribution and cost …")
    assert list(cost["SWAG"]) == ["method", "seeds", "SAM sharpness", "train time (s)", "eval time (s)"]
    corrupted = _table_rows(md, "Corrupted test sets: accuracy …")
    assert list(corrupted["SWAG"]) == ["method", "severity 3"]  # one severity: no "all severities" copy of it
    tables = md.split("\n## ")
    for table in tables:
        body = [x for x in table.splitlines() if x.startswith("|")]
        if len(body) < 3:
            continue
        header = [c.strip() for c in body[0].strip("|").split("|")]
        cells = [[c.strip() for c in x.strip("|").split("|")] for x in body[2:]]
        for j, name in enumerate(header[1:], 1):
            assert name == "tr Σ" or any(row[j] != MISSING for row in cells), (table.splitlines()[0], name)


def test_a_paired_difference_of_a_bounded_metric_stays_within_its_range():
    results = _protocol_results(seeds=(0, 1, 2))
    for r in results["runs"]:
        if r["method"] == "swag":  # accuracy 1.0, 0.0, 1.0 against sgd's ~0.7: differences of ±1 at most
            r["accuracy"] = [1.0, 0.0, 1.0][r["seed"]]
    c = next(c for c in comparisons(results) if c.method == "swag" and c.metric.key == "accuracy")
    a = [1.0, 0.0, 1.0]
    b = [r["accuracy"] for r in results["runs"] if r["method"] == "sgd"]
    t = scipy_stats.ttest_rel(a, b).confidence_interval(0.95)
    assert t.low < -1 and t.high > 1  # Student's t reaches past what a difference of accuracies can be
    assert (c.difference.interval.low, c.difference.interval.high) == (-1.0, 1.0)
    # the detectable difference is not clipped: past the range of a difference it says that none was detectable
    d = [x - y for x, y in zip(a, b)]
    assert c.difference.detectable == pytest.approx(DETECTABLE_PER_S[3] * statistics.stdev(d), rel=1e-10)
    assert c.difference.detectable > 1
    assert c.verdict == f"no difference larger than {c.difference.detectable:.1f} detected"  # the interval's decimals
    nll = next(c for c in comparisons(results) if c.method == "swag" and c.metric.key == "nll")
    assert nll.difference.interval.high - nll.difference.interval.low < 2  # untouched: within its range anyway
