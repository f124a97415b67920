"""Hyperparameter selection in ``flatbma compare``: candidate lists, chosen on the validation split, never the test set.

On digits with a small MLP and a few epochs: which lists are grids (only scalar-typed options), the
refusal without a validation split, every candidate's score in ``results.json`` (checked against an
independent cross-entropy on the validation split), the chosen candidate measured exactly like a
single run of its setting, a poisoned and guarded test set that changes nothing in the choice, a
diverging candidate left out, and two-stage candidates sharing one first stage.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml

from flatbma.data.datasets import ArrayDataset, DatasetSplits
from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.config.run_config import load_config
from flatbma.experiment.parallel import strategies
from flatbma.experiment.run import build, prior
from flatbma.experiment.run.build import build_experiment
from flatbma.experiment.study import compare, selection
from flatbma.experiment.study.compare import run_compare
from flatbma.experiment.study.plan import load_plan
from flatbma.family import Family
from flatbma.methods import METHODS, MethodSpec
from flatbma.posteriors import point
from tests.helpers import load_state

CONFIG: dict[str, Any] = {
    "output_dir": None,
    "data": {"name": "digits", "batch_size": 32, "k_shot": 40, "val_per_class": 10, "test_limit": 200},
    "model": {"name": "mlp", "width": 32},
    "optim": {"lr": 0.3, "momentum": 0.8},
    "train": {"epochs": 8, "progress": False},
    "eval": {"num_samples": 3},
    "compare": {
        "methods": [{"name": "sgd", "optim": {"lr": [0.03, 0.3, 1.0]}}],
        "seeds": [0],
        "corruptions": [],
        "bma_curve": [1],
        "flatness": False,
        "landscape": False,
    },
}

TWO_STAGE = {
    "name": "fp-bma",
    "rank": 3,
    "gamma": [0.01, 0.1],
    "prior": {"method": {"name": "swag", "rank": 3, "start_step": 10, "collect_every": 2}, "epochs": 2},
    "optim": {"lr": 0.02},
}

METRICS = ("accuracy", "nll", "ece", "aece", "brier")


def _write(tmp_path: Path, methods: list[Any], name: str = "out", **data: Any) -> Path:
    cfg = copy.deepcopy(CONFIG)
    cfg["output_dir"] = str(tmp_path / name)
    cfg["compare"]["methods"] = methods
    cfg["data"].update(data)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(path: Path) -> dict[str, Any]:
    return run_compare(load_plan(path), progress=False)


# --------------------------------------------------------------------------------------------------
# parsing: which lists are grids


def test_lists_of_scalar_options_expand_into_candidates(tmp_path: Path) -> None:
    methods = [
        {"name": "sam", "rho": [0.01, 0.05, 0.1], "optim": {"lr": [0.01, 0.05]}},
        {"name": "fp-bma", "rank": 3, "gamma": [0.001, 0.01], "metric": ["fisher", "euclidean"]},
        {"name": "ensemble", "size": 2, "seed": [None, 7], "label": "ens"},
    ]
    plan = load_plan(_write(tmp_path, methods))
    jobs = plan.jobs()
    assert [(j.label, len(j.candidates), j.selects) for j in jobs] == [
        ("sam", 6, True),
        ("fp-bma", 4, True),
        ("ens", 2, True),
    ]
    sam = jobs[0]
    assert [c.options for c in sam.candidates][:3] == [
        {"rho": 0.01, "optim.lr": 0.01},
        {"rho": 0.01, "optim.lr": 0.05},
        {"rho": 0.05, "optim.lr": 0.01},
    ]  # the Cartesian product, in the order written
    for c in sam.candidates:
        cfg = c.config
        assert cfg.method.ascent.rho == c.options["rho"] and cfg.optim.lr == c.options["optim.lr"]
        assert cfg.optim.momentum == 0.8  # the entry's optim overrides only the keys it gives
        assert Path(cfg.output_dir).parent == sam.row_dir and Path(cfg.output_dir).name.startswith("cand-rho=")
    assert len({c.config.output_dir for j in jobs for c in j.candidates}) == 12
    assert [c.config.method.ascent.metric.value for c in jobs[1].candidates] == ["fisher", "euclidean"] * 2
    assert [c.config.method.options["seed"] for c in jobs[2].candidates] == [None, 7]  # `int | None` is a scalar
    assert plan.labels() == ["sam"] * 6 + ["fp-bma"] * 4 + ["ens"] * 2 and len(plan.runs()) == 12


def test_lists_in_a_mixtures_members_method_expand_into_of_candidates(tmp_path: Path) -> None:
    methods = [
        {"name": "multi-fp-bma", "members": [2, 3], "of": {"name": "fp-bma", "rank": 3, "gamma": [0.01, 0.1]}},
        {"name": "multi", "members": 2, "of": {"name": "sam", "rho": [0.01, 0.05]}},
    ]
    jobs = load_plan(_write(tmp_path, methods)).jobs()
    assert [c.options for c in jobs[0].candidates] == [
        {"members": m, "of.gamma": g} for m in (2, 3) for g in (0.01, 0.1)
    ]
    for c in jobs[0].candidates:
        cfg = c.config
        of = cfg.method.options["of"]
        assert cfg.method.options["members"] == c.options["members"] and of.name == "fp-bma"
        assert of.ascent.gamma == c.options["of.gamma"] and of.options["rank"] == 3
        assert Path(cfg.output_dir).name == f"cand-members={c.options['members']},of.gamma={c.options['of.gamma']!r}"
    assert [c.config.method.options["of"].ascent.rho for c in jobs[1].candidates] == [0.01, 0.05]
    assert methods[0]["of"]["gamma"] == [0.01, 0.1]  # the entry as written is not modified


def test_entries_carry_their_own_optim(tmp_path: Path) -> None:
    """Issue #14: two entries with their own ``optim``; ``flatbma train`` on a compare config trains its first
    candidate; one value per key is a single run, not a selection."""
    methods = [{"name": "sgd", "optim": {"lr": 0.2}}, {"name": "sgd", "optim": {"name": "adam"}, "label": "adam"}]
    plan = load_plan(_write(tmp_path, methods, val_per_class=0))
    one, two = plan.runs()
    assert (one.optim.lr, one.optim.momentum, one.optim.name.value) == (0.2, 0.8, "sgd")
    assert (two.optim.lr, two.optim.name.value) == (0.3, "adam")
    assert not any(j.selects for j in plan.jobs()) and one.output_dir != two.output_dir
    first = load_config(_write(tmp_path, [{"name": "sam", "rho": [0.1, 0.2], "optim": {"lr": 0.2}}], name="first"))
    assert (first.method.name, first.method.ascent.rho, first.optim.lr, first.optim.momentum) == ("sam", 0.1, 0.2, 0.8)
    single = load_plan(_write(tmp_path, [{"name": "sam", "rho": [0.05]}], name="single", val_per_class=0))
    (job,) = single.jobs()  # a list of one value needs no validation split: nothing is chosen
    assert not job.selects and job.candidates[0].config.method.ascent.rho == 0.05
    assert Path(job.candidates[0].config.output_dir) == job.row_dir


def test_an_option_that_is_a_list_is_not_a_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass(frozen=True)
    class Options:
        milestones: tuple[int, ...] = (1,)
        scale: float = 1.0

    def family(objective, optimizer, ascent=None, **options):
        return point.build(objective, optimizer, ascent)

    monkeypatch.setitem(METHODS, "milestones-sgd", MethodSpec("milestones-sgd", "test only", Family(family, Options)))
    plan = load_plan(_write(tmp_path, [{"name": "milestones-sgd", "milestones": [1, 2], "scale": [1.0, 2.0]}]))
    (job,) = plan.jobs()
    assert [c.options for c in job.candidates] == [{"scale": 1.0}, {"scale": 2.0}]
    assert all(c.config.method.options["milestones"] == (1, 2) for c in job.candidates)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"name": "sam", "rho": []}, r"compare.methods\[0\].rho is an empty list"),
        ({"name": "sgd", "optim": [0.1]}, r"compare.methods\[0\].optim must be a mapping"),
        ({"name": "sam", "rho": [0.05, "big"]}, "must be a number"),
        ({"name": "sgd", "optim": {"lr": [0.1, -1.0]}}, "lr must be > 0"),
    ],
)
def test_bad_candidate_lists(tmp_path: Path, entry: dict[str, Any], message: str) -> None:
    with pytest.raises(FlatbmaError, match=message):
        load_plan(_write(tmp_path, [entry]))


@pytest.mark.parametrize("data", [{"val_per_class": 0}, {"k_shot": None, "val_per_class": 0}])
def test_lists_are_refused_without_a_validation_split(tmp_path: Path, capsys, data: dict[str, Any]) -> None:
    path = _write(tmp_path, [{"name": "sgd"}, {"name": "sam", "rho": [0.01, 0.05]}], **data)
    assert main(["compare", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'sam' lists candidate values (rho)" in err and "data.val_per_class > 0" in err
    assert not (tmp_path / "out").exists()  # refused before anything was written or trained
    cfg = yaml.safe_load(path.read_text())
    cfg["data"].update(k_shot=40, val_per_class=10)
    cfg["compare"]["quick"] = {"set": ["data.val_per_class=0"]}
    path.write_text(yaml.safe_dump(cfg))
    assert load_plan(path).jobs()[1].selects
    with pytest.raises(FlatbmaError, match="lists candidate values"):
        load_plan(path, quick=True)


def test_candidates_sharing_a_first_stage_are_grouped(tmp_path: Path) -> None:
    lr_grid = {**TWO_STAGE, "gamma": 0.01, "optim": {"lr": [0.01, 0.02]}}
    pinned = {**lr_grid, "prior": {**TWO_STAGE["prior"], "optim": {"lr": 0.05}}, "label": "pinned"}
    plan = load_plan(_write(tmp_path, [TWO_STAGE, lr_grid | {"label": "lr"}, pinned]))
    groups = [[len(g) for g in selection.shared_stages(job)] for job in plan.jobs()]
    assert groups == [[2], [1, 1], [2]]  # the first stage trains with the run's optim unless prior.optim is set


# --------------------------------------------------------------------------------------------------
# end to end


def _val_nll(cfg) -> float:
    """Cross-entropy of the trained point estimate on the validation split, computed directly."""
    exp = build_experiment(cfg)
    state = load_state(Path(cfg.output_dir) / "checkpoint.safetensors")
    x, y = (torch.cat(t) for t in zip(*exp.val_loader, strict=True))
    exp.model.eval()
    logits = torch.func.functional_call(exp.model, {**state.params, **state.buffers}, (x,))
    return float(F.cross_entropy(logits.double(), y))


def test_every_candidate_is_recorded_and_the_chosen_one_is_a_single_run(tmp_path: Path) -> None:
    results = _run(_write(tmp_path, CONFIG["compare"]["methods"]))
    (row,) = results["runs"]
    sel = row["selection"]
    assert sel["criterion"] == "val_nll"
    assert [c["options"] for c in sel["candidates"]] == [{"optim.lr": lr} for lr in (0.03, 0.3, 1.0)]
    scores = [c["val_nll"] for c in sel["candidates"]]
    assert all(math.isfinite(s) for s in scores) and len(set(scores)) == 3
    best = min(range(3), key=scores.__getitem__)
    assert sel["chosen"] == sel["candidates"][best]["options"] and row["optim"]["lr"] == sel["chosen"]["optim.lr"]
    assert row["run_dir"] == sel["candidates"][best]["run_dir"]
    plan = load_plan(tmp_path / "out.yaml")
    for cand, recorded in zip(plan.jobs()[0].candidates, sel["candidates"], strict=True):
        assert recorded["val_nll"] == pytest.approx(_val_nll(cand.config), abs=1e-5)  # an independent computation
        metrics = json.loads((Path(recorded["run_dir"]) / "metrics.json").read_text())
        assert ("accuracy" in metrics) == (recorded is sel["candidates"][best])  # only the chosen one met the test set
    saved = json.loads((tmp_path / "out" / "results.json").read_text())["runs"][0]["selection"]
    assert saved == json.loads(json.dumps(sel))

    # the chosen setting as a single run measures the same numbers
    single = _run(_write(tmp_path, [{"name": "sgd", "optim": {"lr": sel["chosen"]["optim.lr"]}}], name="single"))
    (alone,) = single["runs"]
    assert alone["selection"] is None and alone["run_dir"] != row["run_dir"]
    for key in METRICS:
        assert alone[key] == pytest.approx(row[key], rel=1e-12, abs=1e-12), key

    # a rerun trains nothing and measures nothing again
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").rglob("*.safetensors")}
    assert len(stamps) == 3
    again = _run(tmp_path / "out.yaml")
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "out").rglob("*.safetensors")} == stamps
    assert again["runs"] == results["runs"]


class _Guarded:
    """A test loader that fails the test if it is read outside the test-set measurement."""

    open = False

    def __init__(self, loader) -> None:
        self.loader = loader

    def __iter__(self):
        if not _Guarded.open:
            raise AssertionError("the test set was read outside the measurement of the chosen candidate")
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


@pytest.fixture
def guarded_test_set(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every test loader refuses to be read except inside ``measure``; yields the list of measured runs."""
    test_loader = strategies.Strategy.test_loader
    monkeypatch.setattr(strategies.Strategy, "test_loader", lambda self, *a: _Guarded(test_loader(self, *a)))
    measure, measured = compare.measure, []

    def measuring(*args, **kwargs):
        _Guarded.open = True
        measured.append(1)
        try:
            return measure(*args, **kwargs)
        finally:
            _Guarded.open = False

    monkeypatch.setattr(compare, "measure", measuring)
    return measured


