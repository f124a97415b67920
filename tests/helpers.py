"""Tiny models and objectives shared by the tests."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn

from flatbma.params import Objective
from flatbma.types import State

DONE = (0, 3)
"""Exit codes of a command that did its work: 3 when a health rule flags its run (as tiny test runs often are)."""


class Quadratic(nn.Module):
    """A module whose output is its weight vector; pair it with :func:`quadratic_loss`."""

    def __init__(self, w0: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w0.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w.expand(x.shape[0], -1)


def quadratic_objective(A: torch.Tensor, c: torch.Tensor, w0: torch.Tensor) -> Objective:
    """``L(w) = ½ (w − c)ᵀ A (w − c)`` as an Objective (the labels are ignored)."""

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        d = out[0] - c
        return 0.5 * d @ A @ d

    return Objective(model=Quadratic(w0), loss_fn=loss_fn)


def tiny_bn_net(in_features: int = 6, classes: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(in_features, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, classes))


def toy_batch(n: int = 16, in_features: int = 6, classes: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, in_features, generator=g), torch.randint(0, classes, (n,), generator=g)


METHOD_SECTIONS = {
    "multi": {"name": "multi", "of": {"name": "sam"}, "members": 2},
    **{n: {"name": n, "start_step": 0, "collect_every": 1} for n in ("swag", "swag-diag", "f-swag")},
    "multiswag": {"name": "multiswag", "of": {"name": "swag", "start_step": 0, "collect_every": 1}},
    "sgld": {"name": "sgld", "burn_in": 0, "thin": 1},
}
"""Registered methods that need more than their name to train and sample within a few steps."""


def train_steps(name: str, *, precision: str = "fp32", device: str = "cpu", steps: int = 3, wrap=None):
    """``(start, state, method)``: ``steps`` updates of registered method ``name`` on one toy batch.

    A tiny BatchNorm net (with dropout for the MC-dropout methods), seeded alike on every call, built on the
    CPU and moved to ``device``; ``precision`` is the Objective's; ``wrap`` (e.g. ``LossScaled()``) wraps the
    built method. ``start`` holds the initial trained variables.
    """
    from flatbma.methods import parse_method
    from flatbma.optim import SGD
    from flatbma.params import model_buffers, trainable_params
    from flatbma.precision import Precision

    torch.manual_seed(0)
    model = tiny_bn_net(in_features=6, classes=3)
    if name in ("mc-dropout", "f-mc-dropout"):
        model = nn.Sequential(*model[:3], nn.Dropout(0.2), model[3])
    model = model.to(device)
    objective = Objective(model=model, num_data=64, precision=Precision(precision))
    section = METHOD_SECTIONS.get(name, name)
    method = parse_method(section).build(objective, SGD(lr=0.1, momentum=0.9), map_steps=steps)
    method = wrap(method) if wrap is not None else method
    torch.manual_seed(2)
    state = method.init(trainable_params(model), model_buffers(model))
    start = {k: v.detach().clone() for k, v in state.params.items()}
    x, y = toy_batch(n=32, in_features=6, classes=3)
    batch = (x.to(device), y.to(device))
    torch.manual_seed(1)
    for _ in range(steps):
        state, out = method.update(state, batch)
        assert torch.isfinite(out.loss)
    return start, state, method


def relative_difference(a, b, start) -> float:
    """``‖a − b‖ / ‖b − start‖`` over the tensors of ``b`` (in float64, on the CPU): ``a``'s distance from ``b``
    relative to how far ``b`` moved from ``start``."""
    num = sum(float((a[k].double().cpu() - b[k].double().cpu()).pow(2).sum()) for k in b) ** 0.5
    den = sum(float((b[k].double().cpu() - start[k].double().cpu()).pow(2).sum()) for k in b) ** 0.5
    return num / max(den, 1e-30)


def interrupt_after_first_epoch(monkeypatch) -> None:
    """Make the run's first ``fit`` train one epoch and then raise ``KeyboardInterrupt`` (at an epoch end,
    after its checkpoint); later calls (the resumed run) train normally."""
    from flatbma.loop import fit as real_fit

    calls = {"n": 0}

    def stop_after_first_epoch(method, state, loader, *, epochs, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            real_fit(method, state, loader, epochs=1, **kwargs)
            raise KeyboardInterrupt
        return real_fit(method, state, loader, epochs=epochs, **kwargs)

    monkeypatch.setattr("flatbma.training.fit", stop_after_first_epoch)


@contextlib.contextmanager
def held_by_another_process(*directories: Path) -> Iterator[subprocess.Popen]:
    """A second process that holds the locks of ``directories`` (:func:`flatbma.experiment.run.lock.hold`) as
    ``flatbma train`` does, until the block ends (or the test kills it); yields the process."""
    code = (
        "import contextlib, sys\nfrom flatbma.experiment.run.lock import hold\n"
        "with contextlib.ExitStack() as held:\n"
        "    for d in sys.argv[1:]:\n        held.enter_context(hold(d, 'train'))\n"
        "    print('held', flush=True)\n    sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *map(str, directories)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        if proc.poll() is None:
            proc.stdin.close()
        proc.wait(timeout=120)


class TwoTensors(nn.Module):
    """Float64 parameters registered in non-sorted order ('w' then 'b'), to exercise the flattening order."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))
        self.b = nn.Parameter(torch.zeros(4, dtype=torch.float64))

    def forward(self, x):
        return x @ self.w.sum(0, keepdim=True).T + self.b.sum()


