"""Laplace and F-Laplace as runs: the MAP of the sgd/sam run, a deterministic curvature epoch, exact resume,
``δ → ∞`` reproducing the point's metrics, the registry and its refusals, ``fit_posterior``, and existing methods'
resolved configs left as they were."""

import copy
import hashlib
import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flatbma
from flatbma import training
from flatbma.curvature import estimator
from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.run import stage
from flatbma.experiment.run.checkpoint import CONFIG_KEY, load_checkpoint
from flatbma.experiment.run.pipeline import evaluate_run, load_run, load_run_config, resume_config, train
from flatbma.experiment.run.provenance import WRITTEN_BY, Provenance
from flatbma.linearized import linearized_predictions
from flatbma.methods import METHODS, parse_method
from flatbma.models import build_model, classifier_of
from flatbma.posteriors import laplace
from flatbma.predict import sample_log_probs
from flatbma.predictor import trained_names
from flatbma.state_io import CHECKSUMS, checksums
from tests.experiment.torchrun_helpers import crash_after
from tests.helpers import DONE

BASE = {
    "seed": 0,
    "data": {"name": "digits", "k_shot": 10, "batch_size": 25, "test_limit": 100},  # 100 images: 4 steps/epoch
    "model": {"name": "cnn", "width": 4},  # BatchNorm: statistics recomputed at w*
    "optim": {"lr": 0.05},
    "train": {"epochs": 2, "checkpoint_every": 2, "progress": False},
    "eval": {"num_samples": 3},
}
METRICS = ("accuracy", "nll", "ece", "aece", "brier")


def _config(tmp: Path, name: str, method: dict, **sections) -> object:
    raw = copy.deepcopy(BASE)
    for key, value in sections.items():
        raw[key] = {**raw[key], **value}
    return config_from_dict({**raw, "method": method, "output_dir": str(tmp / name)})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """sgd, sam, and laplace / f-laplace with δ = 1e12 (diag and kfac): trained once for the module."""
    tmp = tmp_path_factory.mktemp("laplace")
    methods = {
        "sgd": {"name": "sgd"},
        "sam": {"name": "sam", "rho": 0.05},
        "laplace": {"name": "laplace", "prior_precision": 1.0e12},
        "f-laplace": {"name": "f-laplace", "rho": 0.05, "hessian": "diag", "prior_precision": 1.0e12},
    }
    return {name: train(_config(tmp, name, method)) for name, method in methods.items()}


def _state(trained):
    return load_checkpoint(Path(trained.experiment.config.output_dir) / "checkpoint.safetensors")[0]


@pytest.mark.parametrize(("point", "posterior"), [("sgd", "laplace"), ("sam", "f-laplace")])
def test_the_map_is_the_point_runs_weights_and_a_huge_prior_precision_its_metrics(runs, point, posterior):
    a, b = _state(runs[point]), _state(runs[posterior])
    assert b.step == a.step + 4  # one curvature epoch of 4 updates after the same 2 epochs
    for section in ("params", "buffers"):
        x, y = getattr(a, section), getattr(b, section)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), section
    assert len(runs[posterior].metrics["history"]) == 3
    ma, mb = runs[point].metrics, runs[posterior].metrics
    assert mb["accuracy"] == ma["accuracy"]
    for key in METRICS:  # δ = 1e12: Δ ~ 1e-6, the linearized BMA is the point's predictive
        assert mb[key] == pytest.approx(ma[key], rel=1e-6, abs=1e-6), key
    assert mb["diagnostics"]["prior_precision"] == 1.0e12 and "diagnostics" not in ma
    assert mb["bn_statistics"].startswith("recomputed at the posterior mean")


def test_without_augmentation_the_curvature_is_a_deterministic_pass_over_the_training_set(runs):
    cfg = runs["laplace"].experiment.config
    exp, state = load_run(load_run_config(cfg.output_dir))
    head = classifier_of(exp.model)[0]  # the default subset: last-layer, the other weights fixed at w*
    chosen = {k: v for k, v in state.params.items() if k.startswith(f"{head}.")}
    fixed = {k: v for k, v in state.params.items() if k not in chosen}
    assert sorted(chosen) == [f"{head}.bias", f"{head}.weight"] and fixed
    est = estimator("kfac", "ggn", exp.model, chosen, num_data=100, num_classes=10)
    acc, offset = est.init(), 0
    for x, y in exp.hessian_loader:  # all training images, un-augmented, in a fixed order (other batches)
        acc = est.accumulate(acc, chosen, {**state.buffers, **fixed}, x, y, offset=offset)
        offset += len(y)
    curvature = laplace.curvature_of(state)
    assert offset == int(curvature.seen) == 100
    for key, value in acc.items():
        torch.testing.assert_close(curvature.curvature[key], value, rtol=1e-6, atol=1e-12, msg=key)


