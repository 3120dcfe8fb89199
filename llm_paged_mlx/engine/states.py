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

    def __bool__(self) -> bool:
        return bool(self.caches)

    @property
    def num_sequences(self) -> int:
        """How many sequences have a state kept (every layer keeps the same ones)."""
        return len(self.caches[0].held) if self.caches else 0

    def arrays(self) -> list[mx.array]:
        """The arrays that hold the kept states (each batch once)."""
        unique = {}
        for cache in self.caches:
            for state in cache.held.values():
                for entry in filter(None, state):
                    unique[id(entry[0])] = entry[0]
        return list(unique.values())

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
        self._touch(request_ids)
        for cache, states in zip(self.caches, written):
            cache.keep(request_ids, states)

    def gather_flat(self, keys: list[Optional[int]]) -> list[mx.array]:
        """The rows' state as one flat list of arrays (for a compiled call's inputs)."""
        gathered = {id(c): c.gather(keys, fresh_as_none=False) for c in self.caches}
        return [gathered[id(c)][i] for c, i in self._entries]

    def bind_flat(self, flat: list[mx.array]) -> None:
        parts = iter(flat)
        for cache in self.caches:
            cache.bind([None if entry is None else next(parts) for entry in cache.layout.entries])

    def unbind_flat(self) -> list[mx.array]:
        written = {id(c): c.unbind() for c in self.caches}
        return [written[id(c)][i] for c, i in self._entries]

    def keep_flat(self, request_ids: list[int], flat: list[mx.array]) -> None:
        """Make row j of a compiled call's state outputs the state of request ``request_ids[j]``."""
        self._touch(request_ids)
        parts = iter(flat)
        for cache in self.caches:
            cache.keep(request_ids, [None if entry is None else next(parts) for entry in cache.layout.entries])

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
        self._touch([request_id])
        parts = iter(state)
        for cache in self.caches:
            cache.keep([request_id], [None if entry is None else next(parts)[None] for entry in cache.layout.entries])

    def release(self, request_id: int) -> None:
        self._touch([request_id])
        for cache in self.caches:
            cache.held.pop(request_id, None)

    def clear(self) -> None:
        """Forget every state (outside a transaction: this is not undone)."""
        for cache in self.caches:
            cache.held.clear()

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

    def _touch(self, request_ids: list[int]) -> None:
        if self._journal is None or not self.caches:
            return
        for request_id in request_ids:
            if request_id not in self._journal:
                self._journal[request_id] = [c.held.get(request_id) for c in self.caches]
