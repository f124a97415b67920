"""``compare.pairs``: paired differences a − b of listed pairs, besides the reference's; the reports and the CLI."""

import dataclasses
import json
import math
import statistics

import pytest
import yaml
from scipy import stats as scipy_stats

from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.report.documents import write_reports
from flatbma.experiment.report.findings import findings, pair_comparisons
from flatbma.experiment.study.plan import CompareConfig, compare_record, load_plan
from flatbma.options import parse_dataclass
from tests.helpers import DETECTABLE_PER_S, DONE

NOISE = (0.013, -0.021, 0.008, 0.017, -0.004)
SEEDS = {"sgd": (0, 1, 2, 3), "swag": (0, 1, 2, 3), "multiswag": (1, 2, 3, 4), "laplace": (0, 1, 2, 3)}
PAIRS = [["multiswag", "swag"], ["laplace", "sgd"], ["sgd", "laplace"]]


def _run(method, seed, k):
    """A run whose numbers differ between methods by a shift (k) and seed-to-seed noise that is not shared."""
    e = NOISE[(seed + 2 * k) % len(NOISE)]
    lam = 1000.0 + 400.0 * k + 20000.0 * e
    return {
        "method": method,
        "seed": seed,
        "accuracy": 0.70 + 0.1 * k + e,
        "nll": 0.90 - 0.002 * k + 3 * e,
        "ece": 0.05 + 0.01 * k + e / 10,
        "brier": 0.35 - 0.001 * k + e,
        "lambda1_summary": {"n": 4, "mean": lam, "median": lam},
        "width": {"trace_cov": 2.0 + k + e},
    }


def _results(pairs=PAIRS):
    runs = [_run(m, s, k) for k, (m, seeds) in enumerate(SEEDS.items()) for s in seeds]
    compare = {"reference": None} if pairs is None else {"reference": None, "pairs": pairs}
    return {"config_hash": "abc", "created": "2024-01-01T00:00:00", "compare": compare, "runs": runs}


def _value(run, metric):
    if metric == "lambda1":
        return run["lambda1_summary"]["median"]
    if metric == "trace_cov":
        return run["width"]["trace_cov"]
    return run[metric]


def test_pair_differences_equal_an_independent_computation():
    results = _results()
    found = findings(results)
    assert [(c["method"], c["reference"]) for c in found["pairs"][::6]] == [tuple(p) for p in PAIRS]
    for c in found["pairs"]:
        a = {r["seed"]: _value(r, c["metric"]) for r in results["runs"] if r["method"] == c["method"]}
        b = {r["seed"]: _value(r, c["metric"]) for r in results["runs"] if r["method"] == c["reference"]}
        seeds = sorted(set(a) & set(b))  # multiswag's seed 4 and swag's seed 0 have no partner: dropped
        assert c["seeds"] == seeds and c["n"] == len(seeds)
        xs, ys = [a[s] for s in seeds], [b[s] for s in seeds]
        ci = scipy_stats.ttest_rel(xs, ys).confidence_interval(0.95)
        assert c["mean"] == pytest.approx(statistics.mean(x - y for x, y in zip(xs, ys)), abs=1e-12)
        assert (c["interval"]["low"], c["interval"]["high"]) == pytest.approx((ci.low, ci.high), abs=1e-9)
        assert c["significant"] == (not ci.low <= 0 <= ci.high)
        s = statistics.stdev(x - y for x, y in zip(xs, ys))
        assert c["detectable"] == pytest.approx(DETECTABLE_PER_S[len(seeds)] * s, rel=1e-10)
        if not c["significant"]:
            assert c["verdict"].startswith("no difference larger than ") and c["verdict"].endswith(" detected")
        assert c["text"].startswith(f"{c['method']} vs {c['reference']}: {c['label']} ")
    multi = [c for c in found["pairs"] if c["method"] == "multiswag"]
    assert {tuple(c["seeds"]) for c in multi} == {(1, 2, 3)}
    # a − b is −(b − a): the pair and its reverse agree
    there = {c["metric"]: c for c in found["pairs"] if c["method"] == "laplace"}
    back = {c["metric"]: c for c in found["pairs"] if c["method"] == "sgd"}
    for key, c in there.items():
        assert c["mean"] == pytest.approx(-back[key]["mean"], abs=1e-12)
    assert {c["verdict"].split(" than ")[0] for c in found["pairs"]} >= {"better", "worse", "no difference larger"}
    # the findings list the pairs after the reference's, once: laplace − sgd is already a reference comparison
    assert found["text"][: len(found["comparisons"])] == [c["text"] for c in found["comparisons"]]
    added = found["text"][len(found["comparisons"]) :]
    assert added == [c["text"] for c in found["pairs"] if c["reference"] != "sgd"]
    assert json.loads(json.dumps(found)) == found


