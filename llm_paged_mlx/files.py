"""Files that other processes read and write at the same time: whole-or-nothing writes and a lock.

Neither follows a symlink found at the file's path: a write replaces the link itself, a lock
refuses it. So a link planted in one of the project's folders cannot make it create or change
a file elsewhere.
"""

import contextlib
import errno
import fcntl
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

TEMP_PREFIX = ".tmp-"  # temporary files of writes in progress (or of a process that died mid-write)
LOCK_POLL_S = 0.05  # how often a wait with a timeout tries the lock again


def write_atomically(path, payload: bytes, *, mtime_ns: Optional[int] = None, durable: bool = False) -> None:
    """Write ``path`` whole or not at all: a temporary file (mode 0600) in its folder, synced, renamed over it.

    ``durable`` also syncs the folder, so that the rename itself survives a crash.
    """
    path = Path(path)
    fd, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".part", dir=path.parent)
    try:
        with open(fd, "wb") as file:
            _write_all(file, payload)
            file.flush()
            os.fsync(file.fileno())
        if mtime_ns is not None:
            os.utime(temp, ns=(mtime_ns, mtime_ns))
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    if durable:
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def _write_all(file, payload: bytes) -> None:  # apart, so that tests can make the disk fail
    file.write(payload)


@contextlib.contextmanager
def locked(lock_path, timeout: Optional[float] = None) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (made if missing): other holders, in any process, wait.

    With a ``timeout`` (seconds), raise TimeoutError if the lock is still held by then: a
    holder may be suspended (Ctrl-Z) for as long as its user likes. The lock file stays:
    removing a lock file that another process holds open breaks the lock. A symlink at
    ``lock_path`` is an OSError that names it.
    """
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(lock_path):  # O_NOFOLLOW's refusal
            raise OSError(f"{lock_path} is a symbolic link, not a lock file; remove it") from None
        raise
    try:
        if timeout is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        else:
            _lock_within(fd, lock_path, timeout)
        yield
    finally:
        os.close(fd)  # which releases the lock


def _lock_within(fd: int, lock_path, timeout: float) -> None:
    """Take the lock, trying until ``timeout`` has passed (a blocking flock could not be given up)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{lock_path} is still locked by another process after {timeout:g} s") from None
            time.sleep(LOCK_POLL_S)
