"""The demo's optional methods and configs/basins-study.yaml (issue #15) load, validate and expand as documented.

Neither is run here (MobileNetV2 for minutes): each optional entry of configs/demo.yaml is parsed from its
comment and validated up front in the demo's setting (the checks every run makes before it trains), and the
study expands to its entries, candidates, pairs and shared first stages.
"""

import dataclasses
from pathlib import Path

import pytest
import yaml

from flatbma.experiment.run.validate import validate_runs
from flatbma.experiment.study.compare import _every_run
from flatbma.experiment.study.plan import load_plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEMO = CONFIGS / "demo.yaml"
MARKER = "# Optional methods"


def optional_demo_methods() -> list[dict]:
    """The entries listed (commented out) under the demo's "Optional methods" comment."""
    lines = DEMO.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(MARKER))
    entries = []
    for line in lines[start + 1 :]:
        text = line.strip()
        if not text.startswith("# - "):
            if text.startswith("#"):
                continue
            break
        entries.append(yaml.safe_load(text[len("# - ") :]))
    return entries


def test_the_demos_optional_methods_validate_in_the_demos_setting(tmp_path):
    optional = optional_demo_methods()
    assert [m["name"] for m in optional] == ["multiswag", "multi-fp-bma", "laplace", "f-laplace"]
    methods = yaml.safe_dump(optional, default_flow_style=True).strip()
    plan = load_plan(DEMO, [f"compare.methods={methods}", f"output_dir={tmp_path / 'out'}"])
    assert [j.label for j in plan.jobs()] == [m["name"] for m in optional]
    validate_runs(_every_run(plan), flatness=plan.compare.flatness)
    multi_fp = plan.jobs()[1].candidates[0].config
    assert multi_fp.prior is not None and multi_fp.method.options["of"].name == "fp-bma"


def test_basins_study_expands_to_the_study():
    plan = load_plan(CONFIGS / "basins-study.yaml")
    flatness = load_plan(CONFIGS / "flatness-study.yaml")
    assert plan.base.data == flatness.base.data and plan.base.model == flatness.base.model
    assert plan.base.train == flatness.base.train and plan.base.eval == flatness.base.eval
    jobs = plan.jobs()
    labels = list(dict.fromkeys(j.label for j in jobs))
    assert labels == ["sgd", "sam", "swag", "multiswag", "fp-bma", "multi-fp-bma", "laplace", "f-laplace"]
    assert plan.compare.seeds == (0, 1, 2) and plan.compare.reference == "fp-bma"
    assert [tuple(p) for p in plan.compare.pairs] == [
        ("multiswag", "swag"),
        ("multi-fp-bma", "fp-bma"),
        ("multi-fp-bma", "multiswag"),
        ("f-laplace", "laplace"),
        ("laplace", "sgd"),
        ("f-laplace", "sam"),
    ]
    first = {j.label: j for j in jobs if j.seed == 0}
    assert [c.options for c in first["multi-fp-bma"].candidates] == [{"of.gamma": g} for g in (0.01, 0.1, 0.5)]
    assert [c.options for c in first["f-laplace"].candidates] == [{"rho": r} for r in (0.01, 0.05, 0.1)]
    # the runs this study shares with the flatness study are the same runs (same resolved configs)
    shared = {j.label: j for j in flatness.jobs() if j.seed == 0}
    for label in ("sgd", "sam", "swag", "fp-bma"):
        mine = [c.config.to_dict() for c in first[label].candidates]
        theirs = [c.config.to_dict() for c in shared[label].candidates]
        drop = lambda d: {k: v for k, v in d.items() if k != "output_dir"}  # noqa: E731
        assert [drop(d) for d in mine] == [drop(d) for d in theirs], label
    # a mixture's first stage is a MultiSWAG of the members' own SWAG priors; the members are fp-bma
    multi = first["multi-fp-bma"].candidates[0].config
    assert multi.prior.method.name == "swag" and multi.method.options["members"] == 3
    multiswag = first["multiswag"].candidates[0].config.method.options["of"]
    assert multiswag == multi.prior.method  # the same SWAG as each member's prior stage


