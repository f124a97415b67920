"""Two-stage mixtures: MultiSWAG → Multi-FP-BMA, every member with its own prior stage.

``{name: multi-fp-bma, members: M, of: {...}, prior: {method: {name: swag, ...}}}``: the first stage is
``multi`` of the prior's method with the same members and seed (member ``m`` of both stages from the same
initialization), and member ``m`` of the second trains FP-BMA with member ``m``'s fitted SWAG as its prior,
started there. Checked on digits with a tiny MLP against the single-member pipeline, a MultiSWAG run and
FP-BMA trained by hand from each member's prior.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import flatbma.experiment.run.stage as stage_module
from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.config.run_config import config_from_dict, load_config
from flatbma.experiment.run.build import build_experiment
from flatbma.experiment.run.pipeline import load_run_config, train
from flatbma.experiment.run.prior import check_stable_with_prior, fit_prior, prior_stage
from flatbma.experiment.study.plan import load_plan
from flatbma.experiment.study.selection import shared_stages
from flatbma.gaussian import kl_lowrank, section
from flatbma.loop import fit
from flatbma.params import Objective
from flatbma.posteriors import fp_bma
from flatbma.posteriors.gaussians import floored
from flatbma.posteriors.members import member, member_seed, member_state
from flatbma.rng import draw_seed, forked_rng
from tests.experiment.torchrun_helpers import torchrun
from tests.helpers import load_state, one_thread

SWAG = {"name": "swag", "rank": 3, "start_step": 30, "collect_every": 5}
FP_BMA = {"name": "fp-bma", "rank": 3, "gamma": 0.01}
MULTI = {
    "seed": 0,
    "method": {"name": "multi-fp-bma", "members": 2, "seed": 7, "of": FP_BMA},
    "prior": {"method": SWAG, "epochs": 5, "optim": {"name": "sgd", "lr": 0.2}},
    "data": {"name": "digits", "batch_size": 64, "test_limit": 200},  # 1198 examples: 19 steps per epoch
    "model": {"name": "mlp", "width": 16},
    "optim": {"name": "adam", "lr": 0.01},
    "train": {"epochs": 1, "progress": False, "device": "cpu", "checkpoint_every": 4},
    "eval": {"num_samples": 4},
}
METRICS = ("accuracy", "nll", "ece", "brier", "kl_from_start")


def _raw(out: Path, **sections) -> dict:
    raw = copy.deepcopy(MULTI)
    raw.update(copy.deepcopy(sections), output_dir=str(out))
    return raw


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def multi_run(tmp_path_factory) -> Path:
    """The two-stage Multi-FP-BMA run of ``MULTI`` (M = 2), trained through the CLI (one thread, as torchrun's)."""
    root = tmp_path_factory.mktemp("multi-prior")
    path = root / "multi.yaml"
    path.write_text(yaml.safe_dump(_raw(root / "run")))
    with one_thread():
        assert main(["train", "--config", str(path)]) == 0
    return root / "run"


def test_cli_trains_both_stages_of_a_mixture_and_evaluates_its_prior_stage(multi_run: Path, capsys) -> None:
    metrics = json.loads((multi_run / "metrics.json").read_text())
    stage = yaml.safe_load((multi_run / "prior" / "config.yaml").read_text())
    swag = config_from_dict({"method": SWAG}).to_dict()["method"]  # resolved: every option spelled out
    assert stage["method"] == {"name": "multi", "of": swag, "members": 2, "seed": 7}
    assert metrics["method"] == "multi-fp-bma" and metrics["prior_run"] == str(multi_run / "prior")
    assert metrics["accuracy"] > 0.6 and metrics["kl_from_start"] > 0
    assert yaml.safe_load((multi_run / "config.yaml").read_text())["prior"]["method"]["name"] == "swag"
    capsys.readouterr()
    assert main(["evaluate", str(multi_run / "prior")]) == 0, capsys.readouterr().err
    assert json.loads((multi_run / "prior" / "metrics.json").read_text())["accuracy"] > 0.6


def test_each_member_has_its_own_multiswag_prior_and_is_fp_bma_trained_by_hand_from_it(
    multi_run: Path, tmp_path: Path
) -> None:
    cfg = load_run_config(multi_run)
    # stage 1 is MultiSWAG with the same members and seed: the one-stage multiswag run, bit for bit
    swag_run = _raw(tmp_path / "multiswag", method={"name": "multiswag", "members": 2, "seed": 7, "of": SWAG})
    del swag_run["prior"]
    swag_run.update(optim={"name": "sgd", "lr": 0.2}, train={**MULTI["train"], "epochs": 5})
    with one_thread():
        train(config_from_dict(swag_run), evaluate=False)
    stage1 = load_state(multi_run / "prior" / "checkpoint.safetensors")
    multiswag = load_state(tmp_path / "multiswag" / "checkpoint.safetensors")
    for part in ("params", "buffers", "aux"):
        assert _same(getattr(stage1, part), getattr(multiswag, part)), part
    # member m's prior: its own SWAG Gaussian (σ floored), and the members' priors differ
    fitted = fit_prior(cfg)  # reused: finished with this config
    swag_posterior = build_experiment(prior_stage(cfg)).method
    theta = floored(swag_posterior.can.gaussian(stage1), cfg.prior.min_std)
    assert _same(fitted.theta, theta)
    means = [section(member(m, theta), "mean") for m in range(2)]
    assert means[0].keys() == means[1].keys() and not any(torch.equal(means[0][k], means[1][k]) for k in means[0])

    # stage 2, member m = FP-BMA with member m's prior, started at it, trained by hand in the one loop
    final, kls = load_state(multi_run / "checkpoint.safetensors"), []
    for m in range(2):
        exp = build_experiment(cfg, prior=fitted.theta)  # the run's loader, from its first batch
        objective = Objective(model=exp.model, num_data=len(exp.train_loader.dataset))
        prior_m = member(m, fitted.theta)
        optimizer = cfg.optim.build(steps_per_epoch=len(exp.train_loader), epochs=cfg.train.epochs)
        by_hand = fp_bma.build_with_prior(objective, optimizer, cfg.method.options["of"].ascent, prior_m, rank=3)
        with forked_rng(member_seed(7, m)):  # multi.build: member m's init under the seed hashed from (seed, m)
            own = by_hand.init(prior_m, member(m, fitted.buffers))
        start = {k: v.clone() for k, v in own.params.items()}
        with one_thread():
            own, _ = fit(by_hand, own, exp.train_loader, epochs=1, progress=False)
        trained = member_state(m, final)
        assert _same(trained.params, own.params) and _same(trained.aux, own.aux), m
        kls.append(float(kl_lowrank(own.params, start)))
    metrics = json.loads((multi_run / "metrics.json").read_text())  # kl_from_start: the members' mean KL(q_T ‖ q_0)
    assert min(kls) > 0 and metrics["kl_from_start"] == pytest.approx(sum(kls) / 2, rel=1e-12)
    # without an explicit seed both stages draw the same member seed right after their builds
    unseeded = config_from_dict(_raw(tmp_path / "unseeded", method={**MULTI["method"], "seed": None}))
    build_experiment(prior_stage(unseeded))
    first = draw_seed()
    build_experiment(unseeded, prior=fitted.theta)
    assert draw_seed() == first


def test_one_member_with_a_prior_is_the_single_member_two_stage_run_bit_for_bit(tmp_path: Path) -> None:
    one = _raw(tmp_path / "one", method={"name": "multi-fp-bma", "members": 1, "of": FP_BMA})
    single = _raw(tmp_path / "single", method=FP_BMA)
    a = train(config_from_dict(one)).metrics
    b = train(config_from_dict(single)).metrics
    for key in METRICS:
        assert a[key] == b[key], key
    for stage in ("prior", "."):
        x = load_state(tmp_path / "one" / stage / "checkpoint.safetensors")
        y = load_state(tmp_path / "single" / stage / "checkpoint.safetensors")
        for part in ("params", "buffers", "aux"):
            assert _same(getattr(member_state(0, x), part), getattr(y, part)), (stage, part)


def test_floor_std_floors_every_members_log_std() -> None:
    theta = {
        "member0/log_std/w": torch.tensor([-9.0, 0.0]),
        "member1/log_std/w": torch.tensor([-7.0, -1.0]),
        "member1/mean/w": torch.tensor([-9.0, 1.0]),
        "log_std/w": torch.tensor([-9.0]),
    }
    low = floored(theta, 0.01)  # log 0.01 = -4.605
    floor = torch.log(torch.tensor(0.01)).item()
    assert low["member0/log_std/w"].tolist() == pytest.approx([floor, 0.0])
    assert low["member1/log_std/w"].tolist() == pytest.approx([floor, -1.0])
    assert low["log_std/w"].tolist() == pytest.approx([floor])
    assert torch.equal(low["member1/mean/w"], theta["member1/mean/w"])


@pytest.mark.parametrize(
    ("method", "prior", "needle"),
    [
        ({"name": "multi", "members": 2, "of": SWAG}, None, "method.of 'swag' takes no Gaussian prior"),
        (None, {"method": {"name": "mfvi"}}, "prior.method 'mfvi' is not a low-rank plus diagonal Gaussian"),
        (None, {"method": {**SWAG, "rank": 4}}, "method.of.rank (3) must equal prior.method.rank (4)"),
        (None, {"method": {**SWAG, "rank": 20}}, "prior.method.rank"),  # validation: too few snapshots
    ],
)
def test_bad_mixture_priors_are_one_line_errors(tmp_path: Path, capsys, method, prior, needle) -> None:
    raw = _raw(tmp_path / "bad")
    raw["method"] = method or raw["method"]
    raw["prior"] = {**raw["prior"], **(prior or {})}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "bad" / "prior" / "checkpoint.safetensors").exists()


