"""One engine's worker thread: callers on any thread or coroutine submit requests, the loop steps them together.

MLX streams belong to threads (an engine built on one thread fails on another),
so a loop owns its engine and does all of its MLX work on its own thread.
Between steps it admits new requests and aborts cancelled ones, so a cancel
takes effect within one step; each request's chunks go to that request's own
queue, and an error that belongs to one request (a prompt that does not fit, a
chat template that rejects it) reaches that request alone.

The thread never ends. The process must not tear down while it is inside MLX
(MLX's C++ statics are destroyed under it: Ctrl-C ended ``llm`` with SIGABRT or
SIGSEGV), nor right after it has ended (its C++ thread-locals may still be being
destroyed: a joined MLX thread aborts the exit now and then). So ``stop`` (run at
exit, before MLX's own exit hooks) ends every request and waits until the thread
has left MLX for good and is parked; if a step keeps it in MLX past ``EXIT_WAIT_S``,
the process ends without running C++ destructors at all.
"""

import asyncio
import atexit
import contextlib
import gc
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import Future
from typing import AsyncIterator, Callable, Hashable, Iterator, Optional, Union

from ..errors import one_line
from .output import StreamChunk
from .request import SamplingParams

# What a request's prompt may be: text, token ids, or a function of the tokenizer giving either
# (run on the loop's thread: a chat template needs the loaded model's tokenizer).
LoopPrompt = Union[str, list[int], Callable[[object], Union[str, list[int]]]]
# Consecutive failed steps after which the requests in the engine get the error (a step that fails once is
# undone by the engine and tried again; one that keeps failing would otherwise spin forever).
MAX_STEP_FAILURES = 3
# How long the exit waits for a running step to end before it ends the process without it.
EXIT_WAIT_S = 3.0


class LoopStopped(RuntimeError):
    """The loop stopped (the process is exiting) before the request finished."""


class QueueFull(RuntimeError):
    """More requests wait than the loop takes (``max_waiting``)."""


class StepFailed(RuntimeError):
    """The engine failed ``MAX_STEP_FAILURES`` steps in a row; the requests in it end with this error
    (its ``__cause__`` is the last step's error)."""


class Submission:
    """One request given to a loop: iterate it (``for`` or ``async for``) for its chunks; ``cancel`` aborts it.

    ``prompt_tokens``, ``block_size`` and ``tokenizer`` (the engine's) are set once
    the loop has admitted it (before its first chunk). Iterating raises the request's error, if it got one.
    """

    def __init__(self, loop: "EngineLoop", prompt: LoopPrompt, params: SamplingParams, config: Hashable):
        self.loop = loop
        self.prompt = prompt
        self.params = params
        self.config = config
        self.request_id: Optional[int] = None  # the engine's, once admitted
        self.prompt_tokens: Optional[int] = None
        self.block_size: Optional[int] = None
        self.tokenizer = None
        self.submitted = time.monotonic()
        self.cancelled = False
        self.done = False  # its last chunk or its error has been read
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._wake: Callable[[], None] = lambda: None

    def cancel(self) -> None:
        """Abort the request (its blocks are freed before the loop's next step); its last chunk, if anyone
        reads on, has ``finish_reason`` "abort"."""
        if not self.cancelled and not self.done:
            self.cancelled = True
            self.loop._inbox.put(("cancel", self))

    def __iter__(self) -> Iterator[StreamChunk]:
        try:
            while True:
                chunk = self._unwrap(self._items.get())
                yield chunk
                if chunk.finish_reason:
                    return
        finally:
            self.cancel()

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        event_loop, arrived = asyncio.get_running_loop(), asyncio.Event()
        self._wake = lambda: event_loop.call_soon_threadsafe(arrived.set)
        try:
            while True:
                try:
                    item = self._items.get_nowait()
                except queue.Empty:
                    arrived.clear()
                    if self._items.empty():  # a put after the clear sets the event again
                        await arrived.wait()
                    continue
                chunk = self._unwrap(item)
                yield chunk
                if chunk.finish_reason:
                    return
        finally:
            self.cancel()

    def _put(self, item: Union[StreamChunk, BaseException]) -> None:
        """On the loop's thread: hand over a chunk or an error."""
        self._items.put(item)
        with contextlib.suppress(Exception):  # the caller's event loop has closed: nobody is waiting
            self._wake()

    def _unwrap(self, item):
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self.done = bool(item.finish_reason)
        return item


