"""The disk tier of the prefix cache: full KV blocks kept as safetensors files across processes.

A block's file is named by the model's key and the block's chain hash (see
``block_manager.chain_hash``), so a later process finds a conversation's blocks
by hashing its prompt. Each file holds one tensor per layer for K and for V (the
block's rows as ``ModelRunner.read_blocks`` returns them), the block's token ids,
and metadata: format name and version, model id, chain hash and a checksum of the
contents. A file that fails any check is removed with a warning and its tokens
are recomputed. Writes go through a queue to one background thread, land in a
temporary file and are renamed into place; when the directory grows past its
budget the least recently used files (by mtime, which a hit refreshes) go first.
"""

import atexit
import contextlib
import hashlib
import json
import os
import queue
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np
from safetensors.numpy import save as safetensors_bytes
from safetensors.numpy import load as safetensors_arrays

from .block_manager import chain_hash

FORMAT = "llm-paged-mlx-kv"
VERSION = "1"
SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"
HITS_FILE = "hits.json"  # blocks found and lookups that missed, per model id, over all processes
STALE_TEMP_S = 3600  # a temporary file this old belongs to a process that died mid-write
LOW_WATER = 0.9  # eviction goes down to this fraction of the budget


class KVDiskCacheWarning(UserWarning):
    """A block file was unusable, or a write failed; the engine carried on without it."""


class BadBlockFile(Exception):
    """Why a block file cannot be used."""


def model_identity(model_path, **settings) -> str:
    """A model id for the disk cache: the folder, its config and weight files, and load settings.

    Re-converting or editing the model changes the id, so stale blocks are never found.
    ``settings`` are what else shapes the K/V, e.g. ``dtype="float32"``.
    """
    path = Path(model_path).resolve()
    digest = hashlib.blake2b((path / "config.json").read_bytes(), digest_size=16)
    for weights in sorted(path.glob("*.safetensors")):
        stat = weights.stat()
        digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    extra = ",".join(f"{k}={v}" for k, v in sorted(settings.items()))
    return f"{path}#{digest.hexdigest()}" + (f"#{extra}" if extra else "")


def _host(array: mx.array) -> np.ndarray:
    """A numpy copy of an evaluated array (bfloat16 travels as its raw 16 bits)."""
    return np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)


def _storage_dtype(dtype: mx.Dtype) -> np.dtype:
    return np.dtype("uint16" if dtype == mx.bfloat16 else str(dtype).rsplit(".", 1)[-1])


def _checksum(token_ids: np.ndarray, kv: Sequence[np.ndarray]) -> str:
    digest = hashlib.blake2b(token_ids.tobytes(), digest_size=16)
    for array in kv:
        digest.update(np.ascontiguousarray(array).data)
    return digest.hexdigest()


def _tensor_name(index: int) -> str:
    """The name of a block's ``index``-th array in ``read_blocks`` order: k.0, v.0, k.1, ..."""
    return f"{'kv'[index % 2]}.{index // 2}"


def _write_all(file, payload: bytes) -> None:
    file.write(payload)


