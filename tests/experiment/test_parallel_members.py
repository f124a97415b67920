"""Ensemble members and compare runs spread over torchrun processes (gloo on CPU) reproduce one process.

``train.parallel: members``: an F-ensemble of 3 members (with training dropout) on 2 processes (members
{0, 1} and {2}) gives bit-identical members, optimizer state and BMA metrics as one process, and the
training history up to float rounding (the mixture of the per-process outputs is regrouped); a run
killed mid-epoch on 2 processes resumes in ONE process to the same result. A ``multi`` mixture of 3 F-SWAG
posteriors on 2 processes equals one process bit for bit (state) and its BMA metrics to 1e-12. ``flatbma compare`` under
torchrun deals its 2 methods x 2 seeds to the 2 processes and writes the same ``results.json`` rows as
one process (timings and run paths aside); only rank 0 writes the shared files and prints.

The multi-process part launches ``python -m torch.distributed.run`` (= ``torchrun``) once, with this
file as the worker script (``_worker``); the one-process references run with one thread, like the
workers, so that float results are comparable bit for bit.
"""

import copy
import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.parallel import loaders, processes
from flatbma.experiment.run.checkpoint import load_checkpoint
from flatbma.experiment.run.pipeline import load_run_config, train
from flatbma.experiment.study.compare import run_compare
from flatbma.experiment.study.plan import load_plan
from flatbma.optim import SAM, SGD
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import ensemble
from tests.experiment.torchrun_helpers import crash_after, torchrun
from tests.helpers import one_thread

MEMBERS = {
    "seed": 0,
    "method": {"name": "f-ensemble", "size": 3, "rho": 0.05},
    "data": {"name": "digits", "batch_size": 64},  # 1198 examples: 19 steps per epoch
    "model": {"name": "mlp", "width": 32, "dropout": 0.2},  # dropout: each member draws its own masks
    "optim": {"name": "adam", "lr": 0.01},
    "train": {"epochs": 2, "progress": False, "device": "cpu", "checkpoint_every": 7, "parallel": "members"},
    "eval": {"num_samples": 3},
}
CRASH_AFTER = 2  # checkpoints (steps 7 and 14: mid epoch 1)
MULTI = {  # a mixture of 3 F-SWAG posteriors (SAM ascent, low-rank moments, dropout masks per member)
    "method": {
        "name": "multi",
        "members": 3,
        "of": {"name": "f-swag", "rank": 2, "start_step": 0, "collect_every": 5, "rho": 0.05},
    },
    "train": {"epochs": 2, "progress": False, "device": "cpu", "checkpoint_every": 7, "parallel": "members"},
}
COMPARE = {
    "seed": 0,
    "data": {"name": "digits", "batch_size": 64, "test_limit": 200},
    "model": {"name": "mlp", "width": 16},
    "optim": {"name": "adam", "lr": 0.01},
    "train": {"epochs": 1, "progress": False, "device": "cpu"},
    "eval": {"num_samples": 2},
    "compare": {
        "methods": [{"name": "sgd"}, {"name": "ensemble", "size": 2}],
        "seeds": [0, 1],
        "bma_curve": [1, 2],
        "flatness": False,
        "landscape": False,
    },
}
METRIC_KEYS = ("accuracy", "nll", "ece", "aece", "brier")
SHARED_FILES = {"compare_config.yaml", "results.json", "results.csv", "report.md", "tables.html"}


def _members_config(output_dir, **train) -> dict:
    cfg = copy.deepcopy(MEMBERS)
    cfg["output_dir"] = str(output_dir)
    cfg["train"].update(train)
    return cfg


def _multi_config(output_dir) -> dict:
    return {**_members_config(output_dir), **copy.deepcopy(MULTI)}


# --------------------------------------------------------------------------------------------------
# the members contract (one process)


