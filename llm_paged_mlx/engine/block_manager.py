"""Fixed-size KV blocks: allocation, reference counts, copy-on-write and prefix caching.

The manager only keeps books; the K/V data live in per-layer pools indexed by
block id. Block 0 is the null block: it pads block tables and is never handed
out. Full blocks are hashed in a chain (a block's hash covers its parent's hash
and its own tokens) so a later sequence with the same prefix can share them.
Freed blocks keep their hash until they are handed out again, least recently
freed first, so the prefix cache costs no memory that anything else needs.
"""

import hashlib
from collections import OrderedDict
from typing import Hashable, Optional, Sequence

import numpy as np

NULL_BLOCK = 0


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "parent", "generation")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: Optional[bytes] = None
        self.token_ids: tuple = ()
        self.parent: Optional[tuple[int, int]] = None  # (block id, generation) of the cached parent
        self.generation = 0  # bumped each time the block is handed out

    def identity(self) -> tuple[int, int]:
        return self.block_id, self.generation


def chain_hash(parent: Optional[bytes], token_ids: Sequence[int]) -> bytes:
    """The hash of a full block: its parent's hash followed by its tokens."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


class BlockManager:
    """Block tables for sequences over a pool of ``num_blocks`` blocks of ``block_size`` tokens.

    ``num_heads`` and ``head_dim`` describe the K/V each token holds, for
    layers that create their pools from the manager (``PagedAttentionLayer``).
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
        self.cached: dict[bytes, int] = {}
        self.tables: dict[Hashable, list[int]] = {}
        self.lengths: dict[Hashable, int] = {}  # tokens with a slot, per sequence
        self.hashed: dict[Hashable, tuple[int, Optional[bytes]]] = {}  # (blocks hashed, last hash)
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) for the pools to apply

    # -- queries --------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self.tables[seq_id]

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.lengths.get(seq_id, 0)

    def blocks_needed(self, seq_id: Hashable, num_new_tokens: int) -> int:
        """New blocks that ``append_slots(seq_id, num_new_tokens)`` would take."""
        length = self.lengths.get(seq_id, 0)
        table = self.tables.get(seq_id, [])
        needed = -(-(length + num_new_tokens) // self.block_size) - len(table)
        if length % self.block_size and num_new_tokens and self.blocks[table[-1]].ref_count > 1:
            needed += 1  # the shared partial block is copied before it is written
        return max(needed, 0)

    # -- allocation -------------------------------------------------------------

    def allocate_prefix(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Start ``seq_id`` with the cached blocks of its longest cached prefix.

        At least one token is always left to compute, so the model produces
        logits for the last one. Returns the number of tokens found.
        """
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        table: list[int] = []
        parent, parent_block = None, None
        if self.enable_prefix_caching:
            for start in range(0, len(token_ids) - 1 - self.block_size + 1, self.block_size):
                tokens = tuple(token_ids[start : start + self.block_size])
                digest = chain_hash(parent, tokens)
                block = self.blocks[self.cached.get(digest, NULL_BLOCK)]
                # The hash only finds a candidate: its tokens and its parent must match too.
                if block.block_id == NULL_BLOCK or block.token_ids != tokens or block.parent != parent_block:
                    break
                self._ref(block.block_id)
                table.append(block.block_id)
                parent, parent_block = digest, block.identity()
        self.tables[seq_id] = table
        self.lengths[seq_id] = len(table) * self.block_size
        self.hashed[seq_id] = (len(table), parent)
        return self.lengths[seq_id]

    def append_slots(self, seq_id: Hashable, num_new_tokens: int) -> Optional[list[int]]:
        """Slots (``block_id * block_size + offset``) for the next tokens, or None if blocks ran out.

        Nothing changes when it returns None.
        """
        if self.blocks_needed(seq_id, num_new_tokens) > len(self.free_queue):
            return None
        self.tables.setdefault(seq_id, [])
        self.lengths.setdefault(seq_id, 0)
        self.hashed.setdefault(seq_id, (0, None))
        table, length = self.tables[seq_id], self.lengths[seq_id]
        if length % self.block_size and num_new_tokens:
            last = table[-1]
            if self.blocks[last].ref_count > 1:  # copy-on-write
                new = self._allocate()
                self.pending_copies.append((last, new))
                self._unref(last)
                table[-1] = new
        slots = []
        for position in range(length, length + num_new_tokens):
            if position // self.block_size == len(table):
                table.append(self._allocate())
            slots.append(table[position // self.block_size] * self.block_size + position % self.block_size)
        self.lengths[seq_id] = length + num_new_tokens
        return slots

    def ensure_slots(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Slots for the sequence's first ``num_tokens`` tokens, appending what is missing."""
        missing = num_tokens - self.lengths.get(seq_id, 0)
        if missing > 0 and self.append_slots(seq_id, missing) is None:
            raise MemoryError(f"out of KV blocks: {self.num_free_blocks} free")
        table = self.tables[seq_id]
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(num_tokens)]

    def cache_full_blocks(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Enter the sequence's newly filled blocks (whose K/V are written) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.tables[seq_id]
        full = min(len(token_ids), self.lengths[seq_id]) // self.block_size
        done, parent = self.hashed[seq_id]
        for index in range(done, full):
            tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            parent_block = None
            if parent is not None:  # the cached holder of the parent's tokens, else our own copy
                parent_block = self.blocks[self.cached.get(parent, table[index - 1])].identity()
            digest = chain_hash(parent, tokens)
            block = self.blocks[table[index]]
            if block.hash is None and digest not in self.cached:
                block.hash, block.token_ids, block.parent = digest, tokens, parent_block
                self.cached[digest] = block.block_id
            parent = digest
        if full > done:
            self.hashed[seq_id] = (full, parent)

    # -- blocks whose K/V come from elsewhere (the disk tier) -----------------------

    def prefix_hash(self, seq_id: Hashable) -> Optional[bytes]:
        """The chain hash of the sequence's hashed blocks (None before the first)."""
        return self.hashed[seq_id][1]

    def append_cached_block(self, seq_id: Hashable, token_ids: Sequence[int]) -> Optional[int]:
        """Give a sequence whose blocks are all full and hashed one more, in the prefix cache.

        Its K/V are the caller's to write. Returns the block id, or None when no
        block is free or another block already holds that hash.
        """
        table = self.tables[seq_id]
        done, parent = self.hashed[seq_id]
        if done != len(table) or self.lengths[seq_id] != done * self.block_size:
            raise ValueError(f"sequence {seq_id!r} does not end with a full hashed block")
        tokens = tuple(token_ids)
        digest = chain_hash(parent, tokens)
        if not self.free_queue or digest in self.cached or len(tokens) != self.block_size:
            return None
        parent_block = self.blocks[self.cached.get(parent, table[-1])].identity() if table else None
        block = self.blocks[self._allocate()]
        block.hash, block.token_ids, block.parent = digest, tokens, parent_block
        self.cached[digest] = block.block_id
        table.append(block.block_id)
        self.lengths[seq_id] += self.block_size
        self.hashed[seq_id] = (done + 1, digest)
        return block.block_id

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """``child_id`` shares all of the parent's blocks; a shared partial block is copied on write."""
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        for block_id in self.tables[parent_id]:
            self._ref(block_id)
        self.tables[child_id] = list(self.tables[parent_id])
        self.lengths[child_id] = self.lengths[parent_id]
        self.hashed[child_id] = self.hashed[parent_id]

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Give back the sequence's slots past its first ``num_tokens`` (taken for a step that never ran)."""
        table = self.tables[seq_id]
        if not self.hashed[seq_id][0] * self.block_size <= num_tokens <= self.lengths[seq_id]:
            raise ValueError(f"cannot truncate sequence {seq_id!r} to {num_tokens} tokens")
        keep = -(-num_tokens // self.block_size)
        for block_id in reversed(table[keep:]):
            self._unref(block_id)
        del table[keep:]
        self.lengths[seq_id] = num_tokens

    def free(self, seq_id: Hashable) -> None:
        """Return the sequence's blocks; the tail is evicted first, the cached prefix last."""
        for block_id in reversed(self.tables.pop(seq_id, [])):
            self._unref(block_id)
        self.lengths.pop(seq_id, None)
        self.hashed.pop(seq_id, None)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies made since the last call: (source block, destination block)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # -- internals ----------------------------------------------------------

    def _allocate(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.cached[block.hash]
            block.hash, block.token_ids, block.parent = None, (), None
        block.generation += 1
        block.ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed twice")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None
