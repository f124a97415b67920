"""Regression from the command line (``model.likelihood: gaussian``, ``data.name: diabetes``): the config resolves,
``flatbma train``/``evaluate``/``compare`` record the mixture predictive's metrics, which agree with the NLL, RMSE and
coverage computed here from the saved weights on diabetes standardized independently (scikit-learn, torch.distributions,
scipy); the refusals are one line each; a config without the key resolves as before."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from scipy.stats import norm
from sklearn.datasets import load_diabetes
from torch.func import functional_call

from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.config.run_config import load_config
from flatbma.experiment.config.sections import Likelihood
from flatbma.experiment.study.plan import load_plan
from flatbma.models import build_model
from flatbma.regression import mixture_metrics
from tests.helpers import load_state

TINY = [
    "--set",
    "train.epochs=3",
    "--set",
    "model.width=8",
    "--set",
    "train.progress=false",
    "--set",
    "eval.num_samples=4",
]


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _diabetes(capsys, command, output_dir, *settings):
    """``flatbma COMMAND --config diabetes-regression`` into ``output_dir``, at TINY's size, then ``--set`` each of
    ``settings`` (after TINY's, so that they override it): ``(code, out, err)``."""
    sets = [arg for setting in settings for arg in ("--set", setting)]
    return _run(capsys, command, "--config", "diabetes-regression", "--set", f"output_dir={output_dir}", *TINY, *sets)


def _diabetes_by_hand() -> tuple[torch.Tensor, torch.Tensor]:
    """The test split of diabetes (80/20 by torch.randperm of seed 0), standardized on the training split."""
    data = load_diabetes(scaled=False)
    x, y = np.asarray(data.data, dtype=np.float32), np.asarray(data.target, dtype=np.float32)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    held = round(0.2 * len(y))
    test, train = perm[:held].sort().values.numpy(), perm[held:].sort().values.numpy()
    mean, std = x[train].mean(0), x[train].std(0, ddof=1)
    x_test = (x[test] - mean) / std
    y_test = (y[test] - y[train].mean()) / y[train].std(ddof=1)
    return torch.from_numpy(x_test), torch.from_numpy(y_test)


def test_the_shipped_config_resolves_to_a_regression_comparison():
    cfg = load_config("diabetes-regression")
    assert cfg.model.likelihood is Likelihood.GAUSSIAN and cfg.model.gaussian.outputs == 2
    assert cfg.data.name == "diabetes" and cfg.to_dict()["model"]["likelihood"] == "gaussian"
    assert "noise_std" not in cfg.to_dict()["model"]  # at its default (learned), left out like other added options
    plan = load_plan("diabetes-regression")
    assert [m["name"] for m in plan.compare.methods] == ["sgd", "swag", "mfvi"] and plan.compare.seeds == (0,)
    fixed = load_config("diabetes-regression", ["model.noise_std=0.5"])
    assert fixed.model.gaussian.outputs == 1 and fixed.to_dict()["model"]["noise_std"] == 0.5


def test_a_config_without_the_likelihood_resolves_as_before():
    """The model section of a classification config holds exactly the keys it held before model.likelihood existed
    (every shipped config's whole resolved config is pinned by test_resolved_configs.py)."""
    for cfg in (load_config(None, ["method.name=sgd"]), load_config("digits-sam")):
        assert cfg.model.likelihood is Likelihood.CATEGORICAL and cfg.model.gaussian is None
        assert list(cfg.to_dict()["model"]) == ["name", "pretrained", "width", "dropout", "trainable"]
    explicit = load_config("digits-sam", ["model.likelihood=categorical"])
    assert explicit.to_dict() == load_config("digits-sam").to_dict()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["method={name: laplace}"], "method 'laplace' cannot fit a regression network .* use swag"),
        (["method={name: f-laplace}"], "method 'f-laplace' cannot fit a regression network"),
        (["model.likelihood=poisson"], "model.likelihood must be one of 'categorical', 'gaussian', got 'poisson'"),
        (["model.likelihood=categorical"], "dataset 'diabetes' has regression targets: set model.likelihood: gaussian"),
        (["data.name=digits"], "model.likelihood: gaussian needs a regression data set"),
        (["model.noise_std=0"], "noise_std must be > 0"),
        (["eval.ood=gaussian_noise"], "eval.ood is not implemented for a regression run"),
    ],
)
def test_refusals_are_one_line(tmp_path, capsys, overrides, message):
    args = [a for o in overrides for a in ("--set", o)]
    code, out, err = _run(capsys, "train", "--config", "diabetes-regression", "--set", f"output_dir={tmp_path}", *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("flatbma: error: ")
    assert re.search(message, err), err
    with pytest.raises(FlatbmaError):
        load_config("diabetes-regression", overrides)


@pytest.mark.parametrize("noise", [None, 0.7], ids=["learned-noise", "fixed-noise"])
def test_train_and_evaluate_write_the_metrics_of_the_saved_weights(tmp_path, capsys, noise):
    """A point estimate's BMA is one Gaussian N(μ(x), σ²(x)): its NLL, RMSE, MAE and coverage recomputed from the
    checkpoint's weights on diabetes standardized here (scipy's normal) equal those in metrics.json."""
    run_dir = tmp_path / "run"
    noise_args = [f"model.noise_std={noise}"] if noise is not None else []
    code, _, err = _diabetes(capsys, "train", run_dir, "method={name: sgd}", *noise_args)
    assert code == 0, err
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for absent in ("accuracy", "ece", "aece", "brier"):
        assert absent not in metrics
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["model"]["likelihood"] == "gaussian"

    state = load_state(run_dir / "checkpoint.safetensors")
    model = build_model("mlp", num_classes=1 if noise else 2, in_channels=10, image_size=1, width=8)
    x, y = _diabetes_by_hand()
    with torch.no_grad():
        out = functional_call(model, {**state.params, **state.buffers}, (x,)).double()
    mu = out[:, 0]
    var = torch.full_like(mu, noise**2) if noise else torch.nn.functional.softplus(out[:, 1]) + 1e-6
    m, s, t = mu.numpy(), var.sqrt().numpy(), y.double().numpy()
    assert metrics["nll"] == pytest.approx(-norm.logpdf(t, m, s).mean(), rel=1e-5)
    assert metrics["rmse"] == pytest.approx(math.sqrt(((m - t) ** 2).mean()), rel=1e-5)
    assert metrics["mae"] == pytest.approx(np.abs(m - t).mean(), rel=1e-5)
    pit = norm.cdf(t, m, s)
    for level in (0.5, 0.9, 0.95):
        assert metrics[f"coverage_{level:g}"] == pytest.approx(
            (np.abs(pit - 0.5) <= level / 2).mean(), abs=1.5 / len(t)
        )
    assert metrics["n"] == len(t) == 88  # the whole test split

    code, out, err = _run(capsys, "evaluate", str(run_dir))
    assert code == 0, err
    printed = json.loads(out.strip().splitlines()[-1])
    assert printed["nll"] == metrics["nll"] and printed["rmse"] == metrics["rmse"]
    code, out, err = _run(capsys, "evaluate", str(run_dir), "--ood", "gaussian_noise")
    assert code == 2 and err.startswith("flatbma: error: OOD detection") and len(err.strip().splitlines()) == 1


def test_a_swag_run_records_the_mixture_of_its_samples(tmp_path, capsys):
    """SWAG's metrics are mixture_metrics of its own samples' (μ_m, σ_m²): the mixture NLL, not a mean of NLLs."""
    from flatbma.experiment.run.build import build_experiment
    from flatbma.experiment.run.evaluate import draw_samples

    run_dir = tmp_path / "swag"
    swag = "method={name: swag, rank: 2, collect_every: 1, start_step: 10}"
    code, _, err = _run(
        capsys, "train", "--config", "diabetes-regression", "--set", swag, "--set", f"output_dir={run_dir}", *TINY
    )
    assert code == 0, err
    metrics = json.loads((run_dir / "metrics.json").read_text())
    cfg = load_config(run_dir / "config.yaml")
    exp = build_experiment(cfg)
    state = load_state(run_dir / "checkpoint.safetensors")
    with exp.rng.restored():
        samples = draw_samples(exp, state)
    x, y = _diabetes_by_hand()
    with torch.no_grad():
        outs = torch.stack([functional_call(exp.model, dict(w), (x,)) for w in samples]).double()
    mu, var = outs[..., 0], torch.nn.functional.softplus(outs[..., 1]) + 1e-6
    expected = mixture_metrics(mu, var, y)
    assert metrics["epistemic_var"] > 0  # the samples differ
    for key in ("nll", "rmse", "mae", "coverage_0.9", "calibration_error"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-9)
    per_sample_nll = -torch.distributions.Normal(mu, var.sqrt()).log_prob(y.double()).mean()
    assert metrics["nll"] <= float(per_sample_nll) + 1e-9  # Jensen: the mixture's NLL ≤ the mean of the samples'


def test_compare_reports_regression_columns_only(tmp_path, capsys):
    out_dir = tmp_path / "cmp"
    code, out, err = _diabetes(
        capsys,
        "compare",
        out_dir,
        "compare.methods=[{name: sgd}, {name: swag, rank: 2, collect_every: 1, start_step: 10}]",
    )
    assert code == 0, err
    report = (out_dir / "report.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| method | seeds |"))
    assert "RMSE" in header and "coverage 0.9" in header and "NLL" in header
    for absent in ("accuracy", "ECE", "Brier"):
        assert absent not in header
    rows = json.loads((out_dir / "results.json").read_text())["runs"]
    assert [r["method"] for r in rows] == ["sgd", "swag"]
    for row in rows:
        assert (
            row["likelihood"] == "gaussian"
            and row["nll"] == json.loads((Path(row["run_dir"]) / "metrics.json").read_text())["nll"]
        )
        assert not {"accuracy", "ece", "brier"} & set(row)
    code, _, err = _run(
        capsys,
        "compare",
        "--config",
        "diabetes-regression",
        "--set",
        f"output_dir={out_dir}",
        "--set",
        "compare.corruptions=[gaussian_noise]",
    )
    assert code == 2 and "compare.corruptions are image corruptions" in err and "have no image to corrupt" in err
    assert len(err.strip().splitlines()) == 1
    assert Path(out_dir / "report.md").read_text() == report


