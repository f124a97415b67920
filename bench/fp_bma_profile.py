"""Where an FP-BMA step's time goes on a fully trainable model: the shares of its parts, by cProfile.

    python bench/fp_bma_profile.py [--case "cnn 28x28"] [--batch 32] [--steps 20] [--threads 1]

Builds ``bench/step_cost.py``'s fully trainable case with the registry's ``fp-bma`` (default options), ``sgd``, ``sam``
and ``lowrank-vi`` (Adam, as step_cost), times each (median ms of ``--steps`` updates after two warm-up steps), then
runs ``--steps`` FP-BMA updates under :mod:`cProfile` and prints the cumulative time per step of each part of
the step (the two passes, the natural gradient and its pieces, the step-size record, the sampler, pullback, KL
gradient and Adam) and its share of the profiled step. A diagnostic: cProfile adds a per-call overhead that
inflates the Python-heavy parts, so read shares, not absolute times (bench/step_cost.py measures those).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from step_cost import TRAINABLE

from flatbma.methods import parse_method
from flatbma.models import build_model
from flatbma.optim import SGD, Adam
from flatbma.params import Objective, model_buffers, trainable_params

PARTS = [
    # (label, function name, file suffix)
    ("step (update)", "update", "posteriors/gaussian_vi.py"),
    ("two passes: forward + backward", "sharpness_aware_value_and_grad", "optim/ascent.py"),
    ("sampler (noise)", "noise", "posteriors/lowrank_vi.py"),
    ("sampler (reparameterize, x2)", "reparameterize", "posteriors/lowrank_vi.py"),
    ("pullback (x2)", "pullback", "posteriors/lowrank_vi.py"),
    ("ascent: perturb", "perturb", "optim/fisher_ball.py"),
    ("  natural gradient", "natural_gradient", "optim/fisher_ball.py"),
    ("    geometry (float64)", "_geometry", "gaussian/geometry.py"),
    ("    float32_error", "float32_error", "optim/fisher_ball.py"),
    ("    rotation projection", "_rotation", "optim/fisher_ball.py"),
    ("    CG solve", "solve_covariance_fisher", "optim/fisher_ball.py"),
    ("      preconditioner: build", "_preconditioner", "optim/fisher_ball.py"),
    ("      preconditioner: apply", "__call__", "optim/fisher_ball.py"),
    ("      Fisher products", "whitened_fisher_product", "optim/fisher_ball.py"),
    ("      dots (_dot)", "_dot", "optim/fisher_ball.py"),
    ("  quadratic-regime check", "_leaves_quadratic_regime", "optim/fisher_ball.py"),
    ("  trust region", "_trust_region", "optim/fisher_ball.py"),
    ("step-size record", "step_size", "gaussian/density.py"),
    ("KL gradient", "kl_grad", "posteriors/lowrank_vi.py"),
    ("optimizer (Adam apply)", "apply", "optim/sgd.py"),
]
SHARED = [("noise", "posteriors/lowrank_vi.py"), ("kl_grad", "posteriors/lowrank_vi.py"), ("apply", "optim/sgd.py")]
"""The parts of a low-rank VI step that FP-BMA takes once, not once per pass."""


def build(case: str, batch: int):
    kwargs, shape = TRAINABLE[case]
    model = build_model(**kwargs, seed=0).train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *shape, generator=g)
    y = torch.randint(0, kwargs["num_classes"], (batch,), generator=g)
    objective = Objective(model=model, num_data=1000)
    params, buffers = trainable_params(model), model_buffers(model)
    methods = {
        "sgd": parse_method("sgd").build(objective, SGD(lr=1e-3, momentum=0.9, weight_decay=5e-4)),
        "sam": parse_method("sam").build(objective, SGD(lr=1e-3, momentum=0.9, weight_decay=5e-4)),
        "lowrank-vi": parse_method({"name": "lowrank-vi", "rank": 5}).build(objective, Adam(lr=1e-3)),
        "fp-bma": parse_method("fp-bma").build(objective, Adam(lr=1e-3)),
    }
    return methods, params, buffers, (x, y)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="cnn 28x28", choices=list(TRAINABLE))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    methods, params, buffers, batch = build(args.case, args.batch)
    states = {name: m.init(params, buffers) for name, m in methods.items()}

    def step(name: str) -> float:
        t0 = time.perf_counter()
        states[name], out = methods[name].update(states[name], batch)
        float(out.loss)
        return time.perf_counter() - t0

    for name in methods:
        step(name)
        step(name)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.steps):  # interleaved, so that a load change hits every method alike
        for name in methods:
            times[name].append(step(name))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    d = sum(v.numel() for v in params.values())
    print(f"{args.case} (d = {d}), batch {args.batch}, {args.threads} thread(s), median of {args.steps} steps:")
    print("  " + ", ".join(f"{n} {v:.2f} ms" for n, v in ms.items()))
    print(
        f"  fp-bma/sam {ms['fp-bma'] / ms['sam']:.3f}, lowrank-vi/sgd {ms['lowrank-vi'] / ms['sgd']:.3f}, "
        f"sam/sgd {ms['sam'] / ms['sgd']:.3f}"
    )
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        step("fp-bma")
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    cumulative: dict[tuple[str, str], float] = {}
    for (filename, _, func), (_, _, _, ct, _) in stats.items():
        for _, name, suffix in PARTS:
            if func == name and filename.endswith(suffix):
                cumulative[name, suffix] = cumulative.get((name, suffix), 0.0) + ct
    total = cumulative.get(("update", "posteriors/gaussian_vi.py"), float("nan"))
    print(f"\n{'part of the FP-BMA step (cProfile, cumulative)':<48}{'ms/step':>10}{'share':>9}")
    for label, name, suffix in PARTS:
        t = cumulative.get((name, suffix), 0.0)
        print(f"{label:<48}{t / args.steps * 1e3:>10.2f}{t / total:>9.1%}")
    # FP-BMA with a free ascent: two low-rank VI steps that share the noise draw, the KL gradient and Adam
    once = sum(cumulative.get(key, 0.0) for key in SHARED) / total * ms["fp-bma"]  # in unprofiled ms
    floor = (2 * ms["lowrank-vi"] - once) / ms["sam"]
    print(
        f"floor of FP-BMA/SAM (a free ascent): (2·lowrank-vi − noise, KL gradient, Adam)/sam = "
        f"(2·{ms['lowrank-vi']:.2f} − {once:.2f})/{ms['sam']:.2f} = {floor:.3f}"
    )


if __name__ == "__main__":
    main()
