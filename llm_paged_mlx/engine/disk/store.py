"""One model's disk tier of the prefix cache: find blocks, queue blocks for writing, keep to a budget.

A block's file is named by the model's key and the block's chain hash (see
``block_manager.chain_hash``), so a later process finds a conversation's blocks by
hashing its prompt; ``format`` says what a file holds and checks it. A file whose
content is malformed is removed with a warning and its tokens are recomputed; so is
anything else found at a block file's name: a directory, a symlink (never followed), a
FIFO (never waited on), a file larger than a block file of the model can be. A file
that cannot be read now (too many open files, an I/O error...) is tried again briefly,
then counts as not on disk and stays: the error may pass, and the file may be good.

Writes go to one background thread per directory in a process (``_Writer``), shared
by every ``KVDiskCache`` on that directory, whatever its model or budget. Each block
lands in a temporary file, is synced and renamed into place. After writing, the
writer brings each model it wrote for back under that model's budget: it lists the
model's files in the directory, under the directory's lock so that processes sharing
it do not race, and removes the least recently used (by mtime, which a hit refreshes)
down to ``LOW_WATER`` of the budget. Other models' files are theirs to budget. The lock
is waited for ``admin.LOCK_WAIT_S`` at most: its holder may be a suspended process, and
a process's exit waits for the writer. Eviction given up is tried after the next writes.

Caches close (finish their writes, add their hit counts) at the process's exit, unless
made with ``close_at_exit=False``: then their owner closes them.

The tier is a cache: no error of its files fails a request. The first change to the directory
that fails (a write, a hit's mtime, a removal, the lock, the hit counts; on a folder that is
read-only, full or another user's, or with a symlink where the lock should be) turns writing off
for that directory in this process, with one warning. Its blocks are still read: reading changes
nothing, and every file is checked. Nothing more is written, touched or removed there.

If the writer thread dies (only an error that is not an ``Exception`` can end it),
``flush`` and ``close`` stop waiting for it, the blocks it had not written are dropped
and counted (``dropped_writes``), one warning says so, and this process saves no more
blocks to that directory: a thread that died once would likely die again.
"""

import atexit
import collections
import os
import threading
import time
import warnings
import weakref
from pathlib import Path
from stat import S_ISREG
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from ... import files
from ..block_manager import chain_hash
from . import admin
from .format import BadBlockFile, decode, device, encode, host, max_file_size

LOW_WATER = 0.9  # eviction goes down to this fraction of the budget
READ_ATTEMPTS = 3  # tries to read a file whose read fails with an error other than "not there"
READ_RETRY_S = 0.01  # the pause between those tries
LIVENESS_POLL_S = 0.1  # how often a flush waiting on the writer checks that its thread still lives


class KVDiskCacheWarning(UserWarning):
    """A block file was unusable, or a read or write failed; the engine carried on without it."""


