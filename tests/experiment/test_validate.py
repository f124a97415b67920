"""A config is checked against its run's length and data before anything trains (flatbma.experiment.run.validate).

Each refused case used to train (for minutes, or a whole first stage) and fail in its evaluation, or
not fail at all. Here the training loop is replaced by one that fails the test if it is ever called,
and the output directory must not exist afterwards: the refusal comes before any step and any file.
The numbers in the messages are worked out by hand from the data: digits with ``k_shot: 10`` trains on
100 images, 4 batches of 25 per epoch; its test split has 599.

Also here: the counts the checks rest on (SWAG's snapshots, SG-MCMC's stored samples) against real
updates, the run's shape against the experiment its build makes, and the heartbeat that names a
stopped process under ``torchrun`` (flatbma.experiment.parallel.liveness; the end-to-end SIGSTOP test is in
test_distributed.py).
"""

from __future__ import annotations

import copy
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml

from flatbma import training
from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.config.run_config import config_from_dict, load_config
from flatbma.experiment.parallel import liveness, processes
from flatbma.experiment.run.build import build_experiment
from flatbma.experiment.run.pipeline import train
from flatbma.experiment.run.validate import run_shape, validate_run
from flatbma.experiment.study.compare import run_compare
from flatbma.experiment.study.plan import load_plan
from flatbma.family import RunShape, Stage
from flatbma.optim import SGD
from flatbma.params import trainable_params
from flatbma.posteriors import sgld, swag
from tests.helpers import quadratic_objective

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

BASE: dict[str, Any] = {
    "seed": 0,
    "data": {"name": "digits", "k_shot": 10, "batch_size": 25},  # 100 images: 4 updates per epoch
    "model": {"name": "mlp", "width": 8},
    "optim": {"lr": 0.05},
    "train": {"epochs": 2, "progress": False, "device": "cpu"},  # 8 updates
    "eval": {"num_samples": 2},
}