@dataclass(frozen=True)
class Scripted:
    """An 'optimizer' that sets the weights to a known sequence: update t writes ``iterates[t]``."""

    iterates: list

    def init(self, params):
        return {}

    def learning_rate(self, step):
        return 0.0

    @torch.no_grad()
    def apply(self, params, grads, state, step):
        for k, v in self.iterates[step].items():
            params[k].copy_(v)
        return state


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One torch thread for the block (the torchrun workers' setting), so that results compare bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_via_cli(tmp_path: Path, cfg: dict) -> tuple[Path, dict]:
    """``flatbma train`` of ``cfg`` (written to ``tmp_path/c.yaml``) into ``tmp_path/run``: ``(run, metrics)``."""
    from flatbma.experiment.cli import main  # here: most tests that import these helpers run no CLI

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    assert main(["train", "--config", str(path), "--set", f"output_dir={out}"]) == 0
    return out, json.loads((out / "metrics.json").read_text())


DETECTABLE_PER_S = {
    2: 11.549888435883657,
    3: 3.2640435497007787,
    4: 2.127949343257799,
    5: 1.6819969659555454,
    10: 0.9960013714554438,
    25: 0.5840266715500866,
}
"""δ₈₀/s of the two-sided paired t test at 5% with n pairs, computed by hand from the definition of the noncentral t.

``T′ = (Z + λ)/√(V/ν)``, ``Z ~ N(0, 1)``, ``V ~ χ²_ν``, ``ν = n − 1``: the power
``∫ [Φ(λ − c√(v/ν)) + Φ(−λ − c√(v/ν))] χ²_ν(v) dv`` (``c = t_{0.975, ν}``; scipy.integrate.quad, tolerance 1e-12)
solved for 0.8 by brentq (xtol 1e-13), then ``λ/√n`` (tests/test_stats.py's ``_power_by_definition`` recomputes the
power at these values). statsmodels 0.15 ``TTestPower().solve_power(nobs=n, alpha=0.05, power=0.8)`` gives 3.2640436
(n = 3), 1.6819971 (n = 5), 0.9960019 (n = 10): equal to its solver's tolerance.
"""


def load_state(path: str | Path, device: str = "cpu") -> State:
    """The state of the state file at ``path`` (a checkpoint, a predictor file), its checksums checked."""
    from flatbma.experiment.run.checkpoint import load_checkpoint

    return load_checkpoint(path, device)[0]
