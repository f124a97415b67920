"""`flatbma evaluate RUN_DIR --flatness` on a run of every registered method."""

import json

import pytest
import yaml

from flatbma.experiment.cli import main
from flatbma.methods import METHODS
from tests.helpers import DONE

# options that make each method produce samples within a one-epoch digits run (~19 steps)
OPTIONS = {
    "swag": {"start_step": 5, "collect_every": 2, "rank": 3},
    "f-swag": {"start_step": 5, "collect_every": 2, "rank": 3},
    "swag-diag": {"start_step": 5, "collect_every": 2},
    "sgld": {"burn_in": 5, "thin": 2},
    "f-sgld": {"burn_in": 5, "thin": 2},
    "csgld": {"cycle_length": 6},
    "ensemble": {"size": 2},
    "f-ensemble": {"size": 2},
    "lowrank-vi": {"rank": 3},
    "f-lowrank-vi": {"rank": 3},
    "fp-bma": {"rank": 3},
    "sa-bma": {"rank": 3},
    "multi": {"members": 2, "of": {"name": "swag", "start_step": 5, "collect_every": 2, "rank": 3}},
    "multiswag": {"members": 2, "of": {"name": "swag", "start_step": 5, "collect_every": 2, "rank": 3}},
    "multi-fp-bma": {"members": 2, "of": {"name": "fp-bma", "rank": 3}},
}


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_evaluate_with_flatness_on_every_method(tmp_path, capsys, method):
    cfg = {
        "method": {"name": method, **OPTIONS.get(method, {})},
        "data": {"name": "digits", "batch_size": 64},
        "model": {"name": "mlp"},
        "optim": {"lr": 0.01},
        "train": {"epochs": 1, "progress": False},
        "eval": {
            "num_samples": 3,
            "flatness_samples": 2,
            "hessian_k": 5,
            "hessian_examples": 64,
            "hessian_max_iter": 20,
            "trace_probes": 2,
        },
        "output_dir": str(tmp_path / "run"),
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(path)]) in DONE, capsys.readouterr().err
    assert main(["evaluate", str(tmp_path / "run"), "--flatness"]) in DONE, capsys.readouterr().err
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    for key in (
        "hessian_top_eigenvalues",
        "hessian_eigenvalue_converged",
        "lambda1",
        "lambda1_summary",
        "lambda1_unconverged",
        "lambda1_over_lambda5",
        "lambda1_at_mean",
        "distribution_lambda1",
        "hessian_trace",
        "sam_sharpness",
        "width",
        "repeatability",
        "bn_statistics",
        "accuracy",
    ):
        assert key in metrics, key
    assert metrics["hessian_examples"] <= 64 and 1 <= metrics["flatness_samples"] <= 2
    assert len(metrics["hessian_top_eigenvalues"]) == metrics["flatness_samples"]
    converged = [row[0] for row in metrics["hessian_eigenvalue_converged"]]
    summarized = metrics["lambda1_summary"]["n"] if metrics["lambda1_summary"] else 0  # None: no λ₁ converged
    assert summarized == sum(converged) and len(metrics["lambda1_unconverged"]) == converged.count(False)
    if metrics["lambda1"] is not None:
        assert metrics["lambda1"] > 0
    if metrics["lambda1_over_lambda5"] is not None:
        assert metrics["lambda1_over_lambda5"] >= 1
    # 20 Lanczos steps may stop short of tol for λ₅: recorded with the residuals, not printed per spectrum
    assert metrics["hessian_converged"] == (not metrics["hessian_warnings"])
    assert all("residual" in w for w in metrics["hessian_warnings"])
    width = metrics["width"]
    assert width["trace_cov"] >= 0 and isinstance(width["exact"], bool)
    assert isinstance(metrics["repeatability"]["agree"], bool)


def _heavy_tail_record(second_mean):
    """A repeated λ₁ measurement as results record it: the demo's FP-BMA, mean 36,647 from one sharp sample."""
    first = {"n": 8, "mean": 36647.0, "median": 1926.0, "interval": {"low": 1640.0, "high": 105786.0, "level": 0.95}}
    second = {"n": 8, "mean": second_mean, "median": 1900.0, "interval": {"low": 1463.0, "high": 2771.0, "level": 0.95}}
    return {"agree": True, "first": first, "second": second}


@pytest.mark.parametrize("flatness", [True, False])
def test_evaluate_flatness_prints_a_measurement_that_did_not_repeat(tmp_path, capsys, monkeypatch, flatness):
    from types import SimpleNamespace

    from flatbma.experiment import cli

    record = _heavy_tail_record(1979.0)
    metrics = {"accuracy": 0.9, "lambda1": 36647.0, "repeatability": record}
    monkeypatch.setattr(cli, "load_run_config", lambda run_dir: SimpleNamespace(train=SimpleNamespace(device="cpu")))
    monkeypatch.setattr(cli, "evaluate_run", lambda run_dir, flatness, ood=None: metrics)
    argv = ["evaluate", str(tmp_path), *(["--flatness"] if flatness else [])]
    assert main(argv) in DONE
    out, err = capsys.readouterr()
    assert json.loads(out.splitlines()[-1]) == {"accuracy": 0.9, "lambda1": 36647.0}  # stdout as it was
    warned = [line for line in err.splitlines() if "does not repeat" in line]
    if not flatness:  # metrics.json may hold an older measurement: only the one just made is reported
        assert not warned
        return
    (line,) = warned
    assert line.startswith("flatbma: warning: λ₁ measured again")
    assert "heavy tail: means 36647 and 1979 differ by more than a factor 2" in line
    assert "median 1926" in line and "median 1900" in line
    metrics["repeatability"] = _heavy_tail_record(30000.0)  # repeats: nothing said
    assert main(argv) in DONE
    assert "does not repeat" not in capsys.readouterr().err
