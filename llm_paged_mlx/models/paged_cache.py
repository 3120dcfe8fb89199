"""Unmodified mlx-lm models over paged KV.

mlx-lm attention layers talk to their cache through a small protocol: they
read ``cache.offset`` for RoPE, call ``cache.update_and_fetch(k, v)`` and ask
``cache.make_mask``; then they call ``scaled_dot_product_attention`` from
``mlx_lm.models.base`` with ``cache=cache``. ``PagedLayerCache`` speaks that
protocol over one layer's K/V pool, and the attention hook (``attention_hook``)
hands the attention calls of caches of ours to them, which call the selected
paged kernel.

Multi-head latent attention (DeepSeek's MLA: deepseek_v3 and the models built
on mlx-lm's ``mla`` module) caches one latent row per token instead:
``update_and_fetch(kv_latent, k_pe)``, then for single-token queries it
attends with the latent as both keys and values, the query absorbed through
the latent up-projection, and ``mask = (q_pe * scale) @ k_pe.T`` as the RoPE
part of the scores. ``PagedLatentCache`` keeps ``[kv_latent | k_pe]`` rows and
returns an identity for ``k_pe``, so ``mask`` arrives as the scaled RoPE
query, and the kernel's ``latent_attention`` scores whole rows and sums their
latent part. A prompt chunk that the runner calls as a sequence ``(1, L)``
(``latent_shape``: when decompressing the context takes less arithmetic) gets
the whole context's latent and RoPE keys instead, and the hook runs mlx-lm's
prompt formulation over the per-head keys and values the model makes of them.

A step feeds the model inputs of shape ``(T, 1)``: every token is its own row
at its own position (``cache.offset`` is a ``(T,)`` array), see
``kernels.plan``. Models with recurrent layers (their state: ``state_cache``)
take prompts as right-padded sequences ``(B, L)`` instead, and MLA models the
prompt chunks they decompress, one a call; ``cache.offset`` then holds each
sequence's first position.
"""

from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx

from ..kernels.plan import AttentionPlan
from ..kernels.portable import (
    PREFILL_ATTENTION_BYTES,
    gather_context,
    overlay,
    prefill_attention_bytes,
    visible_keys,
)
from ..kernels.quantized import QuantizedPool, check_quantization, rotate, unrotate
from . import attention_hook, deferred_rope
from .attention_hook import HookedCache
from .latent_shape import query_tile

# What quantization errors call the rows of a pool.
KV_ROWS = "the model's K/V head dimension"
LATENT_ROWS = "the width of the model's MLA rows (latent + RoPE)"


