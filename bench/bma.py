"""BMA time per test batch: the per-sample loop, samples batched with vmap, and the automatic choice.

For each model, M weight samples (the model's weights with random relative perturbations; BatchNorm
statistics kept) are evaluated on one test batch by the three paths of
:func:`flatbma.predict.bma_log_probs` — ``batched=False`` (loop), ``batched=True`` (vmap, automatic
chunk size) and ``batched=None`` (auto) — in interleaved rounds, so that drift of the machine
affects all alike, their order rotated each round (auto, when it takes the loop, would otherwise always
run right after vmap, with caches that vmap's larger working set left cold). The first auto call
makes the choice (the agreement check and, where the paths agree bit for bit, the timed probe); its
time is reported as "1st auto" and is not in the rounds.

Reported per case: the median time per batch of each path; ``auto/best``, the median over rounds of
``best / auto`` within a round, ``best`` the path with the lower median (paired, so that drift moves
both alike; the goal is ≥ 0.95, 1 = as fast as the faster path); the path auto took and what decided
it (``probe``: the paths agree bit for bit and the faster one was timed; ``rule``: they differ, so
the footprint rule decides); and the largest difference between the loop's and vmap's
log-probabilities (0 = bit-identical). The load average is printed before and after: the machine
may be shared.

    python bench/bma.py [--rounds 11] [--threads 1] [--samples 30] [--cases cnn mobilenet_v2 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from flatbma import batching
from flatbma.models import build_model
from flatbma.predict import bma_log_probs, sample_log_probs

CASES = {
    # name: (label, build_model kwargs, test batch size, image shape)
    "cnn": ("cnn 28x28", dict(name="cnn", num_classes=10, in_channels=1, image_size=28), 256, (1, 28, 28)),
    "mobilenet_v2": (
        "mobilenet_v2 64x64 (transfer)",
        dict(name="mobilenet_v2", num_classes=10, in_channels=3, image_size=64, pretrained="imagenet"),
        32,
        (3, 64, 64),
    ),
    "mlp": ("mlp digits 8x8", dict(name="mlp", num_classes=10, in_channels=1, image_size=8), 256, (1, 8, 8)),
    "resnet18_digits": (
        "resnet18 width 8, digits 8x8",
        dict(name="resnet18", num_classes=10, in_channels=1, image_size=8, width=8),
        32,
        (1, 8, 8),
    ),
    "cnn_small_batch": (
        "cnn 28x28 width 8",
        dict(name="cnn", num_classes=10, in_channels=1, image_size=28, width=8),
        16,
        (1, 28, 28),
    ),
}
PATHS = {"loop": False, "vmap": True, "auto": None}


def perturbed_samples(model: torch.nn.Module, num: int, scale: float = 0.02) -> list[dict[str, torch.Tensor]]:
    """``num`` weight dicts ``w·(1 + scale·ε)`` with the model's buffers (so BatchNorm stays valid)."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(num):
        w = {k: v.detach() * (1 + scale * torch.randn(v.shape, generator=g)) for k, v in model.named_parameters()}
        w.update({k: v.detach().clone() for k, v in model.named_buffers()})
        samples.append(w)
    return samples


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def bench_case(kwargs: dict, batch_size: int, shape: tuple, num_samples: int, rounds: int, device: str) -> dict:
    """Median seconds per test batch of every path, the faster path, auto's paired ratio to it, auto's choice."""
    model = build_model(**kwargs, seed=0).to(device).eval()
    samples = [{k: v.to(device) for k, v in w.items()} for w in perturbed_samples(model, num_samples)]
    x = torch.randn(batch_size, *shape, generator=torch.Generator().manual_seed(1)).to(device)
    loop = sample_log_probs(model, samples, x, batched=False)  # warm-up of the forced paths, and their gap
    vmap = sample_log_probs(model, samples, x, batched=True)
    _sync(device)
    t0 = time.perf_counter()
    bma_log_probs(model, samples, x)  # the first automatic call chooses
    _sync(device)
    first = time.perf_counter() - t0
    choice = batching.decision(model, samples, x)
    times: dict[str, list[float]] = {name: [] for name in PATHS}
    paths = list(PATHS.items())
    for r in range(rounds):  # the order rotates, so that no path always runs right after the same other one
        for name, batched in paths[r % len(paths) :] + paths[: r % len(paths)]:
            _sync(device)
            t0 = time.perf_counter()
            bma_log_probs(model, samples, x, batched=batched)
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(t) for name, t in times.items()}
    best = min(("loop", "vmap"), key=median.__getitem__)
    return {
        "median": median,
        "best": best,
        "auto_vs_fastest": statistics.median(b / a for b, a in zip(times[best], times["auto"], strict=True)),
        "first_auto": first,
        "choice": choice,
        "gap": (vmap - loop).abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--samples", type=int, default=30, help="M, the number of posterior samples")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__} "
        f"M={args.samples} rounds={args.rounds} load average (1, 5, 15 min) {_load()}"
    )
    print(
        f"{'model':<42}{'loop ms':>9}{'vmap ms':>9}{'auto ms':>9}{'auto/best':>10}  {'auto chose':<20}"
        f"{'1st auto ms':>12}{'max |diff|':>11}"
    )
    for case in args.cases:
        label, kwargs, batch_size, shape = CASES[case]
        r = bench_case(kwargs, batch_size, shape, args.samples, args.rounds, args.device)
        t, choice = r["median"], r["choice"]
        chose = f"{'vmap' if choice.batched else 'loop'} ({choice.by})"
        print(
            f"{label + f' (batch {batch_size})':<42}{t['loop'] * 1e3:>9.1f}{t['vmap'] * 1e3:>9.1f}"
            f"{t['auto'] * 1e3:>9.1f}{r['auto_vs_fastest']:>9.2f}x  {chose:<20}{r['first_auto'] * 1e3:>12.1f}"
            f"{r['gap']:>11.1e}",
            flush=True,
        )
    print(f"load average after: {_load()}")
    print("auto/best: median over rounds of (faster path's time) / (auto's time) in the same round (goal >= 0.95)")


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


if __name__ == "__main__":
    main()
