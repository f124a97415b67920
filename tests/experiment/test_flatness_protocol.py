"""The flatness protocol of a run: deterministic BatchNorm statistics for every method, λ₁ over all
training examples with convergence, width and repeatability in the metrics."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader

from flatbma import bn
from flatbma.bn import recompute_bn_statistics
from flatbma.errors import FlatbmaError
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.config.sections import EvalConfig
from flatbma.experiment.run.build import build_experiment, statistics_loader
from flatbma.experiment.run.evaluate import BN_RECOMPUTED, evaluate_state, posterior_samples
from flatbma.experiment.run.pipeline import train
from flatbma.params import model_buffers, trainable_params

RAW = {
    "seed": 1,
    "method": {"name": "sgd"},
    "data": {"name": "digits", "k_shot": 12, "augment": True, "batch_size": 32, "eval_batch_size": 500},
    "model": {"name": "cnn", "width": 4},
    "optim": {"lr": 0.05},
    "train": {"epochs": 2, "progress": False},
    "eval": {"num_samples": 4, "flatness_samples": 4, "trace_probes": 2},
}


def _config(tmp_path, **changes):
    raw = copy.deepcopy(RAW)
    raw["output_dir"] = str(tmp_path / "run")
    for section, values in changes.items():
        raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
    return config_from_dict(raw)


def _bn_buffers(weights: dict) -> dict:
    return {k: v for k, v in weights.items() if "running_" in k}


def test_bn_statistics_are_deterministic_and_augmentation_does_not_enter(tmp_path):
    exp = build_experiment(_config(tmp_path))
    plain = build_experiment(_config(tmp_path, data={"augment": False}))
    train_set = exp.train_loader.dataset
    torch.manual_seed(0)
    assert any(not torch.equal(train_set[0][0], train_set[0][0]) for _ in range(10))  # augmentation draws
    state = exp.method.init(trainable_params(exp.model), model_buffers(exp.model))

    first, again = posterior_samples(exp, state), posterior_samples(exp, state)
    (unaugmented,) = posterior_samples(plain, state)
    assert len(first) == 1  # a point estimate
    for key, value in _bn_buffers(first[0]).items():
        assert torch.equal(value, again[0][key]), key  # the same statistics twice
        assert torch.equal(value, unaugmented[key]), key  # augmentation does not enter
        assert not torch.equal(value, state.buffers[key]), key  # the point's statistics are recomputed too
    # the statistics of all training images without augmentation, read by an independent loader
    images = plain.bn_loader.dataset
    reference = recompute_bn_statistics(exp.model, state.params, [next(iter(DataLoader(images, len(images))))])
    for key, value in _bn_buffers(first[0]).items():
        torch.testing.assert_close(value, reference[key])


def test_the_statistics_loader_has_a_fixed_order_and_no_batch_of_one():
    data = torch.utils.data.TensorDataset(torch.arange(21.0)[:, None], torch.zeros(21))
    loader = statistics_loader(data, 10)
    batches = [x[:, 0].tolist() for x, _ in loader]
    assert [len(b) for b in batches] == [10, 11]
    assert sorted(x for b in batches for x in b) == list(range(21))
    assert batches != [list(range(10)), list(range(10, 21))]  # not the data set's order
    assert batches == [x[:, 0].tolist() for x, _ in statistics_loader(data, 10)]


@pytest.mark.parametrize(
    ("method", "calls"), [({"name": "sgd"}, 1), ({"name": "mc-dropout"}, 1), ({"name": "mfvi"}, 4)]
)
def test_every_method_takes_the_same_bn_path(tmp_path, monkeypatch, method, calls):
    """Point, dropout and Gaussian methods: every distinct sample's statistics recomputed on the same loader."""
    exp = build_experiment(_config(tmp_path, method=method))
    state = exp.method.init(trainable_params(exp.model), model_buffers(exp.model))
    seen = []

    def counting(model, weights, loader, **kw):
        seen.append(loader)
        return recompute_bn_statistics(model, weights, loader, **kw)

    monkeypatch.setattr(bn, "recompute_bn_statistics", counting)  # what flatbma.bn.with_recomputed_statistics calls
    samples = posterior_samples(exp, state)
    assert len(seen) == calls and all(loader is exp.bn_loader for loader in seen)
    assert len(samples) == (1 if method["name"] == "sgd" else 4)


def test_flatness_metrics_of_a_run(tmp_path):
    """SWAG and SGD on a BatchNorm CNN: λ₁ over every training example, summaries, width, repeatability."""
    swag = {"name": "swag", "rank": 3, "start_step": 2, "collect_every": 1}
    trained = train(_config(tmp_path, method=swag), evaluate=False)
    exp = trained.experiment
    metrics = evaluate_state(exp, trained.state, flatness=True)
    n_train = len(exp.train_loader.dataset)
    assert metrics["hessian_examples"] == n_train == 120  # all of them: eval.hessian_examples is None
    assert metrics["bn_statistics"] == BN_RECOMPUTED
    assert metrics["hessian_converged"] and metrics["lambda1_unconverged"] == []
    summary = metrics["lambda1_summary"]
    assert summary["n"] == 4 and summary["method"] == "bootstrap" and summary["mean"] == metrics["lambda1"]
    assert summary["interval"]["low"] <= summary["mean"] <= summary["interval"]["high"]
    assert metrics["lambda1_at_mean"] > 0 and metrics["distribution_lambda1"] <= metrics["lambda1"] + 1e-6
    assert metrics["hessian_trace"]["n"] == 4 and metrics["hessian_trace"]["probes"] == 2
    width = metrics["width"]
    assert width["exact"] and width["trace_cov"] > 0 and width["median_std"] > 0
    rep = metrics["repeatability"]
    assert isinstance(rep["agree"], bool) and rep["second"]["n"] == 4 and rep["second"]["mean"] != summary["mean"]
    assert "lambda1_over_lambda5" not in metrics  # k = 1 by default
    assert _without_times(evaluate_state(exp, trained.state, flatness=True)) == _without_times(metrics)

    point = train(_config(tmp_path, output_dir=str(tmp_path / "sgd")), evaluate=False)
    metrics = evaluate_state(point.experiment, point.state, flatness=True)
    assert metrics["width"] == {**metrics["width"], "trace_cov": 0.0, "median_std": 0.0, "exact": True}
    assert metrics["flatness_samples"] == 1 and metrics["lambda1_at_mean"] == metrics["lambda1"]
    assert metrics["repeatability"]["agree"]  # the same point, another Lanczos start


def _without_times(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith("_time_s")}


def test_eval_config_checks_the_protocol_options():
    assert EvalConfig().hessian_examples is None and EvalConfig().hessian_k == 1
    with pytest.raises(FlatbmaError, match="hessian_max_iter"):
        EvalConfig(hessian_k=5, hessian_max_iter=3)
    with pytest.raises(FlatbmaError, match="hessian_tol"):
        EvalConfig(hessian_tol=1.5)
    with pytest.raises(FlatbmaError, match="trace_probes"):
        EvalConfig(trace_probes=1)
