"""Which mlx-lm models the engine serves, and what it pages of them.

``check_model`` refuses a model the paged engine cannot serve (with the reason),
routes its attention through the hook (``paged_cache``), runs one token
through mlx-lm's own path to see what each layer caches and how it attends,
and returns the model's ``ModelSpec``: the layout of each cache the model takes
(K/V rows, MLA latent rows, or a recurrent state) and what else the engine
reads of it. The engine, the runner and the checks read the spec, not the model. ``adapt_model`` then changes how its linear layers
run, with the same results.
"""

import inspect
import sys
import threading
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache

from .deferred_rope import defer_rope
from .merged_projections import merge_projections
from .attention_hook import install_attention_hook, paged_scaled_dot_product_attention
from .paged_cache import LayerLayout
from .quantized_rows import fold_quantized_rows
from .softcapped import ADAPTED, adapt_attention
from .state_cache import StateLayout

# mlx-lm modules whose Model.__call__ is exactly "body, then tied embedding or lm_head" (mistral runs as
# llama): for their Model, not a subclass that may call otherwise, only sampled rows go through the head.
_BODY_THEN_HEAD = {"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"}
# Architectures whose RoPE positions are built with arange(offset): a per-row offset breaks them.
_ARANGE_POSITION_MODELS = {"gpt_bigcode", "llama4"}
_SDPA_SIGNATURE = inspect.signature(paged_scaled_dot_product_attention)  # mlx-lm's, whose calls it takes


def model_config(model: nn.Module):
    """The model's ModelArgs (mlx-lm keeps them as ``args``, in a few modules as ``config``), or None."""
    return getattr(model, "args", None) or getattr(model, "config", None)


def architecture(model: nn.Module) -> str:
    """The model's ``model_type``, or the name of its mlx-lm module when it has none."""
    return getattr(model_config(model), "model_type", None) or type(model).__module__.split(".")[-1]


@dataclass(frozen=True)
class ModelSpec:
    """What the engine serves of a model (``check_model``'s)."""

    architecture: str
    caches: tuple[LayerLayout | StateLayout, ...]  # one per cache the model takes, in order
    softcapped: bool  # its attention scores are softcapped (``softcapped``)
    projects_sampled_rows_only: bool  # steps may put only the rows they sample through the vocabulary projection
    vocab_size: Optional[int]
    max_context: Optional[int]  # its max_position_embeddings

    @property
    def attention(self) -> list[LayerLayout]:
        """The attention layers' layouts (K/V or MLA latents)."""
        return [layout for layout in self.caches if isinstance(layout, LayerLayout)]

    @property
    def states(self) -> list[StateLayout]:
        """The recurrent layers' layouts."""
        return [layout for layout in self.caches if isinstance(layout, StateLayout)]

    @property
    def latent(self) -> bool:
        return any(layout.latent for layout in self.attention)

    @property
    def windowed(self) -> bool:
        return any(layout.window for layout in self.attention)


def check_model(model: nn.Module) -> ModelSpec:
    """The model's spec, with the layout of each cache it takes (``CacheList`` members in order): K/V for
    attention layers, state for recurrent ones; or a ValueError saying why the model is not supported."""
    model_type = architecture(model)
    structure = _cache_structure(model, model_type)
    labelled = [  # (how a refusal names the cache, the cache)
        (f"layer {i}" if type(entry) is not CacheList else f"layer {i}'s cache {j}", cache)
        for i, entry in enumerate(structure)
        for j, cache in enumerate(entry.caches if type(entry) is CacheList else (entry,))
    ]
    _check_caches(model_type, labelled)
    adapted = adapt_attention(model)
    modules = install_attention_hook(model)
    if not modules and not adapted:
        raise ValueError(f"{model_type}: attention does not go through mlx_lm.models.base.scaled_dot_product_attention")
    try:
        calls = _probe(model, structure, modules)
    except Exception as e:
        raise ValueError(f"{model_type}: mlx-lm's own forward fails: {type(e).__name__}: {e}") from e
    layouts = [_layout(model, model_type, label, cache, calls) for label, cache in labelled]
    body_then_head = type(model).__name__ == "Model" and type(model).__module__ in _BODY_THEN_HEAD
    spec = ModelSpec(
        model_type, tuple(layouts), softcapped=bool(adapted), projects_sampled_rows_only=body_then_head,
        vocab_size=getattr(model_config(model), "vocab_size", None),
        max_context=getattr(model_config(model), "max_position_embeddings", None),
    )  # fmt: skip
    if spec.states and spec.latent:
        raise ValueError(f"{model_type}: multi-head latent attention beside recurrent layers is not supported yet")
    return spec


def adapt_model(model: nn.Module) -> None:
    """Quantized linear layers multiply a step's rows as one matrix (``quantized_rows``), and on a GPU
    projections that read the same input run as one product (``merged_projections``: load the model again
    to train, convert or shard it) and decode steps leave RoPE to the attention kernel (``deferred_rope``)."""
    fold_quantized_rows(model)
    if mx.default_device() == mx.gpu:
        merge_projections(model)
        defer_rope(model)


def model_caches(model: nn.Module, caches: list) -> list:
    """``caches`` (one per ``check_model`` layout) arranged as the model takes them (``CacheList`` groups)."""
    remaining = iter(caches)
    return [
        CacheList(*(next(remaining) for _ in entry.caches)) if type(entry) is CacheList else next(remaining)
        for entry in make_prompt_cache(model)
    ]


