"""Step statistics (``StepOutput.stats``): averaged per epoch by the loop, exact across a resume, logged."""

import json

import torch
import yaml

from flatbma.experiment.cli import main
from flatbma.experiment.run.logs import read_csv
from flatbma.loop import History, fit
from flatbma.types import State, StepOutput, Transform
from tests.helpers import DONE


def _counting() -> Transform:
    """A transform whose step ``t`` reports ``stats = {"t": t}`` and, every other step, ``{"odd": 1}``."""

    def update(state, batch):
        x, _ = batch
        t = state.step
        stats = {"t": torch.tensor(float(t))}
        if t % 2:
            stats["odd"] = torch.tensor(1.0)
        logits = torch.zeros(len(x), 2)
        return State(params=state.params, step=t + 1), StepOutput(torch.tensor(0.5), logits, stats)

    return Transform(init=lambda p, b: State(params=p), update=update)


def _loader(n_batches=5):
    return [(torch.zeros(2, 1), torch.zeros(2, dtype=torch.int64)) for _ in range(n_batches)]


def test_the_epoch_mean_of_each_statistic_over_the_steps_that_reported_it():
    _, history = fit(_counting(), State(params={}), _loader(), epochs=2, progress=False)
    assert history.epochs[0].stats == {"t": 2.0, "odd": 1.0}  # steps 0..4; odd at 1, 3
    assert history.epochs[1].stats == {"t": 7.0, "odd": 1.0}  # steps 5..9
    assert "stats" in history.epochs[0].record() and "validation" not in history.epochs[0].record()


def test_a_run_resumed_mid_epoch_averages_the_statistics_exactly():
    saved = []
    fit(
        _counting(),
        State(params={}),
        _loader(),
        epochs=2,
        progress=False,
        checkpoint=lambda s, p, h: saved.append((s, p, History(list(h.epochs)))),
        checkpoint_every=3,
    )
    # the checkpoint after the 6th update: epoch 1 (updates t = 5..9) has applied t = 5
    state, position, history = next(item for item in saved if item[1].epoch == 1 and item[1].batch == 1)
    assert {k: (s, n) for k, s, n in position.stats} == {"t": (5.0, 1), "odd": (1.0, 1)}
    _, resumed = fit(_counting(), state, _loader(), epochs=2, progress=False, resume=position, history=history)
    assert resumed.epochs[1].stats == {"t": 7.0, "odd": 1.0}


def test_fp_bma_records_the_size_of_every_ascent_in_its_history_and_log(tmp_path):
    config = {
        "seed": 0,
        "method": {"name": "fp-bma", "rank": 3, "radius": 0.05},
        "data": {"name": "digits", "k_shot": 10, "batch_size": 25, "test_limit": 50},
        "model": {"name": "mlp", "width": 8},
        "train": {"epochs": 2, "progress": False, "checkpoint_every": 3},
        "eval": {"num_samples": 1},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(path), "--set", f"output_dir={tmp_path / 'run'}"]) in DONE
    history = json.loads((tmp_path / "run" / "metrics.json").read_text())["history"]
    for epoch in history:
        stats = epoch["stats"]
        assert abs(stats["ascent/mean_shift"] - 0.05) < 1e-6  # the radius in the weights' units, every step
        assert stats["ascent/kl"] > 0 and 0 < stats["ascent/kl_mean"]
    rows = read_csv(tmp_path / "run" / "log.csv")
    assert [r["ascent/kl"] for r in rows] == [h["stats"]["ascent/kl"] for h in history]
