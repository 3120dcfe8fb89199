"""Paged attention in plain MLX ops: runs on every MLX backend.

Decode rows read K/V through their block tables with ``mx.gather_mm`` over
(block, kv-head) pairs, so no contiguous copy of the context is made. A prefill
chunk gathers its context and runs ``mx.fast.scaled_dot_product_attention``
over it: on the GPU, where that attention is fused, for as many KV heads at a
time as fit ``PREFILL_ATTENTION_BYTES``; elsewhere, where it computes the
scores in full, in tiles of queries that skip the keys after their last (of
a causal chunk), and a context longer than one tile goes tile by tile with an
online softmax. So a chunk's attention memory stays bounded at any context
length. Quantized pools (``kernels.quantized``) are read as values: decode rows
dequantize the blocks they use, prefill chunks what they gather, with their own
tokens' K/V taken at full precision from the step's rows.
"""

import mlx.core as mx

from .base import AttentionKernel
from .plan import AttentionPlan
from .quantized import QuantizedPool, block_values, own_rows

# About the most a prefill chunk's attention holds at once: the context gathered for a group of KV
# heads (fused attention), or its scores over a tile of the context (float32, a few live copies) and
# that tile's K and V.
PREFILL_ATTENTION_BYTES = 1 << 30
SCORE_COPIES = 6
# Queries per tile of a causal chunk whose attention computes its scores in full (the CPU, and shapes MLX's
# fused GPU attention does not take).
QUERY_TILE = 256
# Head dimensions and dtypes for which MLX's GPU backends run prefill attention fused (see fused_prefill).
FUSED_PREFILL_DIMS = (64, 80, 128)
FUSED_PREFILL_DTYPES = (mx.float16, mx.bfloat16)


class PortableKernel(AttentionKernel):
    """Block-table attention from MLX primitives (the reference for fused kernels)."""

    name = "portable"
    auto_priority = 0
    compilable = True
    quantized = True
    windowed = True
    softcapped = True

    def is_available(self) -> bool:
        return True

    def __call__(
        self, queries, k_pool, v_pool, plan: AttentionPlan, scale: float, window=None, sinks=None, softcap=None
    ):
        parts = []
        if plan.num_decode:
            q = queries[: plan.num_decode]
            tables, start = (plan.decode_block_tables, None) if window is None else plan.window_tables(window)
            lens = plan.decode_context_lens
            shared = plan.shared("portable decode", window)
            parts.append(
                decode_attention(q, k_pool, v_pool, tables, lens, scale, window, sinks, start, softcap, shared)
            )
        for chunk in plan.prefills:
            q = queries[chunk.row_start : chunk.row_start + chunk.num_tokens]
            table, length, own = chunk.block_table, chunk.context_len, chunk_own_rows(k_pool, v_pool, chunk)
            parts.append(prefill_attention(q, k_pool, v_pool, table, length, scale, window, sinks, softcap, own))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    def latent_attention(self, queries, pool, value_dim: int, plan: AttentionPlan, scale: float):
        """MLA: the keys are the pool's whole rows, the values their first ``value_dim`` values.

        Whole rows are summed and their tail dropped: a view of the first
        values would make the decode path copy the pool.
        """
        return self(queries, pool, pool, plan, scale)[..., :value_dim]


def chunk_own_rows(k_pool, v_pool, chunk) -> "tuple[mx.array, mx.array] | None":
    """A prefill chunk's own K and V rows ``(n, Hkv, D)`` at full precision from quantized pools that carry
    the step's rows (``quantized.own_rows``), or None."""
    k = own_rows(k_pool, chunk.row_start, chunk.num_tokens)
    if k is None:
        return None
    return k, k if v_pool is k_pool else own_rows(v_pool, chunk.row_start, chunk.num_tokens)


