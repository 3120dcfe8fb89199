"""Gemma 2's attention over paged K/V: scores softcapped, which mlx-lm's shared attention function does not do.

mlx-lm's ``gemma2`` attends with its own code (scores taken as
``cap * tanh(scores / cap)`` before the softmax), so the attention hook of
``paged_cache`` never sees its layers. ``adapt_attention`` gives those layers a
class whose call, on a paged cache, hands the queries to the cache's kernel
with the cap; on any other cache it is mlx-lm's own.
"""

import mlx.nn as nn
from mlx_lm.models import gemma2


class PagedGemma2Attention(gemma2.Attention):
    def __call__(self, x, mask=None, cache=None):
        if not hasattr(cache, "attend"):  # not a paged cache (``paged_cache.PagedLayerCache``)
            return super().__call__(x, mask, cache)
        batch, length, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(batch, length, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(batch, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(batch, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=cache.offset)
        keys = self.rope(keys, offset=cache.offset)
        cache.update_and_fetch(keys, values)
        out = cache.attend(queries, self.scale, softcap=self.attn_logit_softcapping)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


ADAPTED = {gemma2.Attention: PagedGemma2Attention}


def adapt_attention(model: nn.Module) -> list[nn.Module]:
    """Give the model's softcapped attention layers (exactly mlx-lm's classes) the paged call, for good (on
    mlx-lm's own caches it computes what mlx-lm does); returns them."""
    adapted = []
    for _, module in model.named_modules():
        paged = ADAPTED.get(type(module))
        if paged is not None:
            module.__class__ = paged  # same attributes and weights: only the call changes
        if type(module) in ADAPTED.values():
            adapted.append(module)
    return adapted


def has_softcapped_attention(model: nn.Module) -> bool:
    """Whether the model has attention layers ``adapt_attention`` adapted."""
    return any(type(module) in ADAPTED.values() for _, module in model.named_modules())