def test_a_pair_with_one_common_seed_claims_nothing():
    results = _results([["multiswag", "swag"]])
    results["runs"] = [r for r in results["runs"] if r["method"] != "swag" or r["seed"] == 1]
    found = findings(results)
    assert all(c["n"] == 1 and c["verdict"] == "no comparison claimed (one seed)" for c in found["pairs"])
    assert "multiswag vs swag: fewer than two seeds in common: no comparison claimed" in found["text"]


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        (
            [["multiswag", "swag"], ["sgd", "x"]],
            "compare.pairs[1] names 'x', which is not a compared method (sgd, swag, multiswag, laplace).",
        ),
        (
            [["multiswg", "swag"]],
            "compare.pairs[0] names 'multiswg', which is not a compared method (sgd, swag, multiswag, laplace). "
            "Did you mean 'multiswag'?",
        ),
        ([["swag", "swag"]], "compare.pairs[0] compares 'swag' with itself: name two different methods"),
        (
            [["sgd", "swag"], ["sgd", "swag"]],
            "compare.pairs[1] repeats an earlier pair ['sgd', 'swag']: list each pair once",
        ),
        ([["sgd"]], "compare.pairs[0] must be a list of 2 values, got ['sgd']"),
        ("sgd", "compare.pairs must be a list, got 'sgd'"),
    ],
)
def test_bad_pairs_are_refused_at_load_in_one_line(pairs, message):
    methods = [{"name": m} for m in SEEDS]
    with pytest.raises(FlatbmaError) as e:
        parse_dataclass(CompareConfig, {"methods": methods, "pairs": pairs}, "compare")
    assert str(e.value) == message  # named once: not "compare: compare.pairs..."


def test_bad_pairs_in_results_are_refused():
    results = _results([["laplace", "sfd"]])
    with pytest.raises(FlatbmaError, match=r"compare\.pairs\[0\] names 'sfd', which is not a compared method"):
        findings(results)
    with pytest.raises(FlatbmaError, match=r"compare\.pairs\[0\]"):
        write_reports(results, "/nonexistent/never-written")


def test_the_reference_error_names_its_key_once():
    methods = [{"name": "sgd"}, {"name": "swag"}]
    with pytest.raises(FlatbmaError) as e:
        parse_dataclass(CompareConfig, {"methods": methods, "reference": "swg"}, "compare")
    assert str(e.value).startswith("compare.reference 'swg' is not a compared method.")
    with pytest.raises(FlatbmaError) as e:  # a message that does not name its key keeps the section's prefix
        parse_dataclass(CompareConfig, {"methods": methods, "corruptions": ["fog!"]}, "compare")
    assert str(e.value).startswith("compare: unknown corruption 'fog!'.")


def _without_pairs_parts(md, found):
    """``md`` with what pairs add removed: the header line, their findings lines, their table, the note's words."""
    lines = md.splitlines()
    text = set(found["text"][len(found["comparisons"]) :])
    lines = [line for line in lines if not line.startswith("- **pairs**: ") and line[2:] not in text]
    start = lines.index(next(line for line in lines if line.startswith("## Paired differences (each listed pair")))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    out = "\n".join(lines[:start] + lines[end:]) + "\n"
    return out.replace(" and a − b for each pair of compare.pairs;", "")


def test_without_pairs_the_report_is_unchanged_and_pairs_only_add(tmp_path):
    plain, listed = _results(None), _results([["multiswag", "swag"], ["sgd", "laplace"]])
    found = findings(plain)
    assert "pairs" not in found and findings(_results([])) == found
    assert pair_comparisons(plain) == []
    write_reports(plain, tmp_path / "plain")
    write_reports(listed, tmp_path / "listed")
    md = (tmp_path / "plain" / "report.md").read_text()
    assert "pairs" not in md and "Paired differences (each" not in md
    with_pairs = (tmp_path / "listed" / "report.md").read_text()
    assert "- **pairs**: multiswag − swag, sgd − laplace" in with_pairs
    assert _without_pairs_parts(with_pairs, findings(listed)) == md.replace(
        "compare:\n  reference: null\n",
        "compare:\n  reference: null\n  pairs:\n  - - multiswag\n    - swag\n  - - sgd\n    - laplace\n",
    )
    page = (tmp_path / "listed" / "report.html").read_text()
    assert "Paired differences (each listed pair a − b" in page and "<td>multiswag − swag</td>" in page