def overlay(context: mx.array, start: int, own: mx.array, own_start: int) -> mx.array:
    """``context`` ``(..., L, D)``, the values at positions ``[start, start + L)``, with those of positions
    ``[own_start, own_start + n)`` taken from ``own`` ``(..., n, D)`` instead."""
    length, n = context.shape[-2], own.shape[-2]
    first, end = max(start, own_start), min(start + length, own_start + n)
    if first >= end:
        return context
    before, after = context[..., : first - start, :], context[..., end - start :, :]
    parts = (before, own[..., first - own_start : end - own_start, :], after)
    return mx.concatenate([p for p in parts if p.shape[-2]], axis=-2)


def gather_context(pool, block_table: mx.array, length: int, heads: slice = slice(None)) -> mx.array:
    """The first ``length`` tokens a block table points at, as values ``(1, H, length, D)`` (of ``heads``)."""

    def view(x):  # (H, num_blocks, bs, D): a view, so the gather below is the one copy
        return x.swapaxes(0, 1)[heads]

    pool = pool.map(view) if isinstance(pool, QuantizedPool) else view(pool)
    blocks = block_values(pool, block_table, axis=1)  # (H, n, bs, D)
    return blocks.reshape(blocks.shape[0], -1, blocks.shape[-1])[None, :, :length]


def chunk_context(pool, block_table, start: int, length: int, own, own_start: int, heads: slice = slice(None)):
    """``gather_context`` of the ``length`` tokens from position ``start`` on, with a chunk's ``own`` rows
    ``(n, H, D)`` (from position ``own_start`` on; None: none) in place of the pool's copies of them."""
    context = gather_context(pool, block_table, length, heads)
    return context if own is None else overlay(context, start, own[:, heads].swapaxes(0, 1)[None], own_start)


def fused_prefill(num_queries: int, k_pool, v_pool) -> bool:
    """Whether MLX's fused attention runs this chunk without materializing its scores.

    MLX's Metal and CUDA backends do for more than 8 queries at these head
    dimensions and dtypes (Metal's full-attention kernel, cuDNN's flash
    attention); the CPU, and other shapes, compute the scores in full.
    """
    dim = k_pool.shape[-1]
    return (
        mx.default_device() == mx.gpu
        and num_queries > 8
        and dim in FUSED_PREFILL_DIMS
        and v_pool.shape[-1] == dim
        and v_pool.dtype in FUSED_PREFILL_DTYPES
    )


def context_bytes(k_pool, v_pool) -> int:
    """Bytes one KV head's gathered K and V take per context token (twice the values, for a copy MLX may make;
    once if they are one pool, as MLA's latent rows)."""
    pools = (k_pool,) if v_pool is k_pool else (k_pool, v_pool)
    per_value = 2 * v_pool.dtype.size
    packed = sum(p.data.dtype.size * p.data.shape[-1] + 2 * p.scales.shape[-1] * p.dtype.size
                 for p in pools if isinstance(p, QuantizedPool))
    return sum(p.shape[-1] for p in pools) * per_value + packed


def prefill_attention_bytes(chunks, q_heads: int, k_pool, v_pool, window=None) -> int:
    """An upper estimate of what the attention of a step's prefill ``chunks`` holds in one layer (of ``window``
    tokens, if given): the keys each chunk reaches gathered, and its scores where MLX's attention computes them
    in full."""
    _, kv_heads, block_size, _ = k_pool.shape
    total = 0
    for chunk in chunks:
        first_query = chunk.context_len - chunk.num_tokens
        reach = chunk.context_len - window_start(first_query, window, block_size) * block_size
        total += reach * kv_heads * context_bytes(k_pool, v_pool)
        if not fused_prefill(chunk.num_tokens, k_pool, v_pool):
            total += chunk.num_tokens * q_heads * reach * 4 * SCORE_COPIES
    return total


