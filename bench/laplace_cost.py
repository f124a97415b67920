"""Cost of the curvature pass of every Hessian structure on the transfer model, side by side in one run.

The transfer model of the demo: MobileNetV2 at 48×48 with 10 classes, only its normalization layers and
classifier trainable (``norm+classifier``, d = 46,922; ``classifier``: d = 12,810). The weights are a
seeded random initialization (the cost does not depend on them; pretrained weights are not needed). For
``--n`` synthetic images in batches of ``--batch-size`` the script times, per structure
(:func:`flatbma.curvature.estimator`):

* ``pass``: the curvature pass, ``accumulate`` over every batch (model in eval mode), after one warm-up
  call on one image;
* ``/fwd+bwd``: that time over the time of one forward + backward of the same batches (the gradient pass
  every training step pays), measured in the same round: the median over ``--rounds`` interleaved rounds
  of the paired ratio, so a machine that slows down moves both alike;
* ``blocks``: the eigendecomposition ``Estimator.blocks`` (float64), ``δ``: :func:`optimize_prior` (scalar);
* ``stored``: the accumulators' size (what a checkpoint holds);
* ``peak``: the extra resident memory at the peak of one pass, measured in a fresh subprocess (the kernel's
  peak-RSS counter reset through ``/proc/self/clear_refs``; ``ru_maxrss``, an upper bound, where that is
  not available), as in ``bench/hessian.py``. ``--no-memory`` skips it.

    python bench/laplace_cost.py [--n 40] [--batch-size 20] [--rounds 1] [--threads 2] [--no-memory]
    python bench/laplace_cost.py --n 100 --batch-size 25      # the design's 10-shot task (several minutes)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from _memory import peak_mib
from torch.func import functional_call

from flatbma.bn import eval_mode
from flatbma.curvature import estimator, optimize_prior
from flatbma.models import build_model
from flatbma.params import model_buffers, trainable_params
from flatbma.transfer import restrict_trainable, subset_names

NUM_CLASSES = 10


@dataclass(frozen=True)
class Row:
    hessian: str
    curvature: str
    subset: str
    full_limit: str = ""  # "dual": max_full = n·K (the dual rows); "" : the default


ROWS = {
    "diag ggn": Row("diag", "ggn", "norm+classifier"),
    "diag ef": Row("diag", "ef", "norm+classifier"),
    "kfac ggn": Row("kfac", "ggn", "norm+classifier"),
    "kfac ef": Row("kfac", "ef", "norm+classifier"),
    "full ggn (dual)": Row("full", "ggn", "norm+classifier", "dual"),
    "full ggn, classifier": Row("full", "ggn", "classifier", "dual"),
}


def setup(subset: str, n: int, image_size: int, batch_size: int):
    """Model with ``subset`` trainable, its parameters and buffers, and ``n`` images in batches."""
    model = build_model("mobilenet_v2", num_classes=NUM_CLASSES, in_channels=3, image_size=image_size, seed=0)
    restrict_trainable(model, subset_names(model, subset))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, image_size, image_size, generator=g)
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, n, batch_size)]
    return model, trainable_params(model), model_buffers(model), batches


def make_estimator(row: Row, model, params, n: int):
    k = NUM_CLASSES if row.curvature == "ggn" else 1
    max_full = n * k if row.full_limit == "dual" else 4096
    return estimator(row.hessian, row.curvature, model, params, num_data=n, num_classes=NUM_CLASSES, max_full=max_full)


def curvature_pass(est, params, buffers, batches):
    acc, offset = est.init(), 0
    for x, y in batches:
        acc = est.accumulate(acc, params, buffers, x, y, offset=offset)
        offset += len(y)
    return acc


def gradient_pass(model, params, buffers, batches) -> None:
    """One forward + backward per batch in eval mode: the reference cost."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    with eval_mode(model):
        for x, y in batches:
            loss = F.cross_entropy(functional_call(model, {**buffers, **leaves}, (x,)), y)
            torch.autograd.grad(loss, list(leaves.values()))


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# -- memory (subprocess; bench/_memory.py) -----------------------------------------------------------