def test_the_splits_are_standardized_on_the_training_examples_only():
    """With data.val_fraction the validation share leaves the training split first; the statistics are the rest's."""
    from flatbma.experiment.run.build import load_data, select_data

    cfg = load_config("diabetes-regression", ["data.val_fraction=0.25", "seed=3"])
    data = select_data(cfg, load_data(cfg.data))
    assert (len(data.train), len(data.val), len(data.test)) == (266, 88, 88)  # round(0.25 · 354) = 88
    torch.testing.assert_close(data.train.features.mean(0), torch.zeros(10), atol=1e-5, rtol=0)
    torch.testing.assert_close(data.train.features.std(0), torch.ones(10), atol=1e-5, rtol=0)
    assert abs(float(data.train.targets.mean())) < 1e-5
    assert float(data.train.targets.std()) == pytest.approx(1, abs=1e-5)
    raw = load_diabetes(scaled=False)
    x, y = np.asarray(raw.data, dtype=np.float64), np.asarray(raw.target, dtype=np.float64)
    perm = torch.randperm(442, generator=torch.Generator().manual_seed(0))
    train = perm[88:].sort().values.numpy()
    inner = torch.randperm(len(train), generator=torch.Generator().manual_seed(3))
    kept = train[inner[88:].sort().values.numpy()]
    _, y_test = _diabetes_by_hand()
    assert not torch.allclose(y_test, data.test.targets)  # the validation share moved the statistics ...
    expected = (y[perm[:88].sort().values.numpy()] - y[kept].mean()) / y[kept].std(ddof=1)
    np.testing.assert_allclose(data.test.targets.numpy(), expected, rtol=1e-5, atol=1e-5)  # ... to the kept ones'
    x_val = (x[train[inner[:88].sort().values.numpy()]] - x[kept].mean(0)) / x[kept].std(0, ddof=1)
    np.testing.assert_allclose(data.val.features.numpy(), x_val, rtol=1e-4, atol=1e-5)


