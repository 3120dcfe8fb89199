"""A draft model for speculative decoding: it drafts a request's next tokens by greedy decoding, on the device.

The draft model keeps its K/V in pools of its own with the target's block ids:
the target's block tables serve both, so the same blocks, growth, copies and
budget hold both models' K/V, and a rejected position's block goes back for
both. It runs only in steps where a request drafts, and only for the requests
that draft: first its K/V for the positions the target computed since that
request last drafted (``Request.draft_start``: every prompt, the steps where
too many requests ran to draft, pauses, a prefix found in the cache or on disk),
then one single-row pass per drafted position (its own greedy token at the last,
fed back). Steps that draft nothing cost nothing more than plain decoding. Its
drafts stay on the device: the target's step takes them as its input tokens, and
they are read back with its sampled tokens.

A swap keeps both models' K/V (``SharedBlocks``).
"""

from typing import Optional

import mlx.core as mx

from .kv_coordinator import KVCoordinator
from .kv_pools import KVPools
from .runner import ModelRunner
from .scheduler import ScheduledChunk


class Drafter:
    def __init__(self, runner: ModelRunner, blocks: KVCoordinator):
        """``runner``: the draft model's, over pools of as many blocks of the same size as the target's, whose
        slots ``blocks`` gives."""
        self.runner, self.blocks = runner, blocks

    def run(self, chunks: list[ScheduledChunk], input_tokens: Optional[mx.array] = None):
        """The drafts of the step's ``chunks`` that have one (their ``draft`` gives only its length): returns the
        target's input tokens (each chunk's, its draft included, in chunk order) and the drafted tokens in
        chunk order (None: no chunk drafts, and ``input_tokens`` as given)."""
        drafting = [c for c in chunks if c.draft]
        for chunk in chunks:
            if not chunk.draft:  # computed without the draft model: it catches up when the request drafts
                chunk.request.draft_start = min(chunk.request.draft_start, chunk.start)
        if not drafting:
            return input_tokens, None
        self._catch_up(drafting)
        plain = [ScheduledChunk(c.request, 1, [s[:1] for s in c.slots]) for c in drafting]  # the pending tokens
        first = mx.argmax(self.runner.forward(plain), axis=-1).astype(mx.int32)
        drafts = [[token] for token in mx.split(first, len(drafting))]
        for position in range(1, max(len(c.draft) for c in drafting) + 1):
            going = [n for n, c in enumerate(drafting) if len(c.draft) >= position]
            passes = [ScheduledChunk(drafting[n].request, 1, [[s[position]] for s in drafting[n].slots],
                                     offset=position) for n in going]  # fmt: skip
            fed = mx.concatenate([drafts[n][position - 1] for n in going])
            greedy = mx.argmax(self.runner.row_logits(passes, fed), axis=-1).astype(mx.int32)
            for k, n in enumerate(going):
                if len(drafting[n].draft) > position:  # the last pass only writes its token's K/V
                    drafts[n].append(greedy[k : k + 1])
        for chunk in drafting:
            chunk.request.draft_start = chunk.start + chunk.num_tokens
        pieces, drafted = [], iter(drafts)
        for chunk in chunks:
            tokens = mx.array(chunk.token_ids()[: chunk.num_tokens - len(chunk.draft)], dtype=mx.int32)
            pieces += [tokens, *next(drafted)] if chunk.draft else [tokens]
        return mx.concatenate(pieces), mx.concatenate([token for tokens in drafts for token in tokens])

    def _catch_up(self, drafting: list[ScheduledChunk]) -> None:
        """The draft model's K/V for each drafting request's positions from its ``draft_start`` to its pending
        token, in calls of at most ``chunk_tokens`` tokens. Blocks another request shares get the same K/V again
        (they follow from the same tokens), in the draft model's pools only."""
        gaps = [(c, c.start - min(c.request.draft_start, c.start)) for c in drafting]
        pieces, size = [], self.runner.chunk_tokens
        for chunk, gap in gaps:
            for offset in range(-gap, 0, size):
                count = min(size, -offset)
                slots = self.blocks.slots(chunk.request.tables, chunk.start + offset, count)
                pieces.append(ScheduledChunk(chunk.request, count, slots, offset=offset))
        calls, tokens = [[]], 0
        # Longest first (a request's pieces keep their order): a call of single rows, which a GPU writes in
        # place, comes after the calls of sequences, which would copy a pool an earlier in-place call kept.
        for piece in sorted(pieces, key=lambda piece: -piece.num_tokens):
            if tokens + piece.num_tokens > size:
                calls, tokens = calls + [[]], 0
            calls[-1].append(piece)
            tokens += piece.num_tokens
        for call in filter(None, calls):
            self.runner.forward(sorted(call, key=lambda c: c.num_tokens != 1), project=False)


class SharedBlocks:
    """The target's pools and the draft model's as one for swap policies: a block's K/V are both models'."""

    def __init__(self, target: KVPools, draft: KVPools):
        self.target, self.draft = target, draft
        self.groups, self.block_size = target.groups, target.block_size

    def read_blocks(self, blocks: list[int]) -> list[mx.array]:
        return self.target.read_blocks(blocks) + self.draft.read_blocks(blocks)

    def write_blocks(self, blocks: list[int], data: list[mx.array]) -> None:
        split = len(self.target.arrays())
        self.target.write_blocks(blocks, data[:split])
        self.draft.write_blocks(blocks, data[split:])
