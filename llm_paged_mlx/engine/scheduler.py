"""Continuous batching: which tokens of which requests run in the next step.

Each step has a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``). Running requests go first, in policy order, each with its
next token or its next prefill chunk; then waiting requests are admitted in
policy order while budget, sequences and blocks last.

- When a running request needs a block and none is free, the lowest-ranked
  running request below it is preempted (what happens to its K/V is the swap
  policy's business); a request preempted ``MAX_PREEMPTIONS`` times is not
  taken again, and a request with no one below it to take yields its own
  blocks.
- A waiting request that does not fit lets later ones in, until
  ``MAX_BYPASSES`` of them have passed it; then admission waits for it.
- A waiting request whose policy says it ``preempts`` a running one takes the
  blocks of such requests when that makes it fit.

A policy is an object with ``key(request)`` (smaller keys run first) and,
optionally, ``preempts(waiting, running) -> bool``.

``schedule()`` changes requests and blocks; between ``begin()`` and
``commit()`` it can all be undone with ``rollback()`` (the engine does when a
step fails before it runs).
"""

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..hookspecs import hookimpl
from .block_manager import SequenceBlocks
from .kv_coordinator import KVCoordinator
from .request import Request, Status

MAX_PREEMPTIONS = 4
MAX_BYPASSES = 16


class FCFSPolicy:
    """First come, first served."""

    name = "fcfs"

    def key(self, request: Request):
        return (request.arrival,)


class PriorityPolicy:
    """Smaller ``SamplingParams.priority`` first, then arrival order.

    Requests age: arriving ``aging_s`` seconds earlier counts as one priority
    level, so a stream of urgent requests cannot starve the rest. An arrival
    whose (aged) level is smaller than a running request's preempts it when
    that frees the blocks it needs.
    """

    name = "priority"
    aging_s = 60.0

    def key(self, request: Request):
        return (self._level(request), request.arrival)

    def preempts(self, waiting: Request, running: Request) -> bool:
        return self._level(waiting) < self._level(running)

    def _level(self, request: Request) -> float:
        return request.params.priority + request.arrival_time / self.aging_s


@hookimpl
def register_schedulers(register):
    register("fcfs", FCFSPolicy)
    register("priority", PriorityPolicy)


@dataclass
class ScheduledChunk:
    """The next ``num_tokens`` uncomputed tokens of a request, and the slots they go to in each of its tables.

    A decoding request's chunk may end in a ``draft`` (``engine.speculative``): tokens guessed to follow its
    last one, counted in ``num_tokens``, whose positions are all sampled to verify them. A draft model's
    passes run chunks ``offset`` positions past the request's computed tokens.
    """

    request: Request
    num_tokens: int
    slots: list[list[int]]
    draft: list[int] = field(default_factory=list)
    offset: int = 0

    @property
    def start(self) -> int:
        """The position of the chunk's first token."""
        return self.request.num_computed + self.offset

    @property
    def completes(self) -> bool:
        """Whether the chunk reaches the request's last token, so its logits are sampled."""
        return self.start + self.num_tokens - len(self.draft) == self.request.num_tokens

    @property
    def num_sampled(self) -> int:
        """The chunk's positions whose logits are sampled: its last, and its draft's."""
        return 1 + len(self.draft) if self.completes else 0

    def token_ids(self) -> list[int]:
        """The tokens the chunk computes: the request's next ones, then its draft."""
        return self.request.token_slice(self.start, self.start + self.num_tokens - len(self.draft)) + self.draft


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk]  # single-token chunks first
    preempted: list[tuple[Request, list[SequenceBlocks]]] = field(default_factory=list)  # with the tables they held
    admitted: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)
    disk_loads: list[tuple[int, list]] = field(default_factory=list)  # (block id, its K/V from the disk tier)


# The request fields a step may change, saved before its first change.
_REQUEST_STATE = (
    "status",
    "num_computed",
    "swap_handle",
    "saved_state",
    "num_cached_tokens",
    "num_disk_cached_tokens",
    "num_preemptions",
    "num_bypassed",
    "draft_start",
)


