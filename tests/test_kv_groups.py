"""Block tables per group of attention layers: how layers are grouped, and windowed tables that return the blocks
their window has passed, through transactions and the prefix cache."""

from llm_paged_mlx.engine.block_manager import NULL_BLOCK, BlockManager
from llm_paged_mlx.engine.kv_coordinator import KVCoordinator
from llm_paged_mlx.engine.kv_groups import kv_groups as group_layers

GEMMA3_27B = [None if (i + 1) % 6 == 0 else 1024 for i in range(62)]  # 52 windowed layers, 10 global


def test_gemma3_27b_gets_one_full_group_and_six_windowed_groups_of_ten():
    groups = group_layers(GEMMA3_27B, uniform=True)
    assert groups.size == 10 and groups.windows == (None,) + (1024,) * 6
    assert [groups.layer_groups[i] for i in (5, 11, 59)] == [0, 0, 0]
    assert groups.layer_groups[:5] == (1, 1, 1, 1, 1) and groups.layer_groups[-2:] == (6, 6)
    # Every (group, place) pair is one layer's: no two layers of a group share a pool array.
    assert len(set(zip(groups.layer_groups, groups.layer_places))) == 62
    assert max(groups.layer_places) == 9
    # At 32K tokens a sequence holds 2048 blocks of the global layers and 65 of each windowed group.
    assert groups.blocks_for(32768, 16) == 2048 + 6 * 65


def test_layers_of_other_shapes_or_no_window_keep_one_group():
    assert group_layers(GEMMA3_27B, uniform=False).windows == (None,)
    assert group_layers([None] * 4, uniform=True).windows == (None,)
    every = group_layers([32] * 4, uniform=True)
    assert every.windows == (32,) and every.size == 4


def test_the_longest_sequence_leaves_room_for_the_windows_and_a_chunk():
    groups = group_layers([32, None], uniform=True)
    # 100 blocks: the windowed table may hold ceil((32 + 64) / 16) + 1 = 7 of them in a 64-token step.
    assert groups.max_tokens(100, 16, 64) == 93 * 16
    assert groups.max_tokens(10, 16, 64) == 5 * 16  # too short to fill a window: both tables hold them all
    assert group_layers([None], uniform=True).max_tokens(100, 16, 64) == 1600
    assert group_layers([32], uniform=True).max_tokens(100, 16, 64) > 10**9
    assert group_layers([32], uniform=True).max_tokens(5, 16, 64) == 5 * 16


def sequence_tokens():
    """The tokens of the sequences of these tests, for the blocks a table returns to enter the prefix cache."""
    return list(range(1000))


def windowed(bm, window=32):
    (seq,) = group_layers([window], uniform=True).new_tables()
    return seq


def test_a_windowed_table_returns_the_blocks_its_window_passed():
    kv = KVCoordinator(BlockManager(32, 16))
    bm = kv.manager
    seq = windowed(bm)
    assert kv.append_slots([seq], 0, 100, sequence_tokens) is not None  # 7 blocks
    held = list(seq.table)
    # The next query, at position 100, reaches back to 69: blocks 0-3 are passed.
    kv.append_slots([seq], 100, 1, sequence_tokens)
    assert seq.table[:4] == [NULL_BLOCK] * 4 and seq.table[4:] == held[4:]
    assert bm.num_free_blocks == 31 - 3
    bm.free(seq)
    assert bm.num_free_blocks == 31


def test_a_rollback_brings_passed_blocks_back():
    kv = KVCoordinator(BlockManager(32, 16))
    bm = kv.manager
    seq = windowed(bm)
    kv.append_slots([seq], 0, 100, sequence_tokens)
    before = (list(seq.table), seq.live_from, list(bm.free_queue), [b.ref_count for b in bm.blocks])
    bm.begin()
    kv.append_slots([seq], 100, 40, sequence_tokens)
    bm.rollback()
    assert (list(seq.table), seq.live_from, list(bm.free_queue), [b.ref_count for b in bm.blocks]) == before


def test_a_resumed_table_takes_blocks_for_its_window_only():
    kv = KVCoordinator(BlockManager(32, 16))
    bm = kv.manager
    seq = windowed(bm)
    kv.restore_slots([seq], 100)
    assert seq.table[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in seq.table[4:] and len(seq.table) == 7


def start(kv, tables, tokens):
    """Admit a sequence as the scheduler does: its cached prefix, slots for the rest, its full blocks cached."""
    found = kv.cached_prefix(tables, tokens)
    hit = kv.allocate_prefix(tables, tokens, found)
    assert kv.append_slots(tables, hit, len(tokens) - hit, lambda: tokens) is not None
    kv.cache_full_blocks(tables, tokens, len(tokens))
    return hit


FULL, WINDOW = 0, 1  # the groups of a window of 32 beside full attention: full attention's comes first
PROMPT = list(range(160))


def first_sequence():
    """A coordinator over a block manager, and the tables of a first 160-token sequence, started and cached."""
    kv = KVCoordinator(BlockManager(64, 16), group_layers([32, None], uniform=True))
    first = kv.new_tables()
    start(kv, first, PROMPT)
    return kv, first


def test_a_cached_prefix_needs_only_the_blocks_the_window_reaches():
    kv, first = first_sequence()
    tokens, full, window = PROMPT, FULL, WINDOW
    passed = first[window].table[:8]
    kv.append_slots(first, 160, 1, sequence_tokens)  # the windowed table passes its first 8 blocks
    assert first[window].table[:8] == [NULL_BLOCK] * 8
    kv.free(first)
    kv.uncache(passed)  # as if other requests had taken them
    second = kv.new_tables()
    assert start(kv, second, tokens + [7, 7]) == 160
    assert second[window].table[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in second[full].table


def test_a_cached_prefix_shortens_when_the_window_s_blocks_are_gone():
    kv, first = first_sequence()
    tokens = PROMPT
    last_windowed = first[WINDOW].table[9]  # holds positions 144-159: the window of position 160 needs it
    kv.free(first)
    kv.uncache([last_windowed])
    second = kv.new_tables()
    found = kv.cached_prefix(second, tokens + [7])
    # 160 tokens would need windowed blocks 8 and 9; 144 needs 7 and 8, which are cached.
    assert [len(blocks) for blocks in found] == [9, 9]
    assert found[1][:7] == [NULL_BLOCK] * 7 and NULL_BLOCK not in found[1][7:] + found[0]


def test_groups_hash_apart():
    """The same tokens in two groups are other layers' K/V: a block of one never serves the other."""
    kv = KVCoordinator(BlockManager(64, 16), group_layers([32, None], uniform=True))
    tables = kv.new_tables()
    start(kv, tables, list(range(64)))
    assert kv.num_cached_blocks == 8  # four blocks in each table, none shared
    assert not set(tables[0].table) & set(tables[1].table)
    assert kv.cached_prefix(tables, list(range(64)) + [1])[0] == tables[0].table
