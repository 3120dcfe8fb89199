"""The fused paged-attention kernels' self-check: ``check_error`` runs a kernel on random pools whose slots a
row must not see hold NaN, against the portable kernel in float32."""

import mlx.core as mx

from .plan import window_tables
from .portable import decode_attention
from .quantized import QuantizedPool
from .rope import RopeSpec


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
                sinks: bool = False, softcap: bool = False, new: bool = False, warps=None,
                rotation: tuple[int, bool] | None = None) -> float:  # fmt: skip
    """Relative error of ``kernel.decode`` (a ``FusedKernel``) against the portable kernel (float32) on random inputs.

    Rows of 1, a block and a bit, and several partitions' worth of tokens (and, with ``one_partition``, rows
    that fit one partition: the kernel without its reduce pass); every position a row must not see holds NaN
    in the fused kernel's pools. With ``bits``, the pools are random values quantized in groups of
    ``group_size`` (hidden positions: NaN scales), and the reference reads them dequantized. With a
    ``window``, the blocks wholly before a row's window are the null block, and the kernel runs over whole
    tables and over tables narrowed as the engine narrows them (the larger error counts); without
    ``one_partition`` a row reaches a partition past the window. ``sinks`` adds random sink logits (in the
    queries' dtype) and ``softcap`` caps logits at 1.5, where tanh bends. With ``new``, each row's own
    K/V (at its last position) is given as ``new_rows`` and NaN in the pools, and must be there after; with
    ``rotation`` ``(dims, traditional)`` too, unrotated, and rotated by ``check_rope`` where the reference reads.
    Every input but the pools is a view the kernel reads through its strides: the queries and own K/V once
    as a model's step gives them (``strided_view``) and once spaced (``spaced_view``). ``warps``: simd
    groups per threadgroup, if not the kernel's own choice.
    """
    lens = _check_lens(kernel.partition_size, block_size, window, one_partition)
    rows, width = len(lens), -(-max(lens) // block_size)
    num_blocks = rows * width + 1
    kq, kk, kv, kp, ks, kr = mx.random.split(mx.random.key(0), 6)
    queries = mx.random.normal((rows, kv_heads * rep, 1, dim), key=kq).astype(dtype)
    k_pool = mx.random.normal((num_blocks, kv_heads, block_size, dim), key=kk).astype(dtype)
    v_pool = mx.random.normal((num_blocks, kv_heads, block_size, dim), key=kv).astype(dtype)
    tables = (mx.random.permutation(num_blocks - 1, key=kp) + 1).reshape(rows, width).astype(mx.int32)
    context_lens = mx.array(lens, mx.int32)
    tables, visible = visible_slots(tables, context_lens, window, num_blocks, block_size)
    own, given = None, {}
    if new:  # each row's own slot, NaN in the pools: read from new_rows
        own_slots, visible = hide_own_slots(tables, context_lens, visible)
        own = own_slots, given.setdefault("new_rows", [slot_rows(p, own_slots) for p in (k_pool, v_pool)])
    if rotation is not None:  # unrotated queries and own keys given; the reference reads them rotated
        queries, k_pool, own, given = _rotated(check_rope(*rotation), context_lens * 37 + 5, queries, k_pool, own, kr)
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
                                  own, given, warps)  # fmt: skip
    values = [e.item() for e in errors]
    return float("nan") if any(v != v for v in values) else max(values)  # max() may pass over a NaN


def _check_lens(partition_size: int, block_size: int, window, one_partition: bool) -> list[int]:
    """The self-check's context lengths: 1, a block and a bit, one partition's or several (and past a window)."""
    lens = [1, block_size + 3, (partition_size - 1) if one_partition else (2 * partition_size + 5)]
    if window is not None and not one_partition:  # narrowed, this row fits one partition for small windows
        lens.append(window + partition_size + block_size + 5)
    return lens


def _run_errors(kernel, view, queries, pools, table, starts, context_lens, scale: float, masking, ref, own,
                given, warps) -> list:  # fmt: skip
    """One ``decode`` run's errors: of its output, and (given ``own``, the rows' slots and K/V as the pools must
    hold them) of what it wrote; the queries and ``given`` rows (``decode``'s arguments, unrotated where it
    rotates) as ``view`` lays them out, the other inputs strided."""
    given = dict(given)
    queries = given.pop("queries", queries)
    if "new_rows" in given:
        given["new_rows"] = [view(r) for r in given["new_rows"]]
    starts = None if starts is None else spaced_view(starts)
    out = kernel.decode(view(queries), *pools, strided_view(table), spaced_view(context_lens), scale, **masking,
                        table_starts=starts, warps=warps, **given)
    errors = [_difference(out, ref, relative=True)]
    if own is not None:  # written in place: the pools now hold the rows' own K/V (keys rotated: up to rounding)
        own_slots, own_rows = own
        rotated = [True, False] if "rope" in given else [False, False]
        errors += [_difference(slot_rows(p, own_slots), r, rel) for p, r, rel in zip(pools, own_rows, rotated)]
    return errors


def _difference(x, ref, relative: bool):
    """max |x - ref|, in float32; ``relative``: over max |ref|."""
    ref = ref.astype(mx.float32)
    difference = mx.abs(x.astype(mx.float32) - ref).max()
    return difference / mx.abs(ref).max() if relative else difference


def _rotated(rope: RopeSpec, positions, queries, k_pool, own, key):
    """A check of a kernel that rotates: new own keys, random; the queries, the pool and the own rows as the
    reference reads them (rotated, rounded to the queries' dtype), and ``decode``'s unrotated arguments."""
    assert own is not None, "only the rows' own keys are rotated: a check with rotation is one with new"
    own_slots, (own_keys, own_values) = own
    keys = mx.random.normal(own_keys.shape, key=key).astype(queries.dtype)
    rotated_keys = rope.rotate(keys, positions).astype(queries.dtype)
    given = {"new_rows": [keys, own_values], "rope": rope, "rope_table": rope.table(positions), "queries": queries}
    rotated_queries = rope.rotate(queries, positions).astype(queries.dtype)
    rotated_pool = set_slot_rows(k_pool, own_slots, rotated_keys)
    return rotated_queries, rotated_pool, (own_slots, [rotated_keys, own_values]), given


def check_rope(dims: int, traditional: bool) -> RopeSpec:
    """The rotation the self-check gives a kernel: a RoPE of base 10,000, positions scaled by 0.5 and rotated
    values by 1.25."""
    inv_freqs = 10000.0 ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    return RopeSpec(dims, traditional, inv_freqs, position_scale=0.5, value_scale=1.25)


def set_slot_rows(pool, slots, rows):
    """A pool ``(blocks, kv_heads, block_size, D)`` with ``rows`` ``(n, kv_heads, D)`` at flattened ``slots``."""
    blocks, kv_heads, block_size, dim = pool.shape
    flat = pool.swapaxes(1, 2).reshape(-1, kv_heads, dim)
    flat[slots] = rows
    return flat.reshape(blocks, block_size, kv_heads, dim).swapaxes(1, 2)
