"""Engine steps are transactions: a step that fails before it is launched leaves no trace.

Each test fails one stage of one step (a policy, a swap, a disk load, the forward pass,
sampling, the wait for the device) and checks that every request still gets mlx-lm's
greedy tokens and every block comes back.
"""

import functools
import random
import signal

import mlx.core as mx
import pytest
from faults import Fault, Injector, run_through_faults
from models import tiny_any, tiny_model
from test_engine import random_prompts, reference

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.engine import step as step_module
from llm_paged_mlx.engine.kv_pools import KVPools
from llm_paged_mlx.engine.runner import ModelRunner
from llm_paged_mlx.engine.scheduler import FCFSPolicy
from llm_paged_mlx.engine.swap import CPUSwapPolicy
from llm_paged_mlx.kernels.portable import PortableKernel

LENGTHS = [40, 300, 120, 7, 64, 200]
MAX_TOKENS = 60  # long enough that slots written one position off show up in the tokens


@functools.cache
def workload():
    model = tiny_model("qwen3")
    prompts = random_prompts(LENGTHS)
    return model, prompts, [reference(model, p, MAX_TOKENS) for p in prompts]


def small_engine(model, **options):
    """A pool too small for the workload at once: it preempts and swaps."""
    return Engine(model, num_blocks=30, max_num_batched_tokens=64, swap_policy="cpu", **options)


STAGES = {
    "policy": (FCFSPolicy, "key", [40]),
    "swap out": (CPUSwapPolicy, "swap_out", [1, 3]),
    "swap in": (CPUSwapPolicy, "swap_in", [1, 2]),
    "forward": (ModelRunner, "forward", [5, 30, 31]),
    "sample": (step_module, "sample", [4, 20]),
}


@pytest.mark.parametrize("stage", STAGES)
def test_a_failed_step_is_undone_and_every_request_gets_mlx_lm_s_tokens(stage, monkeypatch):
    model, prompts, expected = workload()
    owner, name, fail_on = STAGES[stage]
    injector = Injector(monkeypatch, owner, name, fail_on)
    engine = small_engine(model)
    got = run_through_faults(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert injector.failures == len(fail_on)
    assert engine.stats()["preemptions"] > 0
    for prompt, tokens, want in zip(prompts, got, expected):
        assert tokens == want, f"prompt of {len(prompt)} tokens"
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]


def test_an_interrupted_wait_is_undone_and_read_again(monkeypatch):
    model, prompts, expected = workload()
    engine = small_engine(model)  # first: building an engine may synchronize (the model check)
    injector = Injector(monkeypatch, step_module.mx, "synchronize", [3, 10, 11, 40], KeyboardInterrupt)
    got = run_through_faults(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS), (KeyboardInterrupt,))
    assert injector.failures == 4
    assert got == expected
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]


def test_bfloat16_requests_swap_to_host_memory_and_back():
    model = tiny_model("qwen3")
    model.set_dtype(mx.bfloat16)
    prompts = random_prompts(LENGTHS)
    roomy = Engine(model, num_blocks=200)
    expected = [o.token_ids for o in roomy.generate(prompts, SamplingParams(max_tokens=20))]
    engine = small_engine(model)
    got = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=20))]
    assert engine.stats()["preemptions"] > 0 and roomy.stats()["preemptions"] == 0
    assert got == expected


def test_what_was_read_before_a_failed_step_comes_with_the_next(monkeypatch):
    model, prompts, expected = workload()
    engine = small_engine(model)
    rid = engine.add_request(prompts[3], SamplingParams(max_tokens=1))
    assert engine.step() == []  # the prefill is launched
    Injector(monkeypatch, engine.scheduler, "schedule", [1])
    with pytest.raises(Fault):
        engine.step()  # reads the request's only token, then fails to schedule the next step
    assert engine.has_unfinished()  # a chunk is waiting to be returned
    (chunk,) = engine.step()
    assert (chunk.request_id, chunk.token_ids, chunk.finish_reason) == (rid, expected[3][:1], "length")
    assert not engine.has_unfinished()


def test_an_abort_after_a_failed_step_carries_what_was_read(monkeypatch):
    model, prompts, expected = workload()
    engine = small_engine(model)
    rid = engine.add_request(prompts[3], SamplingParams(max_tokens=5))
    engine.step()
    other = engine.add_request(prompts[0], SamplingParams(max_tokens=5))  # waiting: the next step reads first
    Injector(monkeypatch, engine.scheduler, "schedule", [1])
    with pytest.raises(Fault):
        engine.step()  # reads the first token, then fails
    last = engine.abort(rid)
    assert (last.token_ids, last.finish_reason) == (expected[3][:1], "abort")
    engine.abort(other)
    assert engine.step() == [] and not engine.has_unfinished()


@pytest.mark.parametrize("where", ["launch", "wait"])
def test_a_device_failure_in_a_launched_step_starts_every_request_over(where, monkeypatch):
    """The device failing to run a launched step leaves the pools unknown: every request is computed
    again from its tokens (the error reaches the caller), and still gets mlx-lm's tokens."""
    model, prompts, expected = workload()
    engine = small_engine(model)
    if where == "launch":
        Injector(monkeypatch, engine.runner, "launch", [6, 20], RuntimeError)
    else:
        Injector(monkeypatch, step_module.mx, "synchronize", [6, 20], RuntimeError)
    got = run_through_faults(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS), (RuntimeError,))
    assert got == expected
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]


def test_a_failing_discard_of_a_swap_policy_loses_nothing(monkeypatch):
    model, prompts, expected = workload()
    calls = []

    def discard(self, handle):
        calls.append(handle)
        raise OSError("the swap store is gone")

    monkeypatch.setattr(CPUSwapPolicy, "discard", discard, raising=False)
    engine = small_engine(model)
    with pytest.warns(RuntimeWarning, match="discard failed"):
        got = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]
    assert calls and got == expected
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]


