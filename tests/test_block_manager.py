"""The block manager: unit tests, then a stateful model that simulates the K/V each slot holds.

The model (``BlockManagerMachine``) writes every sequence's tokens into a simulated pool
(block id -> the token in each slot), applies the manager's copy-on-write copies before
writing, and checks after every step that each sequence reads its own tokens back through
its block table, that reference counts match the tables, that no block leaks, that the free
queue is in LRU order and that prefix hits are exactly the cached prefixes.
"""

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llm_paged_mlx.engine import block_manager
from llm_paged_mlx.engine.block_manager import NULL_BLOCK, BlockManager


def add(bm, seq_id, tokens):
    """Start a sequence the way the scheduler does: prefix hit, slots for the rest, cache full blocks."""
    hit = bm.allocate_prefix(seq_id, tokens)
    assert bm.append_slots(seq_id, len(tokens) - hit) is not None
    bm.cache_full_blocks(seq_id, tokens)
    return hit


# -- construction and slots ---------------------------------------------------


@pytest.mark.parametrize("num_blocks, block_size", [(1, 16), (0, 16), (8, 0)])
def test_rejects_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_slots_are_block_times_size_plus_offset():
    bm = BlockManager(8, 4)
    slots = bm.append_slots("a", 6)
    table = bm.block_table("a")
    assert len(table) == 2
    assert slots == [table[0] * 4 + i for i in range(4)] + [table[1] * 4 + i for i in range(2)]
    assert bm.append_slots("a", 3) == [table[1] * 4 + 2, table[1] * 4 + 3, bm.block_table("a")[2] * 4]
    assert bm.num_tokens("a") == 9
    assert bm.append_slots("a", 0) == []


def test_null_block_is_never_handed_out():
    bm = BlockManager(5, 2)
    assert bm.num_usable_blocks == 4
    assert bm.append_slots("a", 8) is not None
    assert sorted(bm.block_table("a")) == [1, 2, 3, 4]
    assert NULL_BLOCK not in bm.block_table("a")
    assert bm.num_free_blocks == 0


def test_append_slots_out_of_blocks_changes_nothing():
    bm = BlockManager(4, 2)
    bm.append_slots("a", 3)
    before = (list(bm.free_queue), list(bm.block_table("a")), bm.num_tokens("a"), [b.ref_count for b in bm.blocks])
    assert bm.blocks_needed("a", 4) == 2
    assert bm.append_slots("a", 4) is None
    assert bm.append_slots("b", 5) is None
    after = (list(bm.free_queue), list(bm.block_table("a")), bm.num_tokens("a"), [b.ref_count for b in bm.blocks])
    assert after == before
    assert bm.num_tokens("b") == 0 and bm.tables.get("b", []) == []
    assert bm.append_slots("a", 3) is not None  # exactly what is left still fits


def test_ensure_slots_appends_what_is_missing_and_raises_when_out():
    bm = BlockManager(3, 4)
    assert bm.ensure_slots("a", 3) == bm.ensure_slots("a", 3)
    assert bm.num_tokens("a") == 3
    slots = bm.ensure_slots("a", 6)
    assert bm.num_tokens("a") == 6 and len(slots) == 6
    with pytest.raises(MemoryError):
        bm.ensure_slots("a", 9)


# -- reference counts, free, LRU ------------------------------------------------


def test_free_returns_every_block_and_a_second_free_is_a_no_op():
    bm = BlockManager(6, 2)
    bm.append_slots("a", 5)
    bm.fork("a", "b")
    bm.append_slots("b", 2)
    bm.take_copies()
    bm.free("a")
    bm.free("a")
    assert all(bm.blocks[b].ref_count == 1 for b in bm.block_table("b"))
    bm.free("b")
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)


def test_truncate_gives_back_slots_past_the_end_and_the_same_slots_come_again():
    bm = BlockManager(8, 4)
    add(bm, "a", list(range(6)))  # one full (hashed) block and two tokens
    free = bm.num_free_blocks
    taken = bm.append_slots("a", 7)  # tokens 6-12: two more blocks
    assert bm.num_free_blocks == free - 2
    bm.truncate("a", 6)
    assert bm.num_free_blocks == free and bm.num_tokens("a") == 6 and len(bm.block_table("a")) == 2
    assert bm.append_slots("a", 7)[:2] == taken[:2]  # the partial block is kept
    with pytest.raises(ValueError, match="cannot truncate"):
        bm.truncate("a", 3)  # into the hashed block
    with pytest.raises(ValueError, match="cannot truncate"):
        bm.truncate("a", 14)  # past its slots