def test_a_resume_in_the_middle_of_the_curvature_epoch_is_bit_identical(tmp_path):
    method = {"name": "laplace", "hessian": "diag"}
    augment = {"augment": True}  # the curvature pass sees the run's augmented batches: their draws must resume
    ref = train(_config(tmp_path, "ref", method, data=augment))
    cfg = _config(tmp_path, "run", method, data=augment)
    # checkpoints at steps 2, 4, 4 (epoch end), 6, 8, 8, 10: the 7th is mid-way through the curvature epoch
    with crash_after(training, 7):
        train(cfg)
    assert load_checkpoint(Path(cfg.output_dir) / "checkpoint.safetensors")[1]["step"] == "10"
    again = train(cfg, resume=True)
    a, b = _state(ref), _state(again)
    for section in ("params", "buffers", "aux"):
        x, y = getattr(a, section), getattr(b, section)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), section
    assert {k: again.metrics[k] for k in METRICS} == {k: ref.metrics[k] for k in METRICS}
    assert again.metrics["diagnostics"] == ref.metrics["diagnostics"]


def _cli(argv):
    err, out = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def test_flatbma_methods_lists_laplace_and_f_laplace_with_their_options():
    code, out, _ = _cli(["methods"])
    assert code in (0, None) and "\nlaplace " in out and "\nf-laplace " in out
    code, out, _ = _cli(["methods", "laplace"])
    assert "of               {'name': 'sgd'}" in out and "glm | probit" in out.replace("samples | ", "")


@pytest.mark.parametrize(
    ("method", "sections", "message"),
    [
        ({"name": "laplace", "of": {"name": "swag"}}, {}, "Laplace needs a MAP: method.of must be a point method"),
        ({"name": "f-laplace", "of": {"name": "sgd"}}, {}, "unknown config key 'method.of' for method 'f-laplace'"),
        ({"name": "laplace", "start_step": 9}, {}, "method.start_step=9 is past train.epochs=2"),
        (
            {"name": "laplace", "hessian": "full", "max_full": 50, "subset": "all"},
            {},
            "method.hessian: full needs d <= method.max_full",
        ),
        ({"name": "laplace", "temperature": -1}, {}, "method.temperature must be a positive number"),
        ({"name": "laplace", "prior_mean": "init"}, {}, "prior_mean must be one of 'zero', 'pretrained', got 'init'"),
        (
            {"name": "laplace", "prior_mean": "pretrained"},
            {},
            "method.prior_mean: pretrained centres the prior at the pretrained weights, but model.pretrained is null",
        ),
        (
            {"name": "multi", "members": 3, "of": {"name": "laplace"}},
            {},
            "set method.of.predictive: samples, or method.members: 1",
        ),
    ],
)
def test_a_laplace_config_it_cannot_run_is_refused_before_training_in_one_line(tmp_path, method, sections, message):
    raw = {**copy.deepcopy(BASE), "method": method, "output_dir": str(tmp_path / "run")}
    (tmp_path / "c.yaml").write_text(json.dumps(raw))
    code, _, err = _cli(["train", "--config", str(tmp_path / "c.yaml")])
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_a_prior_section_is_refused():
    with pytest.raises(FlatbmaError, match="takes no prior section: its prior is N"):
        config_from_dict({"method": {"name": "laplace"}, "prior": {"method": {"name": "swag"}}})