def pool_columns(dim: int, dtype: mx.Dtype, kv_bits=None, kv_group_size=64) -> list[tuple[int, mx.Dtype]]:
    """The width and dtype of each pool array that holds rows of ``dim`` values: one, or three quantized."""
    if kv_bits is None:
        return [(dim, dtype)]
    groups = dim // kv_group_size
    return [(dim * kv_bits // 32, mx.uint32), (groups, dtype), (groups, dtype)]


class PendingRows(NamedTuple):
    """K/V rows a step wrote ``(T, heads, D)``, at rows ``index`` of the pools; ``rotation``: the keys are
    unrotated, their RoPE left to the kernel (``deferred_rope``)."""

    index: mx.array
    keys: mx.array
    values: mx.array
    rotation: "deferred_rope.DeferredRotation | None"


class PagedLayerCache(HookedCache):
    """One attention layer's K/V pool, behind mlx-lm's cache protocol.

    The pool is a list of arrays with one row per (block, KV head, token):
    K then V at full precision, or with ``kv_bits`` each of them as the packed
    values, scales and biases of ``mx.quantize``'s layout, quantized as they are
    written, keys rotated first (``kernels.quantized``); a step's prefill chunks attend to
    their own tokens' K/V before quantization (``QuantizedPool.step_rows``).
    """

    # Two ways quantized pools are made more faithful than mlx-lm's cache, at a price in determinism:
    # prefill chunks attend to their own tokens' K/V as written, before quantization, as a prompt does in
    # mlx-lm's cache, so a request's tokens depend on where the steps cut its prompt; and keys (MLA: latent
    # rows) are stored rotated (quantized.rotate), whose matrix product rounds a key alike only within one
    # batch size. Both off, quantized K/V are mx.quantize's of each row, and every key is read from the pool.
    prompts_attend_unquantized = True
    rotates_quantized_rows = True

    def __init__(
        self, num_blocks, block_size, num_kv_heads, k_dim, v_dim, dtype, kernel,
        kv_bits=None, kv_group_size=64, window=None,
    ):  # fmt: skip
        """``window``: each query attends to its last ``window`` tokens only (a sliding-window layer)."""
        check_quantization(kv_bits, kv_group_size, (k_dim, v_dim), KV_ROWS)
        self._make_pools(num_blocks, num_kv_heads, block_size, (k_dim, v_dim), dtype, kernel, kv_bits, kv_group_size)
        self.window = window

    def _make_pools(self, num_blocks, num_kv_heads, block_size, dims, dtype, kernel, kv_bits, kv_group_size):
        """Zeroed arrays for rows of each of ``dims`` values per (block, KV head, token)."""
        self._block_shape = (num_kv_heads, block_size)
        self.dtype = dtype
        self.bits, self.group_size = kv_bits, kv_group_size
        self.parts = 1 if kv_bits is None else 3  # arrays per row kind (K, V or latent)
        self.rotated = kv_bits is not None and self.rotates_quantized_rows  # keys stored rotated
        rows = num_blocks * num_kv_heads * block_size
        columns = [c for dim in dims for c in pool_columns(dim, dtype, kv_bits, kv_group_size)]
        # One owner per pool array: a lingering view would make every write copy the pool. (Layers of other
        # groups may share this list: ``engine.kv_groups``.)
        self.arrays = [mx.zeros((rows, width), dtype=t) for width, t in columns]
        self.kernel = kernel
        self.plan: AttentionPlan | None = None
        self._step_rows: list[mx.array] | None = None  # see _keep_step_rows
        self._pending: PendingRows | None = None  # what a step wrote, until attend writes it
        self.decodes_in_place = False  # whether the last decode step traced wrote this layer's K/V in place

    @property
    def shape(self) -> tuple[int, int, int]:
        """(blocks, KV heads, tokens per block)."""
        heads, size = self._block_shape
        return self.arrays[0].shape[0] // (heads * size), heads, size

    def names(self, layer: int) -> list[str]:
        """Names of the pool's arrays (as block files name them): k.0, v.0; quantized also k_scales.0, ...,
        and keys stored rotated k_rotated.0, k_rotated_scales.0, ...: a file of another layout has other
        names, so it is never read as this one."""
        return self._names(("k_rotated" if self.rotated else "k", "v"), layer)

    def _names(self, kinds: tuple[str, ...], layer: int) -> list[str]:
        suffixes = ("",) if self.bits is None else ("", "_scales", "_biases")
        return [f"{kind}{suffix}.{layer}" for kind in kinds for suffix in suffixes]

    @property
    def offset(self):
        return self.plan.rope_offsets

    def update_and_fetch(self, keys, values):
        """Write a step's K/V rows (full precision: left for ``attend``, which may write them in place); returns
        them (unused: the attention hook reads the pools)."""
        self.write_pending()  # rows no attention took (none do, but a write must not be lost)
        rotation = deferred_rope.take(keys)
        if rotation is not None and not self._may_rotate_in_kernel(rotation):
            keys, rotation = rotation.apply(keys), None
        keys, values = self.plan.as_rows(keys), self.plan.as_rows(values)
        rows, heads = keys.shape[0], keys.shape[1]
        index = self.plan.write_indices(heads)
        keys, values = keys.reshape(rows, heads, -1), values.reshape(rows, heads, -1)
        if self.bits is None:  # written by attend: in place where the kernel can (FusedKernel.write_and_attend)
            self._pending = PendingRows(index, keys, values, rotation)
            return keys, values
        keys = self._write(keys, self.arrays[: self.parts], index, self.rotated)
        values = self._write(values, self.arrays[self.parts :], index, rotated=False)
        self._keep_step_rows([keys, values])
        return keys, values

    def write_pending(self) -> None:
        """Write the K/V rows ``update_and_fetch`` left for ``attend``, as a scatter."""
        if self._pending is not None:
            index, keys, values = self._pending_rows()
            self._pending = None
            self.arrays[0][index] = keys
            self.arrays[1][index] = values

    def _pending_rows(self, rotated: bool = True) -> tuple:
        """``(index, keys, values)`` of the rows ``update_and_fetch`` left, in the pool's dtype, the keys
        rotated unless their rotation is left to the kernel (not ``rotated``)."""
        index, keys, values, rotation = self._pending
        if rotated and rotation is not None:
            keys = rotation.apply(keys)
        return index, keys.astype(self.dtype), values.astype(self.dtype)

    def _may_rotate_in_kernel(self, rotation: deferred_rope.DeferredRotation) -> bool:
        """Whether this step's attention may go to a kernel that rotates the decode rows' queries and keys (at
        the plan's positions: a layer may have given its RoPE other offsets)."""
        plan = self.plan
        return (
            self.bits is None and self.kernel.applies_rope and plan.in_place and plan.one_token_per_sequence
            and rotation.offset is plan.positions and not attention_hook.in_float32()
        )  # fmt: skip

    def drop_pending(self) -> None:
        """Forget the K/V rows of a step that is undone."""
        self._pending = None

    def _write_and_attend(self, rows, scale, masking, rotation=None) -> mx.array | None:
        """The attention of ``rows`` by a kernel that also writes the K/V rows ``update_and_fetch`` left, in
        place (``FusedKernel.write_and_attend``), where the plan allows it; None if it cannot. ``rotation``:
        the rows are unrotated, and so are the keys left (by the same RoPE): the kernel rotates both."""
        write_and_attend = self.kernel.write_and_attend
        if self._pending is None or write_and_attend is None or not self.plan.in_place or attention_hook.in_float32():
            return None
        rope = {} if rotation is None else {"rope": rotation.spec}
        pending = self._pending_rows(rotated=rotation is None)
        out = write_and_attend(rows, *self.arrays, *pending, self.plan, self.shape, scale, **masking, **rope)
        if self.plan.one_token_per_sequence:
            self.decodes_in_place = out is not None
        if out is not None:
            self._pending = None
            self.arrays[:] = mx.depends(self.arrays, [out])  # evaluating the pools runs the writes
        return out

    def _write(self, x: mx.array, arrays: list[mx.array], index: mx.array, rotated: bool) -> mx.array:
        """Store rows ``x`` ``(T, heads, dim)`` at ``index`` of ``arrays`` (with ``kv_bits`` quantized, rotated
        first if ``rotated``); returns them as they are before quantization, in the pool's dtype."""
        if self.bits is None:
            x = x.astype(self.dtype)
            arrays[0][index] = x
            return x
        x = (rotate(x, self.group_size) if rotated else x).astype(self.dtype)
        for array, part in zip(arrays, mx.quantize(x, group_size=self.group_size, bits=self.bits)):
            array[index] = part
        return x

    def _keep_step_rows(self, rows: list[mx.array]) -> None:
        """Keep what a step with prefill chunks wrote to quantized pools, before quantization, for its
        ``attend``: a prompt attends to its own K/V at full precision, as in mlx-lm's cache."""
        keep = self.bits is not None and self.plan.prefills and self.prompts_attend_unquantized
        self._step_rows = rows if keep else None

    def _quantized_pools(self, pools: list[mx.array]) -> list[QuantizedPool]:
        """The pool's arrays as one ``QuantizedPool`` per row kind, with the rows this step wrote."""
        step_rows, self._step_rows = self._step_rows or [None] * (len(pools) // 3), None
        return [
            QuantizedPool(*pools[3 * i : 3 * i + 3], self.bits, self.group_size, rows)
            for i, rows in enumerate(step_rows)
        ]

    def make_mask(self, *args, **kwargs):
        return None

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        return self.attend(queries, scale, sinks)

    def attend(self, queries, scale, sinks=None, softcap=None):
        """The kernel's attention of ``queries`` over this layer's pool (``sinks``, ``softcap``: see
        ``kernels``)."""
        rotation = deferred_rope.take(queries)
        keys_rotation = None if self._pending is None else self._pending.rotation
        in_kernel = rotation is not None and keys_rotation is not None and rotation.same(keys_rotation)
        if rotation is not None and not in_kernel:
            queries = rotation.apply(queries)
        dtype = queries.dtype
        window_and_sinks = {} if self.window is None and sinks is None else {"window": self.window, "sinks": sinks}
        if sinks is not None and not self.kernel.windowed:
            raise ValueError(f"attention kernel {self.kernel.name!r} does not take attention sinks")
        if softcap is not None:
            if not self.kernel.softcapped:
                raise ValueError(f"attention kernel {self.kernel.name!r} does not take softcapped scores")
            window_and_sinks["softcap"] = softcap
        rows = self.plan.as_rows(queries)
        if self.rotated:  # against rotated keys, the same scores
            rows = unrotate(rows, self.group_size)
        out, overlap = self._write_and_attend(rows, scale, window_and_sinks, rotation if in_kernel else None), False
        if out is None and in_kernel:  # the kernel does not rotate: the rows are rotated here, the keys as written
            rows = rotation.apply(rows)
            out = self._write_and_attend(rows, scale, window_and_sinks)
        if out is None:
            self.write_pending()
            pools = [a.reshape(*self.shape, -1) for a in self.arrays]
            if attention_hook.in_float32() and self.bits is None:
                rows, pools = rows.astype(mx.float32), [p.astype(mx.float32) for p in pools]
            k_pool, v_pool = pools if self.bits is None else self._quantized_pools(pools)
            out = self.kernel(rows, k_pool, v_pool, self.plan, scale, **window_and_sinks)
            overlap = bool(self.plan.prefills) and _overlaps(self.plan, rows.shape[1], k_pool, v_pool, self.window)
        if self.plan.prefills:
            self.plan.pace(out, overlap)
        return self.plan.from_rows(out, queries).astype(dtype)

    def block_rows(self, blocks: list[int]) -> mx.array:
        """The flat pool rows that hold the given blocks, block after block."""
        per_block = self.shape[1] * self.shape[2]
        within = mx.arange(per_block, dtype=mx.int32)
        return (mx.array(blocks, dtype=mx.int32)[:, None] * per_block + within).flatten()

    def copy_blocks(self, copies: list[tuple[int, int]]):
        """Copy whole blocks (copy-on-write), as (source, destination) pairs."""
        src = self.block_rows([s for s, _ in copies])
        dst = self.block_rows([d for _, d in copies])
        for array in self.arrays:
            array[dst] = array[src]

    def resize(self, num_blocks: int) -> None:
        """Grow the pool to ``num_blocks`` blocks, keeping what it holds (one array copied at a time)."""
        rows = num_blocks * self.shape[1] * self.shape[2]
        for i, array in enumerate(self.arrays):
            grown = mx.concatenate([array, mx.zeros((rows - array.shape[0], array.shape[1]), array.dtype)])
            mx.eval(grown)
            self.arrays[i] = grown
            del array, grown

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    # mlx-lm calls these on caches in some code paths.
    def empty(self):
        return False

    @property
    def state(self):
        return tuple(self.arrays)


class PagedLatentCache(PagedLayerCache):
    """One MLA layer's pool: a row ``[kv_latent | k_pe]`` per (block, token), as one KV head.

    The keys are whole rows, the values their first ``latent_dim`` values
    (the latent); with ``kv_bits`` the rows are quantized like K/V rows.
    """

    def __init__(self, num_blocks, block_size, row_dim, latent_dim, dtype, kernel, kv_bits=None, kv_group_size=64):
        check_quantization(kv_bits, kv_group_size, (row_dim,), LATENT_ROWS)
        self._make_pools(num_blocks, 1, block_size, (row_dim,), dtype, kernel, kv_bits, kv_group_size)
        self.latent_dim = latent_dim
        # The attention's output is the rows' first latent_dim values: rotated back only if no group straddles them.
        self.rotated = self.rotated and latent_dim % kv_group_size == 0
        self._rope_identity = mx.eye(row_dim - latent_dim, dtype=dtype)[None, None]  # see update_and_fetch

    def names(self, layer: int) -> list[str]:
        """Names of the pool's arrays: latent.0; quantized also latent_scales.0, latent_biases.0 (latent_rotated.0,
        ... when stored rotated)."""
        return self._names(("latent_rotated" if self.rotated else "latent",), layer)

    def update_and_fetch(self, kv_latent, k_pe):
        """Write each row's ``[kv_latent | k_pe]``. Rows get back the latent and, for ``k_pe``, an identity:
        the model's ``(q_pe * scale) @ k_pe.T`` then hands the attention call the scaled RoPE query as its
        mask. A sequence (one prompt chunk) gets its whole context's latent and RoPE keys."""
        kv_latent, k_pe = self.plan.as_rows(kv_latent), self.plan.as_rows(k_pe)
        rows = kv_latent.shape[0]
        x = mx.concatenate([kv_latent.reshape(rows, 1, -1), k_pe.reshape(rows, 1, -1)], axis=-1)
        written = self._write(x, self.arrays, self.plan.write_indices(1), self.rotated)
        if self.plan.sequence_rows is None:
            self._keep_step_rows([written])
            return kv_latent, self._rope_identity
        (chunk,) = self.plan.prefills
        context = gather_context(self._pool(), chunk.block_table, chunk.context_len)  # (1, 1, context, row)
        if self.rotated:
            context = unrotate(context, self.group_size)  # the model decompresses them: as they were
        if self.bits is not None and self.prompts_attend_unquantized:  # the chunk's own rows before quantization
            own = x[chunk.row_start : chunk.row_start + chunk.num_tokens].astype(self.dtype).swapaxes(0, 1)[None]
            context = overlay(context, 0, own, chunk.context_len - chunk.num_tokens)
        return context[..., : self.latent_dim], context[..., self.latent_dim :]

    def _pool(self):
        pools = [a.reshape(*self.shape, -1) for a in self.arrays]
        return pools[0] if self.bits is None else self._quantized_pools(pools)[0]

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        if sinks is not None:
            raise ValueError("attention sinks with multi-head latent attention are not supported by the paged engine")
        if self.plan.sequence_rows is not None:
            return self.attend_sequence(queries, keys, values, scale, mask)
        return self.attend(queries, mask, scale)

    def attend(self, queries, rope_queries, scale):
        """``queries`` ``(T, H, 1, latent_dim)`` absorbed, ``rope_queries`` ``(T, H, 1, rope_dim)`` already
        scaled; returns ``(T, H, 1, latent_dim)``, the attention output in latent space."""
        pool, dtype = self._pool(), queries.dtype
        if attention_hook.in_float32() and self.bits is None:
            queries, pool = queries.astype(mx.float32), pool.astype(mx.float32)
        rows = mx.concatenate([queries * scale, rope_queries.astype(queries.dtype)], axis=-1)
        if self.rotated:  # see PagedLayerCache.attend; the output, a sum of rotated rows, is rotated back
            rows = unrotate(rows, self.group_size)
        out = self.kernel.latent_attention(rows, pool, self.latent_dim, self.plan, 1.0)
        if self.rotated:
            out = unrotate(out, self.group_size)
        if self.plan.prefills:
            self.plan.pace(out, _overlaps(self.plan, rows.shape[1], pool, pool))
        return out.astype(dtype)

    def attend_sequence(self, queries, keys, values, scale, mask):
        """mlx-lm's prompt formulation for one chunk ``(1, H, L, D)`` over its decompressed context: ``mask``
        is the model's RoPE scores (float) or its own mask (None, or boolean), made causal here."""
        (chunk,) = self.plan.prefills
        length, context = queries.shape[2], chunk.context_len
        causal = visible_keys(mx.arange(context - length, context)[:, None], mx.arange(context)[None])
        if mask is None or isinstance(mask, str):
            mask = causal
        elif mask.dtype == mx.bool_:
            mask = mask & causal
        else:
            mask = mx.where(causal, mask, mx.array(mx.finfo(mask.dtype).min, mask.dtype))
        dtype, heads, widths = queries.dtype, queries.shape[1], keys.shape[-1] + values.shape[-1]
        tile = max(1, query_tile(heads, length, context, widths, dtype, PREFILL_ATTENTION_BYTES))
        if attention_hook.in_float32():
            queries, keys, values = (x.astype(mx.float32) for x in (queries, keys, values))
            mask = mask if mask.dtype == mx.bool_ else mask.astype(mx.float32)
        outs = []
        for start in range(0, length, tile):
            rows = slice(start, start + tile)
            outs.append(attention_hook.original_sdpa(queries[:, :, rows], keys, values, cache=None, scale=scale, mask=mask[..., rows, :]))
            mx.eval(outs[-1])  # tile by tile, within the budget
        return (outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)).astype(dtype)


def _overlaps(plan: AttentionPlan, q_heads: int, k_pool, v_pool, window=None) -> bool:
    """Whether a prefill step may queue the next layer before this one's attention is done: two layers'
    attention within the allowance (``kernels.plan.LayerPacer``; not the model check's float32 attention,
    whose pools are copied)."""
    if attention_hook.in_float32():
        return False
    held = prefill_attention_bytes(plan.prefills, q_heads, k_pool, v_pool, window)
    return held <= PREFILL_ATTENTION_BYTES // 2


@dataclass(frozen=True)
class LayerLayout:
    """What one layer caches per token: K and V rows per KV head, or (``latent``) one MLA row whose
    ``k_dim`` values are the keys and whose first ``v_dim`` values are the values. A ``window`` layer
    attends to each query's last ``window`` tokens only."""

    num_kv_heads: int
    k_dim: int
    v_dim: int
    dtype: mx.Dtype
    latent: bool = False
    window: int | None = None

    @property
    def row_dims(self) -> tuple[int, ...]:
        """The widths of the rows the pool stores per KV head and token."""
        return (self.k_dim,) if self.latent else (self.k_dim, self.v_dim)

    def bytes_per_token(self, kv_bits=None, kv_group_size=64) -> int:
        """Bytes of one token's rows in this layer's pool, at full precision or quantized to ``kv_bits``
        (a ValueError if ``kv_bits`` and ``kv_group_size`` cannot quantize them)."""
        check_quantization(kv_bits, kv_group_size, self.row_dims, LATENT_ROWS if self.latent else KV_ROWS)
        columns = [c for dim in self.row_dims for c in pool_columns(dim, self.dtype, kv_bits, kv_group_size)]
        return self.num_kv_heads * sum(width * dtype.size for width, dtype in columns)

    def make_cache(self, num_blocks, block_size, kernel, kv_bits=None, kv_group_size=64) -> "PagedLayerCache":
        """This layer's pool of ``num_blocks`` blocks, behind mlx-lm's cache protocol."""
        if self.latent:
            dims = (self.k_dim, self.v_dim, self.dtype)
            return PagedLatentCache(num_blocks, block_size, *dims, kernel, kv_bits, kv_group_size)
        dims = (self.num_kv_heads, self.k_dim, self.v_dim, self.dtype)
        return PagedLayerCache(num_blocks, block_size, *dims, kernel, kv_bits, kv_group_size, self.window)