def prefill_tile(num_queries: int, q_heads: int, k_pool, v_pool) -> int:
    """Context tokens per tile for a chunk of ``num_queries`` queries: a multiple of the block size."""
    _, kv_heads, block_size, dim = k_pool.shape
    per_token = num_queries * q_heads * 4 * SCORE_COPIES + kv_heads * context_bytes(k_pool, v_pool)
    return max(1, PREFILL_ATTENTION_BYTES // per_token // block_size) * block_size


def prefill_attention(
    queries, k_pool, v_pool, block_table, context_len, scale, window=None, sinks=None, softcap=None, own=None
):
    """Causal attention of ``n`` consecutive queries ``(n, Hq, 1, D)`` over their sequence: over its last
    ``window`` tokens only, if given, with ``sinks`` (one logit per query head) in the softmax, and with
    ``softcap``, scores taken as ``softcap * tanh(scores / softcap)``. ``own``: the queries' own K and V
    ``(n, Hkv, D)`` (``chunk_own_rows``), attended instead of the pools' copies of them.

    Where MLX's fused attention applies (not with ``softcap``), the context is
    gathered for as many KV heads at a time as fit ``PREFILL_ATTENTION_BYTES``;
    elsewhere, a context longer than one tile goes tile by tile.
    """
    n, q_heads = queries.shape[:2]
    kv_heads = k_pool.shape[1]
    chunk = (queries, k_pool, v_pool, block_table, context_len, scale)
    masking = {"window": window, "sinks": sinks, "own": own}
    block_size = k_pool.shape[2]
    reach = context_len - window_start(context_len - n, window, block_size) * block_size  # keys gathered
    tile = prefill_tile(n, q_heads, k_pool, v_pool)
    if softcap is not None:  # MLX's attention does not cap scores: tiles (one, if it fits), a power of 2 blocks
        reach_tile = (1 << (-(-reach // block_size) - 1).bit_length()) * block_size
        return tiled_prefill_attention(*chunk, min(tile, reach_tile), softcap=softcap, **masking)
    if fused_prefill(n, k_pool, v_pool):
        heads = min(kv_heads, PREFILL_ATTENTION_BYTES // (reach * context_bytes(k_pool, v_pool)))
        if heads:
            return grouped_prefill_attention(*chunk, heads, **masking)
    if reach > tile:
        return tiled_prefill_attention(*chunk, tile, **masking)
    return grouped_prefill_attention(*chunk, kv_heads, **masking)


def visible_keys(query_positions: mx.array, key_positions: mx.array, window=None) -> mx.array:
    """Which keys queries attend to (the two broadcast against each other): those at or before the query,
    and within its last ``window`` tokens."""
    visible = key_positions <= query_positions
    if window is not None:
        visible = visible & (key_positions > query_positions - window)
    return visible


def window_start(first_query: int, window, block_size: int) -> int:
    """The first block (index in a block table) a window of queries from position ``first_query`` on reaches."""
    return 0 if window is None else max(0, first_query - window + 1) // block_size


def grouped_prefill_attention(
    queries, k_pool, v_pool, block_table, context_len, scale, heads: int, window=None, sinks=None, own=None
):
    """``prefill_attention`` with the context its queries see gathered, ``heads`` KV heads at a time.

    Each group is evaluated before the next is gathered, so only one group's
    context is held at once.
    """
    n, q_heads = queries.shape[:2]
    kv_heads = k_pool.shape[1]
    block_size = k_pool.shape[2]
    rep = q_heads // kv_heads
    own_k, own_v = own or (None, None)
    # Only the blocks the queries' windows reach are gathered: keys from position `start` on.
    start = window_start(context_len - n, window, block_size) * block_size
    block_table, length = block_table[start // block_size :], context_len - start
    if window is not None and context_len > window:
        queries_at = mx.arange(context_len - n, context_len)[:, None]
        mask = visible_keys(queries_at, mx.arange(start, context_len)[None], window)
    else:
        mask = "causal" if n > 1 else None
    in_full = not fused_prefill(n, k_pool, v_pool)  # scores computed in full: causal chunks go in query tiles
    parts = []
    for first in range(0, kv_heads, heads):
        group = slice(first, min(first + heads, kv_heads))
        k = chunk_context(k_pool, block_table, start, length, own_k, context_len - n, group)
        if v_pool is k_pool:  # MLA: one pool
            v = k
        else:
            v = chunk_context(v_pool, block_table, start, length, own_v, context_len - n, group)
        q_group = slice(group.start * rep, group.stop * rep)
        q = queries[:, q_group].swapaxes(0, 2)  # (1, Hq of the group, n, D)
        group_sinks = None if sinks is None else sinks[q_group]
        parts.append(chunk_attention(q, k, v, scale, mask, group_sinks, in_full))
        if heads < kv_heads:
            mx.eval(parts[-1])
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
    return out.swapaxes(0, 2)


def chunk_attention(q, k, v, scale: float, mask, sinks, in_full: bool) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` of queries ``(1, H, n, D)``, the last ``n`` of the keys'
    positions. Where it computes the scores in full (``in_full``) and ``mask`` is causal, it runs in tiles of
    ``QUERY_TILE`` queries, each over the keys up to its last query: about half the scores of one call for a
    chunk with no context before it, less with more."""
    n = q.shape[2]
    if not in_full or not isinstance(mask, str) or n <= QUERY_TILE:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
    past = k.shape[2] - n  # keys before the first query
    tiles = []
    for first in range(0, n, QUERY_TILE):
        end = past + min(first + QUERY_TILE, n)  # "causal" masks each tile's keys from its bottom right
        tile = q[:, :, first : first + QUERY_TILE]
        tiles.append(mx.fast.scaled_dot_product_attention(tile, k[:, :, :end], v[:, :, :end], scale=scale,
                                                          mask="causal", sinks=sinks))  # fmt: skip
    return mx.concatenate(tiles, axis=2)


def tiled_prefill_attention(
    queries, k_pool, v_pool, block_table, context_len, scale, tile: int, window=None, sinks=None, softcap=None,
    own=None,
):  # fmt: skip
    """``prefill_attention`` over ``tile``-token slices of the context, merged with an online softmax.

    Every slice has ``tile`` tokens (the last one padded with the null block and
    masked), so a chunk's slices share one compiled tile step. Each slice is
    evaluated before the next is queued, so this is not ``compilable``: prefill
    chunks only run in eager steps.
    """
    n, q_heads, _, dim = queries.shape
    _, kv_heads, block_size, _ = k_pool.shape
    rep = q_heads // kv_heads
    own_k, own_v = own or (None, None)
    # The CPU multiplies float32 matrices with BLAS and lower precisions without it.
    dtype = mx.float32 if mx.default_device() == mx.cpu else v_pool.dtype
    q = (queries * scale).astype(dtype).reshape(n, kv_heads, rep, dim).transpose(1, 2, 0, 3)
    q = q.reshape(kv_heads, rep * n, dim)
    positions = mx.arange(context_len - n, context_len, dtype=mx.int32)
    # The running max logit and exp-sum start from the sinks' logit (exp(0) = 1), or from nothing.
    if sinks is None:
        peak = mx.full((kv_heads, rep, n, 1), -mx.inf, mx.float32)
        total = mx.zeros((kv_heads, rep, n, 1), mx.float32)
    else:
        peak = mx.broadcast_to(sinks.astype(mx.float32).reshape(kv_heads, rep, 1, 1), (kv_heads, rep, n, 1))
        total = mx.ones((kv_heads, rep, n, 1), mx.float32)
    window_size = mx.array(context_len if window is None else window, mx.int32)
    out = mx.zeros((kv_heads, rep, n, v_pool.shape[-1]), mx.float32)
    per_tile = tile // block_size
    first = window_start(context_len - n, window, block_size)  # tiles start at the first block a window reaches
    used = block_table[first : -(-context_len // block_size)]
    tiles = -(-used.size // per_tile)
    block_table = mx.pad(used, (0, tiles * per_tile - used.size))
    for index in range(tiles):
        start = (first + index * per_tile) * block_size
        blocks = block_table[index * per_tile : (index + 1) * per_tile]
        k = chunk_context(k_pool, blocks, start, tile, own_k, context_len - n)[0].astype(dtype)  # (H, tile, D)
        if v_pool is not k_pool:
            v = chunk_context(v_pool, blocks, start, tile, own_v, context_len - n)[0].astype(dtype)
        else:
            v = k
        tile_start = mx.array(start, mx.int32)
        peak, total, out = _attend_tile(q, k, v, positions, tile_start, window_size, peak, total, out, softcap)
        # MLX allocates a graph's arrays as it queues their work: unevaluated, every slice's scores
        # would be held at once.
        mx.eval(peak, total, out)
    out = (out / total).astype(queries.dtype)  # (H, rep, n, Dv)
    return out.reshape(q_heads, n, -1).swapaxes(0, 1)[:, :, None]


@mx.compile
def _attend_tile(q, k, v, positions, start, window, peak, total, out, softcap):
    """One tile's step of the online softmax: the running max logit, exp-sum and weighted sum of V."""
    heads, rep, n, _ = out.shape
    length = k.shape[1]
    scores = (q @ k.swapaxes(1, 2)).astype(mx.float32).reshape(heads, rep, n, length)
    if softcap is not None:
        scores = mx.tanh(scores / softcap) * softcap
    keys_at = (mx.arange(length, dtype=mx.int32) + start)[None]
    scores = mx.where(visible_keys(positions[:, None], keys_at, window), scores, -mx.inf)
    # A query that has seen no key yet (a tile before its window) keeps a max of -inf: exp() takes 0 for it.
    new_peak = mx.maximum(peak, scores.max(axis=-1, keepdims=True))
    finite_peak = mx.where(new_peak == -mx.inf, 0, new_peak)
    probs = mx.exp(scores - finite_peak)
    part = (probs.astype(v.dtype).reshape(heads, rep * n, length) @ v).astype(mx.float32)
    correction = mx.exp(peak - finite_peak)
    total = total * correction + probs.sum(axis=-1, keepdims=True)
    out = out * correction + part.reshape(heads, rep, n, -1)
    return new_peak, total, out


# mx.gather_mm runs one GPU threadgroup per product along the grid's z axis, which CUDA caps here.
MAX_GATHER_PRODUCTS = 65535
# MLX 0.32.4's CUDA gather_mm fails to launch float32 products of more rows (query heads per KV head):
# float32 decode takes that many query heads at a time, on every device (one more pass over the blocks).
MAX_GATHER_ROWS = 64


def decode_attention(
    queries, k_pool, v_pool, block_tables, context_lens, scale, window=None, sinks=None, table_start=None,
    softcap=None, shared=None,
):  # fmt: skip
    """One query per row ``(R, Hq, 1, D)`` over the blocks of its table ``(R, max_blocks)``: over its last
    ``window`` tokens only, if given, with ``sinks`` (one logit per query head) in the softmax, and with
    ``softcap``, scores taken as ``softcap * tanh(scores / softcap)``.
    ``table_start`` ``(R,)``: the position of each row's first table entry, if not 0 (``plan.window_tables``).
    ``shared``: a dict that a step's calls with the same tables, lengths, ``window`` and ``table_start`` pass
    alike (``plan.shared``): the arrays made from those alone (gather indices, the keys each row sees) are
    made once for them all, not once a layer.

    Scores and weighted values are ``mx.gather_mm`` products of each (row, KV
    head) with each block of its table, at most ``MAX_GATHER_PRODUCTS`` per call;
    softmax is taken in float32 and normalised after the weighted sum.
    """
    rows, q_heads, _, dim = queries.shape
    on_cpu = mx.default_device() == mx.cpu
    if isinstance(k_pool, QuantizedPool) or (on_cpu and v_pool.dtype != mx.float32):
        # Take the blocks the rows use as values: the CPU gather_mm only takes float32.
        dtype = mx.float32 if on_cpu else v_pool.dtype
        return _decode_block_values(
            queries, k_pool, v_pool, block_tables, context_lens, scale, window, sinks, table_start, softcap, dtype,
            shared,
        )
    num_blocks, kv_heads, block_size, _ = k_pool.shape
    rep = q_heads // kv_heads
    width = block_tables.shape[1]
    dv = v_pool.shape[-1]
    if rep > MAX_GATHER_ROWS and k_pool.dtype == mx.float32:  # each KV head's query heads, a slice at a time
        return _decode_head_slices(
            queries, k_pool, v_pool, block_tables, context_lens, scale, window, sinks, table_start, softcap, shared
        )

    q = (queries * scale).astype(k_pool.dtype).reshape(rows * kv_heads, rep, dim)
    keys = k_pool.reshape(num_blocks * kv_heads, block_size, dim).swapaxes(1, 2)
    values = v_pool.reshape(num_blocks * kv_heads, block_size, dv)
    step = max(1, MAX_GATHER_PRODUCTS // (rows * kv_heads))
    chunks = [slice(start, start + step) for start in range(0, width, step)]
    indices = _once(shared, ("gather", kv_heads), lambda: _gather_indices(block_tables, kv_heads, chunks))
    q_index, kv_index, values_index = indices
    scores = [mx.gather_mm(q, keys, qi, ki) for qi, ki in zip(q_index, kv_index)]
    scores = (scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=2)).astype(mx.float32)
    visible = _once(
        shared, ("visible", block_size), lambda: _visible(context_lens, window, table_start, width, block_size)
    )
    probs, total = _softmax_terms(scores, visible, sinks, softcap)
    out = _weighted_values(probs, total, values, chunks, kv_index, values_index)
    return out.reshape(rows, q_heads, 1, dv)


def _once(shared: dict | None, key, make):
    """``make()``, kept in ``shared`` under ``key`` for the step's other layers (made anew without ``shared``)."""
    if shared is None:
        return make()
    if key not in shared:
        shared[key] = make()
    return shared[key]


def _decode_block_values(
    queries, k_pool, v_pool, block_tables, context_lens, scale, window, sinks, table_start, softcap, dtype, shared
):
    """``decode_attention`` over the blocks the rows use, taken from the pools as values in ``dtype``."""
    used = block_tables.reshape(-1)
    same = v_pool is k_pool  # MLA's latent rows: one pool
    k_pool = block_values(k_pool, used, dtype)
    v_pool = k_pool if same else block_values(v_pool, used, dtype)
    shared = None if shared is None else shared.setdefault("block values", {})  # over these blocks' tables
    block_tables = _once(shared, "tables", lambda: mx.arange(used.size, dtype=mx.int32).reshape(block_tables.shape))
    out = decode_attention(
        queries, k_pool, v_pool, block_tables, context_lens, scale, window, sinks, table_start, softcap, shared
    )
    return out.astype(queries.dtype)


def _decode_head_slices(
    queries, k_pool, v_pool, block_tables, context_lens, scale, window, sinks, table_start, softcap, shared
):
    """``decode_attention`` of each KV head's query heads ``MAX_GATHER_ROWS`` at a time."""
    rows, q_heads, _, dim = queries.shape
    kv_heads = k_pool.shape[1]
    rep = q_heads // kv_heads
    dv = v_pool.shape[-1]
    grouped = queries.reshape(rows, kv_heads, rep, dim)
    grouped_sinks = None if sinks is None else sinks.reshape(kv_heads, rep)
    parts = []
    for s in range(0, rep, MAX_GATHER_ROWS):
        q = grouped[:, :, s : s + MAX_GATHER_ROWS].reshape(rows, -1, 1, dim)
        part_sinks = None if sinks is None else grouped_sinks[:, s : s + MAX_GATHER_ROWS].reshape(-1)
        part = decode_attention(
            q, k_pool, v_pool, block_tables, context_lens, scale, window, part_sinks, table_start, softcap, shared
        )
        parts.append(part.reshape(rows, kv_heads, -1, dv))
    return mx.concatenate(parts, axis=2).reshape(rows, q_heads, 1, dv)


def _gather_indices(block_tables, kv_heads: int, chunks: list[slice]):
    """``mx.gather_mm``'s indices for each (row, KV head, table entry), a list per chunk of the table's columns
    ``(R, H, W')``: of the row's queries of that head in ``(R * H, rep, D)``, of the block's K/V of that head in
    ``(num_blocks * H, ...)``, and of the chunk's weights ``(R * H * W', rep, bs)``."""
    rows, width = block_tables.shape
    heads = mx.arange(kv_heads, dtype=mx.int32)
    pairs = mx.arange(rows, dtype=mx.int32)[:, None] * kv_heads + heads
    q_index = mx.broadcast_to(pairs[:, :, None], (rows, kv_heads, width))
    kv_index = block_tables[:, None, :] * kv_heads + heads[None, :, None]  # (R, H, W)
    # CUDA's gather_mm takes its operands as packed arrays: slices must be made contiguous.
    q_index = [mx.contiguous(q_index[:, :, c]) for c in chunks]
    kv_index = [mx.contiguous(kv_index[:, :, c]) for c in chunks]
    values_index = [mx.arange(i.size, dtype=mx.int32).reshape(i.shape) for i in kv_index]
    return q_index, kv_index, values_index


def _visible(context_lens, window, table_start, width: int, block_size: int) -> mx.array:
    """Which keys of its table's ``width`` blocks each row sees: ``(R, 1, W, 1, bs)``."""
    rows = context_lens.shape[0]
    position = mx.arange(width * block_size, dtype=mx.int32).reshape(1, 1, width, 1, block_size)
    if table_start is not None:
        position = position + table_start.reshape(rows, 1, 1, 1, 1)
    return visible_keys(context_lens.reshape(rows, 1, 1, 1, 1) - 1, position, window)


def _softmax_terms(scores, visible, sinks, softcap):
    """The softmax of scores ``(R, H, W, rep, bs)`` over the keys each row sees (``visible``), before
    normalisation: ``exp(scores - peak)``, and its sum ``(R, H, rep, 1)`` with the sinks' terms."""
    rows, kv_heads, _, rep, _ = scores.shape
    if softcap is not None:
        scores = mx.tanh(scores / softcap) * softcap
    scores = mx.where(visible, scores, -mx.inf)  # (R, H, W, rep, bs)
    peak = scores.max(axis=(2, 4), keepdims=True)  # finite: a row sees its own token
    if sinks is not None:  # one more logit per query head, with no value
        sink = sinks.astype(mx.float32).reshape(1, kv_heads, 1, rep, 1)
        peak = mx.maximum(peak, sink)
    probs = mx.exp(scores - peak)
    total = probs.sum(axis=(2, 4))[..., None]  # (R, H, rep, 1)
    if sinks is not None:
        total = total + mx.exp(sink - peak).reshape(rows, kv_heads, rep, 1)
    return probs, total


def _weighted_values(probs, total, values, chunks, kv_index, values_index):
    """The values of each row's blocks weighted by ``probs`` (``gather_mm`` per chunk of the table), summed
    and divided by ``total``: ``(R, H, rep, Dv)`` in the values' dtype."""
    *_, rep, block_size = probs.shape
    probs = probs.astype(values.dtype)
    out = None
    for c, ki, index in zip(chunks, kv_index, values_index):
        flat = mx.contiguous(probs[:, :, c]).reshape(-1, rep, block_size)
        part = mx.gather_mm(flat, values, index, ki).sum(axis=2)  # (R, H, rep, Dv)
        out = part if out is None else out + part
    return (out.astype(mx.float32) / total).astype(values.dtype)
