"""A draft model for speculative decoding: it drafts a request's next tokens by greedy decoding, on the device.

The draft model keeps its K/V in pools of its own with the target's block ids:
the target's block tables serve both, so the same blocks, growth, copies and
budget hold both models' K/V, and a rejected position's block goes back for
both. It computes its K/V for every position the target computes, in the same
step: each chunk's tokens in one call, then, for each drafting chunk, one
single-row pass per drafted position (its own greedy token at the last, fed
back). Its drafts stay on the device: the target's step takes them as its
input tokens, and they are read back with its sampled tokens.

A swap keeps both models' K/V (``SharedBlocks``). Blocks read from the disk
tier hold the target's alone: the draft model's there are stale, which costs
acceptance, never a token (the target verifies every draft).
"""

from typing import Optional

import mlx.core as mx

from .runner import ModelRunner
from .scheduler import ScheduledChunk


class Drafter:
    def __init__(self, runner: ModelRunner):
        """``runner``: the draft model's, over pools of as many blocks of the same size as the target's."""
        self.runner = runner

    def run(self, chunks: list[ScheduledChunk], input_tokens: Optional[mx.array] = None):
        """Compute the draft model's K/V for the step's ``chunks`` and its drafts for those that have one
        (their ``draft`` gives only its length); returns the target's input tokens (each chunk's, its draft
        included, in chunk order) and the drafted tokens in chunk order (None: no chunk drafts)."""
        plain = [ScheduledChunk(c.request, 1, [s[:1] for s in c.slots]) if c.draft else c for c in chunks]
        order = sorted(range(len(chunks)), key=lambda i: plain[i].num_tokens != 1)  # single tokens first, as runs take
        hidden = self.runner.forward([plain[i] for i in order], input_tokens, project=False)  # run-ahead's: single
        drafting = [i for i, c in enumerate(chunks) if c.draft]
        if not drafting:  # its K/V only: no row goes through its vocabulary
            return input_tokens, None
        completing = [i for i in order if plain[i].completes]
        rows = mx.array([completing.index(i) for i in drafting], dtype=mx.int32)
        first = mx.argmax(self.runner.project(hidden[rows]), axis=-1).astype(mx.int32)
        drafts = [[token] for token in mx.split(first, len(drafting))]
        for position in range(1, max(len(chunks[i].draft) for i in drafting) + 1):
            going = [n for n, i in enumerate(drafting) if len(chunks[i].draft) >= position]
            passes = [ScheduledChunk(chunks[drafting[n]].request, 1, [[s[position]] for s in chunks[drafting[n]].slots],
                                     offset=position) for n in going]  # fmt: skip
            fed = mx.concatenate([drafts[n][position - 1] for n in going])
            greedy = mx.argmax(self.runner.row_logits(passes, fed), axis=-1).astype(mx.int32)
            for k, n in enumerate(going):
                if len(chunks[drafting[n]].draft) > position:  # the last pass only writes its token's K/V
                    drafts[n].append(greedy[k : k + 1])
        pieces, drafted = [], iter(drafts)
        for chunk in chunks:
            tokens = mx.array(chunk.token_ids()[: chunk.num_tokens - len(chunk.draft)], dtype=mx.int32)
            pieces += [tokens, *next(drafted)] if chunk.draft else [tokens]
        return mx.concatenate(pieces), mx.concatenate([token for tokens in drafts for token in tokens])


class SharedBlocks:
    """The target's pools and the draft model's as one for swap policies: a block's K/V are both models'."""

    def __init__(self, target: ModelRunner, draft: ModelRunner):
        self.target, self.draft = target, draft
        self.groups, self.block_size = target.groups, target.block_size

    def read_blocks(self, blocks: list[int]) -> list[mx.array]:
        return self.target.read_blocks(blocks) + self.draft.read_blocks(blocks)

    def write_blocks(self, blocks: list[int], data: list[mx.array]) -> None:
        split = len(self.target.pools())
        self.target.write_blocks(blocks, data[:split])
        self.draft.write_blocks(blocks, data[split:])