class KVDiskCache:
    """Full KV blocks of one model in ``directory`` (shared with other models), at most ``budget_bytes`` of them.

    ``max_pending_bytes`` bounds the host copies waiting for the writer: blocks
    beyond it are not saved, so a slow disk never holds up the engine. With
    ``close_at_exit`` (the default) the cache closes when the process exits;
    otherwise its owner calls ``close``.
    """

    def __init__(
        self,
        directory,
        model_id: str,
        budget_bytes: int = 4 * 1024**3,
        *,
        max_pending_bytes: int = 1024**3,
        close_at_exit: bool = True,
    ):
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.directory = Path(directory)
        self.model_id = model_id
        self.key = admin.model_key(model_id)
        self.budget_bytes = budget_bytes
        self.max_pending_bytes = max_pending_bytes
        self.hits = self.misses = self.read_errors = self.lock_timeouts = 0
        self.writes = self.write_errors = self.skipped_writes = self.dropped_writes = 0
        self._recorded = (0, 0)  # hits and misses already added to the directory's counts
        self._lock = threading.Lock()
        self._pending: dict[bytes, int] = {}  # chain hash -> bytes, queued or being written
        self._pending_bytes = 0
        self._clock = 0  # the last mtime given, in ns, so that order survives a coarse clock
        self._writer = _writer_for(self.directory)
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            self._writer.turn_off(f"could not make the folder ({e})")
        if close_at_exit:
            _CLOSE_AT_EXIT.add(self)

    # -- reading (the engine's thread) ------------------------------------------

    def load_chain(
        self, parent: Optional[bytes], blocks: Sequence[Sequence[int]], layout: Sequence[tuple[str, tuple, mx.Dtype]]
    ) -> list[list[mx.array]]:
        """The K/V of consecutive full blocks, up to the first one not on disk.

        ``blocks`` are the blocks' token ids, the first following the block whose
        chain hash is ``parent`` (None: the sequence's start). ``layout`` is the
        name, shape and dtype of each array a block holds (``ModelRunner.block_layout``). A
        malformed file, or anything but a file, is removed (unless writing is off), with a
        warning, and ends the chain; so does a file that cannot be read, which stays. Raises no OSError.
        """
        found = []
        for tokens in blocks:
            parent = chain_hash(parent, tokens)
            path = self._path(parent)
            read = self._read(path, max_file_size(len(tokens), layout))
            if read is None:
                break
            data, stat = read
            try:
                found.append((path, decode(data, self.model_id, parent, tokens, layout)))
            except BadBlockFile as e:
                self._discard(path, str(e), stat)
                break
        with self._lock:
            self.hits += len(found)
            self.misses += int(len(found) < len(blocks))
        if self._writer.writable():
            self._touch([path for path, _ in found])
        return [[device(a, dtype) for a, (_, _, dtype) in zip(kv, layout)] for _, kv in found]

    def _read(self, path: Path, max_size: int) -> Optional[tuple[bytes, os.stat_result]]:
        """The file's bytes and stat; None if it is not there, was no file of at most ``max_size``
        bytes (``_discard``, with a warning), or could not be read in ``READ_ATTEMPTS`` tries."""
        for attempt in range(READ_ATTEMPTS):
            if attempt:
                time.sleep(READ_RETRY_S)
            try:
                return admin.read_file(path, max_size)
            except FileNotFoundError:
                return None
            except admin.NotAFile as e:
                self._discard(path, str(e), e.stat)
                return None
            except OSError as e:
                error = e
        with self._lock:
            self.read_errors += 1
            first = self.read_errors == 1
        if first:
            message = f"KV disk cache: could not read {path.name} ({error}); its tokens are recomputed, the file kept"
            warnings.warn(message, KVDiskCacheWarning, stacklevel=3)
        return None

    def _discard(self, path: Path, reason: str, stat: os.stat_result) -> None:
        """Remove what was found at ``path`` (``stat``), unless a good file replaced it meanwhile or
        writing is off."""
        removed = self._writer.writable()
        if removed:
            try:
                admin.remove_entry(path, stat)
            except FileNotFoundError:  # removed meanwhile by another process
                pass
            except OSError as e:
                self._writer.turn_off(f"could not remove {path.name} ({e})")
                removed = False
        outcome = "removed it" if removed else "kept it"
        message = f"KV disk cache: {path.name} {reason}; {outcome}, its tokens are recomputed"
        warnings.warn(message, KVDiskCacheWarning, stacklevel=3)

    def _touch(self, paths: Sequence[Path]) -> None:
        """Refresh the mtimes of files just used, so that eviction takes them last (see ``_stamp``)."""
        base = self._stamp(len(paths))
        for position, path in enumerate(paths):
            mtime = base - position
            try:
                os.utime(path, ns=(mtime, mtime), follow_symlinks=False)
            except FileNotFoundError:  # evicted meanwhile
                pass
            except OSError as e:
                self._writer.turn_off(f"could not mark {path.name} as used ({e})")
                return

    # -- writing (the engine's thread queues, the writer's thread writes) ------------

    def save(
        self, token_ids: Sequence[int], block_ids: Sequence[int], block_size: int, read_blocks: Callable, names: Sequence[str]
    ) -> int:
        """Queue the sequence's full blocks ``block_ids`` that are not on disk; returns how many.

        ``block_ids`` hold the K/V of the first ``len(block_ids) * block_size``
        tokens; ``read_blocks(ids)`` returns their K/V as ``KVPools.read_blocks``
        does, arrays that the file names ``names``. A block whose tokens do not fill it is not saved: a lookup would take
        its file for a whole block. This thread only copies the data to host memory.
        """
        todo, parent = [], None
        for index in range(min(len(block_ids), len(token_ids) // block_size)):
            tokens = token_ids[index * block_size : (index + 1) * block_size]
            parent = chain_hash(parent, tokens)
            if parent not in self._pending and not _is_file(self._path(parent)):
                todo.append((parent, tokens, block_ids[index]))
        if not todo:
            return 0
        if not self._writer.accepts():
            with self._lock:
                self.skipped_writes += len(todo)
            return 0
        data = read_blocks([block_id for _, _, block_id in todo])
        mx.eval(data)
        arrays = [host(a).reshape(len(todo), -1, a.shape[-1]) for a in data]
        block_bytes = sum(a[0].nbytes for a in arrays)
        queued, base = 0, self._stamp(len(todo))
        for index, (digest, tokens, _) in enumerate(todo):
            with self._lock:
                if self._pending_bytes + block_bytes > self.max_pending_bytes:
                    self.skipped_writes += len(todo) - index
                    break
                self._pending[digest] = block_bytes
                self._pending_bytes += block_bytes
            job = (digest, np.asarray(tokens, dtype=np.int64), [a[index] for a in arrays], names, base - index)
            if not self._writer.submit(self, job):  # it died since
                with self._lock:
                    self._pending_bytes -= self._pending.pop(digest)
                    self.skipped_writes += len(todo) - index
                break
            queued += 1
        return queued

    def flush(self) -> None:
        """Wait until every block queued for this directory is written (or has failed, or was dropped)."""
        self._writer.wait()

    def close(self) -> None:
        """Finish the writes and add this process's hit counts to the directory's."""
        self.flush()
        with self._lock:
            hits, misses = self.hits - self._recorded[0], self.misses - self._recorded[1]
            self._recorded = (self.hits, self.misses)
        if not (hits or misses) or not self._writer.writable():  # counts are a report: losing them loses no data
            return
        try:
            admin.add_hits(self.directory, self.model_id, hits, misses)
        except TimeoutError:
            with self._lock:  # a later close adds them
                self._recorded = (self._recorded[0] - hits, self._recorded[1] - misses)
            self._lock_timed_out("this process's hit counts not added")
        except OSError as e:
            self._writer.turn_off(f"could not add the hit counts ({e})")

    def _write(self, job) -> bool:
        """Write one block's file (the writer's thread); False if writing is off, or it failed and turned it off."""
        digest, tokens, kv, names, mtime = job
        if not self._writer.writable():  # a write failed since this block was queued
            with self._lock:
                self.skipped_writes += 1
            return False
        try:
            files.write_atomically(self._path(digest), encode(tokens, kv, names, self.model_id, digest), mtime_ns=mtime)
        except Exception as e:  # a full disk, a read-only folder...: the engine goes on without it
            with self._lock:
                self.write_errors += 1
            self._writer.turn_off(f"could not write a block ({e})")
            return False
        with self._lock:
            self.writes += 1
        return True

    def _release(self, job, dropped: bool = False) -> None:
        """The block is no longer pending: written, failed, or ``dropped`` with a dead writer."""
        with self._lock:
            self._pending_bytes -= self._pending.pop(job[0])
            self.dropped_writes += dropped

    def _evict(self) -> None:
        """If this model's files exceed the budget, remove its least recently used down to ``LOW_WATER`` of it.

        A chain's later blocks have older mtimes (see ``_stamp``), so a tail goes before its prefix.
        """
        if not self._writer.writable():
            return
        try:
            with admin.locked(self.directory, admin.LOCK_WAIT_S):
                files = sorted(admin.block_files(self.directory, self.key), key=lambda entry: entry[2])
                size = sum(file_size for _, file_size, _ in files)
                if size <= self.budget_bytes:
                    return
                for path, file_size, _ in files:
                    if size <= self.budget_bytes * LOW_WATER:
                        break
                    path.unlink(missing_ok=True)
                    size -= file_size
        except TimeoutError:
            self._lock_timed_out("eviction put off to the next writes")
        except OSError as e:
            self._writer.turn_off(f"could not evict ({e})")

    def _lock_timed_out(self, consequence: str) -> None:
        """Another process held the directory's lock too long: say so the first time."""
        with self._lock:
            self.lock_timeouts += 1
            first = self.lock_timeouts == 1
        if first:
            lock = self.directory / admin.LOCK_FILE
            message = f"KV disk cache: {lock} held by another process for {admin.LOCK_WAIT_S:g} s; {consequence}"
            warnings.warn(message, KVDiskCacheWarning)

    # -- housekeeping -------------------------------------------------------------------

    def info(self) -> dict:
        """``directory_info`` plus the budget and this cache's counts: blocks found (hits), lookups that
        stopped at a block not on disk (misses), files that could not be read, blocks written, failed,
        skipped (over ``max_pending_bytes``, writing was off or the writer dead) and dropped by a dying writer,
        and evictions or hit counts given up on a lock another process held too long."""
        self.flush()
        return {
            **admin.directory_info(self.directory),
            "budget_bytes": self.budget_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "read_errors": self.read_errors,
            "writes": self.writes,
            "write_errors": self.write_errors,
            "skipped_writes": self.skipped_writes,
            "dropped_writes": self.dropped_writes,
            "lock_timeouts": self.lock_timeouts,
        }

    def clear(self) -> int:
        """Remove every block file in the directory, of every model; returns how many."""
        self.flush()
        return admin.clear_directory(self.directory)

    # -- helpers --------------------------------------------------------------------

    def _path(self, digest: bytes) -> Path:
        return self.directory / f"{self.key}-{digest.hex()}{admin.SUFFIX}"

    def _stamp(self, count: int) -> int:
        """A time (ns) for ``count`` blocks of a sequence used together: block ``i`` gets the time less ``i``.

        So the later blocks of a sequence look older and eviction takes a chain's
        tail before the prefix it hangs on; and every call's times are later than
        the previous call's, however coarse the clock.
        """
        with self._lock:
            self._clock = max(time.time_ns(), self._clock + count)
            return self._clock


def _is_file(path: Path) -> bool:
    """Whether a regular file is at ``path`` (a symlink to one is not: it is replaced when found)."""
    try:
        return S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


_CLOSE_AT_EXIT: weakref.WeakSet = weakref.WeakSet()  # the live caches that close at exit


@atexit.register
def _close_at_exit() -> None:
    """Close the caches still alive: a CLI process ends right after its answer, with writes queued."""
    for cache in list(_CLOSE_AT_EXIT):
        cache.close()


class _Writer:
    """The thread that writes block files into one directory, for every ``KVDiskCache`` of this process on it."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._cond = threading.Condition()
        self._queued: collections.deque = collections.deque()  # (cache, job) not yet taken by the thread
        self._taken: collections.deque = collections.deque()  # taken, not yet written; the thread's alone
        self._unfinished = 0  # jobs queued or taken whose write and eviction are not done
        self._dead = False
        self._cause: Optional[BaseException] = None  # what ended the thread, if it said
        self._off: Optional[str] = None  # the failure that turned writing to the directory off
        self._thread = threading.Thread(target=self._run, name=f"kv-disk-cache {directory}", daemon=True)
        self._thread.start()

    def submit(self, cache: KVDiskCache, job) -> bool:
        """Queue a block of ``cache``; False if writing is off or the thread is dead."""
        with self._cond:
            if self._off is not None or not self._alive():
                return False
            self._queued.append((cache, job))
            self._unfinished += 1
            self._cond.notify_all()
        return True

    def accepts(self) -> bool:
        """Whether a block submitted now would be written: writing is on and the thread lives."""
        with self._cond:
            return self._off is None and self._alive()

    def writable(self) -> bool:
        """Whether this process still changes the directory: no change to it has failed."""
        return self._off is None

    def turn_off(self, failure: str) -> None:
        """Change the directory no more in this process; the first ``failure`` is said in a warning."""
        with self._cond:
            first = self._off is None
            if first:
                self._off = failure
        if first:
            message = (
                f"KV disk cache: {failure}; this process writes nothing more to {self.directory}"
                " (it still reads the blocks there)"
            )
            warnings.warn(message, KVDiskCacheWarning)

    def wait(self) -> None:
        """Until every queued job is done, or the thread is dead."""
        with self._cond:
            while self._unfinished and self._alive():
                self._cond.wait(LIVENESS_POLL_S)

    def _alive(self) -> bool:
        """Whether the thread runs; the first time it is found dead, its jobs are dropped with a warning."""
        if self._dead or self._thread.is_alive():
            return not self._dead
        self._dead = True
        lost = [*self._taken, *self._queued]
        self._taken.clear()
        self._queued.clear()
        self._unfinished = 0
        for cache, job in lost:
            cache._release(job, dropped=True)
        cause = f" ({self._cause!r})" if self._cause is not None else ""
        message = (
            f"KV disk cache: the writer thread for {self.directory} stopped{cause}; {len(lost)} blocks were not"
            " written, and this process saves no more blocks there"
        )
        warnings.warn(message, KVDiskCacheWarning, stacklevel=4)
        return False

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queued:
                        self._cond.wait()
                    self._taken.extend(self._queued)
                    self._queued.clear()
                    count = len(self._taken)
                self._write_taken()
                with self._cond:
                    self._unfinished -= count
                    self._cond.notify_all()
        except BaseException as e:  # Exceptions are handled per job: this is an exit, and waiters must know
            self._cause = e
            raise

    def _write_taken(self) -> None:
        """Write the jobs taken, then evict for each cache written to. Apart from ``_run``, so that no
        cache stays referenced while the thread waits: caches are freed when their owners drop them."""
        wrote = {}
        while self._taken:
            cache, job = self._taken[0]
            if cache._write(job):
                wrote[id(cache)] = cache
            self._taken.popleft()  # before the release: a job found in _taken is released as dropped
            cache._release(job)
        for cache in wrote.values():  # once per batch: listing the directory costs more than a write
            cache._evict()


_WRITERS: dict[str, _Writer] = {}  # real path of the directory -> its writer
_WRITERS_LOCK = threading.Lock()


def _writer_for(directory: Path) -> _Writer:
    """The directory's writer, started (after sweeping a dead process's temporary files) on first use."""
    key = os.path.realpath(directory)
    with _WRITERS_LOCK:
        if key not in _WRITERS:
            admin.remove_stale_temps(directory)
            _WRITERS[key] = _Writer(directory)
        return _WRITERS[key]
