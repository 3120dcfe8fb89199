"""Projections that read the same input, run as one matrix product: an attention layer's query, key and
value projections, and an MLP's gate and up projections (vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear``).

On a GPU the host's share of a decode step is mostly MLX encoding one kernel per operation, and the
matrix products are the dearest of them: merged, a Llama layer runs four products where it ran seven.
Each merged projection is replaced by a ``MergedPart``: the first part called with an input computes the
group's product, every part returns its own columns of it, and the last one served lets it go. A part
keeps its parameters' names and shapes, as views of the merged arrays (no memory is added), so the model
reads as before; the merged arrays themselves are held outside the module tree.

Only MLX's own linear classes are merged (quantized ones alike when their quantization matches); LoRA,
sharded and other layers are left as they are.
"""

import copy

import mlx.core as mx
import mlx.nn as nn

from .quantized_rows import RowFoldedQuantizedLinear

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
MERGEABLE = (nn.Linear, nn.QuantizedLinear, RowFoldedQuantizedLinear)
QUANTIZATION = ("group_size", "bits", "mode")


class MergedProduct:
    """The product of one group's merged weights, computed once per input and handed out by columns."""

    def __init__(self, merged: nn.Module, widths: list[int]):
        self.merged = merged
        self.bounds = [(sum(widths[:i]), sum(widths[: i + 1])) for i in range(len(widths))]
        self._input = self._output = None
        self._unserved = 0

    def columns(self, x: mx.array, index: int) -> mx.array:
        if x is not self._input:
            self._input, self._output, self._unserved = x, self.merged(x), len(self.bounds)
        start, stop = self.bounds[index]
        out = self._output[..., start:stop]
        self._unserved -= 1
        if self._unserved == 0:  # every part has its columns: hold no activations past the layer
            self._input = self._output = None
        return out


class MergedPart(nn.Module):
    """One projection of a merged group: its columns of the group's product."""

    def __init__(self, product: MergedProduct, index: int, parameters: dict[str, mx.array]):
        super().__init__()
        self.product = product  # a plain object: not a child module, so its arrays are not parameters twice
        self.index = index
        for name, value in parameters.items():
            setattr(self, name, value)

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


def _merge(owner: nn.Module, names: tuple[str, ...]) -> None:
    parts = [getattr(owner, name) for name in names]
    merged_parameters = {key: mx.concatenate([p[key] for p in parts]) for key in parts[0].keys()}
    mx.eval(merged_parameters)  # before the parts' own arrays are let go
    merged = copy.copy(parts[0])  # the same class and settings (quantization, row folding)
    merged.update(merged_parameters)
    widths = [p.weight.shape[0] for p in parts]
    product = MergedProduct(merged, widths)
    start = 0
    for index, (name, width) in enumerate(zip(names, widths)):
        views = {key: value[start : start + width] for key, value in merged_parameters.items()}
        start += width
        mx.eval(views)
        setattr(owner, name, MergedPart(product, index, views))


def merge_projections(model: nn.Module) -> int:
    """Merge each module's query/key/value and gate/up projections where they can be; returns how many
    groups were merged."""
    merged = 0
    for _, module in list(model.named_modules()):
        for names in GROUPS:
            parts = [module.get(name) for name in names]
            if all(isinstance(p, nn.Module) for p in parts) and _mergeable(parts):
                _merge(module, names)
                merged += 1
    return merged
