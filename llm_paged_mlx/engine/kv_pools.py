"""A model's K/V pools: the paged caches of its attention layers and its recurrent states, what steps and
swap policies read and write of blocks, and the step's transaction over them.

The layers of a group (``engine.kv_groups``) in one place share that place's
pool arrays: the first of them owns them. A step writes (copies, swap-ins, disk
loads, its K/V) into slots no one reads unless it commits (its new tokens'
slots, fresh blocks), and into blocks whose K/V someone reads again if it is
undone: blocks a preempted request held, which the engine names to ``protect``
before writing, and cached free blocks, which an undone step takes out of the
prefix cache instead. Keeping the whole pools would make every write copy
them, or forbid evaluating within a step.
"""

from typing import Optional

import mlx.core as mx

from ..models.adapt import model_caches
from ..models.paged_cache import LayerLayout
from ..models.state_cache import StateLayout
from .config import EngineConfig
from .kv_groups import KVGroups
from .states import RecurrentStates


class KVPools:
    """The caches of ``layouts`` (one per cache the model takes, ``check_model``'s) over ``num_blocks``
    blocks of ``config.block_size`` tokens, K/V quantized as ``config`` says."""

    def __init__(self, model, layouts: list[LayerLayout | StateLayout], num_blocks: int, kernel,
                 config: EngineConfig, groups: KVGroups):  # fmt: skip
        self.block_size, self.groups = config.block_size, groups
        made = [
            layout.make_cache(num_blocks, config.block_size, kernel, config.kv_bits, config.kv_group_size)
            if isinstance(layout, LayerLayout)
            else layout.make_cache()
            for layout in layouts
        ]
        self.caches = [c for c, layout in zip(made, layouts) if isinstance(layout, LayerLayout)]
        self.owners: list = []  # the caches that own each place's pool arrays
        for cache, place in zip(self.caches, groups.layer_places):
            if place < len(self.owners):
                cache.arrays = self.owners[place].arrays
            else:
                self.owners.append(cache)
        self.states = RecurrentStates([c for c, layout in zip(made, layouts) if isinstance(layout, StateLayout)])
        self.model_caches = model_caches(model, made)  # as the model takes them
        mx.eval(self.arrays())
        self._kept: Optional[list[tuple[list[int], list[mx.array]]]] = None  # see protect()
        self._before_in_place: Optional[list[mx.array]] = None  # see keep_before_in_place()

    @property
    def num_blocks(self) -> int:
        return self.caches[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.owners)

    def arrays(self) -> list[mx.array]:
        """Every pool array, in ``block_layout`` order."""
        return [a for c in self.owners for a in c.arrays]

    def set_arrays(self, arrays: list[mx.array]) -> None:
        """Put ``arrays`` (as ``arrays()`` gives them: a compiled step's outputs, say) in the caches."""
        parts = iter(arrays)
        for cache in self.owners:
            cache.arrays[:] = [next(parts) for _ in cache.arrays]

    def block_layout(self) -> list[tuple[str, tuple, mx.Dtype]]:
        """Name, shape and dtype of each array ``read_blocks`` returns for one block."""
        return [
            (name, (cache.shape[1] * self.block_size, array.shape[1]), array.dtype)
            for place, cache in enumerate(self.owners)
            for name, array in zip(cache.names(place), cache.arrays)
        ]

    def reset(self) -> None:
        """New, zeroed pools, for when what the old ones hold is unknown."""
        for cache in self.owners:
            cache.arrays[:] = [mx.zeros(a.shape, a.dtype) for a in cache.arrays]
        for cache in self.caches:
            cache.plan = None
        self.states.clear()
        mx.eval(self.arrays())

    def resize(self, num_blocks: int) -> None:
        """Grow the pools to ``num_blocks`` blocks, keeping their contents."""
        for cache in self.owners:
            cache.resize(num_blocks)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        for cache in self.owners:
            cache.copy_blocks(copies)

    def read_blocks(self, blocks: list[int]) -> list[mx.array]:
        """The pool arrays' rows of the given blocks (lazy copies), in ``block_layout`` order. Evaluate them
        before the next step is launched: on CUDA steps write the pools in place."""
        out = []
        for cache in self.owners:
            rows = cache.block_rows(blocks)
            out += [array[rows] for array in cache.arrays]
        return out

    def write_blocks(self, blocks: list[int], data: list[mx.array]) -> None:
        """Write what ``read_blocks`` returned into (other) blocks."""
        self._write(blocks, data)

    def _write(self, blocks: list[int], data: list[mx.array]) -> None:  # rollback's, which nothing may wrap
        parts = iter(data)
        for cache in self.owners:
            rows = cache.block_rows(blocks)
            for array in cache.arrays:
                array[rows] = next(parts)

    # -- the step's transaction ---------------------------------------------------------------

    def begin(self) -> None:
        self._kept = []
        self._before_in_place = None
        self.states.begin()

    def protect(self, blocks: list[int]) -> None:
        """Keep a copy of the blocks' K/V as they are now, for ``rollback`` to write back."""
        if blocks:
            data = self.read_blocks(blocks)
            mx.eval(data)
            self._kept.append((blocks, data))

    def keep_before_in_place(self, arrays: list[mx.array]) -> None:
        """The pool arrays before the step's first call that writes them in place (a draft model makes
        several): until the step is launched, ``rollback`` puts them back."""
        if self._before_in_place is None:
            self._before_in_place = arrays

    def commit(self) -> None:
        self._kept = self._before_in_place = None
        self.states.commit()

    def rollback(self) -> None:
        """Write back what ``protect`` kept. What else the step wrote stays, in slots no one reads; writes
        in place that were not launched are dropped (they would run unordered within a later step)."""
        if self._before_in_place is not None:
            self.set_arrays(self._before_in_place)
        for blocks, data in reversed(self._kept):
            self._write(blocks, data)
        self._kept = self._before_in_place = None
        for cache in self.caches:
            cache.plan = None
            cache.drop_pending()
        self.states.rollback()