def test_selection_never_reads_the_test_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, guarded_test_set) -> None:
    methods = [*CONFIG["compare"]["methods"], {"name": "sam", "rho": [0.01, 0.2]}]
    clean = _run(_write(tmp_path, methods, name="clean"))
    assert len(guarded_test_set) == 2  # one measurement per (method, seed): the chosen candidates only

    load_dataset = build.load_dataset

    def poisoned(*args, **kwargs):  # every test label wrong
        splits = load_dataset(*args, **kwargs)
        t = splits.test
        wrong = ArrayDataset(t.images, (t.labels + 1) % t.num_classes, t.classes, t.transform)
        return DatasetSplits(train=splits.train, test=wrong, name=splits.name)

    monkeypatch.setattr(build, "load_dataset", poisoned)
    dirty = _run(_write(tmp_path, methods, name="dirty"))
    for a, b in zip(clean["runs"], dirty["runs"], strict=True):
        assert b["accuracy"] < a["accuracy"] - 0.2  # the poison reached the test metrics ...
        assert [c["val_nll"] for c in b["selection"]["candidates"]] == [
            c["val_nll"] for c in a["selection"]["candidates"]
        ]
        assert b["selection"]["chosen"] == a["selection"]["chosen"]  # ... and nothing of the choice


def test_a_diverging_candidate_is_recorded_and_not_chosen(tmp_path: Path) -> None:
    (row,) = _run(_write(tmp_path, [{"name": "sgd", "optim": {"lr": [0.1, 1.0e6]}}]))["runs"]
    ok, diverged = row["selection"]["candidates"]
    assert math.isfinite(ok["val_nll"]) and ok["error"] is None
    assert diverged["val_nll"] is None and "loss became nan" in diverged["error"]
    assert row["selection"]["chosen"] == {"optim.lr": 0.1}
    with pytest.raises(FlatbmaError, match=r"no candidate of sgd \(seed 0\) has a finite validation NLL"):
        _run(_write(tmp_path, [{"name": "sgd", "optim": {"lr": [1.0e6, 1.0e7]}}], name="all"))


