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


class Scheduler:
    def __init__(self, blocks: BlockManager, policy, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Forget a finished or aborted request and return its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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
            if request.swap_handle is not None:
                if self.blocks.append_slots(rid, request.num_computed) is None:
                    return
                out.swapped_in.append(request)
            else:
                request.num_computed = self.blocks.allocate_prefix(rid, request.token_ids)
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
                self.prefix_hit_tokens += request.num_computed
            request.status = Status.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, count, slots))
            budget -= count

    def _preempt(self, request: Request) -> None:
        self.blocks.free(request.request_id)
        request.status = Status.WAITING
        self.waiting.append(request)
        self.num_preemptions += 1