def test_the_learning_rate_bound_is_each_members_with_its_kl_weight() -> None:
    """SGD at lr 0.5: above 1.9·n·min_std²/κ = 0.228 for κ = method.of.kl_weight = 1, below it for κ = 1e-3."""
    sgd = {"name": "sgd", "lr": 0.5, "momentum": 0.9}
    for kl_weight, stable in ((1.0, False), (1e-3, True)):
        method = {**MULTI["method"], "of": {**FP_BMA, "kl_weight": kl_weight}}
        cfg = config_from_dict(_raw(Path("unused"), method=method, optim=sgd))
        if stable:
            check_stable_with_prior(cfg, 1198)
        else:
            with pytest.raises(FlatbmaError, match=r"optim.lr=0.5 is above 0.228 .*n=1198"):
                check_stable_with_prior(cfg, 1198)


def test_a_swag_prior_without_its_low_rank_part_is_refused_before_stage_one_trains(tmp_path: Path) -> None:
    cfg = config_from_dict(_raw(tmp_path / "diag", prior={**MULTI["prior"], "method": {**SWAG, "diagonal_only": True}}))
    with pytest.raises(FlatbmaError, match=r"prior\.method 'swag' is not a low-rank plus diagonal Gaussian"):
        train(cfg)
    assert not (tmp_path / "diag" / "prior" / "checkpoint.safetensors").exists()


