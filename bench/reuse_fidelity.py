"""How close LookSAM's reused gradient is to the SAM gradient it stands in for, along a real training run.

At the steps between two ascent steps, :class:`flatbma.optim.Amortized` with ``reuse: orthogonal`` descends
along ``g̃ = g + α(‖g‖/‖g_v‖)g_v`` (LookSAM), ``reuse: none`` along ``g``; the full method would take
``g_s = ∇L_B(w + ε)``. This script trains a run config (the study's 10-shot transfer task by default) with
the amortized step and, at every reuse step, also takes the second pass that was skipped, then prints per
position in the cycle (1 … k−1 steps after the ascent) the medians over the run of:

- ``‖g_s − g‖/‖g‖``: SAM's own correction of the gradient (it scales with ρ);
- ``‖g̃ − g‖/‖g‖``: the reused correction (``α`` for SAM, whatever ρ);
- ``cos(g̃ − g, g_s − g)``: whether the reused direction points where SAM's correction points;
- ``‖g̃ − g_s‖/‖g_s − g‖``: the error of the reuse relative to descending along plain ``g`` (1: no better
  than ``reuse: none``; below 1: the reuse approximates SAM better than doing nothing).

The trajectory is the amortized run's own (the extra pass only measures). The script trains a point
estimate with SAM (SGD with the config's ``optim`` section and a cosine schedule); :class:`Measured` wraps
any weight-space ascent step. The study's task needs the set-up's data and weights.

    python bench/reuse_fidelity.py [--config configs/reuse-study.yaml] [--seed 0] [--rho 0.05]
        [--alpha 0.7 0.1] [--every 5] [--epochs 60]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from flatbma.experiment.run.build import build_experiment
from flatbma.experiment.study.plan import load_plan
from flatbma.loop import fit
from flatbma.optim import SAM, SGD, Amortized, cosine
from flatbma.optim.amortized import POSITION
from flatbma.optim.ascent import ascended
from flatbma.params import Objective, add, dot, model_buffers, trainable_params
from flatbma.posteriors import point


@dataclasses.dataclass
class Measured:
    """An :class:`Amortized` step that, at its reuse steps, also takes the skipped second pass and records."""

    inner: Amortized
    records: dict[int, list[tuple[float, float, float, float]]] = dataclasses.field(
        default_factory=lambda: defaultdict(list)
    )

    @property
    def space(self):
        return self.inner.space

    def perturb(self, params, grads):
        return self.inner.perturb(params, grads)

    def init(self, params):
        return self.inner.init(params)

    def descent_gradient(self, gradient, params, batch, grads, memory):
        """The wrapped step's descent gradient; at a reuse step also ``g_s``, compared with it."""
        at = int(memory[POSITION]) % self.inner.ascent_every
        out = self.inner.descent_gradient(gradient, params, batch, grads, memory)
        if at:
            with torch.random.fork_rng(devices=[]):  # the measurement leaves the run's random draws alone
                _, g_s = ascended(gradient, params, batch, self.inner.ascent, grads)
            with torch.no_grad():
                true, used = add(g_s, grads, -1.0), add(out, grads, -1.0)  # the corrections of g
                g2, t2, u2 = float(dot(grads, grads)), float(dot(true, true)), float(dot(used, used))
                miss = add(used, true, -1.0)
                err = float(dot(miss, miss))
                cos = float(dot(used, true)) / math.sqrt(t2 * u2) if t2 > 0 and u2 > 0 else float("nan")
                self.records[at].append((math.sqrt(t2 / g2), math.sqrt(u2 / g2), cos, math.sqrt(err / t2)))
        return out


def run(config: Path, seed: int, rho: float, alpha: float, every: int, epochs: int | None) -> Measured:
    """Train ``config``'s model and data with SGD + ``Amortized(SAM(rho), every, α)``; return the records."""
    plan = load_plan(config, [f"seed={seed}"])
    cfg = plan.base
    exp = build_experiment(cfg)
    epochs = epochs or cfg.train.epochs
    steps = epochs * len(exp.train_loader)
    o = cfg.optim
    optimizer = SGD(lr=cosine(o.lr, total_steps=steps), momentum=o.momentum, weight_decay=o.weight_decay)
    measured = Measured(Amortized(SAM(rho), ascent_every=every, reuse_alpha=alpha))
    method = point.build(Objective(exp.model, num_data=len(exp.train_loader.dataset)), optimizer, measured)
    exp.model.train()
    state = method.init(trainable_params(exp.model), model_buffers(exp.model))
    fit(method, state, exp.train_loader, epochs=epochs, device=exp.device, progress=False)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/reuse-study.yaml"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rho", type=float, default=0.05)
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.7, 0.1])
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=None, help="default: the config's train.epochs")
    args = parser.parse_args()
    print(f"{args.config}, seed {args.seed}, SAM rho {args.rho}, second pass every {args.every} steps")
    print(f"{'alpha':>6}{'position':>10}{'‖g_s−g‖/‖g‖':>14}{'‖g̃−g‖/‖g‖':>13}{'cos':>8}{'‖g̃−g_s‖/‖g_s−g‖':>19}")
    for alpha in args.alpha:
        measured = run(args.config, args.seed, args.rho, alpha, args.every, args.epochs)
        for position, rows in sorted(measured.records.items()):
            medians = [statistics.median(r[i] for r in rows) for i in range(4)]
            print(f"{alpha:>6}{position:>10}" + "".join(f"{m:>{w}.3f}" for m, w in zip(medians, (14, 13, 8, 19))))


if __name__ == "__main__":
    main()
