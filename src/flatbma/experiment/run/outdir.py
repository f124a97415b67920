"""Where ``flatbma train`` and ``flatbma compare`` may write: the one check of an ``output_dir``.

Before anything is written the directory must be missing (it is created), empty but for flatbma's lock file and
the temporary files of killed writes (``.<name>.<8 chars>.tmp``), or a flatbma directory of the command's kind: a
*run directory* holds a regular file ``config.yaml`` that is a YAML mapping with every key of :data:`RUN_KEYS` (the
name is common, so its content decides), a *compare directory* a regular file ``compare_config.yaml``. Anything
else only with ``--force``; never, even with it, a file system root, a mount point or the user's home directory,
whatever the spelling (``..``, symlinks).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import yaml

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.parse import load_yaml
from flatbma.experiment.run.lock import LOCK_FILE
from flatbma.state_io import TEMP_NAME

RUN_CONFIG = "config.yaml"
COMPARE_CONFIG = "compare_config.yaml"
RUN_KEYS = frozenset({"seed", "output_dir", "method", "data", "model", "optim", "train", "eval"})
"""The keys of every resolved run config (:meth:`flatbma.experiment.config.run_config.RunConfig.to_dict`)."""


def check_run_output(path: str | Path, *, force: bool) -> None:
    """Refuse ``path`` as the ``output_dir`` of ``flatbma train`` unless it may hold a run (module docstring).

    Raises:
        FlatbmaError: ``path`` is a file system root, a mount point, the home directory or a file, or,
            without ``force``, a directory with files that is not a run directory.
    """
    _check(Path(path), force, "run", RUN_CONFIG, is_run_dir)


def check_compare_output(path: str | Path, *, force: bool) -> None:
    """Refuse ``path`` as the ``output_dir`` of ``flatbma compare`` unless it may hold a comparison.

    Raises:
        FlatbmaError: as :func:`check_run_output`, for a compare directory.
    """
    _check(Path(path), force, "compare", COMPARE_CONFIG, is_compare_dir)


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds a ``config.yaml`` written by ``flatbma train`` (a mapping with :data:`RUN_KEYS`)."""
    config = path / RUN_CONFIG
    if not config.is_file():
        return False
    try:
        resolved = load_yaml(config.read_text(), str(config))
    except (OSError, ValueError, yaml.YAMLError, RecursionError):  # ValueError: also FlatbmaError, bad UTF-8
        return False
    return isinstance(resolved, dict) and RUN_KEYS <= set(resolved)


def is_compare_dir(path: Path) -> bool:
    """Whether ``path`` holds a ``compare_config.yaml`` (written by ``flatbma compare``)."""
    return (path / COMPARE_CONFIG).is_file()


def _check(path: Path, force: bool, kind: str, marker: str, is_kind: Callable[[Path], bool]) -> None:
    broken = _broken_link(path)
    if broken is not None:
        raise FlatbmaError(
            f"output_dir {path}: {broken} is a symbolic link that leads nowhere (a loop, or its target is gone): "
            "remove it, or choose another output_dir"
        )
    real = Path(os.path.realpath(path))
    where = f"output_dir {path}" + (f" (that is {real})" if str(real) != str(path) else "")
    special = _special(real)
    if special:
        raise FlatbmaError(
            f"{where} is {special}: flatbma would write its files among everything there; choose a directory "
            f"inside it, such as {real / 'runs' / kind} (--force does not change this)"
        )
    if not os.path.exists(real):  # os.path: False, not an exception, for a path it may not look into
        return
    if not os.path.isdir(real):
        raise FlatbmaError(f"{where} is a file, not a directory: choose another output_dir (--set output_dir=...)")
    if force or is_kind(real) or not _holds_files(real):
        return
    raise FlatbmaError(
        f"{where} already holds files and is not a flatbma {kind} directory (it has no {marker} written by "
        f"flatbma {kind if kind == 'compare' else 'train'}): choose a new or empty directory (--set output_dir=...), "
        "or pass --force to write into it anyway"
    )


def _broken_link(path: Path) -> Path | None:
    """The first of ``path`` and its parents that is a symbolic link leading nowhere (dangling, a loop), or ``None``."""
    for place in (path, *path.parents):
        if os.path.islink(place) and not os.path.exists(place):
            return place
    return None


def _special(real: Path) -> str:
    """What makes the resolved path ``real`` no place for flatbma's files, or ``""``."""
    if real == Path(real.anchor):
        return "a file system root"
    try:
        home = Path(os.path.realpath(Path.home()))
    except (RuntimeError, KeyError):  # no home directory known
        home = None
    if real == home:
        return "your home directory"
    if os.path.ismount(real):
        return "a mount point"
    return ""


def _holds_files(path: Path) -> bool:
    """Whether directory ``path`` holds anything but the temporary files of killed flatbma writes and its lock file."""
    try:
        with os.scandir(path) as entries:
            return any(not TEMP_NAME.match(entry.name) and entry.name != LOCK_FILE for entry in entries)
    except OSError as e:
        raise FlatbmaError(f"cannot list output_dir {path} ({e.strerror}): choose another output_dir") from None