def test_fit_posterior_predicts_with_the_glm_and_round_trips(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    bma = flatbma.fit_posterior(model, loader, "laplace", epochs=2, lr=0.1, num_samples=4, hessian="diag")
    assert bma.state.step == 3 * 4 and int(bma.state.aux[laplace.SEEN]) == 64
    drawn = bma.method.sample(bma.state, 4, torch.Generator().manual_seed(0))
    glm = linearized_predictions("glm", bma.method.mean(bma.state), drawn, trained_names(model))
    expected = torch.logsumexp(sample_log_probs(model, glm, x), 0) - torch.log(torch.tensor(4.0))
    torch.testing.assert_close(bma.predict_log_proba(x), expected, rtol=0, atol=0)
    bma.save(tmp_path / "bma.safetensors")
    fresh = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    loaded = flatbma.load_posterior(tmp_path / "bma.safetensors", fresh)
    assert torch.equal(loaded.predict_log_proba(x), bma.predict_log_proba(x))


# The resolved configs of the methods registered before Laplace, as the main tree resolved them (sha256 of the
# sorted JSON of config_from_dict({"method": {"name": NAME}, "train": {"epochs": 3}}).to_dict(), first 16 digits):
# `flatbma compare` reuses a finished run only when its resolved config is identical, so these must not move —
# except on purpose: SWAG's families (swag, swag-diag, f-swag, multiswag) since their default start_step became
# null (the last quarter of the updates, issue #25).
RESOLVED = {
    "sgd": "762dc65b69401fc3",
    "sam": "c329ef725a47fc4b",
    "asam": "1e069deb20dd5463",
    "fsam": "fce450f91d9b6103",
    "swag": "f5824569cc1e3e0e",  # collect_every: auto (#35)
    "swag-diag": "c5461fab24500e3b",  # collect_every: auto (#35)
    "f-swag": "3847664785c4f2e0",  # collect_every: auto (#35)
    "mfvi": "987458df3cc4ed7d",  # variance_step: natural (#35)
    "lowrank-vi": "f2d0d4e4bfcf803e",  # variance_step: natural (#35)
    "f-mfvi": "85ce7c625263abee",  # variance_step: natural (#35)
    "f-lowrank-vi": "45c372a2c58bedfc",  # variance_step: natural (#35)
    "bsam": "cf2079c9b875d3d1",
    "mc-dropout": "8c45d6c89f11d51c",
    "f-mc-dropout": "86e046a1718ef4af",
    "ensemble": "87350af1796c2142",
    "f-ensemble": "de9e4d21fa1c06b4",
    "sgld": "6f390cd7dcf10448",  # burn_in, thin: auto (#35)
    "csgld": "056851c9a3092e59",
    "f-sgld": "ad2b4d7a248fb1d5",  # burn_in, thin: auto (#35)
    "fp-bma": "e6fd041808f39aef",  # radius: 0.05 (#22), variance_step: natural (#35)
    "sa-bma": "224e8f87419a0d71",  # variance_step: natural (#35)
    "multi": "d6549a167fda82e5",
    "multiswag": "334ab5e8e8cf5757",  # swag's start_step: null (#25), collect_every: auto (#35)
    "multi-fp-bma": "d9df450acb7e74a5",  # variance_step: natural (#35)
    "ivon": "72c3be7ac0aec2d9",  # registered after Laplace (#37)
    "f-ivon": "dd6b7d3ca8c2f150",
}


def test_existing_methods_resolve_and_train_as_before():
    for name, digest in RESOLVED.items():
        cfg = config_from_dict({"method": {"name": name}, "train": {"epochs": 3}})
        assert hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:16] == digest, name
        assert cfg.epochs == 3 and parse_method(name).extra_epochs() == 0, name
    assert set(RESOLVED) | {"laplace", "f-laplace"} == set(METHODS)
    # Laplace's resolved config: the main tree's before prior_mean, plus prior_mean: zero and (issue #25) the
    # default subset: last-layer
    for name, digest in {"laplace": "fdc4d784a4f1ba1d", "f-laplace": "c08f54728837e42d"}.items():
        resolved = config_from_dict({"method": {"name": name}, "train": {"epochs": 3}}).to_dict()
        assert resolved["method"].pop("prior_mean") == "zero", name
        assert resolved["method"].pop("subset") == "last-layer", name
        assert hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()[:16] == digest, name
    multi_laplace = config_from_dict({"method": {"name": "multi", "members": 1, "of": {"name": "laplace"}}})
    assert multi_laplace.epochs == multi_laplace.train.epochs + 1
    assert [p.name for p in multi_laplace.method.phases_after()] == ["curvature"]  # the family's declaration


