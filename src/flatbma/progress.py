"""What flatbma shows while it works: a bar on a terminal, one line per finished phase elsewhere, nothing when quiet.

A :class:`Reporter` holds the decision; the command line sets one per command (:func:`reporting`, ``--quiet``)
and working code reads it with :func:`current`: :meth:`Reporter.bar` wraps a loop, :meth:`Reporter.phase` times a
block and prints its line (``flatness: 8 samples λ₁ in 41.2 s``), :meth:`Reporter.tick` says where a long phase
stands every :attr:`Reporter.interval` seconds, and :func:`collecting` gathers the phases' durations.

Everything goes to ``stderr``. Reporting never draws random numbers or changes what it wraps (hence the plain
``tqdm`` bar: ``tqdm.auto``'s opens two iterators of a ``DataLoader``, each drawing a base seed).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tqdm import tqdm  # the plain bar: tqdm.auto's asyncio bar calls iter() once more, and a DataLoader draws a seed

__all__ = ["Reporter", "collecting", "count", "current", "reporting"]

T = TypeVar("T")


def _stderr_is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except (OSError, ValueError):  # a closed or detached stream
        return False


@dataclass(frozen=True)
class Reporter:
    """How progress is shown.

    Attributes:
        quiet: show nothing (no bars, no lines); errors and warnings are not progress and still print.
        terminal: whether ``stderr`` is a terminal; ``None`` asks ``sys.stderr.isatty()`` at every use.
        interval: the longest silence of a phase, in seconds, between its :meth:`tick` lines.
        clock: the time in seconds (``time.perf_counter``; a test gives a fake one).
    """

    quiet: bool = False
    terminal: bool | None = None
    interval: float = 30.0
    clock: Callable[[], float] = field(default=time.perf_counter, compare=False)

    def on_terminal(self) -> bool:
        """Whether ``stderr`` is (taken as) a terminal."""
        return self.terminal if self.terminal is not None else _stderr_is_terminal()

    @property
    def bars(self) -> bool:
        """Whether loops get a progress bar: on a terminal, unless quiet."""
        return not self.quiet and self.on_terminal()

    @property
    def lines(self) -> bool:
        """Whether phases and epochs get a line: when ``stderr`` is not a terminal, unless quiet."""
        return not self.quiet and not self.on_terminal()

    def bar(
        self, iterable: Iterable[T], *, desc: str, total: int | None = None, enabled: bool = True, **options: Any
    ) -> tqdm:
        """``iterable`` wrapped in a ``tqdm`` bar, disabled unless :attr:`bars` and ``enabled``.

        ``options`` are ``tqdm``'s (``leave=False`` by default). A disabled bar is a bare loop.
        """
        options.setdefault("leave", False)
        bar = _Bar(iterable, desc=desc, total=total, disable=not (enabled and self.bars), dynamic_ncols=True, **options)
        bar.reporter, bar.label = self, desc
        bar.count = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        return bar

    def line(self, text: str) -> None:
        """Print ``text`` as one line on ``stderr`` when :attr:`lines` (not on a terminal, not quiet)."""
        if self.lines:
            print(text, file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def phase(self, what: str, detail: str = "") -> Iterator[None]:
        """Time the block; when :attr:`lines`, print ``"<what>: <detail> in <seconds> s"`` once it ends.

        Nothing is printed when the block raises. Its duration goes to the :func:`collecting` block around it.
        """
        start = self.clock()
        token = _PHASE.set(_Phase(what, start, self))
        try:
            yield
        finally:
            _PHASE.reset(token)
        seconds = self.clock() - start
        for sink in _COLLECTING:
            sink.append((what, seconds))
        self.line(f"{what}: {detail + ' ' if detail else ''}in {seconds:.1f} s")

    def tick(self, where: str | None = None) -> None:
        """Note progress inside the current :meth:`phase`; print a line if the phase has been silent too long.

        ``where`` (e.g. ``"Hessian spectra 3/8"``) is kept until the next one. If the phase's reporter prints
        :attr:`lines` and :attr:`interval` seconds have passed since the phase's last line, it prints
        ``"<phase>: <where>, <seconds> s so far"``.
        """
        phase = _PHASE.get()
        if phase is None or not phase.reporter.lines:  # the phase's own reporter decides (a quiet stage stays so)
            return
        if where is not None:
            phase.where = where
        now = phase.reporter.clock()
        if now - phase.last >= phase.reporter.interval:
            phase.last = now
            at = f"{phase.where}, " if phase.where else ""
            phase.reporter.line(f"{phase.what}: {at}{now - phase.started:.0f} s so far")


def count(n: int, noun: str) -> str:
    """``"1 sample"``, ``"8 samples"``: a number and its noun, for the lines of phases."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


class _Bar(tqdm):
    """A ``tqdm`` bar that ticks its reporter after every item (:meth:`Reporter.tick`: ``"<desc> i/n"``)."""

    reporter: Reporter
    label: str
    count: int | None

    def __iter__(self) -> Iterator[Any]:
        start = self.n  # a resumed epoch's bar starts at its applied batches (initial)
        for i, item in enumerate(super().__iter__(), start + 1):
            yield item
            self.reporter.tick(f"{self.label} {i}/{self.count}" if self.count else f"{self.label} {i}")


@dataclass
class _Phase:
    """The phase in progress: its name, start, the reporter that opened it, its last line and position."""

    what: str
    started: float
    reporter: Reporter
    where: str = ""
    last: float = field(init=False)

    def __post_init__(self) -> None:
        self.last = self.started


_PHASE: ContextVar[_Phase | None] = ContextVar("flatbma_phase", default=None)
_COLLECTING: list[list[tuple[str, float]]] = []
"""The lists of the open :func:`collecting` blocks (a plain list: a block may span a generator's ``yield``)."""


@contextlib.contextmanager
def collecting() -> Iterator[list[tuple[str, float]]]:
    """Within the block, every :meth:`Reporter.phase` that ends appends ``(what, seconds)`` to the list it yields."""
    found: list[tuple[str, float]] = []
    _COLLECTING.append(found)
    try:
        yield found
    finally:
        _COLLECTING[:] = [c for c in _COLLECTING if c is not found]


_DEFAULT = Reporter()
_CURRENT: ContextVar[Reporter | None] = ContextVar("flatbma_reporter", default=None)


def current() -> Reporter:
    """The reporter in force (set by :func:`reporting`; by default not quiet, terminal detected)."""
    return _CURRENT.get() or _DEFAULT


@contextlib.contextmanager
def reporting(reporter: Reporter) -> Iterator[Reporter]:
    """Within the block :func:`current` is ``reporter`` (the command line sets it once per command)."""
    token = _CURRENT.set(reporter)
    try:
        yield reporter
    finally:
        _CURRENT.reset(token)
