"""A state machine over the Engine API with faults: nothing wrong, nothing lost.

Hypothesis adds prompts (many sharing prefixes), aborts requests, steps, and arms
faults that fail a random stage of a later step (the scheduling policy, a disk
tier read, a swap out or in, a block write, the forward pass, sampling, Ctrl-C
while waiting for the device, the device failing at launch or while it runs a
step, a swap policy failing to discard what it kept). After every step: each
request's tokens so far are a prefix of mlx-lm's greedy tokens (or part from them
where mlx-lm's two best tokens tie within rounding: ``follows_mlx_lm``), every
block is held by the requests whose tables name it (or free), and only the
injected errors escape. At the end every request has all of its tokens, as
mlx-lm gives them, and every block is free.

CI runs a bounded number of examples; for a longer local run set
LLM_PAGED_MLX_FUZZ_EXAMPLES (e.g. 1000).
"""

import functools
import os
import tempfile
from collections import Counter

import mlx.core as mx
import pytest
from faults import DeviceFault, Fault
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from models import tiny_any, tiny_model
from test_engine import reference

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.engine.disk.store import KVDiskCache
from llm_paged_mlx.engine import step as step_module

BLOCK_SIZE = 8
NUM_BLOCKS = 10  # 9 usable: two requests can fill it, so they preempt and swap
EXAMPLES = int(os.environ.get("LLM_PAGED_MLX_FUZZ_EXAMPLES", "100"))
STAGES = (
    "policy", "disk read", "swap out", "swap in", "write blocks", "forward", "sample", "wait", "launch", "device",
    "discard",
)  # fmt: skip


MODELS = {  # a model of full-attention layers; one whose windowed layers have a block table of their own
    "llama": lambda: tiny_model("llama"),
    "windowed": lambda: tiny_any("gemma3_text", sliding_window=BLOCK_SIZE + 3),
}


@functools.cache
def model(name: str = "llama"):
    return MODELS[name]()


@functools.cache
def expected(prompt: tuple, max_tokens: int, name: str = "llama") -> list[int]:
    return reference(model(name), list(prompt), max_tokens)


TIE = 1e-4  # logits closer than this (relative to the largest) are a tie that rounding may break either way


def follows_mlx_lm(prompt: tuple, tokens: list[int], want: list[int], name: str = "llama") -> bool:
    """Whether ``tokens`` are mlx-lm's greedy tokens ``want`` (a prefix of them), or part from them only at a tie.

    A batch of other sizes rounds differently, so where mlx-lm's two best next tokens are
    equal within rounding the engine may take either; past that point the two run apart.
    """
    for i, (got, wanted) in enumerate(zip(tokens, want)):
        if got != wanted:
            logits = model(name)(mx.array([list(prompt) + want[:i]]))[0, -1]
            is_tie = abs(logits[got] - logits[wanted]).item() <= TIE * mx.abs(logits).max().item()
            event(f"parted at a tie: {is_tie}")
            return is_tie
    return len(tokens) <= len(want)


class Faults:
    """Stages armed to fail: the stage's ``countdown``-th next call raises."""

    def __init__(self):
        self.armed: dict[str, int] = {}

    def wrap(self, stage, function, error=Fault):
        def wrapper(*args, **kwargs):
            countdown = self.armed.get(stage)
            if countdown is not None:
                if countdown == 0:
                    del self.armed[stage]
                    raise error(f"injected: {stage}")
                self.armed[stage] = countdown - 1
            return function(*args, **kwargs)

        return wrapper


PROMPT_TOKENS = st.lists(st.integers(0, 7), min_size=1, max_size=40)  # few distinct tokens: shared blocks


