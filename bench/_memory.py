"""Peak extra resident memory of one call, for the benchmarks' child processes (Linux).

Resets the kernel's peak-RSS counter (``echo 5 > /proc/self/clear_refs``, Linux ≥ 4.0), reads the current
RSS, runs the call once and reports ``VmHWM − RSS_before``: the extra resident memory at the call's peak.
Where ``clear_refs`` is not available, ``ru_maxrss`` (the process's peak so far) is an upper bound.
"""

from __future__ import annotations

from collections.abc import Callable


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_mib(call: Callable[[], object]) -> tuple[float, str]:
    """``(MiB, method)``: the extra resident memory at the peak of ``call()`` and how it was measured."""
    method = "VmHWM after clear_refs"
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
