"""Swap policies: what happens to a preempted request's K/V.

``swap_out(blocks, pools)`` runs when a request is preempted, before its
blocks are reused, and returns a handle (or None to recompute the tokens
later). ``swap_in(handle, blocks, pools)`` writes the kept K/V into the
request's new blocks when it is resumed; a failed step may undo that, so the
handle must still work until it is released. A policy that keeps its copies
somewhere that needs releasing (a file, say) also has ``discard(handle)``:
the engine calls it once a handle is no longer needed (swapped in by a step
that went through, its request finished, or its preemption undone with a
failed step).

``pools`` are the engine's ``KVPools`` (``engine.kv_pools``; with a draft
model, both models' as one). What ``pools.read_blocks`` returns is a list of arrays of any dtype (K and V,
or packed values, scales and biases of quantized pools) that
``pools.write_blocks`` takes back: a policy keeps them bit for bit and
looks no further. The built-in policies:

- ``recompute``: keeps nothing; the request is prefilled again.
- ``cpu``: copies the K/V to host memory (numpy arrays).
- ``disk``: copies them to host memory, then a background thread writes them
  to a file (mode 0600) in a private temporary folder and drops the copy; the
  files go when released and at exit. Within a byte budget: past it, recompute.
- ``auto``: recompute short requests, else ``disk`` on unified
  memory (Metal), where host memory is the device's, and ``cpu`` on a discrete
  GPU or the CPU backend while the host has room.
"""

import atexit
import functools
import itertools
import math
import os
import queue
import shutil
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ..hookspecs import hookimpl
from .disk.format import device, host
from .memory import available_ram

DEFAULT_DISK_BUDGET = 16 * 1024**3  # bytes of swap files at once
RECOMPUTE_TOKENS = 512  # ``auto`` recomputes requests of at most this many computed tokens


class SwapWarning(RuntimeWarning):
    """A swap policy could not keep K/V where it meant to (nothing is lost: kept in memory, or computed again)."""


class RecomputePolicy:
    """Drop the K/V; the request is prefilled again (cached prefix blocks make that cheap)."""

    name = "recompute"

    def swap_out(self, blocks, pools):
        return None

    def swap_in(self, handle, blocks, pools):
        raise RuntimeError("recompute keeps nothing to swap in")


class CPUSwapPolicy:
    """Copy the K/V of a preempted request to host memory and back."""

    name = "cpu"

    def swap_out(self, blocks, pools):
        if not blocks:
            return None
        data = pools.read_blocks(blocks)
        mx.eval(data)
        return [(host(a), a.dtype) for a in data]

    def swap_in(self, handle, blocks, pools):
        pools.write_blocks(blocks, [device(a, dtype) for a, dtype in handle])


@dataclass(eq=False)
class SwapFile:
    """A disk swap handle: its file, the layout of the arrays in it, and the arrays while they are not written."""

    path: Path
    layout: list  # (shape, numpy dtype, MLX dtype) of each array, in file order
    nbytes: int
    arrays: Optional[list] = None  # host copies: until the file is written, or for good if writing failed
    discarded: bool = False