def _batch(seed: int):  # importable without the tests package: this file is also the torchrun worker
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def _clone(tensors: dict) -> dict:
    return {k: v.clone() for k, v in tensors.items()}


def _dropout_net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3))


def test_split_states_train_their_members_as_the_full_state_and_outputs_combine_as_a_mixture():
    torch.manual_seed(0)
    net = _dropout_net().train()
    method = ensemble.build(Objective(model=net), SGD(lr=0.1, momentum=0.9), SAM(rho=0.05), size=3, seed=3)
    assert method.can.members == 3
    full = method.init(trainable_params(net), model_buffers(net))
    parts = [method.can.split(full, [0, 2]), method.can.split(full, [1])]
    for section in ("params", "buffers", "aux"):  # the splits partition the entries (same tensors)
        entries = [k for p in parts for k in getattr(p, section)]
        assert sorted(entries) == sorted(getattr(full, section))
        assert all(getattr(p, section)[k] is getattr(full, section)[k] for p in parts for k in getattr(p, section))
    assert [len(method.sample(p, 30, None)) for p in parts] == [2, 1]

    def copied(state):  # update works in place: the parts must not share tensors with the full state
        return dataclasses.replace(state, **{s: _clone(getattr(state, s)) for s in ("params", "buffers", "aux")})

    parts = [copied(p) for p in parts]
    outs = {}
    for step in range(3):
        batch = _batch(step)
        rng = torch.get_rng_state()
        full, outs["full"] = method.update(full, batch)
        after = torch.get_rng_state()
        for i, part in enumerate(parts):  # each part from the same global stream as the full state
            torch.set_rng_state(rng)
            parts[i], outs[i] = method.update(part, batch)
            assert torch.equal(torch.get_rng_state(), after)  # one draw per step, whatever the members held
    for part in parts:  # bit-identical members: the dropout masks did not depend on the other members
        for section in ("params", "buffers", "aux"):
            for k, v in getattr(part, section).items():
                assert torch.equal(v, getattr(full, section)[k]), (section, k)
        assert part.step == full.step == 3
    # the documented combination of the parts' outputs is the full ensemble's output
    loss = (2 * outs[0].loss + 1 * outs[1].loss) / 3
    log_p = torch.logsumexp(torch.stack([outs[0].logits + math.log(2), outs[1].logits]), 0) - math.log(3)
    torch.testing.assert_close(loss, outs["full"].loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(log_p, outs["full"].logits, rtol=1e-6, atol=1e-6)
    assert torch.allclose(F.softmax(log_p, -1).sum(-1), torch.ones(len(batch[1])))
    with pytest.raises(ValueError, match="distinct member indices"):
        method.can.split(full, [0, 3])


def test_members_needs_a_method_with_members_and_is_a_typed_option(tmp_path):
    cfg = _members_config(tmp_path / "sgd")
    cfg["method"] = {"name": "sgd"}
    with pytest.raises(
        FlatbmaError, match=r"^method sgd has no independent members to spread; use train\.parallel: data$"
    ):
        train(config_from_dict(cfg))
    with pytest.raises(FlatbmaError, match=r"train\.parallel must be one of 'data', 'members', got 'seeds'"):
        config_from_dict(_members_config(tmp_path / "x", parallel="seeds"))
    assert config_from_dict({"method": {"name": "sgd"}}).train.parallel == "data"


def test_one_process_helpers_inside_single_process():
    with processes.single_process():
        assert processes.world_size() == 1 and processes.rank() == 0 and processes.is_main()
        assert not processes.is_distributed()
    assert [list(loaders.member_share(5, 2, r)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(loaders.member_share(3, 3, r)) for r in range(3)] == [[0], [1], [2]]


# --------------------------------------------------------------------------------------------------
# two processes vs one


def _worker(root: Path) -> None:
    """Run under torchrun (2 processes): members training, a crash, too many processes, compare via the CLI."""
    from flatbma import training
    from flatbma.experiment.cli import main
    from flatbma.experiment.report import documents
    from flatbma.experiment.run import stage
    from flatbma.experiment.study import cache, compare, selection

    with processes.process_group(torch.device("cpu")):
        me = processes.rank()
        # rank 1 is given a directory of its own: it must never be created
        train(config_from_dict(_members_config(root / ("members" if me == 0 else "members-rank1"))))

        with crash_after(training, CRASH_AFTER):
            train(config_from_dict(_members_config(root / "crashed")))

        train(config_from_dict(_multi_config(root / "multi")))  # members {0, 1} and {2} of a mixture

        too_many = _members_config(root / "too-many")
        too_many["method"]["size"] = 1
        try:
            train(config_from_dict(too_many))
            message = None
        except FlatbmaError as e:
            message = str(e)
        if me == 0:
            (root / "too-many.json").write_text(json.dumps({"error": message}))

        # compare through the CLI, recording every file this process writes
        writes: list[str] = []

        def recording(module, name):
            real = getattr(module, name)

            def wrapper(path, *a, **k):
                writes.append(str(path))
                return real(path, *a, **k)

            setattr(module, name, wrapper)

        for module, name in [
            (compare, "atomic_write_json"),
            (compare, "write_sealed_json"),
            (compare, "atomic_write_bytes"),
            (cache, "atomic_write_bytes"),
            (selection, "write_sealed_json"),
            (stage, "write_sealed_json"),
            (stage, "atomic_write_bytes"),
            (stage, "save_position"),
        ]:
            recording(module, name)
        real_reports = documents.write_reports

        def reports(results, out_dir):
            writes.append(f"{out_dir}/report.*")
            return real_reports(results, out_dir)

        documents.write_reports = reports
        config = root / "compare.yaml"
        if me == 0:
            config.write_text(yaml.safe_dump({**COMPARE, "output_dir": str(root / "compare")}))
        processes.barrier()
        assert main(["compare", "--config", str(config)]) == 0
        (root / f"writes{me}.json").write_text(json.dumps(writes))


@pytest.mark.slow
def test_torchrun_spreads_members_and_compare_runs_like_one_process(tmp_path):
    many = tmp_path / "many"
    out = torchrun(str(Path(__file__).resolve()), str(many))

    # members on 2 processes = one process (members and optimizer state bit for bit)
    with one_thread():
        train(config_from_dict(_members_config(tmp_path / "one")))
        train(config_from_dict(_members_config(tmp_path / "data", parallel="data")))
    assert not (many / "members-rank1").exists(), "rank 1 wrote files"
    one, _, _ = load_checkpoint(tmp_path / "one" / "checkpoint.safetensors")
    two, _, _ = load_checkpoint(many / "members" / "checkpoint.safetensors")
    data, _, _ = load_checkpoint(tmp_path / "data" / "checkpoint.safetensors")
    assert one.step == two.step == 38
    for section in ("params", "buffers", "aux"):
        for ref in (one, data):  # in one process, members and data are the same training
            x, y = getattr(ref, section), getattr(two, section)
            assert list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x), section
    ma = json.loads((tmp_path / "one" / "metrics.json").read_text())
    mb = json.loads((many / "members" / "metrics.json").read_text())
    assert mb["world_size"] == 2 and "world_size" not in ma
    assert ma["n"] == mb["n"] == 599 and ma["num_samples"] == mb["num_samples"] == 3
    for key in METRIC_KEYS:  # the test set is evaluated in two shards and the metric states summed
        assert mb[key] == pytest.approx(ma[key], rel=1e-12, abs=1e-12), key
    assert ma["accuracy"] > 0.5
    for ha, hb in zip(ma["history"], mb["history"], strict=True):  # the mixture of both processes' outputs
        assert hb["steps"] == ha["steps"] and hb["accuracy"] == ha["accuracy"]
        assert hb["loss"] == pytest.approx(ha["loss"], rel=1e-6)

    # killed at step 14 on 2 processes, resumed in 1 process: the same run
    crashed = load_run_config(many / "crashed")
    assert load_checkpoint(many / "crashed" / "checkpoint.safetensors")[0].step == 14
    with one_thread():
        train(crashed, resume=True)
    resumed, _, _ = load_checkpoint(many / "crashed" / "checkpoint.safetensors")
    for section in ("params", "buffers", "aux"):
        x, y = getattr(one, section), getattr(resumed, section)
        assert all(torch.equal(x[k], y[k]) for k in x), section
    mc = json.loads((many / "crashed" / "metrics.json").read_text())
    assert all(mc[k] == pytest.approx(ma[k], rel=1e-12) for k in METRIC_KEYS)

    # multi (a mixture of F-SWAG posteriors) on 2 processes = one process, bit for bit
    with one_thread():
        train(config_from_dict(_multi_config(tmp_path / "multi-one")))
    one, _, _ = load_checkpoint(tmp_path / "multi-one" / "checkpoint.safetensors")
    two, _, _ = load_checkpoint(many / "multi" / "checkpoint.safetensors")
    assert one.step == two.step == 38 and {k.split("/")[0] for k in one.aux} == {"member0", "member1", "member2"}
    for section in ("params", "buffers", "aux"):
        x, y = getattr(one, section), getattr(two, section)
        assert list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x), section
    ma = json.loads((tmp_path / "multi-one" / "metrics.json").read_text())
    mb = json.loads((many / "multi" / "metrics.json").read_text())
    assert mb["world_size"] == 2 and ma["num_samples"] == mb["num_samples"] == 3
    for key in METRIC_KEYS:
        assert mb[key] == pytest.approx(ma[key], rel=1e-12, abs=1e-12), key

    error = json.loads((many / "too-many.json").read_text())["error"]
    assert error is not None and "1 members of f-ensemble, but 2 processes" in error

    # compare: the runs were dealt round-robin, rank 0 alone wrote the shared files and printed
    assert out.stdout.count("wrote ") == 1 and out.stdout.count("ensemble") >= 1
    writes = [json.loads((many / f"writes{r}.json").read_text()) for r in range(2)]
    for r in (0, 1):  # rank r ran runs r and r + 2 of (sgd, 0), (sgd, 1), (ensemble, 0), (ensemble, 1)
        dirs = {Path(w).relative_to(many / "compare" / "runs").parts[:2] for w in writes[r] if "/runs/" in w}
        assert {seed for _, seed in dirs} == {f"seed{r}"}
        assert sorted(method.split("-")[0] for method, _ in dirs) == ["ensemble", "sgd"]
    shared = {Path(w).name for w in writes[1] if "/runs/" not in w}
    assert shared == set(), f"rank 1 wrote {shared}"
    assert {Path(w).name for w in writes[0] if "/runs/" not in w} >= {"compare_config.yaml", "results.json", "report.*"}

    with one_thread():
        plan = load_plan(many / "compare.yaml", [f"output_dir={tmp_path / 'compare-one'}"])
        run_compare(plan, progress=False)
    a = json.loads((tmp_path / "compare-one" / "results.json").read_text())
    b = json.loads((many / "compare" / "results.json").read_text())
    assert a["config_hash"] == b["config_hash"] and len(a["runs"]) == len(b["runs"]) == 4

    def comparable(row):
        return {k: v for k, v in row.items() if k != "run_dir" and not k.endswith("_time_s")}

    assert [comparable(r) for r in b["runs"]] == [comparable(r) for r in a["runs"]]
    assert [(r["method"], r["seed"]) for r in b["runs"]] == [("sgd", 0), ("sgd", 1), ("ensemble", 0), ("ensemble", 1)]


if __name__ == "__main__":  # the torchrun worker of the test above
    _worker(Path(sys.argv[1]))