@pytest.mark.parametrize("stage", ["prior", "."])
def test_resume_mid_stage_one_or_two_is_bit_identical(multi_run: Path, tmp_path: Path, monkeypatch, stage) -> None:
    crashed = tmp_path / "crashed"
    if stage == ".":  # stage 2: the finished first stage of the same config is reused
        crashed.mkdir()
        shutil.copytree(multi_run / "prior", crashed / "prior")
        shutil.copy(multi_run / "config.yaml", crashed)  # (the same run: its identity leaves out output_dir)
    cfg = config_from_dict(_raw(crashed))
    save = stage_module.save_position

    def save_then_crash(path, state, position, history, *written_by):
        save(path, state, position, history, *written_by)
        if path.parent.resolve() == (crashed / stage).resolve() and state.step == 4:
            raise KeyboardInterrupt  # killed right after a mid-epoch checkpoint of that stage

    monkeypatch.setattr(stage_module, "save_position", save_then_crash)
    with one_thread(), pytest.raises(KeyboardInterrupt):
        train(cfg)
    monkeypatch.setattr(stage_module, "save_position", save)
    with one_thread():
        resumed = train(load_run_config(crashed), resume=True).metrics
    for name in ("prior", "."):
        a = load_state(multi_run / name / "checkpoint.safetensors")
        b = load_state(crashed / name / "checkpoint.safetensors")
        for part in ("params", "buffers", "aux"):
            assert _same(getattr(a, part), getattr(b, part)), (name, part)
    whole = json.loads((multi_run / "metrics.json").read_text())
    assert all(resumed[k] == whole[k] for k in METRICS)


