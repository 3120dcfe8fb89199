"""Layers that multiply a step's rows as one matrix: quantized linear layers (sharded ones too) and MLA's
per-head ones.

Engine steps feed the model inputs of shape ``(T, 1)``: every token is its own
batch row, at its own position. ``mx.matmul`` folds such a batch into one
``(T, K)`` product, but ``mx.quantized_matmul`` takes it as ``T`` products of
one row each, which MLX's GPU backends run as matrix-vector products (reading
the weights once per row) or as tiles padded from one row. The layers here
reshape their input to ``(1, T, K)`` first: one product with the same values,
the shape mlx-lm's own prefill gives it.

On MLX's CUDA backend a quantized linear layer's product also takes the route
that is fastest for its number of rows (``benchmarks/quantized_matmul_rows.py``):
2-7 rows go padded to 8 (MLX takes a route three times slower below 8), and
``DEQUANTIZED_ROWS`` or more (prefill chunks, large batches) in half precision
multiply the weights dequantized to their dtype, one layer's at a time
(``dequantized_bytes``: what a step's memory holds for them). The routes are
checked against the exact product when a model is folded, once per
quantization, dtype and input width, and not taken on a difference.

MLA's ``MultiLinear`` (one matrix per head, mlx-lm's ``mla`` module) gets
queries ``(T, H, 1, D)``, which ``x @ w`` takes as ``T * H`` products of one
row; folded, they go as ``(1, H, T, D)``: one ``(T, D)`` product per head.
"""

import copy
import warnings

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear

PADDED_ROWS = 8
DEQUANTIZED_ROWS = 256
DEQUANTIZED_DTYPES = (mx.float16, mx.bfloat16)  # CUDA multiplies float32 at TF32's precision: not float32
CHECK_ROWS = 1024  # output rows of a layer its check multiplies (every input column)
# A route's check: relative L2 error against the float32 product of the same dequantized weights (a wrong route
# is off by about 1; MLX's own bfloat16 quantized product, on the CPU, by about 1e-2).
CHECK_TOLERANCE = {mx.float32: 5e-3, mx.float16: 2e-2, mx.bfloat16: 5e-2}

_routes_agree: dict[tuple, bool] = {}  # _route_key(layer) -> whether its routes passed their check


def routes_by_rows() -> bool:
    """Whether quantized products here take a route by their number of rows: on MLX's CUDA backend."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def _folded(multiply, x: mx.array) -> mx.array:
    if x.ndim < 3:
        return multiply(x)
    out = multiply(x.reshape(1, -1, x.shape[-1]))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _quantization(layer: nn.Module) -> dict:
    return {"group_size": layer.group_size, "bits": layer.bits, "mode": layer.mode}


def _weights(layer: nn.Module) -> tuple:
    return layer["weight"], layer["scales"], layer.get("biases")


def _quantized_product(layer: nn.Module, x: mx.array) -> mx.array:
    return mx.quantized_matmul(x, *_weights(layer), transpose=True, **_quantization(layer))


def _routed(layer: nn.Module, x: mx.array) -> mx.array:
    """``x @ W.T`` by the route for x's rows: 2-7 folded rows ``(1, T, K)`` padded to ``PADDED_ROWS``,
    ``DEQUANTIZED_ROWS`` or more of the weights' own half-precision dtype through the dequantized weights,
    others (2-D inputs of few rows too) MLX's quantized product."""
    rows = x.size // x.shape[-1]
    if x.ndim == 3 and 1 < rows < PADDED_ROWS:
        padded = mx.concatenate([x, mx.zeros((1, PADDED_ROWS - rows, x.shape[-1]), x.dtype)], axis=1)
        return _quantized_product(layer, padded)[:, :rows]
    if rows >= DEQUANTIZED_ROWS and x.dtype == layer.scales.dtype and x.dtype in DEQUANTIZED_DTYPES:
        return x @ mx.dequantize(*_weights(layer), **_quantization(layer), dtype=x.dtype).T
    return _quantized_product(layer, x)


