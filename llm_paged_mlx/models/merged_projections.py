"""Projections that read the same input, run as one matrix product: an attention layer's query, key and
value projections, and an MLP's gate and up projections (vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear``).

On a GPU the host's share of a decode step is mostly MLX encoding one kernel per operation, and the
matrix products are the dearest of them: merged, a Llama layer runs four products where it ran seven.
Each merged projection is replaced by a ``MergedPart``: the first part called with an input computes the
group's product, every part returns its own columns of it, and the last one served lets it go. A part
keeps its parameters' names and shapes, as views of the merged arrays (no memory is added), so the model
reads as before; the merged arrays themselves are held outside the module tree. A part's parameters set
anew (``load_weights``, ``set_dtype``, ``update``) are merged again before the next product. Each group is
checked once against its separate products when it is merged, and left as it was on any difference beyond
rounding. Training through merged parts (their gradients) and converting them (``nn.quantize``, LoRA) are
not supported: load the model again for that.

Only MLX's own linear classes are merged (quantized ones alike when their quantization matches); LoRA,
sharded and other layers are left as they are.
"""

import copy
import warnings

import mlx.core as mx
import mlx.nn as nn

from .quantized_rows import RowFoldedQuantizedLinear

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
MERGEABLE = (nn.Linear, nn.QuantizedLinear, RowFoldedQuantizedLinear)
QUANTIZATION = ("group_size", "bits", "mode")
CHECK_ROWS = 4
CHECK_TOLERANCE = 1e-2  # relative L2 error of the merged columns against a part's own product


def _bounds(widths: list[int]) -> list[tuple[int, int]]:
    """Each part's columns of the merged product."""
    return [(sum(widths[:i]), sum(widths[: i + 1])) for i in range(len(widths))]


def _concatenated(parts: list) -> dict[str, mx.array]:
    """The parts' parameters stacked along their output rows, evaluated."""
    merged = {key: mx.concatenate([p[key] for p in parts]) for key in parts[0].keys()}
    mx.eval(merged)
    return merged


class MergedProduct:
    """The product of one group's merged weights, computed once per input and handed out by columns."""

    def __init__(self, merged: nn.Module, widths: list[int]):
        self.merged = merged
        self.bounds = _bounds(widths)  # each part's columns
        self.parts: list["MergedPart"] = []
        self.stale = False  # a part's parameters were set anew: merge them again before the next product
        self._input = self._output = None
        self._unserved = 0

    def columns(self, x: mx.array, index: int) -> mx.array:
        if self.stale:
            self._merge_again()
        if x is not self._input:
            self._input, self._output, self._unserved = x, self.merged(x), len(self.bounds)
        start, stop = self.bounds[index]
        out = self._output[..., start:stop]
        self._unserved -= 1
        if self._unserved == 0:  # every part has its columns: hold no activations past the layer
            self._input = self._output = None
        return out

    def view_parts(self) -> None:
        """Point each part's parameters at its rows of the merged arrays (views: no memory added)."""
        for part, (start, stop) in zip(self.parts, self.bounds):
            views = {key: value[start:stop] for key, value in self.merged.parameters().items()}
            mx.eval(views)
            for key, value in views.items():
                dict.__setitem__(part, key, value)  # not MergedPart.__setitem__: these are the merged values

    def _merge_again(self) -> None:
        keys = sorted(self.parts[0].keys())
        if any(sorted(p.keys()) != keys for p in self.parts):
            raise ValueError("merged projections were given parameters of different names: load the model again")
        self.merged.update(_concatenated(self.parts))
        self.bounds = _bounds([p.weight.shape[0] for p in self.parts])
        self.view_parts()
        self.stale = False
        self._input = self._output = None


class MergedPart(nn.Module):
    """One projection of a merged group: its columns of the group's product."""

    def __init__(self, product: MergedProduct, index: int):
        super().__init__()
        self.index = index
        self.product = product  # a plain object: not a child module, so its arrays are not parameters twice
        product.parts.append(self)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if isinstance(value, mx.array):
            self.product.stale = True

    def __call__(self, x: mx.array) -> mx.array:
        return self.product.columns(x, self.index)


def _mergeable(parts: list) -> bool:
    first = parts[0]
    if type(first) not in MERGEABLE or any(type(p) is not type(first) for p in parts):
        return False
    names = sorted(first.keys())
    if any(sorted(p.keys()) != names for p in parts):  # all with a bias or none
        return False
    if any(p.weight.shape[1:] != first.weight.shape[1:] or p.weight.dtype != first.weight.dtype for p in parts):
        return False
    return all(getattr(p, q, None) == getattr(first, q, None) for p in parts for q in QUANTIZATION)


def _agrees(parts: list, merged: nn.Module, bounds: list[tuple[int, int]]) -> bool:
    """Whether the merged product's columns are each part's own product, up to rounding, on random rows."""
    first = parts[0]
    quantized = "scales" in first
    in_dims = first.weight.shape[1] * 32 // first.bits if quantized else first.weight.shape[1]
    dtype = first.scales.dtype if quantized else first.weight.dtype
    x = mx.random.normal((CHECK_ROWS, in_dims), key=mx.random.key(0)).astype(dtype)
    out = merged(x).astype(mx.float32)
    for part, (start, stop) in zip(parts, bounds):
        want = part(x).astype(mx.float32)
        difference = out[:, start:stop] - want
        if not (difference * difference).sum().item() <= CHECK_TOLERANCE**2 * (want * want).sum().item():
            return False
    return True


def _merge(owner: nn.Module, names: tuple[str, ...]) -> bool:
    parts = [getattr(owner, name) for name in names]
    merged = copy.copy(parts[0])  # the same class and settings (quantization, row folding)
    merged.update(_concatenated(parts))  # evaluated before the parts' own arrays are let go
    product = MergedProduct(merged, [p.weight.shape[0] for p in parts])
    if not _agrees(parts, merged, product.bounds):
        return False
    for index, name in enumerate(names):
        setattr(owner, name, MergedPart(product, index))
    product.view_parts()
    return True


def merge_projections(model: nn.Module) -> int:
    """Merge each module's query/key/value and gate/up projections where they can be; returns how many
    groups were merged."""
    # Owners and names only: a list of the modules themselves would hold every old weight until the end.
    groups = [
        (module, names)
        for _, module in model.named_modules()
        for names in GROUPS
        if all(isinstance(module.get(name), nn.Module) for name in names)
    ]
    merged = refused = 0
    for owner, names in groups:
        if _mergeable([getattr(owner, name) for name in names]):
            if _merge(owner, names):
                merged += 1
            else:
                refused += 1
    if refused:
        warnings.warn(f"{refused} groups of projections gave other values merged than apart: left apart", stacklevel=2)
    return merged


def has_merged_projections(model: nn.Module) -> bool:
    """Whether ``merge_projections`` merged any of the model's projections."""
    return any(isinstance(module, MergedPart) for _, module in model.named_modules())