def test_compare_candidates_share_the_per_member_prior_stage(tmp_path: Path) -> None:
    raw = _raw(tmp_path / "cmp")
    prior = raw.pop("prior")
    raw["data"]["val_per_class"] = 2
    raw["data"]["k_shot"] = 10
    raw["compare"] = {
        "methods": [
            {"name": "multi-fp-bma", "members": 2, "of": FP_BMA, "prior": prior, "optim": {"lr": [0.01, 0.005]}},
            {**FP_BMA, "prior": prior},
        ],
        "seeds": [0],
    }
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump(raw))
    jobs = load_plan(path).jobs()
    groups = [shared_stages(job) for job in jobs]
    assert [len(g) for g in groups] == [1, 1] and len(groups[0][0]) == 2  # both lrs share one first stage
    mixture, single = (prior_stage(g[0][0].config).method for g in groups)
    assert mixture.name == "multi" and mixture.options["members"] == 2 and mixture.options["of"].name == "swag"
    assert single == jobs[1].candidates[0].config.prior.method  # a single-member family: prior.method itself


def test_existing_two_stage_configs_resolve_their_first_stage_as_before() -> None:
    """A non-mixture's first stage is ``prior.method`` itself, so a finished prior run is still reused."""
    root = Path(__file__).resolve().parents[2] / "configs"
    cfg = load_config(root / "fpbma-transfer.yaml")
    first = prior_stage(cfg)
    assert first.method is cfg.prior.method and first.to_dict()["method"] == cfg.to_dict()["prior"]["method"]
    for job in load_plan(root / "flatness-study.yaml").jobs():
        for cand in job.candidates:
            if cand.config.prior is not None:
                assert prior_stage(cand.config).method is cand.config.prior.method


@pytest.mark.slow
def test_torchrun_spreads_both_stages_members_like_one_process(multi_run: Path, tmp_path: Path) -> None:
    """``train.parallel: members`` on 2 processes: each trains one member's prior stage and second stage."""
    raw = _raw(tmp_path / "two")
    raw["train"]["parallel"] = "members"
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(raw))
    torchrun("-m", "flatbma", "train", "--config", str(path))
    for stage in ("prior", "."):
        a = load_state(multi_run / stage / "checkpoint.safetensors")
        b = load_state(tmp_path / "two" / stage / "checkpoint.safetensors")
        for part in ("params", "buffers", "aux"):
            assert _same(getattr(a, part), getattr(b, part)), (stage, part)
    one = json.loads((multi_run / "metrics.json").read_text())
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert two["world_size"] == 2 and two["kl_from_start"] == one["kl_from_start"]
    assert all(two[k] == pytest.approx(one[k], rel=1e-12) for k in METRICS)
