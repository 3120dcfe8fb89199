"""Quantized linear layers that multiply a step's rows as one matrix.

Engine steps feed the model inputs of shape ``(T, 1)``: every token is its own
batch row, at its own position. ``mx.matmul`` folds such a batch into one
``(T, K)`` product, but ``mx.quantized_matmul`` takes it as ``T`` products of
one row each, which MLX's GPU backends run as matrix-vector products (reading
the weights once per row) or as tiles padded from one row. The layers here
reshape their input to ``(1, T, K)`` first: one product with the same values,
the shape mlx-lm's own prefill gives it.
"""

import mlx.core as mx
import mlx.nn as nn


def _folded(multiply, x: mx.array) -> mx.array:
    if x.ndim < 3:
        return multiply(x)
    out = multiply(x.reshape(1, -1, x.shape[-1]))
    return out.reshape(*x.shape[:-1], out.shape[-1])


class RowFoldedQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x):
        return _folded(super().__call__, x)


class RowFoldedQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x):
        return _folded(super().as_linear, x)


_FOLDED = {nn.QuantizedLinear: RowFoldedQuantizedLinear, nn.QuantizedEmbedding: RowFoldedQuantizedEmbedding}


def fold_quantized_rows(model: nn.Module) -> int:
    """Make the model's quantized linear layers (exactly MLX's classes) fold rows; returns how many changed."""
    changed = 0
    for _, module in model.named_modules():
        folded = _FOLDED.get(type(module))
        if folded is not None:
            module.__class__ = folded  # same attributes and weights: only the call changes
            changed += 1
    return changed