def _held_out_by_hand(val_fraction: float, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Validation and test splits of diabetes with ``data.val_fraction``: the validation share leaves the training
    split by torch.randperm of ``seed``; both standardized on the rest (numpy, ddof=1)."""
    raw = load_diabetes(scaled=False)
    x, y = np.asarray(raw.data, dtype=np.float64), np.asarray(raw.target, dtype=np.float64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    held = round(0.2 * len(y))
    test, train = perm[:held].sort().values.numpy(), perm[held:].sort().values.numpy()
    inner = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    n_val = round(val_fraction * len(train))
    val, kept = train[inner[:n_val].sort().values.numpy()], train[inner[n_val:].sort().values.numpy()]
    mean, std = x[kept].mean(0), x[kept].std(0, ddof=1)
    y_mean, y_std = y[kept].mean(), y[kept].std(ddof=1)
    return {name: ((x[i] - mean) / std, (y[i] - y_mean) / y_std) for name, i in (("val", val), ("test", test))}


def _point_nll(checkpoint: Path, x: np.ndarray, y: np.ndarray, width: int = 8) -> float:
    """Gaussian NLL (scipy) of the point estimate in ``checkpoint`` (learned noise: σ² = softplus(s) + 10⁻⁶)."""
    state = load_state(checkpoint)
    model = build_model("mlp", num_classes=2, in_channels=10, image_size=1, width=width)
    with torch.no_grad():
        out = functional_call(model, {**state.params, **state.buffers}, (torch.from_numpy(x).float(),)).double()
    std = (torch.nn.functional.softplus(out[:, 1]) + 1e-6).sqrt().numpy()
    return float(-norm.logpdf(y, out[:, 0].numpy(), std).mean())


def test_early_stopping_follows_the_validation_gaussian_nll(tmp_path, capsys):
    """train.early_stopping on a regression run watches the validation NLL of the Gaussian (mixture) predictive: the
    best epoch is the smallest val/nll of log.csv, its value is the NLL of best.safetensors' weights on the validation
    split standardized here (scipy), training stops `patience` epochs after it, and the test metrics are the best
    state's."""
    run_dir = tmp_path / "stop"
    code, _, err = _diabetes(
        capsys,
        "train",
        run_dir,
        *("method={name: sgd}", "train.epochs=15", "optim.lr=0.1", "optim.schedule=constant"),
        *("data.val_fraction=0.25", "seed=3", "train.early_stopping={patience: 2}"),
    )
    assert code == 0, err
    metrics = json.loads((run_dir / "metrics.json").read_text())
    rows = list(csv.DictReader((run_dir / "log.csv").open()))
    val_nll = [float(r["val/nll"]) for r in rows]
    stop = metrics["early_stopping"]
    assert stop["criterion"] == "nll" and stop["best_epoch"] == 1 + int(np.argmin(val_nll))
    assert stop["stopped_early"] and stop["epochs_trained"] == len(rows) == stop["best_epoch"] + 2 < 15
    splits = _held_out_by_hand(0.25, 3)
    best = run_dir / "best.safetensors"
    assert stop["best_value"] == pytest.approx(_point_nll(best, *splits["val"]), rel=1e-5)
    assert float(rows[stop["best_epoch"] - 1]["val/loss"]) == pytest.approx(stop["best_value"], rel=1e-9)  # one sample
    assert metrics["nll"] == pytest.approx(_point_nll(best, *splits["test"]), rel=1e-5)  # evaluated at the best state
    last = _point_nll(run_dir / "checkpoint.safetensors", *splits["val"])
    assert last == pytest.approx(val_nll[-1], rel=1e-5) and last > stop["best_value"]


def test_compare_chooses_candidates_on_the_validation_gaussian_nll(tmp_path, capsys):
    """A regression entry's candidate lists are chosen on validation: every candidate's val_nll is the Gaussian NLL of
    its weights on the validation split standardized here (scipy), the chosen one is the smallest, and only it meets
    the test set."""
    out_dir = tmp_path / "cmp"
    code, _, err = _diabetes(
        capsys,
        "compare",
        out_dir,
        "data.val_fraction=0.25",
        "compare.methods=[{name: sgd, optim: {lr: [0.001, 0.01, 0.1]}}]",
    )
    assert code == 0, err
    (row,) = json.loads((out_dir / "results.json").read_text())["runs"]
    sel = row["selection"]
    assert sel["criterion"] == "val_nll" and [c["options"]["optim.lr"] for c in sel["candidates"]] == [0.001, 0.01, 0.1]
    val = _held_out_by_hand(0.25, 0)["val"]  # compare.seeds: [0]
    by_hand = [_point_nll(Path(c["run_dir"]) / "checkpoint.safetensors", *val) for c in sel["candidates"]]
    for cand, expected in zip(sel["candidates"], by_hand, strict=True):
        assert cand["val_nll"] == pytest.approx(expected, rel=1e-5)
    best = int(np.argmin(by_hand))
    assert len(set(by_hand)) == 3 and sel["chosen"] == sel["candidates"][best]["options"]
    assert row["run_dir"] == sel["candidates"][best]["run_dir"] and row["likelihood"] == "gaussian"
    for i, cand in enumerate(sel["candidates"]):
        metrics = json.loads((Path(cand["run_dir"]) / "metrics.json").read_text())
        assert ("nll" in metrics) == (i == best)  # only the chosen one met the test set


def test_the_training_rmse_of_an_epoch_is_that_of_its_steps_outputs_and_survives_a_resume():
    """The loop's ``rmse`` of regression targets (``regression=True``) is √(mean over the epoch's examples of
    (μ − y)²), μ the first output of each step's (unperturbed) pass, here of fixed weights, so numpy gives it on the
    whole set; a run resumed from a checkpoint inside an epoch, or right at its end, records the same; a classifier's
    history has no rmse."""
    from flatbma.loop import History, fit
    from flatbma.types import State, StepOutput, Transform

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(11, 3, generator=gen), torch.randn(11, generator=gen)
    w = torch.tensor([0.5, -1.0, 2.0])

    def update(state, batch):
        xb, _ = batch
        outputs = torch.stack([xb @ w, torch.zeros(len(xb))], dim=1)  # (μ, raw scale)
        return State(params=state.params, step=state.step + 1), StepOutput(torch.tensor(0.0), outputs)

    transform = Transform(init=lambda p, b: State(params=p), update=update)
    loader = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 11, 4)]  # batches of 4, 4, 3
    expected = float(np.sqrt(((x.numpy() @ w.numpy() - y.numpy()) ** 2).mean()))
    saved = []
    _, history = fit(
        transform,
        State(params={}),
        loader,
        epochs=2,
        progress=False,
        checkpoint=lambda s, p, h: saved.append((s, p, History(list(h.epochs)))),
        checkpoint_every=1,
        regression=True,
    )
    assert [h.rmse for h in history.epochs] == pytest.approx([expected] * 2, rel=1e-6)
    assert [h.accuracy for h in history.epochs] == [0.0, 0.0] and history.epochs[0].record()["rmse"] == history.epochs[
        0
    ].rmse
    for epoch, batch in ((1, 1), (0, 3), (1, 3)):  # mid-epoch; the first epoch's last step; the second's
        state, position, before = next(item for item in saved if (item[1].epoch, item[1].batch) == (epoch, batch))
        _, resumed = fit(
            transform, state, loader, epochs=2, progress=False, resume=position, history=before, regression=True
        )
        assert [h.rmse for h in resumed.epochs][epoch:] == [h.rmse for h in history.epochs][epoch:]
    labels = [(x[:4], torch.tensor([0, 1, 0, 1]))]
    _, classified = fit(transform, State(params={}), labels, epochs=1, progress=False)
    assert classified.epochs[0].rmse is None and "rmse" not in classified.epochs[0].record()


