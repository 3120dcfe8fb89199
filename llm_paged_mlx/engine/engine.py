"""The engine: requests in, tokens out, one scheduled step at a time."""

import functools
import itertools
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import mlx.core as mx

from .. import plugins
from ..kernels import select_kernel
from ..models.paged_cache import check_model
from .block_manager import BlockManager
from .disk_cache import KVDiskCache
from .output import OutputText, RequestOutput, StreamChunk
from .request import Request, SamplingParams, Status
from .runner import ModelRunner, ScheduledChunk
from .sampler import sample
from .scheduler import Scheduler

Prompt = Union[str, Sequence[int]]
DEFAULT_KV_BUDGET = 2 * 1024**3


@dataclass
class _Launched:
    """A step running on the device: who it samples, their (lazy) tokens, who filled a block."""

    sampled: list[Request]
    tokens: Optional[mx.array]
    filled: list[Request]


class Engine:
    """A paged-KV engine over an unmodified mlx-lm model.

    The KV pool has ``num_blocks`` blocks of ``block_size`` tokens, or as many
    as fit in ``kv_budget_bytes`` (2 GiB when neither is given).
    ``tokenizer=None`` means prompts are token ids and outputs carry no text.
    ``kv_disk_cache`` adds a disk tier to the prefix cache: finished requests'
    full blocks are saved there and later prompts (in this or another process)
    read them back instead of computing them. ``compile_steps`` runs steps
    whose tokens are all single-query rows through ``mx.compile`` (see
    ``runner``); it needs the kernel to be ``compilable``. An engine is driven
    from one thread (MLX streams belong to the thread that made them).
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        block_size: int = 16,
        num_blocks: Optional[int] = None,
        kv_budget_bytes: Optional[int] = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        scheduler: str = "fcfs",
        attention_kernel: str = "auto",
        enable_prefix_caching: bool = True,
        swap_policy: str = "recompute",
        kv_disk_cache: Optional[KVDiskCache] = None,
        compile_steps: bool = True,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        policy = plugins.lookup("scheduler", plugins.schedulers(), scheduler)()
        self.swap = plugins.lookup("swap policy", plugins.swap_policies(), swap_policy)()
        self.kernel = select_kernel(attention_kernel)
        layouts = check_model(model)
        block_bytes = block_size * sum(layout.bytes_per_token for layout in layouts)
        if num_blocks is None:
            num_blocks = (kv_budget_bytes or DEFAULT_KV_BUDGET) // block_bytes
        if num_blocks < 2:
            raise ValueError(f"a KV budget of {kv_budget_bytes} bytes holds fewer than 2 blocks of {block_bytes} bytes")
        if kv_disk_cache is not None and not enable_prefix_caching:
            raise ValueError("kv_disk_cache needs enable_prefix_caching")
        self.model = model
        self.tokenizer = tokenizer
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.runner = ModelRunner(model, layouts, num_blocks, block_size, self.kernel, compile_steps)
        self.disk = kv_disk_cache
        load_blocks = None
        if kv_disk_cache is not None:  # the shape and dtype of each array of one block, K and V per layer
            layout = [((l.num_kv_heads * block_size, dim), l.dtype) for l in layouts for dim in (l.k_dim, l.v_dim)]
            load_blocks = functools.partial(kv_disk_cache.load_chain, layout=layout)
        self.scheduler = Scheduler(self.blocks, policy, max_num_seqs, max_num_batched_tokens, load_blocks)
        self.max_context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
        self.eos_token_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.requests: dict[int, Request] = {}
        self.texts: dict[int, OutputText] = {}
        self.outbox: dict[int, list[StreamChunk]] = {}  # chunks waiting for stream()/generate() consumers
        self._in_flight: Optional[_Launched] = None  # a step launched on the device, its tokens not yet read
        self._ready: list[StreamChunk] = []  # chunks read, not yet returned by step()
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(cls, path_or_repo: str, **options) -> "Engine":
        """Load a local folder or Hugging Face repo with ``models.loading.load_model``."""
        from ..models.loading import load_model

        model, tokenizer = load_model(path_or_repo)
        return cls(model, tokenizer, **options)

    # -- requests ---------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None) -> int:
        """Queue a prompt; returns its request id. Raises ValueError on bad input."""
        params = params or SamplingParams()
        token_ids = self._encode(prompt)
        capacity = self.blocks.num_usable_blocks * self.blocks.block_size
        limit = min(capacity, self.max_context or capacity)
        if len(token_ids) >= limit:
            where = "the model's context" if limit != capacity else "the whole KV pool"
            raise ValueError(f"prompt of {len(token_ids)} tokens does not fit {where} ({limit} tokens)")
        stops = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else self.eos_token_ids)
        request = Request(next(self._ids), token_ids, params, max_total_tokens=limit, stop_token_ids=frozenset(stops))
        self.requests[request.request_id] = request
        if self.tokenizer is not None:
            self.texts[request.request_id] = OutputText(self.tokenizer, params.stop)
        self.scheduler.add(request)
        return request.request_id

    def abort(self, request_id: int) -> Optional[StreamChunk]:
        """Stop a request and free its blocks; returns its last chunk, or None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        return self._finish(request, "abort", [])

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step -------------------------------------------------------------

    def step(self) -> list[StreamChunk]:
        """Launch one scheduled forward pass; returns what the previous call's pass gave each request.

        The device runs a step while the host returns and prepares the next:
        a step's tokens are read by the following call, which in steady decoding
        launches its own step first, feeding it those tokens unread. Call it
        while ``has_unfinished()``. Chunks of requests that ``stream`` or
        ``generate`` consume are also kept for them, so any number of those can
        share the engine's steps. If building a step fails or waiting for one
        is interrupted, the error is raised with the engine's books intact; what
        was read before it comes with the next call.
        """
        self._step()
        chunks, self._ready = self._ready, []
        for chunk in chunks:
            if chunk.request_id in self.outbox:
                self.outbox[chunk.request_id].append(chunk)
        return chunks

    def _step(self) -> None:
        launched = self._in_flight
        if launched is not None:
            if self._can_run_ahead(launched):  # the next step is built before this one is read
                self._in_flight = self._run_ahead(launched)
                return
            self._read(launched)
            self._in_flight = None
        plan = self.scheduler.schedule()
        for request, old_blocks in plan.preempted:
            kept = old_blocks[: self._blocks_for(request.num_computed)]
            request.swap_handle = self.swap.swap_out(kept, self.runner)
            if request.swap_handle is None:
                request.num_computed = 0
        self._copy_blocks()
        for request in plan.swapped_in:
            table = self.blocks.block_table(request.request_id)
            self.swap.swap_in(request.swap_handle, table[: self._blocks_for(request.num_computed)], self.runner)
            request.swap_handle = None
        if plan.disk_loads:  # blocks found in the disk tier: their K/V go in before the forward pass
            arrays = zip(*(data for _, data in plan.disk_loads))
            self.runner.write_blocks([block_id for block_id, _ in plan.disk_loads], [mx.concatenate(a) for a in arrays])
        if plan.chunks:
            self._in_flight = self._build(plan.chunks)
            self._launch(self._in_flight)

    def _build(self, chunks: list[ScheduledChunk], input_tokens: Optional[mx.array] = None) -> "_Launched":
        """Build a forward pass and its sampling (lazy arrays: ``_launch`` starts them).

        The chunks' tokens count as computed from here on: whatever runs later
        on the device sees their K/V. If building fails, the requests give back
        the slots scheduled for the chunks and the engine carries on without the step.
        """
        tables = {c.request.request_id: self.blocks.block_table(c.request.request_id) for c in chunks}
        sampled = [c.request for c in chunks if c.completes]
        try:
            logits = self.runner.forward(chunks, tables, input_tokens)
            tokens = sample(logits, sampled) if sampled else None
        except BaseException:  # the step never runs: its requests give back the slots it took
            self._give_back_slots(chunks)
            raise
        filled = []  # requests whose chunk fills a block: cached when the tokens are read
        for chunk in chunks:
            request, before = chunk.request, chunk.request.num_computed
            request.num_computed += chunk.num_tokens
            if request.num_computed // self.blocks.block_size > before // self.blocks.block_size:
                filled.append(request)
        return _Launched(sampled, tokens, filled)

    def _launch(self, step: "_Launched") -> None:
        """Start a built step on the device; nothing waits for it."""
        self.runner.launch(*([step.tokens] if step.sampled else []))

    def _read(self, launched: "_Launched") -> None:
        """Wait for a launched step to end and hand its tokens to their requests (chunks to ``_ready``).

        A GPU backend holds a step's input buffers until its completion handler
        runs, shortly after the step ends; a pool still held then would make the
        next step's writes copy it. Synchronizing waits for the handler too.
        """
        mx.synchronize()
        tokens = launched.tokens.tolist() if launched.sampled else []
        for request in launched.filled:
            if not request.finished:  # finished: aborted, or stopped while this step ran
                self.blocks.cache_full_blocks(request.request_id, request.token_ids)
        self._ready += [self._append(r, t) for r, t in zip(launched.sampled, tokens) if not r.finished]

    def _can_run_ahead(self, launched: "_Launched") -> bool:
        """Whether the next step is surely one decode token for each request ``launched`` sampled.

        Then it can start before their tokens are read: no request waits, every
        running request was sampled and none reaches a length limit with this
        token, and blocks and budget cover one more token each (no preemption).
        """
        running, sampled = self.scheduler.running, launched.sampled
        if self.scheduler.waiting or not sampled or len(running) != len(sampled):
            return False
        if len(sampled) > self.scheduler.max_num_batched_tokens or set(map(id, running)) != set(map(id, sampled)):
            return False
        for request in sampled:
            if len(request.output_token_ids) + 1 >= request.params.max_tokens:
                return False
            if request.num_tokens + 1 >= request.max_total_tokens:
                return False
        needed = sum(self.blocks.blocks_needed(r.request_id, 1) for r in sampled)
        return needed <= self.blocks.num_free_blocks

    def _run_ahead(self, launched: "_Launched") -> "_Launched":
        """Build the next decode step on the launched step's tokens (unread), read those, launch it.

        Reading before launching lets the launched step's graph go, so the next
        step writes the K/V pools in place; the host built it meanwhile.
        """
        for request in launched.sampled:
            request.output_token_ids.append(-1)  # stands for the token being computed
        try:
            plan = self.scheduler.schedule()
            assert not plan.preempted and all(c.num_tokens == 1 for c in plan.chunks), "run-ahead needs plain decode"
            self._copy_blocks()
            index = {id(r): i for i, r in enumerate(launched.sampled)}
            rows = mx.array([index[id(c.request)] for c in plan.chunks], dtype=mx.int32)
            ahead = self._build(plan.chunks, launched.tokens[rows].astype(mx.int32))
        finally:
            for request in launched.sampled:
                request.output_token_ids.pop()  # _read appends the real token (or stops)
        try:
            self._read(launched)
        except BaseException:
            # Interrupted while waiting: the next call reads the launched step again. The step built
            # ahead is dropped; its K/V writes, already in the pools' lazy graph, are harmless.
            for chunk in plan.chunks:
                chunk.request.num_computed -= chunk.num_tokens
            self._give_back_slots(plan.chunks)
            raise
        self._launch(ahead)
        return ahead

    def _give_back_slots(self, chunks: list[ScheduledChunk]) -> None:
        """Return the slots scheduled for chunks that will not run."""
        for chunk in chunks:
            self.blocks.truncate(chunk.request.request_id, chunk.request.num_computed)

    def _copy_blocks(self) -> None:
        copies = self.blocks.take_copies()
        if copies:
            self.runner.copy_blocks(copies)

    def _append(self, request: Request, token: int) -> StreamChunk:
        p = request.params
        if token in request.stop_token_ids:
            return self._finish(request, "stop", [])
        request.output_token_ids.append(token)
        text = self.texts.get(request.request_id)
        if text is not None and text.add(token):
            return self._finish(request, "stop", [token])
        if len(request.output_token_ids) >= p.max_tokens or request.num_tokens >= request.max_total_tokens:
            return self._finish(request, "length", [token])
        return StreamChunk(request.request_id, [token], text.take(final=False) if text else None)

    def _finish(self, request: Request, reason: str, new_tokens: list[int]) -> StreamChunk:
        request.status, request.finish_reason = Status.FINISHED, reason
        if self.disk is not None and request.request_id in self.blocks.tables:  # keep its computed full blocks
            full = self.blocks.block_table(request.request_id)[: request.num_computed // self.blocks.block_size]
            self.disk.save(request.token_ids, full, self.blocks.block_size, self.runner.read_blocks)
        self.scheduler.remove(request)
        del self.requests[request.request_id]
        text = self.texts.pop(request.request_id, None)
        if text is not None:
            text.finish()
        new_text = text.take(final=True) if text else None
        return StreamChunk(
            request.request_id, new_tokens, new_text, reason, request.num_cached_tokens, request.num_disk_cached_tokens
        )

    # -- conveniences ---------------------------------------------------------

    def generate(
        self, prompts: Sequence[Prompt], params: Union[SamplingParams, Sequence[SamplingParams], None] = None
    ) -> list[RequestOutput]:
        """Run the prompts to completion, together with whatever else is queued."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        for prompt in prompts:
            self._encode(prompt)  # reject bad input before anything is queued
        outputs = {}
        for prompt, p in zip(prompts, params):
            rid = self.add_request(prompt, p)
            outputs[rid] = RequestOutput(rid, self.requests[rid].prompt_token_ids, text="" if self.tokenizer else None)
            self.outbox[rid] = []
        pending = set(outputs)
        try:
            while pending:
                self.step()
                for rid in list(pending):
                    for chunk in self.outbox[rid]:
                        self._fold(outputs[rid], chunk)
                        if chunk.finish_reason:
                            pending.discard(rid)
                    self.outbox[rid] = []
        finally:
            for rid in outputs:
                self.outbox.pop(rid, None)
                self.abort(rid)
        return list(outputs.values())

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None) -> Iterator[StreamChunk]:
        """Yield a request's chunks as they come; closing the iterator aborts the request."""
        rid = self.add_request(prompt, params)
        box = self.outbox[rid] = []
        try:
            while True:
                if not box:
                    self.step()
                    continue
                chunk = box.pop(0)
                if chunk.finish_reason:
                    self.outbox.pop(rid, None)
                yield chunk
                if chunk.finish_reason:
                    return
        finally:
            self.outbox.pop(rid, None)
            self.abort(rid)

    def stats(self) -> dict:
        used = self.blocks.num_usable_blocks - self.blocks.num_free_blocks
        return {
            "num_blocks": self.blocks.num_usable_blocks,
            "block_size": self.blocks.block_size,
            "free_blocks": self.blocks.num_free_blocks,
            "used_blocks": used,
            "cached_blocks": len(self.blocks.cached),
            "kv_cache_bytes": self.runner.kv_bytes,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": self.scheduler.prefix_hit_tokens,
            "disk_cache_hit_tokens": self.scheduler.disk_hit_tokens,
            "attention_kernel": self.kernel.name,
        }

    # -- helpers --------------------------------------------------------------

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.blocks.block_size)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or give the engine a tokenizer")
            bos = getattr(self.tokenizer, "bos_token", None)
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=not (bos and prompt.startswith(bos)))
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("empty prompt")
        vocab = getattr(getattr(self.model, "args", None), "vocab_size", None)
        if vocab and not all(0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        return token_ids

    @staticmethod
    def _fold(output: RequestOutput, chunk: StreamChunk) -> None:
        output.token_ids += chunk.token_ids
        if chunk.text is not None:
            output.text += chunk.text
        output.finish_reason = chunk.finish_reason
        output.num_cached_tokens = chunk.num_cached_tokens
        output.num_disk_cached_tokens = chunk.num_disk_cached_tokens
