"""Unmodified mlx-lm models over paged KV.

mlx-lm attention layers talk to their cache through a small protocol: they
read ``cache.offset`` for RoPE, call ``cache.update_and_fetch(k, v)`` and ask
``cache.make_mask``; then they call ``scaled_dot_product_attention`` from
``mlx_lm.models.base`` with ``cache=cache``. ``PagedLayerCache`` speaks that
protocol over one layer's K/V pool, and ``install_attention_hook`` routes the
attention call of caches of ours to the selected paged kernel. For every other
cache the hook calls mlx-lm's own function unchanged.

A step feeds the model inputs of shape ``(T, 1)``: every token is its own row
at its own position (``cache.offset`` is a ``(T,)`` array), see
``kernels.plan``.
"""

import contextlib
import sys
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..kernels.plan import AttentionPlan
from ..kernels.quantized import QuantizedPool, check_quantization

_original_sdpa = mlx_base.scaled_dot_product_attention


def pool_columns(dim: int, dtype: mx.Dtype, kv_bits=None, kv_group_size=64) -> list[tuple[int, mx.Dtype]]:
    """The width and dtype of each pool array that holds rows of ``dim`` values: one, or three quantized."""
    if kv_bits is None:
        return [(dim, dtype)]
    groups = dim // kv_group_size
    return [(dim * kv_bits // 32, mx.uint32), (groups, dtype), (groups, dtype)]


class PagedLayerCache:
    """One attention layer's K/V pool, behind mlx-lm's cache protocol.

    The pool is a list of arrays with one row per (block, KV head, token):
    K then V at full precision, or with ``kv_bits`` each of them as the packed
    values, scales and biases of ``mx.quantize`` (``kernels.quantized``),
    quantized as they are written.
    """

    def __init__(self, num_blocks, block_size, num_kv_heads, k_dim, v_dim, dtype, kernel, kv_bits=None, kv_group_size=64):
        check_quantization(kv_bits, kv_group_size, (k_dim, v_dim))
        self.shape = (num_blocks, num_kv_heads, block_size)
        self.dtype = dtype
        self.bits, self.group_size = kv_bits, kv_group_size
        self.parts = 1 if kv_bits is None else 3  # arrays per K (and per V)
        rows = num_blocks * num_kv_heads * block_size
        columns = [c for dim in (k_dim, v_dim) for c in pool_columns(dim, dtype, kv_bits, kv_group_size)]
        # One owner per pool array: a lingering view would make every write copy the pool.
        self.arrays = [mx.zeros((rows, width), dtype=t) for width, t in columns]
        self.kernel = kernel
        self.plan: AttentionPlan | None = None

    def names(self, layer: int) -> list[str]:
        """Names of the pool's arrays (as block files name them): k.0, v.0; quantized also k_scales.0, ..."""
        suffixes = ("",) if self.bits is None else ("", "_scales", "_biases")
        return [f"{kv}{suffix}.{layer}" for kv in "kv" for suffix in suffixes]

    @property
    def offset(self):
        return self.plan.positions

    def update_and_fetch(self, keys, values):
        rows, heads = keys.shape[0], keys.shape[1]
        index = self.plan.write_indices(heads)
        for x, arrays in ((keys, self.arrays[: self.parts]), (values, self.arrays[self.parts :])):
            x = x.reshape(rows, heads, -1).astype(self.dtype)
            parts = (x,) if self.bits is None else mx.quantize(x, group_size=self.group_size, bits=self.bits)
            for array, part in zip(arrays, parts):
                array[index] = part
        return keys, values  # unused: the hook reads the pools

    def make_mask(self, *args, **kwargs):
        return None

    def attend(self, queries, scale):
        pools = [a.reshape(*self.shape, -1) for a in self.arrays]
        if self.bits is None:
            k_pool, v_pool = pools
        else:
            k_pool = QuantizedPool(*pools[:3], self.bits, self.group_size)
            v_pool = QuantizedPool(*pools[3:], self.bits, self.group_size)
        out = self.kernel(queries, k_pool, v_pool, self.plan, scale)
        if self.plan.prefills:
            # Prefill steps run eagerly and layer by layer: MLX allocates a graph's arrays as it queues their
            # work, so a forward pass queued whole would hold every layer's activations at once.
            mx.eval(out)
        return out

    def block_rows(self, blocks: list[int]) -> mx.array:
        """The flat pool rows that hold the given blocks, block after block."""
        per_block = self.shape[1] * self.shape[2]
        within = mx.arange(per_block, dtype=mx.int32)
        return (mx.array(blocks, dtype=mx.int32)[:, None] * per_block + within).flatten()

    def copy_blocks(self, copies: list[tuple[int, int]]):
        """Copy whole blocks (copy-on-write), as (source, destination) pairs."""
        src = self.block_rows([s for s, _ in copies])
        dst = self.block_rows([d for _, d in copies])
        for array in self.arrays:
            array[dst] = array[src]

    def resize(self, num_blocks: int) -> None:
        """Grow the pool to ``num_blocks`` blocks, keeping what it holds (one array copied at a time)."""
        rows = num_blocks * self.shape[1] * self.shape[2]
        for i, array in enumerate(self.arrays):
            grown = mx.concatenate([array, mx.zeros((rows - array.shape[0], array.shape[1]), array.dtype)])
            mx.eval(grown)
            self.arrays[i] = grown
            del array, grown
        self.shape = (num_blocks, *self.shape[1:])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    # mlx-lm calls these on caches in some code paths.
    def empty(self):
        return False

    @property
    def state(self):
        return tuple(self.arrays)


_float32_attention = False  # see float32_attention()


@contextlib.contextmanager
def float32_attention():
    """Within it, mlx-lm's own attention (not the paged one) runs on float32 copies of its inputs.

    The model check measures with it how much rounding inside attention moves a model's logits.
    """
    global _float32_attention
    _float32_attention = True
    try:
        yield
    finally:
        _float32_attention = False


def paged_scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention entry point, sending paged caches to their kernel."""
    if isinstance(cache, PagedLayerCache):
        if sinks is not None:
            raise ValueError("attention sinks are not supported by the paged engine")
        return cache.attend(queries, scale)
    if _float32_attention and queries.dtype != mx.float32:
        q, k, v = (x.astype(mx.float32) for x in (queries, keys, values))
        return _original_sdpa(q, k, v, cache=cache, scale=scale, mask=mask, sinks=sinks).astype(queries.dtype)
    return _original_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install_attention_hook(model: nn.Module) -> list[str]:
    """Route the model's attention through the hook; returns the patched module names."""
    patched = []
    for name in sorted({type(m).__module__ for _, m in model.named_modules()}):
        module = sys.modules.get(name)
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is _original_sdpa:
            module.scaled_dot_product_attention = paged_scaled_dot_product_attention
        if current in (_original_sdpa, paged_scaled_dot_product_attention):
            patched.append(name)
    return patched


# Architectures whose RoPE positions are built with arange(offset): a per-row offset breaks them.
_ARANGE_POSITION_MODELS = {"gpt_bigcode", "llama4", "ministral3"}


@dataclass(frozen=True)
class LayerLayout:
    num_kv_heads: int
    k_dim: int
    v_dim: int
    dtype: mx.Dtype

    def bytes_per_token(self, kv_bits=None, kv_group_size=64) -> int:
        """Bytes of one token's K and V in this layer's pool, at full precision or quantized to ``kv_bits``."""
        columns = [c for dim in (self.k_dim, self.v_dim) for c in pool_columns(dim, self.dtype, kv_bits, kv_group_size)]
        return self.num_kv_heads * sum(width * dtype.size for width, dtype in columns)


def model_config(model: nn.Module):
    """The model's ModelArgs (mlx-lm keeps them as ``args``, in a few modules as ``config``), or None."""
    return getattr(model, "args", None) or getattr(model, "config", None)


def architecture(model: nn.Module) -> str:
    """The model's ``model_type``, or the name of its mlx-lm module when it has none."""
    return getattr(model_config(model), "model_type", None) or type(model).__module__.split(".")[-1]


def check_model(model: nn.Module) -> list[LayerLayout]:
    """The K/V layout of each layer, or a ValueError saying why the model is not supported."""
    model_type = architecture(model)
    if model_type in _ARANGE_POSITION_MODELS:
        raise ValueError(f"{model_type}: builds RoPE positions with arange(offset), which needs one offset per batch")
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    for _, module in model.named_modules():
        if isinstance(module, DynamicNTKScalingRoPE):
            raise ValueError(f"{model_type}: DynamicNTKScalingRoPE does not accept per-sequence offsets")
    try:
        caches = make_prompt_cache(model)
    except Exception as e:
        raise ValueError(f"{model_type}: mlx-lm cannot make its cache: {type(e).__name__}: {e}") from e
    odd = sorted({type(c).__name__ for c in caches if type(c) is not KVCache})
    if odd:
        raise ValueError(f"{model_type}: needs {', '.join(odd)} (sliding-window or recurrent state), not supported yet")
    modules = install_attention_hook(model)
    if not modules:
        raise ValueError(f"{model_type}: attention does not go through mlx_lm.models.base.scaled_dot_product_attention")
    try:
        attended = _probe(model, caches, modules)
    except Exception as e:
        raise ValueError(f"{model_type}: mlx-lm's own forward fails: {type(e).__name__}: {e}") from e
    latent = _config_value(model_config(model), "kv_lora_rank")
    layouts = []
    for index, cache in enumerate(caches):
        if cache.keys is None:
            raise ValueError(f"{model_type}: layer {index} stores no K/V in its cache")
        _, heads, _, k_dim = cache.keys.shape
        if heads == 1 and k_dim == latent:  # deepseek_v3-style MLA caches one latent "head" (youtu_llm: full K/V)
            raise ValueError(f"{model_type}: multi-head latent attention (MLA) is not supported yet")
        if id(cache) not in attended:  # the paged kernel would never see this layer's queries
            raise ValueError(
                f"{model_type}: layer {index} does not pass its cache to scaled_dot_product_attention "
                "(it attends to what update_and_fetch returns)"
            )
        layouts.append(LayerLayout(heads, k_dim, cache.values.shape[-1], cache.keys.dtype))
    return layouts


def _probe(model: nn.Module, caches: list, modules: list[str]) -> set[int]:
    """Run one token through mlx-lm's own path; the ids of the caches its attention calls were given."""
    attended = set()

    def recording(*args, **kwargs):
        attended.add(id(kwargs["cache"] if "cache" in kwargs else args[3]))
        return paged_scaled_dot_product_attention(*args, **kwargs)

    for name in modules:
        sys.modules[name].scaled_dot_product_attention = recording
    try:
        mx.eval(model(mx.array([[0]]), cache=caches))  # one token shows each layer's K/V shapes
    finally:
        for name in modules:
            sys.modules[name].scaled_dot_product_attention = paged_scaled_dot_product_attention
    return attended


def _config_value(config, name: str, depth: int = 3):
    """``name`` in a config object or dict, or in configs nested in it (``text_config``), else None."""
    fields = config if isinstance(config, dict) else getattr(config, "__dict__", {})
    if name in fields:
        return fields[name]
    for value in fields.values() if depth else ():
        if isinstance(value, dict) or hasattr(value, "__dataclass_fields__"):
            found = _config_value(value, name, depth - 1)
            if found is not None:
                return found
    return None
