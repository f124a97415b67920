"""Peak extra resident memory of one call, for the benchmarks' child processes (Linux).

Returns the heap freed before the call to the kernel (glibc's ``malloc_trim(0)``, where glibc is the C
library), resets the kernel's peak-RSS counter (``echo 5 > /proc/self/clear_refs``, Linux ≥ 4.0), reads
the current RSS, runs the call once and reports ``VmHWM − RSS_before``: the extra resident memory at the
call's peak. Without the trim, memory that the set-up freed stays resident in amounts that vary between
identical runs (up to 20 MiB on ``bench/hessian.py``'s ResNet), and the call's allocations that reuse it
are not counted. Where ``clear_refs`` is not available, ``ru_maxrss`` (the process's peak so far) is an
upper bound.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable


def _trim_heap() -> bool:
    """``malloc_trim(0)``: glibc returns the free memory at the top and inside its heaps to the kernel."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc
        return False
    return True


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_mib(call: Callable[[], object]) -> tuple[float, str]:
    """``(MiB, method)``: the extra resident memory at the peak of ``call()`` and how it was measured."""
    gc.collect()
    method = "VmHWM after malloc_trim and clear_refs" if _trim_heap() else "VmHWM after clear_refs"
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        method = "ru_maxrss (upper bound)"
    before = _rss_kib("VmRSS")
    call()
    if method.startswith("VmHWM"):
        peak = _rss_kib("VmHWM")
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (peak - before) / 1024, method
