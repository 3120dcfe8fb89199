"""The engine: requests in, tokens out, one scheduled step at a time."""

import functools
import itertools
import warnings
from typing import Iterator, Optional, Sequence, Union

import mlx.core as mx

from .. import plugins
from ..errors import one_line
from ..kernels import select_kernel
from ..models.adapt import adapt_model, check_model
from ..parallel.collectives import check_same_config, shard_model
from .block_manager import BlockManager
from .checks import check_group, check_kernel, check_speculation
from .config import EngineConfig
from .disk.store import KVDiskCache, KVDiskCacheWarning
from .grammar import Grammars
from .interrupts import HeldInterrupts
from .kv_coordinator import KVCoordinator
from .memory import format_size
from .model_check import check_against_mlx_lm
from .output import OutputText, RequestOutput, StreamChunk, TokenLogprob, joined, take_token
from .request import Request, SamplingParams, Status
from .runner import ModelRunner, attention_groups
from .scheduler import Scheduler
from .sizing import size_pools
from .step import LaunchedStepFailed, StepPipeline
from .swap import discard

Prompt = Union[str, Sequence[int]]


class Engine:
    """A paged-KV engine over an unmodified mlx-lm model, built with an ``EngineConfig`` (or its fields as
    keyword arguments).

    ``tokenizer=None`` means prompts are token ids and outputs carry no text.
    ``kv_disk_cache`` (``engine.disk``) adds a disk tier to the prefix cache:
    finished requests' full blocks are saved there and later prompts (in this or
    another process) read them back instead of computing them. ``verdict_file``
    keeps the verdicts of the model check and of the kernels' self-checks across
    processes. An engine is driven from one thread (MLX streams belong to the
    thread that made them). It adapts the model in place, with the same results
    for mlx-lm (``models.adapt.adapt_model``).

    Models with recurrent layers (hybrids such as Qwen3.5) keep each running
    sequence's state beside its blocks (``models.state_cache``), counted in the
    budget; a preempted sequence's state is kept in host memory with its K/V, or
    computed again with them. Prefix caching and its disk tier are off for them
    (a state is not kept per block): ``stats()`` says so. Models with
    sliding-window layers keep a block table per group of layers
    (``engine.kv_groups``): a windowed group returns the blocks its window has
    passed. The disk tier is off for them (it keeps one table per prompt).

    ``tensor_parallel``, a group of processes from ``mx.distributed.init()``,
    shards the model over them with mlx-lm's ``Model.shard`` (see
    ``parallel.collectives``): every rank runs this same engine on the same
    requests in the same order (as one program launched with ``mlx.launch``),
    holds the K/V of its own heads, and gets rank 0's sampled tokens. The disk
    tier, the ``priority`` scheduler and swap policies that may decide
    differently on each rank are refused; ``swap_policy`` ``"auto"`` means
    ``"recompute"`` there, and an ``"auto"`` budget is the smallest rank's
    (divided among the ranks that share a machine's memory). A launched step
    that fails on a rank (a peer that died, say) leaves the ranks out of step:
    the engine raises that error at every later step, rather than compute
    again alone.

    ``draft_model`` (an mlx-lm model of the same vocabulary) drafts tokens that
    steps verify (``engine.drafter``), as ``speculative="ngram"`` does by prompt lookup.
    """

    def __init__(self, model, tokenizer=None, config: Optional[EngineConfig] = None, *,
                 kv_disk_cache: Optional[KVDiskCache] = None, verdict_file=None,
                 tensor_parallel: Optional[mx.distributed.Group] = None, draft_model=None, **options):  # fmt: skip
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, not a {type(config).__name__}")
        config = (config or EngineConfig()).replace(**options)
        self.group = tensor_parallel if tensor_parallel is not None and tensor_parallel.size() > 1 else None
        swap_policy = check_group(model, self.group, kv_disk_cache, config.scheduler, config.swap_policy)
        policy = plugins.lookup("scheduler", plugins.schedulers(), config.scheduler)()
        swap = plugins.lookup("swap policy", plugins.swap_policies(), swap_policy)()
        self.kernel = select_kernel(config.attention_kernel)
        self.kernel.verdict_file = verdict_file  # its self-checks are each rank's own, unlike the model check
        if config.kv_bits is not None and not self.kernel.quantized:
            raise ValueError(f"attention kernel {self.kernel.name!r} cannot read quantized K/V (kv_bits)")
        if kv_disk_cache is not None and not config.enable_prefix_caching:
            raise ValueError("kv_disk_cache needs enable_prefix_caching")
        if self.group is not None:
            verdict_file = None  # each rank checks the model, and so takes part in the check's collectives
            check_same_config(config, self.group)
            shard_model(model, self.group)
        self.spec = spec = check_model(model)
        groups = attention_groups(spec.attention)
        if spec.states:
            config = config.replace(enable_prefix_caching=False)
        if spec.states or groups.bounded:  # the disk tier keeps a finished request's blocks of one table
            kv_disk_cache = None
        check_kernel(self.kernel, spec)
        speculator, draft_spec = check_speculation(config, draft_model, spec, self.group)
        adapt_model(model)
        if draft_spec:
            adapt_model(draft_model)
        self.config, self.model, self.tokenizer, self.disk = config, model, tokenizer, kv_disk_cache
        self.pool = size_pools(model, spec, groups, config, self.group, draft_spec)
        initial = self.pool.initial_blocks
        manager = BlockManager(initial, config.block_size, enable_prefix_caching=config.enable_prefix_caching)
        self.blocks = KVCoordinator(manager, groups)
        self.runner = ModelRunner(model, spec, initial, self.kernel, config)
        draft_runner = ModelRunner(draft_model, draft_spec, initial, self.kernel,
                                   config.replace(kv_bits=None)) if draft_spec else None  # fmt: skip
        if config.verify_model:
            check_against_mlx_lm(model, self.runner, verdict_file)
        self._block_layout = self.runner.kv.block_layout()
        load_prefix = None
        if kv_disk_cache is not None:
            load_prefix = functools.partial(kv_disk_cache.load_chain, layout=self._block_layout)
        self.scheduler = Scheduler(self.blocks, policy, self.pool.max_num_seqs, config.max_num_batched_tokens,
                                   load_prefix)  # fmt: skip
        self.eos_token_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.grammars = Grammars(tokenizer) if tokenizer is not None else None
        self.requests: dict[int, Request] = {}
        self.texts: dict[int, OutputText] = {}
        self.outbox: dict[int, list[StreamChunk]] = {}  # chunks waiting for stream()/generate() consumers
        self._out_of_step: Optional[RuntimeError] = None  # a tensor-parallel rank whose launched step failed
        self._ready: list[StreamChunk] = []  # chunks read, not yet returned by step()
        self._ids = itertools.count()
        self._interrupts = HeldInterrupts()
        self.steps = StepPipeline(self.blocks, self.scheduler, self.runner, swap, self.grammars, self.group,
                                  self._interrupts, self._deliver, speculator, draft_runner)  # fmt: skip

    @classmethod
    def from_pretrained(cls, path_or_repo: str, **options) -> "Engine":
        """Load a local folder or Hugging Face repo with ``models.loading.load_model`` (with
        ``tensor_parallel``, the weights are read as they are sharded: each rank holds only its shard)."""
        from ..models.loading import load_model

        model, tokenizer = load_model(path_or_repo, lazy=options.get("tensor_parallel") is not None)
        if isinstance(options.get("draft_model"), str):  # a folder or repo too
            options["draft_model"], _ = load_model(options["draft_model"])
        config = options.pop("config", None) or EngineConfig()
        if config.kv_budget_bytes is None and config.num_blocks is None:
            config = config.replace(kv_budget_bytes="auto")
        return cls(model, tokenizer, config, **options)

    @property
    def swap(self):
        """The swap policy: what happens to a preempted request's K/V (its steps' own)."""
        return self.steps.swap

    @swap.setter
    def swap(self, policy) -> None:
        self.steps.swap = policy

    @property
    def max_context(self) -> Optional[int]:
        """The model's context length (its ``max_position_embeddings``), if it says."""
        return self.spec.max_context

    @property
    def max_blocks(self) -> int:
        """The pools' blocks at the budget, the null block included."""
        return self.pool.max_blocks

    @property
    def kv_budget_bytes(self) -> int:
        """The budget the pools and recurrent state take at most."""
        return self.pool.budget_bytes

    # -- requests ---------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None) -> int:
        """Queue a prompt; returns its request id. Raises ValueError on bad input."""
        with self._interrupts.held():
            return self._add(prompt, params or SamplingParams())

    def _add(self, prompt: Prompt, params: SamplingParams) -> int:
        token_ids = self._encode(prompt)
        chunk = self.scheduler.max_num_batched_tokens
        capacity = self.runner.groups.max_tokens(self.max_blocks - 1, self.blocks.block_size, chunk)
        limit = min(capacity, self.max_context or capacity)
        if len(token_ids) >= limit and limit != capacity:
            raise ValueError(f"prompt of {len(token_ids)} tokens does not fit the model's context ({limit} tokens)")
        if len(token_ids) >= limit:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens does not fit the KV cache: its budget of "
                f"{format_size(self.max_blocks * self.pool.block_bytes)} holds at most "
                f"{limit - 1} prompt tokens; raise the budget (kv_budget_bytes; llm: -o kv_budget) or store K/V "
                "in fewer bits (kv_bits)"
            )
        stops = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else self.eos_token_ids)
        request = Request(next(self._ids), token_ids, params, max_total_tokens=limit, stop_token_ids=frozenset(stops))
        if params.json_schema is not None:
            if self.grammars is None:
                raise ValueError("json_schema needs the model's tokenizer: this engine has none")
            request.grammar = self.grammars.matcher(params.json_schema)
        self.requests[request.request_id] = request
        if self.tokenizer is not None:
            after = token_ids[-1] if params.continues_prompt and token_ids else None
            self.texts[request.request_id] = OutputText(self.tokenizer, params.stop, after)
        self.scheduler.add(request)
        return request.request_id

    def abort(self, request_id: int) -> Optional[StreamChunk]:
        """Stop a request and free its blocks; returns its last chunk, or None if unknown.

        The last chunk also carries what was read for the request and not yet
        returned by ``step`` (after a step that raised), so nothing of it comes later.
        """
        with self._interrupts.held():
            return self._abort(request_id)

    def _abort(self, request_id: int) -> Optional[StreamChunk]:
        request = self.requests.get(request_id)
        if request is None:
            return None
        unreturned = [c for c in self._ready if c.request_id == request_id]
        self._ready = [c for c in self._ready if c.request_id != request_id]
        return joined(unreturned, self._finish(request, "abort", []))

    def has_unfinished(self) -> bool:
        """Whether a request is unfinished or a chunk is yet to be returned (after a step that raised)."""
        return bool(self.requests or self._ready)

    # -- the step -------------------------------------------------------------

    def step(self) -> list[StreamChunk]:
        """Launch one scheduled forward pass; returns what the previous call's pass gave each request.

        The device runs a step while the host returns and prepares the next:
        a step's tokens are read by the following call, which in steady decoding
        launches its own step first, feeding it those tokens unread. Call it
        while ``has_unfinished()``. Chunks of requests that ``stream`` or
        ``generate`` consume are also kept for them, so any number of those can
        share the engine's steps.

        A step is a transaction: it is planned, prepared (swaps, copies, disk
        loads) and built before it is launched, and an exception before the
        launch (from a policy, a kernel, the model, or Ctrl-C while waiting for
        the device) undoes it all: requests, blocks, counters and K/V pools are
        as if it had never been scheduled, and the exception reaches the caller.
        Ctrl-C elsewhere is held until the step is whole. If a launched step
        fails (on the device, or in making the masks of constrained requests
        while it runs), no K/V is trusted any more: every request is computed
        again from its tokens, and the error reaches the caller. What
        was read before an error comes with the next call.
        """
        with self._interrupts.held():
            self._step()
        chunks, self._ready = self._ready, []
        return chunks

    def _step(self) -> None:
        if self._out_of_step is not None:
            raise self._out_of_step
        steps = self.steps
        try:
            if steps.unread is not None:  # reading it was interrupted, after the step built on it was launched
                steps.read(steps.unread)
            launched = steps.in_flight
            if launched is not None:
                if steps.can_run_ahead(launched):  # the next step is built before this one is read
                    steps.run_ahead(launched)
                    return
                steps.finish(launched)
            self._grow_pool()
            built = steps.transaction(steps.plan)
            if built is not None:
                steps.launch(built)
        except LaunchedStepFailed as failure:
            if self.group is not None:  # the other ranks went on with that step: this one cannot redo it alone
                self._out_of_step = RuntimeError(
                    f"a step of this tensor-parallel engine failed ({one_line(failure.__cause__)}); its ranks are "
                    "out of step, so it takes no more"
                )
                raise self._out_of_step from failure.__cause__
            steps.start_over()
            raise failure.__cause__

    def _grow_pool(self) -> None:
        """Grow the pools (at least doubling, up to the budget) if the next step might lack free blocks: a
        step's new tokens, each running sequence's next block, and the whole prompts of waiting requests (the
        disk tier may give their prefixes at once). Nothing is in flight: old arrays go as they are copied."""
        blocks = self.blocks
        if blocks.num_blocks >= self.max_blocks:
            return
        size, groups = blocks.block_size, self.runner.groups
        waiting = sum(groups.blocks_for(r.num_tokens, size) for r in self.scheduler.waiting)
        size = self.pool.grown(blocks.num_blocks, self.pool.step_blocks + waiting - blocks.num_free_blocks)
        if size > blocks.num_blocks:
            for runner in self.steps.runners:
                runner.grow(size)
            blocks.grow(size)

    def _deliver(self, request: Request, token: int, token_logprob: Optional[TokenLogprob]) -> None:
        """A step's token for ``request``: its chunk to return from ``step`` (and to ``stream`` and
        ``generate``, which read the outbox)."""
        chunk = self._append(request, token)
        if chunk.token_ids and token_logprob is not None:
            chunk.logprobs = [token_logprob]
        self._ready.append(chunk)
        if chunk.request_id in self.outbox:  # kept for stream() and generate() as it is read
            self.outbox[chunk.request_id].append(chunk)

    def _append(self, request: Request, token: int) -> StreamChunk:
        text = self.texts.get(request.request_id)
        reason, new_tokens = take_token(request, token, text)
        if reason is not None:
            return self._finish(request, reason, new_tokens)
        return StreamChunk(request.request_id, new_tokens, text.take(final=False) if text else None)

    def _finish(self, request: Request, reason: str, new_tokens: list[int]) -> StreamChunk:
        request.status, request.finish_reason = Status.FINISHED, reason
        if self.disk is not None and request.blocks.table:  # keep its full blocks whose K/V are computed
            tokens, size = request.token_ids, self.blocks.block_size
            full = min(len(tokens), request.num_computed) // size
            try:
                names = [name for name, _, _ in self._block_layout]
                self.disk.save(tokens, request.blocks.table[:full], size, self.runner.kv.read_blocks, names)
            except Exception as e:  # the disk tier is a cache: losing a save loses no data
                warnings.warn(f"KV disk cache: could not save a finished request's blocks ({e})", KVDiskCacheWarning)
        if request.swap_handle is not None:
            discard(self.swap, request.swap_handle)
            request.swap_handle = None
        request.saved_state = None
        self.runner.kv.states.release(request.request_id)
        if self.steps.speculator is not None:
            self.steps.speculator.forget(request.request_id)
        self.scheduler.remove(request)
        del self.requests[request.request_id]
        text = self.texts.pop(request.request_id, None)
        if text is not None:
            text.finish()
        new_text = text.take(final=True) if text else None
        return StreamChunk(
            request.request_id, new_tokens, new_text, reason, request.num_cached_tokens, request.num_disk_cached_tokens,
            drafted=request.drafted if request.drafted.drafts else None,
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
                        outputs[rid].add(chunk)
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
        return {
            "num_blocks": self.blocks.num_usable_blocks,
            "max_blocks": self.max_blocks - 1,
            "kv_bits": self.runner.kv_bits,
            "block_size": self.blocks.block_size,
            "free_blocks": self.blocks.num_free_blocks,
            "used_blocks": self.blocks.num_usable_blocks - self.blocks.num_free_blocks,
            "cached_blocks": self.blocks.num_cached_blocks,
            "kv_cache_bytes": sum(runner.kv.nbytes for runner in self.steps.runners),  # a draft model's too
            "recurrent_state_bytes": self.pool.state_bytes,  # the budget's share for max_num_seqs sequences
            "recurrent_states": self.runner.kv.states.num_sequences,
            "prefix_caching": self.blocks.enable_prefix_caching,
            "disk_cache": self.disk is not None,
            "kv_groups": list(self.runner.groups.windows),  # each group's window (None: full attention)
            "running": len(self.scheduler.running),
            "max_num_seqs": self.scheduler.max_num_seqs,
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_query_tokens": self.scheduler.prefix_query_tokens,
            "prefix_cache_hit_tokens": self.scheduler.prefix_hit_tokens,
            "disk_cache_hit_tokens": self.scheduler.disk_hit_tokens,
            "attention_kernel": self.kernel.name,
            **(self.steps.speculator.stats() if self.steps.speculator else {"speculative": None}),
        }

    # -- helpers --------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or give the engine a tokenizer")
            token_ids = encode_text(self.tokenizer, prompt)
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("empty prompt")
        vocab = self.spec.vocab_size
        if vocab and not all(0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        return token_ids


def encode_text(tokenizer, text: str) -> list[int]:
    """A text prompt's token ids, as the engine takes them (with the tokenizer's BOS unless the text has it)."""
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))