def test_unref_of_a_free_block_raises():
    bm = BlockManager(4, 2)
    bm.append_slots("a", 1)
    (block,) = bm.block_table("a")
    bm.free("a")
    with pytest.raises(RuntimeError, match="freed twice"):
        bm._unref(block)


def test_least_recently_freed_block_is_handed_out_first():
    bm = BlockManager(7, 2, enable_prefix_caching=False)
    bm.append_slots("a", 6)  # blocks 1, 2, 3
    bm.append_slots("b", 6)  # blocks 4, 5, 6
    assert bm.block_table("a") == [1, 2, 3] and bm.block_table("b") == [4, 5, 6]
    bm.free("b")  # the tail first: 6, 5, 4
    bm.free("a")  # then 3, 2, 1
    assert list(bm.free_queue) == [6, 5, 4, 3, 2, 1]
    bm.append_slots("c", 12)
    assert bm.block_table("c") == [6, 5, 4, 3, 2, 1]


def test_cached_prefix_is_evicted_last_and_eviction_forgets_it():
    bm = BlockManager(5, 2)
    prompt = [1, 2, 3, 4, 5]
    add(bm, "a", prompt)  # blocks 1, 2 full and cached, 3 partial
    bm.free("a")
    assert list(bm.free_queue) == [4, 3, 2, 1]
    add(bm, "b", [9, 9])  # takes block 4
    bm.free("b")
    assert add(bm, "c", prompt) == 4  # the prefix survived
    bm.free("c")
    add(bm, "d", [7] * 8)  # needs all four blocks: the cached ones are evicted too
    assert bm.cached.keys() == {bm.blocks[b].hash for b in bm.block_table("d")}
    bm.free("d")
    assert bm.allocate_prefix("e", prompt) == 0


def test_prefix_hit_moves_a_free_block_out_of_the_free_queue():
    bm = BlockManager(6, 2)
    add(bm, "a", [1, 2, 3])
    first = bm.block_table("a")[0]
    bm.free("a")
    assert first in bm.free_queue
    assert add(bm, "b", [1, 2, 3, 4, 5]) == 2
    assert bm.block_table("b")[0] == first and first not in bm.free_queue
    assert bm.blocks[first].ref_count == 1
    bm.free("b")
    assert list(bm.free_queue)[-1] == first  # freed most recently now


# -- prefix caching -------------------------------------------------------------


def test_prefix_hit_leaves_at_least_one_token_to_compute():
    bm = BlockManager(16, 4)
    add(bm, "a", list(range(12)))
    assert bm.allocate_prefix("b", list(range(13))) == 12
    assert bm.allocate_prefix("c", list(range(12))) == 8  # len - 1 = 11 tokens: two full blocks
    assert bm.allocate_prefix("d", list(range(9))) == 8
    assert bm.allocate_prefix("e", list(range(8))) == 4
    assert bm.allocate_prefix("f", list(range(4))) == 0
    assert bm.allocate_prefix("g", [0]) == 0
    assert bm.block_table("b") == bm.block_table("a")
    assert bm.block_table("c") == bm.block_table("a")[:2]


def test_prefix_hit_stops_at_the_first_different_block():
    bm = BlockManager(16, 4)
    add(bm, "a", list(range(12)) + [99])
    assert bm.allocate_prefix("b", [0, 1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12]) == 4
    assert bm.allocate_prefix("c", [1, 1, 2, 3, 4, 5, 6, 7, 8]) == 0


def test_hashes_are_chained_on_the_parent():
    bm = BlockManager(16, 2)
    add(bm, "a", [1, 1, 2, 2])
    add(bm, "b", [3, 3, 2, 2])
    assert len(bm.cached) == 4  # the block (2, 2) is cached once per parent
    assert bm.allocate_prefix("c", [3, 3, 2, 2, 0]) == 4
    assert bm.block_table("c") == bm.block_table("b")