def test_the_pairs_table_holds_the_numbers_bold_where_the_interval_excludes_zero(tmp_path):
    results = _results()
    found = findings(results)
    write_reports(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## Paired differences (each listed pair"))
    header = [c.strip() for c in lines[start + 2].strip("|").split("|")]
    metrics = ["accuracy", "NLL", "ECE", "Brier", "λ₁ median", "tr Σ"]
    assert header == ["pair", "seeds", *(h for m in metrics for h in (m, f"{m} detectable"))]
    rows = {}
    for line in lines[start + 4 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    assert list(rows) == ["multiswag − swag", "laplace − sgd", "sgd − laplace"]
    for c in found["pairs"]:
        cell = rows[f"{c['method']} − {c['reference']}"][c["label"]]
        assert cell.startswith("**") == c["significant"]
        mean, _, interval = cell.strip("*").partition(" [")
        low, high = (float(x.replace("−", "-")) for x in interval.rstrip("]").split(", "))
        decimals = len(interval.split(", ")[0].partition(".")[2])
        tol = 0.5 * 10**-decimals + 1e-12
        assert float(mean.replace("−", "-")) == pytest.approx(c["mean"], abs=tol, rel=0)
        assert (low, high) == pytest.approx((c["interval"]["low"], c["interval"]["high"]), abs=tol, rel=0)
        detectable = rows[f"{c['method']} − {c['reference']}"][f"{c['label']} detectable"]  # the interval's decimals
        assert len(detectable.partition(".")[2]) == decimals and not detectable.startswith("**")
        assert float(detectable) == pytest.approx(c["detectable"], abs=tol, rel=0)
    assert rows["multiswag − swag"]["seeds"] == "3"


CONFIG = {
    "data": {"name": "digits", "batch_size": 64, "test_limit": 120, "k_shot": 10},
    "model": {"name": "mlp"},
    "optim": {"lr": 0.05},
    "train": {"epochs": 1, "progress": False},
    "eval": {"num_samples": 2},
    "compare": {
        "methods": [
            {"name": "sgd"},
            {"name": "sam", "rho": 0.05},
            {"name": "sgd", "label": "sgd-2", "optim": {"lr": 0.1}},
        ],
        "seeds": [0, 1],
        "bma_curve": [1, 2],
        "flatness": False,
        "landscape": False,
        "pairs": [["sam", "sgd-2"]],
        "quick": {"methods": ["sam", "sgd-2"]},
    },
}


def _write(tmp_path, cfg, name="c.yaml"):
    cfg = {**json.loads(json.dumps(cfg)), "output_dir": str(tmp_path / "out")}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_pairs_stay_out_of_the_caches_and_quick_drops_a_pair_left_out(tmp_path):
    listed = load_plan(_write(tmp_path, CONFIG))
    plain_cfg = json.loads(json.dumps(CONFIG))
    del plain_cfg["compare"]["pairs"]
    plain = load_plan(_write(tmp_path, plain_cfg, "plain.yaml"))
    assert listed.compare.pairs == (("sam", "sgd-2"),) and plain.compare.pairs == ()
    assert listed.fingerprint() == plain.fingerprint() and listed.study() == plain.study()
    assert [listed.row_key(j) for j in listed.jobs()] == [plain.row_key(j) for j in plain.jobs()]
    record = compare_record(plain.compare)  # what results.json and compare_config.yaml hold without pairs
    assert list(record) == [f.name for f in dataclasses.fields(CompareConfig) if f.name != "pairs"]
    assert compare_record(listed.compare)["pairs"] == (("sam", "sgd-2"),)
    assert load_plan(_write(tmp_path, CONFIG), quick=True).compare.pairs == (("sam", "sgd-2"),)
    quick = load_plan(_write(tmp_path, CONFIG), ["compare.quick.methods=[sgd, sam]"], quick=True)
    assert [m["name"] for m in quick.compare.methods] == ["sgd", "sam", "sgd"]  # quick keeps entries by name too
    quick = load_plan(_write(tmp_path, CONFIG), ["compare.quick.methods=[sam]"], quick=True)
    assert quick.compare.pairs == ()  # sgd-2 is left out: its pair is dropped, like a left-out reference


def test_cli_compare_with_pairs_writes_them_and_reuses_every_row_without(tmp_path, capsys):
    path = _write(tmp_path, CONFIG)
    assert main(["compare", "--config", str(path), "--quiet"]) in DONE, capsys.readouterr().err
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text())
    assert results["compare"]["pairs"] == [["sam", "sgd-2"]]
    pairs = results["findings"]["pairs"]
    assert {(c["method"], c["reference"]) for c in pairs} == {("sam", "sgd-2")}
    nll = next(c for c in pairs if c["metric"] == "nll")
    a = {r["seed"]: r["nll"] for r in results["runs"] if r["method"] == "sam"}
    b = {r["seed"]: r["nll"] for r in results["runs"] if r["method"] == "sgd-2"}
    assert nll["seeds"] == [0, 1] and nll["mean"] == pytest.approx((a[0] - b[0] + a[1] - b[1]) / 2, abs=1e-12)
    half = scipy_stats.t.ppf(0.975, 1) * statistics.stdev([a[0] - b[0], a[1] - b[1]]) / math.sqrt(2)
    assert nll["interval"]["high"] - nll["interval"]["low"] == pytest.approx(2 * half, rel=1e-9)
    md = (out / "report.md").read_text()
    assert "## Paired differences (each listed pair a − b" in md and "| sam − sgd-2 | 2 |" in md
    assert "Paired differences (each listed pair" in (out / "report.html").read_text()

    # the same study without pairs: every row is reused, and nothing of the pairs is written
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/compare.json")}
    plain = json.loads(json.dumps(CONFIG))
    del plain["compare"]["pairs"]
    assert main(["compare", "--config", str(_write(tmp_path, plain)), "--quiet"]) in DONE
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/compare.json")} == stamps
    again = json.loads((out / "results.json").read_text())
    assert again["runs"] == results["runs"] and again["config_hash"] == results["config_hash"]
    assert "pairs" not in again["compare"] and "pairs" not in again["findings"]
    assert "pairs" not in yaml.safe_load((out / "compare_config.yaml").read_text())["compare"]
    assert "Paired differences (each" not in (out / "report.md").read_text()


REGRESSION = ("nll", "rmse", "mae", "coverage_0.9", "calibration_error")
REGRESSION_LABELS = ("NLL", "RMSE", "MAE", "coverage 0.9", "calibration error")


def _regression_run(method, seed, k):
    e = NOISE[(seed + 2 * k) % len(NOISE)]
    return {
        "method": method,
        "seed": seed,
        "likelihood": "gaussian",
        "nll": 1.2 - 0.05 * k + 3 * e,
        "rmse": 0.80 - 0.03 * k + e,
        "mae": 0.60 - 0.02 * k + e,
        "coverage_0.5": 0.5,
        "coverage_0.9": 0.85 + 0.04 * k + e,
        "coverage_0.95": 0.9,
        "calibration_error": 0.05 - 0.01 * k + e / 10,
    }


def test_regression_rows_pair_rmse_mae_coverage_and_calibration_beside_nll(tmp_path):
    """Regression rows (model.likelihood: gaussian) are compared on NLL, RMSE, MAE, coverage 0.9 and calibration
    error, each with the paired t interval scipy computes; a coverage, best at its level, reads "covers more/less"."""
    runs = [_regression_run(m, s, k) for k, m in enumerate(("sgd", "swag", "mfvi")) for s in range(4)]
    results = {
        "config_hash": "abc",
        "created": "2024-01-01T00:00:00",
        "compare": {"reference": None, "pairs": [["mfvi", "swag"]]},
        "runs": runs,
    }
    found = findings(results)
    for group, expected in (("comparisons", [("swag", "sgd"), ("mfvi", "sgd")]), ("pairs", [("mfvi", "swag")])):
        got = found[group]
        assert [(c["method"], c["reference"], c["metric"]) for c in got] == [
            (a, b, m) for a, b in expected for m in REGRESSION
        ]
        for c in got:
            xs = [r[c["metric"]] for r in runs if r["method"] == c["method"]]
            ys = [r[c["metric"]] for r in runs if r["method"] == c["reference"]]
            ci = scipy_stats.ttest_rel(xs, ys).confidence_interval(0.95)
            assert c["n"] == 4 and c["mean"] == pytest.approx(statistics.mean(xs) - statistics.mean(ys), abs=1e-12)
            assert (c["interval"]["low"], c["interval"]["high"]) == pytest.approx((ci.low, ci.high), abs=1e-9)
            assert c["significant"] == (not ci.low <= 0 <= ci.high)
            if c["metric"] == "coverage_0.9":
                assert c["reading"] == "best at the level"
                # coverage grows with k here
                assert c["verdict"] == "covers more" or c["verdict"].startswith("no difference larger than")
            elif c["significant"]:
                assert c["verdict"] == "better"  # every other metric falls with k: lower is better
    assert any(c["verdict"] == "covers more" for c in found["comparisons"])
    write_reports(results, tmp_path)
    report = (tmp_path / "report.md").read_text()
    compared = "| seeds | " + " | ".join(f"{m} | {m} detectable" for m in REGRESSION_LABELS) + " |"
    assert f"| method {compared}" in report.splitlines()  # the differences from the reference
    assert f"| pair {compared}" in report.splitlines()  # compare.pairs'
