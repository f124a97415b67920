"""End-to-end `flatbma compare` on digits: two methods x two seeds, every output file and key, resume, bad input."""

import csv
import json

import pytest
import yaml

from flatbma.experiment.cli import main
from flatbma.experiment.study.eta import TimeLeft, row_work
from tests.helpers import DONE

CONFIG = {
    "output_dir": None,
    "data": {"name": "digits", "batch_size": 64, "test_limit": 200, "k_shot": 30, "val_per_class": 5},
    "model": {"name": "mlp"},
    "optim": {"lr": 0.05},
    "train": {"epochs": 2, "progress": False},
    "eval": {"num_samples": 4, "flatness_samples": 2, "hessian_examples": 64, "hessian_max_iter": 10},
    "compare": {
        "methods": [{"name": "sgd"}, {"name": "swag", "rank": 3, "start_step": 2, "collect_every": 1}],
        "seeds": [0, 1],
        "corruptions": ["gaussian_noise", "contrast"],
        "severities": [1, 5],
        "corruption_samples": 2,
        "bma_curve": [1, 2, 4],
    },
}

RUN_KEYS = (
    "accuracy",
    "nll",
    "ece",
    "aece",
    "brier",
    "lambda1",
    "lambda1_summary",  # the flatness protocol (k = 1 by default: no λ₁/λ₅ unless eval.hessian_k asks)
    "width",
    "repeatability",
    "corruptions",
    "bma_curve",
    "reliability",
    "train_time_s",
    "eval_time_s",
    "landscape",
    "method",
    "seed",
    "optim",
    "selection",  # None: one setting per method, nothing chosen (tests/experiment/test_selection.py)
)


def _write(tmp_path, cfg):
    cfg = json.loads(json.dumps(cfg))
    cfg["output_dir"] = str(tmp_path / "out")
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.slow
def test_compare_writes_every_output_and_resumes(tmp_path, capsys):
    path = _write(tmp_path, CONFIG)
    assert main(["compare", "--config", path]) in DONE, capsys.readouterr().err
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text())
    assert len(results["runs"]) == 4
    for run in results["runs"]:
        for key in RUN_KEYS:
            assert key in run, key
        assert set(run["corruptions"]) == {"gaussian_noise", "contrast"}
        assert set(run["corruptions"]["contrast"]) == {"1", "5"}
        assert run["bma_curve"]["num_samples"][-1] == (1 if run["method"] == "sgd" else 4)
        assert run["corruption_samples"] == (1 if run["method"] == "sgd" else 2)  # the first 2 of the 4
        assert run["temperature"] > 0 and set(run["temperature_scaled"]) >= {"accuracy", "nll", "ece"}
        assert run["temperature_scaled"]["accuracy"] == run["accuracy"]  # scaling never changes the argmax
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 4
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 4 and 'src="figures/' not in html
    assert "BMA of the first 2 posterior samples (1 for methods that have fewer)" in (out / "report.md").read_text()
    printed = capsys.readouterr().out
    assert "sgd" in printed and "swag" in printed

    # rerun: every (method, seed) is reused, nothing retrains
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/checkpoint.safetensors")}
    assert main(["compare", "--config", path]) in DONE
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/checkpoint.safetensors")} == stamps
    assert json.loads((out / "results.json").read_text())["runs"] == results["runs"]

    # a different config into the same directory is refused unless --force
    assert main(["compare", "--config", path, "--set", "optim.lr=0.01"]) == 2
    assert "--force" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"corruptions": ["gaussian_nosie"]}, "Did you mean 'gaussian_noise'"),
        ({"severities": [0, 6]}, "severities must lie in 1..5"),
        ({"methods": []}, "compare.methods is empty"),
        ({"corruption_samples": 0}, "corruption_samples must be >= 1"),
    ],
)
def test_bad_compare_configs(tmp_path, capsys, change, message):
    cfg = json.loads(json.dumps(CONFIG))
    cfg["compare"].update(change)
    assert main(["compare", "--config", _write(tmp_path, cfg)]) == 2
    assert message in capsys.readouterr().err