def test_two_stage_candidates_train_their_first_stage_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stage1, stage2 = [], []
    first, second = prior.train_stage, selection.train_stage
    monkeypatch.setattr(prior, "train_stage", lambda cfg, **kw: stage1.append(cfg.output_dir) or first(cfg, **kw))
    monkeypatch.setattr(selection, "train_stage", lambda cfg, **kw: stage2.append(cfg.output_dir) or second(cfg, **kw))
    path = _write(tmp_path, [TWO_STAGE])
    (row,) = _run(path)["runs"]
    row_dir = Path(row["run_dir"]).parent
    (shared,) = row_dir.glob("prior-*")
    assert stage1 == [str(shared)] and len(stage2) == 2
    assert not list(row_dir.glob("cand-*/prior"))
    for cand in row["selection"]["candidates"]:
        assert math.isfinite(cand["val_nll"])
        assert json.loads((Path(cand["run_dir"]) / "metrics.json").read_text())["prior_run"] == str(shared)
    assert (
        row["prior"]["method"]["name"] == "swag"
        and row["method_options"]["gamma"] == row["selection"]["chosen"]["gamma"]
    )
    _run(path)
    assert len(stage1) == 1 and len(stage2) == 2  # reused: nothing trains again


@pytest.mark.slow
def test_candidates_spread_over_torchrun_processes_choose_as_one_process(tmp_path: Path) -> None:
    from tests.experiment.torchrun_helpers import torchrun

    methods = [*CONFIG["compare"]["methods"], {"name": "sam", "rho": [0.01, 0.2]}]
    one = _run(_write(tmp_path, methods, name="one"))
    path = _write(tmp_path, methods, name="two")
    out = torchrun("-m", "flatbma", "compare", "--config", str(path), "--set", "train.device=cpu")
    assert out.stdout.count("wrote ") == 1
    for r, mine in ((0, ("optim.lr=0.03", "optim.lr=1.0", "rho=0.2")), (1, ("optim.lr=0.3", "rho=0.01"))):
        done = [line for line in out.stderr.splitlines() if line.startswith(f"candidates (process {r})")]
        assert len(done) == len(mine) and all(opt in line for opt, line in zip(mine, done, strict=True)), done
    two = json.loads((tmp_path / "two" / "results.json").read_text())

    def comparable(row: dict[str, Any]) -> dict[str, Any]:
        sel = row["selection"]
        return {
            **{k: row[k] for k in ("method", "seed", *METRICS)},
            "chosen": sel["chosen"],
            "scores": [(c["options"], c["val_nll"]) for c in sel["candidates"]],
        }

    assert [comparable(r) for r in two["runs"]] == [comparable(r) for r in one["runs"]]


