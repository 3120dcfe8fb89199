"""Fused paged attention for CUDA and Metal, from one template in ``csrc/``.

Decode rows run two kernels: one threadgroup per (row, KV head, head group,
512-token partition) computes a partial softmax-weighted sum, then a reduce
kernel merges a row's partitions, so a few long sequences still fill the GPU
(vLLM's paged attention v2). A step of few rows gives each threadgroup more
simd groups (up to ``max_warps``), one of many rows fewer. The sources compile
at first use.

Quantized pools (``quantized.QuantizedPool``, 8 or 4 bits) are read by a
variant of the same kernel that dequantizes each lane's values in registers.
Sliding windows (over block tables narrowed to the blocks a window reaches),
attention sinks and softcapped logits are template parameters of the same
kernels.

Before a configuration (device, dtype, head dim, block size, GQA ratio, bits
and group size, window, sinks, softcap) is first used, the kernel runs on
random inputs, with every K/V position a query must not see set to NaN (for
quantized pools: its scales), and is compared with ``PortableKernel`` in
float32 over the same values. A compile error or a mismatch warns once and
that configuration stays on the portable kernel, so a kernel that was never
run on this hardware cannot give wrong tokens. Shapes the kernel does not cover
(head dims other than a power of two from 8 to 256, K and V head dims that
differ, ...) also use the portable kernel.

Multi-head latent attention (``latent_attention``) has its own fused kernel,
from ``csrc/latent_attention.in`` (``latent.LatentKernels``).

``write_and_attend`` writes a step's full-precision K/V in place: in a decode
step, the partition kernel reads each row's own K/V as given and writes them
into the pools itself (``PA_NEW``, self-checked as its own configuration);
in a step whose every row is a query of these kernels, ``in_place`` writes
them first. GPU backends otherwise copy a pool that a step in flight holds.
"""

import hashlib

import mlx.core as mx

from . import self_check
from .base import AttentionKernel
from .dialect import CUDA, METAL, Dialect, KernelSource, build, read_template, render
from .fused_check import check_error
from .in_place import InPlaceWrites
from .latent import LatentKernels
from .plan import AttentionPlan, PrefillChunk
from .portable import PortableKernel, chunk_own_rows, prefill_attention
from .quantized import KV_BITS, QuantizedPool
from .rope import RopeSpec

SIMD = 32
VEC = 8  # values of a K/V row per lane (the template's VEC)
MAX_HEADS_PER_GROUP = 8
# Simd groups per threadgroup of the partition kernel: as many as keep the grid at most FILL_SIMD_GROUPS simd
# groups, between MIN_WARPS and the kernel's max_warps; a step of few rows then splits each slice over more
# simd groups, one of many rows keeps more threadgroups resident.
MIN_WARPS = 4
FILL_SIMD_GROUPS = 2048
# 32-bit registers a CUDA SM has for its resident threads: a threadgroup may not need more. A thread of the
# partition kernel holds 2 * VEC values per query head (its query and its sums) and up to THREAD_REGISTERS
# more, the K or V values of the token steps it loads together among them (ptxas for sm_90: 128 registers at
# most for 4 heads a group, 168 for 5; tests/test_kernel_sources.py checks them).
REGISTER_FILE = 65536
THREAD_REGISTERS = 64
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
# Self-check: max |fused - portable| / max |portable|, portable computed in float32.
TOLERANCE = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 2e-2}


def kernel_sources(
    template: str, dialect: Dialect, bits: int | None = None, group_size: int | None = None, new: bool = False,
    rope: bool = False,
):  # fmt: skip
    """``{"partition": KernelSource, "reduce": KernelSource}`` for full precision (``bits`` None) or for
    pools quantized to ``bits`` in groups of ``group_size``; ``new``: the partition kernel takes each row's
    own K/V and writes them (full precision only); ``rope``: and rotates the queries and keys it is given, by
    a table of each row's angles (``RopeSpec.table``). Names differ by variant and template text (MLX caches
    compiled kernels by name)."""
    assert not (new and bits), "only full-precision pools take the rows' own K/V"
    assert new or not rope, "only the rows' own keys are rotated"
    defines = {"PA_BITS": bits or 0, "PA_GROUP": group_size if bits else 0, "PA_NEW": int(new), "PA_ROPE": int(rope)}
    bodies = render(template, dialect, defines)
    tag = hashlib.sha1(template.encode()).hexdigest()[:12]
    variant = f"q{bits}g{group_size}_" if bits else ("new_rope_" if rope else ("new_" if new else ""))
    pools = (
        ["k_pool", "k_scales", "k_biases", "v_pool", "v_scales", "v_biases"] if bits else ["k_pool", "v_pool"]
    )
    pools += ["new_k", "new_v"] if new else []
    pools += ["rope"] if rope else []
    specs = {
        "partition": (f"paged_attention_partition_{variant}{tag}",
                      ["queries", *pools, "block_tables", "context_lens", "table_starts", "sinks", "params"],
                      ["part_out", "part_m", "part_l"]),
        "reduce": (f"paged_attention_reduce_{tag}",
                   ["part_out", "part_m", "part_l", "context_lens", "table_starts", "sinks"], ["out"]),
    }  # fmt: skip
    return {
        kernel: KernelSource(name, inputs, outputs, *bodies[kernel])
        for kernel, (name, inputs, outputs) in specs.items()
    }


