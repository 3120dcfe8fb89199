"""One engine served over a tensor-parallel group: rank 0's engine calls, repeated on every other rank.

Rank 0 runs the engine loop (and the HTTP server). ``LeadEngine`` wraps its
engine: before each step it sends the other ranks what changed since the last
(engines built, requests added with their tokens and sampling, requests
aborted), then the step itself. The other ranks run ``follow``, which makes the
same calls on their own engines in the same order, so every rank's scheduler
makes the same decisions and every step's collectives meet. A message is
pickled and shared by two ``all_sum``s (its length, then its bytes), as
mlx-lm's server shares its requests; the ranks are one job's processes, which
trust each other.

A rank whose collective fails (a peer died) or whose engine goes out of step
ends with an error: its peers' next collective fails in turn, so the group ends
rather than hangs.
"""

import contextlib
import pickle
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from ..errors import one_line

BUILD, ADD, ABORT, STEP, STOP = "build", "add", "abort", "step", "stop"


class GroupFailed(RuntimeError):
    """A collective of the tensor-parallel group failed: a rank died or the group is out of step."""


def share(message, group: mx.distributed.Group, doorbell: Optional[Callable[[], None]] = None):
    """Rank 0's ``message`` (any picklable object), on every rank; the others pass None.

    A collective's wait polls (a whole core, on ``ring``), so ranks that have a ``doorbell`` wait on it
    instead: on rank 0 it wakes the others, which wait in theirs until it does."""
    data = pickle.dumps(message) if group.rank() == 0 else b""
    try:
        if doorbell is not None:
            doorbell()
        size = mx.distributed.all_sum(mx.array([len(data)], mx.int32), group=group).item()
        sent = np.frombuffer(data, np.uint8) if data else np.zeros(size, np.uint8)
        received = mx.distributed.all_sum(mx.array(sent), group=group)
        mx.eval(received)
    except Exception as e:
        raise GroupFailed(f"the tensor-parallel group failed: {one_line(e)}") from e
    return pickle.loads(np.array(received).tobytes())


class LeadEngine:
    """Rank 0's engine: its admissions, aborts and steps are repeated on the other ranks (``follow``).

    Everything else (its requests, stats, tokenizer, ...) is the engine's own. When the group fails, or
    a step fails here (the other ranks may have made theirs: retrying it alone would put the ranks out
    of step), that step and every later one raise ``GroupFailed``, and ``on_failure`` gets it once (a
    server stops: no request can run any more).
    """

    def __init__(self, engine, group: mx.distributed.Group, on_failure: Optional[Callable[[GroupFailed], None]] = None,
                 doorbell: Optional[Callable[[], None]] = None):  # fmt: skip
        self.engine = engine
        self.group = group
        self.on_failure = on_failure
        self.doorbell = doorbell
        self._calls: list[tuple] = []  # made since the last step, sent with the next
        self._failed: GroupFailed | None = None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add_request(self, prompt, params=None) -> int:
        request_id = self.engine.add_request(prompt, params)
        request = self.engine.requests[request_id]
        self._calls.append((ADD, request_id, list(request.prompt_token_ids), request.params))
        return request_id

    def abort(self, request_id: int):
        chunk = self.engine.abort(request_id)
        self._calls.append((ABORT, request_id))
        return chunk

    def step(self):
        if self._failed is not None:
            raise GroupFailed(f"{self._failed} (earlier; restart to run over the ranks again)")
        calls, self._calls = [*self._calls, (STEP,)], []
        try:
            share(calls, self.group, self.doorbell)
            return self.engine.step()
        except Exception as e:
            self._failed = e if isinstance(e, GroupFailed) else GroupFailed(f"rank 0's step failed: {one_line(e)}")
            if self.on_failure is not None:
                self.on_failure(self._failed)
            raise self._failed from e

    def close(self) -> None:
        """Let the other ranks end (at the loop's end)."""
        if self._failed is None:
            with contextlib.suppress(GroupFailed):
                share([(STOP,)], self.group, self.doorbell)


def announce_build(config, group: mx.distributed.Group, doorbell: Optional[Callable[[], None]] = None) -> None:
    """On rank 0, before it builds an engine for ``config``: the other ranks build theirs."""
    share([(BUILD, config)], group, doorbell)


def follow(build: Callable[[object, object], object], group: mx.distributed.Group,
           doorbell: Optional[Callable[[], None]] = None) -> None:  # fmt: skip
    """On a rank other than 0: make rank 0's engine calls on this rank's engines until rank 0 stops
    (waiting in ``doorbell``, if given, for each message).

    ``build(config, weights)`` makes an engine as rank 0's does. Raises ``GroupFailed`` when the group
    fails, and what the engine raised when a call that succeeded on rank 0 fails here (the ranks are then
    out of step)."""
    engine, own, lead = None, {}, {}  # rank 0's request id -> this engine's, and back
    while True:
        for call, *args in share(None, group, doorbell):
            if call == BUILD:
                weights = (engine.model, engine.tokenizer) if engine is not None else None
                engine, own, lead = None, {}, {}  # its pool goes before the new engine allocates one
                engine = build(args[0], weights)
            elif call == ADD:
                lead_id, tokens, params = args
                own[lead_id] = engine.add_request(tokens, params)
                lead[own[lead_id]] = lead_id
            elif call == ABORT:
                own_id = own.pop(args[0])
                del lead[own_id]
                engine.abort(own_id)
            elif call == STEP:
                for chunk in engine.step():
                    if chunk.finish_reason:
                        own.pop(lead.pop(chunk.request_id))
            else:
                return
