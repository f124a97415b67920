"""User-facing errors.

Every error a user can fix by changing their input is a :class:`FlatbmaError`, whose message says what was
wrong and what to do; the CLI prints it on one line and exits non-zero, without a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class FlatbmaError(ValueError):
    """An actionable error caused by user input (config, data, paths, checkpoints)."""


class DivergenceError(FlatbmaError):
    """Training produced a non-finite loss or a failed linear solve; the last good checkpoint is kept.

    ``cause`` says what went wrong first: ``"loss"`` (a non-finite loss), ``"solve"`` (a covariance no longer
    positive definite) or ``"inputs"`` (the inputs held NaN or inf: no step size is to blame).
    """

    def __init__(self, message: str, cause: str = "loss") -> None:
        super().__init__(message)
        self.cause = cause


class FlatbmaTypeError(FlatbmaError, TypeError):
    """An argument of the wrong kind (a model that is no ``nn.Module``, a batch that is no pair of tensors)."""


class FlatbmaWarning(UserWarning):
    """Something a user should know that does not stop the work (an unconverged solver, a collapsed run).

    The command line prints each as one line ``flatbma: warning: ...`` and hides other libraries' warnings.
    """


def suggest(name: str, choices: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else ""
