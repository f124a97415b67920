"""What flatbma shows while it works: a bar on a terminal, one line per finished phase elsewhere, nothing when quiet.

The decision — terminal or not, quiet or not — is made here and nowhere else. A :class:`Reporter` holds
it; the command line sets one for the whole command (:func:`reporting`, ``--quiet``) and the code that
works reads it with :func:`current`:

* :meth:`Reporter.bar` wraps a loop in a ``tqdm`` bar, shown only on a terminal (``stderr`` is a TTY)
  and never when quiet; elsewhere the loop runs bare.
* :meth:`Reporter.phase` times a block and, when ``stderr`` is not a terminal (a log file, CI, a pipe),
  prints one line when it ends: ``flatness: 8 samples λ₁ in 41.2 s``.
* :meth:`Reporter.line` prints one line under the same condition (the training loop's line per epoch,
  unless :attr:`Reporter.epochs` is off: ``flatbma compare`` trains many runs and shows one line per run;
  every run's epochs are in its ``log.csv``).

Everything goes to ``stderr``, so the results a command prints on ``stdout`` stay clean. Without a
command line (Python code) the default reporter is not quiet: bars on a terminal, phase lines elsewhere.
Reporting never draws random numbers or changes what it wraps: the numbers are the same with any reporter.
(Hence the plain ``tqdm`` bar: ``tqdm.auto``'s asyncio bar opens an iterator of what it wraps when it is
created and another when the loop starts, and every iterator of a ``DataLoader`` draws its base seed from
the global generator — so MC dropout's masks would change. In a notebook ``stderr`` is no terminal: lines.)
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from tqdm import tqdm  # the plain bar: tqdm.auto's asyncio bar calls iter() once more, and a DataLoader draws a seed

__all__ = ["Reporter", "count", "current", "reporting"]

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
        epochs: whether the training loop prints its line per epoch (when :attr:`lines`).
    """

    quiet: bool = False
    terminal: bool | None = None
    epochs: bool = True

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

        The bar disappears when the loop ends (``leave=False``, unless ``options`` say otherwise); the
        other ``options`` are ``tqdm``'s (``initial``, ``unit``, ...). A disabled bar is a bare loop whose
        ``set_postfix`` does nothing.
        """
        options.setdefault("leave", False)
        return tqdm(
            iterable, desc=desc, total=total, disable=not (enabled and self.bars), dynamic_ncols=True, **options
        )

    def line(self, text: str) -> None:
        """Print ``text`` as one line on ``stderr`` when :attr:`lines` (not on a terminal, not quiet)."""
        if self.lines:
            print(text, file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def phase(self, what: str, detail: str = "") -> Iterator[None]:
        """Time the block; when :attr:`lines`, print ``"<what>: <detail> in <seconds> s"`` once it ends.

        Nothing is printed when the block raises (the error says what happened).
        """
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.line(f"{what}: {detail + ' ' if detail else ''}in {seconds:.1f} s")


def count(n: int, noun: str) -> str:
    """``"1 sample"``, ``"8 samples"``: a number and its noun, for the lines of phases."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


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
