"""BMA time per test batch: samples batched with vmap, and the automatic choice, against the per-sample loop.

For each model, M weight samples (the model's weights with random relative perturbations; BatchNorm
statistics kept) are evaluated on one test batch by the three paths of
:func:`flatbma.predict.bma_log_probs` — ``batched=False`` (loop), ``batched=True`` (vmap, automatic
chunk size) and ``batched=None`` (automatic choice) — in interleaved rounds (so drift of the machine
affects all alike). Reported: the median loop time per batch and the speedups ``loop / path``
(> 1 means faster than the loop), the path the automatic choice took, and the largest difference
between the loop's and vmap's log-probabilities.

    python bench/bma.py [--rounds 5] [--threads 2] [--samples 30] [--cases cnn mobilenet_v2 ...]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch

from flatbma.models import build_model
from flatbma.predict import bma_log_probs, sample_log_probs

predict_module = importlib.import_module("flatbma.predict")  # the package re-exports a function named predict

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
    """Median seconds per test batch of every path, the automatic path's choice and the loop/vmap gap."""
    model = build_model(**kwargs, seed=0).to(device).eval()
    samples = [{k: v.to(device) for k, v in w.items()} for w in perturbed_samples(model, num_samples)]
    x = torch.randn(batch_size, *shape, generator=torch.Generator().manual_seed(1)).to(device)
    gap = sample_log_probs(model, samples, x, batched=True) - sample_log_probs(model, samples, x, batched=False)
    chosen = []
    real = predict_module._batched_log_probs

    def spy(*args):
        chosen.append(args[-1])
        return real(*args)

    predict_module._batched_log_probs = spy
    try:
        bma_log_probs(model, samples, x)  # warm-up of the automatic path, records its choice
    finally:
        predict_module._batched_log_probs = real
    auto = f"vmap, chunk {chosen[0]}" if chosen else "loop"
    for batched in PATHS.values():  # warm-up
        bma_log_probs(model, samples, x, batched=batched)
    times: dict[str, list[float]] = {name: [] for name in PATHS}
    for _ in range(rounds):
        for name, batched in PATHS.items():
            _sync(device)
            t0 = time.perf_counter()
            bma_log_probs(model, samples, x, batched=batched)
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {
        "median": {name: statistics.median(t) for name, t in times.items()},
        "auto": auto,
        "gap": gap.abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--samples", type=int, default=30, help="M, the number of posterior samples")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__} "
        f"M={args.samples} rounds={args.rounds}"
    )
    print(f"{'model':<42}{'loop ms':>10}{'vmap':>11}{'auto':>11}  {'auto chose':<16}{'max |diff|':>11}")
    for case in args.cases:
        label, kwargs, batch_size, shape = CASES[case]
        r = bench_case(kwargs, batch_size, shape, args.samples, args.rounds, args.device)
        t = r["median"]
        print(
            f"{label + f' (batch {batch_size})':<42}{t['loop'] * 1e3:>10.1f}"
            f"{t['loop'] / t['vmap']:>10.2f}x{t['loop'] / t['auto']:>10.2f}x  {r['auto']:<16}{r['gap']:>11.1e}",
            flush=True,
        )
    print("vmap, auto: speedup = loop time / path time per test batch (> 1: faster than the per-sample loop)")


if __name__ == "__main__":
    main()
