"""Training health (issue #23, item 13): a collapsing run is flagged — one warning line, a ``health`` entry in
``metrics.json`` and in compare's rows, a mark in compare's tables and findings — without being stopped.

The collapse is forced cheaply: plain SGD at ``lr = 30`` on the digits MLP (its loss climbs into the
thousands and its BMA predicts one class), instead of the slow FP-BMA ``gamma: 100`` run of the issue.

The rule ``worse_than_mean`` (issue #25) is forced by a Laplace over all of a small CNN's weights with KFAC and
the evidence's δ, whose BMA undoes its MAP; on training images SGD, SWAG, MC dropout, the default last-layer
Laplace and the mixtures (against their member 0, issue #35) stay unflagged; on a validation split the rule is
"worse beyond rounding", and the flag follows :func:`worse_than_mean` of what was measured.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from flatbma.experiment.cli import main
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.report.findings import findings
from flatbma.experiment.report.tables import summary_table
from flatbma.experiment.run import evaluate
from flatbma.experiment.run.pipeline import load_run, train
from flatbma.health import (
    LOSS_RISE,
    HealthWarning,
    assess,
    flagged_line,
    flagged_text,
    is_flagged,
    warn_if_flagged,
    worse_than_mean,
)
from flatbma.methods import parse_method

BASE: dict[str, Any] = {
    "seed": 0,
    "method": {"name": "sgd"},
    "data": {"name": "digits", "k_shot": 10, "batch_size": 25, "test_limit": 100},
    "model": {"name": "mlp", "width": 16},
    "optim": {"lr": 0.3},
    "train": {"epochs": 10, "progress": False},
    "eval": {"num_samples": 1},
}
COLLAPSING = {"lr": 30.0}


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _history(*losses: float) -> list[dict[str, float]]:
    return [{"epoch": i + 1, "loss": loss} for i, loss in enumerate(losses)]


FIT = {"train_bma_accuracy": 0.62, "train_examples": 100, "chance_accuracy": 0.1}


@pytest.mark.parametrize(
    ("losses", "fit", "flags"),
    [
        ((2.5, 1.2, 0.4), FIT, []),
        ((2.5, 3.0, 25.0), FIT, ["loss_rise"]),  # the issue's FP-BMA run: 2.5 → 25
        ((2.5, 2.5 * LOSS_RISE), FIT, []),  # exactly at the factor: not above it
        ((2.5, 2.5 * LOSS_RISE + 0.01), FIT, ["loss_rise"]),
        ((2.5,), FIT, []),  # one epoch: nothing to compare
        ((2.5, 0.3), {**FIT, "train_bma_accuracy": 0.1}, ["at_chance"]),  # one class predicted
        ((2.5, 0.3), {**FIT, "train_bma_accuracy": 0.15}, ["at_chance"]),  # within 2 SE (0.06) of chance
        ((2.5, 0.3), {**FIT, "train_bma_accuracy": 0.17}, []),
        ((2.5, 30.0), {**FIT, "train_bma_accuracy": 0.1}, ["loss_rise", "at_chance"]),
        ((2.5, 30.0), None, ["loss_rise"]),  # not measured (a run trained without evaluation)
    ],
)
def test_the_rules(losses: tuple[float, ...], fit: dict[str, Any] | None, flags: list[str]) -> None:
    health = assess(_history(*losses), fit)
    assert health["flags"] == flags and health["ok"] is (not flags)
    assert is_flagged(health) is bool(flags) and not is_flagged(None) and not is_flagged({})


def _against(data: str, bma: float, mean: float, classes: int = 10) -> dict[str, Any]:
    return {"data": data, "examples": 100, "num_classes": classes, "bma_nll": bma, "bma_accuracy": 0.9,
            "mean_nll": mean, "mean_accuracy": 0.95}  # fmt: skip


LOG10 = math.log(10)


@pytest.mark.parametrize(
    ("compared", "fired"),
    [
        (None, False),  # a regression
        # the measured runs of the module docstring (the small CNN on digits): on training images, the sound ones
        # are not flagged
        (_against("training", 0.0642, 0.0182), False),  # last-layer Laplace, evidence δ: 3.5x, but +0.046
        (_against("training", 0.0533, 0.0246), False),  # MC dropout (rate 0.2): 2.2x, +0.03
        (_against("training", 0.7575, 0.0182), True),  # all weights, KFAC, evidence δ: +0.74 > 0.2 log 10
        # on validation data a BMA worse than its mean beyond rounding is: it predicts held-out data worse
        (_against("validation", 0.1327, 0.0627), True),  # last-layer: 2.1x
        (_against("validation", 0.6000, 0.0627), True),  # all weights: 9.6x, +0.54
        (_against("validation", 0.0627, 0.0627), False),
        # and by more than twice the standard error of the paired per-example differences, when measured
        ({**_against("validation", 0.1327, 0.0627), "nll_diff_se": 0.0349}, True),  # +0.0700 > 0.0698
        ({**_against("validation", 0.1327, 0.0627), "nll_diff_se": 0.0351}, False),  # within the draw's noise
        # the two conditions, each at its edge
        (_against("validation", 1.01 * 1.2 + 1e-6, 1.2), True),
        (_against("validation", 1.01 * 1.2 - 1e-6, 1.2), False),
        (_against("validation", 0.0627 + 0.0005 * LOG10 + 1e-7, 0.0627), True),
        (_against("validation", 0.0627 + 0.0005 * LOG10 - 1e-7, 0.0627), False),  # within rounding of a tiny NLL
        (_against("training", 0.0182 + 0.2 * LOG10 - 1e-6, 0.0182), False),
        (_against("training", 2.0 * 0.5 - 1e-6, 0.5), False),
        (_against("training", 0.6, 0.0627, classes=1000), False),  # + 0.54 < 0.2 log 1000 = 1.38
        (_against("test", 0.6, 0.0627), False),  # data it has no rule for
    ],
)
def test_the_rule_against_the_mean(compared: dict[str, Any] | None, fired: bool) -> None:
    health = assess(_history(2.5, 0.3), {**FIT, "train_bma_nll": 0.3, "against_mean": compared})
    assert health["flags"] == (["worse_than_mean"] if fired else []) and health["against_mean"] == compared
    assert ("worse_than_mean" in health["rules"]) is (compared is not None and compared["data"] != "test")
    assert fired is (compared is not None and worse_than_mean(compared))
    if fired:
        assert flagged_text(health).startswith(f"its BMA is worse than its posterior mean on 100 {compared['data']}")
        assert "a posterior too wide for its posterior mean" in flagged_line("sgd", {"seed": 0, "health": health})
        with pytest.warns(HealthWarning, match=r"too wide for its posterior mean \(try scale: 0\.5\): its BMA is"):
            warn_if_flagged(health, "the run", "scale: 0.5")
        member = {**health, "against_mean": {**compared, "reference": "member 0"}}
        assert "too wide for its member 0" in flagged_line("ensemble", {"seed": 0, "health": member})


def _write(tmp_path: Path, name: str, cfg: dict[str, Any]) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_a_collapsing_run_is_flagged_but_not_stopped(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = {**BASE, "optim": COLLAPSING, "output_dir": str(run)}
    code, out, err = _cli(["train", "--config", _write(tmp_path, "c", cfg), "--quiet"])
    assert code == 3 and "wrote" in out  # trained to the end, metrics written; exit code 3: flagged
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"flatbma: warning: the run in {run} looks collapsed: "), err
    assert "at chance on its training data" in lines[0] and "lower the learning rate" in lines[0]
    health = json.loads((run / "metrics.json").read_text())["health"]
    assert health["ok"] is False and "at_chance" in health["flags"] and health["train_examples"] == 100
    code, _, err = _cli(["evaluate", str(run), "--quiet"])  # re-evaluated: flagged again, in one line
    assert code == 3 and err.startswith("flatbma: warning: ") and len(err.splitlines()) == 1


def test_a_healthy_run_says_nothing_and_records_its_health(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, _, err = _cli(["train", "--config", _write(tmp_path, "c", {**BASE, "output_dir": str(run)}), "--quiet"])
    assert code == 0 and err == ""
    health = json.loads((run / "metrics.json").read_text())["health"]
    assert health["ok"] is True and health["flags"] == [] and health["train_bma_accuracy"] > 0.5


CNN: dict[str, Any] = {
    **BASE,
    "data": {"name": "digits", "batch_size": 32, "test_limit": 100},
    "model": {"name": "cnn", "width": 8},
    "optim": {"lr": 0.05, "momentum": 0.9},
    "train": {"epochs": 5, "progress": False},
    "eval": {"num_samples": 5},
}
UNDOING = {"name": "laplace", "subset": "all", "hessian": "kfac"}  # and the evidence's δ, the default
"""Laplace over all the small CNN's weights: its BMA undoes its MAP (issue #25: accuracy 0.776 against 0.988)."""


