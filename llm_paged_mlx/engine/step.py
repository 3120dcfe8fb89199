"""A step's life in the engine: planned, prepared and built as one transaction, launched on the device, its
tokens read and handed to their requests; and run-ahead, where the next decode step is built (or launched)
on a step's tokens before they are read. With a ``Speculator``, decoding requests' chunks carry drafts: a step
verifies them, and what it rejects is given back (``engine.speculative``).

A step is a transaction: an exception before its launch (from a policy, a kernel, the model, or Ctrl-C while
waiting for the device) undoes it all: requests, blocks, counters and K/V pools are as if it had never been
scheduled. A launched step that fails raises ``LaunchedStepFailed``: no K/V it wrote is trusted, and
``start_over`` computes every request again from its tokens.
"""

from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx

from ..parallel.collectives import rank_zero_tokens
from . import speculative
from .disk.format import device, host
from .drafter import Drafter, SharedBlocks
from .output import TokenLogprob
from .request import Request
from .runner import ModelRunner
from .sampler import StepLogprobs, logprobs, sample
from .scheduler import ScheduledChunk, StepPlan
from .swap import discard


@dataclass
class BuiltStep:
    """A step built (lazy arrays): its chunks, who it samples (by row: a drafted chunk samples a row for each
    of its positions, ``ahead`` counting them), who it fills a block for, its logits until they are sampled,
    the sampled tokens and log-probabilities, and the drafts it verifies (by their chunk's first row)."""

    chunks: list[ScheduledChunk]
    sampled: list[Request]
    filled: list[Request]
    logits: Optional[mx.array]
    tokens: Optional[mx.array] = None
    logprobs: Optional[StepLogprobs] = None
    ahead: list[int] = field(default_factory=list)
    drafts: dict[int, list[int]] = field(default_factory=dict)
    draft_tokens: Optional[mx.array] = None  # a draft model's drafts, on the device until ``take_drafts``

    def take_drafts(self) -> None:
        """Read a draft model's drafts (as the step ran) into ``drafts``."""
        values = iter(self.draft_tokens.tolist())
        for first, draft in self.drafts.items():
            self.drafts[first] = [next(values) for _ in draft]
        self.draft_tokens = None

    @property
    def constrained(self) -> bool:
        """Whether a request it samples has a grammar (its mask follows the tokens before this step)."""
        return any(r.grammar is not None for r in self.sampled)

    def outputs(self) -> list[mx.array]:
        """The arrays the host reads once the step has run."""
        if not self.sampled:
            return []
        extra = self.logprobs and [self.logprobs.sampled, self.logprobs.top_ids, self.logprobs.top_values]
        drafts = [self.draft_tokens] if self.draft_tokens is not None else []
        return [self.tokens, *drafts, *(a for a in extra or [] if a is not None)]


class LaunchedStepFailed(Exception):
    """A launched step failed: on the device, or in making its masks (the error is its ``__cause__``)."""


@dataclass
class SwapHandles:
    """Swap handles a step made (released if it is undone) and used up (released once it commits), and
    requests whose handle failed to swap in (if the step is undone, they are computed again instead)."""

    created: list = field(default_factory=list)
    consumed: list = field(default_factory=list)
    unreadable: list[Request] = field(default_factory=list)


