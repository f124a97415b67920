"""Every family is module-level functions over a frozen options dataclass, and the registry reads the options there."""

import dataclasses
import inspect

import pytest
import torch

from flatbma.methods import METHODS, parse_method
from flatbma.optim import SGD
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import mc_dropout, swag
from flatbma.types import prediction_mode
from tests.helpers import toy_batch


def plain_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_options_are_a_frozen_dataclass_whose_fields_are_the_methods_options(name):
    spec = METHODS[name]
    options = spec.family.options
    assert dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen
    fields = [f.name for f in dataclasses.fields(options)]
    nested = ["of"] if spec.family.of is not None else []
    assert list(spec.family_options()) == [*nested, *fields]
    defaults = parse_method(name).options
    assert [k for k in defaults] == [*nested, *fields]
    # the dataclass's defaults, one value for the library, the registry and the CLI (issue #25: SWAG's
    # start_step: null and Laplace's subset: last-layer live in swag.Options and laplace.Options)
    assert all(defaults[f.name] == f.default for f in dataclasses.fields(options))
    assert not hasattr(spec, "overrides")
    if fields:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(options(), fields[0], None)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_no_builder_fakes_its_signature(name):
    spec = METHODS[name]
    for builder in (spec.family.build, spec.family.with_prior):
        if builder is not None:
            assert not {"__signature__", "__wrapped__"} & set(vars(builder))
            params = inspect.signature(builder).parameters.values()
            assert not any(p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "of" for p in params)


def test_an_unknown_option_is_refused_by_the_dataclass():
    with pytest.raises(TypeError, match="collect"):
        swag.build(Objective(model=plain_net()), SGD(lr=0.1), collect=3)


def test_mc_dropout_masks_follow_the_generator_not_the_last_sample_call():
    torch.manual_seed(0)
    net = plain_net()
    method = mc_dropout.build(Objective(model=net), SGD(lr=0.1), rate=0.3)
    state = method.init(trainable_params(net), model_buffers(net))
    x = toy_batch(n=8)[0]

    def logits(seed):
        samples = method.sample(state, 3, torch.Generator().manual_seed(seed))
        with torch.no_grad(), prediction_mode(method, seed)(net):
            return torch.stack([torch.func.functional_call(net, w, (x,)) for w in samples])

    first = logits(0)
    method.sample(state, 3, torch.Generator().manual_seed(5))  # no side effect on the next prediction
    assert torch.equal(logits(0), first)
    assert not torch.equal(logits(1), first)
