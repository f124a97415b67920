"""CUDA checks (``pytest -m cuda``), skipped where ``torch.cuda.is_available()`` is false.

What a GPU must agree on with the CPU: every registered method's first steps, the BMA's metrics, the
predictor and λ₁ (float32 tolerance); mixed precision on the GPU (bf16, fp16 with its loss scale);
checkpoints moving between the devices; NCCL's collectives giving gloo's numbers; and the host-device
synchronizations of a training step. ``scripts/gpu-check.sh`` runs them on a GPU machine.

The methods' noise is drawn from the generator of the device they train on, so a CPU and a GPU run of
a stochastic method are different draws; :func:`cpu_noise` makes both draw on the CPU, so that the
comparison sees the arithmetic alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flatbma.methods import METHODS
from flatbma.optim import LossScaled
from flatbma.optim.loss_scale import SCALE
from tests.helpers import relative_difference, tiny_bn_net, toy_batch, train_steps

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m cuda on a GPU machine)"),
]

ROOT = Path(__file__).resolve().parents[1]

FLOAT32_TOLERANCE = 1e-4
"""Largest ``‖s_cuda − s_cpu‖ / ‖s_cpu − s_0‖`` after two steps (:func:`tests.helpers.relative_difference`):
float32 arithmetic in another order (cuBLAS, cuDNN), TF32 off (PyTorch's default for matrix products)."""

BF16_TOLERANCE = 0.1
"""As ``tests/test_precision.py``'s: bf16 against fp32, both on the GPU."""


@pytest.fixture
def cpu_noise(monkeypatch):
    """Every random draw of the methods on the CPU's generators, moved to the device: the same numbers on both."""
    import flatbma.rng as rng
    from flatbma.posteriors import bsam, gaussian_vi, multi

    real_generator = rng.seeded_generator
    for module in (rng, bsam, gaussian_vi, multi):
        monkeypatch.setattr(module, "seeded_generator", lambda seed, stream, device="cpu": real_generator(seed, stream))
    real_randn = torch.randn
    monkeypatch.setattr(torch, "randn_like", lambda t, **kw: real_randn(t.shape, dtype=t.dtype).to(t.device))
    real_dropout = F.dropout

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return real_dropout(x, p, training, inplace)
        keep = (torch.rand(x.shape) >= p).to(x.device, x.dtype)
        return x * keep / (1 - p)

    monkeypatch.setattr(F, "dropout", dropout)


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_trains_two_steps_on_cuda_as_on_the_cpu(name, cpu_noise):
    start, cpu, _ = train_steps(name, steps=2)
    _, gpu, method = train_steps(name, steps=2, device="cuda")
    assert all(v.is_cuda for v in gpu.params.values())
    assert relative_difference(gpu.params, cpu.params, start) < FLOAT32_TOLERANCE
    for key, value in cpu.aux.items():  # the method state (moments, snapshots, curvature) too
        if value.is_floating_point():
            torch.testing.assert_close(gpu.aux[key].cpu(), value, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_trains_under_bf16_on_cuda(name, cpu_noise):
    """bf16 against fp32 on the GPU, the same noise in both (CUDA's fused dropout draws other masks in bf16)."""
    start, full, _ = train_steps(name, steps=2, device="cuda")
    _, half, _ = train_steps(name, steps=2, device="cuda", precision="bf16")
    assert relative_difference(half.params, full.params, start) < BF16_TOLERANCE


@pytest.mark.parametrize("name", ["sgd", "sam", "fp-bma", "swag", "lowrank-vi"])
def test_fp16_with_its_loss_scale_trains_on_cuda(name):
    start, full, _ = train_steps(name, steps=3, device="cuda")
    _, half, _ = train_steps(name, steps=3, device="cuda", precision="fp16", wrap=LossScaled())
    assert float(half.aux[SCALE]) == 2.0**16  # no overflow on this problem
    assert relative_difference(half.params, full.params, start) < BF16_TOLERANCE


def test_bma_metrics_predictor_and_lambda1_on_cuda_match_the_cpu():
    from torch.utils.data import DataLoader, TensorDataset

    from flatbma.flatness import hessian_eigenvalues
    from flatbma.predictor import BMA

    _, state, method = train_steps("swag", steps=6)  # samples with BatchNorm statistics recomputed
    x, y = toy_batch(n=96, in_features=6, classes=3, seed=3)
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    results = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = tiny_bn_net(in_features=6, classes=3)  # the train_steps template (its frozen parts: none)
        bma = BMA(model, method, state, loader, num_samples=4, seed=0, device=device)
        metrics = bma.evaluate(loader)
        probs = bma.predict_proba(x).cpu()
        sample = bma.samples[0]
        data = [(x.to(device), y.to(device))]
        lam = hessian_eigenvalues(bma.model, data, k=1, weights=sample, tol=1e-6, max_iter=200)
        half = BMA(model, method, state, loader, num_samples=4, seed=0, device=device, precision="bf16")
        results[device] = (metrics, probs, float(lam[0]), half.evaluate(loader))
    (m_cpu, p_cpu, l_cpu, h_cpu), (m_gpu, p_gpu, l_gpu, h_gpu) = results["cpu"], results["cuda"]
    for key in ("accuracy", "nll", "ece", "brier"):
        assert m_gpu[key] == pytest.approx(m_cpu[key], rel=1e-4, abs=1e-6), key
        assert h_gpu[key] == pytest.approx(h_cpu[key], rel=0.05, abs=0.02), key  # bf16 on both
        assert h_gpu[key] == pytest.approx(m_gpu[key], rel=0.05, abs=0.02), key  # bf16 BMA near fp32's
    torch.testing.assert_close(p_gpu, p_cpu, rtol=1e-4, atol=1e-6)
    assert l_gpu == pytest.approx(l_cpu, rel=1e-4)


DIGITS = {
    "seed": 0,
    "method": {"name": "sgd"},
    "data": {"name": "digits", "batch_size": 64, "test_limit": 300},
    "model": {"name": "mlp"},
    "optim": {"lr": 0.05, "momentum": 0.9},
    "train": {"epochs": 2, "progress": False},
    "eval": {"num_samples": 1},
}


@pytest.mark.parametrize(("first", "then"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_checkpoint_written_on_one_device_resumes_on_the_other(tmp_path, monkeypatch, first, then):
    from flatbma.experiment.config.run_config import config_from_dict
    from flatbma.experiment.run.pipeline import train
    from tests.helpers import interrupt_after_first_epoch

    cfg = config_from_dict({**DIGITS, "train": {**DIGITS["train"], "device": first}})
    reference = train(dataclasses.replace(cfg, output_dir=str(tmp_path / "ref")), evaluate=False)
    stopped = dataclasses.replace(cfg, output_dir=str(tmp_path / "run"))
    interrupt_after_first_epoch(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        train(stopped, evaluate=False)
    moved = dataclasses.replace(stopped, train=dataclasses.replace(stopped.train, device=then))
    resumed = train(moved, resume=True, evaluate=False)
    assert all(v.device.type == then for v in resumed.state.params.values())
    start = {k: torch.zeros_like(v) for k, v in reference.state.params.items()}
    assert relative_difference(resumed.state.params, reference.state.params, start) < FLOAT32_TOLERANCE
    assert resumed.state.step == reference.state.step


def _torchrun(*args: str) -> None:
    """``torchrun --nproc_per_node=1 *args`` from the repository root, flatbma and the tests importable."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # cuBLAS's deterministic mode (tests/cuda_worker.py asks for it)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-8000:]


def test_nccl_gives_the_numbers_of_gloo_under_torchrun(tmp_path):
    """One process under torchrun, its data-parallel path forced on: NCCL's collectives on the GPU = gloo's."""
    for backend in ("nccl", "gloo"):
        _torchrun(str(ROOT / "tests" / "cuda_worker.py"), backend, "cuda", str(tmp_path / backend))
    nccl = json.loads((tmp_path / "nccl" / "metrics.json").read_text())
    gloo = json.loads((tmp_path / "gloo" / "metrics.json").read_text())
    assert nccl["history"] == gloo["history"]
    for key in ("accuracy", "nll", "ece", "brier"):
        assert nccl[key] == gloo[key], key
    assert nccl["backend"] == "nccl" and gloo["backend"] == "gloo"


SYNC_BOUND = {"sgd": 0, "sam": 0, "lowrank-vi": 1, "swag": 1, "fp-bma": None}
"""Host-device synchronizations per training step in a run's steady state (``None``: measured, not bounded).

The loop reads its losses every :data:`flatbma.loop.CHECK_EVERY` steps and its sums at epoch
ends only. What remains per step: low-rank VI and FP-BMA read their noise seed (an int64 in the state)
to seed the step's generator; SWAG reads its snapshot count when it may collect; FP-BMA's Fisher solve
tests its residual on the host once per conjugate-gradient iteration (the stopping rule decides the
number of iterations, so it cannot be deferred without changing the numbers), and its trust region
decides on the host whether the step leaves the quadratic regime."""


@pytest.mark.parametrize("name", list(SYNC_BOUND))
def test_synchronizations_per_training_step(name, record_property):
    from flatbma import loop
    from flatbma.methods import parse_method
    from flatbma.optim import SGD
    from flatbma.params import Objective, model_buffers, trainable_params
    from tests.helpers import METHOD_SECTIONS

    torch.manual_seed(0)
    model = tiny_bn_net().cuda()
    method = parse_method(METHOD_SECTIONS.get(name, name)).build(Objective(model, num_data=512), SGD(lr=0.05))
    state = method.init(trainable_params(model), model_buffers(model))
    x, y = toy_batch(n=512)
    steps = loop.CHECK_EVERY - 1  # one window of steps between two reads of the losses
    batches = [(x[i : i + 16].cuda(), y[i : i + 16].cuda()) for i in range(0, 16 * steps, 16)]  # on the GPU
    state, _ = loop.fit(method, state, batches, epochs=1, device="cuda", progress=False)  # warm-up
    torch.cuda.synchronize()
    where: Counter[str] = Counter()  # the innermost line of flatbma under each synchronization
    outside: Counter[str] = Counter()  # synchronizations with no flatbma frame on the stack (not the loop's)

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(str(ROOT / "src" / "flatbma"))]
            if ours:
                where[f"{Path(ours[-1].filename).relative_to(ROOT)}:{ours[-1].lineno}"] += 1
            else:
                outside[f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loop.fit(method, state, batches, epochs=1, device="cuda", progress=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum(where.values())
    epoch_end = 3  # the epoch end's reads: the losses' check, the loss sum and the correct count
    per_step = max(syncs - epoch_end, 0) / steps
    record_property("syncs_per_step", per_step)
    print(f"{name}: {syncs} synchronizations in {steps} steps and their epoch end ({per_step:.2f} per step)")
    print("  where: " + ", ".join(f"{line} ×{n}" for line, n in where.most_common()))
    if outside:
        print("  not flatbma's (no flatbma frame on the stack): " + ", ".join(f"{k} ×{n}" for k, n in outside.items()))
    if SYNC_BOUND[name] is not None:
        assert syncs <= SYNC_BOUND[name] * steps + epoch_end, f"{name}: {syncs} synchronizations in {steps} steps"


def test_the_fisher_solve_and_kl_of_a_wide_posterior_on_cuda_match_the_cpu():
    """150k weights: the wide products and small factorizations of the Fisher solve and of the KL on the GPU."""
    from flatbma.gaussian import kl_rows, rows
    from flatbma.optim.fisher_ball import natural_gradient

    d = 150_001
    g = torch.Generator().manual_seed(0)
    log_std = torch.rand(d, generator=g) * 3 - 6
    theta = {
        "mean/w": torch.randn(d, generator=g),
        "log_std/w": log_std,
        "factor/w": torch.randn(5, d, generator=g) * log_std.exp(),
    }
    prior = {k: v + 0.1 * torch.randn(v.shape, generator=g) * v.abs().mean() for k, v in theta.items()}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in theta.items()}
    x_cpu, quad_cpu = natural_gradient(theta, grads, damping=1e-2, cg_iters=10)
    on_gpu = {k: v.cuda() for k, v in theta.items()}
    x_gpu, quad_gpu = natural_gradient(on_gpu, {k: v.cuda() for k, v in grads.items()}, damping=1e-2, cg_iters=10)
    start = {k: torch.zeros_like(v) for k, v in x_cpu.items()}
    assert relative_difference(x_gpu, x_cpu, start) < 1e-6
    assert float(quad_gpu) == pytest.approx(float(quad_cpu), rel=1e-9)
    kl_cpu = kl_rows(rows(theta).double(), rows(prior).double())
    kl_gpu = kl_rows(rows(on_gpu).double(), rows({k: v.cuda() for k, v in prior.items()}).double())
    assert float(kl_gpu) == pytest.approx(float(kl_cpu), rel=1e-9)