def measure_memory(args) -> None:
    """Child process: one curvature pass of row ``args.measure``; prints ``{"mib": ..., "method": ...}``."""
    row = ROWS[args.measure]
    model, params, buffers, batches = setup(row.subset, args.n, args.image_size, args.batch_size)
    est = make_estimator(row, model, params, args.n)
    gc.collect()
    mib, method = peak_mib(lambda: curvature_pass(est, params, buffers, batches))
    print(json.dumps({"mib": mib, "method": method}))


def memory_of(args, name: str) -> tuple[float, str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", name]
    cmd += ["--n", str(args.n), "--batch-size", str(args.batch_size), "--image-size", str(args.image_size)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    result = json.loads(out)
    return result["mib"], result["method"]


# -- main -----------------------------------------------------------------------------------------


def bench(args) -> dict[str, dict]:
    """Per row: pass times and paired ratios over rounds, blocks and δ times, stored bytes, description."""
    cases = {}
    for subset in sorted({row.subset for row in ROWS.values() if row_selected(args, row)}):
        cases[subset] = setup(subset, args.n, args.image_size, args.batch_size)
    results: dict[str, dict] = {}
    for name, row in ROWS.items():
        if not row_selected(args, row):
            continue
        model, params, *_ = cases[row.subset]
        est = make_estimator(row, model, params, args.n)
        results[name] = {"est": est, "pass": [], "ratio": [], "d": est.dim}
        _, params, buffers, batches = cases[row.subset]
        x, y = batches[0]
        est.accumulate(est.init(), params, buffers, x[:1], y[:1], offset=0)  # warm-up (functorch's first call)
    for _ in range(args.rounds):
        for name, result in results.items():
            model, params, buffers, batches = cases[ROWS[name].subset]
            base, _ = timed(lambda: gradient_pass(model, params, buffers, batches))  # noqa: B023
            seconds, acc = timed(lambda: curvature_pass(result["est"], params, buffers, batches))  # noqa: B023
            result["pass"].append(seconds)
            result["ratio"].append(seconds / base)
            result["acc"] = acc
    for name, result in results.items():
        est, acc = result.pop("est"), result.pop("acc")
        params = cases[ROWS[name].subset][1]
        result["blocks"], blocks = timed(lambda: est.blocks(acc, args.n, args.n))  # noqa: B023
        result["delta"], deltas = timed(lambda: optimize_prior(blocks, params, 1.0, "scalar"))  # noqa: B023
        result["prior"] = next(iter(deltas.values()))
        result["stored"] = sum(v.numel() * v.element_size() for v in acc.values())
        result["describe"] = est.describe()
    return results


def row_selected(args, row: Row) -> bool:
    return not args.rows or any(ROWS[r] == row for r in args.rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=40, help="training images in the pass")
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--image-size", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=None, help="only these rows")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--measure", choices=list(ROWS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure:
        measure_memory(args)
        return
    print(
        f"mobilenet_v2 {args.image_size}x{args.image_size}, {NUM_CLASSES} classes, n = {args.n} images in batches of "
        f"{args.batch_size}, threads={torch.get_num_threads()} torch={torch.__version__} rounds={args.rounds}"
    )
    results = bench(args)
    memory = {} if args.no_memory else {name: memory_of(args, name) for name in results}
    head = f"{'structure':<22}{'d':>8}{'pass s':>9}{'/fwd+bwd':>10}{'blocks s':>10}{'δ s':>8}{'stored MB':>11}"
    print(head + ("" if args.no_memory else f"{'peak MiB':>10}") + f"{'δ*':>11}")
    for name, r in results.items():
        line = (
            f"{name:<22}{r['d']:>8}{statistics.median(r['pass']):>9.2f}{statistics.median(r['ratio']):>9.1f}x"
            f"{r['blocks']:>10.2f}{r['delta']:>8.3f}{r['stored'] / 1e6:>11.2f}"
        )
        if not args.no_memory:
            line += f"{memory[name][0]:>10.0f}"
        print(line + f"{r['prior']:>11.4g}")
    print()
    for name, r in results.items():
        print(f"  {name}: {r['describe']}")
    if memory:
        print(f"  peak: {next(iter(memory.values()))[1]}, extra resident memory of one pass in a fresh process")


if __name__ == "__main__":
    main()