def _config(tmp_path: Path, method: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    raw = copy.deepcopy(BASE)
    raw["method"] = method
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values} if name != "prior" else values
    raw["output_dir"] = str(tmp_path / "run")
    return raw


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """The training loop fails the test if a run gets as far as training."""

    def fit(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a run started training although its config asks what it cannot give")

    monkeypatch.setattr(training, "fit", fit)


# ---------------------------------------------------------------------------------------------------
# flatbma train: each case is refused before any step and any file


CASES = [
    pytest.param(
        {"name": "swag"},  # rank 20 spread over the last quarter (updates 7, 8): one per update, 2 of 20
        {},
        "swag needs >= 20 snapshots for method.rank=20, but train.epochs=2 × 4 steps per epoch = 8 updates with "
        "method.start_step=null \\(the last quarter: 6\\) and method.collect_every=auto \\(1: one snapshot per "
        "update\\) collect 2: raise train.epochs to >= 20, or lower method.start_step, or method.rank$",
        id="swag-rank",
    ),
    pytest.param(
        {"name": "swag", "collect_every": 10},  # a snapshot every 10 updates of the last quarter (updates 7, 8): 0
        {},
        "swag needs >= 20 snapshots for method.rank=20, but train.epochs=2 × 4 steps per epoch = 8 updates with "
        "method.start_step=null \\(the last quarter: 6\\) and method.collect_every=10 collect 0: raise train.epochs to "
        ">= 200, or lower method.start_step or method.collect_every, or method.rank",
        id="swag-rank-every",
    ),
    pytest.param(
        {"name": "f-swag", "rank": 5, "start_step": 2, "collect_every": 2},  # (8 − 2)/2 = 3 < 5; 2 + 5·2 = 12 updates
        {},
        "f-swag needs >= 5 snapshots for method.rank=5, .* collect 3: raise train.epochs to >= 3,",
        id="f-swag-rank",
    ),
    pytest.param(
        {"name": "swag-diag", "start_step": 7, "collect_every": 2},  # (8 − 7)/2 = 0 < 2; 7 + 2·2 = 11 updates
        {},
        r"swag-diag needs >= 2 snapshots to sample .* collect 0: raise train.epochs to >= 3, or lower "
        r"method.start_step or method.collect_every$",
        id="swag-diag",
    ),
    pytest.param(
        {"name": "sgld", "burn_in": 1000, "thin": 100},
        {},
        "sgld stores its first sample after method.burn_in \\+ method.thin = 1000 \\+ 100 = 1100 updates, but "
        "train.epochs=2 × 4 steps per epoch = 8 updates: raise train.epochs to >= 275, or lower method.burn_in or "
        "method.thin",
        id="sgld-burn-in",
    ),
    pytest.param(
        {"name": "f-sgld", "burn_in": 8, "thin": 1},  # the burn-in is the whole run
        {},
        "f-sgld stores its first sample after .* = 9 updates, .*: raise train.epochs to >= 3,",
        id="f-sgld-burn-in",
    ),
    pytest.param(
        {"name": "csgld", "cycle_length": 20},  # one sample per cycle, at its last step (update 20)
        {},
        "csgld stores its first sample after 20 updates .* method.cycle_length=20.*: raise train.epochs to >= 5,",
        id="csgld-cycle",
    ),
    pytest.param(
        {"name": "sgd"},
        {"data": {"test_limit": 20}, "eval": {"n_bins": 30}},  # 2 of each class's ~60 test images: 20
        r"eval.n_bins=30 is more than the 20 test examples: .* use eval.n_bins <= 20",
        id="n-bins",
    ),
    pytest.param(
        {"name": "sgd"},  # the classifier of an MLP of width 2: 2·10 weights + 10 biases = 30
        {
            "model": {"width": 2, "trainable": "classifier"},
            "eval": {"flatness": True, "hessian_k": 31, "hessian_max_iter": 40},
        },
        r"eval.hessian_k=31 eigenvalues were asked for, but the Hessian has only 30 .*: use eval.hessian_k <= 30",
        id="hessian-k",
    ),
    pytest.param(
        {"name": "fp-bma", "rank": 3},  # stage 1: (8 − 4)/2 = 2 snapshots < 3; 4 + 3·2 = 10 updates
        {"prior": {"method": {"name": "swag", "rank": 3, "start_step": 4, "collect_every": 2}, "epochs": 2}},
        "swag needs >= 3 snapshots for prior.method.rank=3, but prior.epochs=2 × 4 steps per epoch = 8 updates "
        "with prior.method.start_step=4 and prior.method.collect_every=2 collect 2: raise prior.epochs to >= 3",
        id="prior-stage-snapshots",
    ),
    pytest.param(
        {"name": "fp-bma", "rank": 3},  # 1.9 · 100 · 0.01² = 0.019 < 0.05
        {"prior": {"method": {"name": "swag", "rank": 3, "start_step": 0, "collect_every": 1}, "epochs": 2}},
        r"optim.lr=0.05 is above 0.019 = \(1\+m\)·n·prior.min_std²/kl_weight \(n=100,",
        id="prior-stage-learning-rate",
    ),
    pytest.param(  # the data's own refusals, which a two-stage run met after writing its config.yaml
        {"name": "fp-bma", "rank": 3, "kl_weight": 0.01},
        {
            "prior": {"method": {"name": "swag", "rank": 3, "start_step": 0, "collect_every": 1}, "epochs": 2},
            "data": {"test_limit": 2},
        },
        r"data.test_limit=2 keeps no test image .* use data.test_limit >= 10",
        id="prior-stage-test-limit",
    ),
]


@pytest.mark.parametrize(("method", "sections", "message"), CASES)
def test_train_refuses_before_any_step_or_file(tmp_path, no_training, method, sections, message):
    cfg = config_from_dict(_config(tmp_path, method, **sections))
    with pytest.raises(FlatbmaError, match=message):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_more_eigenvalues_than_lanczos_steps_are_refused_when_the_config_is_read(tmp_path):
    raw = _config(tmp_path, {"name": "sgd"}, eval={"hessian_k": 5, "hessian_max_iter": 4})
    with pytest.raises(FlatbmaError, match=r"hessian_max_iter \(4\) must be >= hessian_k \(5\)"):
        config_from_dict(raw)


def test_the_cli_ends_in_one_line_and_writes_nothing(tmp_path, no_training, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path, {"name": "swag", "rank": 4, "collect_every": 3})))
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flatbma: error: swag needs >= 4 snapshots for method.rank=4")
    assert not (tmp_path / "run").exists()


