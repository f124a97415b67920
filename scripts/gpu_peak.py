"""Run a Python module or script in this process, as ``python -m MODULE`` / ``python SCRIPT`` would, and report it.

    python scripts/gpu_peak.py LABEL MODULE_OR_SCRIPT.py [ARGS ...]

At the end it prints one line, ``[gpu-peak] LABEL: exit N, T s, peak GPU memory M MiB`` — the peak of
``torch.cuda.max_memory_allocated`` in this process (processes it starts, e.g. under ``torchrun``, are not
counted; ``no CUDA`` without a GPU) — and exits with the module's exit status. Used by ``scripts/gpu-check.sh``.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path


def main() -> int:
    """Run the module or script of ``sys.argv``, print its line (exit, time, peak GPU memory), return its status."""
    label, target, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    sys.argv = [target, *args]
    start = time.perf_counter()
    code: int = 0
    try:
        if target.endswith(".py"):
            sys.path.insert(0, str(Path(target).resolve().parent))  # as `python SCRIPT` puts it first
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # report it, then fail like python would
        import traceback

        traceback.print_exc()
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
    elapsed = time.perf_counter() - start
    import torch

    peak = f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB" if torch.cuda.is_available() else "no CUDA"
    print(f"[gpu-peak] {label}: exit {code}, {elapsed:.1f} s, peak GPU memory {peak}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
