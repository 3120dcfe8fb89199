"""The seed example: PagedAttentionLayer over a BlockManager is causal attention over paged blocks."""

import mlx.core as mx
import pytest

from llm_paged_mlx import BlockManager, PagedAttentionLayer


def dense_causal(layer, x):
    """Causal attention over the same projections, with contiguous K/V."""
    n, heads, dim = x.shape[0], layer.num_heads, layer.head_dim
    split = lambda proj, h: proj(x).reshape(n, h, dim).transpose(1, 0, 2)[None]
    q, k, v = split(layer.q_proj, heads), split(layer.k_proj, layer.num_kv_heads), split(layer.v_proj, layer.num_kv_heads)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask="causal")
    return layer.o_proj(out[0].transpose(1, 0, 2).reshape(n, -1))


def test_seed_example_runs_as_written():
    manager = BlockManager(num_blocks=1024, num_heads=32, head_dim=128)
    layer = PagedAttentionLayer(num_heads=32, head_dim=128, manager=manager)
    seq_id = 0
    x = mx.random.normal((1, 4096))
    output = layer(x, seq_id=seq_id)
    assert output.shape == (1, 4096)
    assert mx.allclose(output, dense_causal(layer, x), atol=1e-5)
    manager.free(seq_id)
    assert manager.num_free_blocks == 1023


@pytest.mark.parametrize("chunks", [[1, 1, 1], [5, 1, 30, 1], [40], [16, 16, 3]])
def test_appending_calls_attend_causally_over_everything_held(chunks):
    manager = BlockManager(num_blocks=32, block_size=16, num_heads=4, head_dim=16)
    layer = PagedAttentionLayer(num_heads=4, head_dim=16, manager=manager, num_kv_heads=2)
    mx.random.seed(3)
    xs = mx.random.normal((sum(chunks), 64))
    other = layer(mx.random.normal((7, 64)), seq_id="other")  # another sequence interleaved
    outs, start = [], 0
    for n in chunks:
        outs.append(layer(xs[start : start + n], seq_id="s"))
        start += n
    assert mx.allclose(mx.concatenate(outs), dense_causal(layer, xs), atol=1e-5)
    assert len(manager.sequence("s").table) == -(-sum(chunks) // 16)
    assert mx.allclose(layer(xs[:7], seq_id="fresh"), dense_causal(layer, xs[:7]), atol=1e-5)
    for seq in ("s", "other", "fresh"):
        manager.free(seq)
    assert manager.num_free_blocks == 31


def test_layers_share_block_tables_and_reject_bad_shapes():
    manager = BlockManager(num_blocks=16, block_size=4, num_heads=2, head_dim=8)
    first = PagedAttentionLayer(num_heads=2, head_dim=8, manager=manager)
    second = PagedAttentionLayer(num_heads=2, head_dim=8, manager=manager)
    x = mx.random.normal((6, 16))
    h = first(x, seq_id=1)
    second(h, seq_id=1)
    assert len(manager.sequence(1).table) == 2
    assert mx.allclose(second(first(x[:2], seq_id=2), seq_id=2), dense_causal(second, dense_causal(first, x[:2])), atol=1e-5)
    with pytest.raises(ValueError, match=r"x must be \(tokens, 16\)"):
        first(mx.zeros((3, 10)), seq_id=1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        PagedAttentionLayer(num_heads=3, head_dim=8, manager=manager, num_kv_heads=2)


def test_a_layer_must_match_the_heads_its_manager_was_made_for():
    manager = BlockManager(num_blocks=16, num_heads=4, head_dim=16)
    with pytest.raises(ValueError, match="made for 4 heads of 16, not 8 of 16"):
        PagedAttentionLayer(num_heads=8, head_dim=16, manager=manager)
    PagedAttentionLayer(num_heads=4, head_dim=16, manager=manager, num_kv_heads=2)  # grouped queries
    PagedAttentionLayer(num_heads=8, head_dim=16, manager=BlockManager(num_blocks=16))  # a manager of any heads