def test_same_full_block_computed_twice_is_cached_once():
    bm = BlockManager(16, 2)
    bm.append_slots("a", 3)
    bm.append_slots("b", 3)  # both computed [5, 6, 7] without sharing
    bm.cache_full_blocks("a", [5, 6, 7])
    bm.cache_full_blocks("b", [5, 6, 7])
    assert list(bm.cached.values()) == [bm.block_table("a")[0]]
    assert bm.blocks[bm.block_table("b")[0]].hash is None


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(16, 2, enable_prefix_caching=False)
    add(bm, "a", [1, 2, 3, 4, 5])
    assert bm.cached == {}
    assert bm.allocate_prefix("b", [1, 2, 3, 4, 5]) == 0


def test_forced_hash_collision_does_not_reuse_different_tokens(monkeypatch):
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: b"collide")
    bm = BlockManager(16, 4)
    add(bm, "a", [1, 1, 1, 1, 2, 2, 2, 2, 0])
    cached_block = bm.block_table("a")[0]
    assert bm.cached == {b"collide": cached_block}
    bm.free("a")
    assert bm.allocate_prefix("b", [2, 2, 2, 2, 2, 2, 2, 2, 0]) == 0
    assert bm.block_table("b") == []
    assert bm.blocks[cached_block].ref_count == 0
    assert bm.allocate_prefix("c", [1, 1, 1, 1, 3, 3, 3, 3, 0]) == 4
    assert bm.block_table("c") == [cached_block]


def test_forced_hash_collision_does_not_reuse_equal_tokens_at_another_position(monkeypatch):
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: b"collide")
    bm = BlockManager(16, 4)
    add(bm, "a", [1, 1, 1, 1, 0])  # one cached block: (1, 1, 1, 1) at positions 0-3
    block = bm.block_table("a")[0]
    # positions 4-7 hold (1, 1, 1, 1) too, but their K/V (RoPE, context) were never computed
    assert bm.allocate_prefix("b", [1] * 8 + [0]) == 4
    assert bm.block_table("b") == [block]


# -- fork and copy-on-write ---------------------------------------------------


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    bm = BlockManager(8, 4)
    bm.append_slots("a", 6)
    full, partial = bm.block_table("a")
    bm.fork("a", "b")
    assert bm.block_table("b") == [full, partial]
    assert bm.blocks[full].ref_count == bm.blocks[partial].ref_count == 2
    assert bm.take_copies() == []
    assert bm.blocks_needed("b", 1) == 1
    slots = bm.append_slots("b", 1)
    new = bm.block_table("b")[1]
    assert new not in (full, partial) and slots == [new * 4 + 2]
    assert bm.take_copies() == [(partial, new)]
    assert bm.take_copies() == []
    assert bm.block_table("a") == [full, partial]
    assert (bm.blocks[full].ref_count, bm.blocks[partial].ref_count, bm.blocks[new].ref_count) == (2, 1, 1)
    assert bm.blocks_needed("a", 1) == 0
    assert bm.append_slots("a", 1) == [partial * 4 + 2]  # no longer shared: written in place
    assert bm.take_copies() == []


def test_fork_at_a_block_boundary_copies_nothing():
    bm = BlockManager(8, 4)
    bm.append_slots("a", 4)
    bm.fork("a", "b")
    bm.append_slots("a", 1)
    bm.append_slots("b", 1)
    assert bm.take_copies() == []
    assert bm.block_table("a")[1] != bm.block_table("b")[1]


def test_copy_on_write_out_of_blocks_changes_nothing():
    bm = BlockManager(3, 4)
    bm.append_slots("a", 6)
    bm.fork("a", "b")
    assert bm.num_free_blocks == 0
    assert bm.blocks_needed("b", 1) == 1
    assert bm.append_slots("b", 1) is None
    assert bm.take_copies() == [] and bm.block_table("b") == bm.block_table("a")


def test_existing_sequence_ids_are_rejected():
    bm = BlockManager(8, 4)
    bm.append_slots("a", 1)
    with pytest.raises(ValueError, match="'a'"):
        bm.allocate_prefix("a", [1, 2])
    bm.append_slots("b", 1)
    with pytest.raises(ValueError, match="'b'"):
        bm.fork("a", "b")


# -- the stateful model -----------------------------------------------------------