def _with_validation(cfg: dict[str, Any]) -> dict[str, Any]:
    return {**cfg, "data": {**cfg["data"], "val_fraction": 0.2}}


@pytest.mark.parametrize("validation", [False, True], ids=["training", "validation"])
def test_a_laplace_posterior_that_undoes_its_map_is_flagged(tmp_path: Path, validation: bool) -> None:
    run = tmp_path / "run"
    cfg = {**CNN, "method": UNDOING, "output_dir": str(run)}
    cfg = _with_validation(cfg) if validation else cfg
    code, out, err = _cli(["train", "--config", _write(tmp_path, "c", cfg), "--quiet"])
    assert code == 3 and "wrote" in out  # 3: flagged
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"flatbma: warning: the run in {run} has a posterior too wide for its posterior mean (try subset: last-layer"
    )
    data = "validation" if validation else "training"
    health = json.loads((run / "metrics.json").read_text())["health"]
    assert health["flags"] == ["worse_than_mean"] and health["against_mean"]["data"] == data
    compared = health["against_mean"]
    assert f"its BMA is worse than its posterior mean on {compared['examples']} {data} " in lines[0]
    assert compared["bma_nll"] > compared["mean_nll"] + 0.3 and compared["bma_accuracy"] < compared["mean_accuracy"]
    if not validation:  # the BMA's side is the chance rule's measurement, on the same training images
        assert compared["bma_nll"] == health["train_bma_nll"] and compared["examples"] == health["train_examples"]
    code, _, err = _cli(["evaluate", str(run), "--quiet"])  # re-evaluated: the same numbers, flagged again
    assert code == 3 and len(err.splitlines()) == 1 and "has a posterior too wide" in err
    assert json.loads((run / "metrics.json").read_text())["health"]["against_mean"] == compared