def _cache_structure(model: nn.Module, model_type: str) -> list:
    """mlx-lm's caches for the model, after the refusals that need no forward pass."""
    if model_type in _ARANGE_POSITION_MODELS:
        raise ValueError(f"{model_type}: builds RoPE positions with arange(offset), which needs one offset per batch")
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    for _, module in model.named_modules():
        if isinstance(module, DynamicNTKScalingRoPE):
            raise ValueError(f"{model_type}: DynamicNTKScalingRoPE does not accept per-sequence offsets")
    try:
        return make_prompt_cache(model)
    except Exception as e:
        raise ValueError(f"{model_type}: mlx-lm cannot make its cache: {type(e).__name__}: {e}") from e


def _check_caches(model_type: str, labelled: list) -> None:
    """Refuse caches the engine has no paged form of."""
    caches = [cache for _, cache in labelled]
    odd = sorted({type(c).__name__ for c in caches if type(c) not in (KVCache, RotatingKVCache, ArraysCache)})
    if odd:
        raise ValueError(f"{model_type}: needs {', '.join(odd)}, not supported yet")
    if all(type(c) is ArraysCache for c in caches):
        raise ValueError(f"{model_type}: has no attention layers (only recurrent state), nothing to page")
    for label, cache in labelled:
        if type(cache) is RotatingKVCache and cache.keep:
            raise ValueError(
                f"{model_type}: {label} keeps its first {cache.keep} tokens beside its window, not supported yet"
            )


def _layout(model: nn.Module, model_type: str, label: str, cache, calls: dict) -> LayerLayout | StateLayout:
    """The layout of one cache after the probe's token (``calls``: ``_probe``'s)."""
    if type(cache) is ArraysCache:  # what one token left in it: the state's shape per sequence
        return StateLayout(tuple(None if a is None else (a.shape[1:], a.dtype) for a in cache.cache))
    if cache.keys is None:
        raise ValueError(f"{model_type}: {label} stores no K/V in its cache")
    if id(cache) not in calls:  # the paged kernel would never see this layer's queries
        if any(type(m).__name__ == "Indexer" for _, m in model.named_modules()):
            raise ValueError(
                f"{model_type}: sparse attention is not supported: its indexer reads cached keys directly "
                f"to pick the top-k tokens ({label} is not passed to scaled_dot_product_attention)"
            )
        raise ValueError(
            f"{model_type}: {label} does not pass its cache to scaled_dot_product_attention "
            "(it attends to what update_and_fetch returns)"
        )
    if calls[id(cache)]:  # MLA: the cached "keys" are the latent, the cached "values" the RoPE keys
        latent_dim, rope_dim = cache.keys.shape[-1], cache.values.shape[-1]
        return LayerLayout(1, latent_dim + rope_dim, latent_dim, cache.keys.dtype, latent=True)
    _, heads, _, k_dim = cache.keys.shape
    window = cache.max_size if type(cache) is RotatingKVCache else None
    return LayerLayout(heads, k_dim, cache.values.shape[-1], cache.keys.dtype, window=window)


_PROBE_LOCK = threading.Lock()


def _probe(model: nn.Module, structure: list, modules: list[str]) -> dict[int, bool]:
    """Run one token through mlx-lm's own path. For the id of each cache its attention calls were given:
    whether every call attends latents (MLA): one cached head given as both keys and values, the
    cache's second array (the RoPE keys) something else, and the RoPE scores as a float mask."""
    calls = {}

    def recording(*args, **kwargs):
        call = _SDPA_SIGNATURE.bind(*args, **kwargs).arguments
        cache, keys, mask = call["cache"], call["keys"], call.get("mask")
        cached = getattr(cache, "keys", None), getattr(cache, "values", None)
        latent = (
            keys is call["values"]
            and keys.shape[1] == 1
            and cached[0] is not None
            and keys.shape[-1] == cached[0].shape[-1]
            and not (cached[0].shape == cached[1].shape and mx.array_equal(*cached).item())  # not tied K and V
            and isinstance(mask, mx.array)
            and mx.issubdtype(mask.dtype, mx.floating)
        )
        calls[id(cache)] = calls.get(id(cache), True) and latent
        return paged_scaled_dot_product_attention(*args, **kwargs)

    def adapted(call):  # softcapped layers (``softcapped``) pass their cache to the paged kernel themselves
        def recording_call(self, x, mask=None, cache=None):
            calls[id(cache)] = False
            return call(self, x, mask, cache)

        return recording_call

    with _PROBE_LOCK:  # the recorders are set on modules and classes that every model in the process shares
        own_calls = {cls: cls.__call__ for cls in ADAPTED.values()}
        for name in modules:
            sys.modules[name].scaled_dot_product_attention = recording
        for cls, call in own_calls.items():
            cls.__call__ = adapted(call)
        try:
            mx.eval(model(mx.array([[0]]), cache=structure))  # one token shows each layer's K/V shapes
        finally:
            for name in modules:
                sys.modules[name].scaled_dot_product_attention = paged_scaled_dot_product_attention
            for cls, call in own_calls.items():
                cls.__call__ = call
    return calls