def _route_key(layer: nn.Module) -> tuple:
    """What a check's verdict holds for: a quantization, a dtype and an input width."""
    return layer.group_size, layer.bits, layer.mode, layer.scales.dtype, layer.weight.shape[1]


def _routes_on(layer: nn.Module) -> bool:
    # Called for every product: no verdict yet (the CPU, Metal) answers at once.
    return bool(_routes_agree) and routes_by_rows() and _routes_agree.get(_route_key(layer), False)


def check_routes(layer: nn.Module) -> bool:
    """Whether the routes by rows give ``layer``'s product up to rounding, on random rows (against the float32
    product of its dequantized weights, over its first ``CHECK_ROWS`` outputs): checked once per quantization,
    dtype and input width; a difference (or an error) warns, and MLX's quantized product stays. Only affine
    quantization (scales of the model's dtype) is routed."""
    key = _route_key(layer)
    if layer.mode != "affine":
        return False
    if key not in _routes_agree:
        try:
            _routes_agree[key] = _agrees(layer)
            problem = "gave other values"
        except Exception as exc:  # any failure means "don't use them"
            _routes_agree[key], problem = False, f"failed ({exc})"
        if not _routes_agree[key]:
            warnings.warn(f"quantized products by rows {problem} for group size {key[0]}, {key[1]} bits, "
                          f"{key[3]}, {key[4] * 32 // key[1]} inputs: MLX's quantized product is used",
                          RuntimeWarning, stacklevel=2)  # fmt: skip
    return _routes_agree[key]


def _agrees(layer: nn.Module) -> bool:
    probe = copy.copy(layer)  # the same settings, its first output rows
    probe.update({name: value[:CHECK_ROWS] for name, value in zip(("weight", "scales", "biases"), _weights(layer))
                  if value is not None})  # fmt: skip
    dtype = layer.scales.dtype
    exact = mx.dequantize(*_weights(probe), **_quantization(probe), dtype=mx.float32)
    for rows in (3, DEQUANTIZED_ROWS):
        x = mx.random.normal((1, rows, exact.shape[1]), key=mx.random.key(0)).astype(dtype)
        want = x.astype(mx.float32) @ exact.T
        difference = _routed(probe, x).astype(mx.float32) - want
        bound = CHECK_TOLERANCE.get(dtype, CHECK_TOLERANCE[mx.float16]) ** 2 * (want * want).sum()
        if not ((difference * difference).sum() <= bound).item():
            return False
    return True


def dequantized_bytes(layer: nn.Module) -> int:
    """The bytes of ``layer``'s weights as a step may dequantize them (0: never dequantized)."""
    folded = isinstance(layer, (RowFoldedQuantizedLinear, RowFoldedQuantizedEmbedding))
    if not folded or layer.scales.dtype not in DEQUANTIZED_DTYPES or not _routes_on(layer):
        return 0
    rows, words = layer.weight.shape
    return rows * (words * 32 // layer.bits) * layer.scales.dtype.size


class RowFoldedQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x):
        if not _routes_on(self):
            return _folded(super().__call__, x)
        out = _folded(lambda rows: _routed(self, rows), x)
        return out + self["bias"] if "bias" in self else out


class RowFoldedQuantizedAllToShardedLinear(nn.QuantizedAllToShardedLinear):
    def __call__(self, x):
        return _folded(super().__call__, x)


class RowFoldedQuantizedShardedToAllLinear(nn.QuantizedShardedToAllLinear):
    def __call__(self, x):
        return _folded(super().__call__, x)


class RowFoldedQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x):
        if not _routes_on(self):
            return _folded(super().as_linear, x)
        return _folded(lambda rows: _routed(self, rows), x)


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
    classes) fold rows, and check the routes by rows of its quantizations (``check_routes``) where products
    take them; returns how many changed."""
    changed = 0
    for _, module in model.named_modules():
        folded = _FOLDED.get(type(module))
        if folded is not None:
            module.__class__ = folded  # same attributes and weights: only the call changes
            changed += 1
            if routes_by_rows() and folded in (RowFoldedQuantizedLinear, RowFoldedQuantizedEmbedding):
                check_routes(module)
    return changed
