"""Paged attention in plain MLX ops: runs on every MLX backend.

Decode rows read K/V through their block tables with ``mx.gather_mm`` over
(block, kv-head) pairs, so no contiguous copy of the context is made. A prefill
chunk gathers its context once and runs MLX's fused causal attention over it,
which costs little next to the chunk's own compute.
"""

import mlx.core as mx

from .plan import AttentionPlan


class PortableKernel:
    """Block-table attention from MLX primitives (the reference for fused kernels)."""

    name = "portable"
    auto_priority = 0

    def is_available(self) -> bool:
        return True

    def __call__(self, queries, k_pool, v_pool, plan: AttentionPlan, scale: float):
        parts = []
        if plan.num_decode:
            parts.append(
                decode_attention(
                    queries[: plan.num_decode],
                    k_pool,
                    v_pool,
                    plan.decode_block_tables,
                    plan.decode_context_lens,
                    scale,
                )
            )
        for chunk in plan.prefills:
            q = queries[chunk.row_start : chunk.row_start + chunk.num_tokens]
            parts.append(prefill_attention(q, k_pool, v_pool, chunk.block_table, chunk.context_len, scale))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def gather_context(pool: mx.array, block_table: mx.array, length: int) -> mx.array:
    """The first ``length`` tokens a block table points at, as ``(1, H, length, D)``."""
    _, heads, block_size, dim = pool.shape
    blocks = pool[block_table]  # (n, H, bs, D)
    ctx = blocks.transpose(1, 0, 2, 3).reshape(heads, -1, dim)[:, :length]
    return mx.contiguous(ctx[None])


def prefill_attention(queries, k_pool, v_pool, block_table, context_len, scale):
    """Causal attention of ``n`` consecutive queries ``(n, Hq, 1, D)`` over their sequence."""
    k = gather_context(k_pool, block_table, context_len)
    v = gather_context(v_pool, block_table, context_len)
    q = queries.swapaxes(0, 2)  # (1, Hq, n, D)
    mask = "causal" if q.shape[2] > 1 else None
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return out.swapaxes(0, 2)


def decode_attention(queries, k_pool, v_pool, block_tables, context_lens, scale):
    """One query per row ``(R, Hq, 1, D)`` over the blocks of its table ``(R, max_blocks)``."""
    num_blocks, kv_heads, block_size, dim = k_pool.shape
    rows, q_heads, _, _ = queries.shape
    rep = q_heads // kv_heads
    width = block_tables.shape[1]
    dv = v_pool.shape[-1]

    q = queries.reshape(rows * kv_heads, rep, dim)
    heads = mx.arange(kv_heads, dtype=mx.int32)
    q_index = mx.broadcast_to(
        (mx.arange(rows, dtype=mx.int32)[:, None] * kv_heads + heads)[:, :, None],
        (rows, kv_heads, width),
    )
    kv_index = block_tables[:, None, :] * kv_heads + heads[None, :, None]  # (R, H, W)

    keys = k_pool.reshape(num_blocks * kv_heads, block_size, dim).swapaxes(1, 2)
    scores = mx.gather_mm(q, keys, q_index, kv_index)  # (R, H, W, rep, bs)
    scores = scores.astype(mx.float32) * scale
    position = mx.arange(width * block_size, dtype=mx.int32).reshape(1, 1, width, 1, block_size)
    visible = position < context_lens.reshape(rows, 1, 1, 1, 1)
    scores = mx.where(visible, scores, -mx.inf)
    peak = scores.max(axis=(2, 4), keepdims=True)
    probs = mx.exp(scores - peak)
    total = probs.sum(axis=(2, 4), keepdims=True)  # (R, H, 1, rep, 1)
    probs = (probs / total).astype(v_pool.dtype)

    values = v_pool.reshape(num_blocks * kv_heads, block_size, dv)
    flat = probs.reshape(rows * kv_heads * width, rep, block_size)
    out = mx.gather_mm(flat, values, mx.arange(flat.shape[0], dtype=mx.int32).reshape(rows, kv_heads, width), kv_index)
    out = out.sum(axis=2)  # (R, H, rep, Dv)
    return out.reshape(rows, q_heads, 1, dv)
