"""The block manager: unit tests, then a stateful model that simulates the K/V each slot holds.

The model (``BlockManagerMachine``) writes every sequence's tokens into a simulated pool
(block id -> the token in each slot), applies the manager's copy-on-write copies before
writing, and checks after every step that each sequence reads its own tokens back through
its block table, that reference counts match the tables, that no block leaks, that the free
queue is in LRU order and that prefix hits are exactly the cached prefixes.
"""

import copy
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llm_paged_mlx.engine import block_manager
from llm_paged_mlx.engine.block_manager import NULL_BLOCK, BlockManager, SequenceBlocks


def add(bm, seq, tokens):
    """Start a sequence the way the scheduler does: prefix hit, slots for the rest, cache full blocks."""
    hit = bm.allocate_prefix(seq, tokens)
    assert bm.append_slots(seq, hit, len(tokens) - hit) is not None
    bm.cache_full_blocks(seq, tokens, len(tokens))
    return hit


def grown(bm, count):
    """A new sequence with slots for ``count`` tokens."""
    seq = SequenceBlocks()
    assert bm.append_slots(seq, 0, count) is not None
    return seq


# -- construction and slots ---------------------------------------------------


@pytest.mark.parametrize("num_blocks, block_size", [(1, 16), (0, 16), (8, 0)])
def test_rejects_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_slots_are_block_times_size_plus_offset():
    bm = BlockManager(8, 4)
    a = SequenceBlocks()
    slots = bm.append_slots(a, 0, 6)
    table = a.table
    assert len(table) == 2
    assert slots == [table[0] * 4 + i for i in range(4)] + [table[1] * 4 + i for i in range(2)]
    assert bm.append_slots(a, 6, 3) == [table[1] * 4 + 2, table[1] * 4 + 3, a.table[2] * 4]
    assert bm.append_slots(a, 9, 0) == []


def test_slots_must_continue_the_table():
    bm = BlockManager(8, 4)
    a = grown(bm, 6)
    for start in (0, 3, 9, 12):  # before the last block, or past its end
        with pytest.raises(ValueError, match="does not end at position"):
            bm.append_slots(a, start, 1)


def test_null_block_is_never_handed_out():
    bm = BlockManager(5, 2)
    assert bm.num_usable_blocks == 4
    a = grown(bm, 8)
    assert sorted(a.table) == [1, 2, 3, 4]
    assert NULL_BLOCK not in a.table
    assert bm.num_free_blocks == 0


def test_append_slots_out_of_blocks_changes_nothing():
    bm = BlockManager(4, 2)
    a = grown(bm, 3)
    before = (list(bm.free_queue), list(a.table), [b.ref_count for b in bm.blocks])
    assert bm.blocks_needed(a, 3, 4) == 2
    assert bm.append_slots(a, 3, 4) is None
    b = SequenceBlocks()
    assert bm.append_slots(b, 0, 5) is None
    assert (list(bm.free_queue), list(a.table), [b.ref_count for b in bm.blocks]) == before
    assert b.table == []
    assert bm.append_slots(a, 3, 3) is not None  # exactly what is left still fits


def test_named_sequences_for_standalone_layers():
    bm = BlockManager(3, 4)
    assert bm.ensure_slots("a", 3) == bm.ensure_slots("a", 3)
    assert len(bm.sequence("a").table) == 1
    slots = bm.ensure_slots("a", 6)
    assert len(slots) == 6 and len(bm.sequence("a").table) == 2
    with pytest.raises(MemoryError):
        bm.ensure_slots("a", 9)
    bm.free("a")
    bm.free("a")
    assert bm.num_free_blocks == 2 and "a" not in bm.named


# -- reference counts, free, LRU ------------------------------------------------


def test_free_returns_every_block_and_a_second_free_is_a_no_op():
    bm = BlockManager(6, 2)
    a = grown(bm, 5)
    b = bm.fork(a)
    bm.append_slots(b, 5, 2)
    bm.take_copies()
    bm.free(a)
    bm.free(a)
    assert all(bm.blocks[x].ref_count == 1 for x in b.table)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)


def test_unref_of_a_free_block_raises():
    bm = BlockManager(4, 2)
    a = grown(bm, 1)
    (block,) = a.table
    bm.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        bm._unref(block)