class StepPipeline:
    """The engine's steps in flight: at most one launched and not read (``in_flight``), and before it one
    whose reading was interrupted after the step built on it was launched (``unread``).

    ``deliver(request, token, token_logprob)`` hands a read token to its request (the engine's stop rules
    and outputs); ``interrupts`` (``HeldInterrupts``) lets Ctrl-C through while waiting for the device.
    """

    def __init__(self, blocks, scheduler, runner, swap, grammars, group, interrupts, deliver: Callable,
                 speculator: Optional[speculative.Speculator] = None,
                 draft_runner: Optional[ModelRunner] = None):  # fmt: skip
        """``speculator`` drafts, filled in by a draft model's runner when given (``engine.drafter``)."""
        self.blocks = blocks
        self.scheduler = scheduler
        self.runner = runner
        self.swap = swap
        self.grammars = grammars
        self.group = group
        self.interrupts = interrupts
        self.deliver = deliver
        self.speculator = speculator
        self.drafter = Drafter(draft_runner, blocks) if draft_runner else None
        self.runners = [runner] + ([draft_runner] if draft_runner else [])  # every pool the block ids index
        self.swapped = SharedBlocks(runner.kv, draft_runner.kv) if draft_runner else runner.kv  # what a swap keeps
        self.in_flight: Optional[BuiltStep] = None  # a step launched on the device, its tokens not yet read
        self.unread: Optional[BuiltStep] = None  # a step before in_flight, not read yet (see _launch_ahead)
        self._overwritten_cached: list[int] = []  # cached free blocks the open transaction writes over

    def start_over(self) -> None:
        """After a launched step failed, compute every request again from its tokens.

        What that step, and any built on it, wrote to the pools is unknown: so no
        block is kept, the prefix cache is emptied and the pools are made anew.
        Copies kept by the swap policy and the disk tier came from steps that
        ended, and stay.
        """
        self.in_flight = self.unread = None
        self.scheduler.start_over()
        self.blocks.forget_cached()
        for runner in self.runners:
            runner.kv.reset()

    def transaction(self, work: Callable[[SwapHandles], Optional[BuiltStep]]) -> Optional[BuiltStep]:
        """Run ``work`` so that an exception undoes all it did; on success, count its chunks as computed.

        ``work`` plans and builds a step, listing the swap handles it creates
        and consumes: an undone step releases the ones it created, a committed
        one the ones it consumed.
        """
        handles = SwapHandles()
        self._overwritten_cached = []
        self.scheduler.begin()
        for runner in self.runners:
            runner.kv.begin()
        try:
            built = work(handles)
        except BaseException:
            for runner in self.runners:
                runner.kv.rollback()
            self.scheduler.rollback()
            self.blocks.uncache(self._overwritten_cached)
            for handle in handles.created:
                discard(self.swap, handle)
            for request in handles.unreadable:  # a damaged swap file must not fail every later step
                discard(self.swap, request.swap_handle)
                request.swap_handle, request.saved_state, request.num_computed = None, None, 0
            raise
        for runner in self.runners:
            runner.kv.commit()
        self.scheduler.commit()
        if built is not None:
            for chunk in built.chunks:  # whatever runs later on the device sees these tokens' K/V
                chunk.request.num_computed += chunk.num_tokens
        for handle in handles.consumed:
            discard(self.swap, handle)
        return built

    def plan(self, handles: SwapHandles) -> Optional[BuiltStep]:
        """The next step scheduled, its writes protected, its swaps, copies and disk loads done, and built
        (``transaction``'s work); None when nothing is scheduled."""
        drafts = self.speculator.propose(self.scheduler.running) if self.speculator else None
        plan = self.scheduler.schedule(drafts)
        if drafts:
            self.speculator.unscheduled(drafts, plan.chunks)
        self._protect(plan)
        self._prepare(plan, handles)
        return self._build(plan.chunks) if plan.chunks else None

    def _protect(self, plan: StepPlan) -> None:
        """Before a step writes: have the runner keep the K/V it overwrites in blocks a sequence held at its
        start, and note the cached free blocks it overwrites (an undone step takes them out of the cache)."""
        size = self.blocks.block_size
        written = list({slot // size for chunk in plan.chunks for slots in chunk.slots for slot in slots})
        written += self.blocks.copies_to_make()
        written += [block_id for block_id, _ in plan.disk_loads]
        for request in plan.swapped_in:
            written += self.blocks.live_blocks(request.tables, request.num_computed)
        held, cached = self.blocks.held_before(written)
        for runner in self.runners:
            runner.kv.protect(held)
        self._overwritten_cached += cached

    def _prepare(self, plan: StepPlan, handles: SwapHandles) -> None:
        """Before the forward pass: swap preempted requests out and resumed ones in, copy, load from disk."""
        for request, old_tables in plan.preempted:
            kept = self.blocks.live_blocks(old_tables, request.num_computed)
            handle = self.swap.swap_out(kept, self.swapped)
            if handle is None:
                request.num_computed = 0
            else:
                handles.created.append(handle)
            request.swap_handle = handle
            if self.runner.kv.states:  # the recurrent state goes with the K/V (or is computed again with them)
                request.saved_state = self._save_state(request) if handle is not None else None
                self.runner.kv.states.release(request.request_id)
        self._copy_blocks()
        for request in plan.swapped_in:
            blocks = self.blocks.live_blocks(request.tables, request.num_computed)
            try:
                self.swap.swap_in(request.swap_handle, blocks, self.swapped)
            except Exception:
                handles.unreadable.append(request)
                raise
            handles.consumed.append(request.swap_handle)
            request.swap_handle = None
            if self.runner.kv.states:
                self.runner.kv.states.write(request.request_id, [device(a, dtype) for a, dtype in request.saved_state])
                request.saved_state = None
        if plan.disk_loads:  # blocks found in the disk tier: their K/V go in before the forward pass
            arrays = zip(*(data for _, data in plan.disk_loads))
            self.runner.kv.write_blocks([block_id for block_id, _ in plan.disk_loads], [mx.concatenate(a) for a in arrays])

    def _build(self, chunks: list[ScheduledChunk], input_tokens: Optional[mx.array] = None) -> BuiltStep:
        """Build a forward pass and, unless it is constrained, its sampling (lazy arrays: ``launch`` starts
        them)."""
        draft_tokens = None
        if self.drafter is not None:
            for chunk in chunks:  # the drafter moves their draft_start
                self.scheduler.touch(chunk.request)
            input_tokens, draft_tokens = self.drafter.run(chunks, input_tokens)
        logits = self.runner.forward(chunks, input_tokens)
        size = self.blocks.block_size
        filled = [c.request for c in chunks if (c.request.num_computed % size) + c.num_tokens >= size]
        built = BuiltStep(chunks, [], filled, logits, draft_tokens=draft_tokens)
        for chunk in chunks:
            sampled = chunk.num_sampled  # none unless the chunk completes its request
            if chunk.draft and sampled:
                built.drafts[len(built.sampled)] = chunk.draft
            built.sampled += [chunk.request] * sampled
            built.ahead += range(sampled)
        if built.sampled and not built.constrained:
            self._sample(built)
        return built

    def _sample(self, step: BuiltStep, allowed: Optional[mx.array] = None) -> None:
        step.tokens = sample(step.logits, step.sampled, allowed, step.ahead if step.drafts else None)
        if self.group is not None:
            step.tokens = rank_zero_tokens(step.tokens, self.group)
        step.logprobs = logprobs(step.logits, step.tokens, step.sampled)
        step.logits = None

    def launch(self, step: BuiltStep) -> None:
        """Start a built step on the device; nothing waits for it.

        A constrained step's masks follow the tokens ``apply`` has just given
        its requests: another thread makes them while this one launches the
        forward pass (launching takes the host as long as a small model's pass
        takes the GPU), then its sampling is launched.
        """
        self.in_flight = step
        try:
            if self.drafter is not None:  # its pools' writes, which no output of the step holds
                self.drafter.runner.launch()
            if not step.constrained:
                self.runner.launch(*step.outputs(), decode=all(c.num_tokens == 1 for c in step.chunks))
                return
            grammars = self._row_matchers(step)
            bitmask = self.grammars.bitmask_meanwhile(grammars)
            try:
                self.runner.launch(step.logits)
            finally:
                futures.wait([bitmask])  # no later step touches the matchers while they make masks
            self._sample(step, self.grammars.allowed(bitmask.result(), grammars, step.logits.shape[-1]))
            mx.async_eval(*step.outputs())
        except BaseException as e:  # Ctrl-C too: a step launched in part is not one to wait for
            raise LaunchedStepFailed() from e

    @staticmethod
    def _row_matchers(step: BuiltStep) -> list:
        """Each sampled row's grammar matcher (None: free, or finished while the step was built): its
        request's, or for a drafted position a copy advanced past the drafted tokens before it."""
        matchers = []
        for request, ahead in zip(step.sampled, step.ahead):
            matcher = None if request.finished else request.grammar
            if matcher is not None and ahead:
                matcher = matcher.deep_copy()
                matcher.consume_tokens(step.drafts[len(matchers) - ahead][:ahead])
            matchers.append(matcher)
        return matchers

    def wait(self, launched: BuiltStep, synchronize: bool = True) -> tuple[list[int], dict[int, TokenLogprob]]:
        """Wait for a launched step to end; its sampled tokens, and their log-probabilities by row for the
        requests that asked for them. Nothing changes if it is interrupted.

        A GPU backend holds a step's input buffers until its completion handler
        runs, shortly after the step ends; a pool still held then would make the
        next step's scatter writes copy it. Synchronizing waits for the handler
        too, and for any step launched after this one: without ``synchronize``,
        only this step's outputs are waited for.
        """
        with self.interrupts.allowed():
            try:
                if synchronize:
                    mx.synchronize()
                tokens = launched.tokens.tolist() if launched.sampled else []
                token_logprobs = self._read_logprobs(launched, tokens)
                if launched.draft_tokens is not None:
                    launched.take_drafts()
                return tokens, token_logprobs
            except Exception as e:
                raise LaunchedStepFailed() from e

    @staticmethod
    def _read_logprobs(launched: BuiltStep, tokens: list[int]) -> dict[int, TokenLogprob]:
        step = launched.logprobs
        if step is None:
            return {}
        sampled = step.sampled.tolist()
        top_ids = step.top_ids.tolist() if step.top_ids is not None else [[]] * len(step.rows)
        top_values = step.top_values.tolist() if step.top_values is not None else [[]] * len(step.rows)
        read = {}
        for i, row in enumerate(step.rows):
            wanted = launched.sampled[row].params.logprobs
            top = sorted(zip(top_ids[i], top_values[i]), key=lambda pair: -pair[1])[:wanted]
            read[row] = TokenLogprob(tokens[row], sampled[i], top)
        return read

    def apply(self, launched: BuiltStep, tokens: list[int], token_logprobs: dict[int, TokenLogprob]) -> None:
        """Hand a finished step's tokens to their requests (``deliver``), cache the blocks it filled."""
        rejected, accepted = self._verify(launched, tokens) if launched.drafts else (set(), {})
        for request in launched.filled:
            if not request.finished:  # finished: aborted, or stopped while this step ran
                token_ids = request.token_ids + accepted.get(request.request_id, [])
                self.blocks.cache_full_blocks(request.tables, token_ids, request.num_computed)
        for row, (request, token) in enumerate(zip(launched.sampled, tokens)):
            if not request.finished and row not in rejected:
                self.deliver(request, token, token_logprobs.get(row))

    def _verify(self, launched: BuiltStep, tokens: list[int]) -> tuple[set[int], dict[int, list[int]]]:
        """Check each draft against the tokens sampled at its positions: the rows whose tokens are not taken,
        and each request's accepted draft tokens. The positions of rejected tokens are given back."""
        rejected, accepted = set(), {}
        for first, draft in launched.drafts.items():
            request = launched.sampled[first]
            taken = speculative.accepted(draft, tokens[first : first + len(draft) + 1])
            rejected.update(range(first + len(taken), first + len(draft) + 1))
            if request.finished:
                continue
            request.num_computed -= len(draft) + 1 - len(taken)  # the last taken token is computed next step
            self.blocks.truncate(request.tables, request.num_computed)
            accepted[request.request_id] = taken[:-1]
            self.speculator.record(request, len(draft), len(taken) - 1)
        return rejected, accepted

    def can_run_ahead(self, launched: BuiltStep) -> bool:
        """Whether the next step is surely one decode token for each request ``launched`` sampled.

        Then it can start before their tokens are read: no request waits, every
        running request was sampled and none reaches a length limit with this
        token, and blocks and budget cover one more token each (no preemption).
        """
        running, sampled = self.scheduler.running, launched.sampled
        if self.scheduler.waiting or not sampled or len(running) != len(sampled) or launched.drafts:
            return False
        if self.speculator is not None and self.speculator.active(running):  # its next drafts follow these tokens
            return False
        if len(sampled) > self.scheduler.max_num_batched_tokens or set(map(id, running)) != set(map(id, sampled)):
            return False
        for request in sampled:
            if len(request.output_token_ids) + 1 >= request.params.max_tokens:
                return False
            if request.num_tokens + 1 >= request.max_total_tokens:
                return False
        needed = sum(self.blocks.blocks_needed(r.tables, r.num_computed, 1) for r in sampled)
        return needed <= self.blocks.num_free_blocks

    def run_ahead(self, launched: BuiltStep) -> None:
        """Build the next decode step on the launched step's tokens (unread), read those, launch it.

        Reading before launching lets the launched step's graph go, so the next
        step's scatter writes the K/V pools in place; the host built it
        meanwhile. If the wait is interrupted, the step built ahead is undone
        and the next call reads the launched step again. Where the pools are
        written in place anyway, the step is launched first (``_launch_ahead``).
        """
        if self.runner.writes_in_place and not launched.constrained:
            self._launch_ahead(launched)
            return
        read: list[tuple] = []  # the launched step's tokens and log-probabilities, once waited for

        def plan_and_wait(handles: SwapHandles) -> BuiltStep:
            ahead = self._build_ahead(launched)
            read.append(self.wait(launched))
            return ahead

        ahead = self.transaction(plan_and_wait)
        self.in_flight = None
        self.apply(launched, *read[0])
        self.launch(ahead)

    def _launch_ahead(self, launched: BuiltStep) -> None:
        """Build the next decode step on the launched step's tokens, launch it, then read those tokens: the
        device has the next step queued before it ends the one it runs. (Constrained steps cannot: their
        masks follow the tokens read.) If the wait is interrupted, the next call reads the step first."""
        ahead = self.transaction(lambda handles: self._build_ahead(launched))
        self.launch(ahead)
        self.unread = launched
        self.read(launched)

    def finish(self, launched: BuiltStep) -> None:
        """Wait for the step in flight to end, and hand out its tokens."""
        read = self.wait(launched)
        self.in_flight = None
        self.apply(launched, *read)

    def read(self, launched: BuiltStep) -> None:
        """Wait for a step that another launched step follows, and hand out its tokens."""
        read = self.wait(launched, synchronize=False)
        self.unread = None
        self.apply(launched, *read)

    def _build_ahead(self, launched: BuiltStep) -> BuiltStep:
        """The next decode step, built on the launched step's tokens before they are read."""
        for request in launched.sampled:
            request.output_token_ids.append(-1)  # stands for the token being computed
        try:
            plan = self.scheduler.schedule()
            assert not plan.preempted and all(c.num_tokens == 1 for c in plan.chunks), "run-ahead needs plain decode"
            self._protect(plan)
            self._copy_blocks()
            index = {id(r): i for i, r in enumerate(launched.sampled)}
            rows = mx.array([index[id(c.request)] for c in plan.chunks], dtype=mx.int32)
            return self._build(plan.chunks, launched.tokens[rows].astype(mx.int32))
        finally:
            for request in launched.sampled:
                request.output_token_ids.pop()  # apply appends the real token (or stops)

    def _save_state(self, request: Request) -> list:
        """Host copies of a running request's recurrent state, for ``runner.kv.states.write``."""
        state = self.runner.kv.states.read(request.request_id)
        mx.eval(state)
        return [(host(a), a.dtype) for a in state]

    def _copy_blocks(self) -> None:
        copies = self.blocks.take_copies()
        if copies:
            for runner in self.runners:
                runner.kv.copy_blocks(copies)
