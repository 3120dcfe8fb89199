"""The model runner: owns the model and the K/V pools, runs one step's forward pass."""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..kernels.plan import AttentionPlan, PrefillChunk
from ..models.paged_cache import LayerLayout, PagedLayerCache
from .request import Request

# Architectures whose Model.__call__ is exactly "body, then tied embedding or lm_head":
# for them only the rows that are sampled go through the vocabulary projection.
_BODY_THEN_HEAD = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass
class ScheduledChunk:
    """The next ``num_tokens`` uncomputed tokens of a request, and the slots they go to."""

    request: Request
    num_tokens: int
    slots: list[int]

    @property
    def completes(self) -> bool:
        """Whether the chunk reaches the request's last token, so its logits are sampled."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


class ModelRunner:
    def __init__(self, model, layouts: list[LayerLayout], num_blocks: int, block_size: int, kernel):
        self.model = model
        self.block_size = block_size
        self.caches = [
            PagedLayerCache(num_blocks, block_size, l.num_kv_heads, l.k_dim, l.v_dim, l.dtype, kernel)
            for l in layouts
        ]
        mx.eval(self.pools())
        self.split = getattr(model, "model_type", None) in _BODY_THEN_HEAD

    def pools(self) -> list[mx.array]:
        return [a for c in self.caches for a in (c.keys, c.values)]

    @property
    def kv_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        for cache in self.caches:
            cache.copy_blocks(copies)

    def read_blocks(self, blocks: list[int]) -> list[mx.array]:
        """The K and V of the given blocks in every layer (lazy copies)."""
        out = []
        for cache in self.caches:
            rows = cache.block_rows(blocks)
            out += [cache.keys[rows], cache.values[rows]]
        return out

    def write_blocks(self, blocks: list[int], data: list[mx.array]) -> None:
        """Write what ``read_blocks`` returned into (other) blocks."""
        for cache, keys, values in zip(self.caches, data[::2], data[1::2]):
            rows = cache.block_rows(blocks)
            cache.keys[rows] = keys
            cache.values[rows] = values

    def forward(self, chunks: list[ScheduledChunk], tables: dict[int, list[int]]) -> mx.array:
        """Logits ``(S, vocab)`` for the chunks that complete their request, in chunk order.

        ``chunks`` must list single-token chunks first. The K/V writes stay lazy
        until ``finish`` evaluates them with the sampled tokens.
        """
        plan, tokens, sample_rows = self._plan(chunks, tables)
        for cache in self.caches:
            cache.plan = plan
        inputs = mx.array(tokens)[:, None]
        rows = mx.array(sample_rows, dtype=mx.int32)
        if self.split:
            hidden = self.model.model(inputs, cache=self.caches)[rows, 0]
            if self.model.args.tie_word_embeddings:
                return self.model.model.embed_tokens.as_linear(hidden)
            return self.model.lm_head(hidden)
        return self.model(inputs, cache=self.caches)[rows, 0]

    def finish(self, *outputs) -> None:
        """Evaluate the step: the given outputs and every pool write."""
        mx.eval(*outputs, self.pools())
        for cache in self.caches:
            cache.plan = None

    def _plan(self, chunks, tables):
        tokens, positions, slots, sample_rows = [], [], [], []
        decode = [c for c in chunks if c.num_tokens == 1]
        width = max((len(tables[c.request.request_id]) for c in decode), default=0)
        decode_tables = np.zeros((len(decode), width), dtype=np.int32)
        decode_lens = np.zeros(len(decode), dtype=np.int32)
        prefills = []
        for chunk in chunks:
            request, n = chunk.request, chunk.num_tokens
            start = request.num_computed
            row = len(tokens)
            tokens.extend(request.token_slice(start, start + n))
            positions.extend(range(start, start + n))
            slots.extend(chunk.slots)
            table = tables[request.request_id]
            if n == 1:
                if row >= len(decode):
                    raise ValueError("single-token chunks must come first")
                decode_tables[row, : len(table)] = table
                decode_lens[row] = start + 1
            else:
                used = -(-(start + n) // self.block_size)
                prefills.append(PrefillChunk(row, n, start + n, mx.array(table[:used], dtype=mx.int32)))
            if chunk.completes:
                sample_rows.append(row + n - 1)
        plan = AttentionPlan(
            block_size=self.block_size,
            positions=mx.array(positions, dtype=mx.int32),
            slots=mx.array(slots, dtype=mx.int32),
            num_decode=len(decode),
            decode_block_tables=mx.array(decode_tables),
            decode_context_lens=mx.array(decode_lens),
            prefills=prefills,
        )
        return plan, tokens, sample_rows
