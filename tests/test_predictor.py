"""The BMA predictor: every trap of prediction by hand is impossible through it, and its numbers are the
careful manual path's (same samples, same BatchNorm statistics, same mode), bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

import flatbma
from flatbma import BMA
from flatbma.bn import eval_mode, recompute_bn_statistics, statistics_loader
from flatbma.errors import FlatbmaError
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.run.evaluate import evaluate_state
from flatbma.experiment.run.pipeline import train
from flatbma.loop import fit
from flatbma.optim import SGD, cosine
from flatbma.posteriors import mc_dropout, point, swag
from flatbma.predict import bma_log_probs, evaluate
from flatbma.types import prediction_mode

M = 6


def _data(n: int = 240, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, :3] + 0.3 * x[:, 3:]).argmax(1)


def _net(dropout: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU()]
    return nn.Sequential(*layers, *([nn.Dropout(0.3)] if dropout else []), nn.Linear(16, 3))


@pytest.fixture(scope="module")
def trained_swag():
    """SWAG on a BatchNorm MLP, trained by hand: ``(model, method, state, train set, loader)``."""
    x, y = _data()
    train_set = TensorDataset(x, y)
    loader = DataLoader(train_set, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))
    model = _net()
    optimizer = SGD(lr=cosine(0.05, total_steps=6 * len(loader)), momentum=0.9)
    method = swag.build(flatbma.Objective(model, num_data=len(x)), optimizer, rank=4, start_step=8, collect_every=2)
    state = method.init(flatbma.trainable_params(model), flatbma.model_buffers(model))
    model.train()
    state, _ = fit(method, state, loader, epochs=6, progress=False)
    return model, method, state, train_set, loader


def _test_loader() -> DataLoader:
    return DataLoader(TensorDataset(*_data(90, seed=5)), batch_size=40)


def _manual_samples(model, method, state, train_set, batch_size=32, seed=0):
    """The careful manual path: drawn once with a seeded generator, statistics recomputed per sample."""
    samples = method.sample(state, M, torch.Generator().manual_seed(seed))
    bn_data = statistics_loader(train_set, batch_size)
    return [recompute_bn_statistics(model, w, bn_data) for w in samples]


def _assert_same_samples(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- mode -----------------------------------------------------------------------------------------------


def test_a_module_left_in_train_mode_gives_the_eval_mode_answers_and_keeps_its_modes(trained_swag):
    model, method, state, train_set, loader = trained_swag
    x = _data(50, seed=3)[0]
    bma = BMA(model, method, state, loader, num_samples=M)
    model.train()
    model[1].eval()  # a mixed configuration, restored exactly
    modes = [m.training for m in model.modules()]
    in_train = bma.predict_proba(x)
    assert [m.training for m in model.modules()] == modes
    model.eval()
    in_eval = bma.predict_proba(x)
    assert not model.training
    assert torch.equal(in_train, in_eval)
    # the trap the predictor removes: the same samples through the module's own (train) mode differ
    model.train()
    trap = bma_log_probs(model, bma.samples, x).exp()
    assert (trap - in_eval).abs().max() > 1e-3


def test_predicting_twice_gives_the_same_answer_and_leaves_the_global_rng(trained_swag):
    model, method, state, _, loader = trained_swag
    bma = BMA(model, method, state, loader, num_samples=M, seed=4)
    x = _data(30, seed=3)[0]
    before = torch.get_rng_state()
    first = bma.predict_log_proba(x)
    assert torch.equal(first, bma.predict_log_proba(x))
    assert torch.equal(torch.get_rng_state(), before)
    other = BMA(model, method, state, loader, num_samples=M, seed=5).predict_log_proba(x)
    assert not torch.equal(first, other)  # the seed chooses the samples


# --- BatchNorm ------------------------------------------------------------------------------------------


def test_swag_samples_get_the_statistics_of_the_manual_recompute_path(trained_swag):
    model, method, state, train_set, loader = trained_swag
    assert method.recompute_bn
    bma = BMA(model, method, state, loader, num_samples=M)
    assert bma.recompute_bn
    manual = _manual_samples(model, method, state, train_set)
    _assert_same_samples(bma.samples, manual)
    test = _test_loader()
    expected = evaluate(model, manual, test, num_classes=3, mode=method.predict_mode)
    assert bma.evaluate(test) == expected  # bit for bit
    # the loader's shuffling does not enter: the statistics of all training data, in a fixed order
    whole = recompute_bn_statistics(model, method.sample(state, 1, torch.Generator().manual_seed(0))[0], [train_set[:]])
    torch.testing.assert_close(bma.samples[0]["1.running_mean"], whole["1.running_mean"])
    # the trap it removes: the state's statistics (those of the SGD iterate) give other numbers
    kept = BMA(model, method, state, loader, num_samples=M, recompute_bn=False).evaluate(test)
    assert abs(kept["nll"] - expected["nll"]) > 1e-4


def test_training_inputs_alone_serve_for_the_statistics(trained_swag):
    model, method, state, train_set, loader = trained_swag
    inputs_only = DataLoader(TensorDataset(train_set.tensors[0]), batch_size=32)  # batches [x]
    ours = BMA(model, method, state, inputs_only, num_samples=M).samples
    _assert_same_samples(ours, BMA(model, method, state, loader, num_samples=M).samples)


def test_a_posterior_that_needs_statistics_needs_the_training_data(trained_swag):
    model, method, state, _, _ = trained_swag
    with pytest.raises(FlatbmaError, match="train_loader="):
        BMA(model, method, state)
    BMA(model, method, state, recompute_bn=False)  # the explicit choice is allowed


def test_the_predictor_equals_the_evaluation_of_flatbma_train(tmp_path):
    """BMA(exp.model, exp.method, state, ...) gives the metrics ``flatbma train`` records, bit for bit."""
    raw = {
        "seed": 2,
        "output_dir": str(tmp_path / "run"),
        "method": {"name": "swag", "rank": 3, "start_step": 2, "collect_every": 1},
        "data": {"name": "digits", "k_shot": 10, "batch_size": 25, "eval_batch_size": 60, "test_limit": 120},
        "model": {"name": "cnn", "width": 4},
        "train": {"epochs": 2, "progress": False},
        "eval": {"num_samples": 3},
    }
    trained = train(config_from_dict(raw), evaluate=False)
    exp = trained.experiment
    recorded = evaluate_state(exp, trained.state)
    bma = BMA(
        exp.model,
        exp.method,
        trained.state,
        exp.bn_loader,
        num_samples=exp.config.eval.num_samples,
        seed=exp.config.seed,
        recompute_bn=True,
    )
    ours = bma.evaluate(exp.test_loader)
    for key in ("accuracy", "nll", "ece", "aece", "brier", "n", "num_samples"):
        assert ours[key] == recorded[key], key


# --- MC dropout -----------------------------------------------------------------------------------------


def _trained_dropout():
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=48, shuffle=True, generator=torch.Generator().manual_seed(2))
    model = _net(dropout=True)
    method = mc_dropout.build(flatbma.Objective(model, num_data=len(x)), SGD(lr=0.05, momentum=0.9), rate=0.3)
    state = method.init(flatbma.trainable_params(model), flatbma.model_buffers(model))
    model.train()
    state, _ = fit(method, state, loader, epochs=2, progress=False)
    return model, method, state, loader


def test_mc_dropout_predicts_in_its_mode_as_the_manual_path_does():
    model, method, state, loader = _trained_dropout()
    x = _data(40, seed=3)[0]
    test = _test_loader()
    bma = BMA(model, method, state, loader, num_samples=M, seed=7)
    probs = bma.predict_proba(x)
    # dropout is on: not the deterministic eval-mode network
    model.eval()
    deterministic = bma_log_probs(model, [bma.samples[0]], x).exp()
    assert (probs - deterministic).abs().max() > 1e-3
    # the manual path: samples with the same seed, the method's prediction mode
    samples = method.sample(state, M, torch.Generator().manual_seed(7))
    assert bma.evaluate(test) == evaluate(model, samples, test, num_classes=3, mode=prediction_mode(method, 7))
    # masks follow the predictor's seed, not whatever sampled from the method last
    method.sample(state, M, torch.Generator().manual_seed(99))
    assert torch.equal(bma.predict_proba(x), probs)
    assert not model.training  # the mode it was left in


# --- inputs ---------------------------------------------------------------------------------------------


def test_inputs_alone_batches_and_loaders_give_the_same_predictions(trained_swag):
    model, method, state, _, loader = trained_swag
    bma = BMA(model, method, state, loader, num_samples=M)
    x, y = _data(70, seed=8)
    expected = bma.predict_log_proba(x)
    assert expected.shape == (70, 3)
    torch.testing.assert_close(bma.predict_log_proba((x,)), expected, rtol=0, atol=0)
    torch.testing.assert_close(bma.predict_log_proba((x, y)), expected, rtol=0, atol=0)
    torch.testing.assert_close(bma.predict_log_proba([x, y]), expected, rtol=0, atol=0)  # a DataLoader's batch
    x_only = DataLoader(TensorDataset(x), batch_size=32)  # batches [x]
    torch.testing.assert_close(bma.predict_log_proba(x_only), expected, rtol=1e-6, atol=1e-6)
    labelled = DataLoader(TensorDataset(x, y), batch_size=32)
    torch.testing.assert_close(bma.predict_log_proba(labelled), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bma.predict_log_proba([x[:30], x[30:]]), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(bma.predict(x), expected.argmax(-1))
    torch.testing.assert_close(bma.predict_proba(x).sum(-1), torch.ones(70))


def test_uncertainty_splits_the_bma_entropy_over_the_predictors_own_samples(trained_swag):
    model, method, state, _, loader = trained_swag
    bma = BMA(model, method, state, loader, num_samples=M)
    x = _data(50, seed=8)[0]
    out = bma.predict_uncertainty(DataLoader(TensorDataset(x), batch_size=16))
    torch.testing.assert_close(out["total"], flatbma.metrics.predictive_entropy(bma.predict_log_proba(x)))
    with torch.no_grad(), eval_mode(model):  # the manual path: every sample's own entropy, averaged
        per_sample = [torch.log_softmax(functional_call(model, w, (x,)), -1) for w in bma.samples]
    expected = torch.stack([flatbma.metrics.predictive_entropy(lp) for lp in per_sample]).mean(0)
    torch.testing.assert_close(out["aleatoric"], expected)
    torch.testing.assert_close(out["total"], out["aleatoric"] + out["epistemic"], rtol=0, atol=0)
    assert float(out["epistemic"].min()) > 0  # SWAG's samples disagree somewhere on every input
    torch.testing.assert_close(bma.predict_entropy(x), out["total"])
    torch.testing.assert_close(bma.mutual_information(x), out["epistemic"])
    point_bma = BMA(model, point.build(flatbma.Objective(model), SGD(lr=0.1)), state, loader, num_samples=M)
    assert torch.equal(point_bma.mutual_information(x), torch.zeros(50, dtype=torch.float64))


def test_the_probit_predictive_refuses_the_split_in_one_line():
    loader = DataLoader(TensorDataset(*_data(60)), batch_size=30)
    bma = flatbma.fit_posterior(_net(), loader, "laplace", epochs=1, predictive="probit", hessian="diag")
    with pytest.raises(FlatbmaError, match="predictive: glm"):
        bma.predict_uncertainty(_data(5)[0])


def test_bad_inputs_and_unlabelled_metrics_end_in_one_clear_error(trained_swag):
    model, method, state, _, loader = trained_swag
    bma = BMA(model, method, state, loader, num_samples=M)
    x = _data(20)[0]
    with pytest.raises(FlatbmaError, match="labelled"):
        bma.evaluate(DataLoader(TensorDataset(x), batch_size=8))
    with pytest.raises(FlatbmaError, match="labelled"):  # the functional path says where inputs alone go
        list(flatbma.predict(model, bma.samples, DataLoader(TensorDataset(x), batch_size=8)))
    with pytest.raises(FlatbmaError, match="a dict batch must hold its inputs"):
        bma.predict_proba({"features": x})
    with pytest.raises(FlatbmaError, match="a batch must be"):
        bma.predict_proba((x, x, x))
    with pytest.raises(FlatbmaError, match="nothing to predict"):
        bma.predict_proba([])
    with pytest.raises(FlatbmaError, match="empty"):
        bma.evaluate([])


def test_the_number_of_classes_is_read_from_the_model(trained_swag):
    model, method, state, _, loader = trained_swag
    bma = BMA(model, method, state, loader, num_samples=M)
    test = _test_loader()
    assert bma.evaluate(test) == bma.evaluate(test, num_classes=3)


# --- files ----------------------------------------------------------------------------------------------


def test_save_and_load_round_trip_bit_for_bit(trained_swag, tmp_path):
    model, method, state, train_set, loader = trained_swag
    bma = BMA(model, method, state, loader, num_samples=M, seed=3)
    x = _data(50, seed=3)[0]
    path = tmp_path / "bma.safetensors"
    bma.save(path)
    again = BMA.load(path, model, method, loader)
    assert (again.num_samples, again.seed, again.recompute_bn) == (M, 3, True)
    for section in ("params", "buffers", "aux"):
        ours, theirs = getattr(bma.state, section), getattr(again.state, section)
        assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    _assert_same_samples(again.samples, bma.samples)
    assert torch.equal(again.predict_log_proba(x), bma.predict_log_proba(x))
    with pytest.raises(FlatbmaError, match="does not fit"):  # the state of another method
        other = point.build(flatbma.Objective(model), SGD(lr=0.1))
        BMA.load(path, nn.Sequential(nn.Linear(6, 3)), other)


def test_a_predictor_file_of_another_layout_is_refused_by_name(trained_swag, tmp_path):
    """A state whose components' entries are not under the names the method gives them (SWAG's point-update state
    at the top of ``aux``: ``momentum/<w>``, not ``point/optimizer/momentum/<w>``) is refused, never read guessed."""
    model, method, state, _, loader = trained_swag
    old_aux = {"/".join(s for s in k.split("/") if s not in ("point", "optimizer")): v for k, v in state.aux.items()}
    old = flatbma.State(params=state.params, buffers=state.buffers, aux=old_aux, step=state.step)
    path = tmp_path / "old.safetensors"
    BMA(model, method, old, loader, num_samples=M, seed=3).save(path)
    with pytest.raises(FlatbmaError, match=r"does not fit this model and method \(aux/point/optimizer/momentum/"):
        BMA.load(path, model, method, loader)


@pytest.mark.parametrize(
    "alter, problem",
    [
        (lambda s: s.params.update(w=s.params.pop("0.weight").double()), "params/0.weight is missing"),
        (lambda s: s.params.update({"0.weight": s.params["0.weight"].double()}), "is float64 instead of float32"),
        (lambda s: s.aux.update(extra=torch.zeros(3)), "aux/extra is unexpected"),
        (lambda s: s.buffers.update({"1.running_mean": torch.zeros(4)}), r"has shape \(4,\) instead of \(16,\)"),
    ],
)
def test_a_predictor_file_meets_the_rule_of_a_resumed_checkpoint(trained_swag, tmp_path, alter, problem):
    """The same structure check as ``--resume`` (state_io.structure_problem): names, dtypes, shapes, extra aux."""
    model, method, state, _, loader = trained_swag
    altered = copy.deepcopy(state)
    alter(altered)
    path = tmp_path / "bma.safetensors"
    BMA(model, method, altered, loader, num_samples=2).save(path)
    with pytest.raises(FlatbmaError, match=f"does not fit this model and method .*{problem}"):
        BMA.load(path, model, method, loader)


def test_the_iterates_a_sampler_keeps_are_accepted_on_load(tmp_path):
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=48, shuffle=True)
    bma = flatbma.fit_posterior(_net(), loader, "sgld", epochs=3, lr=0.01, burn_in=5, thin=2, num_samples=2)
    assert any(k.startswith("sgld/samples/") for k in bma.state.aux)  # grown while training
    path = tmp_path / "sgld.safetensors"
    bma.save(path)
    xs = _data(20, seed=4)[0]
    assert torch.equal(flatbma.load_posterior(path, _net(), loader).predict_log_proba(xs), bma.predict_log_proba(xs))


def test_a_packed_variational_state_round_trips_and_is_a_flatbma_state_file(tmp_path):
    from tests.helpers import load_state

    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=48, shuffle=True)
    bma = flatbma.fit_posterior(_net(), loader, "lowrank-vi", epochs=1, lr=0.01, rank=2, num_samples=3)
    path = tmp_path / "vi.safetensors"
    bma.save(path)
    again = flatbma.load_posterior(path, _net(), loader)
    xs = _data(20, seed=4)[0]
    assert torch.equal(again.predict_log_proba(xs), bma.predict_log_proba(xs))
    state = load_state(path)  # the run layer reads it as a state file
    assert state.step == bma.state.step and all(torch.equal(state.params[k], v) for k, v in bma.state.params.items())
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with pytest.raises(FlatbmaError, match="not a readable safetensors file"):
        flatbma.load_posterior(path, _net(), loader)


def test_fit_posterior_and_load_posterior_round_trip_with_a_fresh_module(tmp_path):
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=48, shuffle=True)
    bma = flatbma.fit_posterior(_net(dropout=False), loader, "mc-dropout", epochs=2, lr=0.05, rate=0.2, num_samples=4)
    path = tmp_path / "mc.safetensors"
    bma.save(path)
    fresh = _net()  # the same architecture; load_posterior rebuilds mc-dropout, which inserts its dropout layer
    again = flatbma.load_posterior(path, fresh, loader)
    assert again.method_config == bma.method_config and again.method_config["name"] == "mc-dropout"
    xs = _data(30, seed=9)[0]
    assert torch.equal(again.predict_proba(xs), bma.predict_proba(xs))
    (tmp_path / "run.safetensors").write_bytes(b"")
    with pytest.raises(FlatbmaError):
        flatbma.load_posterior(tmp_path / "run.safetensors", _net(), loader)


def test_a_run_checkpoint_is_not_a_predictor(trained_swag, tmp_path):
    from flatbma.experiment.run.checkpoint import save_state

    model, method, state, _, loader = trained_swag
    save_state(state, tmp_path / "checkpoint.safetensors")
    with pytest.raises(FlatbmaError, match="no predictor settings"):
        BMA.load(tmp_path / "checkpoint.safetensors", model, method, loader)


# --- device ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_the_device_argument_is_honoured_on_cpu(trained_swag, device):
    model, method, state, _, loader = trained_swag
    bma = BMA(model, method, state, loader, num_samples=M, device=device)
    assert bma.device == torch.device("cpu")
    out = bma.predict_log_proba(_data(10)[0])
    assert out.device.type == "cpu"
    assert all(v.device.type == "cpu" for w in bma.samples for v in w.values())


def test_the_device_moves_samples_inputs_and_module():
    """On the meta device (shapes only) every tensor of the prediction goes where the device says."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    method = point.build(flatbma.Objective(model), SGD(lr=0.1))
    state = method.init(flatbma.trainable_params(model), flatbma.model_buffers(model))
    bma = BMA(model, method, state, device="meta")
    out = bma.predict_log_proba(_data(5)[0])  # CPU inputs, moved
    assert out.device.type == "meta" and out.shape == (5, 3)
    assert next(model.parameters()).device.type == "meta"
    assert BMA(_net(), method, state, recompute_bn=False).device == torch.device("cpu")  # None: the module's
    with pytest.raises(FlatbmaError, match="not a device name"):
        BMA(model, method, state, device="gpu0")


