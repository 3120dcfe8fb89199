"""How large an engine's K/V pools are: the budget, the blocks it holds beside recurrent state, the pools'
first size, and how they grow.

The pools start at ``INITIAL_POOL_BYTES`` (or as large as one step needs) and grow as requests need blocks,
up to the budget: a large budget costs nothing until it is used, and allocating it whole takes seconds on
some machines.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ..models.adapt import ModelSpec
from ..parallel.collectives import every_rank, ranks_on_this_machine
from .config import DEFAULT_KV_BUDGET, DEFAULT_MAX_NUM_SEQS, EngineConfig
from .memory import auto_kv_budget, format_size, step_reserve

INITIAL_POOL_BYTES = 128 * 1024**2


@dataclass(frozen=True)
class PoolSize:
    """The pools' sizes, in blocks (the null block included) and bytes."""

    block_bytes: int  # one block's K/V over all the layers it serves
    max_blocks: int  # what the budget holds
    initial_blocks: int  # what the pools start with
    step_blocks: int  # what one step may take: its tokens, each sequence's next block in every table, the null block
    max_num_seqs: int
    state_bytes: int  # the recurrent state of max_num_seqs sequences (hybrid models), counted in the budget

    @property
    def budget_bytes(self) -> int:
        return self.max_blocks * self.block_bytes + self.state_bytes

    def grown(self, num_blocks: int, wanted: int) -> int:
        """The pools' next size from ``num_blocks`` when a step may want ``wanted`` blocks more than are
        free: at least doubled, up to the budget (``num_blocks`` itself when nothing is wanted)."""
        if wanted <= 0:
            return num_blocks
        return min(self.max_blocks, max(2 * num_blocks, num_blocks + wanted))


def size_pools(model, spec: ModelSpec, groups, config: EngineConfig, group=None,
               draft: Optional[ModelSpec] = None) -> PoolSize:  # fmt: skip
    """The pools of ``config.num_blocks`` blocks, or of as many as ``kv_budget_bytes`` (``kv_budget``'s) holds
    beside the recurrent state of ``max_num_seqs`` sequences (``DEFAULT_MAX_NUM_SEQS`` unless given, or for
    models with recurrent layers as many as half the budget holds the state of). ``spec``: the model's,
    ``groups``: its attention layers' ``KVGroups``; ``group``: a tensor-parallel group; ``draft``: a draft
    model's spec, whose K/V each block also holds (``engine.drafter``). ValueError if the budget holds fewer
    than 2 blocks."""
    layouts, state_layouts, draft_layouts = spec.attention, spec.states, draft.attention if draft else []
    block_size, num_blocks, max_num_seqs = config.block_size, config.num_blocks, config.max_num_seqs
    kv_bits, kv_group_size, max_num_batched_tokens = config.kv_bits, config.kv_group_size, config.max_num_batched_tokens
    # A block holds its tokens for the layers of one group: one layer in each of the groups' places.
    owners = {place: layout for place, layout in reversed(list(zip(groups.layer_places, layouts)))}
    block_bytes = block_size * sum(layout.bytes_per_token(kv_bits, kv_group_size) for layout in owners.values())
    block_bytes += block_size * sum(layout.bytes_per_token(None, kv_group_size) for layout in draft_layouts)
    per_sequence = sum(layout.bytes_per_sequence for layout in state_layouts)
    if num_blocks is None:
        step_tokens = max_num_batched_tokens * (2 if state_layouts else 1)  # hybrids' prompts run right-padded
        logit_rows = (max_num_seqs or DEFAULT_MAX_NUM_SEQS) if spec.projects_sampled_rows_only else step_tokens
        budget = kv_budget(model, config.kv_budget_bytes, config.memory_fraction, logit_rows,
                           step_tokens, group)  # fmt: skip
        if max_num_seqs is None and per_sequence:  # as many sequences as half the budget holds the state of
            max_num_seqs = max(1, min(DEFAULT_MAX_NUM_SEQS, budget // 2 // per_sequence))
        max_num_seqs = max_num_seqs or DEFAULT_MAX_NUM_SEQS
        state_bytes = max_num_seqs * per_sequence
        num_blocks = (budget - state_bytes) // block_bytes
        if num_blocks < 2:
            states = f" after {format_size(state_bytes)} of recurrent state for {max_num_seqs} sequences"
            raise ValueError(
                f"a KV budget of {budget} bytes holds fewer than 2 blocks of {block_bytes} bytes"
                + (states + " (lower max_num_seqs or raise the budget)" if state_bytes else "")
            )
    else:
        max_num_seqs = max_num_seqs or DEFAULT_MAX_NUM_SEQS
        state_bytes = max_num_seqs * per_sequence
    step_blocks = (-(-max_num_batched_tokens // block_size) + max_num_seqs) * len(groups.windows) + 1
    initial = min(num_blocks, max(INITIAL_POOL_BYTES // block_bytes, 2 * step_blocks))
    return PoolSize(block_bytes, num_blocks, initial, step_blocks, max_num_seqs, state_bytes)


def kv_budget(model, budget, fraction: float, logit_rows: int, max_num_batched_tokens: int, group=None) -> int:
    """The pools' bytes: ``budget`` as given, ``DEFAULT_KV_BUDGET`` for None, or for ``"auto"`` the ``fraction``
    of the device's memory that the weights and a step's activations leave (``logit_rows``: the rows a step
    puts through the vocabulary projection; over a tensor-parallel ``group``: the smallest rank's, shared by
    the ranks on one machine where they share its memory)."""
    if budget is None:
        return DEFAULT_KV_BUDGET
    if budget != "auto":
        return budget
    mx.eval(model.parameters())  # the weights count as memory in use
    budget = auto_kv_budget(step_reserve(model, max_num_batched_tokens, logit_rows), fraction)
    if group is not None:  # the pools must hold as many blocks on every rank
        if mx.default_device() == mx.cpu or mx.metal.is_available():  # ranks on one machine share its memory
            budget //= ranks_on_this_machine(group)
        budget = min(every_rank(budget >> 20, group)) << 20  # in MiB: it travels as an int32
    return budget