class DiskSwapPolicy:
    """Write the K/V of a preempted request to a file and read it back.

    ``directory`` is where the policy makes its private folder (default: the
    system's temporary folder); ``budget_bytes`` caps the bytes kept at once:
    a swap-out past it returns None (recompute). ``swap_out`` copies the
    arrays to host memory and returns; a background thread writes the file
    (raw bytes, in ``read_blocks`` order) and then drops the host copy. Until
    then, or for good if the write failed (a full disk: warned once),
    ``swap_in`` uses that copy. Files go when their handle is discarded, and
    the folder with ``close()``, which runs at exit.
    """

    name = "disk"

    def __init__(self, directory=None, budget_bytes: int = DEFAULT_DISK_BUDGET):
        self.parent = directory
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.directory: Optional[Path] = None  # made at first use
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # for the writer thread: writes and removals, in order
        self._writer: Optional[threading.Thread] = None
        self._names = itertools.count()
        self._lock = threading.Lock()  # ``close`` may run at exit while another thread still steps the engine
        self._closed = False
        self._error: Optional[BaseException] = None  # the first write error (set on the writer thread)
        self._warned = False

    def swap_out(self, blocks, pools):
        if not blocks:
            return None
        data = pools.read_blocks(blocks)
        nbytes = sum(a.nbytes for a in data)
        if self.used_bytes + nbytes > self.budget_bytes:
            return None
        mx.eval(data)
        arrays = [host(a) for a in data]
        handle = None
        with self._lock:
            if not self._closed and (self.directory is not None or self._start()):
                path = self.directory / f"{next(self._names)}.kv"
                handle = SwapFile(path, [(a.shape, a.dtype, d.dtype) for a, d in zip(arrays, data)], nbytes, arrays)
                self._jobs.put(functools.partial(self._write, handle, arrays))
                self.used_bytes += nbytes
        self._warn_failed()
        return handle

    def swap_in(self, handle: SwapFile, blocks, pools):
        self._warn_failed()
        arrays = handle.arrays  # one read: the writer drops it once the file is whole
        if arrays is None:
            arrays = self._read(handle)
        pools.write_blocks(blocks, [device(a, dtype) for a, (_, _, dtype) in zip(arrays, handle.layout)])

    def discard(self, handle: SwapFile):
        if handle.discarded:
            return
        handle.discarded, handle.arrays = True, None  # a write not started is skipped
        self.used_bytes -= handle.nbytes
        self._jobs.put(functools.partial(handle.path.unlink, missing_ok=True))  # after its write, if any
        self._warn_failed()

    def wait(self) -> None:
        """Wait until every write and removal queued so far is done."""
        done = threading.Event()
        with self._lock:
            if self._writer is None or self._closed:
                return
            self._jobs.put(done.set)
        done.wait()
        self._warn_failed()

    def close(self) -> None:
        """Stop writing (a write under way ends first) and remove the folder; swap-outs recompute from now on."""
        with self._lock:
            self._closed = True
            if self._writer is not None:
                self._jobs.put(None)
                self._writer.join()
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)
            atexit.unregister(self.close)

    def _start(self) -> bool:
        """Make the folder and start the writer; False (warned once) if the folder cannot be made."""
        try:
            if self.parent is not None:
                os.makedirs(self.parent, exist_ok=True)
            self.directory = Path(tempfile.mkdtemp(prefix="llm-paged-mlx-swap-", dir=self.parent))  # mode 0700
        except OSError as e:
            self._error = self._error or e
            return False
        # A daemon thread: the interpreter's exit does not wait for queued writes, ``close`` skips them.
        self._writer = threading.Thread(target=self._run, name="llm-paged-mlx-swap", daemon=True)
        self._writer.start()
        atexit.register(self.close)
        return True

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception as e:  # a file that could not be removed: the folder goes at exit
                self._error = self._error or e

    def _write(self, handle: SwapFile, arrays: list) -> None:
        """On the writer thread: the file, whole, then the host copy goes; on failure the copy stays."""
        if handle.discarded or self._closed:
            return
        try:
            fd = os.open(handle.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(fd, "wb") as file:
                for array in arrays:
                    _write_array(file, array)
        except Exception as e:
            self._error = self._error or e
            handle.path.unlink(missing_ok=True)
            return
        handle.arrays = None

    def _read(self, handle: SwapFile) -> list:
        try:
            raw = handle.path.read_bytes()
        except OSError as e:
            raise RuntimeError(f"swap file {handle.path} cannot be read back ({e})") from e
        if len(raw) != handle.nbytes:
            raise RuntimeError(f"swap file {handle.path} holds {len(raw)} bytes, not {handle.nbytes}")
        arrays, offset = [], 0
        for shape, dtype, _ in handle.layout:
            count = math.prod(shape)
            arrays.append(np.frombuffer(raw, dtype, count, offset).reshape(shape))
            offset += count * dtype.itemsize
        return arrays

    def _warn_failed(self) -> None:
        if self._error is not None and not self._warned:
            self._warned = True
            warnings.warn(
                f"swap policy disk: could not write to {self.parent or tempfile.gettempdir()} ({self._error}); "
                "swapped K/V stay in host memory, or are computed again",
                SwapWarning,
            )


def _write_array(file, array: np.ndarray) -> None:  # apart, so that tests can make the disk fail
    file.write(np.ascontiguousarray(array).data)


class AutoSwapPolicy:
    """Pick a tier per swap-out: recompute, ``cpu`` or ``disk`` (see the module docstring).

    ``tier`` ("recompute", "cpu" or "disk") forces one; ``recompute_tokens`` is
    the most computed tokens a request recomputes. The handle remembers the
    policy that made it, for ``swap_in`` and ``discard``.
    """

    name = "auto"

    def __init__(self, tier: Optional[str] = None, recompute_tokens: int = RECOMPUTE_TOKENS):
        self.tier = tier
        self.recompute_tokens = recompute_tokens
        self.tiers = {"recompute": RecomputePolicy(), "cpu": CPUSwapPolicy(), "disk": DiskSwapPolicy()}

    def choose(self, blocks, pools) -> str:
        if self.tier is not None:
            return self.tier
        # A sequence of recompute_tokens tokens holds this many blocks over its tables (a windowed one, its
        # window's only).
        if len(blocks) <= pools.groups.blocks_for(self.recompute_tokens, pools.block_size):
            return "recompute"
        if unified_memory():
            return "disk"
        nbytes = sum(a.nbytes for a in pools.read_blocks(blocks))  # lazy arrays: only their sizes are read
        return "cpu" if host_has_room(nbytes) else "disk"

    def swap_out(self, blocks, pools):
        policy = self.tiers[self.choose(blocks, pools)]
        handle = policy.swap_out(blocks, pools)
        return None if handle is None else (policy, handle)

    def swap_in(self, handle, blocks, pools):
        policy, inner = handle
        policy.swap_in(inner, blocks, pools)

    def discard(self, handle):
        policy, inner = handle
        if hasattr(policy, "discard"):
            policy.discard(inner)


def unified_memory() -> bool:
    """Whether MLX computes on a GPU that shares the host's memory (Apple silicon)."""
    return mx.default_device().type == mx.DeviceType.gpu and mx.metal.is_available()


def host_has_room(nbytes: int) -> bool:
    """Whether a host copy of ``nbytes`` takes at most half of the available memory."""
    available = available_ram()
    return available is not None and nbytes <= available // 2


@hookimpl
def register_swap_policies(register):
    register("recompute", RecomputePolicy)
    register("cpu", CPUSwapPolicy)
    register("disk", DiskSwapPolicy)
    register("auto", AutoSwapPolicy)


def discard(policy, handle) -> None:
    """Release what ``policy`` kept for a request that will not be swapped in (a policy without ``discard``
    keeps nothing to release). A failure warns: what is lost is the policy's own storage, not a request's
    tokens."""
    release = getattr(policy, "discard", None)
    if release is None:
        return
    try:
        release(handle)
    except Exception as e:
        warnings.warn(f"swap policy {type(policy).__name__}: discard failed ({e})", RuntimeWarning)