def test_the_time_left_comes_from_each_methods_measured_cost(monkeypatch, capsys):
    """#25: the ETA once extrapolated from the cheapest method (said 4.9 min left, took 13); #35: a method not yet
    timed is counted from its work per phase at the rates the phases took so far (7.6 min promised, 40 taken)."""
    from flatbma import progress
    from flatbma.experiment.study import compare

    clock = [0.0]
    monkeypatch.setattr(compare.time, "perf_counter", lambda: clock[0])
    items = [("sgd", 0), ("sgd", 1), ("fp-bma", 0), ("fp-bma", 1)]
    work = {"sgd": {"train": 10, "flatness": 1}, "fp-bma": {"train": 20, "flatness": 8}}  # fp-bma: 8 spectra
    phases = {"sgd": [("train", 20.0), ("flatness", 30.0)], "fp-bma": [("train", 80.0), ("flatness", 480.0)]}
    describe = lambda item: f"{item[0]} seed {item[1]}"  # noqa: E731
    reporter = progress.Reporter(terminal=False, clock=lambda: clock[0])
    for item in compare._progress(
        items, "compare", describe, True, 0, 1, kind=lambda item: item[0], work=lambda item: work[item[0]]
    ):
        for name, seconds in phases[item[0]]:
            with reporter.phase(name):
                clock[0] += seconds
        clock[0] += 10.0  # outside the phases (building the run, writing its files)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("compare: [")]
    assert len(lines) == 4, lines
    # fp-bma untimed: its work at sgd's rates, 2 s per epoch and 30 s per spectrum, plus sgd's 10 s outside
    # phases: 2·20 + 30·8 + 10 = 290 s for each of its two rows, beside sgd's own 60 s
    assert lines[0].endswith(
        "done in 60 s; about 10.7 min left (fp-bma not yet timed: counted from the phases measured so far)"
    )
    assert lines[2].endswith("done in 570 s; about 9.5 min left")  # fp-bma's own cost once measured
    assert lines[3].endswith("nothing left")

    learned = TimeLeft()
    learned.add("a", 100.0, [("BMA", 40.0), ("BMA", 20.0)], {"BMA": 30})  # 2 s per sample, 40 s outside
    assert learned.estimate("a", {"BMA": 1}) == 100.0  # a timed kind: its mean
    assert learned.estimate("b", {"BMA": 5, "landscape": 8}) == 40.0 + 10.0  # a phase never measured counts 0
    assert learned.estimate("b", None) == 100.0  # no work known: the costliest kind
    assert learned.text([("a", None), ("c", None)]) == (
        "about 3.3 min left (c not yet timed: counted at the slowest so far)"
    )


def test_a_row_read_from_its_cache_is_not_taken_for_its_cost(monkeypatch, capsys):
    """A resumed comparison's cached rows take ~0 s: learned, they promised "0.0 min left" for hours of rows."""
    from flatbma import progress
    from flatbma.experiment.study import compare

    clock = [0.0]
    monkeypatch.setattr(compare.time, "perf_counter", lambda: clock[0])
    items = [("sgd", 0), ("sgd", 1), ("sgd", 2)]
    reporter = progress.Reporter(terminal=False, clock=lambda: clock[0])
    for item in compare._progress(
        items, "compare", str, True, 0, 1, kind=lambda item: item[0], work=lambda item: {"train": 10}
    ):
        if item[1] > 0:  # seed 0 comes from its cache: no phase runs
            with reporter.phase("train"):
                clock[0] += 60.0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("compare: [")]
    assert lines[0].endswith("read from its cache; time left known once a row is measured"), lines
    assert lines[1].endswith("done in 60 s; about 1.0 min left"), lines
    learned = TimeLeft()
    learned.add("a", 0.01, [], {"train": 10})
    assert not learned.rows and learned.text([("a", None)]) == "time left known once a row is measured"


def test_a_rows_work_counts_its_phases_in_units_of_its_config():
    from flatbma.experiment.config.run_config import config_from_dict
    from flatbma.experiment.study.plan import CompareConfig

    base = {"data": {"name": "digits"}, "model": {"name": "mlp"}, "train": {"epochs": 3}, "eval": {"num_samples": 6}}
    compare = CompareConfig(
        methods=({"name": "sgd"},), seeds=(0,), corruptions=("contrast",), severities=(1, 3), corruption_samples=2
    )
    sgd = row_work(config_from_dict({**base, "method": {"name": "sgd"}}), compare)
    assert sgd == {
        "train": 3,
        "BMA": 1,
        "temperature": 1,
        "OOD": 1,
        "corruptions": 2,
        "flatness": 1,
        "repeatability": 1,
        "landscape": 1,
    }  # a point estimate: one distinct sample
    swag = {"name": "swag", "rank": 2, "start_step": 0, "collect_every": 1}
    prior = {"method": {"name": "fp-bma", "rank": 2}, "prior": {"method": swag, "epochs": 4}}
    two = row_work(config_from_dict({**base, **prior}), compare)
    assert two["train"] == 3 + 4 and two["BMA"] == 6 and two["corruptions"] == 2 * 2 and two["flatness"] == 8