@pytest.mark.parametrize(
    ("method", "validation"),
    [
        ({"name": "sgd"}, False),  # a point estimate is its own mean: the same numbers
        ({"name": "swag", "rank": 2}, True),
        ({"name": "mc-dropout", "rate": 0.2}, False),
        ({"name": "laplace"}, False),  # the default: last layer, the evidence's δ
        ({"name": "laplace"}, True),
        ({"name": "ensemble", "members": 2}, False),  # a mixture of members: against its member 0
        ({"name": "multiswag", "members": 2, "of": {"name": "swag", "rank": 2}}, False),  # member 0's SWA mean
    ],
)
def test_every_run_is_compared_with_its_reference_network(
    tmp_path: Path, method: dict[str, Any], validation: bool
) -> None:
    """On training images these sound runs are not flagged; on validation data the flag is the rule's verdict on
    what was measured, in one line with the method's advice."""
    run = tmp_path / "run"
    cfg = {**CNN, "method": method, "output_dir": str(run)}
    cfg = _with_validation(cfg) if validation else cfg
    code, _, err = _cli(["train", "--config", _write(tmp_path, "c", cfg), "--quiet"])
    health = json.loads((run / "metrics.json").read_text())["health"]
    assert code == (0 if health["ok"] else 3)  # a flagged run's command exits 3
    compared = health["against_mean"]
    assert "worse_than_mean" in health["rules"]
    assert compared["data"] == ("validation" if validation else "training") and compared["mean_accuracy"] > 0.9
    mixture = method["name"] in ("ensemble", "multiswag")
    assert compared["reference"] == ("member 0" if mixture else "mean")
    assert health["flags"] == (["worse_than_mean"] if worse_than_mean(compared) else [])
    if not validation:
        assert health["ok"] is True and err == ""
    else:
        assert (err == "") is health["ok"] and len(err.splitlines()) <= 1
        diagnostics = json.loads((run / "metrics.json").read_text()).get("diagnostics")
        advice = parse_method(method).advice(False, diagnostics)
        assert health["ok"] or f"has a posterior too wide for its posterior mean (try {advice[:40]}" in err
    if method["name"] == "sgd":
        assert compared["bma_nll"] == compared["mean_nll"] == health["train_bma_nll"]
    if method["name"] == "laplace":
        assert compared["bma_nll"] > compared["mean_nll"]  # wider than its MAP, but not undoing it