def test_least_recently_freed_block_is_handed_out_first():
    bm = BlockManager(7, 2, enable_prefix_caching=False)
    a, b = grown(bm, 6), grown(bm, 6)
    assert a.table == [1, 2, 3] and b.table == [4, 5, 6]
    bm.free(b)  # the tail first: 6, 5, 4
    bm.free(a)  # then 3, 2, 1
    assert list(bm.free_queue) == [6, 5, 4, 3, 2, 1]
    assert grown(bm, 12).table == [6, 5, 4, 3, 2, 1]


def test_cached_prefix_is_evicted_last_and_eviction_forgets_it():
    bm = BlockManager(5, 2)
    prompt = [1, 2, 3, 4, 5]
    a = SequenceBlocks()
    add(bm, a, prompt)  # blocks 1, 2 full and cached, 3 partial
    bm.free(a)
    assert list(bm.free_queue) == [4, 3, 2, 1]
    b = SequenceBlocks()
    add(bm, b, [9, 9])  # takes block 4
    bm.free(b)
    c = SequenceBlocks()
    assert add(bm, c, prompt) == 4  # the prefix survived
    bm.free(c)
    d = SequenceBlocks()
    add(bm, d, [7] * 8)  # needs all four blocks: the cached ones are evicted too
    assert bm.cached.keys() == {bm.blocks[x].hash for x in d.table}
    bm.free(d)
    assert bm.allocate_prefix(SequenceBlocks(), prompt) == 0


def test_prefix_hit_moves_a_free_block_out_of_the_free_queue():
    bm = BlockManager(6, 2)
    a = SequenceBlocks()
    add(bm, a, [1, 2, 3])
    first = a.table[0]
    bm.free(a)
    assert first in bm.free_queue
    b = SequenceBlocks()
    assert add(bm, b, [1, 2, 3, 4, 5]) == 2
    assert b.table[0] == first and first not in bm.free_queue
    assert bm.blocks[first].ref_count == 1
    bm.free(b)
    assert list(bm.free_queue)[-1] == first  # freed most recently now


# -- prefix caching -------------------------------------------------------------


def test_prefix_hit_leaves_at_least_one_token_to_compute():
    bm = BlockManager(16, 4)
    a = SequenceBlocks()
    add(bm, a, list(range(12)))
    hits = {n: SequenceBlocks() for n in (13, 12, 9, 8, 4, 1)}
    found = {n: bm.allocate_prefix(seq, list(range(n))) for n, seq in hits.items()}
    assert found == {13: 12, 12: 8, 9: 8, 8: 4, 4: 0, 1: 0}  # never all of a prompt
    assert hits[13].table == a.table and hits[12].table == a.table[:2]


def test_cached_prefix_finds_without_taking():
    bm = BlockManager(16, 4)
    a = SequenceBlocks()
    add(bm, a, list(range(12)))
    table = list(a.table)
    bm.free(a)
    before = (list(bm.free_queue), [b.ref_count for b in bm.blocks])
    assert bm.cached_prefix(SequenceBlocks(), list(range(13))) == table
    assert (list(bm.free_queue), [b.ref_count for b in bm.blocks]) == before


def test_prefix_hit_stops_at_the_first_different_block():
    bm = BlockManager(16, 4)
    add(bm, SequenceBlocks(), list(range(12)) + [99])
    assert bm.allocate_prefix(SequenceBlocks(), [0, 1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12]) == 4
    assert bm.allocate_prefix(SequenceBlocks(), [1, 1, 2, 3, 4, 5, 6, 7, 8]) == 0


def test_hashes_are_chained_on_the_parent():
    bm = BlockManager(16, 2)
    add(bm, SequenceBlocks(), [1, 1, 2, 2])
    b = SequenceBlocks()
    add(bm, b, [3, 3, 2, 2])
    assert len(bm.cached) == 4  # the block (2, 2) is cached once per parent
    c = SequenceBlocks()
    assert bm.allocate_prefix(c, [3, 3, 2, 2, 0]) == 4
    assert c.table == b.table


def test_same_full_block_computed_twice_is_cached_once():
    bm = BlockManager(16, 2)
    a, b = grown(bm, 3), grown(bm, 3)  # both computed [5, 6, 7] without sharing
    bm.cache_full_blocks(a, [5, 6, 7], 3)
    bm.cache_full_blocks(b, [5, 6, 7], 3)
    assert list(bm.cached.values()) == [a.table[0]]
    assert bm.blocks[b.table[0]].hash is None


