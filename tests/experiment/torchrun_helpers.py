"""Shared by the torchrun tests: launch a worker under ``torch.distributed.run``, crash a run on cue.

Imported as ``tests.experiment.torchrun_helpers`` by pytest and by the worker processes alike
(:func:`torchrun` puts the repository root on their ``PYTHONPATH``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run --standalone --nproc_per_node=nproc *args`` from the repository root.

    One thread per process; fails the test with the tail of stderr, long enough to show every rank's
    traceback.
    """
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-12000:]
    return out


class Crash(Exception):
    """Raised by :func:`crash_after` on every rank, right after the same collective checkpoint."""


@contextlib.contextmanager
def crash_after(run: ModuleType, checkpoints: int) -> Iterator[list[int]]:
    """Within the block, ``run.fit`` raises :class:`Crash` right after its ``checkpoints``-th checkpoint.

    The crash ends the block quietly (the run directory keeps that checkpoint); ``run.fit`` is restored
    on exit. Yields the list that grows by one entry per checkpoint written.

    Args:
        run: the module :mod:`flatbma.training`, whose ``fit`` (the loop) every run trains through (it is replaced).
        checkpoints: the number of checkpoints after which to crash.
    """
    real_fit, calls = run.fit, []

    def crashing_fit(*args, checkpoint, **kwargs):
        def hook(*a):
            checkpoint(*a)
            calls.append(1)
            if len(calls) == checkpoints:
                raise Crash

        return real_fit(*args, checkpoint=hook, **kwargs)

    run.fit = crashing_fit
    try:
        yield calls
    except Crash:
        pass
    finally:
        run.fit = real_fit
