"""The cache directory as a whole, for any model: its layout, its lock, its hit counts, and what
``llm paged-mlx cache info`` shows and ``cache clear`` removes.

The directory holds block files named ``<model key>-<chain hash>.safetensors`` for every
model and process that uses it, ``hits.json`` (blocks found and lookups that missed, per
model id, over all processes), temporary files of writes in progress, and ``.lock``, the
file whose ``flock`` serializes what must see the directory whole (eviction, the hit
counts, clearing). Nothing here trusts a file's content, nor that what has a file's name
is a file: files are opened without following symlinks or waiting on FIFOs, and a file
it cannot make sense of is counted under its model key, never a reason to fail.
"""

import contextlib
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from stat import S_ISDIR, S_ISFIFO, S_ISLNK, S_ISREG, S_ISSOCK
from typing import BinaryIO, Iterator, Optional

from ... import files
from .format import BadBlockFile, read_metadata

SUFFIX = ".safetensors"
HITS_FILE = "hits.json"
LOCK_FILE = ".lock"
STALE_TEMP_S = 3600  # a temporary file this old belongs to a process that died mid-write
# Eviction and hit counts give up on a lock held longer: its holder may be suspended (Ctrl-Z), and
# waiting on it would hang the process's exit, which flushes the writes. Clearing waits a little more.
LOCK_WAIT_S = 2.0
CLEAR_LOCK_WAIT_S = 10.0
MAX_HITS_BYTES = 1 << 20  # hit counts are a few hundred bytes per model
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a symlink's target, never a wait
_KINDS = [(S_ISDIR, "a directory"), (S_ISLNK, "a symbolic link"), (S_ISFIFO, "a FIFO"), (S_ISSOCK, "a socket")]


class NotAFile(BadBlockFile):
    """What has a file's name is not a regular file, or is larger than it can be; ``stat`` is what was found."""

    def __init__(self, reason: str, stat: os.stat_result):
        super().__init__(reason)
        self.stat = stat


def model_key(model_id: str) -> str:
    """The prefix of a model's block file names."""
    return hashlib.blake2b(model_id.encode(), digest_size=8).hexdigest()


def block_files(directory, key: Optional[str] = None) -> list[tuple[Path, int, int]]:
    """(path, size, mtime in ns) of every block file in the directory, or only of the model ``key``.

    Only regular files count: anything else with a block file's name is removed where it is met.
    """
    found = []
    for entry in _named_as_blocks(directory, key):
        try:
            stat = entry.stat(follow_symlinks=False)
        except OSError:  # removed meanwhile by another process
            continue
        if S_ISREG(stat.st_mode):
            found.append((Path(entry.path), stat.st_size, stat.st_mtime_ns))
    return found


def _named_as_blocks(directory, key: Optional[str] = None) -> list[os.DirEntry]:
    """Every entry whose name is a block file's (of the model ``key``), whatever it is."""
    prefix = "" if key is None else key + "-"
    with os.scandir(directory) as it:
        return [entry for entry in it if entry.name.endswith(SUFFIX) and entry.name.startswith(prefix)]


def read_file(path, max_size: int) -> tuple[bytes, os.stat_result]:
    """The content of the regular file at ``path``, and its stat.

    Raises FileNotFoundError if nothing is there, NotAFile if what is there is not a
    regular file of at most ``max_size`` bytes, another OSError if it cannot be read now.
    """
    with open_file(path) as (file, stat):
        if stat.st_size > max_size:
            raise NotAFile(f"is {stat.st_size} bytes, larger than the {max_size} such a file can be", stat)
        return file.read(stat.st_size), stat


