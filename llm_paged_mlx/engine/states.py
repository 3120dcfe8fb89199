"""The recurrent state of every running sequence of a hybrid model, for the runner: per call, and undoable.

Each running sequence's state is kept by its request id in every recurrent
layer's ``PagedStateCache``. A forward call gathers its rows' state, binds it
to the caches, and keeps what the layers wrote (``bound``; the compiled step
passes the state in and out of its trace as a flat list instead). Between
``begin()`` and ``commit()`` every change can be undone with ``rollback()``.
"""

import contextlib
from typing import Optional

import mlx.core as mx

from ..models.state_cache import PagedStateCache


class RecurrentStates:
    def __init__(self, caches: list[PagedStateCache]):
        self.caches = caches
        self._entries = [(c, i) for c in caches for i, entry in enumerate(c.layout.entries) if entry is not None]
        self._journal: Optional[dict[int, list]] = None  # request id -> its state in every layer at begin()
        self._written: list[mx.array] = []  # arrays kept since the last take_written()

    def __bool__(self) -> bool:
        return bool(self.caches)

    @property
    def num_sequences(self) -> int:
        """How many sequences have a state kept (every layer keeps the same ones)."""
        return len(self.caches[0].held) if self.caches else 0

    def take_written(self) -> list[mx.array]:
        """The arrays kept as states since the last call (a step launches them with its outputs)."""
        written, self._written = self._written, []
        return written

    # -- one forward call ------------------------------------------------------------------

    @contextlib.contextmanager
    def bound(self, keys: list[Optional[int]], request_ids: list[int], lengths: Optional[list[int]] = None):
        """Around an eager call whose row j continues sequence ``keys[j]`` (None: starts), is request
        ``request_ids[j]`` and, if the call is right-padded, holds ``lengths[j]`` tokens: bind the rows'
        state, then keep what the layers wrote."""
        padded = None if lengths is None else mx.array(lengths, dtype=mx.int32)
        for cache in self.caches:
            cache.bind(cache.gather(keys, fresh_as_none=True), padded)
        try:
            yield
            written = [cache.unbind() for cache in self.caches]
        except BaseException:
            self.abandon_call()
            raise
        self._keep(request_ids, written)

    def gather_flat(self, keys: list[Optional[int]]) -> list[mx.array]:
        """The rows' state as one flat list of arrays (for a compiled call's inputs)."""
        gathered = {id(c): c.gather(keys, fresh_as_none=False) for c in self.caches}
        return [gathered[id(c)][i] for c, i in self._entries]

    def bind_flat(self, flat: list[mx.array]) -> None:
        for cache, states in zip(self.caches, self._per_cache(flat)):
            cache.bind(states)

    def unbind_flat(self) -> list[mx.array]:
        written = {id(c): c.unbind() for c in self.caches}
        return [written[id(c)][i] for c, i in self._entries]

    def keep_flat(self, request_ids: list[int], flat: list[mx.array]) -> None:
        """Make row j of a compiled call's state outputs the state of request ``request_ids[j]``."""
        self._keep(request_ids, self._per_cache(flat))

    # -- whole sequences --------------------------------------------------------------------

    def read(self, request_id: int) -> list[mx.array]:
        """A sequence's state, every layer's set entries in order (lazy copies)."""
        out = []
        for cache, i in self._entries:
            batch, row = cache.held[request_id][i]
            out.append(batch[row])
        return out

    def write(self, request_id: int, state: list[mx.array]) -> None:
        """Give a sequence the state ``read`` returned."""
        self._keep([request_id], self._per_cache([a[None] for a in state]))

    def _per_cache(self, flat: list[mx.array]) -> list[list[Optional[mx.array]]]:
        """A flat list (every cache's set entries, in order) per cache, None at its unset entries."""
        parts = iter(flat)
        return [[None if entry is None else next(parts) for entry in c.layout.entries] for c in self.caches]

    def _keep(self, request_ids: list[int], states: list[list[Optional[mx.array]]]) -> None:
        """Make ``states`` (per cache, per entry) the rows' states of ``request_ids``."""
        self._touch(request_ids)
        for cache, written in zip(self.caches, states):
            cache.keep(request_ids, written)
            self._written += [a for a in written if a is not None]

    def release(self, request_id: int) -> None:
        self._touch([request_id])
        for cache in self.caches:
            cache.held.pop(request_id, None)

    def clear(self) -> None:
        """Forget every state (outside a transaction: this is not undone)."""
        for cache in self.caches:
            cache.held.clear()
        self._written = []

    def abandon_call(self) -> None:
        """Unbind the caches from a call that failed."""
        for cache in self.caches:
            cache.unbind()

    # -- transactions -----------------------------------------------------------------------

    def begin(self) -> None:
        self._journal = {}

    def commit(self) -> None:
        self._journal = None

    def rollback(self) -> None:
        for request_id, states in (self._journal or {}).items():
            for cache, held in zip(self.caches, states):
                if held is None:
                    cache.held.pop(request_id, None)
                else:
                    cache.held[request_id] = held
        self.abandon_call()
        self._journal = None
        self._written = []

    def _touch(self, request_ids: list[int]) -> None:
        if self._journal is None or not self.caches:
            return
        for request_id in request_ids:
            if request_id not in self._journal:
                self._journal[request_id] = [c.held.get(request_id) for c in self.caches]