class Scheduler:
    """Plans each step over the requests' blocks (``blocks``: their ``KVCoordinator``).

    ``load_prefix(parent_hash, blocks_token_ids)``, if given, returns the K/V of
    the full blocks that follow a cached prefix, as far as the disk tier has
    them; it is asked only for blocks an admitted request has room for.
    """

    def __init__(self, blocks: KVCoordinator, policy, max_num_seqs: int, max_num_batched_tokens: int,
                 load_prefix: Optional[Callable] = None):  # fmt: skip
        self.blocks = blocks
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.load_prefix = load_prefix
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0
        self.disk_hit_tokens = 0
        self._saved: Optional[tuple] = None

    def add(self, request: Request) -> None:
        request.tables = self.blocks.new_tables()
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Forget a finished or aborted request and return its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.tables)

    def start_over(self) -> None:
        """Every request back to waiting, its blocks freed: its K/V are computed again (or swapped back in)."""
        for request in self.running + self.waiting:
            self.blocks.free(request.tables)
            if request.swap_handle is None:
                request.num_computed = 0
            request.status = Status.WAITING
        self.waiting, self.running = self.running + self.waiting, []

    # -- transactions -------------------------------------------------------------

    def begin(self) -> None:
        counters = (self.num_preemptions, self.prefix_query_tokens, self.prefix_hit_tokens, self.disk_hit_tokens)
        self._saved = (list(self.running), list(self.waiting), counters, {})
        self.blocks.begin()

    def commit(self) -> None:
        self._saved = None
        self.blocks.commit()

    def rollback(self) -> None:
        """Put requests, queues, counters and blocks back as they were at ``begin``."""
        (self.running, self.waiting, counters, requests), self._saved = self._saved, None
        self.num_preemptions, self.prefix_query_tokens, self.prefix_hit_tokens, self.disk_hit_tokens = counters
        for request, state in requests.values():
            for name, value in zip(_REQUEST_STATE, state):
                setattr(request, name, value)
        self.blocks.rollback()

    def touch(self, request: Request) -> None:
        """Save a request's state before the step changes it (for ``rollback``)."""
        if self._saved is not None and id(request) not in self._saved[3]:
            self._saved[3][id(request)] = (request, tuple(getattr(request, name) for name in _REQUEST_STATE))

    # -- planning -----------------------------------------------------------------

    def schedule(self, drafts: Optional[dict[int, list[int]]] = None) -> StepPlan:
        """Plan the next step; ``drafts`` (request id -> tokens) extend decoding requests' chunks with what
        budget and free blocks are left once every running request has its tokens and waiting ones are
        admitted: a draft never preempts, nor delays another request."""
        plan = StepPlan(chunks=[])
        budget = self.max_num_batched_tokens
        self.running.sort(key=self.policy.key)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(request.num_pending, budget)
            tokens = functools.partial(getattr, request, "token_ids")  # built only if a windowed table needs them
            slots = self.blocks.append_slots(request.tables, request.num_computed, count, tokens)
            while slots is None:
                victim = self._victim(index)
                self._preempt(victim, plan)
                if victim is request:
                    break
                slots = self.blocks.append_slots(request.tables, request.num_computed, count, tokens)
            if slots is not None:
                plan.chunks.append(ScheduledChunk(request, count, slots))
                budget -= count
                index += 1
        if not plan.preempted:
            budget = self._admit(plan, budget)
        if drafts:
            self._extend(plan, drafts, budget)
        plan.chunks.sort(key=lambda chunk: chunk.num_tokens != 1)
        return plan

    def _extend(self, plan: StepPlan, drafts: dict[int, list[int]], budget: int) -> None:
        """Add each decoding chunk's draft, as far as ``budget`` and free blocks go."""
        for chunk in plan.chunks:
            request = chunk.request
            draft = drafts.get(request.request_id, [])[:budget]
            if not draft or chunk.num_tokens != 1 or not chunk.completes:
                continue
            start = request.num_computed + 1
            slots = self.blocks.append_slots(request.tables, start, len(draft), lambda: request.token_ids)
            if slots is None:
                continue
            chunk.draft, chunk.num_tokens = draft, 1 + len(draft)
            chunk.slots = [mine + more for mine, more in zip(chunk.slots, slots)]
            budget -= len(draft)

    def _victim(self, index: int) -> Request:
        """The lowest-ranked running request below ``running[index]`` that may be preempted, else that one."""
        for victim in reversed(self.running[index + 1 :]):
            if victim.num_preemptions < MAX_PREEMPTIONS:
                return victim
        return self.running[index]

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        self.touch(victim)
        plan.preempted.append((victim, [dataclasses.replace(seq) for seq in victim.tables]))  # keep the tables
        self.blocks.free(victim.tables)
        self.running.remove(victim)
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.waiting.append(victim)
        self.num_preemptions += 1

    def _admit(self, plan: StepPlan, budget: int) -> int:
        """Admit waiting requests in policy order while budget, sequences and blocks last; the budget left."""
        self.waiting.sort(key=self.policy.key)
        passed_over: list[Request] = []
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            chunk = self._admit_one(request, budget, plan)
            if chunk is None:
                passed_over.append(request)
                if request.num_bypassed >= MAX_BYPASSES:
                    break
                continue
            budget -= chunk.num_tokens
            for waiting in passed_over:
                self.touch(waiting)
                waiting.num_bypassed += 1
        return budget

    def _admit_one(self, request: Request, budget: int, plan: StepPlan) -> Optional[ScheduledChunk]:
        """Admit ``request`` with a chunk of at most ``budget`` tokens if its blocks fit; None if not."""
        size, tables, tokens = self.blocks.block_size, request.tables, request.token_ids
        if request.swap_handle is not None:  # its kept K/V go to new blocks, then the chunk
            start, found = request.num_computed, [[] for _ in tables]
        else:
            found = self.blocks.cached_prefix(tables, tokens)
            start = len(found[0]) * size
        count = min(len(tokens) - start, budget)
        needed = self.blocks.blocks_to_start(tables, found, start, count)
        prefix = [b for blocks in found for b in blocks if b]
        free = self.blocks.free_besides(prefix)
        if needed > free and not self._make_room(request, needed - free, prefix, plan):
            return None
        self.touch(request)
        self.waiting.remove(request)
        self.running.append(request)
        plan.admitted.append(request)
        request.status = Status.RUNNING
        if request.swap_handle is not None:
            self.blocks.restore_slots(tables, start)
            plan.swapped_in.append(request)
        else:
            hit = self.blocks.allocate_prefix(tables, tokens, found)
            from_disk = self._load_from_disk(request, budget, plan)
            request.num_computed = start = hit + from_disk
            request.draft_start = 0  # a prefix from the cache or the disk may lack a draft model's K/V
            count = min(len(tokens) - start, budget)
            request.num_cached_tokens = max(request.num_cached_tokens, start)
            request.num_disk_cached_tokens = max(request.num_disk_cached_tokens, from_disk)
            self.prefix_query_tokens += len(tokens)
            self.prefix_hit_tokens += hit
            self.disk_hit_tokens += from_disk
        slots = self.blocks.append_slots(tables, start, count, lambda: tokens)
        chunk = ScheduledChunk(request, count, slots)
        plan.chunks.append(chunk)
        return chunk

    def _make_room(self, request: Request, short: int, prefix: list[int], plan: StepPlan) -> bool:
        """Preempt running requests the policy lets ``request`` preempt, if that frees ``short`` blocks."""
        preempts = getattr(self.policy, "preempts", None)
        if preempts is None:
            return False
        victims, freed = [], 0
        for victim in sorted(self.running, key=self.policy.key, reverse=True):
            if freed >= short:
                break
            if victim.num_preemptions < MAX_PREEMPTIONS and victim not in plan.admitted and preempts(request, victim):
                victims.append(victim)
                freed += self.blocks.freed_by(victim.tables, prefix)
        if freed < short:
            return False
        for victim in victims:
            plan.chunks = [c for c in plan.chunks if c.request is not victim]
            self._preempt(victim, plan)
        return True

    def _load_from_disk(self, request: Request, budget: int, plan: StepPlan) -> int:
        """Continue the request's cached prefix with full blocks from the disk tier; returns their tokens.

        As for the memory cache, the last prompt token is always left to
        compute. Blocks are asked for only as far as the request still fits
        with them. They enter the prefix cache now; the engine writes their K/V
        before the forward pass.
        """
        if self.load_prefix is None:
            return 0
        size, seq, tokens = self.blocks.block_size, request.blocks, request.token_ids
        start = len(seq.table) * size
        starts = []
        for block_start in range(start, len(tokens) - size, size):
            count = min(len(tokens) - block_start - size, budget)
            if -(-(block_start + size + count) // size) - len(seq.table) > self.blocks.num_free_blocks:
                break
            starts.append(block_start)
        if not starts:
            return 0
        parent = seq.hashes[len(seq.table) - 1] if seq.table else None
        found = self.load_prefix(parent, [tokens[s : s + size] for s in starts])
        loaded = 0
        for block_start, data in zip(starts, found):
            block_id = self.blocks.append_cached_block(request.tables, tokens[: block_start + size])
            if block_id is None:
                break
            plan.disk_loads.append((block_id, data))
            loaded += size
        return loaded
