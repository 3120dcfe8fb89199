"""RoPE as a kernel takes it: the numbers that say how ``mx.fast.rope`` rotates a row at a position.

A kernel that rotates what it reads (``AttentionKernel.write_and_attend`` with ``rope``) gets a ``RopeSpec``
and reads the cosines and sines of a step's angles from its ``table`` (``AttentionPlan.rope_table``: made once a
step); ``rotate`` is the same rotation in MLX operations, which the self-checks compare kernels and a model's
own RoPE module with.
"""

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """The first ``dims`` values of a row rotate in pairs, ``(j, j + dims / 2)`` or, ``traditional``, ``(j, j +
    1)``, pair ``i`` by the angle ``position_scale * position * inv_freqs[i]``; the rotated values are then
    multiplied by ``value_scale`` (YaRN's and LongRoPE's scale of the input), the others left as they are."""

    dims: int
    traditional: bool
    inv_freqs: mx.array  # (dims / 2,) float32
    position_scale: float = 1.0
    value_scale: float = 1.0

    def matches(self, other: "RopeSpec") -> bool:
        """Whether ``other`` rotates alike (layers whose specs match share a step's table)."""
        same = (self.dims, self.traditional, self.position_scale, self.value_scale) == (
            other.dims, other.traditional, other.position_scale, other.value_scale)  # fmt: skip
        return same and mx.array_equal(self.inv_freqs, other.inv_freqs).item()

    def table(self, positions: mx.array) -> mx.array:
        """``(R, dims)`` float32: the cosines, then the sines, of each position's ``dims / 2`` angles, times
        ``value_scale`` (what a kernel reads: the same for every layer of a step)."""
        angles = (self.position_scale * positions.astype(mx.float32))[:, None] * self.inv_freqs[None]
        return self.value_scale * mx.concatenate([mx.cos(angles), mx.sin(angles)], axis=-1)

    def rotate(self, x: mx.array, positions: mx.array) -> mx.array:
        """Rows ``x`` ``(R, ..., D)`` rotated at ``positions`` ``(R,)``, in float32."""
        x = x.astype(mx.float32)
        half = self.dims // 2
        table = self.table(positions).reshape(x.shape[0], *([1] * (x.ndim - 2)), self.dims)
        cos, sin = table[..., :half], table[..., half:]
        if self.traditional:
            first, second = x[..., 0 : self.dims : 2], x[..., 1 : self.dims : 2]
        else:
            first, second = x[..., :half], x[..., half : self.dims]
        pairs = [first * cos - second * sin, first * sin + second * cos]
        if self.traditional:
            rotated = mx.stack(pairs, axis=-1).reshape(*x.shape[:-1], self.dims)
        else:
            rotated = mx.concatenate(pairs, axis=-1)
        return mx.concatenate([rotated, x[..., self.dims :]], axis=-1)
