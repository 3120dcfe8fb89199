"""The hook that hands mlx-lm's attention calls on paged caches to those caches.

mlx-lm's attention layers call ``scaled_dot_product_attention``, imported from
``mlx_lm.models.base`` into their module, with ``cache=cache``.
``install_attention_hook`` puts ``paged_scaled_dot_product_attention`` in its
place in the model's modules: a call on a ``HookedCache`` (``paged_cache``)
goes to the cache, every other call to mlx-lm's function unchanged.
"""

import contextlib
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_base

original_sdpa = mlx_base.scaled_dot_product_attention
_float32 = False  # see float32_attention()


class HookedCache:
    """A cache whose attention calls the hook hands to it."""

    def attention(self, queries, keys, values, scale, mask, sinks=None) -> mx.array:
        raise NotImplementedError


@contextlib.contextmanager
def float32_attention():
    """Within it, attention runs on float32 copies of its inputs: mlx-lm's own, and the paged kernels over
    full-precision pools.

    The model check measures with it how much rounding inside attention moves a model's logits, and
    compares the two paths with that rounding taken out.
    """
    global _float32
    _float32 = True
    try:
        yield
    finally:
        _float32 = False


def in_float32() -> bool:
    """Whether attention runs in float32 now (``float32_attention``)."""
    return _float32


def paged_scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention entry point, sending paged caches' calls to them."""
    if isinstance(cache, HookedCache):
        return cache.attention(queries, keys, values, scale, mask, sinks)
    if _float32 and queries.dtype != mx.float32:
        q, k, v = (x.astype(mx.float32) for x in (queries, keys, values))
        return original_sdpa(q, k, v, cache=cache, scale=scale, mask=mask, sinks=sinks).astype(queries.dtype)
    return original_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install_attention_hook(model: nn.Module) -> list[str]:
    """Route the model's attention through the hook; returns the patched module names."""
    patched = []
    for name in sorted({type(m).__module__ for _, m in model.named_modules()}):
        module = sys.modules.get(name)
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is original_sdpa:
            module.scaled_dot_product_attention = paged_scaled_dot_product_attention
        if current in (original_sdpa, paged_scaled_dot_product_attention):
            patched.append(name)
    return patched
