"""The attention plan: what one engine step tells the attention kernels.

A step packs every scheduled token into its own row of the model's batch, so
the model sees inputs of shape ``(T, 1)``: the tokens of all decoding
sequences first, then each prefill chunk as a run of consecutive rows. (Models
with recurrent layers take prefill chunks as sequences instead: a call of shape
``(B, L)``, each chunk a row, right-padded; ``as_rows`` and ``from_rows`` turn
its queries, keys and values into the kernel's rows and back. So do MLA models'
prompt chunks that decompress their context, one chunk a call.) Every
row is one query at its own position; a kernel may serve all rows as
single-token queries (``row_block_tables``/``row_context_lens``) or treat a
prefill chunk as one causal block (``prefills``).

K/V pools have shape ``(num_blocks, num_kv_heads, block_size, head_dim)``;
block 0 is the null block that pads block tables.
"""

from dataclasses import dataclass, field

import mlx.core as mx

from .rope import RopeSpec


def paces_layers() -> bool:
    """Whether eager steps on the default device keep it a layer ahead of the host (``LayerPacer``): on GPUs.
    On the CPU the computation dwarfs building a layer, and waiting for each layer holds less memory."""
    return mx.default_device() == mx.gpu


class LayerPacer:
    """How one eager (prefill) step waits for its layers' outputs.

    Prefill steps run eagerly: MLX allocates a graph's arrays as it queues
    their work, so a forward pass queued whole would hold every layer's
    activations at once, and waiting for each layer leaves the device idle
    while the host builds the next. A pacer queues each layer's output and
    waits for the one queued before it: the device computes one layer while
    the host builds the next, and a step holds two layers' activations (within
    ``engine.memory.step_reserve``). A layer whose attention may hold more than
    half the prefill attention's allowance is waited for at once (``overlap``
    False), so that two layers' attention stay within it.
    """

    def __init__(self):
        self._queued: mx.array | None = None

    def __call__(self, out: mx.array, overlap: bool = True) -> None:
        if not overlap:  # the layer before first: then this one alone holds its attention
            if self._queued is not None:
                mx.eval(self._queued)
            mx.eval(out)
            self._queued = None
            return
        mx.async_eval(out)
        if self._queued is not None:
            mx.eval(self._queued)
        self._queued = out


@dataclass(frozen=True)
class PrefillChunk:
    """Several new tokens of one sequence, in consecutive rows."""

    row_start: int
    num_tokens: int
    context_len: int  # tokens the chunk's last query sees (cached + new)
    block_table: mx.array  # (ceil(context_len / block_size),) int32