class EngineLoop:
    """A worker thread that owns one engine and steps every submitted request through it.

    ``build(config, weights)`` makes the engine for a request's ``config`` (on the
    loop's thread; ``weights``: the model and tokenizer of the engine it replaces,
    or None, so that it can reuse them). A request whose config differs from the current engine's
    waits until that engine is idle, then the engine is rebuilt. ``max_waiting``
    bounds the requests submitted and not yet running (``submit`` raises
    ``QueueFull``). ``on_stop`` runs after ``stop`` has parked the thread.
    """

    def __init__(
        self,
        build: Callable[[Hashable, object], object],
        *,
        max_waiting: Optional[int] = None,
        name: str = "llm-paged-mlx",
        on_stop: Optional[Callable[[], None]] = None,
    ):
        self.build = build
        self.max_waiting = max_waiting
        self.on_stop = on_stop
        self.engine = None
        self.config: Hashable = None
        self.tokenizer = None  # the engine's, once built: for callers that tokenize off the loop's thread
        self.stats: dict = {}  # the engine's stats after its last step (read from any thread)
        self.num_steps = 0
        # The status of an exit that stops waiting for a step (``_stop_at_exit``): an interrupt's, unless the
        # owner says that the exit is a stop it was asked for (``server.run``, stopped by SIGINT or SIGTERM).
        self.exit_status_past_wait = 128 + signal.SIGINT
        self._failures = 0  # steps failed in a row
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[int, Submission] = {}  # request id -> submission, on the loop's thread
        self._deferred: list[Submission] = []  # waiting for the engine to be rebuilt with their config
        self._outstanding: set[Submission] = set()  # submitted and not yet finished
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.parked = threading.Event()  # the thread has left MLX for good
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def submit(self, prompt: LoopPrompt, params: Optional[SamplingParams] = None, config: Hashable = None) -> Submission:
        """Queue a request; its chunks (or its error) come through the returned ``Submission``."""
        with self._lock:
            if self._stopping.is_set():
                raise LoopStopped("the engine loop has stopped")
            waiting = self.num_waiting()
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting (the most this loop queues)")
            submission = Submission(self, prompt, params or SamplingParams(), config)
            self._outstanding.add(submission)
            self._inbox.put(("submit", submission))  # under the lock: never after stop's marker
        return submission

    def prepare(self, config: Hashable = None) -> Future:
        """Build the engine for ``config`` now rather than at the first request; the future ends when it is built
        (or raises why it could not be)."""
        built: Future = Future()
        with self._lock:
            if self._stopping.is_set():
                raise LoopStopped("the engine loop has stopped")
            self._inbox.put(("prepare", (config, built)))
        return built

    def num_waiting(self) -> int:
        """Requests submitted and not yet in the engine's running batch."""
        return max(0, len(self._outstanding) - self.stats.get("running", 0))

    def stop(self) -> None:
        """End every request (they get ``LoopStopped``), park the thread for good and wait for it; then run
        ``on_stop`` (once, whoever stops the loop first)."""
        self.request_stop()
        self.parked.wait()
        with self._lock:
            on_stop, self.on_stop = self.on_stop, None
        if on_stop is not None:
            on_stop()

    def request_stop(self) -> bool:
        """Begin to stop without waiting for the thread (fit for an event loop's thread); False if already begun.
        Not from a signal handler: it takes the lock that ``submit`` holds.

        Every request's reader gets ``LoopStopped`` at once, not when the step in progress ends.
        """
        with self._lock:
            if self._stopping.is_set():
                return False
            self._stopping.set()
            self._inbox.put(("stop", None))
            outstanding = list(self._outstanding)
        for submission in outstanding:
            submission._put(_stopped())
        return True

    def _stop_at_exit(self) -> None:
        """``stop`` at exit, rather than tear the process down under MLX.

        A step that runs on past ``EXIT_WAIT_S`` (a long prefill on a CPU) ends the process at once with
        ``exit_status_past_wait``, and a second Ctrl-C while it waits with 130: without C++ destructors,
        ``on_stop`` (closing the disk tier: its queued writes and hit counts are lost, a cache's) or the
        exit hooks registered before this one. Once the thread is parked, Ctrl-C is ignored so that
        ``on_stop`` finishes; SIG_IGN outlives the interpreter's reset of its handlers.
        """
        signal.signal(signal.SIGINT, exit_at_once)
        self.request_stop()
        if not self.parked.wait(EXIT_WAIT_S):
            with contextlib.suppress(Exception):  # a closed or broken stderr
                print(f"llm-paged-mlx: the engine's step did not end within {EXIT_WAIT_S:g} s of the exit; "
                      "exiting without waiting for it", file=sys.stderr, flush=True)
            exit_now(self.exit_status_past_wait)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.stop()

    # -- the loop's thread ----------------------------------------------------------

    def _run(self) -> None:
        # atexit runs its hooks last in, first out: registered after MLX's own (made on its import),
        # ``stop`` runs before them, while MLX is whole.
        with contextlib.suppress(ImportError):  # then building the engine reports it
            import mlx.core  # noqa: F401
        atexit.register(self._stop_at_exit)
        self._ready.set()
        while True:
            try:
                if not self._take_inbox():
                    break
                self._admit_deferred()
                if self.engine is not None and self.engine.has_unfinished():
                    self._step()
            except Exception as e:  # a fault outside a step (an abort, a delivery): the requests get it, and the
                self._fail_all(e)  # thread goes on rather than leave them waiting for it
        stopped = _stopped()
        self._fail_all(stopped)
        close = getattr(self.engine, "close", None)  # an engine whose peers wait for it (parallel.mirror)
        if close is not None:
            with contextlib.suppress(Exception):
                close()
        self.engine = None
        with contextlib.suppress(queue.Empty):
            while True:  # submitted before the stop, never taken
                kind, item = self._inbox.get_nowait()
                if kind == "submit":
                    self._fail(item, stopped)
                elif kind == "prepare":
                    item[1].set_exception(stopped)
        self.parked.set()
        threading.Event().wait()  # never end: see the module docstring

    def _step(self) -> None:
        """One engine step, its chunks to their requests. A step that fails is undone by the engine and tried
        again; after ``MAX_STEP_FAILURES`` in a row the requests in the engine get ``StepFailed``."""
        try:
            chunks = self.engine.step()
            self._failures = 0
        except Exception as e:
            self._failures += 1
            if self._failures >= MAX_STEP_FAILURES:
                self._failures = 0
                failed = StepFailed(f"the engine failed {MAX_STEP_FAILURES} steps in a row: {one_line(e)}")
                failed.__cause__ = e
                self._fail_all(failed)
            return
        self.num_steps += 1
        for chunk in chunks:
            self._deliver(chunk)
        self.stats = self.engine.stats()

    def _take_inbox(self) -> bool:
        """Admit submissions and apply cancels; wait for one if there is nothing to step. False: stop."""
        busy = self.engine is not None and self.engine.has_unfinished()
        while True:
            try:
                kind, item = self._inbox.get(block=not busy and not self._deferred, timeout=None)
            except queue.Empty:
                return True
            if kind == "stop":
                return False
            if kind == "submit":
                self._admit(item)
            elif kind == "prepare":
                self._prepare(*item)
            else:
                self._cancel(item)
            busy = True  # once something arrived, take the rest without waiting

    def _admit(self, submission: Submission) -> None:
        if submission.cancelled:
            self._abandon(submission)
            return
        if self.engine is not None and submission.config != self.config:
            if self.engine.has_unfinished():
                self._deferred.append(submission)
                return
        try:
            if self.engine is None or submission.config != self.config:
                self._rebuild(submission.config)
            prompt = submission.prompt
            if callable(prompt):
                prompt = prompt(self.engine.tokenizer)
            request_id = self.engine.add_request(prompt, submission.params)
        except Exception as e:
            self._fail(submission, e)
            return
        submission.request_id = request_id
        submission.prompt_tokens = len(self.engine.requests[request_id].prompt_token_ids)
        submission.block_size = self.engine.blocks.block_size
        submission.tokenizer = self.engine.tokenizer
        self._active[request_id] = submission
        self.stats = self.engine.stats()

    def _prepare(self, config: Hashable, built: Future) -> None:
        try:
            if self.engine is None or (config != self.config and not self.engine.has_unfinished()):
                self._rebuild(config)
            built.set_result(None)
        except Exception as e:
            built.set_exception(e)

    def _rebuild(self, config: Hashable) -> None:
        weights = (self.engine.model, self.engine.tokenizer) if self.engine is not None else None
        self.engine = None  # its KV pool goes before the new engine allocates one
        self.engine = self.build(config, weights)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.stats = self.engine.stats()

    def _admit_deferred(self) -> None:
        if self._deferred and (self.engine is None or not self.engine.has_unfinished()):
            deferred, self._deferred = self._deferred, []
            for submission in deferred:
                self._admit(submission)

    def _cancel(self, submission: Submission) -> None:
        if self._active.get(submission.request_id) is submission:
            self._deliver(self.engine.abort(submission.request_id))
            self.stats = self.engine.stats()
        elif submission in self._deferred:
            self._deferred.remove(submission)
            self._abandon(submission)

    def _deliver(self, chunk: Optional[StreamChunk]) -> None:
        submission = chunk and self._active.get(chunk.request_id)
        if submission is None:
            return
        submission._put(chunk)
        if chunk.finish_reason:
            del self._active[chunk.request_id]
            self._end(submission)

    def _abandon(self, submission: Submission) -> None:
        """End a submission cancelled before the engine took it (with no request id: it never had one)."""
        submission._put(StreamChunk(request_id=-1, token_ids=[], text="", finish_reason="abort"))
        self._end(submission)

    def _fail(self, submission: Submission, error: BaseException) -> None:
        submission._put(error)
        self._end(submission)

    def _fail_all(self, error: BaseException) -> None:
        """Every request in the engine or waiting for it gets ``error``; the engine keeps none of them."""
        for request_id, submission in list(self._active.items()):
            with contextlib.suppress(Exception):
                self.engine.abort(request_id)
            self._fail(submission, error)
        self._active.clear()
        for submission in self._deferred:
            self._fail(submission, error)
        self._deferred = []
        if self.engine is not None:
            self.stats = self.engine.stats()

    def _end(self, submission: Submission) -> None:
        with self._lock:
            self._outstanding.discard(submission)


def _stopped() -> LoopStopped:
    return LoopStopped("the engine loop stopped (the process is exiting)")


def freeze_heap() -> bool:
    """Take what the process holds now (modules, the model, the engine) out of Python's full garbage collections,
    for a process that keeps it until it ends, as a server does (vLLM does the same): a full collection walks it
    otherwise, a step stalled for tens of milliseconds each time a few hundred requests' objects set one off.
    Whether it froze (not where something was frozen already: whoever froze it undoes it)."""
    if gc.get_freeze_count():
        return False
    gc.collect()
    gc.freeze()
    return True


def exit_at_once(signum, frame):
    """A signal handler that ends the process now (``exit_now``) with 128 + the signal's number, as a shell
    reports a process that a signal ended."""
    exit_now(128 + signum)


def exit_now(status: int):
    """End the process now with ``status``, without C++ destructors (which would run under MLX)."""
    with contextlib.suppress(Exception):  # a closed or broken stdout
        sys.stdout.flush()
    os._exit(status)
