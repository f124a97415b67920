"""Progress a user can trust (issue #35): a long phase prints at least every ``interval`` seconds — checked
with a fake clock, never a timed assertion — from the loops inside it (bars, training steps, Hessian products)."""

from __future__ import annotations

import io
import itertools
import sys

import pytest
import torch
from torch import nn

from flatbma import progress
from flatbma.flatness import hessian_eigenvalues
from flatbma.loop import fit
from flatbma.optim import SGD
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import point
from flatbma.progress import Reporter


def _lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_a_phase_prints_once_its_interval_has_passed_with_where_it_stands(capsys):
    clock = [0.0]
    reporter = Reporter(terminal=False, interval=30.0, clock=lambda: clock[0])
    with progress.reporting(reporter), reporter.phase("flatness", "8 samples λ₁"):
        for _ in reporter.bar(range(8), desc="Hessian spectra"):  # 8 samples of 7 products, 1 s each
            for _ in range(7):
                clock[0] += 1.0
                reporter.tick()
    assert _lines(capsys) == [
        "flatness: Hessian spectra 4/8, 30 s so far",  # 4 samples done after 28 s; the line at 30 s
        "flatness: 8 samples λ₁ in 56.0 s",
    ]


def test_no_silence_is_longer_than_the_interval_plus_one_step(monkeypatch):
    clock = [0.0]
    times: list[float] = []

    class Stderr(io.StringIO):  # records the clock's time of every line printed
        def write(self, text: str) -> int:
            if text.strip():
                times.append(clock[0])
            return len(text)

    monkeypatch.setattr(sys, "stderr", Stderr())
    reporter = Reporter(terminal=False, interval=30.0, clock=lambda: clock[0])
    steps = [0.5, 7.0, 2.0, 11.0, 0.1, 4.0, 9.5] * 20  # irregular loop steps, at most 11 s
    with reporter.phase("BMA"):
        for step in steps:
            clock[0] += step
            reporter.tick()
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert len(times) > 10 and max(gaps) <= 30.0 + max(steps) and min(gaps[:-1]) >= 30.0


def test_ticks_print_nothing_outside_a_phase_when_quiet_on_a_terminal_or_in_a_quiet_phase(capsys):
    clock = itertools.count(0.0, 100.0)  # every reading 100 s later
    loud = Reporter(terminal=False, clock=lambda: next(clock))
    loud.tick("nowhere")  # no phase
    for reporter in (Reporter(terminal=False, quiet=True, clock=loud.clock), Reporter(terminal=True, clock=loud.clock)):
        with progress.reporting(loud), reporter.phase("train"):
            progress.current().tick()  # the phase's own reporter decides: a quiet stage stays quiet
    assert _lines(capsys) == []


@pytest.mark.filterwarnings("ignore:Lanczos did not converge")  # 6 products are the point, not the eigenvalue
def test_training_steps_and_hessian_products_tick_the_phase_they_run_in(capsys):
    clock = itertools.count(0.0, 20.0)  # every reading 20 s later: a line every other tick
    reporter = Reporter(terminal=False, interval=30.0, clock=lambda: next(clock))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    data = [(torch.randn(8, 4), torch.arange(8) % 3) for _ in range(3)]
    method = point.build(Objective(model, num_data=24), SGD(lr=0.1))
    with progress.reporting(reporter):
        with reporter.phase("train", "sgd, 2 epochs"):
            state, _ = fit(method, method.init(trainable_params(model), model_buffers(model)), data, epochs=2)
        with reporter.phase("flatness", "1 sample"):
            hessian_eigenvalues(model, data, k=1, weights=state.params, max_iter=6, tol=1e-12)
    lines = _lines(capsys)
    assert "train: epoch 1/2 2/3, 40 s so far" in lines and any(line.startswith("train: epoch 2/2") for line in lines)
    heartbeats = [line for line in lines if line.startswith("flatness: ") and line.endswith("s so far")]
    assert len(heartbeats) >= 2 and all("Hessian-vector product" in line for line in heartbeats), lines
