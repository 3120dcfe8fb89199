"""Quantized K/V blocks: what a kernel gets for a pool whose values are stored in 8 or 4 bits.

Each token's K (or V) row of one head is quantized along the head dimension
in ``mx.quantize``'s layout (affine, groups of ``group_size`` values, each with
a scale and a bias in the model's dtype), as mlx-lm's ``QuantizedKVCache``
stores it. A row of ``D`` values packs into ``D * bits / 32`` uint32 words,
value ``i`` in bits ``(i * bits) % 32`` upwards of word ``i * bits // 32``.
Keys are stored rotated, which makes them more faithful than mlx-lm's cache
at the same size: each group of a key's values is multiplied by a Hadamard
matrix (``rotate``) before it is quantized, which spreads the few large values
of keys' outlier channels over the group, so the group's range, and its
rounding error, shrink. Queries are multiplied by the inverse, which keeps
every score (``models.paged_cache``). Values, which have no such channels, are
stored as they are. (MLA's latent rows are keys and values at once: the
attention's output, a sum of rotated rows, is rotated back.) The matrices'
entries are powers of two, exact in any float dtype, so each is the other's
inverse with no error of their own. Every reader dequantizes as ``mx.dequantize`` does.

A step's prefill chunks attend to their own tokens' K/V at full precision, as
mlx-lm's cache attends a prompt to its own K/V before it quantizes them: the
pool a kernel gets then carries the rows the step wrote, before quantization
(``QuantizedPool.step_rows``), and earlier tokens are read quantized.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

KV_BITS = (8, 4)
GROUP_SIZES = (32, 64, 128)


def check_quantization(bits, group_size: int, dims, rows: str) -> None:
    """A ValueError unless ``bits`` (None: full precision) and ``group_size`` can quantize rows of ``dims``
    (``rows`` says what they are, for the message)."""
    if bits is None:
        return
    if bits not in KV_BITS:
        raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))} (or None), not {bits!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of {', '.join(map(str, GROUP_SIZES))}, not {group_size!r}")
    odd = sorted({d for d in dims if d % group_size})
    if odd:
        fitting = [g for g in GROUP_SIZES if all(d % g == 0 for d in dims)]
        advice = f"choose a kv_group_size that does ({', '.join(map(str, fitting))})" if fitting else (
            f"no kv_group_size ({', '.join(map(str, GROUP_SIZES))}) does, so this model cannot use kv_bits"
        )
        raise ValueError(f"kv_group_size {group_size} does not divide {rows} {odd[0]}: {advice}")


def rotate(x: mx.array, group_size: int) -> mx.array:
    """``x`` ``(..., D)`` with each group of ``group_size`` values (a power of 2) multiplied by the Hadamard
    matrix and a power of two, as keys are stored; in ``x``'s dtype."""
    return (x.reshape(-1, group_size) @ _hadamard(group_size, x.dtype, inverse=False)).reshape(x.shape)


def unrotate(x: mx.array, group_size: int) -> mx.array:
    """The inverse of ``rotate`` (its transpose too, up to a power of two: queries multiplied by it keep
    their scores against rotated keys)."""
    return (x.reshape(-1, group_size) @ _hadamard(group_size, x.dtype, inverse=True)).reshape(x.shape)


def _hadamard(size: int, dtype, inverse: bool) -> mx.array:
    """Sylvester's ``size x size`` Hadamard matrix ``H`` times ``2**-a`` (``rotate``) or ``2**-b``
    (``unrotate``), ``a + b = log2(size)``: as ``H @ H = size * I``, each undoes the other, and every entry
    is exact in any float dtype (made once per size and dtype)."""
    key = (size, dtype, inverse)
    if key not in _HADAMARD:
        h = np.ones((1, 1), np.float32)
        while h.shape[0] < size:
            h = np.block([[h, h], [h, -h]])
        log2 = size.bit_length() - 1
        _HADAMARD[key] = mx.array(h * 2.0 ** -(log2 - log2 // 2 if inverse else log2 // 2)).astype(dtype)
    return _HADAMARD[key]


_HADAMARD: dict[tuple, mx.array] = {}


@dataclass(frozen=True)
class QuantizedPool:
    """One layer's K or V blocks, quantized: ``shape`` and ``dtype`` are those of the values they stand for."""

    data: mx.array  # (num_blocks, heads, block_size, dim * bits // 32) uint32
    scales: mx.array  # (num_blocks, heads, block_size, dim // group_size), the model's dtype
    biases: mx.array  # like scales
    bits: int
    group_size: int
    step_rows: "mx.array | None" = None  # (T, heads, dim): the rows this step wrote, before quantization

    @property
    def shape(self) -> tuple:
        return (*self.scales.shape[:3], self.data.shape[-1] * 32 // self.bits)

    @property
    def dtype(self) -> mx.Dtype:
        return self.scales.dtype

    def map(self, f) -> "QuantizedPool":
        """``f`` (a take, a view) applied to the values, scales and biases alike: still quantized (and without
        the step's rows, which ``f`` does not index)."""
        return QuantizedPool(f(self.data), f(self.scales), f(self.biases), self.bits, self.group_size)

    def dequantize(self, dtype=None) -> mx.array:
        """The values, of shape ``self.shape``, in ``dtype`` (default: the pool's)."""
        out = mx.dequantize(self.data, self.scales, self.biases, group_size=self.group_size, bits=self.bits)
        return out if dtype is None else out.astype(dtype)


def block_values(pool, blocks: mx.array, dtype=None, axis: int = 0) -> mx.array:
    """The given blocks (indices along ``axis``) of a pool, quantized or not, as values in ``dtype``
    (default: the pool's)."""
    if isinstance(pool, QuantizedPool):
        return pool.map(lambda x: mx.take(x, blocks, axis=axis)).dequantize(dtype)
    taken = mx.take(pool, blocks, axis=axis)
    return taken if dtype is None else taken.astype(dtype)


def own_rows(pool, row_start: int, num_tokens: int) -> "mx.array | None":
    """A prefill chunk's own K (or V) rows ``(num_tokens, heads, dim)`` at full precision, when the pool is
    quantized and carries the step's rows; else None (the chunk reads its own tokens from the pool)."""
    if not isinstance(pool, QuantizedPool) or pool.step_rows is None:
        return None
    return pool.step_rows[row_start : row_start + num_tokens]
