"""Two-stage runs (a ``prior`` section): SWAG on the target data → FP-BMA with that prior, started there.

The pipeline of SA-BMA / FP-BMA's Bayesian transfer learning (Lim et al., UAI 2025), checked on digits
with an MLP: both stages write their run directories, the second stage starts exactly at the fitted
posterior and is penalized by the KL to it, a finished first stage is reused, and bad sections fail
with one actionable error.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml

from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.run.build import build_experiment
from flatbma.experiment.run.pipeline import train
from flatbma.experiment.run.prior import check_stable_with_prior, fit_prior, prior_stage
from flatbma.gaussian import init_from_swag, kl_lowrank, section
from flatbma.optim import SGD
from flatbma.params import Objective
from flatbma.posteriors import fp_bma
from flatbma.posteriors.gaussians import floored
from flatbma.prior import sgd_stability_bound
from tests.helpers import load_state

TWO_STAGE = {
    "seed": 0,
    "method": {"name": "fp-bma", "rank": 3, "gamma": 0.01},
    "prior": {
        "method": {"name": "swag", "rank": 3, "start_step": 20, "collect_every": 5},
        "epochs": 3,
        "optim": {"lr": 0.2},
    },
    "data": {"name": "digits", "batch_size": 64},
    "model": {"name": "mlp", "width": 16},
    "optim": {"lr": 0.05},
    "train": {"epochs": 2, "progress": False},
    "eval": {"num_samples": 4},
}


def _config(tmp_path: Path, **changes) -> dict:
    raw = copy.deepcopy(TWO_STAGE)
    raw["output_dir"] = str(tmp_path / "run")
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        node = raw
        for p in parents:
            node = node.setdefault(p, {})
        node[key] = value
    return raw


def test_cli_train_writes_both_stages_and_evaluate_reads_them(tmp_path: Path, capsys) -> None:
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path)))
    assert main(["train", "--config", str(path)]) == 0, capsys.readouterr().err
    run_dir = tmp_path / "run"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    prior_metrics = json.loads((run_dir / "prior" / "metrics.json").read_text())
    assert metrics["method"] == "fp-bma" and prior_metrics["method"] == "swag"
    assert metrics["prior_run"] == str(run_dir / "prior")
    assert metrics["accuracy"] > 0.6 and "accuracy" not in prior_metrics  # stage 1 is evaluated on request
    stage = yaml.safe_load((run_dir / "prior" / "config.yaml").read_text())
    assert stage["train"]["epochs"] == 3 and "prior" not in stage
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["prior"]["method"]["name"] == "swag"
    capsys.readouterr()
    assert main(["evaluate", str(run_dir)]) == 0, capsys.readouterr().err
    again = json.loads((run_dir / "metrics.json").read_text())
    assert again["accuracy"] == pytest.approx(metrics["accuracy"])
    assert main(["evaluate", str(run_dir / "prior")]) == 0, capsys.readouterr().err
    assert json.loads((run_dir / "prior" / "metrics.json").read_text())["accuracy"] > 0.6


def test_second_stage_starts_at_the_fitted_posterior(tmp_path: Path) -> None:
    """With a vanishing learning rate the trained θ is the SWAG posterior in θ layout (and not without init)."""
    cfg = config_from_dict(_config(tmp_path, optim__lr=1e-12))
    train(cfg)
    fitted = fit_prior(cfg)  # reused: the first stage finished with this config
    state = load_state(Path(cfg.output_dir) / "checkpoint.safetensors")
    assert set(state.params) == set(fitted.theta)
    for k, v in fitted.theta.items():
        torch.testing.assert_close(state.params[k], v, rtol=1e-6, atol=1e-6)
    swag_mean = section(fitted.theta, "mean")
    assert any(not torch.equal(v, 0 * v) for v in section(fitted.theta, "factor").values())

    cold = config_from_dict(_config(tmp_path / "cold", optim__lr=1e-12, prior__init=False))
    train(cold)
    cold_state = load_state(Path(cold.output_dir) / "checkpoint.safetensors")
    assert not all(torch.allclose(cold_state.params[f"mean/{k}"], v) for k, v in swag_mean.items())


def test_f_lowrank_vi_takes_the_fitted_prior_like_lowrank_vi(tmp_path: Path) -> None:
    """F-low-rank VI (SAM on each sample) starts at the fitted posterior too, and its SAM step acts on it."""
    method = {"name": "f-lowrank-vi", "rank": 3, "rho": 0.05}
    cfg = config_from_dict(_config(tmp_path, method=method, optim__lr=1e-12))
    train(cfg)
    fitted = fit_prior(cfg)
    state = load_state(Path(cfg.output_dir) / "checkpoint.safetensors")
    for k, v in fitted.theta.items():
        torch.testing.assert_close(state.params[k], v, rtol=1e-6, atol=1e-6)
    plain = config_from_dict(_config(tmp_path / "plain", method={"name": "lowrank-vi", "rank": 3}))
    flat = config_from_dict(_config(tmp_path / "flat", method=method))
    thetas = []
    for c in (plain, flat):
        train(c)
        thetas.append(load_state(Path(c.output_dir) / "checkpoint.safetensors").params)
    assert set(thetas[0]) == set(thetas[1])
    assert any(not torch.equal(thetas[0][k], thetas[1][k]) for k in thetas[0])  # the same run but for SAM


def test_finished_first_stage_is_reused_and_force_retrains_it(tmp_path: Path) -> None:
    cfg = config_from_dict(_config(tmp_path))
    train(cfg)
    ckpt = Path(cfg.output_dir) / "prior" / "checkpoint.safetensors"
    stamp = ckpt.stat().st_mtime_ns
    train(cfg)  # same config: the main stage trains again, the first stage is reused
    assert ckpt.stat().st_mtime_ns == stamp
    train(cfg, force=True)
    assert ckpt.stat().st_mtime_ns != stamp


def test_the_second_stage_minimizes_the_kl_to_the_fitted_prior(tmp_path: Path) -> None:
    """The registry build with a prior is ``fp_bma.build_with_prior``: same update as built by hand."""
    cfg = config_from_dict(_config(tmp_path))
    train(prior_stage(cfg))
    fitted = fit_prior(cfg)
    exp = build_experiment(cfg, prior=fitted.theta)
    by_hand = fp_bma.build_with_prior(
        Objective(model=exp.model, num_data=len(exp.train_loader.dataset)),
        SGD(lr=0.05, momentum=0.9, weight_decay=5e-4),
        cfg.method.ascent,
        fitted.theta,
        rank=3,
    )
    batch = next(iter(exp.train_loader))
    torch.manual_seed(0)
    a, _ = exp.method.update(exp.method.init(fitted.theta, fitted.buffers), batch)
    torch.manual_seed(0)
    b, _ = by_hand.update(by_hand.init(fitted.theta, fitted.buffers), batch)
    for k in a.params:
        torch.testing.assert_close(a.params[k], b.params[k])
    # and it differs from the isotropic prior N(0, I): the prior is really used
    plain = build_experiment(cfg).method
    torch.manual_seed(0)
    c, _ = plain.update(plain.init(fitted.theta, fitted.buffers), batch)
    assert any(not torch.allclose(a.params[k], c.params[k]) for k in a.params)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"method": {"name": "sgd"}}, "takes no Gaussian prior"),
        ({"prior__method": {"name": "mfvi"}}, "cannot serve as a prior: use one of swag"),
        ({"prior__method": {"name": "swag-diag"}}, "cannot serve as a prior"),
        ({"prior__method__rank": 4}, "method.rank (3) must equal prior.method.rank (4)"),
        ({"prior__epoch": 3}, "Did you mean 'epochs'"),
        ({"prior__epochs": 0}, "prior.epochs must be > 0"),
        ({"prior__optim": {"lr": -1}}, "lr must be > 0"),
        ({"prior": "swag"}, "prior must be a mapping with a 'method' key"),
    ],
)
def test_bad_prior_sections_are_one_line_errors(tmp_path: Path, capsys, changes: dict, needle: str) -> None:
    raw = _config(tmp_path, **changes)
    with pytest.raises(FlatbmaError, match=None) as info:
        config_from_dict(raw)
    assert needle in str(info.value)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_fpbma_transfer_config_parses_as_two_stage() -> None:
    from flatbma.experiment.config.run_config import load_config

    cfg = load_config(Path(__file__).parents[2] / "configs" / "fpbma-transfer.yaml")
    assert cfg.method.name == "fp-bma" and cfg.prior is not None and cfg.prior.method.name == "swag"
    assert cfg.model.trainable == "norm+classifier" and cfg.model.pretrained == "imagenet"
    assert cfg.data.k_shot == 10 and cfg.eval.num_samples == 30


def test_sgd_learning_rate_beyond_the_kl_stability_bound_is_refused_before_training(tmp_path: Path) -> None:
    cfg = config_from_dict(_config(tmp_path, optim__lr=0.5))  # 1.9·1198·0.01² = 0.228 < 0.5 (n: digits train split)
    message = r"optim.lr=0.5 is above 0.228 = \(1\+m\)·n·prior.min_std²/kl_weight \(n=1198, m=optim.momentum=0.9\)"
    with pytest.raises(FlatbmaError, match=message):
        train(cfg)
    assert not (Path(cfg.output_dir) / "prior" / "checkpoint.safetensors").exists()  # refused before stage 1


def _swag_like_prior(min_std: float, k: int = 3) -> dict[str, torch.Tensor]:
    """A fitted prior as ``fit_prior`` makes it: a SWAG Gaussian (σ mostly ~0.002) with σ floored at ``min_std``."""
    g = torch.Generator().manual_seed(0)
    like = {"fc.weight": torch.zeros(4, 5, dtype=torch.float64), "fc.bias": torch.zeros(4, dtype=torch.float64)}
    d = 24
    std = torch.exp(torch.randn(d, generator=g, dtype=torch.float64) - 6.2)  # median ~0.002, as SWAG's
    std[:4] = torch.tensor([0.3, 0.5, 0.8, 1.2], dtype=torch.float64)  # a few weights the snapshots do move
    deviations = 0.05 * torch.randn(k, d, generator=g, dtype=torch.float64)
    mean = torch.randn(d, generator=g, dtype=torch.float64)
    return floored(init_from_swag(mean, std**2, deviations, like), min_std)


def _kl_hessian_in_mean(prior: dict, kl_weight: float, n: int) -> torch.Tensor:
    """The dense Hessian of ``κ·KL(q ‖ p)/n`` in ``q``'s mean, by autograd through ``kl_lowrank``."""
    names = list(section(prior, "mean"))
    shapes = [prior[f"mean/{name}"].shape for name in names]
    q_cov = {k: v for k, v in prior.items() if not k.startswith("mean/")}  # any q covariance: the KL is quadratic in μ

    def objective(mu: torch.Tensor) -> torch.Tensor:
        means = dict(zip(names, torch.split(mu, [s.numel() for s in shapes]), strict=True))
        theta = {**q_cov, **{f"mean/{name}": means[name].reshape(shape) for name, shape in zip(names, shapes)}}
        return kl_weight * kl_lowrank(theta, prior) / n

    mu_p = torch.cat([prior[f"mean/{name}"].reshape(-1) for name in names])
    return torch.autograd.functional.hessian(objective, mu_p + 0.1)