@dataclass
class AttentionPlan:
    block_size: int
    positions: mx.array  # (T,) int32: each row's token position, the RoPE offset
    slots: mx.array  # (T,) int32: block_id * block_size + offset, where each row's K/V goes
    num_decode: int  # rows [0, num_decode) are single-token queries
    decode_block_tables: mx.array  # (num_decode, max_blocks) int32, padded with 0
    decode_context_lens: mx.array  # (num_decode,) int32
    prefills: list[PrefillChunk] = field(default_factory=list)
    # A call of sequences ``(B, L)`` instead of rows: each sequence's first position ``(B,)``, and where each
    # row is in the call's flattened ``(B * L)`` tokens ``(T,)``.
    sequence_starts: "mx.array | None" = None
    sequence_rows: "mx.array | None" = None
    # Every row is the one new token of its sequence (a decode step): no row needs K/V another row writes.
    one_token_per_sequence: bool = False
    # Kernels may write this step's K/V into the pools in place (a compiled step of rows whose every layer
    # owns its pools: no write of it is ordered only by values, as a scatter after another write would be).
    in_place: bool = False
    # How a prefill step waits for its layers (None: each layer at once), shared by its groups of layers.
    pacer: "LayerPacer | None" = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def rope_offsets(self) -> mx.array:
        """What the model's RoPE takes as ``cache.offset``: one position per batch entry."""
        return self.positions if self.sequence_starts is None else self.sequence_starts

    def as_rows(self, x: mx.array) -> mx.array:
        """A call's ``(B, heads, L, D)`` queries, keys or values as the kernel's rows ``(T, heads, 1, D)``."""
        if self.sequence_rows is None:
            return x
        batch, heads, length, dim = x.shape
        flat = x.transpose(0, 2, 1, 3).reshape(batch * length, heads, dim)
        return flat[self.sequence_rows][:, :, None]

    def from_rows(self, rows: mx.array, like: mx.array) -> mx.array:
        """The kernel's output rows ``(T, heads, 1, D)`` in the layout of the call's queries ``like``
        (zeros at padding)."""
        if self.sequence_rows is None:
            return rows
        batch, heads, length, _ = like.shape
        flat = mx.zeros((batch * length, heads, rows.shape[-1]), dtype=rows.dtype)
        flat[self.sequence_rows] = rows[:, :, 0]
        return flat.reshape(batch, length, heads, -1).transpose(0, 2, 1, 3)

    @property
    def num_rows(self) -> int:
        return self.positions.shape[0]

    @property
    def max_context_len(self) -> int:
        lens = [c.context_len for c in self.prefills]
        if self.num_decode:
            lens.append(self.decode_block_tables.shape[1] * self.block_size)
        return max(lens, default=0)

    def pace(self, out: mx.array, overlap: bool = True) -> None:
        """Wait for a prefill step's layer output ``out``: at once, or through the step's ``pacer``."""
        if self.pacer is None:
            mx.eval(out)
        else:
            self.pacer(out, overlap)

    def shared(self, *key) -> dict:
        """A dict kept for this step under ``key``: what a kernel makes once for the layers that ask alike."""
        return self._cache.setdefault(("shared", *key), {})

    def write_indices(self, num_kv_heads: int) -> mx.array:
        """(T, num_kv_heads) rows of the flat pool ``(num_blocks*H*block_size, D)``."""
        key = ("write", num_kv_heads)
        if key not in self._cache:
            block, offset = self.slots // self.block_size, self.slots % self.block_size
            heads = mx.arange(num_kv_heads, dtype=mx.int32)
            idx = (block[:, None] * num_kv_heads + heads[None]) * self.block_size
            self._cache[key] = idx + offset[:, None]
        return self._cache[key]

    def rope_table(self, rope: RopeSpec) -> mx.array:
        """``rope.table`` of the rows' positions, shared by the step's layers that rotate alike."""
        key = ("rope", id(rope))
        if key not in self._cache:
            self._cache[key] = rope.table(self.positions)
        return self._cache[key]

    def window_tables(self, window: int, every_row: bool = False) -> tuple[mx.array, "mx.array | None"]:
        """The decode rows' block tables (``every_row``: ``row_tables``') narrowed to the columns a ``window``
        can reach, and the position each row's first column starts at (None when nothing was cut), shared by
        the step's layers."""
        key = ("window", window, every_row)
        if key not in self._cache:
            tables, lens = self.row_tables() if every_row else (self.decode_block_tables, self.decode_context_lens)
            self._cache[key] = window_tables(tables, lens, window, self.block_size)
        return self._cache[key]

    def row_tables(self) -> tuple[mx.array, mx.array]:
        """Every row as a single query: ``(T, max_blocks)`` block tables and ``(T,)`` context lengths."""
        if "rows" not in self._cache:
            width = max(1, -(-self.max_context_len // self.block_size))
            tables, lens = [], []
            if self.num_decode:
                pad = width - self.decode_block_tables.shape[1]
                tables.append(mx.pad(self.decode_block_tables, [(0, 0), (0, pad)]))
                lens.append(self.decode_context_lens)
            for chunk in self.prefills:
                row = mx.pad(chunk.block_table, [(0, width - chunk.block_table.shape[0])])
                tables.append(mx.broadcast_to(row[None], (chunk.num_tokens, width)))
                first = chunk.context_len - chunk.num_tokens + 1
                lens.append(mx.arange(first, chunk.context_len + 1, dtype=mx.int32))
            self._cache["rows"] = (
                mx.concatenate(tables).astype(mx.int32),
                mx.concatenate(lens).astype(mx.int32),
            )
        return self._cache["rows"]


def window_tables(block_tables, context_lens, window: int, block_size: int):
    """The columns of decode block tables that a ``window`` can reach, and the position each row's first
    one starts at: ``(tables (R, W'), start (R,))``, W' at most ``ceil(window / block_size) + 1``."""
    span = -(-window // block_size) + 1
    width = block_tables.shape[1]
    if width <= span:
        return block_tables, None
    first = mx.maximum(context_lens - window, 0) // block_size  # the first block a row's window reaches
    columns = mx.minimum(first[:, None] + mx.arange(span, dtype=mx.int32)[None], width - 1)
    return mx.take_along_axis(block_tables, columns, axis=1), first * block_size
