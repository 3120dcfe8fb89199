"""Fixed-size KV blocks: allocation, reference counts, copy-on-write and prefix caching.

The manager keeps books only; the K/V data live in per-layer pools indexed by
block id. Block 0 is the null block: it pads block tables and is never handed
out. Each sequence owns a ``SequenceBlocks`` (its block table and the chain
hashes of its full blocks); how many of its tokens are computed is the
caller's to say, so there is one count of it, not two. Callers that would
rather name sequences than hold them (``PagedAttentionLayer``) use
``sequence(seq_id)``, ``ensure_slots`` and ``free(seq_id)``.

Full blocks are hashed in a chain (a block's hash covers its parent's hash and
its own tokens), so a later sequence with the same prefix can share them; a
hash names the whole prefix, so a cached block is found whatever became of the
blocks before it. Freed blocks keep their hash until they are handed out
again, least recently freed first, so the prefix cache costs no memory that
anything else needs.

Between ``begin()`` and ``commit()`` every change is journaled, and
``rollback()`` puts back every block, sequence, hash and the free order as
they were at ``begin()``: an engine step that fails before it runs leaves no
trace in the books.
"""

import dataclasses
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence, Union

import numpy as np

NULL_BLOCK = 0


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "parent_hash", "freed_at")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: Optional[bytes] = None  # set while the block is in the prefix cache
        self.token_ids: tuple = ()
        self.parent_hash: Optional[bytes] = None
        self.freed_at = block_id  # orders the free queue: least recently freed first

    def state(self) -> tuple:
        return self.ref_count, self.hash, self.token_ids, self.parent_hash, self.freed_at

    def restore(self, state: tuple) -> None:
        self.ref_count, self.hash, self.token_ids, self.parent_hash, self.freed_at = state


@dataclass
class SequenceBlocks:
    """The blocks one sequence holds for layers that attend to its whole context, and the chain hashes of
    its full blocks of tokens. ``root`` is what the first block's hash follows (see ``engine.kv_groups``)."""

    table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # block i's chain hash, computed as far as needed
    num_cached: int = 0  # leading blocks found in, or entered into, the prefix cache
    root: Optional[bytes] = None
    live_from: int = 0  # entries before it are null: blocks a window passed

    def passed(self, position: int, block_size: int) -> int:
        """How many of the table's first blocks no query at ``position`` or later can reach: none."""
        return 0


@dataclass
class WindowedBlocks(SequenceBlocks):
    """The blocks of a sequence for layers that attend to its last ``window`` tokens: the table returns
    the blocks no query to come can reach (``BlockManager.release_passed``), their entries becoming the
    null block, and its prefix-cache hits may skip blocks its window does not need."""

    window: int = 1

    def passed(self, position: int, block_size: int) -> int:
        return max(0, position - self.window + 1) // block_size


