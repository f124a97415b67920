"""Top-5 Hessian eigenvalues: flatbma (Lanczos) against PyHessian (power iteration with deflation).

Same model, same batch, same eval-mode loss. For each case the script

1. builds the model, draws one synthetic batch and trains a few SGD steps on it (so that the
   Hessian has the outliers of a trained network rather than the flat spectrum of an initialization);
2. computes a reference top-k in float64 (flatbma Lanczos on a float64 copy of the model, residual
   tolerance 1e-10, unbounded basis, one gradient graph) — the ground truth both tools are compared with;
3. times, interleaved over ``--repeats`` rounds (so that the load of a shared machine affects all
   alike), ``flatbma.flatness.hessian_eigenvalues(model, (x, y), k, tol=--tol)`` and
   ``pyhessian.hessian(model, criterion, data=(x, y), cuda=False).eigenvalues(top_n=k, tol=...)``
   with PyHessian's default ``tol`` (1e-3) and with ``--pyhessian-tight-tol``; each call includes the
   construction of the operator (PyHessian's first gradient graph, ours); flatbma runs with its
   defaults (a basis of ``default_basis_size(k)`` Lanczos vectors with thick restarts, gradient graphs
   of at most ``CPU_CHUNK_SIZE`` examples on CPU);
4. measures peak memory of one call of each in a fresh subprocess (below);
5. prints a table: Hessian-vector products, median wall time, speed-up of flatbma, peak memory and
   the largest relative error of the top-k against the float64 reference and against PyHessian.

Memory. ``tracemalloc`` only sees allocations made through Python's allocator; tensor storage comes
from c10's CPU allocator (malloc/posix_memalign), so tracemalloc reports next to nothing for torch
work and is not used. ``getrusage(...).ru_maxrss`` is the high-water mark of the whole process,
including the interpreter, the torch libraries and whatever transient peak the setup reached, so on
its own it cannot isolate one call. Instead each measurement runs in a fresh subprocess that sets the
case up, returns the heap that the set-up freed to the kernel (glibc's ``malloc_trim(0)``: without it
the set-up's freed memory stays resident in varying amounts, which moved the baseline by up to 20 MiB
between identical runs and hid that much of the call's allocations), resets the kernel's peak-RSS
counter (``echo 5 > /proc/self/clear_refs``, Linux ≥ 4.0), reads the current RSS, runs the call once,
and reports ``VmHWM − RSS_before``: the extra resident memory at the peak of that call. Where
``clear_refs`` is not available the script falls back to ``ru_maxrss − RSS_before`` (an upper bound)
and says so (bench/_memory.py). On CUDA it reports
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (the tensors' own peak).

    pip install --no-deps pyhessian   # bench-only dependency
    python bench/hessian.py [--resnet] [--batch-size 32] [--repeats 3] [--threads 1]

``--transfer`` runs a different case instead (no PyHessian needed): **λ₁ of 8 posterior samples on the
transfer model** of the demo (``configs/demo.yaml``: ImageNet MobileNetV2 at 48×48, ``norm+classifier``
trainable, 10-shot animal-mnist, every training image un-augmented in one batch). It trains the demo's
SWAG (~10 s), draws 8 samples with recomputed BatchNorm statistics and prints the time of one
Hessian-vector product (with the lean second-order graph of :mod:`flatbma.flatness.hvp` — frozen
convolutions without weight gradients, eval-mode BatchNorm as an affine map — and with PyTorch's own
double backward, interleaved), of λ₁ of the 8 samples (Lanczos to
``eval.hessian_tol``), and of each part of the full flatness protocol of one method
(:func:`flatbma.experiment.run.evaluate.flatness_metrics` with the default ``eval`` settings)::

    python bench/hessian.py --transfer [--threads 2] [--lambda1-only]

``--lambda1-only`` stops after λ₁ of the 8 samples (what ``scripts/gpu-check.sh`` records, with the peak GPU
memory of that measurement on CUDA). The run's device is the demo's ``train.device`` (``auto``: CUDA when
there is a GPU).
"""

from __future__ import annotations

import argparse
import copy
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

from flatbma.flatness import default_basis_size, hessian_eigenvalues, hvp_fn, lanczos
from flatbma.models import build_model

PYHESSIAN_DEFAULT_TOL = 1e-3
PYHESSIAN_MAX_ITER = 100  # PyHessian's default per eigenvalue


@dataclass(frozen=True)
class Case:
    name: str
    model_kwargs: dict


