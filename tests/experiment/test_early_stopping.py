"""Early stopping on validation (``train.early_stopping``) and the validation pool (``data.val_pool``)."""

import json

import pytest
import torch
import yaml

from flatbma.data.fewshot import few_shot_indices
from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.config.sections import DataConfig, TrainConfig
from flatbma.experiment.run.early_stopping import BEST_FILE
from flatbma.options import parse_dataclass, plain
from tests.helpers import interrupt_after_first_epoch

CONFIG = {
    "seed": 0,
    "method": {"name": "sgd"},
    "data": {"name": "digits", "k_shot": 10, "val_pool": 5, "batch_size": 25, "test_limit": 100},
    "model": {"name": "mlp", "width": 8},
    "optim": {"lr": 0.5},
    "train": {"epochs": 30, "progress": False, "early_stopping": {"patience": 3, "samples": 1}},
    "eval": {"num_samples": 2},
}


def _train(tmp_path, name, config=CONFIG, *extra):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / name
    code = main(["train", "--config", str(path), "--set", f"output_dir={out}", *extra])
    return code, out


def _metrics(run_dir):
    return json.loads((run_dir / "metrics.json").read_text())


def test_training_stops_on_patience_and_the_run_is_evaluated_at_its_best_state(tmp_path, capsys):
    code, run = _train(tmp_path, "es")
    assert code == 0
    m = _metrics(run)
    record = m["early_stopping"]
    assert record["stopped_early"] and record["criterion"] == "nll"
    assert record["epochs_trained"] == record["best_epoch"] + 3 < 30  # patience 3, then stop
    assert len(m["history"]) == record["epochs_trained"]
    values = [h["validation"]["nll"] for h in m["history"]]  # evaluated every epoch
    assert min(values) == record["best_value"] == values[record["best_epoch"] - 1]
    assert (run / BEST_FILE).is_file()
    # `flatbma evaluate` reads the best state back: the same numbers as the run reported
    assert main(["evaluate", str(run)]) == 0
    again = _metrics(run)
    assert again["accuracy"] == m["accuracy"] and again["nll"] == m["nll"]
    header = (run / "log.csv").read_text().splitlines()[0].split(",")
    assert header[-3:] == ["val/nll", "val/loss", "val/accuracy"]


def test_a_resumed_run_stops_and_keeps_exactly_what_the_uninterrupted_one_did(tmp_path, monkeypatch):
    _, ref = _train(tmp_path, "ref")
    interrupt_after_first_epoch(monkeypatch)
    code, run = _train(tmp_path, "run")
    assert code == 130  # interrupted after the first epoch's checkpoint
    assert main(["train", "--resume", str(run)]) == 0
    a, b = _metrics(ref), _metrics(run)
    for key in ("accuracy", "nll", "ece", "history", "early_stopping", "steps"):
        assert a[key] == b[key], key
    from safetensors.torch import load_file

    best_a, best_b = load_file(str(ref / BEST_FILE)), load_file(str(run / BEST_FILE))
    assert best_a.keys() == best_b.keys() and all(torch.equal(best_a[k], best_b[k]) for k in best_a)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"data": {"name": "digits", "k_shot": 10}}, "validation split"),
        ({"method": {"name": "laplace"}}, "curvature pass"),
    ],
)
def test_early_stopping_without_what_it_needs_is_refused(tmp_path, capsys, change, words):
    code, _ = _train(tmp_path, "bad", {**CONFIG, **change})
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("flatbma: error:") and words in err and len(err.strip().splitlines()) == 1


def test_the_section_is_left_out_of_the_resolved_config_unless_given():
    assert "early_stopping" not in plain(TrainConfig())  # runs resolved before it existed are the same runs
    given = plain(parse_dataclass(TrainConfig, {"early_stopping": {"criterion": "loss"}}, "train"))
    assert given["early_stopping"] == {"criterion": "loss", "patience": 10, "every": 1, "samples": 3}
    with pytest.raises(FlatbmaError, match="patience must be > 0"):
        parse_dataclass(TrainConfig, {"early_stopping": {"patience": 0}}, "train")


# ------------------------------------------------------------------------------------------------
# data.val_pool


def test_val_pool_draws_validation_outside_the_same_k_shot_images():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (200,), generator=g)
    plain_train, _ = few_shot_indices(labels, 5, seed=3)
    train, val = few_shot_indices(labels, 5, seed=3, val_pool=7)
    assert torch.equal(train, plain_train)  # the k-shot images are those of the run without validation
    assert not set(val.tolist()) & set(train.tolist())
    assert torch.bincount(labels[val], minlength=4).tolist() == [7] * 4
    with pytest.raises(FlatbmaError, match="not combined"):
        few_shot_indices(labels, 5, seed=3, val_pool=2, val_per_class=1)
    smallest = int(torch.bincount(labels).min())
    with pytest.raises(FlatbmaError, match="val_pool"):
        few_shot_indices(labels, 5, seed=3, val_pool=smallest)
    assert "val_pool" not in plain(DataConfig())
    with pytest.raises(FlatbmaError, match="not both"):
        DataConfig(k_shot=5, val_per_class=1, val_pool=3)


def test_an_entry_or_a_set_turns_early_stopping_off_with_null():
    off = parse_dataclass(TrainConfig, {"early_stopping": None}, "train")
    assert off.early_stopping is None  # None is "no section", not "a section of defaults"


def test_val_fraction_holds_out_a_stratified_share_of_a_full_training_split(tmp_path, capsys):
    from flatbma.experiment.config.run_config import config_from_dict
    from flatbma.experiment.run.build import load_data, select_data

    cfg = config_from_dict({"method": {"name": "sgd"}, "data": {"name": "digits", "val_fraction": 0.2}})
    splits = load_data(cfg.data)
    data = select_data(cfg, splits)
    assert cfg.data.validation and len(data.train) + len(data.val) == len(splits.train)
    share = torch.bincount(data.val.labels, minlength=10) / torch.bincount(splits.train.labels, minlength=10)
    assert float((share - 0.2).abs().max()) < 0.01  # every class holds out its share
    with pytest.raises(FlatbmaError, match="with k_shot use val_per_class"):
        DataConfig(k_shot=5, val_fraction=0.2)
    # a full-data run with early stopping trains on the rest and stops on the held-out share
    config = {**CONFIG, "data": {"name": "digits", "val_fraction": 0.1, "batch_size": 256, "test_limit": 100}}
    code, run = _train(tmp_path, "full", config)
    assert code == 0 and _metrics(run)["early_stopping"]["best_epoch"] is not None


def test_an_early_stopped_run_is_finished_training_it_again_touches_nothing(tmp_path, capsys):
    code, run = _train(tmp_path, "es")
    assert code == 0 and _metrics(run)["early_stopping"]["stopped_early"]
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.name != ".flatbma-lock"}
    code, _ = _train(tmp_path, "es")  # the same config again: finished, although it stopped before epoch 30
    assert code == 0
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.name in before} == before
    assert main(["evaluate", str(run)]) == 0  # evaluate reads it as finished
