"""Fused decode attention for multi-head latent attention (MLA), from ``csrc/latent_attention.in``.

Every query head of an MLA layer attends the same latent rows, so the kernel
multiplies matrices on the GPU's matrix units: a threadgroup takes a tile of
heads (16 on CUDA's tensor cores, 8 on Metal's simdgroup matrices) over one
partition of a row's context, and the reduce kernel of ``paged_attention.in``
merges a row's partitions.

Self-checked like ``fused.FusedKernel``: before a configuration (device, dtype,
row and value widths, block size) is first used, the kernel runs on random rows
with every slot a query must not see set to NaN and is compared with the
portable kernel in float32 over the same values. A compile error or a mismatch
warns once and that configuration stays on the portable kernel.
"""

import hashlib

import mlx.core as mx

from . import self_check
from .dialect import LATENT_TEMPLATE, Dialect, KernelSource, build, read_template, render
from .portable import decode_attention

SIMD = 32
DTYPES = (mx.float16, mx.bfloat16)  # what the matrix units multiply
# Self-check: max |fused - portable| / max |portable|, portable in float32. The probabilities weigh the
# values rounded to the dtype, as in flash attention.
TOLERANCE = {mx.float16: 1e-2, mx.bfloat16: 2e-2}
MAX_VALUE_DIM = 1024  # the reduce pass runs one thread per value
CHUNK = 8  # values one thread copies at a time (the template's CHUNK)


def latent_source(template: str, dialect: Dialect) -> KernelSource:
    """The partition kernel, named by its template text (MLX caches compiled kernels by name)."""
    header, body = render(template, dialect, tiles=True)["partition"]
    tag = hashlib.sha1(template.encode()).hexdigest()[:12]
    inputs = ["queries", "pool", "block_tables", "context_lens", "params"]
    return KernelSource(f"latent_attention_partition_{tag}", inputs, ["part_out", "part_m", "part_l"], header, body)