@contextlib.contextmanager
def open_file(path) -> Iterator[tuple[BinaryIO, os.stat_result]]:
    """The regular file at ``path``, open for reading, and its stat; NotAFile if something else is there.

    A symlink is never followed (to /dev/zero, say) and a FIFO never waited on.
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as e:
        if not isinstance(e, FileNotFoundError):  # O_NOFOLLOW refuses a symlink, a socket cannot be opened
            _check_regular(os.lstat(path))
        raise  # not there, or a regular file that cannot be opened now (too many open files...)
    try:
        stat = os.fstat(fd)
        _check_regular(stat)  # before open(), which refuses a directory with an error of its own
        file = open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with file:
        yield file, stat


def _check_regular(stat: os.stat_result) -> None:
    if not S_ISREG(stat.st_mode):
        kind = next((name for test, name in _KINDS if test(stat.st_mode)), "a device")
        raise NotAFile(f"is {kind}, not a file", stat)


def remove_entry(path, expected: Optional[os.stat_result] = None) -> None:
    """Remove what is at ``path``: a directory with its content, anything else unlinked (a symlink, not its target).

    With ``expected``, only if it is still that entry, not a file another process renamed there since.
    """
    found = os.lstat(path)
    if expected is not None and (found.st_dev, found.st_ino) != (expected.st_dev, expected.st_ino):
        return
    if S_ISDIR(found.st_mode):
        shutil.rmtree(path)  # which follows no symlink, not even one that replaced the directory meanwhile
    else:
        os.unlink(path)


@contextlib.contextmanager
def locked(directory, timeout: Optional[float] = None) -> Iterator[None]:
    """Hold the directory's lock: other processes' (and threads') ``locked`` wait meanwhile.

    TimeoutError if another holds it ``timeout`` seconds (None: wait as long as it takes).
    """
    with files.locked(Path(directory) / LOCK_FILE, timeout):
        yield


def remove_stale_temps(directory) -> None:
    """Remove the temporary files of writes that a dead process left behind."""
    cutoff = time.time() - STALE_TEMP_S
    for path in Path(directory).glob(files.TEMP_PREFIX + "*"):
        with contextlib.suppress(OSError):  # removed meanwhile; or not a file, so not a write of ours
            if path.lstat().st_mtime < cutoff:
                path.unlink()


def directory_info(directory) -> dict:
    """The directory's total size and block count, and blocks and bytes per model id; never fails."""
    try:
        found = block_files(directory)
    except OSError:  # no directory, or one that cannot be listed: no blocks to show
        found = []
    by_key: dict[str, list[tuple[Path, int]]] = {}
    for path, size, _ in found:
        by_key.setdefault(path.name.split("-", 1)[0], []).append((path, size))
    models = {
        _model_of([path for path, _ in entries], key): {"blocks": len(entries), "bytes": sum(s for _, s in entries)}
        for key, entries in by_key.items()
    }
    for model_id, counts in read_hits(directory).items():
        models.setdefault(model_id, {"blocks": 0, "bytes": 0}).update(counts)
    total = sum(size for _, size, _ in found)
    return {"directory": str(directory), "size_bytes": total, "blocks": len(found), "models": models}


def clear_directory(directory) -> int:
    """Remove everything named as a block file, of every model and whatever it is, and the hit counts.

    Returns how many blocks it removed. Raises TimeoutError if another process holds the
    lock ``CLEAR_LOCK_WAIT_S``, OSError if something cannot be removed.
    """
    if not Path(directory).is_dir():
        return 0
    removed = 0
    with locked(directory, CLEAR_LOCK_WAIT_S):
        for entry in _named_as_blocks(directory):
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile by another process
                remove_entry(entry.path)
                removed += 1
        with contextlib.suppress(FileNotFoundError):
            remove_entry(Path(directory) / HITS_FILE)
    return removed


def read_hits(directory) -> dict[str, dict[str, int]]:
    """The hit counts per model id; entries that are not two counts are left out."""
    try:
        counts = json.loads(read_file(Path(directory) / HITS_FILE, MAX_HITS_BYTES)[0])
    except (OSError, NotAFile, ValueError, RecursionError):
        return {}
    if not isinstance(counts, dict):
        return {}
    return {
        model_id: {"hits": entry["hits"], "misses": entry["misses"]}
        for model_id, entry in counts.items()
        if isinstance(entry, dict) and type(entry.get("hits")) is int and type(entry.get("misses")) is int
    }


def add_hits(directory, model_id: str, hits: int, misses: int) -> None:
    """Add one process's hit counts to the directory's.

    Raises OSError if they could not be added: TimeoutError if another process held the lock ``LOCK_WAIT_S``.
    """
    with locked(directory, LOCK_WAIT_S):
        counts = read_hits(directory)
        entry = counts.setdefault(model_id, {"hits": 0, "misses": 0})
        entry["hits"] += hits
        entry["misses"] += misses
        files.write_atomically(Path(directory) / HITS_FILE, json.dumps(counts).encode())


def _model_of(paths: list[Path], key: str) -> str:
    """The model id in the metadata of the first readable file (the key if none is)."""
    for path in paths:
        try:
            with open_file(path) as (file, stat):
                model_id = read_metadata(file, stat.st_size).get("model_id")
        except (OSError, BadBlockFile):
            continue
        if isinstance(model_id, str):
            return model_id
    return key
