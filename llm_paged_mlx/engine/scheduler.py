"""Continuous batching: which tokens of which requests run in the next step.

Each step has a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``). Running requests go first, in policy order, each with its
next token or its next prefill chunk; then waiting requests are admitted in
policy order while budget, sequences and blocks last. When a running request
needs a block and none is free, the lowest-ranked running request is
preempted; what happens to its K/V is the swap policy's business.
"""

from dataclasses import dataclass, field

from ..hookspecs import hookimpl
from .block_manager import BlockManager
from .request import Request, Status
from .runner import ScheduledChunk


class FCFSPolicy:
    """First come, first served."""

    name = "fcfs"

    def key(self, request: Request):
        return (request.arrival,)


class PriorityPolicy:
    """Smaller ``SamplingParams.priority`` first, then arrival order."""

    name = "priority"

    def key(self, request: Request):
        return (request.params.priority, request.arrival)


@hookimpl
def register_schedulers(register):
    register("fcfs", FCFSPolicy)
    register("priority", PriorityPolicy)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # single-token chunks first
    preempted: list[tuple[Request, list[int]]] = field(default_factory=list)  # with their old blocks
    swapped_in: list[Request] = field(default_factory=list)
    disk_loads: list[tuple[int, list]] = field(default_factory=list)  # (block id, its K/V from the disk tier)


class Scheduler:
    """Plans each step over the block manager.

    ``load_blocks(parent_hash, blocks_token_ids)``, if given, returns the K/V of
    the full blocks that follow a cached prefix, as far as the disk tier has them.
    """

    def __init__(self, blocks: BlockManager, policy, max_num_seqs: int, max_num_batched_tokens: int, load_blocks=None):
        self.blocks = blocks
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.load_blocks = load_blocks
        self.disk_hit_tokens = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Forget a finished or aborted request and return its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.request_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(chunks=[])
        budget = self.max_num_batched_tokens
        self.running.sort(key=self.policy.key)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(request.num_pending, budget)
            slots = self.blocks.append_slots(request.request_id, count)
            while slots is None:
                victim = self.running.pop()
                out.preempted.append((victim, self.blocks.block_table(victim.request_id)))
                self._preempt(victim)
                if victim is request:
                    break
                slots = self.blocks.append_slots(request.request_id, count)
            if slots is not None:
                out.chunks.append(ScheduledChunk(request, count, slots))
                budget -= count
                index += 1
        if not out.preempted:
            self._admit(out, budget)
        out.chunks.sort(key=lambda chunk: chunk.num_tokens != 1)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        self.waiting.sort(key=self.policy.key)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            rid = request.request_id
            from_disk = 0
            if request.swap_handle is not None:
                if self.blocks.append_slots(rid, request.num_computed) is None:
                    return
                out.swapped_in.append(request)
            else:
                request.num_computed = self.blocks.allocate_prefix(rid, request.token_ids)
                from_disk = self._load_from_disk(request, out)
                request.num_computed += from_disk
            count = min(request.num_pending, budget)
            slots = self.blocks.append_slots(rid, count)
            if slots is None:
                if request.swap_handle is not None:
                    out.swapped_in.pop()
                self.blocks.free(rid)
                return
            self.waiting.pop(0)
            if not out.swapped_in or out.swapped_in[-1] is not request:
                request.num_cached_tokens = max(request.num_cached_tokens, request.num_computed)
                request.num_disk_cached_tokens = max(request.num_disk_cached_tokens, from_disk)
                self.prefix_hit_tokens += request.num_computed - from_disk
                self.disk_hit_tokens += from_disk
            request.status = Status.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, count, slots))
            budget -= count

    def _load_from_disk(self, request: Request, out: SchedulerOutput) -> int:
        """Continue the request's cached prefix with full blocks from the disk tier; returns their tokens.

        As for the memory cache, the last prompt token is always left to compute.
        The blocks enter the prefix cache now; the engine writes their K/V before
        the forward pass.
        """
        if self.load_blocks is None:
            return 0
        rid, size, tokens = request.request_id, self.blocks.block_size, request.token_ids
        starts = range(request.num_computed, len(tokens) - size, size)[: self.blocks.num_free_blocks]
        if not starts:
            return 0
        found = self.load_blocks(self.blocks.prefix_hash(rid), [tokens[s : s + size] for s in starts])
        loaded = 0
        for start, data in zip(starts, found):
            block_id = self.blocks.append_cached_block(rid, tokens[start : start + size])
            if block_id is None:
                break
            out.disk_loads.append((block_id, data))
            loaded += size
        return loaded

    def _preempt(self, request: Request) -> None:
        self.blocks.free(request.request_id)
        request.status = Status.WAITING
        self.waiting.append(request)
        self.num_preemptions += 1