CASES = {
    "cnn": Case("cnn 28x28", dict(name="cnn", num_classes=10, in_channels=1, image_size=28)),
    "resnet18": Case(
        "resnet18 w16 28x28", dict(name="resnet18", num_classes=10, in_channels=1, image_size=28, width=16)
    ),
}


def pyhessian_module():
    """PyHessian's ``hessian`` module, or ``None`` when it is not installed."""
    try:
        import pyhessian  # noqa: F401
    except ImportError:
        return None
    return sys.modules["pyhessian.hessian"]


def setup(case: Case, batch_size: int, train_steps: int, device: str):
    """Model (eval mode) and batch at a point reached by ``train_steps`` SGD steps on that batch."""
    model = build_model(**case.model_kwargs, seed=0).to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 1, 28, 28, generator=g).to(device)
    y = torch.randint(0, 10, (batch_size,), generator=g).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for _ in range(train_steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return model.eval(), (x, y)


def run_flatbma(model, batch, k: int, tol: float, hvp: str) -> torch.Tensor:
    return hessian_eigenvalues(model, batch, k=k, tol=tol, hvp=hvp)


def run_pyhessian(model, batch, k: int, tol: float) -> torch.Tensor:
    ph = pyhessian_module()
    model = copy.deepcopy(model)  # PyHessian leaves graphs in .grad; keep the shared model clean
    torch.manual_seed(0)
    h = ph.hessian(model, torch.nn.CrossEntropyLoss(), data=batch, cuda=batch[0].is_cuda)
    values, _ = h.eigenvalues(maxIter=PYHESSIAN_MAX_ITER, tol=tol, top_n=k)
    return torch.tensor(values, dtype=torch.float64)


def count_products(tool: str, model, batch, k: int, tol: float, hvp: str) -> int:
    """Hessian-vector products one call makes (an untimed, identical call)."""
    if tool == "flatbma":
        op = hvp_fn(model, batch, hvp=hvp)
        res = lanczos(
            op,
            op.dim,
            k,
            tol=tol,
            max_iter=100,
            eps=op.eps,
            generator=torch.Generator().manual_seed(0),
            dtype=op.dtype,
            basis_size=default_basis_size(k),
            vectors=False,
        )
        return res.num_matvecs
    ph = pyhessian_module()
    original, count = ph.hessian_vector_product, [0]

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    ph.hessian_vector_product = counting
    try:
        run_pyhessian(model, batch, k, tol)
    finally:
        ph.hessian_vector_product = original
    return count[0]


def reference(model, batch, k: int) -> torch.Tensor:
    md = copy.deepcopy(model).double()
    x, y = batch
    # unbounded basis and one graph: the reference does not depend on the memory-saving defaults
    return hessian_eigenvalues(md, (x.double(), y), k=k, tol=1e-10, max_iter=300, basis_size=None, chunk_size=None)


# -- memory (subprocess) ------------------------------------------------------------------------


def measure_memory(args) -> None:
    """Child process: one call of one tool; prints ``{"mib": ..., "method": ...}``."""
    torch.set_num_threads(args.threads or torch.get_num_threads())
    model, batch = setup(CASES[args.case], args.batch_size, args.train_steps, args.device)
    tool, tol = args.measure.split(":")
    call = {
        "flatbma": lambda: run_flatbma(model, batch, args.k, float(tol), args.hvp),
        "pyhessian": lambda: run_pyhessian(model, batch, args.k, float(tol)),
    }[tool]
    gc.collect()
    if args.device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        call()
        torch.cuda.synchronize()
        print(json.dumps({"mib": (torch.cuda.max_memory_allocated() - base) / 2**20, "method": "cuda peak"}))
        return
    mib, method = peak_mib(call)
    print(json.dumps({"mib": mib, "method": method}))


def memory_of(args, case: str, tool: str, tol: float) -> tuple[float, str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", f"{tool}:{tol}", "--case", case]
    for key in ("batch_size", "train_steps", "k", "threads", "device", "hvp"):
        value = getattr(args, key)
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    result = json.loads(out)
    return result["mib"], result["method"]


# -- main -----------------------------------------------------------------------------------------


def bench_case(args, case_key: str) -> None:
    case = CASES[case_key]
    model, batch = setup(case, args.batch_size, args.train_steps, args.device)
    d = sum(p.numel() for p in model.parameters())
    ref = reference(model, batch, args.k)
    rows = [(f"flatbma lanczos {tol:.0e}", "flatbma", tol) for tol in args.tol] + [
        ("pyhessian (default tol)", "pyhessian", PYHESSIAN_DEFAULT_TOL),
        ("pyhessian (tight tol)", "pyhessian", args.pyhessian_tight_tol),
    ]
    calls = {
        label: (
            (lambda tol=tol: run_flatbma(model, batch, args.k, tol, args.hvp))
            if tool == "flatbma"
            else (lambda tol=tol: run_pyhessian(model, batch, args.k, tol))
        )
        for label, tool, tol in rows
    }
    times: dict[str, list[float]] = {label: [] for label in calls}
    values = {}
    for label, fn in calls.items():  # warm-up (lazy initialization), also gives the eigenvalues
        values[label] = fn().cpu()
    for _ in range(args.repeats):
        for label, fn in calls.items():
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if args.device == "cuda":
                torch.cuda.synchronize()
            times[label].append(time.perf_counter() - t0)
    med = {label: statistics.median(t) for label, t in times.items()}
    ref = ref.cpu()
    print(
        f"\n{case.name}: d = {d:,} parameters, batch {args.batch_size}, top-{args.k}, "
        f"{args.train_steps} SGD steps on the batch first"
    )
    print("  float64 reference: " + ", ".join(f"{v:.6g}" for v in ref.tolist()))
    header = f"  {'tool':<26}{'tol':>8}{'HVPs':>6}{'time s':>9}{'time ratio':>12}{'peak MiB':>10}"
    print(header + f"{'rel.err vs ref':>16}{'rel.err vs first':>18}")
    first = rows[0][0]
    mem_method = ""
    for label, tool, tol in rows:
        n = count_products(tool, model, batch, args.k, tol, args.hvp)
        mib, mem_method = memory_of(args, case_key, tool, tol) if not args.no_memory else (float("nan"), "skipped")
        err_ref = _rel_err(values[label], ref)
        vs = "" if label == first else f"{_rel_err(values[first], values[label]):>18.1e}"
        ratio = med[label] / med[first]
        print(f"  {label:<26}{tol:>8.0e}{n:>6}{med[label]:>9.2f}{ratio:>11.2f}x{mib:>10.1f}{err_ref:>16.1e}{vs}")
    print(
        f"  time: median of {args.repeats} interleaved calls; time ratio: to '{first}'; memory: {mem_method}\n"
        f"  rel.err: max_i |a_i - b_i| / |b_i| over the top-{args.k}; 'vs first': '{first}' (a) against that row (b)"
    )


def bench_transfer(args) -> None:
    """λ₁ of 8 posterior samples on the demo's transfer model, and the full protocol of one method (module doc)."""
    import dataclasses
    import tempfile
    from pathlib import Path

    import yaml

    from flatbma.experiment.config.run_config import config_from_dict
    from flatbma.experiment.run import evaluate
    from flatbma.experiment.run.pipeline import train
    from flatbma.flatness import hvp as hvp_module

    root = Path(__file__).resolve().parents[1]
    raw = yaml.safe_load((root / "configs" / "demo.yaml").read_text())
    swag = next(m for m in raw.pop("compare")["methods"] if m["name"] == "swag")
    with tempfile.TemporaryDirectory() as out:
        raw.update(method=swag, output_dir=out, eval={"num_samples": 8})
        raw["train"]["progress"] = False
        cfg = config_from_dict(raw)
        t0 = time.perf_counter()
        trained = train(cfg, evaluate=False)
        print(f"trained the demo's SWAG in {time.perf_counter() - t0:.1f} s")
    exp, state = trained.experiment, trained.state
    e = exp.config.eval
    names = [n for n, p in exp.model.named_parameters() if p.requires_grad]
    data = list(exp.hessian_loader)
    n_images = sum(len(y) for _, y in data)
    with exp.rng.restored():
        samples = evaluate.posterior_samples(exp, state, 8)
    print(
        f"transfer model: d = {sum(exp.model.get_parameter(n).numel() for n in names):,} trained parameters, "
        f"{n_images} training images ({len(data)} batch(es)), k = {e.hessian_k}, tol = {e.hessian_tol:g}"
    )

    if args.lambda1_only:
        _lambda1_of_samples(exp, samples, data, names)
        return
    patches = (hvp_module._frozen_convolutions, hvp_module._eval_batch_norms)
    ops = {"lean second-order graph (default)": hvp_fn(exp.model, data, params=names, weights=samples[0])}
    hvp_module._frozen_convolutions = lambda model, point: []
    hvp_module._eval_batch_norms = lambda model: []
    try:
        ops["PyTorch's own double backward"] = hvp_fn(exp.model, data, params=names, weights=samples[0])
    finally:
        hvp_module._frozen_convolutions, hvp_module._eval_batch_norms = patches
    v = torch.randn(ops["lean second-order graph (default)"].dim)
    times: dict[str, list[float]] = {label: [] for label in ops}
    for _ in range(args.repeats + 1):
        for label, op in ops.items():
            t0 = time.perf_counter()
            op(v)
            times[label].append(time.perf_counter() - t0)
    for label, t in times.items():
        print(f"  one Hessian-vector product, {label}: median {statistics.median(t[1:]):.3f} s")

    _lambda1_of_samples(exp, samples, data, names)

    for label, changes in (
        ("λ₁ per sample + at the mean + sharpness + width", dict(trace=False, distribution_spectrum=False)),
        ("  + trace (4 probes per sample)", dict(trace=True, distribution_spectrum=False)),
        ("  + averaged-Hessian spectrum", dict(trace=True, distribution_spectrum=True)),
    ):
        exp = dataclasses.replace(exp, config=dataclasses.replace(exp.config, eval=dataclasses.replace(e, **changes)))
        with exp.rng.restored():
            t0 = time.perf_counter()
            report = evaluate.flatness_metrics(exp, state, samples)
            total = time.perf_counter() - t0
        repeat = report.get("repeatability_time_s", 0.0)
        interval = report["lambda1_summary"]["interval"]
        second = report["repeatability"]["second"]
        print(
            f"  full protocol, {label}: {total:.1f} s (of which repeatability {repeat:.1f} s), "
            f"{report['hessian_products']} products before the repeat; λ₁ = {report['lambda1']:.0f} "
            f"[{interval['low']:.0f}, {interval['high']:.0f}], at the mean {report['lambda1_at_mean']:.0f}, "
            f"repeat: {second['mean']:.0f} [{second['interval']['low']:.0f}, {second['interval']['high']:.0f}], "
            f"agrees: {report['repeatability']['agree']}"
        )


def _lambda1_of_samples(exp, samples, data, names) -> None:
    """Print the time (and on CUDA the peak memory) of λ₁ of the samples, as the flatness protocol measures it."""
    from flatbma.flatness import measure_samples

    e = exp.config.eval
    cuda = exp.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    measured = measure_samples(
        exp.model, samples, data, k=e.hessian_k, params=names, tol=e.hessian_tol, max_iter=e.hessian_max_iter
    )
    elapsed = time.perf_counter() - t0
    products = sum(m.products for m in measured)
    values = ", ".join(f"{float(m.eigen.eigenvalues[0]):.0f}" for m in measured)
    peak = f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB" if cuda else ""
    print(
        f"  λ₁ of {len(samples)} posterior samples on {exp.device.type}: {elapsed:.1f} s, {products} products "
        f"({elapsed / products:.3f} s per product, operator set-up included){peak}; λ₁ = {values}; "
        f"converged: {all(bool(m.eigen.converged_each[0]) for m in measured)}"
    )


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs()).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resnet", action="store_true", help="also run resnet18 width 16")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--train-steps", type=int, default=20)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument(
        "--tol", type=float, nargs="+", default=[1e-3], help="flatbma's residual tolerance(s), one row each"
    )
    parser.add_argument("--pyhessian-tight-tol", type=float, default=1e-4)
    parser.add_argument("--hvp", default="double_backward", choices=["double_backward", "func"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    parser.add_argument("--lambda1-only", action="store_true", help="--transfer: stop after λ₁ of the 8 samples")
    parser.add_argument(
        "--transfer", action="store_true", help="time λ₁ of 8 posterior samples on the demo's transfer model instead"
    )
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--case", default="cnn", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.transfer:
        if args.threads:
            torch.set_num_threads(args.threads)
        print(f"threads={torch.get_num_threads()} torch={torch.__version__}")
        bench_transfer(args)
        return
    if pyhessian_module() is None:
        print(
            "PyHessian is not installed: this benchmark compares against it.\n"
            "Install it with `pip install --no-deps pyhessian` (it needs only torch and numpy)."
        )
        sys.exit(0)
    if args.measure:
        measure_memory(args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__} "
        f"hvp={args.hvp} repeats={args.repeats}"
    )
    for case in ["cnn", "resnet18"] if args.resnet else ["cnn"]:
        bench_case(args, case)


if __name__ == "__main__":
    main()