# --- weights into the module ----------------------------------------------------------------------------


def test_load_into_writes_the_posterior_mean_and_its_statistics(trained_swag):
    model, method, state, train_set, loader = trained_swag
    target = copy.deepcopy(model)
    bma = BMA(model, method, state, loader, num_samples=M)
    samples_before = [dict(w) for w in bma.samples]
    assert bma.load_into(target) is target
    mean = bma.mean()
    expected = recompute_bn_statistics(model, method.mean(state), statistics_loader(train_set, 32))
    own = {**dict(target.named_parameters()), **dict(target.named_buffers())}
    for k, v in expected.items():
        assert torch.equal(own[k], v) and torch.equal(mean[k], v), k
    _assert_same_samples(bma.samples, samples_before)
    with pytest.raises(FlatbmaError, match=r"no parameter or buffer 'fc\.weight'"):
        flatbma.load_into(target, {"fc.weight": torch.zeros(3, 16)})
    with pytest.raises(FlatbmaError, match="shape"):
        flatbma.load_into(target, {"0.weight": torch.zeros(3, 3)})


# --- fit_posterior --------------------------------------------------------------------------------------


def test_fit_posterior_trains_restores_the_mode_and_leaves_the_callers_rng():
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=48, shuffle=True)
    model = _net()
    model.eval()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(11)
    before = torch.get_rng_state()
    bma = flatbma.fit_posterior(model, loader, "sgd", epochs=3, lr=0.05, num_samples=2, load_into=False)
    assert torch.equal(torch.get_rng_state(), before)
    assert not model.training
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())  # untouched without load_into
    assert len(bma.samples) == 1 and not bma.recompute_bn  # a point estimate keeps its trained statistics
    untrained = evaluate(model, [start], DataLoader(TensorDataset(*_data(90, seed=5)), batch_size=40), num_classes=3)
    assert bma.evaluate(_test_loader())["nll"] < untrained["nll"]
    again = flatbma.fit_posterior(_net(), loader, "sgd", epochs=3, lr=0.05, num_samples=2)
    assert torch.equal(again.predict_log_proba(x), bma.predict_log_proba(x))  # the seed fixes the run


