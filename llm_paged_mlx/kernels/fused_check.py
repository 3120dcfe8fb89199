"""The fused paged-attention kernels' self-check: ``check_error`` runs a kernel on random pools whose slots a
row must not see hold NaN, against the portable kernel in float32."""

import mlx.core as mx

from .plan import window_tables
from .portable import decode_attention
from .quantized import QuantizedPool


def visible_slots(tables, context_lens, window, num_blocks: int, block_size: int):
    """The self-check's tables (null blocks where a ``window`` no longer reaches) and the pool slots rows see."""
    rows, width = tables.shape
    positions = mx.arange(width * block_size).reshape(1, width, block_size)
    seen = positions < context_lens[:, None, None]
    if window is not None:
        seen = seen & (positions >= context_lens[:, None, None] - window)
        # What a windowed table holds: the null block where the window no longer reaches
        tables = mx.where(seen.any(axis=2), tables, 0)
    visible = mx.zeros((num_blocks, 1, block_size, 1), mx.bool_)
    visible[tables.reshape(-1)] = seen.reshape(rows * width, 1, block_size, 1)
    visible[0] = False
    return tables, visible


def hide_own_slots(tables, context_lens, visible):
    """Each row's own slot (its last position) in the flattened pools, and ``visible`` with those slots hidden."""
    num_blocks, _, block_size, _ = visible.shape
    own_blocks = tables[mx.arange(tables.shape[0]), (context_lens - 1) // block_size]
    own_slots = own_blocks * block_size + (context_lens - 1) % block_size
    flat_slots = mx.zeros((num_blocks * block_size,), mx.bool_)
    flat_slots[own_slots] = True
    return own_slots, visible & ~flat_slots.reshape(num_blocks, 1, block_size, 1)


def slot_rows(pool, slots):
    """The K/V rows ``(n, kv_heads, D)`` of a pool ``(blocks, kv_heads, block_size, D)`` at flattened ``slots``."""
    _, kv_heads, _, dim = pool.shape
    return pool.swapaxes(1, 2).reshape(-1, kv_heads, dim)[slots]


def strided_view(x: mx.array) -> mx.array:
    """``x`` as a view of a wider array, its rows strided as the columns of a merged projection's output
    are (the kernel reads them in place): the last axis contiguous."""
    return mx.concatenate([x, mx.zeros_like(x)], axis=-1)[..., : x.shape[-1]]


def spaced_view(x: mx.array) -> mx.array:
    """``x`` as a view whose last axis has stride 2: no 16-byte load reads it."""
    return mx.stack([x, x], axis=-1).reshape(*x.shape[:-1], 2 * x.shape[-1])[..., ::2]


def poison(pool, visible):
    """A pool with NaN at every slot not ``visible`` (of a quantized pool: NaN scales)."""
    if isinstance(pool, QuantizedPool):
        return QuantizedPool(pool.data, mx.where(visible, pool.scales, mx.nan), pool.biases, pool.bits, pool.group_size)
    return mx.where(visible, pool, mx.nan)


def reference(queries, k_pool, v_pool, tables, context_lens, scale: float, window, sinks, softcap) -> mx.array:
    """The self-check's reference: ``decode_attention`` in float32 over the pools' values (dequantized)."""
    k_ref, v_ref = (p.dequantize(mx.float32) if isinstance(p, QuantizedPool) else p.astype(mx.float32)
                    for p in (k_pool, v_pool))  # fmt: skip
    ref_sinks = None if sinks is None else sinks.astype(mx.float32)
    return decode_attention(queries.astype(mx.float32), k_ref, v_ref, tables, context_lens, scale, window, ref_sinks,
                            softcap=softcap)  # fmt: skip


def check_error(kernel, dtype, dim: int, block_size: int, rep: int, kv_heads: int = 2, one_partition=False,
                bits: int | None = None, group_size: int | None = 64, window: int | None = None,
                sinks: bool = False, softcap: bool = False, new: bool = False, warps=None) -> float:  # fmt: skip
    """Relative error of ``kernel.decode`` (a ``FusedKernel``) against the portable kernel (float32) on random inputs.

    Rows of 1, a block and a bit, and several partitions' worth of tokens (and, with ``one_partition``, rows
    that fit one partition: the kernel without its reduce pass); every position a row must not see holds NaN
    in the fused kernel's pools. With ``bits``, the pools are random values quantized in groups of
    ``group_size`` (hidden positions: NaN scales), and the reference reads them dequantized. With a
    ``window``, the blocks wholly before a row's window are the null block, and the kernel runs over whole
    tables and over tables narrowed as the engine narrows them (the larger error counts); without
    ``one_partition`` a row reaches a partition past the window. ``sinks`` adds random sink logits (in the
    queries' dtype) and ``softcap`` caps logits at 1.5, where tanh bends. With ``new``, each row's own
    K/V (at its last position) is given as ``new_rows`` and NaN in the pools, and must be there after.
    Every input but the pools is a view the kernel reads through its strides: the queries and own K/V once
    as a model's step gives them (``strided_view``) and once spaced (``spaced_view``). ``warps``: simd
    groups per threadgroup, if not the kernel's own choice.
    """
    lens = [1, block_size + 3, (kernel.partition_size - 1) if one_partition else (2 * kernel.partition_size + 5)]
    if window is not None and not one_partition:  # narrowed, this row fits one partition for small windows
        lens.append(window + kernel.partition_size + block_size + 5)
    rows, width = len(lens), -(-max(lens) // block_size)
    num_blocks = rows * width + 1
    kq, kk, kv, kp, ks = mx.random.split(mx.random.key(0), 5)
    queries = mx.random.normal((rows, kv_heads * rep, 1, dim), key=kq).astype(dtype)
    k_pool = mx.random.normal((num_blocks, kv_heads, block_size, dim), key=kk).astype(dtype)
    v_pool = mx.random.normal((num_blocks, kv_heads, block_size, dim), key=kv).astype(dtype)
    tables = (mx.random.permutation(num_blocks - 1, key=kp) + 1).reshape(rows, width).astype(mx.int32)
    context_lens = mx.array(lens, mx.int32)
    tables, visible = visible_slots(tables, context_lens, window, num_blocks, block_size)
    own = None
    if new:  # each row's own slot, NaN in the pools: read from new_rows
        own_slots, visible = hide_own_slots(tables, context_lens, visible)
        own = own_slots, [slot_rows(p, own_slots) for p in (k_pool, v_pool)]
    scale = dim**-0.5
    sink_logits = mx.random.normal((kv_heads * rep,), key=ks).astype(dtype) if sinks else None
    cap = 1.5 if softcap else None
    if bits:
        k_pool, v_pool = (
            QuantizedPool(*mx.quantize(x, group_size, bits), bits, group_size) for x in (k_pool, v_pool)
        )
    poisoned = [poison(p, visible) for p in (k_pool, v_pool)]
    ref = reference(queries, k_pool, v_pool, tables, context_lens, scale, window, sink_logits, cap)
    # Whole tables, and tables narrowed to the window as the engine narrows them
    layouts = [(tables, None)]
    if window is not None:
        layouts.append(window_tables(tables, context_lens, window, block_size))
    masking = {"window": window, "sinks": None if sink_logits is None else spaced_view(sink_logits), "softcap": cap}
    errors = []
    for table, starts in layouts:
        for view in (strided_view, spaced_view):
            if new:  # fresh pools for each run: the kernel writes into them
                poisoned = [poison(p, visible) for p in (k_pool, v_pool)]
                mx.eval(poisoned)
            errors += _run_errors(kernel, view, queries, poisoned, table, starts, context_lens, scale, masking, ref,
                                  own, warps)  # fmt: skip
    values = [e.item() for e in errors]
    return float("nan") if any(v != v for v in values) else max(values)  # max() may pass over a NaN


def _run_errors(kernel, view, queries, pools, table, starts, context_lens, scale: float, masking, ref, own,
                warps) -> list:  # fmt: skip
    """One ``decode`` run's errors: of its output, and (given ``own``, the rows' slots and K/V) of what it wrote;
    the queries and own K/V as ``view`` lays them out, the other inputs strided."""
    given = {"new_rows": [view(r) for r in own[1]]} if own is not None else {}
    starts = None if starts is None else spaced_view(starts)
    out = kernel.decode(view(queries), *pools, strided_view(table), spaced_view(context_lens), scale, **masking,
                        table_starts=starts, warps=warps, **given)
    errors = [mx.abs(out.astype(mx.float32) - ref).max() / mx.abs(ref).max()]
    if own is not None:  # written in place: the pools now hold the rows' own K/V
        own_slots, own_rows = own
        written = [slot_rows(p, own_slots) for p in pools]
        errors += [mx.abs(w - r).astype(mx.float32).max() for w, r in zip(written, own_rows)]
    return errors
