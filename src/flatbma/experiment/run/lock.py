"""One writer per directory: the lock a command holds on a run or comparison directory while it works there.

``flatbma train`` (``--resume`` too), ``evaluate`` and ``compare`` hold the lock of every directory they
write, from before they read what it holds until they are done (:func:`hold`). The lock is an
advisory ``fcntl.flock`` on the file :data:`LOCK_FILE` inside the directory, so the operating system
releases it when its process ends, however it ends (``SIGKILL`` too): a killed run never leaves a
directory locked. The file holds the holder's process id and command, and a second command that wants
the directory is refused in one line naming them — instead of two processes writing one checkpoint, a
log of twice the epochs, or an ``evaluate`` removing the temporary file a training is writing. When the
last block ends the file is emptied, and a directory the lock created is removed again if nothing else was
written into it (a command refused before its first file leaves no trace).

The lock is re-entrant within a process (a two-stage run holds its directory and then its first
stage's inside it; ``compare`` holds its directory and each run's). Under ``torchrun`` only the process
that writes files holds it (:func:`flatbma.experiment.parallel.processes.is_main`). Where the lock file can be
neither created nor opened (a directory without write permission, on a read-only file system, before the
file existed) or the file system has no locks, the command goes on without it: nothing can be written
there, and the write that fails says so.
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

LOCK_FILE = ".flatbma-lock"
"""The lock file's name inside a locked directory (not a file of the run: output_dir checks ignore it)."""


@dataclass
class _Held:
    """A lock this process holds.

    Its open lock file (``None``: held without one), the directories created for it (leaf first) and how
    many :func:`hold` blocks hold it.
    """

    fd: int | None
    created: list[Path]
    depth: int = 0


_held: dict[str, _Held] = {}
"""The directories this process holds (by real path) and how many :func:`hold` blocks hold each."""


@contextlib.contextmanager
def hold(directory: str | Path, command: str, *, every_process: bool = True) -> Iterator[None]:
    """Hold the lock of ``directory`` (created if missing) within the block; ``command`` names the holder.

    Under ``torchrun`` only rank 0 holds it. With ``every_process`` (every process of the group runs this
    call) they agree on the outcome (:func:`flatbma.experiment.parallel.processes.all_or_none`), so a refusal
    ends every process at once; ``flatbma compare``'s rank 0 claims its output directory alone
    (``every_process=False``).

    Raises:
        FlatbmaError: another process holds it — one line naming its process id and command, and what to do.
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

    It empties the lock file first, or removes it and the directories created for it when nothing else
    was written into them.
    """
    held = _held[key]
    held.depth -= 1
    if held.depth > 0:
        return
    del _held[key]
    if held.fd is not None:
        with contextlib.suppress(OSError):
            os.ftruncate(held.fd, 0)  # an empty lock file: a command that is refused leaves the directory as it was
    if held.created:
        with contextlib.suppress(OSError):
            if set(os.listdir(held.created[0])) <= {LOCK_FILE}:  # nothing written: the place is left as it was
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(held.created[0] / LOCK_FILE)
                for directory in held.created:
                    os.rmdir(directory)
    if held.fd is not None:
        os.close(held.fd)  # releases the lock


def _acquire(directory: Path, command: str) -> _Held:
    """The lock of ``directory``: its lock file open, locked and holding this process's id and ``command``.

    Its ``fd`` is ``None`` where no lock file can be had (module docstring).
    """
    path = directory / LOCK_FILE
    created = [d for d in (directory, *directory.parents) if not os.path.lexists(d)]
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # an unwritable place: the command's first write names it
    fd, writable = _open(path)
    if fd is None:
        return _Held(None, created)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(fd)
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return _Held(None, [])  # a file system without locks
        raise FlatbmaError(
            f"{directory} is in use by {holder}: wait until it ends (or stop it), then run this command again; "
            "one process at a time writes a run or comparison directory"
        ) from None
    if writable:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {command}\n".encode(), 0)
        except OSError:
            pass  # the lock holds without the note
    return _Held(fd, created)


def _open(path: Path) -> tuple[int | None, bool]:
    """``(fd, writable)`` of the lock file at ``path``: read-write (created if missing), else read-only if it exists.

    ``(None, False)`` when it can be neither. Never through a symbolic link, never anything but a regular
    file (a link could point outside the directory, a FIFO block).

    Raises:
        FlatbmaError: ``path`` is a symbolic link or not a regular file.
    """
    for flags, writable in ((os.O_RDWR | os.O_CREAT, True), (os.O_RDONLY, False)):
        try:  # 0o666: the mode the umask allows, like every output
            fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise FlatbmaError(f"{path} is a symbolic link, not flatbma's lock file: remove it") from None
            continue
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FlatbmaError(f"{path} is not a regular file, so not flatbma's lock file: remove it")
        return fd, writable
    return None, False


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says: ``"flatbma train (process 4242)"``, or ``"another process"``."""
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").split()
    except OSError:
        text = []
    if len(text) >= 2 and text[0].isdigit():
        return f"flatbma {text[1][:20]} (process {text[0][:10]})"
    return "another process"
