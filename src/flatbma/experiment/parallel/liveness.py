"""Collective timeouts under ``torchrun``: a stopped or hung process ends the job with one line naming it.

The process group waits at most :func:`collective_timeout` seconds in a collective (``$FLATBMA_COLLECTIVE_TIMEOUT``,
a property of the launch: in no run's fingerprint). To name the process that did not answer, every process runs a
:class:`Heartbeat`, a daemon thread that counts up ``alive/<rank>`` in the rendezvous store every
``interval = min(5 s, timeout/10)`` and publishes how many collectives its process has entered. On a timeout
``diagnose`` reads the counters twice, ``2.5·interval`` apart: a process whose counter stood still is stopped or
gone; when all are alive, the one that entered fewer collectives is stuck elsewhere or much slower. The store lives
in ``torchrun``'s agent (or rank 0), so it answers while a worker is stopped. Tested with gloo on CPU; NCCL's
watchdog may abort the process before the line is written (``TORCH_NCCL_BLOCKING_WAIT=1``: docs/distributed.md).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from flatbma.errors import FlatbmaError

ENV = "FLATBMA_COLLECTIVE_TIMEOUT"
"""The environment variable holding the collective timeout in seconds."""

DEFAULT_TIMEOUT = 300.0
"""Seconds a collective may wait: far above a training step or a checkpoint write, short enough to notice."""

_PREFIX = "flatbma"


def collective_timeout() -> float:
    """The collective timeout in seconds: ``$FLATBMA_COLLECTIVE_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`.

    Raises:
        FlatbmaError: the variable is not a finite number of seconds > 0.
    """
    text = os.environ.get(ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise FlatbmaError(
            f"{ENV} must be a number of seconds > 0 (how long a collective may wait for the other processes), "
            f"got {text[:40]!r}"
        )
    return value


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a collective (or rendezvous) that timed out: gloo's, or a ``torch.distributed`` one."""
    text = str(error).lower()
    timed_out = "timed out" in text or "timeout" in text
    if isinstance(error, getattr(dist, "DistError", ())):
        return timed_out
    return isinstance(error, RuntimeError) and "gloo" in text and timed_out


class Heartbeat:
    """This process's sign of life in the rendezvous store, and what it tells about the others.

    Keys go under the prefix ``flatbma/`` of the group's ``store``; ``timeout`` is the collective timeout in seconds,
    ``sequence`` how many collectives this process has entered (``None``: unknown).
    """

    def __init__(
        self, store: dist.Store, rank: int, world: int, timeout: float, sequence: Callable[[], int] | None = None
    ) -> None:
        self.rank, self.world, self.timeout = rank, world, timeout
        self.interval = min(5.0, timeout / 10)
        self.store = dist.PrefixStore(_PREFIX, store)
        clone = getattr(store, "clone", None)  # a connection of its own for the thread, where torch offers one
        self._beat_store = dist.PrefixStore(_PREFIX, clone()) if clone is not None else self.store
        self._sequence = sequence
        self._agreements = 0
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="flatbma-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._beat_store.add(f"alive/{self.rank}", 1)
        if self._sequence is not None:
            self._beat_store.set(f"entered/{self.rank}", str(self._sequence()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # the store is gone: the job is ending; nothing to report from here
                return

    def stop(self) -> None:
        """End the thread (when the group is destroyed), waiting for a beat under way to finish.

        A daemon thread still inside a store call when the interpreter exits aborts the process.
        """
        self._stop.set()
        self._thread.join(timeout=self.timeout)

    def beats(self) -> list[int]:
        """Every process's heartbeat count (without waiting: a missing count reads 0)."""
        return [self.store.add(f"alive/{r}", 0) for r in range(self.world)]

    def silent(self) -> list[int]:
        """The other processes whose heartbeat stood still for ``2.5·interval`` seconds (waits that long)."""
        before = self.beats()
        time.sleep(2.5 * self.interval)
        after = self.beats()
        return [r for r in range(self.world) if r != self.rank and after[r] <= before[r]]

    def entered(self) -> list[int] | None:
        """How many collectives every process has entered, as last published (``None``: unknown)."""
        keys = [f"entered/{r}" for r in range(self.world)]
        if self._sequence is None or not self.store.check(keys):
            return None
        return [int(self.store.get(k)) for k in keys]

    def diagnose(self, error: BaseException) -> FlatbmaError:
        """The one-line error for a collective of this process that timed out (``error``)."""
        wait = f"{self.timeout:g} s"
        fix = f"raise {ENV} (now {wait}) if the processes may legitimately wait longer"
        try:
            silent = self.silent()
            entered = self.entered() if not silent else None
        except Exception:  # the store did not answer either
            return FlatbmaError(
                f"a collective operation did not complete within {wait}, and the rendezvous store did not answer "
                "either: a process (or the node hosting the store) stopped or lost its network; end the job and "
                f"launch again, or {fix}"
            )
        if silent:
            ranks = ", ".join(map(str, silent))
            return FlatbmaError(
                f"rank {ranks} did not answer within {wait}: the process is stopped or frozen (no sign of life for "
                f"{2.5 * self.interval:.1f} s); end the job and launch again (--resume continues from the last "
                "checkpoint)"
            )
        if entered is not None and min(entered) < max(entered):
            behind = [r for r, n in enumerate(entered) if n < max(entered)]
            return FlatbmaError(
                f"rank {', '.join(map(str, behind))} did not reach the collective operation within {wait}: the "
                f"process is alive but stuck or much slower than the others; end the job, or {fix}"
            )
        return FlatbmaError(
            f"a collective operation did not complete within {wait} although every process is alive: one is stuck "
            f"or much slower ({str(error).splitlines()[0][:80] if str(error) else type(error).__name__}); end the "
            f"job, or {fix}"
        )

    def agree(self, failed: bool) -> list[int]:
        """The ranks whose ``failed`` is true, once every process has given its own (a store-based rendezvous).

        Waits as long as every process that has not answered yet shows a heartbeat; one that stays
        silent for the timeout ends the wait with a :class:`FlatbmaError` naming it. Every process
        must call it the same number of times (each call is one rendezvous).
        """
        self._agreements += 1
        keys = [f"agree/{self._agreements}/{r}" for r in range(self.world)]
        self.store.set(keys[self.rank], "1" if failed else "0")
        last, quiet_since = self.beats(), {r: time.monotonic() for r in range(self.world)}
        while not self.store.check(keys):
            time.sleep(min(0.5, self.interval))
            now, beats = time.monotonic(), self.beats()
            for r in range(self.world):
                if beats[r] > last[r]:
                    quiet_since[r] = now
            last = beats
            missing = [r for r in range(self.world) if r != self.rank and not self.store.check([keys[r]])]
            gone = [r for r in missing if now - quiet_since[r] > self.timeout]
            if gone:
                raise FlatbmaError(
                    f"rank {', '.join(map(str, gone))} did not answer within {self.timeout:g} s: the process is "
                    "stopped or frozen (no sign of life); end the job and launch again"
                )
        return [r for r, k in enumerate(keys) if self.store.get(k) == b"1"]


_current: Heartbeat | None = None


def start(store: dist.Store, rank: int, world: int, timeout: float, sequence: Callable[[], int] | None) -> None:
    """Start this process's :class:`Heartbeat` (when its process group is created)."""
    global _current
    stop()
    _current = Heartbeat(store, rank, world, timeout, sequence)


def stop() -> None:
    """Stop the heartbeat (when the process group is destroyed)."""
    global _current
    if _current is not None:
        _current.stop()
        _current = None


def current() -> Heartbeat | None:
    """The running heartbeat, or ``None`` (no group made by :func:`~.processes.init_from_env`)."""
    return _current