def test_only_computed_full_blocks_are_cached():
    bm = BlockManager(16, 2)
    a = grown(bm, 5)
    bm.cache_full_blocks(a, [1, 2, 3, 4, 5], 3)  # K/V written for 3 tokens: one full block
    assert len(bm.cached) == 1 and a.num_cached == 1
    bm.cache_full_blocks(a, [1, 2, 3], 5)  # the tokens known so far: still one
    assert len(bm.cached) == 1
    bm.cache_full_blocks(a, [1, 2, 3, 4, 5], 5)
    assert len(bm.cached) == 2 and a.num_cached == 2


def test_a_block_cached_under_another_parent_copy_is_still_found():
    """Prompts A and B share block 1 and differ in block 2, computed side by side: B's block 2 is
    cached, B's copy of block 1 is not (A's is). A's block 1 is evicted while B runs. Then B's
    prompt alone finds both blocks from its second run on (it used to stop at one forever)."""
    bm = BlockManager(64, 16)
    a_tokens = list(range(16)) + list(range(100, 116)) + [1]
    b_tokens = list(range(16)) + list(range(200, 216)) + [1]
    a, b = SequenceBlocks(), SequenceBlocks()
    for seq, tokens in ((a, a_tokens), (b, b_tokens)):
        assert bm.allocate_prefix(seq, tokens) == 0
        bm.append_slots(seq, 0, len(tokens))
    bm.cache_full_blocks(a, a_tokens, len(a_tokens))
    bm.cache_full_blocks(b, b_tokens, len(b_tokens))
    bm.free(a)
    bm.free(grown(bm, 16 * bm.num_free_blocks))  # evicts every free block, A's block 1 too
    bm.free(b)
    hits = []
    for _ in range(4):
        hits.append(add(bm, seq := SequenceBlocks(), b_tokens))
        bm.free(seq)
    assert hits == [0, 32, 32, 32]


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(16, 2, enable_prefix_caching=False)
    add(bm, SequenceBlocks(), [1, 2, 3, 4, 5])
    assert bm.cached == {}
    assert bm.allocate_prefix(SequenceBlocks(), [1, 2, 3, 4, 5]) == 0


def test_forced_hash_collision_does_not_reuse_different_tokens(monkeypatch):
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: b"collide")
    bm = BlockManager(16, 4)
    a = SequenceBlocks()
    add(bm, a, [1, 1, 1, 1, 2, 2, 2, 2, 0])
    cached_block = a.table[0]
    assert bm.cached == {b"collide": cached_block}
    bm.free(a)
    b = SequenceBlocks()
    assert bm.allocate_prefix(b, [2, 2, 2, 2, 2, 2, 2, 2, 0]) == 0
    assert b.table == []
    assert bm.blocks[cached_block].ref_count == 0
    c = SequenceBlocks()
    assert bm.allocate_prefix(c, [1, 1, 1, 1, 3, 3, 3, 3, 0]) == 4
    assert c.table == [cached_block]


def test_forced_hash_collision_does_not_reuse_equal_tokens_at_another_position(monkeypatch):
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: b"collide")
    bm = BlockManager(16, 4)
    a = SequenceBlocks()
    add(bm, a, [1, 1, 1, 1, 0])  # one cached block: (1, 1, 1, 1) at positions 0-3
    # positions 4-7 hold (1, 1, 1, 1) too, but their K/V (RoPE, context) were never computed
    b = SequenceBlocks()
    assert bm.allocate_prefix(b, [1] * 8 + [0]) == 4
    assert b.table == a.table[:1]


# -- fork and copy-on-write ---------------------------------------------------


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    bm = BlockManager(8, 4)
    a = grown(bm, 6)
    full, partial = a.table
    b = bm.fork(a)
    assert b.table == [full, partial]
    assert bm.blocks[full].ref_count == bm.blocks[partial].ref_count == 2
    assert bm.take_copies() == []
    assert bm.blocks_needed(b, 6, 1) == 1
    slots = bm.append_slots(b, 6, 1)
    new = b.table[1]
    assert new not in (full, partial) and slots == [new * 4 + 2]
    assert bm.take_copies() == [(partial, new)]
    assert bm.take_copies() == []
    assert a.table == [full, partial]
    assert (bm.blocks[full].ref_count, bm.blocks[partial].ref_count, bm.blocks[new].ref_count) == (2, 1, 1)
    assert bm.blocks_needed(a, 6, 1) == 0
    assert bm.append_slots(a, 6, 1) == [partial * 4 + 2]  # no longer shared: written in place
    assert bm.take_copies() == []


def test_fork_at_a_block_boundary_copies_nothing():
    bm = BlockManager(8, 4)
    a = grown(bm, 4)
    b = bm.fork(a)
    bm.append_slots(a, 4, 1)
    bm.append_slots(b, 4, 1)
    assert bm.take_copies() == []
    assert a.table[1] != b.table[1]