def quantization(k_pool, v_pool) -> tuple[int | None, int | None] | None:
    """``(bits, group_size)`` of two pools quantized alike, ``(None, None)`` for two plain arrays, else None."""
    if isinstance(k_pool, QuantizedPool) and isinstance(v_pool, QuantizedPool):
        same = (k_pool.bits, k_pool.group_size) == (v_pool.bits, v_pool.group_size)
        return (k_pool.bits, k_pool.group_size) if same else None
    if isinstance(k_pool, QuantizedPool) or isinstance(v_pool, QuantizedPool):
        return None
    return None, None


def head_groups(rep: int) -> tuple[int, int]:
    """How the ``rep`` query heads of a KV head split into threadgroups: ``(groups, heads per group)``."""
    groups = -(-rep // MAX_HEADS_PER_GROUP)
    return groups, -(-rep // groups)


class FusedKernel(AttentionKernel):
    """Paged attention with the fused decode kernels of one dialect."""

    name: str
    dialect: Dialect
    auto_priority = 10
    compilable = True
    quantized = True  # takes quantized.QuantizedPool pools
    windowed = True  # takes window and sinks
    softcapped = True  # takes softcap
    in_place_writes = False  # write_and_attend writes K/V in place (a backend that runs its work in order)
    # A prefill chunk runs as single-query rows of the fused kernel while its
    # tokens x context length is at most this; larger chunks use the portable
    # causal attention (on the H200 the two cost the same at 64 tokens over a 4K
    # context: benchmarks/RESULTS.md).
    row_prefill_max_reads = 1 << 18
    max_warps = MIN_WARPS  # the most simd groups a threadgroup of few rows takes (a power of two)
    max_slots = None  # the most simd groups' sums kept at once (None: as many as threadgroup memory holds)

    def __init__(
        self,
        template: str | None = None,
        partition_size: int = 512,
        warps: int | None = None,
        poison_outputs: bool = False,
        latent_template: str | None = None,
    ):
        """``template`` and ``latent_template``: kernel sources to use instead of ``csrc/``'s;
        ``partition_size`` and ``warps``: tokens per partition and simd groups per threadgroup (None: chosen
        for each call's grid, see ``FILL_SIMD_GROUPS``); ``poison_outputs``: fill the kernels' output buffers
        with NaN before they run (tests: nothing unwritten is read)."""
        self.template = template if template is not None else read_template()
        self.partition_size = partition_size
        self.warps = warps
        self.init_value = float("nan") if poison_outputs else None
        self.portable = PortableKernel()
        reduce = kernel_sources(self.template, self.dialect)["reduce"]
        self.latent = LatentKernels(self.dialect, reduce, latent_template, init_value=self.init_value)
        self._kernels: dict[tuple, object] = {}
        self._checked: dict[tuple, bool] = {}
        self._param_arrays: dict[tuple, mx.array] = {}
        self._unused = mx.zeros((1,), mx.int32)  # stands in for table_starts and sinks where they are off
        self.writes = InPlaceWrites(self.dialect)

    def __call__(
        self, queries, k_pool, v_pool, plan: AttentionPlan, scale: float, window=None, sinks=None, softcap=None
    ):
        masking = {"window": window, "sinks": sinks, "softcap": softcap}
        if not self.usable(queries.dtype, k_pool, v_pool, queries.shape[1], window, sinks is not None, softcap):
            return self.portable(queries, k_pool, v_pool, plan, scale, **masking)

        def rows(every_row: bool):
            tables, lens, starts = self._row_tables(plan, every_row, window)
            q = queries[: lens.shape[0]]
            return self.decode(q, k_pool, v_pool, tables, lens, scale, **masking, table_starts=starts)

        def chunk(c: PrefillChunk):
            q, own = queries[c.row_start : c.row_start + c.num_tokens], chunk_own_rows(k_pool, v_pool, c)
            table, length = c.block_table, c.context_len
            return prefill_attention(q, k_pool, v_pool, table, length, scale, window, sinks, softcap, own)

        return self._route(plan, rows, chunk, k_pool)

    @staticmethod
    def _row_tables(plan: AttentionPlan, every_row: bool, window=None):
        """Block tables, context lengths and table starts of single-query rows (the decode rows, or every
        row), the tables narrowed to a window's reach."""
        tables, lens = plan.row_tables() if every_row else (plan.decode_block_tables, plan.decode_context_lens)
        starts = None
        if window is not None:
            tables, starts = plan.window_tables(window, every_row)
        return tables, lens, starts

    def write_and_attend(self, queries, k_flat, v_flat, index, keys, values, plan: AttentionPlan, shape,
                         scale: float, window=None, sinks=None, softcap=None,
                         rope: RopeSpec | None = None):  # fmt: skip
        """Write a step's K/V (``keys``, ``values``: ``(T, kv_heads, D)``, at rows ``index`` of the flat
        pools, whose ``(blocks, kv_heads, tokens)`` rows have ``shape``) in place, and attend as ``__call__``
        does: a decode step in one kernel that reads each row's own K/V as given and writes them, a step
        whose every row is a query of the row kernel with ``in_place`` first. With ``rope``, the queries and
        keys are unrotated: a decode step's kernel rotates them at the plan's positions. Returns the
        attention's output, or None where this cannot be done (nothing is written: the caller writes)."""
        if not self.in_place_writes:
            return None
        k_pool, v_pool = (p.reshape(*shape, -1) for p in (k_flat, v_flat))
        masking = {"window": window, "sinks": sinks, "softcap": softcap}
        features = (queries.dtype, k_pool, v_pool, queries.shape[1], window, sinks is not None, softcap)
        if plan.one_token_per_sequence and self.usable(*features, new=True, rope=rope):
            tables, lens, starts = self._row_tables(plan, False, window)
            return self.decode(queries, k_pool, v_pool, tables, lens, scale, **masking, table_starts=starts,
                               new_rows=(keys, values), rope=rope,
                               rope_table=None if rope is None else plan.rope_table(rope))  # fmt: skip
        if rope is not None:
            return None
        if plan.prefills and not self._all_rows(plan, k_pool):
            return None
        if not self.usable(*features) or not self.writes.usable(k_flat.dtype, queries.dtype, self._kept_verdicts()):
            return None
        rows = self.writes(k_flat, v_flat, index, keys, values, queries)
        return self(rows, k_pool, v_pool, plan, scale, **masking)

    def latent_attention(self, queries, pool, value_dim: int, plan: AttentionPlan, scale: float):
        """MLA rows (see ``kernels``): single-query rows through ``latent.LatentKernels``, other prefill
        chunks through the portable kernel's causal attention."""
        if not self.latent.usable(queries.dtype, pool, queries.shape[1], value_dim, self._kept_verdicts()):
            return self.portable.latent_attention(queries, pool, value_dim, plan, scale)

        def rows(every_row: bool):
            tables, lens = plan.row_tables() if every_row else (plan.decode_block_tables, plan.decode_context_lens)
            return self.latent.decode(queries[: lens.shape[0]], pool, value_dim, tables, lens, self._params(scale))

        def chunk(c: PrefillChunk):
            q, own = queries[c.row_start : c.row_start + c.num_tokens], chunk_own_rows(pool, pool, c)
            return prefill_attention(q, pool, pool, c.block_table, c.context_len, scale, own=own)[..., :value_dim]

        return self._route(plan, rows, chunk, pool)

    def _route(self, plan: AttentionPlan, rows, chunk, pool) -> mx.array:
        """A step's outputs in row order: ``rows(every_row)`` for the decode rows (or, when every prefill
        chunk is served best as rows, for every row), ``chunk(c)`` for each other prefill chunk. Chunks that
        attend to their own K/V at full precision (a quantized ``pool`` with the step's rows) are never rows:
        rows read every key from the pool."""
        if not plan.prefills:
            return rows(every_row=False)
        if self._all_rows(plan, pool):
            return rows(every_row=True)
        parts = [rows(every_row=False)] if plan.num_decode else []
        parts += [chunk(c) for c in plan.prefills]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    def _all_rows(self, plan: AttentionPlan, pool) -> bool:
        """Whether every prefill chunk of the step is served as rows."""
        own_rows = isinstance(pool, QuantizedPool) and pool.step_rows is not None
        return not own_rows and all(self.prefill_as_rows(c.num_tokens, c.context_len) for c in plan.prefills)

    def prefill_as_rows(self, num_tokens: int, context_len: int) -> bool:
        """Whether a prefill chunk is served best as single-query rows."""
        return num_tokens * context_len <= self.row_prefill_max_reads

    def supports(self, dtype, k_pool, v_pool, q_heads: int) -> bool:
        """Whether these shapes and dtypes are within what the kernel was written for."""
        layout = quantization(k_pool, v_pool)
        if layout is None:
            return False
        bits, group_size = layout
        _, kv_heads, block_size, dim = k_pool.shape
        lanes = dim // VEC
        return (
            dtype in DTYPES
            and k_pool.dtype == v_pool.dtype == dtype
            and v_pool.shape == k_pool.shape
            and dim % VEC == 0
            and 1 <= lanes <= SIMD
            and lanes & (lanes - 1) == 0
            and block_size % (SIMD // lanes) == 0
            and self.partition_size % block_size == 0
            and q_heads % kv_heads == 0
            # a lane's VEC values fill whole words and lie in one group
            and (bits is None or (bits in KV_BITS and group_size % VEC == 0 and dim % group_size == 0))
        )

    def usable(
        self, dtype, k_pool, v_pool, q_heads: int, window=None, sinks: bool = False, softcap=None, new=False,
        rope: RopeSpec | None = None,
    ) -> bool:  # fmt: skip
        """Supported, and passed its self-check on this device, for this ``window`` (or none), with or
        without ``sinks`` and a ``softcap``, with or without the rows' own K/V (``new``, ``decode``'s
        ``new_rows``), rotated by ``rope`` or not."""
        if not self.supports(dtype, k_pool, v_pool, q_heads):
            return False
        _, kv_heads, block_size, dim = k_pool.shape
        layout = quantization(k_pool, v_pool)
        if new and layout != (None, None):
            return False
        if rope is not None and not (new and self.rotates(rope, dim)):
            return False
        rotation = None if rope is None else (rope.dims, rope.traditional)
        features = (window, sinks, softcap is not None, new, rotation)
        key = (str(mx.default_device()), dtype, dim, block_size, q_heads // kv_heads, *layout, *features)
        if key not in self._checked:
            self._checked[key] = self._self_check(*key[1:])
        return self._checked[key]

    @staticmethod
    def rotates(rope: RopeSpec, dim: int) -> bool:
        """Whether the kernel rotates rows of ``dim`` values by ``rope``: whole lanes of values rotate, and each
        lane's pairs lie in one other lane (or, traditional, its own)."""
        return 0 < rope.dims <= dim and rope.dims % (2 * VEC) == 0

    def decode(self, queries, k_pool, v_pool, block_tables, context_lens, scale: float, window=None, sinks=None,
               softcap=None, table_starts=None, new_rows=None, warps=None, rope: RopeSpec | None = None,
               rope_table=None) -> mx.array:  # fmt: skip
        """The fused kernels, unchecked: ``(R, Hq, 1, D)`` queries over ``(R, W)`` block tables, each
        query over its last ``window`` tokens if given, with ``sinks`` and ``softcap`` as ``__call__``
        takes them; ``table_starts`` ``(R,)``: the position of each table's first column, if not 0
        (``plan.window_tables``; only with a window); ``new_rows``: each row's own keys and values
        ``(R, kv_heads, D)``, read from there and written into its slot of the pools, in place; ``rope``: the
        queries and new keys are unrotated, and rotated by the angles of ``rope_table`` (``rope.table`` of the
        rows' positions, row-contiguous; only with ``new_rows``); ``warps``: simd groups per threadgroup, if not
        the kernel's own choice. Queries, tables, lengths, sinks and new rows may be views of any strides (read
        in place); the pools must be row-contiguous."""
        rows, q_heads, _, dim = queries.shape
        _, kv_heads, block_size, _ = k_pool.shape
        dtype = k_pool.dtype
        rep = q_heads // kv_heads
        groups, heads_per_group = head_groups(rep)
        part = self.partition_size
        parts = -(-block_tables.shape[1] * block_size // part)
        warps = warps or self._warps(parts * kv_heads * groups * rows, heads_per_group)
        slots = self._slots(warps, heads_per_group, dim, block_size)
        threads = warps * SIMD
        bits, group_size = quantization(k_pool, v_pool)
        partition, reduce = self._compiled(bits, group_size, new_rows is not None, rope is not None)
        if bits:
            pools = [k_pool.data, k_pool.scales, k_pool.biases, v_pool.data, v_pool.scales, v_pool.biases]
        else:
            pools = [k_pool, v_pool, *(new_rows or [])]
        rotation = []
        if rope is not None:
            pools.append(rope_table)
            rotation = [("ROT", rope.dims), ("TRAD", rope.traditional)]
        lens = context_lens.astype(mx.int32)
        one = parts == 1  # the partition kernel writes the output itself
        starts = self._table_starts(rows, window, table_starts)
        masking = [("WINDOW", window or 0), ("SINKS", sinks is not None), ("SOFTCAP", softcap is not None)]
        # float32 whatever the model's dtype: MLX's CUDA backend keys compiled kernels by name and template
        # values, not by the dtypes of inputs that are not a template value
        sinks = self._unused if sinks is None else sinks.astype(mx.float32)
        part_out, part_m, part_l = partition(
            inputs=[queries, *pools, block_tables.astype(mx.int32), lens, starts, sinks, self._params(scale, softcap)],
            template=[("T", dtype), ("D", dim), ("BS", block_size), ("REP", rep), ("HPG", heads_per_group),
                      ("PART", part), ("NW", warps), ("SLOTS", slots), ("ONE", one), *masking, *rotation],
            grid=(parts * threads, kv_heads * groups, rows), threadgroup=(threads, 1, 1),
            output_shapes=[(rows, q_heads, parts, dim)] + [(1,) if one else (rows, q_heads, parts)] * 2,
            output_dtypes=[dtype if one else mx.float32, mx.float32, mx.float32],
            init_value=self.init_value,
        )
        return part_out if one else self._merge(reduce, [part_out, part_m, part_l], lens, starts, sinks, masking, dtype)

    def warp_choices(self, heads_per_group: int) -> list[int]:
        """The simd groups per threadgroup ``decode`` may choose for query heads in groups of
        ``heads_per_group`` (each is self-checked): powers of two from MIN_WARPS to ``max_warps``, as many as
        ``REGISTER_FILE`` holds by its estimate of a thread's registers."""
        if self.warps:
            return [self.warps]
        registers = SIMD * (2 * VEC * heads_per_group + THREAD_REGISTERS)
        choices = [MIN_WARPS]
        while choices[-1] * 2 <= self.max_warps and choices[-1] * 2 * registers <= REGISTER_FILE:
            choices.append(choices[-1] * 2)
        return choices

    def _warps(self, threadgroups: int, heads_per_group: int) -> int:
        """Simd groups per threadgroup for a grid of ``threadgroups``: the most that fill at most
        ``FILL_SIMD_GROUPS``."""
        choices = self.warp_choices(heads_per_group)
        return max([w for w in choices if w * threadgroups <= FILL_SIMD_GROUPS], default=min(choices))

    def _slots(self, warps: int, heads_per_group: int, dim: int, block_size: int) -> int:
        """How many simd groups' partial sums are kept at once (the template's SLOTS): as many as fit the
        threadgroup memory the partition kernel's other arrays leave, at least one, at most ``max_slots``."""
        free = self.dialect.shared_memory - self.shared_bytes(heads_per_group, dim, block_size, slots=0)
        return max(1, min(warps, self.max_slots or warps, free // (4 * heads_per_group * dim)))

    def shared_bytes(self, heads_per_group: int, dim: int, block_size: int, slots: int) -> int:
        """Threadgroup memory the partition kernel declares: a slice's block ids, its probabilities, two floats
        per head and ``slots`` simd groups' partial sums."""
        part = self.partition_size
        return 4 * (part // block_size + heads_per_group * (part + 2 + slots * dim))

    def _table_starts(self, rows: int, window, table_starts) -> mx.array:
        """The kernels' ``table_starts`` input: without a window a stand-in, else each table's first position."""
        if window is None:
            return self._unused
        if table_starts is None:  # tables from each sequence's first block
            return mx.zeros((rows,), mx.int32)
        return table_starts.astype(mx.int32)

    def _merge(self, reduce, partials, lens, starts, sinks, masking, dtype) -> mx.array:
        """The reduce kernel: each row's partitions (the partition kernel's outputs) merged, in ``dtype``."""
        rows, q_heads, _, dim = partials[0].shape
        (out,) = reduce(
            inputs=[*partials, lens, starts, sinks],
            template=[("T", dtype), ("D", dim), ("PART", self.partition_size), *masking],
            grid=(dim, q_heads, rows), threadgroup=(dim, 1, 1),
            output_shapes=[(rows, q_heads, 1, dim)], output_dtypes=[dtype],
            init_value=self.init_value,
        )
        return out

    def _params(self, scale: float, softcap=None) -> mx.array:
        """``(scale, softcap)`` as a device array, made once per pair (a new one each call costs a copy)."""
        key = (scale, softcap)
        if key not in self._param_arrays:
            self._param_arrays[key] = mx.array([scale, softcap or 0.0], mx.float32)
            mx.eval(self._param_arrays[key])
        return self._param_arrays[key]

    def _compiled(self, bits=None, group_size=None, new=False, rope=False):
        """The (partition, reduce) kernels of a variant, made at first use."""
        key = (bits, group_size, new, rope)
        if key not in self._kernels:
            sources = kernel_sources(self.template, self.dialect, bits, group_size, new, rope)
            # The partition kernel reads its views through their strides; pools and params are row-contiguous.
            partition = build(sources["partition"], self.dialect, contiguous=False)
            self._kernels[key] = (partition, build(sources["reduce"], self.dialect))
        return self._kernels[key]

    def _self_check(
        self, dtype, dim: int, block_size: int, rep: int, bits=None, group_size=None, window=None, sinks=False,
        softcap=False, new=False, rotation=None,
    ) -> bool:  # fmt: skip
        config = f"dtype={dtype}, head_dim={dim}, block_size={block_size}, gqa={rep}"
        if bits:
            config += f", kv_bits={bits}, group_size={group_size}"
        features = {"window": window, "sinks": sinks, "softcap": softcap, "new": new, "rotation": rotation}
        config += "".join(f", {name}={value}" for name, value in features.items() if value)
        warp_choices = self.warp_choices(head_groups(rep)[1])
        settings = (f"partition_size={self.partition_size}, warps={warp_choices}, max_slots={self.max_slots}, "
                    f"init_value={self.init_value}")  # fmt: skip
        return self_check.passes(
            f"{self.name} paged attention",
            config,
            lambda: max(
                check_error(
                    self, dtype, dim, block_size, rep, one_partition=one, bits=bits, group_size=group_size,
                    **features, warps=warps,
                )
                for one in (False, True)
                for warps in warp_choices
            ),
            TOLERANCE[dtype],
            source=f"{self.template}\n{settings}",
            verdict_file=self._kept_verdicts(),
        )

    def _kept_verdicts(self):
        """The verdict file, for this package's own kernels: a subclass's code (a plugin's) is not in the
        verdicts' fingerprints, so it checks itself in every process."""
        return self.verdict_file if type(self) in (CudaKernel, MetalKernel) else None


class CudaKernel(FusedKernel):
    """The fused kernels on MLX's CUDA backend."""

    name = "cuda"
    dialect = CUDA
    in_place_writes = True
    applies_rope = True  # its decode steps' kernel rotates unrotated rows (write_and_attend's rope)
    max_warps = 16

    def is_available(self) -> bool:
        return mx.cuda.is_available() and mx.default_device() == mx.gpu


class MetalKernel(FusedKernel):
    """The fused kernels on MLX's Metal backend."""

    name = "metal"
    dialect = METAL
    # Not on Metal: MLX orders its command buffers there by the arrays kernels give, and a pool written in
    # place is not one of them, so a later step could read a slot before it is written. Untested here.
    in_place_writes = False
    # Measured only on the H200, whose 132 SMs few rows leave idle: Metal keeps MIN_WARPS simd groups, and adds
    # their sums one at a time in the threadgroup memory it used before (more would leave room for fewer
    # threadgroups on a core), until an Apple GPU is measured.
    max_warps = MIN_WARPS
    max_slots = 1

    def is_available(self) -> bool:
        return mx.metal.is_available() and mx.default_device() == mx.gpu