def test_ivon_study_is_the_demos_task_with_its_arms_grid_and_pairs():
    """configs/ivon-study.yaml (issue #37): the demo's data (plus a validation pool outside the k-shot images), model,
    optim and epochs; IVON's and F-IVON's ess and beta2 chosen on validation; the three pairs."""
    plan = load_plan(CONFIGS / "ivon-study.yaml")
    demo = load_plan(DEMO)
    assert plan.base.model == demo.base.model and plan.base.optim == demo.base.optim
    assert plan.base.train.epochs == demo.base.train.epochs
    assert dataclasses.replace(plan.base.data, val_pool=0) == demo.base.data and plan.base.data.val_pool == 10
    jobs = plan.jobs()
    arms = ["ivon", "f-ivon", "mfvi", "lowrank-vi", "fp-bma", "swag", "sgd"]
    assert list(dict.fromkeys(j.label for j in jobs)) == arms
    assert plan.compare.seeds == (0, 1, 2, 3, 4) and plan.compare.reference == "ivon" and plan.compare.flatness
    assert [tuple(p) for p in plan.compare.pairs] == [("f-ivon", "ivon"), ("ivon", "sgd"), ("ivon", "mfvi")]
    first = {j.label: j for j in jobs if j.seed == 0}
    grid = [{"ess": e, "beta2": b} for e in (1e4, 1e5) for b in (0.95, 0.99999)]
    assert [c.options for c in first["ivon"].candidates] == grid
    assert [c.options for c in first["f-ivon"].candidates] == grid
    assert first["fp-bma"].candidates[0].config.prior == first["lowrank-vi"].candidates[0].config.prior


FLAT_PAIRS = [("f-swag", "swag"), ("f-mfvi", "mfvi"), ("f-mc-dropout", "mc-dropout"), ("f-ensemble", "ensemble")]
FLAT_PAIRS += [("f-sgld", "sgld"), ("f-lowrank-vi", "lowrank-vi")]


@pytest.mark.parametrize("name", ["claims-transfer", "claims-scratch"])
def test_the_claims_studies_expand_to_both_claims_arms_and_validate(name):
    """Issue #34 parts 2-3: FP-BMA where q can move (no KL to its start, fixed epochs, the SWAG fit as start and
    prior), its width twins and the positive control; F-X − X for six families at ρ = 0.05; 10 seeds."""
    plan = load_plan(CONFIGS / f"{name}.yaml")
    validate_runs(_every_run(plan), flatness=plan.compare.flatness)
    assert plan.compare.seeds == tuple(range(10)) and plan.compare.flatness
    assert plan.base.data.test_limit is None and plan.base.train.early_stopping is None  # the whole test split
    pairs = [tuple(p) for p in plan.compare.pairs]
    for arm in ("fp-bma-r0.05", "fp-bma-score0.5"):
        assert (arm, "lowrank-vi") in pairs and (arm, f"twin@{arm}") in pairs
    assert ("lowrank-vi", "sgd") in pairs  # the positive control
    assert all(p in pairs for p in FLAT_PAIRS)
    by_label = {}
    for job in plan.jobs():
        by_label.setdefault(job.label, job)
    vi = [by_label[x].candidates[0].config for x in ("lowrank-vi", "f-lowrank-vi", "fp-bma-r0.05", "fp-bma-score0.5")]
    swag = by_label["swag"].candidates[0].config
    for c in vi:
        assert c.method.options["kl_weight"] == 0.0 and c.prior is not None and c.prior.init
        assert c.prior.method == swag.method and c.prior.epochs == swag.train.epochs  # q starts at the swag row
    assert vi[2].method.ascent.radius == 0.05 and vi[3].method.ascent.radius == 0.5
    assert vi[2].method.ascent.direction == "loss" and vi[3].method.ascent.direction == "score"
    for flat, plain in FLAT_PAIRS:
        assert by_label[flat].candidates[0].config.method.ascent.rho == 0.05
        assert by_label[plain].candidates[0].config.method.ascent is None
    assert len(by_label["mfvi"].candidates) == 3 and len(by_label["sgld"].candidates) == 3  # chosen on validation
