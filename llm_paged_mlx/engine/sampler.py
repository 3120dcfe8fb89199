"""Per-request sampling with mlx-lm's filters.

Greedy rows share one argmax. A sampled row applies mlx-lm's top-p, min-p and
top-k filters; a seeded request draws with a key made from its seed and the
number of tokens it has generated, so its tokens do not depend on what else is
in the batch.
"""

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .request import Request


def sample(logits: mx.array, requests: list[Request]) -> mx.array:
    """One token per row of ``logits`` (lazy), row ``i`` for ``requests[i]``."""
    greedy = mx.argmax(logits, axis=-1)
    if all(r.params.temperature == 0 for r in requests):
        return greedy
    tokens = []
    for i, request in enumerate(requests):
        if request.params.temperature == 0:
            tokens.append(greedy[i : i + 1])
        else:
            tokens.append(_sample_row(logits[i : i + 1], request))
    return mx.concatenate(tokens)


def _sample_row(logits: mx.array, request: Request) -> mx.array:
    p = request.params
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if p.top_p < 1.0:
        logprobs = apply_top_p(logprobs, p.top_p)
    if p.min_p > 0.0:
        logprobs = apply_min_p(logprobs, p.min_p)
    if 0 < p.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, p.top_k)
    key = None
    if p.seed is not None:
        key = mx.random.key((p.seed * 1_000_003 + len(request.output_token_ids)) % 2**64)
    return mx.random.categorical(logprobs * (1 / p.temperature), key=key)
