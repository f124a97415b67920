"""One writer per directory: the lock a command holds on a run or comparison directory while it works there.

An advisory ``fcntl.flock`` on a descriptor of the directory itself (:func:`hold`), which the operating system
releases however the process ends; :data:`LOCK_FILE` names the holder, so a second command is refused in one line.
Re-entrant within a process, held by rank 0 under ``torchrun``. Where a directory cannot be locked, the lock file
is; where neither can, the command goes on without it (docs/reliability.md, "One writer per directory").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flatbma.errors import FlatbmaError
from flatbma.experiment.parallel import processes
from flatbma.state_io import atomic_write_bytes

LOCK_FILE = ".flatbma-lock"
"""The lock file's name inside a locked directory (not a file of the run: output_dir checks ignore it)."""


@dataclass
class _Held:
    """A lock this process holds.

    The open directory it is held on (``None``: held on the lock file, or without a lock), the open lock file
    that holds the note (``None``: none could be opened), the directories created for it (leaf first) and how
    many :func:`hold` blocks hold it.
    """

    directory_fd: int | None
    fd: int | None
    created: list[Path]
    depth: int = 0


_held: dict[str, _Held] = {}
"""The directories this process holds (by real path) and how many :func:`hold` blocks hold each."""


@contextlib.contextmanager
def hold(directory: str | Path, command: str, *, every_process: bool = True) -> Iterator[None]:
    """Hold the lock of ``directory`` (created if missing) within the block; ``command`` names the holder.

    Under ``torchrun`` only rank 0 holds it. With ``every_process`` (every process of the group makes this call)
    they agree on the outcome (:func:`flatbma.experiment.parallel.processes.all_or_none`): a refusal ends them all.

    Raises:
        FlatbmaError: another process holds it — one line naming its process id and command, and what to do;
            its lock file is a symbolic link or no regular file.
    """
    key = os.path.realpath(directory)
    main = processes.is_main()
    with processes.all_or_none() if every_process else contextlib.nullcontext():
        if main and key not in _held:
            _held[key] = _acquire(Path(directory), command)
    if main:
        _held[key].depth += 1
    try:
        yield
    finally:
        if main:
            _release(key)


def _release(key: str) -> None:
    """Leave one :func:`hold` block of ``key``; the last one releases the lock.

    It empties the lock file first (never one hard-linked elsewhere since), or removes it and the
    directories created for it when nothing else was written into them.
    """
    held = _held[key]
    held.depth -= 1
    if held.depth > 0:
        return
    del _held[key]
    if held.fd is not None:
        with contextlib.suppress(OSError):
            if os.fstat(held.fd).st_nlink <= 1:  # an empty lock file: a refused command leaves the directory as it was
                os.ftruncate(held.fd, 0)
    if held.created:
        with contextlib.suppress(OSError):
            if set(os.listdir(held.created[0])) <= {LOCK_FILE}:  # nothing written: the place is left as it was
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(held.created[0] / LOCK_FILE)
                for directory in held.created:
                    os.rmdir(directory)
    for fd in (held.fd, held.directory_fd):
        if fd is not None:
            os.close(fd)  # the directory's: releases the lock


def _acquire(directory: Path, command: str) -> _Held:
    """The lock of ``directory``, held on the directory itself (module docstring), and its note written.

    Its ``fd`` is ``None`` where no lock file can be had, its ``directory_fd`` where the directory cannot be
    opened or locked (then the lock file is locked instead, where it can be).
    """
    path = directory / LOCK_FILE
    created = [d for d in (directory, *directory.parents) if not os.path.lexists(d)]
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # an unwritable place: the command's first write names it
    _check_lock_file(path)
    directory_fd = _open_directory(directory)
    if directory_fd is not None and not _locked(directory_fd, directory, path):
        os.close(directory_fd)  # a file system that cannot lock a directory: the lock file instead
        directory_fd = None
    fd, writable = _open(path)
    if directory_fd is None:
        if fd is None:
            return _Held(None, None, created)
        if not _locked(fd, directory, path):
            os.close(fd)
            return _Held(None, None, [])  # a file system without locks
    if fd is not None and writable:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {command}\n".encode(), 0)
        except OSError:
            pass  # the lock holds without the note
    return _Held(directory_fd, fd, created)


def _locked(fd: int, directory: Path, path: Path) -> bool:
    """Lock the open ``fd`` (the directory's or the lock file's): ``True``, or ``False`` where locks fail.

    Raises:
        FlatbmaError: another process holds the lock (named from the note in ``path``).
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        os.close(fd)
        raise FlatbmaError(
            f"{directory} is in use by {_holder(path)}: wait until it ends (or stop it), then run this command "
            "again; one process at a time writes a run or comparison directory"
        ) from None
    return True


def _open_directory(directory: Path) -> int | None:
    """A read-only descriptor of ``directory`` to lock, or ``None`` where it cannot be opened."""
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None


def _check_lock_file(path: Path) -> None:
    """Refuse a lock file that is a symbolic link or no regular file (a link could point outside, a FIFO block).

    One hard-linked elsewhere is replaced by an empty file of its own (its other names keep their bytes).

    Raises:
        FlatbmaError: ``path`` is a symbolic link or not a regular file.
    """
    try:
        info = os.lstat(path)
    except OSError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise FlatbmaError(f"{path} is a symbolic link, not flatbma's lock file: remove it")
    if not stat.S_ISREG(info.st_mode):
        raise FlatbmaError(f"{path} is not a regular file, so not flatbma's lock file: remove it")
    if info.st_nlink > 1:
        with contextlib.suppress(FlatbmaError):  # an unwritable place: the lock file is left alone
            atomic_write_bytes(path, b"")


def _open(path: Path) -> tuple[int | None, bool]:
    """``(fd, writable)`` of the lock file at ``path``: read-write (created if missing), else read-only if it exists.

    ``(None, False)`` when it can be neither, or when it is no longer a regular file of its own (replaced
    since it was checked). Never through a symbolic link.
    """
    for flags, writable in ((os.O_RDWR | os.O_CREAT, True), (os.O_RDONLY, False)):
        try:  # 0o666: the mode the umask allows, like every output
            fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise FlatbmaError(f"{path} is a symbolic link, not flatbma's lock file: remove it") from None
            continue
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise FlatbmaError(f"{path} is not a regular file, so not flatbma's lock file: remove it")
        if info.st_nlink > 1:  # linked since it was checked: its note would change the other file
            os.close(fd)
            return None, False
        return fd, writable
    return None, False


def _holder(path: Path) -> str:
    """Who holds the lock, as its note says: ``"flatbma train (process 4242)"``, or ``"another process"``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return "another process"
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").split() if stat.S_ISREG(os.fstat(fd).st_mode) else []
    except OSError:
        text = []
    finally:
        os.close(fd)
    if len(text) >= 2 and text[0].isdigit():
        return f"flatbma {text[1][:20]} (process {text[0][:10]})"
    return "another process"