class KVDiskCache:
    """Full KV blocks of one model in ``directory`` (shared with other models), at most ``budget_bytes``.

    ``max_pending_bytes`` bounds the host copies waiting for the writer: blocks
    beyond it are not saved, so a slow disk never holds up the engine.
    """

    def __init__(self, directory, model_id: str, budget_bytes: int = 4 * 1024**3, *, max_pending_bytes: int = 1024**3):
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.model_id = model_id
        self.key = hashlib.blake2b(model_id.encode(), digest_size=8).hexdigest()
        self.budget_bytes = budget_bytes
        self.max_pending_bytes = max_pending_bytes
        self.hits = self.misses = self.writes = self.write_errors = self.skipped_writes = 0
        self._recorded = (0, 0)  # hits and misses already added to HITS_FILE
        self._lock = threading.Lock()
        self._pending: dict[bytes, int] = {}  # chain hash -> bytes, queued or being written
        self._pending_bytes = 0
        self._queue: queue.Queue = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        self._clock = 0  # the last mtime given, in ns, so that order survives a coarse clock
        self._remove_stale_temps()
        self._size = sum(size for _, size, _ in _block_files(self.directory))
        atexit.register(self.close)  # a CLI process ends right after its answer

    # -- reading (the engine's thread) ------------------------------------------

    def load_chain(
        self, parent: Optional[bytes], blocks: Sequence[Sequence[int]], layout: Sequence[tuple[tuple, mx.Dtype]]
    ) -> list[list[mx.array]]:
        """The K/V of consecutive full blocks, up to the first one not on disk.

        ``blocks`` are the blocks' token ids, the first following the block whose
        chain hash is ``parent`` (None: the sequence's start). ``layout`` is the
        (shape, dtype) of each array a block holds, in ``read_blocks`` order. A
        file that fails a check is removed, with a warning, and ends the chain.
        """
        found = []
        for tokens in blocks:
            parent = chain_hash(parent, tokens)
            path = self._path(parent)
            try:
                found.append((path, self._decode(path.read_bytes(), parent, tokens, layout)))
            except FileNotFoundError:
                break
            except (BadBlockFile, OSError) as e:
                self._discard(path, str(e))
                break
        self.hits += len(found)
        if len(found) < len(blocks):
            self.misses += 1
        base = self._stamp(len(found))
        for position, (path, _) in enumerate(found):
            self._touch(path, base - position)
        return [[self._device(a, dtype) for a, (_, dtype) in zip(kv, layout)] for _, kv in found]

    @staticmethod
    def _device(array: np.ndarray, dtype: mx.Dtype) -> mx.array:
        return mx.array(array).view(dtype) if dtype == mx.bfloat16 else mx.array(array)

    def _decode(self, data: bytes, digest: bytes, token_ids, layout) -> list[np.ndarray]:
        try:
            header_len = int.from_bytes(data[:8], "little")
            meta = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
        except (ValueError, AttributeError):
            raise BadBlockFile("is not a safetensors file (corrupt or truncated)") from None
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            found = f"{meta.get('format')!r} version {meta.get('version')!r}"
            raise BadBlockFile(f"has format {found}, not {FORMAT!r} version {VERSION!r}")
        if meta.get("model_id") != self.model_id:
            raise BadBlockFile(f"belongs to another model ({meta.get('model_id')!r})")
        if meta.get("chain_hash") != digest.hex():
            raise BadBlockFile("holds another block than its name says")
        try:
            arrays = safetensors_arrays(data)
        except Exception:  # safetensors raises its own error type for bad offsets and sizes
            raise BadBlockFile("is corrupt or truncated") from None
        names = [_tensor_name(index) for index in range(len(layout))]
        if sorted(arrays) != sorted(names + ["token_ids"]):
            raise BadBlockFile("does not have the tensors this model's K/V needs")
        if arrays["token_ids"].tolist() != list(token_ids):
            raise BadBlockFile("holds other tokens than the prompt")
        kv = [arrays[name] for name in names]
        for array, (shape, dtype) in zip(kv, layout):
            if array.shape != tuple(shape) or array.dtype != _storage_dtype(dtype):
                raise BadBlockFile(f"has K/V of shape {array.shape} {array.dtype}, not {tuple(shape)} {dtype}")
        if _checksum(arrays["token_ids"], kv) != meta.get("checksum"):
            raise BadBlockFile("fails its checksum (corrupt)")
        return kv

    # -- writing ------------------------------------------------------------------

    def save(self, token_ids: Sequence[int], block_ids: Sequence[int], block_size: int, read_blocks: Callable) -> int:
        """Queue the sequence's full blocks ``block_ids`` that are not on disk; returns how many.

        ``block_ids`` hold the K/V of the first ``len(block_ids) * block_size``
        tokens; ``read_blocks(ids)`` returns their K/V as ``ModelRunner.read_blocks``
        does. This thread only copies the data to host memory; a worker writes it.
        """
        todo, parent = [], None
        for index, block_id in enumerate(block_ids):
            tokens = token_ids[index * block_size : (index + 1) * block_size]
            parent = chain_hash(parent, tokens)
            if parent not in self._pending and not self._path(parent).exists():
                todo.append((parent, tokens, block_id))
        if not todo:
            return 0
        data = read_blocks([block_id for _, _, block_id in todo])
        mx.eval(data)
        host = [_host(a).reshape(len(todo), -1, a.shape[-1]) for a in data]
        block_bytes = sum(a[0].nbytes for a in host)
        queued, base = 0, self._stamp(len(todo))
        for index, (digest, tokens, _) in enumerate(todo):
            with self._lock:
                if self._pending_bytes + block_bytes > self.max_pending_bytes:
                    self.skipped_writes += len(todo) - index
                    break
                self._pending[digest] = block_bytes
                self._pending_bytes += block_bytes
            self._start_worker()
            self._queue.put((digest, np.asarray(tokens, dtype=np.int64), [a[index] for a in host], base - index))
            queued += 1
        return queued

    def flush(self) -> None:
        """Wait until every queued block is written (or has failed)."""
        self._queue.join()

    def close(self) -> None:
        """Finish the writes and add this process's hit counts to the directory's."""
        self.flush()
        with self._lock:
            hits, misses = self.hits - self._recorded[0], self.misses - self._recorded[1]
            self._recorded = (self.hits, self.misses)
        if hits or misses:
            counts = _read_hits(self.directory)
            entry = counts.setdefault(self.model_id, {"hits": 0, "misses": 0})
            entry["hits"] += hits
            entry["misses"] += misses
            temp = None
            try:  # counts are a report, not data: a failed write only loses them
                fd, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".part", dir=self.directory)
                with open(fd, "w") as file:
                    json.dump(counts, file)
                os.replace(temp, self.directory / HITS_FILE)
            except OSError:
                if temp:
                    Path(temp).unlink(missing_ok=True)

    def _start_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="kv-disk-cache", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while True:
            digest, tokens, kv, mtime = self._queue.get()
            try:
                self._write(digest, tokens, kv, mtime)
            except Exception as e:  # a full disk, a read-only folder...: the engine goes on without it
                with self._lock:
                    self.write_errors += 1
                    first = self.write_errors == 1
                if first:
                    warnings.warn(f"KV disk cache: could not write to {self.directory}: {e}", KVDiskCacheWarning)
            finally:
                with self._lock:
                    self._pending_bytes -= self._pending.pop(digest)
                self._queue.task_done()

    def _write(self, digest: bytes, tokens: np.ndarray, kv: list[np.ndarray], mtime: int) -> None:
        arrays = {"token_ids": tokens}
        for index, array in enumerate(kv):
            arrays[_tensor_name(index)] = array
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "model_id": self.model_id,
            "chain_hash": digest.hex(),
            "checksum": _checksum(tokens, kv),
        }
        payload = safetensors_bytes(arrays, metadata=meta)
        fd, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".part", dir=self.directory)  # mode 0600
        try:
            with open(fd, "wb") as file:
                _write_all(file, payload)
            self._touch(temp, mtime)
            path = self._path(digest)
            old = path.stat().st_size if path.exists() else 0
            os.replace(temp, path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
        with self._lock:
            self.writes += 1
            self._size += len(payload) - old
            over = self._size > self.budget_bytes
        if over:
            self._evict()

    # -- size and eviction ----------------------------------------------------------

    def _evict(self) -> None:
        """Remove the least recently used files (of any model) down to ``LOW_WATER`` of the budget."""
        files = sorted(_block_files(self.directory), key=lambda entry: entry[2])
        size = sum(entry[1] for entry in files)
        for path, file_size, _ in files:
            if size <= self.budget_bytes * LOW_WATER:
                break
            path.unlink(missing_ok=True)
            size -= file_size
        with self._lock:
            self._size = size

    def _remove_stale_temps(self) -> None:
        cutoff = time.time() - STALE_TEMP_S
        for path in self.directory.glob(TEMP_PREFIX + "*"):
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()

    # -- housekeeping -------------------------------------------------------------------

    def info(self) -> dict:
        """``directory_info`` plus the budget and this cache's counts: blocks found (hits), lookups
        that stopped at a block not on disk (misses), blocks written, failed and skipped."""
        self.flush()
        return {
            **directory_info(self.directory),
            "budget_bytes": self.budget_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "writes": self.writes,
            "write_errors": self.write_errors,
            "skipped_writes": self.skipped_writes,
        }

    def clear(self) -> int:
        """Remove every block file in the directory, of every model; returns how many."""
        self.flush()
        with self._lock:
            self._size = 0
        return clear_directory(self.directory)

    # -- helpers --------------------------------------------------------------------

    def _path(self, digest: bytes) -> Path:
        return self.directory / f"{self.key}-{digest.hex()}{SUFFIX}"

    def _stamp(self, count: int) -> int:
        """A time (ns) for ``count`` blocks of a sequence used together: block ``i`` gets the time less ``i``.

        So the later blocks of a sequence look older and eviction takes a chain's
        tail before the prefix it hangs on; and every call's times are later than
        the previous call's, however coarse the clock.
        """
        with self._lock:
            self._clock = max(time.time_ns(), self._clock + count)
            return self._clock

    @staticmethod
    def _touch(path, mtime: int) -> None:
        with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
            os.utime(path, ns=(mtime, mtime))

    def _discard(self, path: Path, reason: str) -> None:
        message = f"KV disk cache: {path.name} {reason}; removed it, its tokens are recomputed"
        warnings.warn(message, KVDiskCacheWarning, stacklevel=3)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


# -- the directory, for any model (what ``llm paged-mlx cache`` shows and clears) ---------


def _block_files(directory) -> list[tuple[Path, int, int]]:
    """(path, size, mtime in ns) of every block file in the directory."""
    entries = []
    with os.scandir(directory) as it:
        for entry in it:
            if entry.name.endswith(SUFFIX):
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # removed meanwhile by another process
                    continue
                entries.append((Path(entry.path), stat.st_size, stat.st_mtime_ns))
    return entries


def directory_info(directory) -> dict:
    """The directory's total size and block count, and blocks and bytes per model id."""
    files = _block_files(directory) if Path(directory).is_dir() else []
    by_key: dict[str, list[tuple[Path, int]]] = {}
    for path, size, _ in files:
        by_key.setdefault(path.name.split("-", 1)[0], []).append((path, size))
    models = {
        _model_of([path for path, _ in entries], key): {"blocks": len(entries), "bytes": sum(s for _, s in entries)}
        for key, entries in by_key.items()
    }
    for model_id, counts in _read_hits(directory).items():
        models.setdefault(model_id, {"blocks": 0, "bytes": 0}).update(counts)
    total = sum(size for _, size, _ in files)
    return {"directory": str(directory), "size_bytes": total, "blocks": len(files), "models": models}


def clear_directory(directory) -> int:
    """Remove every block file of every model in the directory, and the hit counts; returns how many."""
    files = _block_files(directory) if Path(directory).is_dir() else []
    for path, _, _ in files:
        path.unlink(missing_ok=True)
    (Path(directory) / HITS_FILE).unlink(missing_ok=True)
    return len(files)


def _read_hits(directory) -> dict:
    try:
        counts = json.loads((Path(directory) / HITS_FILE).read_text())
        return counts if isinstance(counts, dict) else {}
    except (OSError, ValueError):
        return {}


def _model_of(paths: list[Path], key: str) -> str:
    """The model id in the metadata of the first readable file (the key if none is)."""
    for path in paths:
        try:
            with open(path, "rb") as file:
                header = file.read(int.from_bytes(file.read(8), "little"))
            return json.loads(header)["__metadata__"]["model_id"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return key
