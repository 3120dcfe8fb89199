"""The one API through which the scheduler and the engine use blocks (vLLM v1's KV cache coordinator).

A request holds a block table per group of attention layers (``engine.kv_groups``),
all drawn from one ``BlockManager``. Its tables are all or nothing:
``append_slots`` gives blocks to every table or to none, and a prefix is cached
only as far as every table has it. A windowed table returns the blocks its
window has passed as the request moves on; what it returns enters the prefix
cache first.
"""

from typing import Callable, Optional, Sequence

from .block_manager import NULL_BLOCK, BlockManager, SequenceBlocks
from .kv_groups import FULL_ATTENTION, KVGroups

Tables = list[SequenceBlocks]


class KVCoordinator:
    """Requests' block tables over ``manager``, one per group of ``groups`` (one full-attention group unless
    given), and the pool's books: its size, what is free and cached, and the step's transaction."""

    def __init__(self, manager: BlockManager, groups: Optional[KVGroups] = None):
        self.manager = manager
        self.groups = groups or FULL_ATTENTION
        self.block_size = manager.block_size

    # -- the pool -----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block included."""
        return self.manager.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.manager.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.manager.cached)

    @property
    def enable_prefix_caching(self) -> bool:
        return self.manager.enable_prefix_caching

    def grow(self, num_blocks: int) -> None:
        self.manager.grow(num_blocks)

    def free_besides(self, prefix: Sequence[int]) -> int:
        """The free blocks left once a request takes the cached blocks of ``prefix`` that are free."""
        blocks = self.manager.blocks
        return self.manager.num_free_blocks - sum(blocks[b].ref_count == 0 for b in prefix)

    def freed_by(self, tables: Tables, besides: Sequence[int]) -> int:
        """The blocks freeing ``tables`` would free, not counting ``besides``."""
        blocks = self.manager.blocks
        return sum(blocks[b].ref_count == 1 and b not in besides for b in self.held(tables))

    # -- a request's tables ---------------------------------------------------------------------

    def new_tables(self) -> Tables:
        """Empty tables for a new request, one per group."""
        return self.groups.new_tables()

    def blocks_needed(self, tables: Tables, start: int, count: int) -> int:
        """New blocks that ``append_slots(tables, start, count)`` would take."""
        return sum(self.manager.blocks_needed(seq, start, count) for seq in tables)

    def slots(self, tables: Tables, start: int, count: int) -> list[list[int]]:
        """Each table's slots of positions ``[start, start + count)``, which it holds already."""
        return [self.manager.slots(seq, start, count) for seq in tables]

    def append_slots(self, tables: Tables, start: int, count: int, tokens: Callable) -> Optional[list[list[int]]]:
        """Each table's slots for positions ``[start, start + count)`` (``BlockManager.append_slots``), or None
        (nothing allocated) when the blocks run out. Blocks no window reaches any more are returned first, and
        enter the prefix cache if they have not yet (``tokens()``: the sequence's tokens): a step that runs
        ahead is planned before the last one's filled blocks are cached, and a later prompt may need them."""
        manager = self.manager
        for seq in tables:
            if seq.passed(start, self.block_size) > seq.live_from and seq.num_cached < start // self.block_size:
                manager.cache_full_blocks(seq, tokens(), start)
            manager.release_passed(seq, start)
        if len(tables) > 1 and self.blocks_needed(tables, start, count) > manager.num_free_blocks:
            return None  # checked first, so that every table gets its blocks or none does
        slots = [manager.append_slots(seq, start, count) for seq in tables]
        return None if slots[0] is None else slots  # one table: it failed unchanged (``BlockManager.append_slots``)

    def cached_prefix(self, tables: Tables, token_ids) -> list[list[int]]:
        """Each table's cached blocks of the longest prefix of ``token_ids`` that every table has cached (null
        where a window needs none)."""
        manager, size = self.manager, self.block_size
        found = [manager.cached_prefix(seq, token_ids) for seq in tables]
        length = min(len(blocks) for blocks in found)
        while True:  # a windowed table's hit may hold only its window's blocks: it shortens, others follow
            shorter = min(manager.usable_prefix(seq, blocks, length) for seq, blocks in zip(tables, found))
            if shorter == length:
                break
            length = shorter
        return [[NULL_BLOCK] * seq.passed(length * size, size) + blocks[seq.passed(length * size, size) : length]
                for seq, blocks in zip(tables, found)]  # fmt: skip

    def blocks_to_start(self, tables: Tables, found: list[list[int]], start: int, count: int) -> int:
        """New blocks a request takes to start with ``found`` (``cached_prefix``, or nothing) and its first
        ``count`` tokens from position ``start``."""
        end = -(-(start + count) // self.block_size)
        return sum(end - max(len(blocks), seq.passed(start, self.block_size)) for seq, blocks in zip(tables, found))

    def allocate_prefix(self, tables: Tables, token_ids, found: list[list[int]]) -> int:
        """Start each table with its blocks of ``cached_prefix``; returns their tokens."""
        return min(self.manager.allocate_prefix(seq, token_ids, blocks) for seq, blocks in zip(tables, found))

    def restore_slots(self, tables: Tables, num_tokens: int) -> None:
        """Blocks for a resumed request's first ``num_tokens`` tokens (their K/V come back from a swap), but
        none a window has passed."""
        for seq in tables:
            self.manager.release_passed(seq, num_tokens)
            start = len(seq.table) * self.block_size
            self.manager.append_slots(seq, start, num_tokens - start)

    def append_cached_block(self, tables: Tables, token_ids: Sequence[int]) -> Optional[int]:
        """One more full block, entered in the prefix cache, for a request of one table whose blocks are all
        full and cached (``BlockManager.append_cached_block``: its K/V are the caller's to write)."""
        (seq,) = tables
        return self.manager.append_cached_block(seq, token_ids)

    def cache_full_blocks(self, tables: Tables, token_ids: Sequence[int], num_computed: int) -> None:
        """Enter the tables' full blocks of computed tokens in the prefix cache."""
        for seq in tables:
            self.manager.cache_full_blocks(seq, token_ids, num_computed)

    def truncate(self, tables: Tables, num_tokens: int) -> None:
        """Each table's blocks past the first ``num_tokens`` tokens returned (``BlockManager.truncate``)."""
        for seq in tables:
            self.manager.truncate(seq, num_tokens)

    def free(self, tables: Tables) -> None:
        for seq in tables:
            self.manager.free(seq)

    def live_blocks(self, tables: Tables, num_tokens: int) -> list[int]:
        """The blocks that hold the tables' first ``num_tokens`` tokens and that a query after them reaches,
        table after table: what a swap keeps of a preempted request, and writes back when it resumes."""
        end = -(-num_tokens // self.block_size)
        return [block for seq in tables for block in seq.table[seq.passed(num_tokens, self.block_size) : end]]

    @staticmethod
    def held(tables: Tables) -> list[int]:
        """The blocks the tables hold (not the null entries of blocks a window passed)."""
        return [block for seq in tables for block in seq.table if block != NULL_BLOCK]

    # -- the step's transaction and what it writes ---------------------------------------------------

    def begin(self) -> None:
        self.manager.begin()

    def commit(self) -> None:
        self.manager.commit()

    def rollback(self) -> None:
        self.manager.rollback()

    def copies_to_make(self) -> list[int]:
        """The blocks that copy-on-write copies not yet taken write to."""
        return [destination for _, destination in self.manager.pending_copies]

    def take_copies(self) -> list[tuple[int, int]]:
        return self.manager.take_copies()

    def held_before(self, block_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        return self.manager.held_before(block_ids)

    def uncache(self, block_ids: Sequence[int]) -> None:
        self.manager.uncache(block_ids)

    def forget_cached(self) -> None:
        self.manager.forget_cached()