def test_compare_marks_the_flagged_row_in_its_tables_and_findings(tmp_path: Path) -> None:
    out = tmp_path / "study"
    cfg = {
        **BASE,
        "output_dir": str(out),
        "compare": {
            "methods": [{"name": "sgd"}, {"name": "sgd", "label": "sgd-lr30", "optim": COLLAPSING}],
            "seeds": [0],
            "bma_curve": [1],
            "flatness": False,
            "landscape": False,
        },
    }
    code, stdout, err = _cli(["compare", "--config", _write(tmp_path, "c", cfg), "--quiet"])
    assert code == 3, err  # a flagged row
    warnings = [line for line in err.splitlines() if line.startswith("flatbma: warning: ")]
    assert len(warnings) == 1 and "sgd-lr30 seed 0" in warnings[0], err
    results = json.loads((out / "results.json").read_text())
    healths = {r["method"]: r["health"] for r in results["runs"]}
    assert healths["sgd"]["ok"] and not healths["sgd-lr30"]["ok"]
    assert results["findings"]["health"] == [{"method": "sgd-lr30", "seed": 0, "flags": healths["sgd-lr30"]["flags"]}]
    assert results["findings"]["text"][0].startswith("⚠ sgd-lr30 seed 0: ")
    assert "| sgd-lr30 ⚠ |" in stdout and "| sgd |" in stdout  # the table printed by the command
    report = (out / "report.md").read_text()
    assert "| sgd-lr30 ⚠ |" in report and "- ⚠ sgd-lr30 seed 0: " in report
    assert summary_table(results) in stdout and findings(results)["text"] == results["findings"]["text"]
    run_dirs = {r["method"]: Path(r["run_dir"]) for r in results["runs"]}
    assert json.loads((run_dirs["sgd-lr30"] / "metrics.json").read_text())["health"] == healths["sgd-lr30"]


@pytest.mark.parametrize(
    "method",
    [
        {"name": "mc-dropout", "rate": 0.2},
        {"name": "swag", "rank": 2, "start_step": 0},
        {"name": "laplace", "subset": "all"},  # compared with its MAP: that changes nothing either
        {"name": "laplace", "predictive": "samples", "model": CNN["model"]},  # its MAP's BatchNorm statistics
    ],
)
def test_measuring_the_health_changes_no_other_number(tmp_path: Path, method: dict[str, Any], monkeypatch) -> None:
    """The training pass runs under forked generators: every other measurement is the same bit for bit."""
    method = dict(method)
    model = method.pop("model", BASE["model"])
    options = {**BASE, "method": method, "model": model, "eval": {"num_samples": 3}, "output_dir": str(tmp_path / "r")}
    cfg = config_from_dict(options)
    train(cfg, evaluate=False)
    options = dict(bma_curve=(1, 3), corruptions=("gaussian_noise",), severities=(3,), corruption_samples=None)

    def measured() -> dict[str, Any]:
        exp, state = load_run(cfg)
        out = evaluate.measure(exp, state, flatness=True, landscape=True, **options)
        return {k: v for k, v in out.items() if not k.endswith("time_s") and k != "health"}

    with_health = measured()
    monkeypatch.setattr(evaluate, "training_fit", lambda exp, predictions, state: {})
    assert measured() == with_health


def test_the_model_check_draws_nothing_the_run_sees(tmp_path: Path) -> None:
    """The forward pass of :func:`flatbma.models.check_classifier` (#23) leaves the run's random stream as it was.

    With augmentation, reading a training image draws from the global generator. A build has always read
    one augmented image (for its shape) — runs' numbers count on that draw — and the check's images are
    read under a fork: an SGD run starts from the state of its seed after exactly that one read.
    """
    from flatbma.experiment.run import build

    cfg = config_from_dict({**BASE, "data": {**BASE["data"], "augment": True}, "output_dir": str(tmp_path / "r")})
    exp = build.build_experiment(cfg)
    build.seed_everything(cfg.seed)
    data = build.select_data(cfg, build.load_data(cfg.data))
    data.train.with_transform(build.transforms(cfg.data)[0])[0]  # the one read a build makes
    assert torch.equal(exp.rng.cpu, torch.get_rng_state())