def test_ctrl_c_at_any_moment_of_a_step_loses_nothing(monkeypatch, decode_launch):
    """Real SIGINTs, raised at random points all through the engine's step, while the caller keeps stepping."""
    model, prompts, expected = workload()
    engine = small_engine(model)
    rng, sent = random.Random(5), []

    def sigint_now_and_then(function):
        def interrupted(*args, **kwargs):
            if rng.random() < 0.05:
                sent.append(function.__name__)
                signal.raise_signal(signal.SIGINT)
            result = function(*args, **kwargs)
            if rng.random() < 0.05:
                sent.append(function.__name__)
                signal.raise_signal(signal.SIGINT)
            return result

        return interrupted

    points = {
        engine: ["_append", "_finish"],
        engine.steps: ["wait", "apply", "launch", "_prepare"],
        engine.scheduler: ["schedule", "commit", "rollback", "remove"],
        engine.blocks: ["append_slots", "allocate_prefix", "cache_full_blocks", "free"],
        engine.runner: ["forward", "launch"],
        engine.runner.kv: ["read_blocks", "write_blocks"],
    }
    for owner, names in points.items():
        for name in names:
            monkeypatch.setattr(owner, name, sigint_now_and_then(getattr(owner, name)))
    ids = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts]
    outputs, interrupted = {rid: [] for rid in ids}, 0
    while engine.has_unfinished():
        try:
            chunks = engine.step()
        except KeyboardInterrupt:
            interrupted += 1
            continue
        for chunk in chunks:
            outputs[chunk.request_id] += chunk.token_ids
    assert 10 < interrupted <= len(sent)  # two SIGINTs within one held stretch raise once
    assert [outputs[rid] for rid in ids] == expected
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]


def test_a_failed_step_that_overwrote_cached_blocks_takes_them_out_of_the_cache(monkeypatch):
    """A step hands out free blocks still in the prefix cache and writes over them, then fails: the undone
    step must not leave them cached (their K/V are another prompt's now), and the pool is not copied."""
    model = tiny_model("qwen3")
    first, second = random_prompts([64, 200], seed=21)
    params = SamplingParams(max_tokens=6)
    engine = Engine(model, num_blocks=16, max_num_batched_tokens=256)  # 15 blocks: the second evicts the first
    assert engine.generate([first], params)[0].token_ids == reference(model, first, 6)
    assert engine.stats()["cached_blocks"] >= 4
    protected = []
    real_protect = KVPools.protect
    monkeypatch.setattr(KVPools, "protect", lambda pools, blocks: protected.extend(blocks) or real_protect(pools, blocks))
    Injector(monkeypatch, step_module, "sample", [1])
    with pytest.raises(Fault):
        engine.generate([second], params)
    assert protected == []  # no block a sequence held was written over: nothing was copied
    out = engine.generate([first], params)[0]
    assert out.token_ids == reference(model, first, 6)
    assert engine.generate([second], params)[0].token_ids == reference(model, second, 6)
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]


@pytest.mark.parametrize("error", [Fault, KeyboardInterrupt])
def test_a_prefill_failing_between_its_groups_of_heads_is_undone(error, monkeypatch):
    """Where attention runs fused, long prefill chunks gather their context a KV head at a time and
    evaluate each head before the next; failing between two heads undoes the step."""
    from llm_paged_mlx.kernels import portable

    model, prompts, expected = workload()  # qwen3: 2 KV heads of 32, float32
    monkeypatch.setattr(portable, "fused_prefill", lambda n, k_pool, v_pool: n > 8)
    # Contexts up to 150 tokens gather both heads at once, up to 300 one at a time, longer ones go in tiles.
    monkeypatch.setattr(portable, "PREFILL_ATTENTION_BYTES", 300 * (32 + 32) * 2 * 4)
    engine = small_engine(model)  # its model check runs the fused route too: faults come after it
    second_head = []  # failures injected while gathering a second KV head's context
    gather, calls = portable.gather_context, []

    def gather_failing_at_a_second_head(pool, block_table, length, heads=slice(None)):
        if heads.start == 1:  # the first head's attention has been evaluated by now
            calls.append(length)
            if len(calls) in (1, 4, 8):
                second_head.append(length)
                raise error(f"gather of the second head failed (call {len(calls)})")
        return gather(pool, block_table, length, heads)

    monkeypatch.setattr(portable, "gather_context", gather_failing_at_a_second_head)
    got = run_through_faults(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS), (error,))
    assert len(second_head) == 3
    for prompt, tokens, want in zip(prompts, got, expected):
        assert tokens == want, f"prompt of {len(prompt)} tokens"
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]


@pytest.mark.parametrize(
    "arch, overrides, kernel_entry",
    [("deepseek_v3", {}, "latent_attention"), ("gpt_oss", dict(sliding_window=32), "__call__")],
    ids=["mla", "sliding-window-and-sinks"],
)
def test_a_failed_attention_call_of_an_mla_or_windowed_model_is_undone(arch, overrides, kernel_entry, monkeypatch):
    """The kernel fails inside a step (MLA's latent attention; a windowed call with sinks): the step is undone,
    every request still gets mlx-lm's tokens and every block comes back."""
    model = tiny_any(arch, **overrides)
    prompts = random_prompts(LENGTHS, seed=5)
    expected = [reference(model, p, 30) for p in prompts]
    injector = Injector(monkeypatch, PortableKernel, kernel_entry, [7])
    engine = small_engine(model)
    got = run_through_faults(engine, prompts, SamplingParams(max_tokens=30))
    assert injector.failures == 1
    assert engine.stats()["preemptions"] > 0
    assert got == expected
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]