class LatentKernels:
    """MLA decode rows on one dialect's fused kernels."""

    def __init__(
        self,
        dialect: Dialect,
        reduce: KernelSource,
        template: str | None = None,
        partition_size: int = 256,
        warps: int = 4,
        init_value: float | None = None,
    ):
        """``reduce``: ``paged_attention.in``'s reduce kernel; ``template``: kernel source to use instead
        of ``csrc/``; ``partition_size`` and ``warps``: tokens per partition and simd groups per
        threadgroup; ``init_value``: what output buffers hold before the kernels run (tests)."""
        self.dialect = dialect
        self.template = template if template is not None else read_template(LATENT_TEMPLATE)
        self.reduce_source = reduce
        self.partition_size = partition_size
        self.warps = warps
        self.init_value = init_value
        self._kernels = None
        self._checked: dict[tuple, bool] = {}
        self._unused = mx.zeros((1,), mx.int32)  # the reduce pass's table_starts and sinks

    def supports(self, dtype, pool, q_heads: int, value_dim: int) -> bool:
        """Whether these shapes and dtypes are within what the kernel was written for: one unquantized
        row per token, heads in whole tiles, values in whole tiles per simd group."""
        if not isinstance(pool, mx.array):
            return False
        _, kv_heads, block_size, dim = pool.shape
        tile, part = self.dialect.tile, self.partition_size
        return (
            dtype in DTYPES
            and pool.dtype == dtype
            and kv_heads == 1
            and q_heads % tile == 0
            and dim % tile == 0
            and dim % CHUNK == 0
            and value_dim <= min(dim, MAX_VALUE_DIM)
            and value_dim % (tile * self.warps) == 0
            and block_size % tile == 0
            and part % block_size == 0
            and self.shared_bytes(dtype, dim, value_dim, block_size) <= self.dialect.shared_memory
        )

    def shared_bytes(self, dtype, dim: int, value_dim: int, block_size: int) -> int:
        """Threadgroup memory the partition kernel declares (the template's arrays, rows padded by ``CHUNK``):
        staged queries or values, scores (float32) and probabilities of its heads, block ids, and two
        floats per head."""
        tile, part = self.dialect.tile, self.partition_size
        staged = max(tile * (dim + CHUNK), tile * (value_dim + CHUNK)) * dtype.size
        return staged + tile * (part + CHUNK) * (4 + dtype.size) + 4 * (part // block_size + 2 * tile)

    def usable(self, dtype, pool, q_heads: int, value_dim: int, verdict_file=None) -> bool:
        """Supported, and passed its self-check on this device (``verdict_file``: see ``self_check.passes``)."""
        if not self.supports(dtype, pool, q_heads, value_dim):
            return False
        _, _, block_size, dim = pool.shape
        key = (str(mx.default_device()), dtype, dim, value_dim, block_size)
        if key not in self._checked:
            self._checked[key] = self._self_check(*key[1:], verdict_file)
        return self._checked[key]

    def decode(self, queries, pool, value_dim: int, block_tables, context_lens, params) -> mx.array:
        """The fused kernels, unchecked: ``(R, Hq, 1, D)`` queries over ``(R, W)`` block tables of a
        ``(blocks, 1, block_size, D)`` pool; ``params``: a float32 array whose first value is the scale. Returns
        ``(R, Hq, 1, value_dim)``."""
        rows, q_heads, _, dim = queries.shape
        block_size, dtype = pool.shape[2], pool.dtype
        tile, part = self.dialect.tile, self.partition_size
        parts = -(-block_tables.shape[1] * block_size // part)
        threads = self.warps * SIMD
        partition, reduce = self._compiled()
        lens = context_lens.astype(mx.int32)
        part_out, part_m, part_l = partition(
            inputs=[queries, pool, block_tables.astype(mx.int32), lens, params],
            template=[("T", dtype), ("D", dim), ("DV", value_dim), ("BS", block_size), ("HM", tile),
                      ("PART", part), ("NW", self.warps)],  # fmt: skip
            grid=(parts * threads, q_heads // tile, rows),
            threadgroup=(threads, 1, 1),
            output_shapes=[(rows, q_heads, parts, value_dim), (rows, q_heads, parts), (rows, q_heads, parts)],
            output_dtypes=[mx.float32] * 3,
            init_value=self.init_value,
        )
        (out,) = reduce(
            inputs=[part_out, part_m, part_l, lens, self._unused, self._unused],
            template=[("T", dtype), ("D", value_dim), ("PART", part), ("WINDOW", 0), ("SINKS", False),
                      ("SOFTCAP", False)],  # fmt: skip
            grid=(value_dim, q_heads, rows),
            threadgroup=(value_dim, 1, 1),
            output_shapes=[(rows, q_heads, 1, value_dim)],
            output_dtypes=[dtype],
            init_value=self.init_value,
        )
        return out

    def _compiled(self):
        if self._kernels is None:
            self._kernels = (
                build(latent_source(self.template, self.dialect), self.dialect),
                build(self.reduce_source, self.dialect),
            )
        return self._kernels

    def _self_check(self, dtype, dim: int, value_dim: int, block_size: int, verdict_file) -> bool:
        config = f"dtype={dtype}, row={dim}, latent={value_dim}, block_size={block_size}"
        return self_check.passes(
            f"{self.dialect.name} latent attention",
            config,
            lambda: self.check_error(dtype, dim, value_dim, block_size),
            TOLERANCE[dtype],
            source=f"{self.template}\n{self.reduce_source}\npartition_size={self.partition_size}, warps={self.warps}, "
            f"init_value={self.init_value}",
            verdict_file=verdict_file,
        )

    def check_error(self, dtype, dim: int, value_dim: int, block_size: int, q_heads: int | None = None) -> float:
        """Relative error of ``decode`` against the portable kernel (float32) on random inputs.

        Rows of 1 token, a block and a bit, a partition less one, a whole partition, and several
        partitions and a bit, over scattered blocks; every slot a row must not see holds NaN in the
        fused kernel's pool. ``q_heads``: two threadgroups' worth unless given.
        """
        part = self.partition_size
        lens = [1, block_size + 3, part - 1, part, 2 * part + 5]
        rows, width = len(lens), -(-max(lens) // block_size)
        num_blocks = rows * width + 1
        kq, kp, kt = mx.random.split(mx.random.key(0), 3)
        queries = mx.random.normal((rows, q_heads or 2 * self.dialect.tile, 1, dim), key=kq).astype(dtype)
        pool = mx.random.normal((num_blocks, 1, block_size, dim), key=kp).astype(dtype)
        tables = (mx.random.permutation(num_blocks - 1, key=kt) + 1).reshape(rows, width).astype(mx.int32)
        context_lens = mx.array(lens, mx.int32)
        seen = mx.arange(width * block_size).reshape(1, width, block_size) < context_lens[:, None, None]
        visible = mx.zeros((num_blocks, 1, block_size, 1), mx.bool_)
        visible[tables.reshape(-1)] = seen.reshape(rows * width, 1, block_size, 1)
        scale = dim**-0.5
        reference = pool.astype(mx.float32)
        ref = decode_attention(queries.astype(mx.float32), reference, reference, tables, context_lens, scale)
        ref = ref[..., :value_dim]
        poisoned = mx.where(visible, pool, mx.nan)
        out = self.decode(queries, poisoned, value_dim, tables, context_lens, mx.array([scale], mx.float32))
        return (mx.abs(out.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()
