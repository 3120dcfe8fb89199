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

import sys
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..kernels.plan import AttentionPlan

_original_sdpa = mlx_base.scaled_dot_product_attention


class PagedLayerCache:
    """One attention layer's K/V pool, behind mlx-lm's cache protocol."""

    def __init__(self, num_blocks, block_size, num_kv_heads, k_dim, v_dim, dtype, kernel):
        self.shape = (num_blocks, num_kv_heads, block_size)
        rows = num_blocks * num_kv_heads * block_size
        # One owner per pool array: a lingering view would make every write copy the pool.
        self.keys = mx.zeros((rows, k_dim), dtype=dtype)
        self.values = mx.zeros((rows, v_dim), dtype=dtype)
        self.kernel = kernel
        self.plan: AttentionPlan | None = None

    @property
    def offset(self):
        return self.plan.positions

    def update_and_fetch(self, keys, values):
        rows, heads = keys.shape[0], keys.shape[1]
        index = self.plan.write_indices(heads)
        self.keys[index] = keys.reshape(rows, heads, -1).astype(self.keys.dtype)
        self.values[index] = values.reshape(rows, heads, -1).astype(self.values.dtype)
        return keys, values  # unused: the hook reads the pools

    def make_mask(self, *args, **kwargs):
        return None

    def attend(self, queries, scale):
        k_pool = self.keys.reshape(*self.shape, -1)
        v_pool = self.values.reshape(*self.shape, -1)
        return self.kernel(queries, k_pool, v_pool, self.plan, scale)

    def block_rows(self, blocks: list[int]) -> mx.array:
        """The flat pool rows that hold the given blocks, block after block."""
        per_block = self.shape[1] * self.shape[2]
        within = mx.arange(per_block, dtype=mx.int32)
        return (mx.array(blocks, dtype=mx.int32)[:, None] * per_block + within).flatten()

    def copy_blocks(self, copies: list[tuple[int, int]]):
        """Copy whole blocks (copy-on-write), as (source, destination) pairs."""
        src = self.block_rows([s for s, _ in copies])
        dst = self.block_rows([d for _, d in copies])
        self.keys[dst] = self.keys[src]
        self.values[dst] = self.values[src]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    # mlx-lm calls these on caches in some code paths.
    def empty(self):
        return False

    @property
    def state(self):
        return self.keys, self.values


def paged_scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention entry point, sending paged caches to their kernel."""
    if isinstance(cache, PagedLayerCache):
        if sinks is not None:
            raise ValueError("attention sinks are not supported by the paged engine")
        return cache.attend(queries, scale)
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

    @property
    def bytes_per_token(self) -> int:
        return self.num_kv_heads * (self.k_dim + self.v_dim) * self.dtype.size


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
