"""Which formulation of multi-head latent attention (MLA) a prompt chunk takes.

mlx-lm's MLA layers have two: for one query (``L == 1``) the query is absorbed
through the latent up-projection (``embed_q``) and attends the cached latent
rows, whose output ``unembed_out`` projects back; for several, the prompt
formulation decompresses every context token's latent into per-head keys and
values and attends those. Per head and in multiply-adds, with ``L`` queries
over ``C`` context tokens, latent width ``R`` and decompressed key and value
widths ``K`` and ``V`` (the RoPE part costs both the same):

- absorbed:     ``L * R * (K + V)``  +  ``L * C * 2R``
- decompressed: ``C * R * (K + V)``  +  ``L * C * (K + V)``

so decompressing takes less arithmetic unless a few queries meet a long
context (at DeepSeek's R = 512, K = V = 128: whenever ``1/L - 1/C < 1/171``,
every chunk of 171 tokens or more). It holds more at once, though: the
model's RoPE scores of every query over the whole context, and the per-head
keys and values. The engine decompresses only when those leave room, within
the budget of its tiled prefill attention, for the attention's own scores of
``MIN_QUERY_TILE`` queries at a time (``query_tile``). And since the two
round differently in low precision, it decides once per request (its new
prompt tokens, at most a step's worth, over its context), not per chunk: how
a step's budget cuts a prompt must not change its tokens.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear

# Bytes per score of one tile of queries in MLX's attention: scores, masked scores and softmax, float32.
TILE_SCORE_BYTES = 12
MIN_QUERY_TILE = 64
# Fewest new prompt tokens a request decompresses: each of its chunks is a call of the whole model of its own,
# where absorbed rows share the step's one call.
MIN_SEQUENCE_TOKENS = 256


def model_bytes(heads: int, num_tokens: int, context_len: int, widths: int, dtype: mx.Dtype) -> int:
    """What a decompressed chunk's model code holds at once: its RoPE scores and their masked copy, and the
    context's per-head keys and values (``widths`` values per head and token), twice (a concatenation)."""
    return heads * context_len * (num_tokens + widths) * 2 * dtype.size


def query_tile(heads: int, num_tokens: int, context_len: int, widths: int, dtype: mx.Dtype, budget: int) -> int:
    """Queries per attention call of a decompressed chunk, so that it all holds at most ``budget`` bytes
    (0: none fit)."""
    left = budget - model_bytes(heads, num_tokens, context_len, widths, dtype)
    return max(0, min(num_tokens, left // (heads * context_len * TILE_SCORE_BYTES)))


@dataclass(frozen=True)
class LatentShape:
    """The per-head up-projections of a model's MLA layers: ``heads`` heads decompress a ``latent_dim``
    latent into keys of ``key_dim`` (besides the RoPE part) and values of ``value_dim``."""

    heads: int
    latent_dim: int
    key_dim: int
    value_dim: int
    dtype: mx.Dtype

    def decompresses(self, num_tokens: int, context_len: int, budget: int) -> bool:
        """Whether a chunk of ``num_tokens`` queries, the last of which sees ``context_len`` tokens, takes
        less arithmetic decompressed, within ``budget`` bytes held at once."""
        if num_tokens == 1:
            return False
        widths = self.key_dim + self.value_dim
        absorbed = num_tokens * self.latent_dim * widths + num_tokens * context_len * 2 * self.latent_dim
        decompressed = context_len * self.latent_dim * widths + num_tokens * context_len * widths
        tile = query_tile(self.heads, num_tokens, context_len, widths, self.dtype, budget)
        return decompressed < absorbed and tile >= min(num_tokens, MIN_QUERY_TILE)


def _input_dims(layer: MultiLinear | QuantizedMultiLinear) -> int:
    if isinstance(layer, QuantizedMultiLinear):
        return layer.scales.shape[-1] * layer.group_size
    return layer.weight.shape[-1]


def latent_shape(model: nn.Module, dtype: mx.Dtype) -> LatentShape | None:
    """The shape of the model's first MLA attention (a module with mlx-lm's ``embed_q`` and ``unembed_out``
    per-head layers), or None; ``dtype``: its activations'."""
    per_head = (MultiLinear, QuantizedMultiLinear)
    for _, module in model.named_modules():
        embed, unembed = getattr(module, "embed_q", None), getattr(module, "unembed_out", None)
        if isinstance(embed, per_head) and isinstance(unembed, per_head):
            heads, latent_dim = embed.weight.shape[:2]  # (heads, latent, key): it projects keys into the latent
            return LatentShape(heads, latent_dim, _input_dims(embed), unembed.weight.shape[1], dtype)
    return None