BLOCK_SIZE = 4
NUM_BLOCKS = 24
# A two-letter alphabet makes equal full blocks (prefix hits) common.
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=14)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.kv = {b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)}  # what each slot holds
        self.tokens: dict[int, list[int]] = {}  # what each live sequence was given
        self.history: list[list[int]] = []  # every sequence ever started, to draw shared prefixes from
        self.free_order = list(range(1, NUM_BLOCKS))  # the expected free queue, LRU first
        self.prefix_blocks: dict[tuple, int] = {}  # oracle prefix cache: exact token prefix -> block
        self.block_prefix: dict[int, tuple] = {}
        self.cached_upto: dict[int, int] = {}  # full blocks of each sequence offered to the cache
        self.next_id = 0

    # -- helpers ----------------------------------------------------------------

    def snapshot(self):
        bm = self.bm
        return (
            list(bm.free_queue),
            {k: list(v) for k, v in bm.tables.items()},
            dict(bm.lengths),
            dict(bm.hashed),
            dict(bm.cached),
            [b.ref_count for b in bm.blocks],
        )

    def grow(self, seq, new_tokens) -> bool:
        bm, n = self.bm, len(new_tokens)
        old_table, old_length = list(bm.block_table(seq)), bm.num_tokens(seq)
        shared_partial = bool(old_length % BLOCK_SIZE) and bm.blocks[old_table[-1]].ref_count > 1
        needed = bm.blocks_needed(seq, n)
        before = self.snapshot()
        slots = bm.append_slots(seq, n)
        if slots is None:
            assert needed > bm.num_free_blocks
            assert self.snapshot() == before, "a failed append_slots changed the books"
            return False
        assert needed <= len(before[0])
        table = bm.block_table(seq)
        kept = max(len(old_table) - 1, 0)
        assert table[:kept] == old_table[:kept]
        replaced = [table[i] for i in range(len(old_table)) if table[i] != old_table[i]]
        allocated = replaced + table[len(old_table) :]
        assert len(allocated) == needed
        assert allocated == self.free_order[: len(allocated)], "blocks not handed out least recently freed first"
        self.free_order = self.free_order[len(allocated) :]
        for block in allocated:
            prefix = self.block_prefix.pop(block, None)
            if prefix is not None:
                del self.prefix_blocks[prefix]
        copies = bm.take_copies()
        if shared_partial:
            assert copies == [(old_table[-1], table[len(old_table) - 1])]
        else:
            assert copies == [] and replaced == []
        for src, dst in copies:  # the pools copy before the step writes
            self.kv[dst] = list(self.kv[src])
        positions = range(old_length, old_length + n)
        assert slots == [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
        for slot, token in zip(slots, new_tokens):
            self.kv[slot // BLOCK_SIZE][slot % BLOCK_SIZE] = token
        self.tokens[seq] = self.tokens[seq] + list(new_tokens)
        self.offer_to_cache(seq)
        return True

    def offer_to_cache(self, seq):
        tokens, table = self.tokens[seq], self.bm.block_table(seq)
        self.bm.cache_full_blocks(seq, tokens)
        full = len(tokens) // BLOCK_SIZE
        for index in range(self.cached_upto[seq], full):
            prefix = tuple(tokens[: (index + 1) * BLOCK_SIZE])
            if table[index] not in self.block_prefix and prefix not in self.prefix_blocks:
                self.prefix_blocks[prefix] = table[index]
                self.block_prefix[table[index]] = prefix
        self.cached_upto[seq] = max(self.cached_upto[seq], full)

    def release(self, seq):
        bm = self.bm
        counts = {b: bm.blocks[b].ref_count for b in bm.block_table(seq)}
        for block in reversed(bm.block_table(seq)):
            counts[block] -= 1
            if counts[block] == 0:
                self.free_order.append(block)
        bm.free(seq)
        del self.tokens[seq], self.cached_upto[seq]

    def pick(self, data):
        return data.draw(st.sampled_from(sorted(self.tokens)), label="sequence")

    # -- rules ------------------------------------------------------------------

    @rule(data=st.data(), tail=TOKENS)
    def new_sequence(self, data, tail):
        if self.history and data.draw(st.booleans(), label="share a prefix"):
            base = data.draw(st.sampled_from(self.history), label="base")
            tokens = base[: data.draw(st.integers(0, len(base)), label="cut")] + tail
        else:
            tokens = tail
        seq, self.next_id = self.next_id, self.next_id + 1
        self.history.append(tokens)
        bm = self.bm
        expected = []
        for index in range((len(tokens) - 1) // BLOCK_SIZE):
            block = self.prefix_blocks.get(tuple(tokens[: (index + 1) * BLOCK_SIZE]))
            if block is None:
                break
            expected.append(block)
        hit = bm.allocate_prefix(seq, tokens)
        assert hit <= len(tokens) - 1
        assert bm.block_table(seq) == expected and hit == len(expected) * BLOCK_SIZE
        self.free_order = [b for b in self.free_order if b not in expected]
        self.tokens[seq] = list(tokens[:hit])
        self.cached_upto[seq] = len(expected)
        if not self.grow(seq, tokens[hit:]):
            self.release(seq)  # as the scheduler does when admission fails

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 1), min_size=1, max_size=6))
    def append(self, data, new_tokens):
        self.grow(self.pick(data), new_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), count=st.integers(1, 6))
    def abandoned_append(self, data, count):
        """Slots taken for a step that never ran, then given back with ``truncate``."""
        seq, bm = self.pick(data), self.bm
        length, old_table = bm.num_tokens(seq), list(bm.block_table(seq))
        if bm.append_slots(seq, count) is None:
            return
        table = list(bm.block_table(seq))
        for src, dst in bm.take_copies():  # a copy-on-write copy was made before the step failed
            self.kv[dst] = list(self.kv[src])
        allocated = [block for block in table if block not in old_table]
        assert allocated == self.free_order[: len(allocated)]
        self.free_order = self.free_order[len(allocated) :]
        for block in allocated:
            prefix = self.block_prefix.pop(block, None)
            if prefix is not None:
                del self.prefix_blocks[prefix]
        bm.truncate(seq, length)
        keep = len(old_table)
        assert bm.block_table(seq) == table[:keep] and bm.num_tokens(seq) == length
        self.free_order += list(reversed(table[keep:]))  # given back, the tail first

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.pick(data)
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent, child)
        assert self.bm.take_copies() == []
        self.tokens[child] = list(self.tokens[parent])
        self.cached_upto[child] = self.cached_upto[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        self.release(self.pick(data))

    # -- invariants -------------------------------------------------------------

    @invariant()
    def books_balance(self):
        bm = self.bm
        holders = Counter(b for table in bm.tables.values() for b in table)
        free = set(bm.free_queue)
        assert NULL_BLOCK not in holders and NULL_BLOCK not in free
        assert bm.blocks[NULL_BLOCK].ref_count == 0
        for block in range(1, NUM_BLOCKS):
            assert bm.blocks[block].ref_count == holders[block]
            assert (block in free) == (holders[block] == 0), f"block {block} is both free and held, or neither"
        assert len(free) + len(holders) == bm.num_usable_blocks, "a block leaked"
        assert list(bm.free_queue) == self.free_order
        assert bm.pending_copies == []

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        bm = self.bm
        assert set(bm.tables) == set(self.tokens)
        for seq, tokens in self.tokens.items():
            table = bm.block_table(seq)
            assert bm.num_tokens(seq) == len(tokens)
            assert len(table) == -(-len(tokens) // BLOCK_SIZE)
            read = [self.kv[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(len(tokens))]
            assert read == tokens, f"sequence {seq} reads {read}, was given {tokens}"

    @invariant()
    def prefix_cache_matches_the_oracle(self):
        bm = self.bm
        assert len(bm.cached) == len(self.block_prefix)
        for block, prefix in self.block_prefix.items():
            assert bm.cached[bm.blocks[block].hash] == block
            assert bm.blocks[block].token_ids == prefix[-BLOCK_SIZE:]
            assert self.kv[block] == list(prefix[-BLOCK_SIZE:]), "a cached block's K/V was overwritten"

    def teardown(self):
        for seq in list(self.tokens):
            self.release(seq)
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks
        assert all(block.ref_count == 0 for block in self.bm.blocks)
        assert not self.bm.tables and not self.bm.lengths and not self.bm.hashed


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_model = BlockManagerMachine.TestCase
