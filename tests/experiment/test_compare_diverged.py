"""A diverged row in ``flatbma compare``: a failed row, recorded and reused, left out of every mean and pair.

End to end on digits (a small MLP, one epoch): a row whose learning rate makes its training diverge does not
stop the comparison; ``results.json`` holds it with its error, ``report.md`` says it diverged, a rerun reuses
its record (nothing trained again), ``--force`` trains it again, and a row width-matched to it is failed
too. On synthetic results: the paired differences pair only the seeds both methods have numbers for, checked
against an independent computation, and the means leave the diverged seed out.
"""

import json
import statistics
from pathlib import Path

import pytest
import yaml
from scipy import stats as scipy_stats

from flatbma.experiment.cli import main
from flatbma.experiment.report.documents import write_reports
from flatbma.experiment.report.findings import findings
from flatbma.experiment.report.tables import report_tables, summary_table
from flatbma.experiment.run import pipeline
from flatbma.experiment.study import compare

HOT = {"name": "swag", "label": "swag-hot", "rank": 3, "start_step": 0, "collect_every": 1, "optim": {"lr": 1.0e6}}
CONFIG = {
    "output_dir": None,
    "data": {"name": "digits", "batch_size": 64, "test_limit": 100, "k_shot": 20, "val_per_class": 3},
    "model": {"name": "mlp"},
    "optim": {"lr": 0.05},
    "train": {"epochs": 1, "progress": False},
    "eval": {
        "num_samples": 2,
        "flatness_samples": 2,
        "hessian_examples": 32,
        "hessian_max_iter": 8,
        "trace": False,
        "distribution_spectrum": False,
        "repeatability": False,
    },
    "compare": {
        "methods": [
            {"name": "sgd"},
            HOT,
            {"name": "lowrank-vi", "label": "vi-as-hot", "rank": 3, "init_std": 0.01, "match_width": "swag-hot"},
        ],
        "seeds": [0],
        "corruptions": [],
        "bma_curve": [1],
        "landscape": False,
    },
}


def _write(tmp_path):
    cfg = json.loads(json.dumps(CONFIG))
    cfg["output_dir"] = str(tmp_path / "out")
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_a_diverged_row_is_recorded_reused_and_the_comparison_goes_on(tmp_path, capsys, monkeypatch):
    trained = []
    train = pipeline.train

    def counting(cfg, **kwargs):
        trained.append(cfg.output_dir)
        return train(cfg, **kwargs)

    monkeypatch.setattr(compare, "train", counting)
    config = _write(tmp_path)
    assert main(["compare", "--config", config]) == 3  # a row diverged
    out = tmp_path / "out"
    runs = json.loads((out / "results.json").read_text())["runs"]
    ok, hot, twin = runs
    assert "error" not in ok and 0 <= ok["accuracy"] <= 1
    assert set(hot) == {"method", "method_options", "optim", "prior", "seed", "run_dir", "error"}
    assert hot["method"] == "swag-hot" and hot["seed"] == 0 and "loss became nan" in hot["error"]
    assert hot["optim"]["lr"] == 1.0e6
    assert twin["method"] == "vi-as-hot" and twin["error"] == "its width reference swag-hot seed 0 diverged"
    assert "accuracy" not in twin
    record = json.loads((Path(hot["run_dir"]) / compare.ROW_ERROR).read_text())
    assert record["result"]["error"] == hot["error"] and record["data"] and record["config"]["optim"]["lr"] == 1.0e6
    assert not (Path(hot["run_dir"]) / compare.RUN_CACHE).exists()
    report = (out / "report.md").read_text()
    failed = "swag-hot seed 0, vi-as-hot seed 0"
    assert f"- **diverged**: 2 (failed rows, in no mean or paired difference: {failed})" in report
    assert "swag-hot: 1 of 1 seed diverged (seed 0; left out of every mean and paired difference)" in report
    assert "| swag-hot | diverged |" in report  # the summary table's row of a method with no seed left
    captured = capsys.readouterr()
    assert "flatbma: warning: swag-hot seed 0 diverged" in captured.err
    assert "vi-as-hot: 1 of 1 seed diverged" in captured.out  # under the summary table on the console
    assert len(trained) == 2  # sgd and swag-hot; the width-matched twin has nothing to be matched to

    # a rerun reuses the failed row's record: nothing is trained again, the rows are the same
    trained.clear()
    assert main(["compare", "--config", config]) == 3
    assert trained == []
    assert json.loads((out / "results.json").read_text())["runs"] == runs
    assert "swag-hot seed 0 diverged" in capsys.readouterr().err
    # --force trains every row again, the diverged one included (it diverges again)
    assert main(["compare", "--config", config, "--force"]) == 3
    assert sorted(trained) == sorted([ok["run_dir"], hot["run_dir"]])
    again = json.loads((out / "results.json").read_text())["runs"]
    assert again[1]["error"] == hot["error"] and again[2]["error"] == twin["error"]