def test_a_resume_cannot_move_the_end_of_the_map_phase_once_the_curvature_epoch_began(runs):
    laplace_dir = runs["laplace"].experiment.config.output_dir
    with pytest.raises(FlatbmaError, match=r"\(its curvature phase\), so --resume cannot change train\.epochs"):
        resume_config(laplace_dir, ["train.epochs=4"])
    cfg, change = resume_config(runs["sgd"].experiment.config.output_dir, ["train.epochs=4"])  # a point run may
    assert cfg.train.epochs == 4 and "train.epochs" in change.changed


def test_a_pretrained_prior_mean_run_stores_w0_resumes_bit_identically_and_the_cli_takes_it(tmp_path):
    """``prior_mean: pretrained`` on a cnn loaded from a 4-class checkpoint (its 10-class head re-drawn): ``w₀``
    in the checkpoint is the loaded values and 0 for the head, the run resumes and evaluates to the same bits."""
    source = build_model("cnn", num_classes=4, in_channels=1, image_size=8, width=4, seed=1)
    with torch.no_grad():
        for t in source.parameters():
            t.add_(0.5)
    torch.save(source.state_dict(), tmp_path / "pretrained.pt")
    model = {"pretrained": str(tmp_path / "pretrained.pt"), "trainable": "norm+classifier"}
    method = {"name": "laplace", "hessian": "diag", "prior_mean": "pretrained", "subset": "all"}
    raw = {**copy.deepcopy(BASE), "method": method, "output_dir": str(tmp_path / "ref")}
    raw["model"] = {**raw["model"], **model}
    (tmp_path / "c.yaml").write_text(json.dumps(raw))
    code, _, err = _cli(["train", "--config", str(tmp_path / "c.yaml")])
    assert code in (*DONE, None), err
    ref_dir = tmp_path / "ref"
    ref = load_checkpoint(ref_dir / "checkpoint.safetensors")[0]
    w0 = laplace.curvature_of(ref).prior_mean
    assert w0.keys() == ref.params.keys()
    for k, v in w0.items():
        expected = torch.zeros_like(v) if k.startswith(classifier_of(source)[0] + ".") else source.state_dict()[k]
        assert torch.equal(v, expected) and v.dtype == ref.params[k].dtype, k
    assert any(torch.count_nonzero(v) == 0 for v in w0.values()) and any(torch.all(v != 0) for v in w0.values())
    ref_metrics = json.loads((ref_dir / "metrics.json").read_text())
    info = ref_metrics["diagnostics"]
    sq = sum(float((ref.params[k].double() - w0[k].double()).square().sum()) for k in w0)
    assert info["prior_precision"] * sq == pytest.approx(info["effective_params"], rel=1e-6)
    exp, state = load_run(load_run_config(ref_dir))  # evaluation of the run directory: the same fit
    assert exp.method.can.diagnostics(state) == info
    cfg = _config(tmp_path, "run", method, model=model)
    with crash_after(training, 7):  # mid-way through the curvature epoch
        train(cfg)
    again = train(cfg, resume=True)
    b = _state(again)
    for section in ("params", "buffers", "aux"):
        x, y = getattr(ref, section), getattr(b, section)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), section
    assert {k: again.metrics[k] for k in METRICS} == {k: ref_metrics[k] for k in METRICS}
    assert again.metrics["diagnostics"] == info


def test_fit_posterior_with_a_pretrained_prior_mean_round_trips_through_load_posterior(tmp_path):
    source = build_model("cnn", num_classes=4, in_channels=1, image_size=8, width=4, seed=1)
    path = tmp_path / "pretrained.pt"
    torch.save(source.state_dict(), path)

    def pretrained():  # a 3-class head re-drawn on the loaded network
        return build_model("cnn", num_classes=3, in_channels=1, image_size=8, width=4, pretrained=path)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    bma = flatbma.fit_posterior(
        pretrained(), loader, "laplace", epochs=1, lr=0.05, num_samples=3, hessian="diag", prior_mean="pretrained"
    )
    assert laplace.curvature_of(bma.state).prior_mean
    bma.save(tmp_path / "bma.safetensors")
    loaded = flatbma.load_posterior(tmp_path / "bma.safetensors", pretrained(), loader)
    assert torch.equal(loaded.predict_log_proba(x), bma.predict_log_proba(x))
    assert loaded.method.can.diagnostics(loaded.state) == bma.method.can.diagnostics(bma.state)


