"""Width-matched posteriors in `flatbma compare` (``match_width``) and the covariance scaling behind them."""

import json
import math

import pytest
import torch
import yaml

from flatbma.errors import FlatbmaError
from flatbma.experiment.study.compare import run_compare
from flatbma.experiment.study.plan import load_plan
from flatbma.gaussian import dense_covariance, marginal_variance, scale_covariance
from flatbma.posteriors.lowrank_vi import fixed


def _theta(d=(3, 2), k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = {}
    for name, n in zip(("a", "b"), d, strict=True):
        theta[f"mean/{name}"] = torch.randn(n, generator=g, dtype=torch.float64)
        theta[f"log_std/{name}"] = 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
        theta[f"factor/{name}"] = torch.randn(k, n, generator=g, dtype=torch.float64)
    return theta


@pytest.mark.parametrize("c", [0.01, 0.7, 4.0, 250.0])
def test_scale_covariance_scales_sigma_by_exactly_c(c):
    theta = _theta()
    scaled = scale_covariance(theta, c)
    torch.testing.assert_close(dense_covariance(scaled), c * dense_covariance(theta), rtol=1e-12, atol=0)
    for name in ("a", "b"):
        torch.testing.assert_close(scaled[f"mean/{name}"], theta[f"mean/{name}"], rtol=0, atol=0)
        torch.testing.assert_close(marginal_variance(scaled)[name], c * marginal_variance(theta)[name])
    with pytest.raises(ValueError):
        scale_covariance(theta, 0.0)


def test_fixed_posterior_samples_its_gaussian():
    """Samples of :func:`fixed` have the mean μ and covariance Σ of θ (Monte-Carlo, 20k draws)."""
    theta = scale_covariance(_theta(d=(2, 1)), 3.0)
    posterior, state = fixed(theta, {"buf": torch.ones(1)})
    draws = posterior.sample(state, 20_000, torch.Generator().manual_seed(1))
    assert torch.equal(draws[0]["buf"], torch.ones(1))
    w = torch.stack([torch.cat([s["a"], s["b"]]) for s in draws])
    cov = dense_covariance(theta)
    mean = torch.cat([theta["mean/a"], theta["mean/b"]])
    se = (torch.diagonal(cov) / w.shape[0]).sqrt()
    assert bool(((w.mean(0) - mean).abs() < 5 * se).all())
    torch.testing.assert_close(torch.cov(w.T), cov, rtol=0.06, atol=0.06 * float(cov.abs().max()))
    widths = posterior.marginal_variance(state)
    assert math.isclose(sum(float(v.sum()) for v in widths.values()), float(torch.trace(cov)), rel_tol=1e-12)


SMALL = {
    "output_dir": None,
    "data": {"name": "digits", "batch_size": 64, "test_limit": 100, "k_shot": 20, "val_per_class": 3},
    "model": {"name": "mlp"},
    "optim": {"lr": 0.05},
    "train": {"epochs": 2, "progress": False},
    "eval": {
        "num_samples": 3,
        "flatness_samples": 2,
        "hessian_examples": 32,
        "hessian_max_iter": 8,
        "trace": False,
        "distribution_spectrum": False,
        "repeatability": False,
    },
    "compare": {
        "methods": [
            {"name": "lowrank-vi", "rank": 3, "init_std": 0.01},
            {"name": "swag", "rank": 3, "start_step": 2, "collect_every": 1},
            {
                "name": "swag",
                "label": "swag-wide",
                "rank": 3,
                "start_step": 2,
                "collect_every": 1,
                "match_width": "lowrank-vi",
            },
            {"name": "lowrank-vi", "label": "vi-as-swag", "rank": 3, "init_std": 0.01, "match_width": "swag"},
            {"name": "ivon", "label": "ivon-as-swag", "beta2": 0.9, "match_width": "swag"},  # a diagonal Gaussian
        ],
        "seeds": [0],
        "bma_curve": [1, 3],
        "landscape": False,
    },
}


def _write(tmp_path, cfg):
    cfg = json.loads(json.dumps(cfg))
    cfg["output_dir"] = str(tmp_path / "out")
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_width_matched_rows_have_the_reference_width(tmp_path):
    plan = load_plan(_write(tmp_path, SMALL))
    results = run_compare(plan, progress=False)
    rows = {r["method"]: r for r in results["runs"]}
    for label, ref in (("swag-wide", "lowrank-vi"), ("vi-as-swag", "swag"), ("ivon-as-swag", "swag")):
        row, target = rows[label], rows[ref]
        matched = row["width_matched"]
        assert matched["to"] == ref
        assert math.isclose(row["width"]["trace_cov"], target["width"]["trace_cov"], rel_tol=1e-5)
        assert math.isclose(matched["reference_trace"], target["width"]["trace_cov"], rel_tol=0, abs_tol=0)
        assert math.isclose(matched["factor"], matched["reference_trace"] / matched["trained_trace"], rel_tol=1e-12)
        assert row["width"]["exact"] is True
    # the trained posterior's own width: the unmatched row of the same run config (lowrank-vi is seeded alike)
    vi_own = rows["lowrank-vi"]["width"]["trace_cov"]
    assert math.isclose(rows["vi-as-swag"]["width_matched"]["trained_trace"], vi_own, rel_tol=1e-5)
    assert rows["lowrank-vi"]["width_matched"] is None and rows["swag"]["width_matched"] is None
    assert abs(math.log(rows["swag-wide"]["width_matched"]["factor"])) > 0.1  # the widths did differ
    # a rerun reuses every row, the width-matched ones included
    again = run_compare(load_plan(_write(tmp_path, SMALL)), progress=False)
    assert [r["eval_time_s"] for r in again["runs"]] == [r["eval_time_s"] for r in results["runs"]]


def _with(methods, **compare):
    cfg = json.loads(json.dumps(SMALL))
    cfg["compare"]["methods"] = methods
    cfg["compare"].update(compare)
    return cfg


SWAG = {"name": "swag", "rank": 3, "start_step": 2, "collect_every": 1}


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (_with([SWAG, {"name": "sgd", "match_width": "swag"}]), "no low-rank plus diagonal Gaussian"),
        (
            _with([SWAG, {**SWAG, "label": "w", "diagonal_only": True, "match_width": "swag"}]),
            "with these options has no",
        ),
        (_with([{**SWAG, "label": "w", "match_width": "swag"}, SWAG]), "not the label of an earlier entry"),
        (_with([SWAG, {**SWAG, "label": "w", "match_width": "swa"}]), "not the label of an earlier entry"),
        (
            _with([SWAG, {**SWAG, "label": "w", "match_width": "swag"}, {**SWAG, "label": "v", "match_width": "w"}]),
            "itself width-matched",
        ),
        (_with([SWAG, {**SWAG, "label": "w", "match_width": "swag"}], flatness=False), "compare.flatness: true"),
    ],
)
def test_bad_match_width_is_refused_at_load(tmp_path, cfg, message):
    with pytest.raises(FlatbmaError, match=message):
        load_plan(_write(tmp_path, cfg))


def test_match_width_is_not_a_method_option(tmp_path):
    plan = load_plan(_write(tmp_path, SMALL))
    jobs = {j.label: j for j in plan.jobs()}
    assert jobs["swag-wide"].match_width == "lowrank-vi" and jobs["swag"].match_width is None
    cfg = jobs["swag-wide"].candidates[0].config
    assert "match_width" not in cfg.to_dict()["method"]
    assert jobs["swag-wide"].row_dir != jobs["swag"].row_dir  # its own cached row