def test_the_transfer_pipeline_with_a_short_first_stage_is_refused_before_it_trains(tmp_path, no_training):
    # configs/fpbma-transfer.yaml: 10-shot animal-mnist, 4 updates per epoch; SWAG (rank 5) collects from update 12
    path = CONFIGS / "fpbma-transfer.yaml"
    cfg = load_config(path, ["prior.epochs=2", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(FlatbmaError, match=r"swag needs >= 5 snapshots .* collect 0: raise prior.epochs to >= 6,"):
        train(cfg)
    assert not (tmp_path / "run").exists()
    # a short second stage is fine: the first still collects its 24 snapshots
    shape = validate_run(load_config(path, ["train.epochs=2"]))
    assert shape == RunShape(
        steps_per_epoch=4, num_train=100, num_test=1000, num_classes=10, pretrained=True, channels=1
    )


def test_a_config_within_its_means_passes_and_trains(tmp_path):
    cfg = config_from_dict(_config(tmp_path, {"name": "swag", "rank": 3, "start_step": 2, "collect_every": 2}))
    expected = RunShape(steps_per_epoch=4, num_train=100, num_test=599, num_classes=10, channels=1)
    assert validate_run(cfg) == expected  # (8 − 2)/2 = 3 snapshots
    metrics = train(cfg).metrics
    assert metrics["steps"] == 8


# ---------------------------------------------------------------------------------------------------
# flatbma compare: every entry × seed × candidate before the first run


def test_compare_checks_every_entry_before_the_first_run(tmp_path, no_training, monkeypatch):
    # the demo with train.epochs=2: its swag entry (rank 5, snapshots from update 12) would train sgd and sam first
    plan = load_plan(CONFIGS / "demo.yaml", ["train.epochs=2", f"output_dir={tmp_path / 'out'}"])
    with pytest.raises(FlatbmaError) as info:
        run_compare(plan, progress=False)
    assert str(info.value).startswith(
        "compare.methods entry 'swag', seed 0: swag needs >= 5 snapshots for method.rank=5, but train.epochs=2 × 4 "
        "steps per epoch = 8 updates with method.start_step=12"
    )
    assert not (tmp_path / "out").exists()


def test_compare_checks_every_candidate(tmp_path, no_training):
    raw = copy.deepcopy(BASE)
    raw["data"] = {**raw["data"], "val_per_class": 2}  # 80 training images: still 4 updates per epoch
    raw["output_dir"] = str(tmp_path / "out")
    raw["compare"] = {"methods": [{"name": "sgd"}, {"name": "sgld", "burn_in": [4, 40], "thin": 2}], "seeds": [0, 1]}
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(FlatbmaError, match=r"^compare.methods entry 'sgld', seed 0, candidate burn_in=40: sgld stores"):
        run_compare(load_plan(path), progress=False)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------
# the shape and the counts the checks rest on


@pytest.mark.parametrize(
    ("data", "model", "expected"),
    [
        ({"k_shot": 10, "batch_size": 33}, {}, (3, 100)),  # 100 = 3·33 + 1: the batch of one is dropped
        ({"k_shot": 10, "val_per_class": 3, "batch_size": 8, "test_limit": 50}, {"trainable": "classifier"}, (9, 70)),
        ({"batch_size": 64}, {"width": 4}, (19, 1198)),  # the whole training split
    ],
)
def test_the_shape_is_that_of_the_built_experiment(tmp_path, data, model, expected):
    raw = copy.deepcopy(BASE)
    raw["data"] = {"name": "digits", **data}
    raw["model"] = {**raw["model"], **model}
    raw.update(method={"name": "sgd"}, output_dir=str(tmp_path / "run"))
    cfg = config_from_dict(raw)
    shape = run_shape(cfg, trainable=True)
    exp = build_experiment(cfg)
    assert (shape.steps_per_epoch, shape.num_train) == expected
    assert shape.steps_per_epoch == len(exp.train_loader) == len(list(exp.train_loader))
    assert shape.num_train == len(exp.train_loader.dataset)
    assert shape.num_test == len(exp.test_loader.dataset)
    assert shape.num_trainable == sum(p.numel() for p in exp.model.parameters() if p.requires_grad)


def test_checking_first_leaves_the_build_as_it_was(tmp_path):
    cfg = config_from_dict(_config(tmp_path, {"name": "swag", "rank": 2, "collect_every": 1}))
    plain = build_experiment(cfg)
    validate_run(cfg, flatness=True)
    checked = build_experiment(cfg)
    assert torch.equal(plain.rng.cpu, checked.rng.cpu)
    for (name, a), (_, b) in zip(plain.model.state_dict().items(), checked.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def _count_per_update(method, steps: int, key: str) -> list[int]:
    """The method's stored count (``state.aux[key]``) after each of ``steps`` real updates of a quadratic."""
    obj = quadratic_objective(torch.eye(2), torch.zeros(2), torch.ones(2))
    method = method(obj)
    state = method.init(trainable_params(obj.model), {})
    counts = []
    batch = (torch.zeros(1, 1), torch.zeros(1))
    for _ in range(steps):
        state, _ = method.update(state, batch)
        counts.append(int(state.aux[key]))
    return counts


@pytest.mark.parametrize(("start_step", "collect_every"), [(0, 1), (3, 2), (5, 4), (30, 1)])
def test_swag_snapshots_count_what_training_collects(start_step, collect_every):
    options = {"start_step": start_step, "collect_every": collect_every}
    counts = _count_per_update(lambda o: swag.build(o, SGD(lr=0.1), rank=2, **options), 25, swag.N_COLLECTED)
    assert counts == [swag.snapshots(t, **options) for t in range(1, 26)]


@pytest.mark.parametrize(("burn_in", "thin"), [(0, 1), (3, 2), (7, 5), (40, 1)])
def test_sgld_stored_count_is_what_training_stores(burn_in, thin):
    options = {"burn_in": burn_in, "thin": thin}
    counts = _count_per_update(lambda o: sgld.build(o, SGD(lr=0.01), **options), 25, sgld.COUNT_KEY)
    assert counts == [sgld.samples_stored(t, **options) for t in range(1, 26)]


@pytest.mark.parametrize(("cycle_length", "exploration", "samples_per_cycle"), [(10, 0.4, 3), (7, 0.5, 2), (6, 0.8, 1)])
def test_csgld_stored_count_is_what_training_stores(cycle_length, exploration, samples_per_cycle):
    options = {"cycle_length": cycle_length, "exploration": exploration, "samples_per_cycle": samples_per_cycle}
    counts = _count_per_update(lambda o: sgld.build_cyclical(o, SGD(lr=0.01), **options), 25, sgld.COUNT_KEY)
    assert counts == [sgld.cyclical_samples_stored(t, **options) for t in range(1, 26)]


def test_invalid_schedule_options_are_refused_by_the_counts_as_by_the_builders():
    with pytest.raises(FlatbmaError, match=r"method.collect_every must be an integer >= 1"):
        swag.snapshots(10, start_step=0, collect_every=0)
    with pytest.raises(FlatbmaError, match=r"method.thin must be an integer >= 1"):
        sgld.samples_stored(10, burn_in=0, thin=0)
    with pytest.raises(FlatbmaError, match=r"method.samples_per_cycle is 3 but the sampling stage has only 2"):
        sgld.cyclical_samples_stored(10, cycle_length=10, exploration=0.8, samples_per_cycle=3)


def test_stage_arithmetic():
    stage_ = Stage(RunShape(steps_per_epoch=4, num_train=100, num_test=10), epochs=3, epochs_key="prior.epochs")
    assert stage_.steps == 12 and stage_.describe() == "prior.epochs=3 × 4 steps per epoch = 12 updates"
    assert [stage_.epochs_for(s) for s in (1, 4, 5, 12, 13)] == [1, 1, 2, 3, 4]
    for needed in range(1, 8):  # the fewest updates that give `needed`, against a brute-force search
        count = lambda s: max(0, (s - 7) // 3)  # noqa: E731
        assert Stage.steps_for(count, needed) == min(s for s in range(1, 100) if count(s) >= needed)


# ---------------------------------------------------------------------------------------------------
# collective timeouts: the heartbeat that names a stopped process


def test_the_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(liveness.ENV, raising=False)
    assert liveness.collective_timeout() == liveness.DEFAULT_TIMEOUT == 300
    monkeypatch.setenv(liveness.ENV, " 12.5 ")
    assert liveness.collective_timeout() == 12.5
    for bad in ("0", "-3", "five", "inf", "nan", "1e999"):
        monkeypatch.setenv(liveness.ENV, bad)
        with pytest.raises(FlatbmaError, match="FLATBMA_COLLECTIVE_TIMEOUT must be a number of seconds > 0"):
            liveness.collective_timeout()


def test_timeouts_are_told_from_other_errors():
    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"
    assert liveness.is_timeout(RuntimeError(gloo))
    assert liveness.is_timeout(dist.DistBackendError("Watchdog caught collective operation timeout: WorkNCCL"))
    assert not liveness.is_timeout(RuntimeError("DataLoader timed out after 5 seconds"))  # not a collective
    assert not liveness.is_timeout(RuntimeError("gloo: connection closed by peer"))
    assert not liveness.is_timeout(ValueError(gloo))


def test_a_process_that_never_joins_ends_the_rendezvous_with_one_line(monkeypatch):
    with socket.socket() as s:  # a free port for the rendezvous rank 0 would host
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in {**env, liveness.ENV: "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(FlatbmaError, match=r"^not every one of the 2 processes joined within 1 s"):
        processes.init_from_env(torch.device("cpu"))
    assert not dist.is_initialized() and liveness.current() is None


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)


def test_the_heartbeat_names_a_silent_process_and_a_lagging_one(store):
    entered = [7, 6]
    zero = liveness.Heartbeat(store, 0, 2, timeout=1.0, sequence=lambda: entered[0])
    try:
        assert zero.silent() == [1]  # rank 1 never beat
        error = zero.diagnose(RuntimeError("gloo Timed out"))
        assert str(error).startswith("rank 1 did not answer within 1 s: the process is stopped or frozen")
        one = liveness.Heartbeat(store, 1, 2, timeout=1.0, sequence=lambda: entered[1])
        try:
            assert zero.silent() == [] and one.silent() == []
            assert zero.entered() == [7, 6]
            assert str(zero.diagnose(RuntimeError("gloo Timed out"))).startswith(
                "rank 1 did not reach the collective operation within 1 s: the process is alive but stuck"
            )
            entered[1] = 7
            time.sleep(0.3)  # the next beat publishes it
            assert "although every process is alive" in str(zero.diagnose(RuntimeError("gloo Timed out")))
        finally:
            one.stop()
    finally:
        zero.stop()


def test_agreement_waits_for_the_living_and_gives_up_on_the_silent(store):
    zero, one = (liveness.Heartbeat(store, r, 2, timeout=1.0) for r in range(2))
    try:
        result: dict[int, list[int]] = {}

        def late_one() -> None:
            time.sleep(2.5)  # longer than the timeout: a process busy with its share of the runs, but alive
            result[1] = one.agree(True)

        thread = threading.Thread(target=late_one)
        thread.start()
        result[0] = zero.agree(False)
        thread.join()
        assert result == {0: [1], 1: [1]}
        one.stop()  # rank 1 falls silent: the next agreement names it (no clock is read here: bench/, never tests)
        with pytest.raises(FlatbmaError, match=r"^rank 1 did not answer within 1 s"):
            zero.agree(False)
    finally:
        zero.stop()
        one.stop()