def test_fit_posterior_refuses_bad_options_in_one_line():
    loader = DataLoader(TensorDataset(*_data(40)), batch_size=20)
    with pytest.raises(FlatbmaError, match=r"unknown method 'swagg'.*Did you mean 'swag'"):
        flatbma.fit_posterior(_net(), loader, "swagg", epochs=1)
    with pytest.raises(FlatbmaError, match=r"method\.rnak"):
        flatbma.fit_posterior(_net(), loader, "swag", epochs=1, rnak=3)
    with pytest.raises(FlatbmaError, match="given twice"):
        flatbma.fit_posterior(_net(), loader, "sgd", epochs=1, lr=0.1, optim={"lr": 0.2})
    with pytest.raises(FlatbmaError, match="epochs"):
        flatbma.fit_posterior(_net(), loader, "sgd", epochs=0)
    with pytest.raises(FlatbmaError, match="DataLoader"):
        flatbma.fit_posterior(_net(), iter(loader), "sgd", epochs=1)


def test_mc_dropout_masks_run_on_over_the_batches_of_one_prediction():
    """One prediction enters MC dropout's prediction mode once: its second batch does not reuse the first's masks.

    (The input check that prediction makes on its first batch runs inside that mode, in eval mode, drawing no mask.)
    """
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=48, shuffle=True)
    bma = flatbma.fit_posterior(_net(dropout=False), loader, "mc-dropout", epochs=1, lr=0.05, rate=0.3, num_samples=2)
    xs = _data(16, seed=5)[0]
    together = bma.predict_log_proba([xs[:8], xs[8:]])  # two batches (a list: its iteration draws nothing)
    assert torch.equal(together[:8], bma.predict_log_proba(xs[:8]))  # the same start
    assert not torch.allclose(together[8:], bma.predict_log_proba(xs[8:]))  # masks ran on
