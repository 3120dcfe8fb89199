"""Layers that multiply a step's rows as one matrix: quantized linear layers (sharded ones too) and MLA's
per-head ones.

Engine steps feed the model inputs of shape ``(T, 1)``: every token is its own
batch row, at its own position. ``mx.matmul`` folds such a batch into one
``(T, K)`` product, but ``mx.quantized_matmul`` takes it as ``T`` products of
one row each, which MLX's GPU backends run as matrix-vector products (reading
the weights once per row) or as tiles padded from one row. The layers here
reshape their input to ``(1, T, K)`` first: one product with the same values,
the shape mlx-lm's own prefill gives it.

On MLX's CUDA backend and on the CPU a quantized linear layer's product also takes
the route that is fastest for its number of rows (``device_routes``;
``benchmarks/quantized_matmul_rows.py``). On CUDA: up to ``MATVEC_ROWS`` rows of
large weights go through a kernel of this package (``kernels.quantized_matvec``:
MLX's own reads 4-bit weights at a fraction of the memory's rate), other rows
below 8 go padded to 8 (MLX takes a route three times slower below 8), and
``DEQUANTIZED_ROWS`` or more (prefill chunks, large batches) in half precision
multiply the weights dequantized to their dtype. On the CPU, MLX's quantized
product takes its rows one at a time, so that ``CPU_DEQUANTIZED_ROWS`` or more
rows multiply the weights dequantized to the rows' dtype, whatever it and the
scales' are (the CPU multiplies float32 in float32). Weights are dequantized
one layer's at a time (``dequantized_bytes``: what a step's memory holds for
them). Each route is checked against the exact
product when a model is folded, once per kind of device, quantization, dtype
and input width, and not taken on a difference. Metal keeps MLX's product (unmeasured).

MLA's ``MultiLinear`` (one matrix per head, mlx-lm's ``mla`` module) gets
queries ``(T, H, 1, D)``, which ``x @ w`` takes as ``T * H`` products of one
row; folded, they go as ``(1, H, T, D)``: one ``(T, D)`` product per head.
"""

import copy
import itertools
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear

from ..kernels.quantized_matvec import quantized_matvec
from ..kernels.quantized_matvec import available as matvec_available
from ..kernels.quantized_matvec import supports as supports_matvec

# The matvec kernel's products: at most this many rows, of weights of at least this many values (a Llama-8B
# layer's MLP and the output head; below, MLX's own product is as fast: benchmarks/RESULTS.md).
MATVEC_ROWS = 2
MATVEC_MIN_WEIGHTS = 32 * 1024**2
PADDED_ROWS = 8
DEQUANTIZED_ROWS = 256
DEQUANTIZED_DTYPES = (mx.float16, mx.bfloat16)  # CUDA multiplies float32 at TF32's precision: not float32
# On the CPU, dequantizing a layer's weights costs about as much as MLX's quantized product of 3 to 6 rows
# (benchmarks/RESULTS.md): from 8 rows on, the dequantized weights are the faster route for every layer.
CPU_DEQUANTIZED_ROWS = 8
CHECK_ROWS = 1000  # output rows of a layer its check multiplies (every input column): no multiple of a kernel's tile
# A route's check: relative L2 error against the float32 product of the same dequantized weights, and no output
# off by more than that share of the largest (a wrong route is off by about 1; MLX's own bfloat16 quantized
# product, on the CPU, by about 1e-2).
CHECK_TOLERANCE = {mx.float32: 5e-3, mx.float16: 2e-2, mx.bfloat16: 5e-2}

_routes_agree: dict[tuple, dict[str, bool]] = {}  # _route_key(layer) -> {route: whether it passed its check}


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


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1]