@pytest.mark.parametrize(("momentum", "nesterov"), [(0.0, False), (0.9, False), (0.9, True)])
def test_the_sgd_stability_bound_is_the_edge_of_stability_of_the_kl_to_the_prior(
    tmp_path: Path, momentum: float, nesterov: bool
) -> None:
    """``bound·(1 ± ε)``: SGD on the prior's actual curvature converges / diverges; the check agrees."""
    n, kl_weight, min_std, eps = 50, 0.5, 0.05, 0.05
    hessian = _kl_hessian_in_mean(_swag_like_prior(min_std), kl_weight, n)
    lam_max = float(torch.linalg.eigvalsh(hessian).max())
    assert lam_max == pytest.approx(2 * kl_weight / (n * min_std**2), rel=1e-9)  # variance σ²/2 at the floor
    bound = sgd_stability_bound(n, min_std, kl_weight, momentum=momentum, nesterov=nesterov)
    if momentum == 0:
        assert bound == pytest.approx(2 / lam_max, rel=1e-9) == n * min_std**2 / kl_weight
    top = torch.linalg.eigh(hessian).eigenvectors[:, -1]
    for lr, stable in ((bound * (1 - eps), True), (bound * (1 + eps), False)):
        x = {"mu": top.clone()}  # μ − μ_p along the stiffest direction; the KL gradient is H(μ − μ_p)
        optimizer = SGD(lr=lr, momentum=momentum, nesterov=nesterov)
        state = optimizer.init(x)
        for step in range(1500):
            state = optimizer.apply(x, {"mu": hessian @ x["mu"]}, state, step)
        size = float(x["mu"].norm())
        assert (size < 1e-3) if stable else (size > 1e3), (lr / bound, size)
        cfg = config_from_dict(
            _config(
                tmp_path,
                optim__lr=lr,
                optim__momentum=momentum,
                optim__nesterov=nesterov,
                method__kl_weight=kl_weight,
                prior__min_std=min_std,
            )
        )
        if stable:
            check_stable_with_prior(cfg, n)
        else:
            with pytest.raises(FlatbmaError, match="where SGD on the KL to the fitted prior diverges"):
                check_stable_with_prior(cfg, n)


