"""configs/flatness-study.yaml (issue #12 item 5) loads and expands to the study's entries and candidates (not run)."""

from pathlib import Path

from flatbma.experiment.study.plan import load_plan

STUDY = Path(__file__).resolve().parents[2] / "configs" / "flatness-study.yaml"
DEMO = STUDY.with_name("demo.yaml")


def test_flatness_study_expands_to_the_study():
    plan = load_plan(STUDY)
    base, demo = plan.base, load_plan(DEMO).base
    assert base.data.name == demo.data.name and base.model == demo.model  # the demo's 10-shot transfer task
    assert base.data.k_shot == 10 and base.data.k_shot - base.data.val_per_class == 8  # 8 train + 2 validation
    assert len(plan.compare.seeds) >= 5
    assert plan.compare.flatness and base.eval.repeatability and base.eval.trace and base.eval.distribution_spectrum
    assert base.train.epochs == 60 > demo.train.epochs  # FP-BMA's second stage trains long enough to move q

    jobs = plan.jobs()
    labels = list(dict.fromkeys(j.label for j in jobs))
    assert labels == ["lowrank-vi", "fp-bma", "swag", "swag-wide", "sgd", "sam"]
    assert len(jobs) == len(labels) * len(plan.compare.seeds)
    first = {j.label: j for j in jobs if j.seed == plan.compare.seeds[0]}
    assert [c.options for c in first["fp-bma"].candidates] == [{"gamma": g} for g in (0.01, 0.1, 0.5)]
    assert [c.options for c in first["sam"].candidates] == [{"rho": r} for r in (0.01, 0.05, 0.1)]
    assert all(len(j.candidates) == 1 for label, j in first.items() if label not in ("fp-bma", "sam"))
    assert first["swag-wide"].match_width == "fp-bma"
    assert all(j.match_width is None for label, j in first.items() if label != "swag-wide")

    vi = first["lowrank-vi"].candidates[0].config
    fp = [c.config for c in first["fp-bma"].candidates]
    swag = first["swag"].candidates[0].config
    assert vi.method.ascent is None  # gamma = 0: low-rank VI with the prior
    assert [c.method.ascent.gamma for c in fp] == [0.01, 0.1, 0.5]
    for cfg in (vi, *fp):  # the same SWAG prior and start for every Bayesian method ...
        assert cfg.prior == vi.prior and cfg.prior.init and cfg.prior.method.name == "swag"
        assert cfg.prior.method.options["rank"] == cfg.method.options["rank"] == 5
    # ... and SWAG alone is that prior stage: the same options, epochs and optimizer
    assert swag.method == vi.prior.method and swag.train.epochs == vi.prior.epochs and vi.prior.optim is None
    assert first["swag-wide"].candidates[0].config.method == swag.method
