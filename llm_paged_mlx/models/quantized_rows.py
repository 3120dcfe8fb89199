"""Layers that multiply a step's rows as one matrix: quantized linear layers (sharded ones too) and MLA's
per-head ones.

Engine steps feed the model inputs of shape ``(T, 1)``: every token is its own
batch row, at its own position. ``mx.matmul`` folds such a batch into one
``(T, K)`` product, but ``mx.quantized_matmul`` takes it as ``T`` products of
one row each, which MLX's GPU backends run as matrix-vector products (reading
the weights once per row) or as tiles padded from one row. The layers here
reshape their input to ``(1, T, K)`` first: one product with the same values,
the shape mlx-lm's own prefill gives it.

MLA's ``MultiLinear`` (one matrix per head, mlx-lm's ``mla`` module) gets
queries ``(T, H, 1, D)``, which ``x @ w`` takes as ``T * H`` products of one
row; folded, they go as ``(1, H, T, D)``: one ``(T, D)`` product per head.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear


def _folded(multiply, x: mx.array) -> mx.array:
    if x.ndim < 3:
        return multiply(x)
    out = multiply(x.reshape(1, -1, x.shape[-1]))
    return out.reshape(*x.shape[:-1], out.shape[-1])


class RowFoldedQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x):
        return _folded(super().__call__, x)


class RowFoldedQuantizedAllToShardedLinear(nn.QuantizedAllToShardedLinear):
    def __call__(self, x):
        return _folded(super().__call__, x)


class RowFoldedQuantizedShardedToAllLinear(nn.QuantizedShardedToAllLinear):
    def __call__(self, x):
        return _folded(super().__call__, x)


class RowFoldedQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x):
        return _folded(super().as_linear, x)


def _heads_folded(multiply, x: mx.array, transpose: bool) -> mx.array:
    if x.ndim != 4 or x.shape[2] != 1:
        return multiply(x, transpose)
    return multiply(x.swapaxes(0, 2), transpose).swapaxes(0, 2)  # (T, H, 1, D) as (1, H, T, D)


class RowFoldedMultiLinear(MultiLinear):
    def __call__(self, x, transpose=True):
        return _heads_folded(super().__call__, x, transpose)


class RowFoldedQuantizedMultiLinear(QuantizedMultiLinear):
    def __call__(self, x, transpose=True):
        return _heads_folded(super().__call__, x, transpose)


_FOLDED = {
    nn.QuantizedLinear: RowFoldedQuantizedLinear,
    nn.QuantizedAllToShardedLinear: RowFoldedQuantizedAllToShardedLinear,  # as mlx-lm's shard() leaves them
    nn.QuantizedShardedToAllLinear: RowFoldedQuantizedShardedToAllLinear,
    nn.QuantizedEmbedding: RowFoldedQuantizedEmbedding,
    MultiLinear: RowFoldedMultiLinear,
    QuantizedMultiLinear: RowFoldedQuantizedMultiLinear,
}


def fold_quantized_rows(model: nn.Module) -> int:
    """Make the model's quantized linear (sharded or not) and MLA per-head layers (exactly MLX's and mlx-lm's
    classes) fold rows; returns how many changed."""
    changed = 0
    for _, module in model.named_modules():
        folded = _FOLDED.get(type(module))
        if folded is not None:
            module.__class__ = folded  # same attributes and weights: only the call changes
            changed += 1
    return changed