def test_copy_on_write_out_of_blocks_changes_nothing():
    bm = BlockManager(3, 4)
    a = grown(bm, 6)
    b = bm.fork(a)
    assert bm.num_free_blocks == 0
    assert bm.blocks_needed(b, 6, 1) == 1
    assert bm.append_slots(b, 6, 1) is None
    assert bm.take_copies() == [] and b.table == a.table


def test_a_sequence_with_blocks_cannot_take_a_prefix():
    bm = BlockManager(8, 4)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate_prefix(grown(bm, 1), [1, 2])


# -- transactions ----------------------------------------------------------------------


def books(bm, *seqs):
    return (
        list(bm.free_queue),
        dict(bm.cached),
        [b.state() for b in bm.blocks],
        [(list(s.table), s.num_cached) for s in seqs],
        list(bm.pending_copies),
    )


def test_rollback_undoes_everything_since_begin():
    bm = BlockManager(10, 2)
    a, b = SequenceBlocks(), SequenceBlocks()
    add(bm, a, [1, 2, 3, 4, 5])
    add(bm, b, [1, 2, 3, 4, 6, 7])  # shares two cached blocks with a
    c = bm.fork(b)
    bm.free(grown(bm, 3))  # blocks freed with no hash, and cached ones, in the free queue
    before = books(bm, a, b, c)
    bm.begin()
    bm.free(a)
    bm.append_slots(c, 6, 3)  # its partial block is shared with b: copy-on-write
    d = SequenceBlocks()
    add(bm, d, [1, 2, 3, 4, 9, 9, 9])  # a prefix hit, and blocks taken from the free queue
    bm.free(b)
    assert books(bm, a, b, c) != before
    bm.rollback()
    assert books(bm, a, b, c) == before
    assert d.table == []
    bm.begin()  # and it can be used again
    bm.free(a)
    bm.commit()
    assert a.table == []


# -- the stateful model -----------------------------------------------------------