def _matvec(layer: nn.Module, x: mx.array) -> mx.array:
    out = quantized_matvec(x.reshape(_rows(x), x.shape[-1]), *_weights(layer), layer.bits, layer.group_size)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _padded(layer: nn.Module, x: mx.array) -> mx.array:
    rows = _rows(x)
    flat = x.reshape(rows, x.shape[-1])
    padded = mx.concatenate([flat, mx.zeros((PADDED_ROWS - rows, x.shape[-1]), x.dtype)])
    out = _quantized_product(layer, padded[None])[0, :rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _dequantized(layer: nn.Module, x: mx.array) -> mx.array:
    """``x @ W.T`` over the weights dequantized in the wider of x's and the scales' dtypes, as MLX's quantized
    product computes."""
    weight, scales, biases = _weights(layer)
    dtype = mx.result_type(x.dtype, scales.dtype)
    if dtype != scales.dtype:
        scales, biases = scales.astype(dtype), None if biases is None else biases.astype(dtype)
    return x @ mx.dequantize(weight, scales, biases, **_quantization(layer), dtype=dtype).T


def _takes_matvec(layer: nn.Module, x: mx.array) -> bool:
    return (
        1 <= _rows(x) <= MATVEC_ROWS
        and matvec_available()
        and x.dtype == layer.scales.dtype
        and supports_matvec(layer.bits, layer.group_size, x.dtype, x.shape[-1])
    )


def _matvec_pays(layer: nn.Module) -> bool:
    return layer.weight.shape[0] * layer.weight.shape[1] * 32 // layer.bits >= MATVEC_MIN_WEIGHTS


def _same_dtype(layer: nn.Module, x: mx.array) -> bool:
    return x.dtype == layer.scales.dtype


@dataclass(frozen=True)
class Route:
    """A way to multiply: whether it computes a product (from ``min_rows`` rows, of ``dtypes`` (None: any), and
    what ``takes`` asks), the product, the rows its check multiplies (of the scales' dtype, and with
    ``checks_float32`` of float32 too: a float32 model's rows over half-precision scales), and whether it is
    the faster way for a layer's weights."""

    takes: Callable[[nn.Module, mx.array], bool]
    product: Callable[[nn.Module, mx.array], mx.array]
    check_rows: tuple[int, ...]
    pays: Callable[[nn.Module], bool] = lambda layer: True
    min_rows: int = 1
    dtypes: Optional[tuple] = None
    checks_float32: bool = False

    def applies(self, layer: nn.Module, x: mx.array) -> bool:
        return _rows(x) >= self.min_rows and self.multiplies(x.dtype) and self.takes(layer, x)

    def multiplies(self, dtype) -> bool:
        return self.dtypes is None or dtype in self.dtypes


# A product takes the first route of its device that applies, passed its check and pays, else MLX's product.
CUDA_ROUTES = {
    "matvec": Route(_takes_matvec, _matvec, (1, MATVEC_ROWS), _matvec_pays),
    "padded": Route(lambda layer, x: _rows(x) < PADDED_ROWS, _padded, (3,), min_rows=2),
    "dequantized": Route(_same_dtype, _dequantized, (DEQUANTIZED_ROWS,), min_rows=DEQUANTIZED_ROWS,
                         dtypes=DEQUANTIZED_DTYPES),
}  # fmt: skip
CPU_ROUTES = {
    "dequantized": Route(lambda layer, x: True, _dequantized, (CPU_DEQUANTIZED_ROWS, 100),
                         min_rows=CPU_DEQUANTIZED_ROWS, checks_float32=True),
}  # fmt: skip


def device_routes() -> dict[str, Route]:
    """The routes by rows of the default device: CUDA's, the CPU's, or none (Metal)."""
    if mx.default_device() == mx.cpu:
        return CPU_ROUTES
    return CUDA_ROUTES if mx.cuda.is_available() else {}


def _routed(layer: nn.Module, x: mx.array, passed: dict[str, bool]) -> mx.array:
    """``x @ W.T`` by the first route that applies to x and ``passed`` its check, else MLX's quantized product."""
    for name, route in device_routes().items():
        if passed.get(name) and route.applies(layer, x) and route.pays(layer):
            return route.product(layer, x)
    return _quantized_product(layer, x)


def _route_key(layer: nn.Module) -> tuple:
    """What a check's verdict holds for: a kind of device, a quantization, a dtype and an input width."""
    quantization = layer.group_size, layer.bits, layer.mode
    return mx.default_device().type, *quantization, layer.scales.dtype, layer.weight.shape[1]


def _passed(layer: nn.Module) -> Optional[dict[str, bool]]:
    """Which routes passed their check for ``layer`` (None: not checked here; MLX's product). Called for every
    product: with no verdict at all, it answers at once."""
    return _routes_agree.get(_route_key(layer)) if _routes_agree else None


def check_routes(layer: nn.Module) -> bool:
    """Whether some route by rows gives ``layer``'s product up to rounding, on random rows (against the float32
    product of its dequantized weights, over its first ``CHECK_ROWS`` outputs): each route of the device is
    checked once per kind of device, quantization, dtype and input width; one that differs (or fails) warns,
    and is not taken. Only affine quantization is routed."""
    key = _route_key(layer)
    if layer.mode != "affine":
        return False
    if key not in _routes_agree:
        passed = {}
        for name in device_routes():
            try:
                agrees = _agrees(layer, name)
                problem = "gave other values"
            except Exception as exc:  # any failure means "don't use it"
                agrees, problem = False, f"failed ({exc})"
            passed[name] = bool(agrees)
            if agrees is False:
                _, group_size, bits, _, dtype, words = key
                warnings.warn(f"quantized products by rows ({name}) {problem} for group size {group_size}, {bits} "
                              f"bits, {dtype}, {words * 32 // bits} inputs: MLX's quantized product is used there",
                              RuntimeWarning, stacklevel=2)  # fmt: skip
        _routes_agree[key] = passed
    return any(_routes_agree[key].values())


def _agrees(layer: nn.Module, name: str):
    """Whether route ``name`` gives the product on its check's rows (fresh ones, and rows that start one value
    into an array, which a kernel may get at any address); None where it takes none of them."""
    route = device_routes()[name]
    probe = copy.copy(layer)  # the same settings, its first output rows
    probe.update({part: value[:CHECK_ROWS] for part, value in zip(("weight", "scales", "biases"), _weights(layer))
                  if value is not None})  # fmt: skip
    weight, scales, biases = _weights(probe)  # dequantized in float32 arithmetic (not the scales' dtype's)
    exact = mx.dequantize(weight, scales.astype(mx.float32), None if biases is None else biases.astype(mx.float32),
                          **_quantization(probe), dtype=mx.float32)  # fmt: skip
    width = exact.shape[1]
    taken = False
    dtypes = dict.fromkeys([layer.scales.dtype] + [mx.float32] * route.checks_float32)
    for rows, dtype in itertools.product(route.check_rows, dtypes):
        tolerance = CHECK_TOLERANCE.get(dtype, CHECK_TOLERANCE[mx.float16])
        key = mx.random.key(rows)
        fresh = mx.random.normal((1, rows, width), key=key).astype(dtype)
        offset = mx.random.normal((rows, width + 1), key=key).astype(dtype)[None, :, 1:]
        for x in (fresh, offset):
            if not route.applies(probe, x):
                continue
            taken = True
            want = x.astype(mx.float32) @ exact.T
            difference = route.product(probe, x).astype(mx.float32) - want
            close = (difference * difference).sum() <= tolerance**2 * (want * want).sum()
            bounded = mx.abs(difference).max() <= tolerance * mx.abs(want).max()  # no output far off
            if not (close & bounded).item():
                return False
    return True if taken else None


def dequantized_rows() -> Optional[int]:
    """The fewest rows whose products multiply dequantized weights on the default device (None: none do)."""
    route = device_routes().get("dequantized")
    return route.min_rows if route else None


def dequantized_bytes(layer: nn.Module) -> int:
    """The bytes of ``layer``'s weights as a step may dequantize them (0: never dequantized)."""
    folded = isinstance(layer, (RowFoldedQuantizedLinear, RowFoldedQuantizedEmbedding))
    route = device_routes().get("dequantized")
    if not folded or route is None or not route.multiplies(layer.scales.dtype):
        return 0
    if not (_passed(layer) or {}).get("dequantized"):
        return 0
    rows, words = layer.weight.shape
    size = layer.scales.dtype.size if route.dtypes else mx.float32.size  # a route of any dtype: rows of float32
    return rows * (words * 32 // layer.bits) * size


class RowFoldedQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x):
        passed = _passed(self)
        if passed is None:
            return _folded(super().__call__, x)
        out = _folded(lambda rows: _routed(self, rows, passed), x)
        return out + self["bias"] if "bias" in self else out


class RowFoldedQuantizedAllToShardedLinear(nn.QuantizedAllToShardedLinear):
    def __call__(self, x):
        return _folded(super().__call__, x)


class RowFoldedQuantizedShardedToAllLinear(nn.QuantizedShardedToAllLinear):
    def __call__(self, x):
        return _folded(super().__call__, x)


class RowFoldedQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x):
        passed = _passed(self)
        if passed is None:
            return _folded(super().as_linear, x)
        return _folded(lambda rows: _routed(self, rows, passed), x)


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
            if device_routes() and folded in (RowFoldedQuantizedLinear, RowFoldedQuantizedEmbedding):
                check_routes(module)
    return changed
