"""Run by ``tests/test_cuda.py`` under ``torchrun --nproc_per_node=1``: a data-parallel run with a chosen backend.

    python -m torch.distributed.run --standalone --nproc_per_node=1 tests/cuda_worker.py BACKEND DEVICE OUT

One process joins a group of BACKEND (``nccl`` or ``gloo``) and trains SWAG on digits on DEVICE with the
data-parallel path forced on (flatbma takes it only for groups of several processes), so every collective
of a data-parallel run — the gradients' all-reduce, BatchNorm averaging, the replica check, the metrics'
reduction — runs through BACKEND, with PyTorch's deterministic algorithms. It writes OUT/metrics.json with
``backend`` added.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.parallel import processes
from flatbma.experiment.run.pipeline import train

CONFIG = {
    "seed": 0,
    "method": {"name": "swag", "rank": 2, "start_step": 0, "collect_every": 2},
    "data": {"name": "digits", "batch_size": 64, "test_limit": 300},
    "model": {"name": "cnn", "width": 8},
    "optim": {"lr": 0.05, "momentum": 0.9},
    "train": {"epochs": 2, "progress": False},
    "eval": {"num_samples": 4},
}


def main() -> None:
    backend, device, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    # two processes compare bit for bit: cuDNN's and cuBLAS's nondeterministic kernels (atomics) would
    # differ in the last float32 digit between any two runs, whatever the backend
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend=backend)
    processes.is_distributed = lambda: True  # one process, the data-parallel path (its collectives) on
    try:
        cfg = config_from_dict({**CONFIG, "train": {**CONFIG["train"], "device": device}, "output_dir": str(out)})
        metrics = train(cfg).metrics
    finally:
        dist.destroy_process_group()
    metrics["backend"] = dist.Backend(backend)
    (out / "metrics.json").write_text(json.dumps(metrics))


if __name__ == "__main__":
    main()
