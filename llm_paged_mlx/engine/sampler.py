"""Per-request sampling with mlx-lm's filters.

A request's logit bias is added to its row first (the rows of requests without
one are left as they are). Greedy rows share one argmax. A sampled row applies
mlx-lm's top-p, min-p and top-k filters; a seeded request draws with a key made
from its seed and the number of tokens it has generated before the row's, so its
tokens depend neither on what else is in the batch nor on whether a row verifies a
draft. Log-probabilities, for the requests that
ask for them, are the model's (before bias, temperature and filters).
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .request import Request


@dataclass
class StepLogprobs:
    """Log-probabilities a step computed (lazy until read): for ``requests[i]`` of each of ``rows``, the
    sampled token's, and the ``k`` most likely tokens' ids and values (``k``: the most any of them asks)."""

    rows: list[int]
    sampled: mx.array
    top_ids: Optional[mx.array]
    top_values: Optional[mx.array]


def sample(
    logits: mx.array, requests: list[Request], allowed: Optional[mx.array] = None, ahead: Optional[list[int]] = None
) -> mx.array:
    """One token per row of ``logits`` (lazy), row ``i`` for ``requests[i]``, among the tokens ``allowed``
    (booleans shaped as the logits; None: all) before any other filter. ``ahead[i]``: the tokens between the
    request's last and row ``i``'s (drafted tokens it verifies; None: 0 for every row)."""
    if any(r.params.logit_bias for r in requests):
        logits = _biased(logits, requests)
    if allowed is not None:
        logits = mx.where(allowed, logits, -mx.inf)
    greedy = mx.argmax(logits, axis=-1)
    if all(r.params.temperature == 0 for r in requests):
        return greedy
    tokens = []
    for i, request in enumerate(requests):
        if request.params.temperature == 0:
            tokens.append(greedy[i : i + 1])
        else:
            tokens.append(_sample_row(logits[i : i + 1], request, ahead[i] if ahead else 0))
    return mx.concatenate(tokens)


def _biased(logits: mx.array, requests: list[Request]) -> mx.array:
    """``logits`` in float32 (as a sampled row takes them: a greedy row's argmax is the same), with each
    request's ``logit_bias`` added to its row; an id past the logits has none to bias."""
    width = logits.shape[-1]
    rows, ids, biases = [], [], []
    for row, request in enumerate(requests):
        for token, bias in (request.params.logit_bias or {}).items():
            if token < width:
                rows.append(row)
                ids.append(token)
                biases.append(bias)
    if not rows:
        return logits
    return logits.astype(mx.float32).at[mx.array(rows), mx.array(ids)].add(mx.array(biases, dtype=mx.float32))


def _sample_row(logits: mx.array, request: Request, ahead: int) -> mx.array:
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
        key = mx.random.key((p.seed * 1_000_003 + len(request.output_token_ids) + ahead) % 2**64)
    return mx.random.categorical(logprobs * (1 / p.temperature), key=key)


def logprobs(logits: mx.array, tokens: mx.array, requests: list[Request]) -> Optional[StepLogprobs]:
    """The log-probabilities the requests in ``requests`` with ``params.logprobs`` set ask for."""
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return None
    index = mx.array(rows, dtype=mx.int32)
    values = logits[index].astype(mx.float32)
    values = values - mx.logsumexp(values, axis=-1, keepdims=True)
    sampled = mx.take_along_axis(values, tokens[index].astype(mx.int32)[:, None], axis=-1)[:, 0]
    k = max(requests[i].params.logprobs for i in rows)
    if k == 0:
        return StepLogprobs(rows, sampled, None, None)
    top_ids = mx.argpartition(-values, k - 1, axis=-1)[:, :k]
    return StepLogprobs(rows, sampled, top_ids, mx.take_along_axis(values, top_ids, axis=-1))