def test_a_first_stage_whose_options_drop_the_low_rank_part_is_refused_before_it_trains(tmp_path: Path) -> None:
    cfg = config_from_dict(_config(tmp_path, prior__method__diagonal_only=True))  # swag is a Gaussian method...
    with pytest.raises(FlatbmaError, match=r"prior\.method 'swag' is not a low-rank plus diagonal Gaussian posterior"):
        train(cfg)  # ... but not with this option
    assert not (Path(cfg.output_dir) / "prior" / "checkpoint.safetensors").exists()


def test_resume_after_a_crash_in_the_first_stage_matches_an_uninterrupted_run(tmp_path: Path, monkeypatch) -> None:
    import flatbma.experiment.run.pipeline as run_module
    import flatbma.experiment.run.stage as stage_module

    whole = config_from_dict(_config(tmp_path / "whole", train__checkpoint_every=5))
    train(whole)
    crashed = config_from_dict(_config(tmp_path / "crashed", train__checkpoint_every=5))
    save = stage_module.save_position

    def save_then_crash(path, state, position, history, *written_by):
        save(path, state, position, history, *written_by)
        if path.parent.name == "prior" and state.step == 10:
            raise KeyboardInterrupt  # the process dies right after a mid-epoch checkpoint of stage 1

    monkeypatch.setattr(stage_module, "save_position", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        train(crashed)
    monkeypatch.setattr(stage_module, "save_position", save)
    assert not (Path(crashed.output_dir) / "checkpoint.safetensors").exists()
    run_dir = Path(crashed.output_dir)
    train(run_module.load_run_config(run_dir), resume=True)  # what `--resume` does
    a = load_state(Path(whole.output_dir) / "checkpoint.safetensors")
    b = load_state(run_dir / "checkpoint.safetensors")
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k]), k