class EngineMachine(RuleBasedStateMachine):
    MODEL = "llama"
    NUM_BLOCKS = NUM_BLOCKS

    def __init__(self):
        super().__init__()
        self.faults = Faults()
        self.sample, self.synchronize = step_module.sample, step_module.mx.synchronize
        step_module.sample = self.faults.wrap("sample", self.sample)
        step_module.mx.synchronize = self.faults.wrap("device", self.synchronize, DeviceFault)
        self.prompts: dict[int, tuple[tuple, int]] = {}  # request id -> (prompt, tokens it generates)
        self.received: dict[int, list[int]] = {}
        self.done: dict[int, str] = {}  # request id -> finish reason
        self.history: list[tuple] = []

    @initialize(
        swap_policy=st.sampled_from(["recompute", "cpu"]),
        scheduler=st.sampled_from(["fcfs", "priority"]),
        compile_steps=st.booleans(),
        max_num_batched_tokens=st.sampled_from([8, 32]),
        disk_tier=st.booleans(),
    )
    def build(self, swap_policy, scheduler, compile_steps, max_num_batched_tokens, disk_tier):
        if disk_tier:  # evicted blocks come back from disk, within this example
            self.directory = tempfile.TemporaryDirectory()
            disk = KVDiskCache(self.directory.name, "fuzz")
        engine = self.engine = Engine(
            model(self.MODEL),
            block_size=BLOCK_SIZE,
            num_blocks=self.NUM_BLOCKS,
            max_num_seqs=6,
            max_num_batched_tokens=max_num_batched_tokens,
            scheduler=scheduler,
            swap_policy=swap_policy,
            compile_steps=compile_steps,
            attention_kernel="portable",
            kv_disk_cache=disk if disk_tier else None,
        )
        wrap = self.faults.wrap
        if engine.disk is not None:  # (models with windowed tables have no disk tier)
            engine.scheduler.load_prefix = wrap("disk read", engine.scheduler.load_prefix)
        engine.scheduler.policy.key = wrap("policy", engine.scheduler.policy.key)
        engine.swap.swap_out = wrap("swap out", engine.swap.swap_out)
        engine.swap.swap_in = wrap("swap in", engine.swap.swap_in)
        engine.runner.kv.write_blocks = wrap("write blocks", engine.runner.kv.write_blocks)
        engine.runner.forward = wrap("forward", engine.runner.forward)
        engine.runner.launch = wrap("launch", engine.runner.launch, DeviceFault)
        engine.steps.wait = wrap("wait", engine.steps.wait, KeyboardInterrupt)
        engine.swap.discard = wrap("discard", lambda handle: None)  # its failure is warned about, never raised

    # -- rules ------------------------------------------------------------------

    @rule(data=st.data(), tails=st.lists(PROMPT_TOKENS, min_size=1, max_size=4))
    def add(self, data, tails):
        for tail in tails:
            prompt = tail
            if self.history and data.draw(st.integers(0, 2), label="share a prefix"):
                base = data.draw(st.sampled_from(self.history), label="base")
                prompt = list(base[: data.draw(st.integers(len(base) // 2, len(base)), label="cut")]) + tail
            prompt = tuple(prompt[:60])
            max_tokens = data.draw(st.integers(1, 16), label="max_tokens")
            priority = data.draw(st.integers(0, 2), label="priority")
            self.history.append(prompt)
            rid = self.engine.add_request(list(prompt), SamplingParams(max_tokens=max_tokens, priority=priority))
            capacity = self.engine.requests[rid].max_total_tokens  # no request grows past it
            self.prompts[rid] = (prompt, min(max_tokens, capacity - len(prompt)))
            self.received[rid] = []

    @precondition(lambda self: self.engine.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.engine.requests)), label="abort")
        chunk = self.engine.abort(rid)
        self.collect([chunk])

    @rule(stage=st.sampled_from(STAGES), countdown=st.integers(0, 3))
    def arm(self, stage, countdown):
        self.faults.armed[stage] = countdown

    @rule(steps=st.integers(1, 8))
    def step(self, steps):
        for _ in range(steps):
            if self.engine.disk is not None:
                self.engine.disk.flush()  # what a lookup finds does not depend on the writer thread's timing
            try:
                chunks = self.engine.step()
            except (Fault, DeviceFault, KeyboardInterrupt) as e:  # the only errors that may escape: the injected ones
                event(str(e))
                continue
            self.collect(chunks)

    def collect(self, chunks):
        for chunk in chunks:
            assert chunk.request_id not in self.done, "a chunk after the request finished"
            self.received[chunk.request_id] += chunk.token_ids
            if chunk.finish_reason:
                self.done[chunk.request_id] = chunk.finish_reason

    # -- invariants -------------------------------------------------------------

    @invariant()
    def tokens_are_mlx_lm_s(self):
        for rid, tokens in self.received.items():
            prompt, max_tokens = self.prompts[rid]
            want = expected(prompt, max_tokens, self.MODEL)
            assert follows_mlx_lm(prompt, tokens, want, self.MODEL), f"request {rid}: {tokens}"

    @invariant()
    def every_block_is_accounted_for(self):
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        bm = engine.blocks.manager
        held = Counter(b for r in engine.requests.values() for seq in r.tables for b in seq.table if b)
        free = set(bm.free_queue)
        assert 0 not in free
        for block in range(1, self.NUM_BLOCKS):
            assert bm.blocks[block].ref_count == held[block], f"block {block}"
            assert (block in free) == (held[block] == 0), f"block {block} is both free and held, or neither"
        queued = engine.scheduler.running + engine.scheduler.waiting
        assert sorted(r.request_id for r in queued) == sorted(engine.requests)

    def teardown(self):
        step_module.sample, step_module.mx.synchronize = self.sample, self.synchronize
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        self.faults.armed.clear()
        for _ in range(2000):
            if not engine.has_unfinished():
                break
            self.collect(engine.step())
        self.collect(engine.step())  # reads whatever ran ahead for finished requests: nothing for them
        assert not engine.has_unfinished()
        for rid, tokens in self.received.items():
            prompt, max_tokens = self.prompts[rid]
            want = expected(prompt, max_tokens, self.MODEL)
            assert follows_mlx_lm(prompt, tokens, want, self.MODEL), f"request {rid}: {tokens} against {want}"
            if self.done.get(rid) != "abort":
                assert (len(tokens), self.done.get(rid)) == (len(want), "length"), f"request {rid}"  # max_tokens, or the pool
        stats = engine.stats()
        assert stats["free_blocks"] == stats["num_blocks"]
        event(f"preempted: {stats['preemptions'] > 0}, prefix hits: {stats['prefix_cache_hit_tokens'] > 0}")
        if engine.disk is not None:
            event(f"disk hits: {stats['disk_cache_hit_tokens'] > 0}")
            engine.disk.close()
            self.directory.cleanup()


EngineMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_engine_state_machine = pytest.mark.filterwarnings("ignore::RuntimeWarning")(EngineMachine.TestCase)


class WindowedEngineMachine(EngineMachine):
    """The same over a model with a window of 11 tokens beside full attention: two block tables per request, the
    windowed one returning blocks as its window passes them, in a pool that still preempts."""

    MODEL = "windowed"
    NUM_BLOCKS = 16


WindowedEngineMachine.TestCase.settings = settings(EngineMachine.TestCase.settings, max_examples=max(1, EXAMPLES // 3))
test_windowed_engine_state_machine = pytest.mark.filterwarnings("ignore::RuntimeWarning")(
    WindowedEngineMachine.TestCase
)
