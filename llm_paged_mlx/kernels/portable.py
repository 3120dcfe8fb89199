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
    compilable = True

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


# mx.gather_mm runs one GPU threadgroup per product along the grid's z axis, which CUDA caps here.
MAX_GATHER_PRODUCTS = 65535


def decode_attention(queries, k_pool, v_pool, block_tables, context_lens, scale):
    """One query per row ``(R, Hq, 1, D)`` over the blocks of its table ``(R, max_blocks)``.

    Scores and weighted values are ``mx.gather_mm`` products of each (row, KV
    head) with each block of its table, at most ``MAX_GATHER_PRODUCTS`` per call;
    softmax is taken in float32 and normalised after the weighted sum.
    """
    rows, q_heads, _, dim = queries.shape
    if v_pool.dtype != mx.float32 and mx.default_device() == mx.cpu:
        # The CPU gather_mm only takes float32: upcast the blocks the rows use.
        used = block_tables.reshape(-1)
        k_pool, v_pool = k_pool[used].astype(mx.float32), v_pool[used].astype(mx.float32)
        block_tables = mx.arange(used.size, dtype=mx.int32).reshape(block_tables.shape)
        return decode_attention(queries, k_pool, v_pool, block_tables, context_lens, scale).astype(queries.dtype)
    num_blocks, kv_heads, block_size, _ = k_pool.shape
    rep = q_heads // kv_heads
    width = block_tables.shape[1]
    dv = v_pool.shape[-1]

    q = (queries * scale).astype(k_pool.dtype).reshape(rows * kv_heads, rep, dim)
    heads = mx.arange(kv_heads, dtype=mx.int32)
    pairs = mx.arange(rows, dtype=mx.int32)[:, None] * kv_heads + heads
    q_index = mx.broadcast_to(pairs[:, :, None], (rows, kv_heads, width))
    kv_index = block_tables[:, None, :] * kv_heads + heads[None, :, None]  # (R, H, W)
    keys = k_pool.reshape(num_blocks * kv_heads, block_size, dim).swapaxes(1, 2)
    values = v_pool.reshape(num_blocks * kv_heads, block_size, dv)
    step = max(1, MAX_GATHER_PRODUCTS // (rows * kv_heads))
    chunks = [slice(start, start + step) for start in range(0, width, step)]

    # CUDA's gather_mm takes its operands as packed arrays: slices must be made contiguous.
    q_index = [mx.contiguous(q_index[:, :, c]) for c in chunks]
    kv_index = [mx.contiguous(kv_index[:, :, c]) for c in chunks]
    scores = [mx.gather_mm(q, keys, qi, ki) for qi, ki in zip(q_index, kv_index)]
    scores = (scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=2)).astype(mx.float32)
    position = mx.arange(width * block_size, dtype=mx.int32).reshape(1, 1, width, 1, block_size)
    visible = position < context_lens.reshape(rows, 1, 1, 1, 1)
    scores = mx.where(visible, scores, -mx.inf)  # (R, H, W, rep, bs)
    probs = mx.exp(scores - scores.max(axis=(2, 4), keepdims=True))
    total = probs.sum(axis=(2, 4))[..., None]  # (R, H, rep, 1)
    probs = probs.astype(v_pool.dtype)

    out = None
    for c, ki in zip(chunks, kv_index):
        flat = mx.contiguous(probs[:, :, c]).reshape(-1, rep, block_size)
        index = mx.arange(flat.shape[0], dtype=mx.int32).reshape(rows, kv_heads, -1)
        part = mx.gather_mm(flat, values, index, ki).sum(axis=2)  # (R, H, rep, Dv)
        out = part if out is None else out + part
    out = (out.astype(mx.float32) / total).astype(v_pool.dtype)
    return out.reshape(rows, q_heads, 1, dv)