def test_compare_entries_may_carry_a_prior_and_a_label(tmp_path: Path) -> None:
    from flatbma.experiment.study.plan import load_plan

    raw = _config(tmp_path)
    prior = raw.pop("prior")
    raw["compare"] = {
        "methods": [
            {"name": "fp-bma", "rank": 3},
            {"name": "fp-bma", "rank": 3, "prior": prior, "label": "fp-bma+swag"},
            {"name": "sgd"},
        ],
        "seeds": [0, 1],
        "quick": {"methods": ["fp-bma+swag"]},
    }
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump(raw))
    plan = load_plan(path)
    runs = plan.runs()
    assert plan.labels() == ["fp-bma", "fp-bma", "fp-bma+swag", "fp-bma+swag", "sgd", "sgd"]
    assert [r.prior is not None for r in runs] == [False, False, True, True, False, False]
    assert runs[2].prior.method.name == "swag" and runs[2].method.name == "fp-bma"
    assert len({r.output_dir for r in runs}) == 6
    quick = load_plan(path, quick=True)
    assert quick.labels() == ["fp-bma+swag", "fp-bma+swag"]

    del raw["compare"]["methods"][1]["label"]
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(FlatbmaError, match="several entries named 'fp-bma': give them distinct 'label' keys"):
        load_plan(path)
    raw["compare"]["methods"][1]["prior"]["method"] = {"name": "mfvi"}
    raw["compare"]["methods"][1]["label"] = "x"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(FlatbmaError, match="cannot serve as a prior"):
        load_plan(path)