def test_a_run_stored_before_subset_existed_is_refused_in_one_line_never_read_with_the_new_default(tmp_path, capsys):
    """A Laplace run directory whose ``config.yaml`` has no ``subset`` was written by an older flatbma, when the
    posterior was over all weights; read with today's default (``last-layer``) it would be evaluated as another
    posterior. flatbma has no release and ships no reader of older layouts: evaluate and --resume refuse it in one
    line, and no config of today finds it finished. A checkpoint whose records lack the option (beside a complete
    ``config.yaml``) is refused too."""
    method = {"name": "laplace", "hessian": "diag", "subset": "all"}
    cfg = _config(tmp_path, "old", method)
    train(cfg)
    path = Path(cfg.output_dir) / "config.yaml"
    complete = path.read_text()
    stored = yaml.safe_load(complete)
    assert stored["method"].pop("subset") == "all"  # an old run's config: no subset
    path.write_text(yaml.safe_dump(stored, sort_keys=False))
    with pytest.raises(FlatbmaError, match=r"config\.yaml was written by an older flatbma: it has no method\.subset,"):
        load_run_config(cfg.output_dir)
    capsys.readouterr()
    for argv in (["evaluate", cfg.output_dir], ["train", "--resume", cfg.output_dir]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "written by an older flatbma: it has no method.subset" in err, err
    assert not stage.same_config(Path(cfg.output_dir), cfg)
    default = _config(tmp_path, "old", {"name": "laplace", "hessian": "diag"})
    assert not stage.same_config(Path(cfg.output_dir), default)

    path.write_text(complete)
    _without_subset(Path(cfg.output_dir) / "checkpoint.safetensors")  # its checkpoint's records lack it
    with pytest.raises(FlatbmaError, match=r"checkpoint .* was written with .*subset=— vs .all."):
        evaluate_run(cfg.output_dir)


def _without_subset(path: Path) -> None:
    """The checkpoint at ``path`` as one written before ``subset`` existed: its records of the config lack it."""
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    written = json.loads(meta[WRITTEN_BY])
    del written["options_fingerprint"], written["options"]["subset"]
    meta[WRITTEN_BY] = Provenance(**written).to_json()
    config = json.loads(meta[CONFIG_KEY])
    del config["method"]["subset"]
    meta[CONFIG_KEY] = json.dumps(config, sort_keys=True)
    meta[CHECKSUMS] = json.dumps(checksums(tensors, meta), sort_keys=True)  # as flatbma wrote it
    save_file(tensors, str(path), metadata=meta)


SWAG = {"name": "swag", "rank": 2, "start_step": 4, "collect_every": 1}


@pytest.mark.parametrize(
    ("method", "crash"),
    [
        ({"name": "laplace", "hessian": "diag", "subset": "all"}, 3),  # in the MAP phase
        ({"name": "laplace", "hessian": "diag", "subset": "all"}, 7),  # in the curvature epoch
        ({"name": "laplace", "hessian": "kfac", "subset": "all"}, 7),
        ({"name": "multiswag", "members": 2, "of": SWAG}, 4),
        (SWAG, 4),
        ({"name": "sam"}, 3),
        ({"name": "ensemble", "members": 2}, 3),
        ({"name": "fp-bma"}, 3),
        ({"name": "mfvi"}, 3),
    ],
    ids=["laplace-map", "laplace-curvature", "laplace-kfac", "multiswag", "swag", "sam", "ensemble", "fp-bma", "mfvi"],
)
def test_a_run_stopped_mid_way_resumes_bit_identically(tmp_path, method, crash):
    """A run stopped mid-way (in Laplace's MAP phase or its curvature epoch, in a composed state) resumes to the
    bits of an uninterrupted run."""
    ref = train(_config(tmp_path, "ref", method))
    cfg = _config(tmp_path, "run", method)
    with crash_after(training, crash):
        train(cfg)
    again = train(cfg, resume=True)
    a, b = _state(ref), _state(again)
    assert a.step == b.step
    for section in ("params", "buffers", "aux"):
        x, y = getattr(a, section), getattr(b, section)
        assert list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x), section
    assert {k: again.metrics[k] for k in METRICS} == {k: ref.metrics[k] for k in METRICS}
