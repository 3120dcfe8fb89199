"""Quantized K/V blocks: what a kernel gets for a pool whose values are stored in 8 or 4 bits.

Each token's K (or V) row of one head is quantized along the head dimension
with ``mx.quantize`` (affine, groups of ``group_size`` values, each with a
scale and a bias in the model's dtype), as mlx-lm's ``QuantizedKVCache``
does. A row of ``D`` values packs into ``D * bits / 32`` uint32 words, value
``i`` in bits ``(i * bits) % 32`` upwards of word ``i * bits // 32``.
"""

from dataclasses import dataclass

import mlx.core as mx

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


@dataclass(frozen=True)
class QuantizedPool:
    """One layer's K or V blocks, quantized: ``shape`` and ``dtype`` are those of the values they stand for."""

    data: mx.array  # (num_blocks, heads, block_size, dim * bits // 32) uint32
    scales: mx.array  # (num_blocks, heads, block_size, dim // group_size), the model's dtype
    biases: mx.array  # like scales
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple:
        return (*self.scales.shape[:3], self.data.shape[-1] * 32 // self.bits)

    @property
    def dtype(self) -> mx.Dtype:
        return self.scales.dtype

    def map(self, f) -> "QuantizedPool":
        """``f`` (a take, a view) applied to the values, scales and biases alike: still quantized."""
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