BLOCK_SIZE = 4
NUM_BLOCKS = 24
# A two-letter alphabet makes equal full blocks (prefix hits) common.
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=14)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.seqs: dict[int, SequenceBlocks] = {}  # the live sequences
        self.kv = {b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)}  # what each slot holds
        self.tokens: dict[int, list[int]] = {}  # what each live sequence was given
        self.history: list[list[int]] = []  # every sequence ever started, to draw shared prefixes from
        self.free_order = list(range(1, NUM_BLOCKS))  # the expected free queue, LRU first
        self.prefix_blocks: dict[tuple, int] = {}  # oracle prefix cache: exact token prefix -> block
        self.block_prefix: dict[int, tuple] = {}
        self.next_id = 0

    # the model's state, saved and put back around a rolled-back transaction
    ORACLE = ("seqs", "kv", "tokens", "free_order", "prefix_blocks", "block_prefix")

    # -- helpers ----------------------------------------------------------------

    def books(self):
        bm = self.bm
        return (
            list(bm.free_queue),
            dict(bm.cached),
            [b.state() for b in bm.blocks],
            {i: (list(s.table), s.num_cached) for i, s in self.seqs.items()},
        )

    def grow(self, seq_id, new_tokens) -> bool:
        bm, n, seq = self.bm, len(new_tokens), self.seqs[seq_id]
        old_table, old_length = list(seq.table), len(self.tokens[seq_id])
        shared_partial = bool(old_length % BLOCK_SIZE) and bm.blocks[old_table[-1]].ref_count > 1
        needed = bm.blocks_needed(seq, old_length, n)
        before = self.books()
        slots = bm.append_slots(seq, old_length, n)
        if slots is None:
            assert needed > bm.num_free_blocks
            assert self.books() == before, "a failed append_slots changed the books"
            return False
        assert needed <= len(before[0])
        table = seq.table
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
        self.tokens[seq_id] = self.tokens[seq_id] + list(new_tokens)
        self.offer_to_cache(seq_id)
        return True

    def offer_to_cache(self, seq_id):
        tokens, seq = self.tokens[seq_id], self.seqs[seq_id]
        cached_before = seq.num_cached
        self.bm.cache_full_blocks(seq, tokens, len(tokens))
        full = len(tokens) // BLOCK_SIZE
        for index in range(cached_before, full):
            prefix = tuple(tokens[: (index + 1) * BLOCK_SIZE])
            if seq.table[index] not in self.block_prefix and prefix not in self.prefix_blocks:
                self.prefix_blocks[prefix] = seq.table[index]
                self.block_prefix[seq.table[index]] = prefix
        assert seq.num_cached == max(cached_before, full)

    def release(self, seq_id):
        bm, seq = self.bm, self.seqs.pop(seq_id)
        counts = {b: bm.blocks[b].ref_count for b in seq.table}
        for block in reversed(seq.table):
            counts[block] -= 1
            if counts[block] == 0:
                self.free_order.append(block)
        bm.free(seq)
        del self.tokens[seq_id]

    def pick(self, data):
        return data.draw(st.sampled_from(sorted(self.tokens)), label="sequence")

    # -- operations -------------------------------------------------------------

    def start(self, data, tail):
        if self.history and data.draw(st.booleans(), label="share a prefix"):
            base = data.draw(st.sampled_from(self.history), label="base")
            tokens = base[: data.draw(st.integers(0, len(base)), label="cut")] + tail
        else:
            tokens = tail
        seq_id, self.next_id = self.next_id, self.next_id + 1
        self.history.append(tokens)
        expected = []
        for index in range((len(tokens) - 1) // BLOCK_SIZE):
            block = self.prefix_blocks.get(tuple(tokens[: (index + 1) * BLOCK_SIZE]))
            if block is None:
                break
            expected.append(block)
        seq = self.seqs[seq_id] = SequenceBlocks()
        hit = self.bm.allocate_prefix(seq, tokens)
        assert hit <= len(tokens) - 1
        assert seq.table == expected and hit == len(expected) * BLOCK_SIZE
        self.free_order = [b for b in self.free_order if b not in expected]
        self.tokens[seq_id] = list(tokens[:hit])
        if not self.grow(seq_id, tokens[hit:]):
            self.release(seq_id)  # as the scheduler does when admission fails

    def split(self, data):
        parent = self.seqs[self.pick(data)]
        child_id, self.next_id = self.next_id, self.next_id + 1
        self.seqs[child_id] = self.bm.fork(parent)
        assert self.bm.take_copies() == []
        self.tokens[child_id] = list(self.tokens[next(i for i, s in self.seqs.items() if s is parent)])

    # -- rules ------------------------------------------------------------------

    @rule(data=st.data(), tail=TOKENS)
    def new_sequence(self, data, tail):
        self.start(data, tail)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 1), min_size=1, max_size=6))
    def append(self, data, new_tokens):
        self.grow(self.pick(data), new_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        self.split(data)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        self.release(self.pick(data))

    @rule(data=st.data(), ops=st.lists(st.sampled_from(["new", "append", "fork", "free"]), min_size=1, max_size=4))
    def rolled_back(self, data, ops):
        """Any operations between begin and rollback leave the books exactly as they were."""
        saved = {name: copy.deepcopy(getattr(self, name)) for name in self.ORACLE if name != "seqs"}
        seqs, books = dict(self.seqs), self.books()
        self.bm.begin()
        for op in ops:
            if op == "new":
                self.start(data, data.draw(TOKENS, label="tail"))
            elif self.tokens and op == "append":
                self.grow(self.pick(data), data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=6)))
            elif self.tokens and op == "fork":
                self.split(data)
            elif self.tokens:
                self.release(self.pick(data))
        self.bm.rollback()
        self.seqs = seqs
        for name, value in saved.items():
            setattr(self, name, value)
        assert self.books() == books

    # -- invariants -------------------------------------------------------------

    @invariant()
    def books_balance(self):
        bm = self.bm
        holders = Counter(b for seq in self.seqs.values() for b in seq.table)
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
        for seq_id, tokens in self.tokens.items():
            table = self.seqs[seq_id].table
            assert len(table) == -(-len(tokens) // BLOCK_SIZE)
            read = [self.kv[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(len(tokens))]
            assert read == tokens, f"sequence {seq_id} reads {read}, was given {tokens}"

    @invariant()
    def prefix_cache_matches_the_oracle(self):
        bm = self.bm
        assert len(bm.cached) == len(self.block_prefix)
        for block, prefix in self.block_prefix.items():
            assert bm.cached[bm.blocks[block].hash] == block
            assert bm.blocks[block].token_ids == prefix[-BLOCK_SIZE:]
            assert self.kv[block] == list(prefix[-BLOCK_SIZE:]), "a cached block's K/V was overwritten"

    def teardown(self):
        for seq_id in list(self.tokens):
            self.release(seq_id)
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks
        assert all(block.ref_count == 0 for block in self.bm.blocks)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_model = BlockManagerMachine.TestCase