def test_a_fixed_row_with_a_candidates_config_copies_that_finished_run_instead_of_training_it(tmp_path: Path) -> None:
    methods = [
        {"name": "sgd", "label": "chosen", "optim": {"lr": [0.03, 0.3]}},
        {"name": "sgd", "label": "fixed", "optim": {"lr": 0.3}},  # the second candidate's very config
    ]
    results = _run(_write(tmp_path, methods))
    candidates = results["runs"][0]["selection"]["candidates"]
    chosen_dir = next(c["run_dir"] for c in candidates if c["options"] == {"optim.lr": 0.3})
    fixed_dir = Path(results["runs"][1]["run_dir"])
    assert (fixed_dir / "adopted_from.txt").read_text().strip() == chosen_dir
    a = json.loads((Path(chosen_dir) / "metrics.json").read_text())
    b = json.loads((fixed_dir / "metrics.json").read_text())
    assert a["history"] == b["history"] and a["train_time_s"] == b["train_time_s"]  # trained once


def test_an_entry_overrides_the_shared_train_and_data_keys_it_gives(tmp_path: Path) -> None:
    methods = [{"name": "sgd"}, {"name": "sgd", "label": "short", "train": {"epochs": 2}, "data": {"k_shot": 20}}]
    plan = load_plan(_write(tmp_path, methods))
    long, short = (job.candidates[0].config for job in plan.jobs())
    assert (long.train.epochs, long.data.k_shot) == (8, 40)
    assert (short.train.epochs, short.data.k_shot, short.data.batch_size) == (2, 20, 32)  # the other keys shared
    assert short.train.progress is False


def test_compare_without_matplotlib_is_refused_before_anything_trains(tmp_path: Path, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # `import matplotlib.figure` raises ImportError
    path = _write(tmp_path, [{"name": "sgd"}])
    with pytest.raises(FlatbmaError, match="need matplotlib: pip install"):
        _run(path)
    assert not (tmp_path / "out" / "runs").exists()
