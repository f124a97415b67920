"""``fit_posterior``'s defaults (issue #25): a fitted module that holds its posterior, a training history,
progress wherever ``stderr`` is no terminal, and flatness functions that say which weights they measure."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flatbma
from flatbma.errors import FlatbmaWarning
from flatbma.experiment.run.logs import COLUMNS
from flatbma.flatness import hessian_eigenvalues
from flatbma.optim.config import OptimConfig


def _data(n: int = 240, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, :3] + 0.3 * x[:, 3:]).argmax(1)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(*_data()), batch_size=48, shuffle=True)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def test_the_module_holds_the_posterior_mean_with_its_statistics_by_default():
    model = _net()
    start = copy.deepcopy(model.state_dict())
    bma = flatbma.fit_posterior(model, _loader(), "swag", epochs=6, lr=0.05, rank=4, start_step=10, collect_every=2)
    own, mean = _weights(model), bma.mean()  # SWA mean, BatchNorm statistics recomputed at it
    assert all(torch.equal(own[k], v) for k, v in mean.items())
    assert not torch.equal(own["1.running_mean"], start["1.running_mean"])
    x = _data(90, seed=5)[0]
    model.eval()
    point = flatbma.bma_log_probs(model, [mean], x)
    torch.testing.assert_close(model(x).log_softmax(-1), point)  # model(x) is the posterior mean's network

    kept = _net()
    flatbma.fit_posterior(kept, _loader(), "sgd", epochs=2, lr=0.05, load_into=False, progress=False)
    assert all(torch.equal(v, start[k]) for k, v in kept.state_dict().items())


def test_history_holds_the_rows_of_the_clis_log_csv():
    loader = _loader()
    bma = flatbma.fit_posterior(_net(), loader, "sgd", epochs=3, lr=0.05, progress=False)
    assert [row["epoch"] for row in bma.history] == [1, 2, 3]
    assert all(tuple(row)[: len(COLUMNS)] == COLUMNS for row in bma.history)
    rate = OptimConfig(lr=0.05).learning_rate(steps_per_epoch=len(loader), epochs=3)
    for row in bma.history:
        assert row["steps"] == len(loader) and row["time_s"] >= 0 and 0 <= row["accuracy"] <= 1
        assert row["lr"] == rate(row["epoch"] * len(loader) - 1)  # the schedule at the epoch's last step
    assert bma.history[-1]["loss"] < bma.history[0]["loss"]
    laplace = flatbma.fit_posterior(_net(), loader, "laplace", epochs=2, lr=0.05, hessian="diag", progress=False)
    assert [row["epoch"] for row in laplace.history] == [1, 2, 3]  # its curvature epoch too


def test_progress_prints_one_line_per_epoch_where_stderr_is_no_terminal(capsys):
    flatbma.fit_posterior(_net(), _loader(), "sgd", epochs=3, lr=0.05)  # pytest's stderr: no terminal
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("epoch ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]
    assert all(" loss " in line and " acc " in line for line in lines)
    flatbma.fit_posterior(_net(), _loader(), "sgd", epochs=2, lr=0.05, progress=False)
    assert capsys.readouterr().err == ""


def test_flatness_on_a_predictors_module_says_which_weights_it_measures():
    loader = _loader()
    kept = _net()
    bma = flatbma.fit_posterior(kept, loader, "sgd", epochs=2, lr=0.05, load_into=False, progress=False)
    with pytest.warns(FlatbmaWarning, match=r"does not hold its posterior mean.*weights=bma\.mean\(\)"):
        hessian_eigenvalues(kept, loader, k=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlatbmaWarning)
        at_mean = hessian_eigenvalues(kept, loader, k=1, weights=bma.mean())  # said which: no warning
        bma.load_into()
        loaded = hessian_eigenvalues(kept, loader, k=1)  # the module now holds the mean: no warning
        torch.testing.assert_close(loaded, at_mean)
        held = _net()
        flatbma.fit_posterior(held, loader, "sgd", epochs=2, lr=0.05, progress=False)
        hessian_eigenvalues(held, loader, k=1)  # the default: the posterior mean
    with torch.no_grad():
        held[0].weight.add_(1.0)  # changed since: the module no longer holds the mean
    with pytest.warns(FlatbmaWarning, match="changed since"):
        hessian_eigenvalues(held, loader, k=1)


# --- SWAG's default window, validated as the CLI validates ----------------------------------------------


def test_default_swag_collects_over_the_last_quarter_at_the_rate_reached_there():
    """``start_step: null`` = the last 25% of the updates, the learning rate held there (Maddox et al.'s swa_lr).

    Checked against the same run written out: ``swag.build(start_step=T − ⌊T/4⌋)`` with the cosine schedule
    frozen at its value there.
    """
    from flatbma.methods import parse_method
    from flatbma.optim import SGD, cosine
    from flatbma.posteriors import swag
    from flatbma.posteriors.swag import last_quarter

    config = parse_method("swag")
    assert config.options["start_step"] is None and config.resolved(100).options["start_step"] == 75
    assert last_quarter(10) == 8  # 10 − ⌊10/4⌋: the window is the last 2 updates of 10
    loader = DataLoader(TensorDataset(*_data(80)), batch_size=16)  # 5 steps per epoch, no shuffling
    epochs, steps = 8, 40
    bma = flatbma.fit_posterior(_net(), loader, "swag", epochs=epochs, lr=0.05, rank=3, collect_every=2, progress=False)
    assert int(bma.state.aux[swag.N_COLLECTED]) == 5  # updates 32..40: snapshots at 32, 34, 36, 38, 40
    peak = cosine(0.05, steps)
    assert [row["lr"] for row in bma.history[-2:]] == [peak(30), peak(30)]  # held from update 30 on
    assert bma.method_config["start_step"] == 30  # recorded as the run resolved it

    model = _net()
    held = SGD(lr=lambda t: peak(min(t, 30)), momentum=0.9, weight_decay=5e-4)
    manual = swag.build(flatbma.Objective(model, num_data=80), held, rank=3, start_step=30, collect_every=2)
    state = manual.init(flatbma.trainable_params(model), flatbma.model_buffers(model))
    from flatbma.loop import fit
    from flatbma.rng import forked_rng

    with forked_rng(0):
        model.train()
        state, _ = fit(manual, state, loader, epochs=epochs, progress=False)
    for key, value in state.aux.items():
        assert torch.equal(value, bma.state.aux[key]), key


def test_fit_posterior_refuses_default_swag_as_the_cli_does_with_the_same_message():
    from flatbma.errors import FlatbmaError
    from flatbma.family import RunShape, Stage
    from flatbma.methods import parse_method

    loader = _loader()  # 5 steps per epoch
    with pytest.raises(FlatbmaError) as info:
        flatbma.fit_posterior(_net(), loader, "swag", epochs=10, lr=0.05, progress=False)
    with pytest.raises(FlatbmaError) as cli:  # what flatbma train checks for train.epochs=10 of the same loader
        parse_method("swag").check(Stage(RunShape(steps_per_epoch=len(loader), num_train=240, num_test=0), 10))
    assert str(info.value) == str(cli.value)
    assert str(info.value).startswith("swag needs >= 20 snapshots for method.rank=20, but train.epochs=10 × 5 steps")
    assert "start_step=null (the last quarter: 38)" in str(info.value)
    with pytest.raises(FlatbmaError, match="swag needs >= 4 snapshots"):  # an explicit window is checked too
        flatbma.fit_posterior(_net(), loader, "swag", epochs=2, rank=4, start_step=5, collect_every=5)


# --- any batches, targets and outputs ------------------------------------------------------------------


class _Dicts(torch.utils.data.Dataset):
    """The data of :func:`_data` as dicts under ``keys`` (what a Hugging Face style dataset yields)."""

    def __init__(self, keys: tuple[str, str] = ("x", "y")) -> None:
        self.x, self.y = _data()
        self.keys = keys

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {self.keys[0]: self.x[i], self.keys[1]: self.y[i], "id": torch.tensor(i)}


class _WithFeatures(nn.Module):
    """A classifier returning ``(logits, features)``."""

    def __init__(self) -> None:
        super().__init__()
        net = _net()
        self.body, self.head = net[:3], net[3]  # _net()'s weights, under other names

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x)
        return self.head(features), features


def _fit(model, loader, **kw):
    return flatbma.fit_posterior(model, loader, "sgd", epochs=2, lr=0.05, progress=False, **kw)


def test_dict_batches_train_as_the_same_pairs():
    pairs = _fit(_net(), DataLoader(TensorDataset(*_data()), batch_size=48))
    for keys in (("x", "y"), ("image", "label"), ("pixel_values", "labels")):
        dicts = _fit(_net(), DataLoader(_Dicts(keys), batch_size=48))
        for k, v in pairs.state.params.items():
            assert torch.equal(v, dicts.state.params[k]), (keys, k)
    x = _data(20, seed=5)[0]
    assert torch.equal(dicts.predict_log_proba({"pixel_values": x}), pairs.predict_log_proba(x))
    with pytest.raises(flatbma.FlatbmaError, match=r"a dict batch must hold its inputs .* got the keys 'a', 'b'"):
        _fit(_net(), [{"a": x, "b": x}])


def test_soft_targets_are_the_cross_entropy_with_probabilities():
    """One-hot rows train exactly as their labels; smoothed rows minimize ``−Σ_c y_c log p_c``."""
    x, y = _data()
    one_hot = torch.nn.functional.one_hot(y, 3).float()
    hard = _fit(_net(), DataLoader(TensorDataset(x, y), batch_size=48))
    soft = _fit(_net(), DataLoader(TensorDataset(x, one_hot), batch_size=48))
    for k, v in hard.state.params.items():
        torch.testing.assert_close(soft.state.params[k], v, rtol=1e-5, atol=1e-6)
    assert [r["accuracy"] for r in soft.history] == [r["accuracy"] for r in hard.history]  # the top class
    smooth = 0.9 * one_hot + 0.1 / 3
    model = _net()
    bma = _fit(model, DataLoader(TensorDataset(x, smooth), batch_size=240))  # one full batch per step
    first = bma.history[0]["loss"]
    with torch.no_grad():
        start = _net().train()(x)
    assert first == pytest.approx(float(-(smooth * start.log_softmax(-1)).sum(-1).mean()), rel=1e-6)
    with pytest.raises(flatbma.FlatbmaError, match="soft targets must be class probabilities"):
        _fit(_net(), [(x[:8], 2 * one_hot[:8])])
    with pytest.raises(flatbma.FlatbmaError, match="soft targets have 4 columns"):
        _fit(_net(), [(x[:8], torch.full((8, 4), 0.25))])


def test_soft_targets_evaluate_as_the_cross_entropy_with_probabilities():
    """One-hot rows score as their labels; smoothed rows: NLL ``−Σ_c y_c log p̄_c``, Brier ``Σ_c (p̄_c − y_c)²``."""
    loader = DataLoader(TensorDataset(*_data()), batch_size=48)
    bma = flatbma.fit_posterior(_net(), loader, "mfvi", epochs=2, lr=0.05, progress=False, num_samples=4)
    x, y = _data(90, seed=7)
    one_hot = torch.nn.functional.one_hot(y, 3).float()
    hard = bma.evaluate(DataLoader(TensorDataset(x, y), batch_size=32))
    assert bma.evaluate(DataLoader(TensorDataset(x, one_hot), batch_size=32)) == hard
    soft = torch.softmax(torch.randn(90, 3, generator=torch.Generator().manual_seed(3)), -1)
    got = bma.evaluate([{"x": x[:50], "y": soft[:50]}, (x[50:], soft[50:])])
    model = copy.deepcopy(bma.model).eval()  # independently: the mean of the samples' softmax
    with torch.no_grad():
        p = torch.stack([torch.func.functional_call(model, w, (x,)).double().softmax(-1) for w in bma.samples]).mean(0)
    q = soft.double()
    assert got["nll"] == pytest.approx(float(-(q * p.log()).sum(-1).mean()), rel=1e-6)
    assert got["brier"] == pytest.approx(float((p - q).square().sum(-1).mean()), rel=1e-6)
    assert got["accuracy"] == pytest.approx(float((p.argmax(-1) == q.argmax(-1)).double().mean()))
    with pytest.raises(flatbma.FlatbmaError, match="soft targets must be class probabilities"):
        bma.evaluate([(x, 2 * one_hot)])


def test_a_model_returning_a_tuple_trains_on_its_first_element():
    loader = DataLoader(TensorDataset(*_data()), batch_size=48)
    plain = _fit(_net(), loader)
    model = _WithFeatures()
    tupled = _fit(model, loader)
    flat = {k.replace("body.", "").replace("head.", "3."): v for k, v in tupled.state.params.items()}
    for k, v in plain.state.params.items():
        assert torch.equal(v, flat[k]), k
    x = _data(20, seed=5)[0]
    assert torch.equal(tupled.predict_log_proba(x), plain.predict_log_proba(x))
    assert model.eval()(x).shape == (20, 3)  # the module now returns its logits


def test_a_saved_tuple_model_loads_predicting_as_fitted(tmp_path):
    """``load_posterior`` gives a fresh ``(logits, features)`` module the hook ``fit_posterior`` installed."""
    loader = DataLoader(TensorDataset(*_data()), batch_size=48)
    fitted = _fit(_WithFeatures(), loader)
    fitted.save(tmp_path / "bma.safetensors")
    fresh = _WithFeatures()
    loaded = flatbma.load_posterior(tmp_path / "bma.safetensors", fresh)
    x, y = _data(20, seed=5)
    assert torch.equal(loaded.predict_proba(x), fitted.predict_proba(x))
    assert loaded.evaluate([(x, y)]) == fitted.evaluate([(x, y)])
    assert fresh.eval()(x).shape == (20, 3)  # the hook is back: the module returns its logits
    plain = _fit(_net(), loader)  # a module returning a tensor gets no hook
    plain.save(tmp_path / "plain.safetensors")
    other = _net()
    flatbma.load_posterior(tmp_path / "plain.safetensors", other)
    assert not other._forward_hooks


@pytest.mark.parametrize("record", ["logits", "architecture"])
def test_a_predictor_file_of_an_older_layout_is_refused(tmp_path, record):
    """A file without the ``logits`` or ``architecture`` record (an older flatbma's, rewritten here with its
    checksums intact) is refused in one line, never loaded by guess."""
    from flatbma.predictor_file import read_file, write_file

    path = tmp_path / "old.safetensors"
    _fit(_WithFeatures(), DataLoader(TensorDataset(*_data()), batch_size=48)).save(path)
    state, settings = read_file(path)
    del settings[record]
    write_file(path, state, settings)
    with pytest.raises(flatbma.FlatbmaError, match="predictor settings are damaged or of another version"):
        flatbma.load_posterior(path, _WithFeatures())


def test_a_predictor_file_with_an_unknown_logits_record_is_refused(tmp_path):
    from flatbma.predictor_file import read_file, write_file

    path = tmp_path / "bma.safetensors"
    _fit(_net(), DataLoader(TensorDataset(*_data()), batch_size=48)).save(path)
    state, settings = read_file(path)
    assert settings["logits"] == "output"
    write_file(path, state, {**settings, "logits": "second"})
    with pytest.raises(flatbma.FlatbmaError, match="predictor settings are damaged"):
        flatbma.load_posterior(path, _net())


def test_a_list_of_batches_is_a_loader():
    x, y = _data()
    batches = [(x[i : i + 48], y[i : i + 48]) for i in range(0, 240, 48)]
    listed = _fit(_net(), batches)
    loaded = _fit(_net(), DataLoader(TensorDataset(x, y), batch_size=48))
    for k, v in loaded.state.params.items():
        assert torch.equal(v, listed.state.params[k]), k
    assert [r["steps"] for r in listed.history] == [5, 5]
    with pytest.raises(flatbma.FlatbmaError, match="one-shot"):
        _fit(_net(), iter(batches))


def test_members_is_the_one_spelling_of_the_number_of_members():
    from flatbma.methods import parse_method

    assert parse_method({"name": "ensemble", "members": 3}) == parse_method({"name": "ensemble", "size": 3})
    assert parse_method({"name": "f-ensemble", "members": 2}).options["size"] == 2
    assert parse_method({"name": "multiswag", "members": 2}).options["members"] == 2
    with pytest.raises(flatbma.FlatbmaError, match="one option"):
        parse_method({"name": "ensemble", "members": 3, "size": 3})
    bma = flatbma.fit_posterior(_net(), _loader(), "ensemble", epochs=1, members=2, progress=False)
    assert bma.method_config["size"] == 2 and len(bma.samples) == 2


# --- Laplace: a BMA worse than its MAP says so, with advice for its own settings ------------------------


def test_a_laplace_bma_worse_than_its_map_warns_on_validation_or_training_data():
    loader = _loader()
    val = DataLoader(TensorDataset(*_data(90, seed=5)), batch_size=45)
    wide = dict(hessian="diag", subset="all", prior_precision=1e-3, temperature=100, num_samples=8, progress=False)
    with pytest.warns(FlatbmaWarning) as caught:
        bma = flatbma.fit_posterior(_net(), loader, "laplace", epochs=10, lr=0.1, val_loader=val, **wide)
    (line,) = [str(w.message) for w in caught if "too wide" in str(w.message)]
    assert line.startswith("the laplace BMA has a posterior too wide for its posterior mean (try subset: last-layer")
    assert "prior_precision: val, or above δ = 0.001" in line
    assert "its BMA is worse than its posterior mean on 90 validation examples" in line
    assert "probit" not in line and "\n" not in line  # glm is the setting: no advice to leave it for probit
    point = flatbma.evaluate(bma.model, [bma.method.mean(bma.state)], val, num_classes=3)
    assert bma.evaluate(val)["nll"] > point["nll"]  # what the warning says, recomputed
    with pytest.warns(FlatbmaWarning, match="too wide for its posterior mean .* on 240 training images"):
        flatbma.fit_posterior(_net(), loader, "laplace", epochs=10, lr=0.1, **wide)
    from flatbma.methods import parse_method

    last = {"name": "laplace", "subset": "last-layer", "predictive": "probit", "prior_precision": "val"}
    line = parse_method(last).advice(False, {"prior_precision": 3.2})  # the settings it has are not advised
    assert line == "a fixed prior_precision above δ = 3.2", line
    line = parse_method({"name": "laplace", "predictive": "samples"}).advice(False, {})
    assert line == "prior_precision: val, or larger; predictive: glm", line
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlatbmaWarning)
        narrow = dict(hessian="diag", prior_precision=1e6, num_samples=8, progress=False)  # ≈ the MAP: no warning
        flatbma.fit_posterior(_net(), loader, "laplace", epochs=10, lr=0.1, val_loader=val, **narrow)
        flatbma.fit_posterior(_net(), loader, "sgd", epochs=1, lr=0.05, val_loader=val, progress=False)  # a point


def test_swag_and_laplace_defaults_live_in_their_options():
    """One value for the library, the registry, the CLI and ``fit_posterior`` (issue #25): the Options' field."""
    from flatbma.methods import METHODS, parse_method
    from flatbma.optim import SGD
    from flatbma.posteriors import laplace, swag

    assert swag.Options().start_step is None and swag.DiagonalOptions().start_step is None
    assert laplace.Options().subset is laplace.Subset.LAST_LAYER
    for name in ("swag", "swag-diag", "f-swag"):
        assert parse_method(name).options["start_step"] is None, name
    for name in ("laplace", "f-laplace"):
        assert parse_method(name).options["subset"] is laplace.Subset.LAST_LAYER, name
    assert not any(hasattr(spec, "overrides") for spec in METHODS.values())
    with pytest.raises(flatbma.FlatbmaError, match=r"start_step: null .* give start_step"):
        swag.build(flatbma.Objective(_net()), SGD(lr=0.1))  # no run length to resolve it from


@pytest.mark.parametrize("hessian", ["kfac", "diag", "full"])
def test_laplace_defaults_to_the_last_layer_which_is_a_laplace_of_the_head_with_the_body_frozen_at_the_map(hessian):
    """The default ``subset: last-layer`` equals post-hoc Laplace (``subset: all``, ``start_step: 0``) of a copy of
    the MAP whose body is frozen: the same curvature, δ by the evidence, evidence and samples."""
    from flatbma.loop import fit
    from flatbma.methods import parse_method
    from flatbma.optim import SGD
    from flatbma.posteriors import laplace

    assert parse_method("laplace").options["subset"] is laplace.Subset.LAST_LAYER
    assert parse_method("f-laplace").options["subset"] is laplace.Subset.LAST_LAYER
    loader = DataLoader(TensorDataset(*_data()), batch_size=48)  # one order for both curvature passes
    bma = flatbma.fit_posterior(_net(), loader, "laplace", epochs=3, lr=0.05, hessian=hessian, progress=False)
    state = bma.state
    head = {"3.weight", "3.bias"}
    assert set(bma.method.marginal_variance(state)) == head
    (sample,) = bma.method.sample(state, 1, torch.Generator().manual_seed(3))
    assert all(torch.equal(sample[k], state.params[k]) for k in state.params if k not in head)  # the body at w*

    frozen = _net()
    flatbma.load_into(frozen, {**state.params, **state.buffers})
    for name, p in frozen.named_parameters():
        p.requires_grad_(name in head)
    post = laplace.build(
        flatbma.Objective(frozen, num_data=240), SGD(lr=0.1), hessian=hessian, start_step=0, subset="all"
    )
    ref = post.init(flatbma.trainable_params(frozen), flatbma.model_buffers(frozen))
    frozen.train()
    ref, _ = fit(post, ref, loader, epochs=1, progress=False)
    ours, theirs = bma.method.can.diagnostics(state), post.can.diagnostics(ref)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key
    (expected,) = post.sample(ref, 1, torch.Generator().manual_seed(3))
    for k in head:
        torch.testing.assert_close(sample[k], expected[k], rtol=1e-4, atol=1e-6)


def test_prior_precision_val_is_the_grid_value_of_the_smallest_validation_nll():
    from flatbma.posteriors.laplace import PRIOR_PRECISION_GRID

    loader = _loader()
    val = DataLoader(TensorDataset(*_data(90, seed=5)), batch_size=45)
    options = dict(epochs=4, lr=0.1, hessian="diag", subset="all", num_samples=4, progress=False)
    with pytest.raises(flatbma.FlatbmaError, match="prior_precision=val chooses it by the validation NLL: pass val_"):
        flatbma.fit_posterior(_net(), loader, "laplace", prior_precision="val", **options)
    bma = flatbma.fit_posterior(_net(), loader, "laplace", prior_precision="val", val_loader=val, **options)
    assert [row["prior_precision"] for row in bma.selection] == list(PRIOR_PRECISION_GRID)
    best = min(bma.selection, key=lambda row: row["val/nll"])
    assert bma.method_config["prior_precision"] == best["prior_precision"]
    assert bma.method.can.diagnostics(bma.state)["prior_precision"] == best["prior_precision"]
    # each candidate is the fixed-δ run: the grid's values recomputed independently at two of them
    for row in (bma.selection[0], best):
        fixed = flatbma.fit_posterior(_net(), loader, "laplace", prior_precision=row["prior_precision"], **options)
        assert fixed.evaluate(val)["nll"] == pytest.approx(row["val/nll"], rel=1e-6)
    assert best["val/nll"] <= min(r["val/nll"] for r in bma.selection)
    assert bma.evaluate(val)["nll"] == pytest.approx(best["val/nll"], rel=1e-6)


def test_the_cli_refuses_prior_precision_val_before_training_in_one_line(tmp_path, capsys):
    import yaml

    from flatbma.experiment.cli import main

    config = {
        "data": {"name": "digits", "k_shot": 10, "val_per_class": 2, "batch_size": 25, "test_limit": 50},
        "model": {"name": "mlp", "width": 8},
        "method": {"name": "laplace", "prior_precision": "val"},
        "train": {"epochs": 1, "progress": False},
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flatbma: error: method.prior_precision: val (chosen on validation data after training) is")
    assert "\n" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("method", ["mfvi", "sam"])
def test_a_predictor_trained_with_adam_loads_with_the_optimizer_it_records(tmp_path, method):
    """The file records the ``optim`` section: a state holding Adam's moments loads and predicts as fitted."""
    from flatbma.predictor_file import read_file, write_file

    loader = DataLoader(TensorDataset(*_data()), batch_size=48)
    torch.manual_seed(0)
    fitted = flatbma.fit_posterior(
        _net(), loader, method, epochs=2, lr=1e-2, optim={"name": "adam"}, num_samples=4, progress=False
    )
    path = tmp_path / "adam.safetensors"
    fitted.save(path)
    assert read_file(path)[1]["optim"] == {"name": "adam", "lr": 1e-2}
    loaded = flatbma.load_posterior(path, _net(), loader)
    x, _ = _data(20, seed=5)
    assert torch.equal(loaded.predict_proba(x), fitted.predict_proba(x))
    state, settings = read_file(path)  # a file of before the record: the default optimizer's entries are expected
    del settings["optim"]
    write_file(path, state, settings)
    with pytest.raises(flatbma.FlatbmaError, match="recorded its optimizer"):
        flatbma.load_posterior(path, _net(), loader)


def test_a_mixture_loads_one_member_exactly_and_its_repr_counts_the_members():
    """issue #35: an ensemble's load_into wrote the average of its members' weights (accuracy 0.087 on digits);
    now the module holds member 0 (or the one named) exactly, and the repr counts 5 samples over 5 members."""
    model = _net()
    bma = flatbma.fit_posterior(model, _loader(), "ensemble", epochs=2, lr=0.05, size=5, progress=False)
    state = bma.state
    for m in (0, 3):
        if m:
            bma.load_into(member=m)
        own = _weights(model)
        for key in ("params", "buffers"):
            for k, v in getattr(state, key).items():
                if k.startswith(f"member{m}/"):
                    assert torch.equal(own[k.split("/", 1)[1]], v), k
        assert bma.loaded == f"member {m} of 5"
    assert "num_samples=5 over 5 members" in repr(bma) and "module holds member 3 of 5" in repr(bma)
    x, y = _data(90, seed=5)
    model.eval()
    member = (model(x).argmax(1) == y).float().mean()
    assert member > 0.5  # chance is 1/3: a network the ensemble holds (measured 0.6 after 2 epochs)
    with pytest.raises(flatbma.FlatbmaError, match=r"member must be an integer in \[0, 5\)"):
        bma.load_into(member=5)
    point = flatbma.fit_posterior(_net(), _loader(), "sgd", epochs=1, lr=0.05, progress=False)
    assert point.loaded == "the posterior mean"
    with pytest.raises(flatbma.FlatbmaError, match="has no members; use mean"):
        point.load_into(member=0)


def test_multiswag_loads_member_zeros_swa_mean():
    model = _net()
    method = {"name": "multiswag", "members": 2, "of": {"name": "swag", "rank": 2, "start_step": 4, "collect_every": 1}}
    bma = flatbma.fit_posterior(model, _loader(), method, epochs=2, lr=0.05, num_samples=6, progress=False)
    want = bma.member(0)
    own = _weights(model)
    assert all(torch.equal(own[k], v) for k, v in want.items())
    mean0 = bma.method.mean(bma.method.can.split(bma.state, [0]))
    names = [n for n, _ in model.named_parameters()]
    assert all(torch.equal(want[k], mean0[k]) for k in names)  # its statistics recomputed at it, as BMA.mean's
    assert "num_samples=6 over 2 members" in repr(bma) and bma.loaded == "member 0 of 2"
