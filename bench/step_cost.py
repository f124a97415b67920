"""Cost of one sharpness-aware step relative to one SGD step, measured side by side in one run.

For each model the methods are timed in interleaved rounds on the same batch (so drift of the
machine affects all alike) and the median step time is reported as a ratio to SGD's.
Goal: SAM, ASAM, FSAM <= 2.1x an SGD step (two forward/backward passes are the floor).

    python bench/step_cost.py [--rounds 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flatbma.models import build_model
from flatbma.optim import ASAM, SAM, SGD, FisherSAM
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import point

METHODS = {"sgd": None, "sam": SAM(0.05), "asam": ASAM(0.5), "fsam": FisherSAM(0.1)}
CASES = {
    # name: (model kwargs, batch size, image shape)
    "cnn 28x28": (dict(name="cnn", num_classes=10, in_channels=1, image_size=28), 64, (1, 28, 28)),
    "mobilenet_v2 64x64 (transfer)": (
        dict(name="mobilenet_v2", num_classes=10, in_channels=3, image_size=64),
        32,
        (3, 64, 64),
    ),
}


def bench_case(model_kwargs: dict, batch_size: int, shape: tuple, rounds: int, device: str) -> dict[str, float]:
    """Median seconds per step for every method on one model and batch."""
    model = build_model(**model_kwargs, seed=0).to(device).train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, *shape, generator=g).to(device)
    y = torch.randint(0, model_kwargs["num_classes"], (batch_size,), generator=g).to(device)
    objective = Objective(model=model)
    runs = {}
    for name, ascent in METHODS.items():
        method = point.build(objective, SGD(lr=1e-3, momentum=0.9, weight_decay=5e-4), ascent)
        state = method.init(trainable_params(model), model_buffers(model))
        for _ in range(3):  # warm-up
            state, _ = method.update(state, (x, y))
        runs[name] = [method, state, []]
    for _ in range(rounds):
        for entry in runs.values():
            method, state, times = entry
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            state, out = method.update(state, (x, y))
            float(out.loss)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            entry[1] = state
    return {name: statistics.median(entry[2]) for name, entry in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__} rounds={args.rounds}")
    print(f"{'model':<32}{'sgd ms':>10}" + "".join(f"{m + '/sgd':>12}" for m in METHODS if m != "sgd"))
    for case, (kwargs, bs, shape) in CASES.items():
        t = bench_case(kwargs, bs, shape, args.rounds, args.device)
        ratios = "".join(f"{t[m] / t['sgd']:>11.2f}x" for m in METHODS if m != "sgd")
        print(f"{case + f' (batch {bs})':<32}{t['sgd'] * 1e3:>10.1f}{ratios}")


if __name__ == "__main__":
    main()
