"""Config options as ``str`` Enums, the optimizer table, the registry's ``gaussian`` field, the strategy choice."""

from __future__ import annotations

import pytest
import torch
import yaml

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.config.sections import ModelConfig, Parallel, TrainConfig
from flatbma.experiment.parallel import strategies
from flatbma.methods import METHODS, parse_method, prior_methods
from flatbma.optim import SGD, Adam, cosine
from flatbma.optim.config import OptimConfig, Optimizer, Schedule
from flatbma.options import coerce
from flatbma.params import Objective
from flatbma.prior import gaussian_methods
from flatbma.transfer import Subset


def _old_probe(name: str) -> bool:
    """Whether the method (default options) builds one Gaussian posterior — the probe the field replaced.

    A mixture's ``gaussian`` is its members' Gaussians (``member<m>/...``), not one: it is no prior stage.
    """
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    try:
        posterior = parse_method(name).build(Objective(model=model), SGD(lr=0.1), map_steps=40)  # start_step: null
        return posterior.can.gaussian is not None and not posterior.can.members
    except FlatbmaError:
        return False


@pytest.mark.parametrize("name", list(METHODS))
def test_gaussian_field_is_what_the_built_posterior_says(name: str) -> None:
    assert METHODS[name].family.gaussian == _old_probe(name)


def test_gaussian_methods_are_the_ones_a_prior_stage_accepts() -> None:
    assert gaussian_methods() == ["swag", "f-swag", "lowrank-vi", "f-lowrank-vi", "ivon", "f-ivon", "fp-bma", "sa-bma"]


@pytest.mark.parametrize("name", prior_methods())
def test_methods_that_take_a_prior_resolve_kl_weight(name: str) -> None:
    """The stability check of a two-stage run reads the resolved option (parse_method fills the default).

    A mixture's is its members' method's (``multi-fp-bma``: ``method.of.kl_weight``).
    """
    assert isinstance(parse_method(name).component().options["kl_weight"], float)


def test_the_methods_that_take_a_prior() -> None:
    assert prior_methods() == ["lowrank-vi", "f-lowrank-vi", "fp-bma", "sa-bma", "multi-fp-bma"]


def test_options_accept_strings_and_members_and_resolve_to_plain_strings() -> None:
    assert OptimConfig(name="adam").name is Optimizer.ADAM
    assert OptimConfig(name=Optimizer.ADAM, schedule="constant").schedule is Schedule.CONSTANT
    assert TrainConfig(parallel=Parallel.MEMBERS).parallel is Parallel.MEMBERS
    assert ModelConfig(trainable="classifier").trainable is Subset.CLASSIFIER
    with pytest.raises(FlatbmaError, match="name must be one of 'sgd', 'adam', got 'sdg'"):
        OptimConfig(name="sdg")

    raw = {
        "method": {"name": "sgd"},
        "optim": {"name": "adam", "schedule": "constant"},
        "model": {"trainable": "norm+classifier"},
        "train": {"parallel": "members"},
    }
    cfg = config_from_dict(raw)
    assert cfg.optim.name is Optimizer.ADAM and cfg.model.trainable == "norm+classifier"
    resolved = cfg.to_dict()
    for section, key in [("optim", "name"), ("optim", "schedule"), ("model", "trainable"), ("train", "parallel")]:
        assert type(resolved[section][key]) is str, (section, key)
    assert yaml.safe_load(yaml.safe_dump(resolved, sort_keys=False)) == resolved  # written as config.yaml
    assert config_from_dict(resolved) == cfg
    with pytest.raises(FlatbmaError, match=r"train.parallel must be one of 'data', 'members', got 'model'"):
        config_from_dict({**raw, "train": {"parallel": "model"}})
    assert coerce(Optimizer.SGD, Optimizer, "optim.name") is Optimizer.SGD


def test_the_optimizer_table_builds_each_name_with_its_schedule() -> None:
    sgd = OptimConfig(lr=0.1, momentum=0.5, nesterov=True, warmup_epochs=1.0).build(steps_per_epoch=10, epochs=4)
    assert isinstance(sgd, SGD) and sgd.momentum == 0.5 and sgd.nesterov
    expected = cosine(0.1, 40, 10)  # 4 epochs of 10 steps, one epoch of warm-up
    assert [sgd.lr(t) for t in range(41)] == [expected(t) for t in range(41)]
    adam = OptimConfig(name="adam", lr=0.01, schedule="constant").build(steps_per_epoch=10, epochs=4)
    assert isinstance(adam, Adam) and adam.lr(0) == adam.lr(39) == 0.01


def test_one_process_chooses_its_strategy_once() -> None:
    one = strategies.strategy("data")
    assert type(one) is strategies.Strategy and one.reduce_metrics is None and one.record() == {}
    members = strategies.strategy(Parallel.MEMBERS)
    assert isinstance(members, strategies.Members) and not members.sharded
    with pytest.raises(ValueError):
        strategies.strategy("model")


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_resolves_to_plain_yaml(name: str) -> None:
    """Enum options of a family or an ascent step are written as their strings (config.yaml is safe YAML)."""
    resolved = config_from_dict({"method": name}).to_dict()
    assert yaml.safe_load(yaml.safe_dump(resolved, sort_keys=False)) == resolved
