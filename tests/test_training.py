"""The one training core (:mod:`flatbma.training`): ``flatbma train`` and ``flatbma.fit_posterior`` both go through it.

Given the same seed and config — the network and loader ``flatbma train`` builds (:func:`build_experiment`), the
same method and ``optim`` sections — the Python API trains the state the CLI trains, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import flatbma
from flatbma import training
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.run.build import build_experiment
from flatbma.experiment.run.pipeline import train
from flatbma.options import plain
from flatbma.types import State

CONFIG = {
    "seed": 5,
    "data": {"name": "digits", "k_shot": 10, "batch_size": 20, "eval_batch_size": 50, "test_limit": 50},
    "model": {"name": "mlp", "width": 16},
    "optim": {"lr": 0.05},
    "train": {"epochs": 2, "progress": False},
    "eval": {"num_samples": 2},
}


@pytest.mark.parametrize(
    "method",
    [{"name": "sgd"}, {"name": "sam", "rho": 0.1}, {"name": "swag", "rank": 2, "collect_every": 1}, {"name": "mfvi"}],
    ids=lambda m: m["name"],
)
def test_the_api_and_the_cli_train_equal_states(tmp_path, method):
    cfg = config_from_dict({**CONFIG, "method": method, "output_dir": str(tmp_path / "run")})
    cli = train(cfg, evaluate=False).state
    exp = build_experiment(cfg)  # the network at its initial weights and a fresh loader, as the CLI built them
    bma = flatbma.fit_posterior(
        exp.model,
        exp.train_loader,
        cfg.method.to_dict(),
        epochs=cfg.train.epochs,
        optim=plain(cfg.optim),
        seed=cfg.seed,
        num_samples=1,
        progress=False,
        load_into=False,
    )
    _equal(bma.state, cli)


def _equal(a: State, b: State) -> None:
    assert a.step == b.step
    for section in ("params", "buffers", "aux"):
        x, y = getattr(a, section), getattr(b, section)
        assert list(x) == list(y), section
        assert all(torch.equal(x[k], y[k]) for k in x), section


def test_build_resolves_the_run_and_train_restores_the_network_mode():
    """:func:`training.build` resolves ``start_step: null`` over the run's updates and holds SWAG's learning rate
    from there (what its logs report); :func:`training.train` trains in train mode and gives the mode back."""
    from flatbma.methods import parse_method
    from flatbma.optim.config import OptimConfig
    from flatbma.params import Objective, model_buffers, trainable_params
    from tests.helpers import tiny_bn_net, toy_batch

    net = tiny_bn_net().eval()
    built = training.build(
        parse_method({"name": "swag", "rank": 2, "collect_every": 1}),
        OptimConfig(lr=0.1),
        Objective(model=net),
        steps_per_epoch=4,
        epochs=2,
    )
    assert built.epochs == 2 and built.learning_rate(7) == built.learning_rate(6)  # held from update 6 = 8 − 8//4
    assert built.learning_rate(5) > built.learning_rate(6)
    state = built.posterior.init(trainable_params(net), model_buffers(net))
    modes = []
    batches = [toy_batch(seed=s) for s in range(4)]
    state, history = training.train(
        built.posterior,
        state,
        batches,
        model=net,
        epochs=2,
        device="cpu",
        after_epoch=lambda s, h: modes.append(net.training),
        progress=False,
    )
    assert modes == [True, True] and not net.training and state.step == 8 and len(history.epochs) == 2