def test_a_regression_log_has_the_training_rmse_instead_of_an_accuracy(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, _, err = _diabetes(capsys, "train", run_dir, "method={name: sgd}")
    assert code == 0, err
    lines = (run_dir / "log.csv").read_text().splitlines()
    assert lines[0] == "epoch,loss,rmse,steps,lr,time_s"
    history = json.loads((run_dir / "metrics.json").read_text())["history"]
    rows = list(csv.DictReader(lines))
    assert [float(r["rmse"]) for r in rows] == [h["rmse"] for h in history] and all(h["rmse"] > 0 for h in history)
    assert [float(r["loss"]) for r in rows] == [h["loss"] for h in history]


def _training_split_by_hand() -> tuple[np.ndarray, np.ndarray]:
    """The training split of diabetes (no validation share), standardized on itself (numpy, ddof=1)."""
    raw = load_diabetes(scaled=False)
    x, y = np.asarray(raw.data, dtype=np.float64), np.asarray(raw.target, dtype=np.float64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train = perm[round(0.2 * len(y)) :].sort().values.numpy()
    x, y = x[train], y[train]
    return (x - x.mean(0)) / x.std(0, ddof=1), (y - y.mean()) / y.std(ddof=1)


LINEAR_MODEL = """
from torch import nn


def linear(num_classes, in_channels, **_):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels, num_classes))
"""


def test_the_flatness_of_a_linear_regression_is_the_spectrum_of_its_gram_matrix(tmp_path, capsys, monkeypatch):
    """eval.flatness on a regression run measures the Hessian of its training loss, the mean Gaussian NLL with its
    noise_std: for a linear model μ = [X 1]·θ that is the Gram matrix [X 1]ᵀ[X 1]/(nσ²), whatever θ; its top
    eigenvalues by numpy's eigvalsh on diabetes standardized here are λ₁…λ₃ per sample and at the mean."""
    (tmp_path / "linmod.py").write_text(LINEAR_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir, sigma = tmp_path / "run", 0.7
    code, _, err = _diabetes(
        capsys,
        "train",
        run_dir,
        *("method={name: swag, rank: 2, collect_every: 1, start_step: 10}", "model.name=linmod:linear"),
        *(f"model.noise_std={sigma}", "eval.flatness=true", "eval.flatness_samples=2", "eval.hessian_k=3"),
        *("eval.hessian_tol=1.0e-6", "eval.repeatability=false"),
    )
    assert code == 0, err
    metrics = json.loads((run_dir / "metrics.json").read_text())
    x, _ = _training_split_by_hand()
    design = np.hstack([x, np.ones((len(x), 1))])
    expected = np.linalg.eigvalsh(design.T @ design / (len(x) * sigma**2))[::-1][:3]
    assert metrics["hessian_examples"] == len(x) == 354 and metrics["flatness_samples"] == 2
    for spectrum in metrics["hessian_top_eigenvalues"]:  # two SWAG samples, the same Hessian
        np.testing.assert_allclose(spectrum, expected, rtol=1e-4)
    assert metrics["lambda1"] == pytest.approx(expected[0], rel=1e-4)
    assert metrics["lambda1_at_mean"] == pytest.approx(expected[0], rel=1e-4)
    assert metrics["lambda1_over_lambda3"] == pytest.approx(expected[0] / expected[2], rel=1e-3)
    assert metrics["width"]["trace_cov"] > 0 and metrics["nll"] == metrics["nll"]


def test_the_flatness_of_a_learned_noise_mlp_is_that_of_its_full_gaussian_nll_hessian(tmp_path, capsys):
    """With a learned noise the loss is ½ log(2π σ²) + (y − μ)²/(2σ²), σ² = softplus(s) + 10⁻⁶, over the mean and the
    scale outputs: λ₁ of the run's point estimate equals the top eigenvalue (numpy) of the full Hessian of that
    NLL, written out here, over every weight (torch.autograd.functional.hessian in float64)."""
    run_dir = tmp_path / "run"
    code, _, err = _diabetes(
        capsys,
        "train",
        run_dir,
        *("method={name: sgd}", "model.width=4", "eval.flatness=true", "eval.hessian_tol=1.0e-6"),
        "eval.repeatability=false",
    )
    assert code == 0, err
    metrics = json.loads((run_dir / "metrics.json").read_text())
    state = load_state(run_dir / "checkpoint.safetensors")
    model = build_model("mlp", num_classes=2, in_channels=10, image_size=1, width=4).double()
    names = list(state.params)
    shapes = [state.params[n].shape for n in names]
    theta = torch.cat([state.params[n].double().reshape(-1) for n in names])
    x, y = (torch.from_numpy(a) for a in _training_split_by_hand())

    def nll(flat):
        parts = torch.split(flat, [math.prod(s) for s in shapes])
        weights = {n: p.reshape(s) for n, p, s in zip(names, parts, shapes, strict=True)}
        out = functional_call(model, {**weights, **{k: v.double() for k, v in state.buffers.items()}}, (x,))
        var = torch.nn.functional.softplus(out[:, 1]) + 1e-6
        return (0.5 * torch.log(2 * math.pi * var) + (y - out[:, 0]) ** 2 / (2 * var)).mean()

    hessian = torch.autograd.functional.hessian(nll, theta).numpy()
    expected = np.linalg.eigvalsh(hessian)[-1]
    assert metrics["lambda1"] == pytest.approx(expected, rel=1e-4)
    assert metrics["hessian_examples"] == 354 and metrics["hessian_converged"]


def test_compare_measures_the_flatness_and_landscape_of_regression_rows(tmp_path, capsys):
    out_dir = tmp_path / "cmp"
    code, _, err = _diabetes(
        capsys,
        "compare",
        out_dir,
        *("eval.flatness_samples=2", "compare.flatness=true", "compare.landscape=true", "eval.repeatability=false"),
        "compare.methods=[{name: sgd}, {name: swag, rank: 2, collect_every: 1, start_step: 10}]",
    )
    assert code == 0, err
    rows = json.loads((out_dir / "results.json").read_text())["runs"]
    for row in rows:
        assert row["lambda1"] > 0 and row["width"]["trace_cov"] >= 0 and len(row["landscape"]["mean"]) == 21
        assert abs(row["landscape"]["alphas"][10]) < 1e-6 and all(math.isfinite(v) for v in row["landscape"]["mean"])
    sgd = Path(rows[0]["run_dir"]) / "checkpoint.safetensors"  # a point: at α = 0 its training Gaussian NLL (scipy)
    assert rows[0]["landscape"]["mean"][10] == pytest.approx(_point_nll(sgd, *_training_split_by_hand()), rel=1e-5)
    header = next(line for line in (out_dir / "report.md").read_text().splitlines() if line.startswith("| method |"))
    assert "λ₁ median" in header and "RMSE" in header


def test_a_two_stage_regression_run_fits_its_prior_on_the_gaussian_nll_and_trains_against_it(tmp_path, capsys):
    """A `prior` stage on a regression run: the first stage is exactly the SWAG run of its config trained alone (the
    Gaussian NLL), and the second stage's update is FP-BMA with that fitted prior and the Gaussian likelihood as its
    loss, built here by hand (fp_bma.build_with_prior, Objective(loss_fn=Gaussian()))."""
    from flatbma.experiment.run.build import build_experiment
    from flatbma.experiment.run.prior import fit_prior
    from flatbma.optim import SGD
    from flatbma.params import Objective
    from flatbma.posteriors import fp_bma
    from flatbma.regression import Gaussian

    swag = "{name: swag, rank: 2, start_step: 10, collect_every: 1}"
    two_stage = ["--set", "method={name: fp-bma, rank: 2}", "--set", "optim.lr=0.002"]
    two_stage += ["--set", f"prior={{method: {swag}, epochs: 3}}"]
    run_dir, alone = tmp_path / "two", tmp_path / "alone"
    code, _, err = _run(
        capsys, "train", "--config", "diabetes-regression", "--set", f"output_dir={run_dir}", *TINY, *two_stage
    )
    assert code == 0, err
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["likelihood"] == "gaussian" and math.isfinite(metrics["nll"]) and metrics["prior_run"]
    code, _, err = _run(
        capsys,
        "train",
        "--config",
        "diabetes-regression",
        "--set",
        f"output_dir={alone}",
        *TINY,
        "--set",
        f"method={swag}",
        "--set",
        "optim.lr=0.002",  # the first stage's: the run's optim (no prior.optim)
    )
    assert code in (0, 3), err  # 3: flagged, three epochs at lr 0.002 move its training RMSE by under 1 %
    assert (run_dir / "prior" / "config.yaml").read_text().splitlines()[2:] == (
        (alone / "config.yaml").read_text().splitlines()[2:]
    )  # the same config but its output_dir
    first, single = (load_state(d / "checkpoint.safetensors") for d in (run_dir / "prior", alone))
    assert set(first.params) == set(single.params)
    for k in first.params:
        assert torch.equal(first.params[k], single.params[k]), k

    cfg = load_config(run_dir / "config.yaml")
    fitted = fit_prior(cfg)  # reused: the first stage finished with this config
    exp = build_experiment(cfg, prior=fitted.theta)
    by_hand = fp_bma.build_with_prior(
        Objective(model=exp.model, num_data=len(exp.train_loader.dataset), loss_fn=Gaussian()),
        SGD(lr=0.002, momentum=0.9, weight_decay=1e-4),
        cfg.method.ascent,
        fitted.theta,
        rank=2,
    )
    batch = next(iter(exp.train_loader))
    torch.manual_seed(0)
    a, out_a = exp.method.update(exp.method.init(fitted.theta, fitted.buffers), batch)
    torch.manual_seed(0)
    b, out_b = by_hand.update(by_hand.init(fitted.theta, fitted.buffers), batch)
    assert out_a.logits.shape == (len(batch[1]), 2)
    for k in a.params:
        torch.testing.assert_close(a.params[k], b.params[k])


def test_torchrun_trains_a_regression_run_like_one_process(tmp_path):
    """Two processes (gloo, torchrun) of data-parallel SWAG with early stopping on diabetes reproduce one process: the
    same weights (float32 tolerance: the mean of two shard means), the same history (loss, training RMSE, validation
    NLL) and the same mixture metrics, every process scoring the whole test set; only rank 0 writes."""
    from flatbma.experiment.run.checkpoint import load_checkpoint
    from flatbma.experiment.run.lock import LOCK_FILE
    from tests.experiment.torchrun_helpers import torchrun

    # 266 training examples in global batches of 50 (25 + 25) and a last one of 16 (8 + 8)
    args = ["--set", "data.batch_size=50", "--set", "data.val_fraction=0.25", "--set", "train.device=cpu"]
    args += ["--set", "method={name: swag, rank: 2, start_step: 0, collect_every: 2}"]
    args += ["--set", "train.early_stopping={patience: 5}"]
    one, many = tmp_path / "one", tmp_path / "many"
    code = main(["train", "--config", "diabetes-regression", "--set", f"output_dir={one}", *TINY, *args])
    assert code in (0, 3)  # 3: flagged (this tiny run does no better than the mean on validation); under torchrun 0
    out = torchrun(
        "-m", "flatbma", "train", "--config", "diabetes-regression", "--set", f"output_dir={many}", *TINY, *args
    )
    assert out.stdout.count("wrote ") == 1  # rank 0 prints
    expected = ["checkpoint.safetensors", "config.yaml", "log.csv", "metrics.json"]
    assert sorted(p.name for p in many.iterdir() if p.name not in (LOCK_FILE, "best.safetensors")) == expected
    a, _, _ = load_checkpoint(one / "checkpoint.safetensors")
    b, _, _ = load_checkpoint(many / "checkpoint.safetensors")
    assert a.step == b.step > 0
    for section in ("params", "aux"):
        for k, v in getattr(a, section).items():
            torch.testing.assert_close(getattr(b, section)[k], v, atol=1e-5, rtol=1e-5, msg=f"{section}/{k}")
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (one, many))
    assert mb["world_size"] == 2 and ma["n"] == mb["n"] == 88 and ma["steps"] == mb["steps"] == 18
    for key in ("nll", "rmse", "mae", "coverage_0.5", "coverage_0.9", "calibration_error", "epistemic_var"):
        assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-7), key
    for ha, hb in zip(ma["history"], mb["history"], strict=True):
        assert hb["steps"] == ha["steps"] and hb["rmse"] == pytest.approx(ha["rmse"], rel=1e-5)
        assert hb["loss"] == pytest.approx(ha["loss"], rel=1e-5)
        assert hb["validation"]["nll"] == pytest.approx(ha["validation"]["nll"], rel=1e-5)
    assert mb["early_stopping"]["best_epoch"] == ma["early_stopping"]["best_epoch"]