# --------------------------------------------------------------------------------------------------
# the report, on synthetic results: the failed seed is in no mean and no paired difference

NOISE = (0.013, -0.021, 0.008, 0.017, -0.004)


def _run(method, seed, k):
    e = NOISE[(seed + 2 * k) % len(NOISE)]
    return {"method": method, "seed": seed, "accuracy": 0.7 + 0.1 * k + e, "nll": 0.9 + 3 * e, "ece": 0.05 + e / 10}


def _failed(method, seed):
    return {"method": method, "seed": seed, "optim": {"lr": 1.0}, "error": f"{method} blew up at seed {seed}"}


def _results():
    runs = [_run("sgd", s, 0) for s in range(4)]
    runs += [_run("sam", s, 1) for s in (0, 1, 3)] + [_failed("sam", 2)]
    runs += [_failed("hot", s) for s in range(2)]
    compare = {"reference": None, "pairs": [["sam", "sgd"], ["hot", "sgd"]]}
    return {"config_hash": "abc", "created": "2024-01-01T00:00:00", "compare": compare, "runs": runs}


def test_paired_differences_pair_only_the_seeds_both_rows_have_numbers_for():
    results = _results()
    found = findings(results)
    sam = [c for c in found["comparisons"] if c["method"] == "sam"]
    assert {c["metric"] for c in sam} == {"accuracy", "nll", "ece"}
    for c in sam:
        assert c["seeds"] == [0, 1, 3]
        mine = {r["seed"]: r[c["metric"]] for r in results["runs"] if r["method"] == "sam" and "error" not in r}
        theirs = {r["seed"]: r[c["metric"]] for r in results["runs"] if r["method"] == "sgd"}
        xs, ys = [mine[s] for s in (0, 1, 3)], [theirs[s] for s in (0, 1, 3)]
        ci = scipy_stats.ttest_rel(xs, ys).confidence_interval(0.95)
        assert c["mean"] == pytest.approx(statistics.mean(x - y for x, y in zip(xs, ys, strict=True)), abs=1e-12)
        assert (c["interval"]["low"], c["interval"]["high"]) == pytest.approx((ci.low, ci.high), abs=1e-9)
    assert not any(c["method"] == "hot" for c in found["comparisons"])  # no numbers: in no comparison
    assert {(c["method"], c["reference"]) for c in found["pairs"]} == {("sam", "sgd")}  # hot − sgd: no numbers
    assert found["diverged"] == [
        {"method": "sam", "seed": 2, "error": "sam blew up at seed 2"},
        {"method": "hot", "seed": 0, "error": "hot blew up at seed 0"},
        {"method": "hot", "seed": 1, "error": "hot blew up at seed 1"},
    ]
    assert found["text"][:2] == [
        "sam: 1 of 4 seeds diverged (seed 2; left out of every mean and paired difference): sam blew up at seed 2",
        "hot: 2 of 2 seeds diverged (seed 0, 1; left out of every mean and paired difference): hot blew up at seed 0",
    ]


def test_means_leave_the_diverged_seed_out_and_the_reports_say_it(tmp_path):
    results = _results()
    (summary, *_) = report_tables(results)
    rows = {row[0]: row for row in summary.rows}
    sam_acc = statistics.mean(0.8 + NOISE[(s + 2) % len(NOISE)] for s in (0, 1, 3))
    assert summary.header[:3] == ["method", "seeds", "accuracy"]
    assert rows["sam"][1] == "3" and rows["sam"][2].startswith(f"{sam_acc:.4f} ± ")
    assert rows["hot"][1:] == ["diverged"] * (len(summary.header) - 1)
    assert summary.lines[0].startswith("sam: 1 of 4 seeds diverged")
    assert "hot: 2 of 2 seeds diverged" in summary_table(results)
    write_reports(results, tmp_path)
    for name in ("report.md", "report.html"):
        text = (tmp_path / name).read_text()
        assert "sam: 1 of 4 seeds diverged" in text and "hot: 2 of 2 seeds diverged" in text
    with open(tmp_path / "results.csv") as f:
        assert "blew up" not in f.read()  # the CSV has the rows with numbers
