"""The ``flatbma`` command's entry point: it answers SIGTERM before ``flatbma`` (and torch) are imported.

Importing flatbma takes seconds (torch). A SIGTERM then, before :func:`flatbma.experiment.cli.main` installs
its handler, ended the command silently with the signal's default action. This module is outside the
``flatbma`` package on purpose: importing any ``flatbma`` module imports the package first. It installs a
handler that ends the start-up with the command's SIGTERM line and exit code 143, then hands over to
:func:`flatbma.experiment.cli.main` (which installs its own).
"""

from __future__ import annotations

import signal
import sys


def _terminated_while_starting(signum: int, frame: object) -> None:
    print("flatbma: terminated (SIGTERM); finished checkpoints are kept", file=sys.stderr, flush=True)
    raise SystemExit(143)


def main() -> int:
    """Run the ``flatbma`` command (:func:`flatbma.experiment.cli.main`), answering SIGTERM during its imports."""
    previous = signal.signal(signal.SIGTERM, _terminated_while_starting)
    try:
        from flatbma.experiment.cli import main as command
    finally:
        signal.signal(signal.SIGTERM, previous)
    return command()


if __name__ == "__main__":
    raise SystemExit(main())