def chain_hash(parent: Optional[bytes], token_ids: Sequence[int]) -> bytes:
    """The hash of a full block: its parent's hash followed by its tokens."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


class BlockManager:
    """Block tables over a pool of ``num_blocks`` blocks of ``block_size`` tokens.

    ``num_heads`` and ``head_dim``, if given, are the attention heads of the
    layers that make their pools over the manager (``PagedAttentionLayer``
    checks that it has them).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        num_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        enable_prefix_caching: bool = True,
    ):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[bytes, int] = {}  # chain hash -> the block holding it
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) for the pools to apply
        self._clock = num_blocks  # the last freed_at given
        self.named: dict[Hashable, SequenceBlocks] = {}  # sequences known by name (``sequence``)
        self._journal: Optional[_Journal] = None

    # -- queries --------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, seq: SequenceBlocks, start: int, count: int) -> int:
        """New blocks that ``append_slots(seq, start, count)`` would take."""
        needed = max(0, -(-(start + count) // self.block_size) - len(seq.table))
        if start % self.block_size and count and self.blocks[seq.table[-1]].ref_count > 1:
            needed += 1  # the shared partial block is copied before it is written
        return needed

    def slots(self, seq: SequenceBlocks, start: int, count: int) -> list[int]:
        """The slots (``block_id * block_size + offset``) of positions ``[start, start + count)``."""
        size, table = self.block_size, seq.table
        return [table[p // size] * size + p % size for p in range(start, start + count)]

    # -- allocation -------------------------------------------------------------

    def cached_prefix(self, seq: SequenceBlocks, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks of the longest cached prefix of ``token_ids``, changing nothing.

        At least one token is always left out, so the model produces logits
        for the last one. A windowed sequence's list goes on past blocks
        missing from the cache (null entries): its window may need only the
        last ones (``usable_prefix``).
        """
        found = []
        if self.enable_prefix_caching:
            for index in range((len(token_ids) - 1) // self.block_size):
                digest, tokens = self._hash(seq, token_ids, index)
                block = self.blocks[self.cached.get(digest, NULL_BLOCK)]
                # The hash finds a candidate; its tokens and its parent's hash must match too.
                parent = seq.hashes[index - 1] if index else None
                if block.block_id == NULL_BLOCK or block.token_ids != tokens or block.parent_hash != parent:
                    if not isinstance(seq, WindowedBlocks):
                        break
                    found.append(NULL_BLOCK)
                else:
                    found.append(block.block_id)
        return found

    def usable_prefix(self, seq: SequenceBlocks, found: list[int], length: int) -> int:
        """How many of the first ``length`` blocks of ``found`` (from ``cached_prefix``) the sequence can start
        with: all there are, or for a window as many as leave the blocks the next query reaches all there."""
        length = min(length, len(found))
        while length and NULL_BLOCK in found[seq.passed(length * self.block_size, self.block_size) : length]:
            length -= 1
        return length

    def allocate_prefix(self, seq: SequenceBlocks, token_ids: Sequence[int], found: Optional[list[int]] = None) -> int:
        """Start ``seq`` with the blocks of ``cached_prefix`` (or those ``found`` of them; null where a window
        needs none); returns their tokens."""
        if seq.table:
            raise ValueError("the sequence already holds blocks")
        self._save_sequence(seq)
        for block_id in self.cached_prefix(seq, token_ids) if found is None else found:
            if block_id != NULL_BLOCK:
                self._ref(block_id)
            seq.table.append(block_id)
        seq.num_cached = len(seq.table)
        seq.live_from = seq.passed(len(seq.table) * self.block_size, self.block_size)
        return len(seq.table) * self.block_size

    def release_passed(self, seq: SequenceBlocks, position: int) -> None:
        """Return the windowed sequence's blocks that no query at ``position`` or later can reach; a shorter
        table (a sequence that starts there) gets null entries up to its first live block."""
        first = seq.passed(position, self.block_size)
        if first <= seq.live_from:
            return
        self._save_sequence(seq)
        for index in range(seq.live_from, min(first, len(seq.table))):
            if seq.table[index] != NULL_BLOCK:
                self._unref(seq.table[index])
                seq.table[index] = NULL_BLOCK
        seq.table += [NULL_BLOCK] * (first - len(seq.table))
        seq.live_from = first

    def append_slots(self, seq: SequenceBlocks, start: int, count: int) -> Optional[list[int]]:
        """Blocks for positions ``[start, start + count)``, and their slots; None if blocks ran out.

        ``start`` is how many of the sequence's tokens have slots: the table must
        end in the block that holds position ``start`` (or just before it). A
        shared last block is copied first (copy-on-write). Nothing changes when
        it returns None.
        """
        if len(seq.table) != -(-start // self.block_size):
            raise ValueError(f"a table of {len(seq.table)} blocks does not end at position {start}")
        needed = self.blocks_needed(seq, start, count)
        if needed > len(self.free_queue):
            return None
        if needed:
            self._save_sequence(seq)
        if start % self.block_size and count and self.blocks[seq.table[-1]].ref_count > 1:
            last = seq.table[-1]
            new = self._allocate()
            self.pending_copies.append((last, new))
            self._unref(last)
            seq.table[-1] = new
        while len(seq.table) * self.block_size < start + count:
            seq.table.append(self._allocate())
        return self.slots(seq, start, count)

    def cache_full_blocks(self, seq: SequenceBlocks, token_ids: Sequence[int], num_computed: int) -> None:
        """Enter the sequence's full blocks whose K/V are written (its first ``num_computed`` tokens) in the cache.

        A block whose hash another block already holds is not entered: the
        other one serves later prompts.
        """
        if not self.enable_prefix_caching:
            return
        full = min(len(token_ids), num_computed) // self.block_size
        if full <= seq.num_cached:
            return
        self._save_sequence(seq)
        for index in range(seq.num_cached, full):
            digest, tokens = self._hash(seq, token_ids, index)
            block = self.blocks[seq.table[index]]
            if block.block_id != NULL_BLOCK and block.hash is None and digest not in self.cached:
                self._enter(block, digest, tokens, seq.hashes[index - 1] if index else None)
        seq.num_cached = full

    def append_cached_block(self, seq: SequenceBlocks, token_ids: Sequence[int]) -> Optional[int]:
        """One more full block for a sequence whose blocks are all full and cached, entered in the cache.

        ``token_ids`` are the sequence's tokens up to and including the block's.
        Its K/V are the caller's to write. Returns the block id, or None when no
        block is free or another block already holds that hash.
        """
        index = len(seq.table)
        if seq.num_cached != index or len(token_ids) != (index + 1) * self.block_size:
            raise ValueError("the sequence does not end with a full cached block, or the tokens are not one more block")
        digest, tokens = self._hash(seq, token_ids, index)
        if not self.free_queue or digest in self.cached:
            return None
        self._save_sequence(seq)
        block = self.blocks[self._allocate()]
        self._enter(block, digest, tokens, seq.hashes[index - 1] if index else None)
        seq.table.append(block.block_id)
        seq.num_cached += 1
        return block.block_id

    def sequence(self, seq_id: Hashable) -> SequenceBlocks:
        """The blocks of the sequence named ``seq_id`` (new and empty the first time)."""
        return self.named.setdefault(seq_id, SequenceBlocks())

    def ensure_slots(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Slots for the named sequence's first ``num_tokens`` tokens, appending the blocks missing.

        Raises MemoryError when blocks run out. (No copy-on-write: named
        sequences are not forked.)
        """
        seq = self.sequence(seq_id)
        missing = -(-num_tokens // self.block_size) - len(seq.table)
        if missing > len(self.free_queue):
            raise MemoryError(f"out of KV blocks: {self.num_free_blocks} free, {missing} needed")
        if missing > 0:
            self._save_sequence(seq)
            seq.table += [self._allocate() for _ in range(missing)]
        return self.slots(seq, 0, num_tokens)

    def fork(self, seq: SequenceBlocks) -> SequenceBlocks:
        """A new sequence sharing all of ``seq``'s blocks; a shared partial block is copied on write."""
        for block_id in seq.table:
            if block_id != NULL_BLOCK:
                self._ref(block_id)
        return dataclasses.replace(seq, table=list(seq.table), hashes=list(seq.hashes))

    def free(self, seq: Union[SequenceBlocks, Hashable]) -> None:
        """Return a sequence's blocks (it, or its name); the tail is evicted first, the cached prefix last."""
        if not isinstance(seq, SequenceBlocks):
            seq = self.named.pop(seq, None)
            if seq is None:
                return
        self._save_sequence(seq)
        for block_id in reversed(seq.table):
            if block_id != NULL_BLOCK:
                self._unref(block_id)
        seq.table = []  # a new list: the journal keeps the old one
        seq.num_cached = seq.live_from = 0

    def truncate(self, seq: SequenceBlocks, num_tokens: int) -> None:
        """Return the blocks past the sequence's first ``num_tokens`` tokens (slots of drafted tokens that
        were rejected). They were never full of computed tokens, so none is in the prefix cache."""
        keep = -(-num_tokens // self.block_size)
        if len(seq.table) <= keep:
            return
        if seq.num_cached > keep:
            raise ValueError(f"cannot truncate a sequence to {num_tokens} tokens: {seq.num_cached} blocks are cached")
        self._save_sequence(seq)
        for block_id in reversed(seq.table[keep:]):
            if block_id != NULL_BLOCK:
                self._unref(block_id)
        seq.table = seq.table[:keep]  # a new list: the journal keeps the old one

    def forget_cached(self) -> None:
        """Empty the prefix cache (the K/V its blocks hold can no longer be trusted)."""
        for block_id in self.cached.values():
            block = self.blocks[block_id]
            block.hash, block.token_ids, block.parent_hash = None, (), None
        self.cached = {}

    def held_before(self, block_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Of ``block_ids`` (blocks a transaction writes), those that changed hands in it after holding K/V that
        would be read again were it rolled back: (blocks a sequence held, a preempted one's say; free blocks
        in the prefix cache). A rollback must put back the first's K/V; the second it may ``uncache``."""
        held, cached = [], []
        for block_id in dict.fromkeys(block_ids):
            state = self._journal.blocks.get(block_id)  # (ref_count, hash, ...) at begin, if it changed since
            if state is not None and state[0] > 0:
                held.append(block_id)
            elif state is not None and state[1] is not None:
                cached.append(block_id)
        return held, cached

    def uncache(self, block_ids: Sequence[int]) -> None:
        """Take free blocks out of the prefix cache (their K/V were overwritten)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids, block.parent_hash = None, (), None

    def grow(self, num_blocks: int) -> None:
        """Add blocks up to ``num_blocks`` (not within a transaction); they are handed out before freed ones,
        which may hold cached prefixes."""
        if self._journal is not None:
            raise RuntimeError("the pool cannot grow within a transaction")
        added = range(self.num_blocks, num_blocks)
        for block_id in added:
            block = Block(block_id)
            block.freed_at = block_id - num_blocks  # before every block freed so far
            self.blocks.append(block)
        self.free_queue = OrderedDict([*((block_id, None) for block_id in added), *self.free_queue.items()])
        self.num_blocks = max(self.num_blocks, num_blocks)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies made since the last call: (source block, destination block)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # -- transactions ---------------------------------------------------------------

    def begin(self) -> None:
        """Start journaling changes, for ``commit`` or ``rollback``."""
        if self._journal is not None:
            raise RuntimeError("a transaction is already open")
        self._journal = _Journal(list(self.pending_copies))

    def commit(self) -> None:
        self._journal = None

    def rollback(self) -> None:
        """Undo every change since ``begin``."""
        journal, self._journal = self._journal, None
        for block_id in journal.blocks:  # the hashes they hold now leave the cache...
            digest = self.blocks[block_id].hash
            if digest is not None and self.cached.get(digest) == block_id:
                del self.cached[digest]
        for block_id, state in journal.blocks.items():  # ...and the ones they held come back
            block = self.blocks[block_id]
            block.restore(state)
            if block.hash is not None:
                self.cached[block.hash] = block_id
        for seq, table, length, last, num_cached, num_hashes, entries, live_from in journal.sequences.values():
            del table[length:]
            if entries is not None:
                table[:] = entries
            elif length:
                table[-1] = last
            seq.table, seq.num_cached, seq.live_from = table, num_cached, live_from
            del seq.hashes[num_hashes:]
        free = sorted((b for b in self.blocks[1:] if b.ref_count == 0), key=lambda b: b.freed_at)
        self.free_queue = OrderedDict.fromkeys(b.block_id for b in free)
        self.pending_copies = journal.copies

    # -- internals ----------------------------------------------------------

    def _hash(self, seq: SequenceBlocks, token_ids: Sequence[int], index: int) -> tuple[bytes, tuple]:
        """Block ``index``'s chain hash (computing the missing ones before it) and its tokens."""
        size = self.block_size
        if index >= len(seq.hashes):
            self._save_sequence(seq)
        for i in range(len(seq.hashes), index + 1):
            seq.hashes.append(chain_hash(seq.hashes[i - 1] if i else seq.root, token_ids[i * size : (i + 1) * size]))
        return seq.hashes[index], tuple(token_ids[index * size : (index + 1) * size])

    def _enter(self, block: Block, digest: bytes, tokens: tuple, parent: Optional[bytes]) -> None:
        self._save_block(block)
        block.hash, block.token_ids, block.parent_hash = digest, tokens, parent
        self.cached[digest] = block.block_id

    def _allocate(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        self._save_block(block)
        if block.hash is not None:  # evicted from the prefix cache
            del self.cached[block.hash]
            block.hash, block.token_ids, block.parent_hash = None, (), None
        block.ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        self._save_block(block)
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed twice")
        self._save_block(block)
        block.ref_count -= 1
        if block.ref_count == 0:
            self._clock += 1
            block.freed_at = self._clock
            self.free_queue[block_id] = None

    def _save_block(self, block: Block) -> None:
        if self._journal is not None and block.block_id not in self._journal.blocks:
            self._journal.blocks[block.block_id] = block.state()

    def _save_sequence(self, seq: SequenceBlocks) -> None:
        """Journal a sequence before its first change.

        Within a transaction a table only grows at its end, changes its last
        block, or is replaced by ``free``; hashes only grow. A windowed table
        also nulls entries, so its entries are kept whole.
        """
        if self._journal is not None and id(seq) not in self._journal.sequences:
            table = seq.table
            entries = list(table) if isinstance(seq, WindowedBlocks) else None
            state = (seq, table, len(table), table[-1] if table else None, seq.num_cached, len(seq.hashes))
            self._journal.sequences[id(seq)] = (*state, entries, seq.live_from)


@dataclass
class _Journal:
    copies: list[tuple[int, int]]  # pending copies at begin
    blocks: dict[int, tuple] = field(default_factory=dict)  # block id -> its state at begin
    sequences: dict[int, tuple] = field(default_factory=dict)  # id(seq) -> (seq, table, length, last, ...)
