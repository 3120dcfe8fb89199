"""The engine against mlx-lm on tiny random-weight models: exact greedy tokens, batching, preemption, errors."""

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from models import ARCHS, tiny_any, tiny_model

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.engine.step import StepPipeline

PROMPT_LENGTHS = [1, 2, 15, 16, 17, 33, 100, 250, 600, 640]


def reference(model, prompt, max_tokens, stop_token_ids=()):
    """mlx-lm's greedy continuation (generate_step is what stream_generate runs)."""
    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, -1)):
        if int(token) in stop_token_ids:
            break
        tokens.append(int(token))
    return tokens


def random_prompts(lengths, seed=1, vocab=256):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def run_staggered(engine, prompts, params, first=5, steps_between=3):
    """Add ``first`` prompts, run a few steps, then add the rest while those decode."""
    ids = [engine.add_request(p, params) for p in prompts[:first]]
    outputs = {}
    for _ in range(steps_between):
        collect(engine.step(), outputs)
    ids += [engine.add_request(p, params) for p in prompts[first:]]
    while engine.has_unfinished():
        collect(engine.step(), outputs)
    return [outputs[i] for i in ids]


def collect(chunks, outputs):
    for chunk in chunks:
        outputs.setdefault(chunk.request_id, []).extend(chunk.token_ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_mlx_lm_under_preemption(arch):
    model = tiny_model(arch)
    prompts = random_prompts(PROMPT_LENGTHS)
    engine = Engine(model, block_size=16, num_blocks=56, max_num_batched_tokens=128)
    got = run_staggered(engine, prompts, SamplingParams(max_tokens=24))
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference(model, prompt, 24), f"prompt of {len(prompt)} tokens"
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["free_blocks"] == stats["num_blocks"] == 55


def test_cpu_swap_policy_gives_the_same_tokens():
    model = tiny_model("qwen3")
    prompts = random_prompts([40, 300, 120, 7, 64, 200])
    engine = Engine(model, num_blocks=30, max_num_batched_tokens=64, swap_policy="cpu")
    outs = engine.generate(prompts, SamplingParams(max_tokens=20))
    assert engine.stats()["preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(model, prompt, 20)
    assert engine.stats()["free_blocks"] == 29


def test_prefix_cache_on_and_off_give_the_same_tokens():
    model = tiny_model("llama")
    shared = random_prompts([70], seed=3)[0]
    prompts = [shared + tail for tail in random_prompts([5, 9, 1], seed=4)]
    expected = [reference(model, p, 12) for p in prompts]
    for caching in (True, False):
        engine = Engine(model, num_blocks=64, enable_prefix_caching=caching)
        first = engine.generate(prompts[:1], SamplingParams(max_tokens=12))
        rest = engine.generate(prompts[1:], SamplingParams(max_tokens=12))
        assert [o.token_ids for o in first + rest] == expected
        hits = engine.stats()["prefix_cache_hit_tokens"]
        assert hits == (2 * 64 if caching else 0)  # four full shared blocks of the 70 shared tokens, twice
        if caching:
            assert [o.num_cached_tokens for o in rest] == [64, 64]


def test_repeated_prompt_reuses_all_but_the_last_token():
    model = tiny_model("qwen2")
    prompt = random_prompts([48])[0]  # exactly three blocks
    engine = Engine(model, num_blocks=32)
    a = engine.generate([prompt], SamplingParams(max_tokens=8))[0]
    b = engine.generate([prompt], SamplingParams(max_tokens=8))[0]
    assert a.token_ids == b.token_ids == reference(model, prompt, 8)
    assert b.num_cached_tokens == 32  # the last block is recomputed to get logits


def test_seeded_sampling_does_not_depend_on_the_batch():
    model = tiny_model("qwen3")
    prompt = random_prompts([20])[0]
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    alone = Engine(model, num_blocks=64).generate([prompt], params)[0].token_ids
    others = random_prompts([5, 50, 90], seed=9)
    batch = Engine(model, num_blocks=64).generate(
        others + [prompt] + others,
        [SamplingParams(max_tokens=16, temperature=1.0)] * 3 + [params] + [SamplingParams(max_tokens=16)] * 3,
    )
    assert batch[3].token_ids == alone
    unseeded = Engine(model, num_blocks=64).generate([prompt] * 3, SamplingParams(max_tokens=16, temperature=1.0))
    assert len({tuple(o.token_ids) for o in unseeded}) > 1


def test_stop_token_ids_and_length():
    model = tiny_model("qwen3")
    prompt = random_prompts([30])[0]
    full = reference(model, prompt, 12)
    stop = full[5]
    engine = Engine(model, num_blocks=32)
    out = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[stop]))[0]
    assert out.token_ids == full[: full.index(stop)]
    assert out.finish_reason == "stop"
    out = engine.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert out.token_ids == full and out.finish_reason == "length"


def test_generation_stops_at_the_model_context():
    model = tiny_model("llama", max_position_embeddings=64)
    engine = Engine(model, num_blocks=32)
    out = engine.generate(random_prompts([60]), SamplingParams(max_tokens=20))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_stream_matches_generate_and_close_aborts():
    model = tiny_model("llama")
    prompt = random_prompts([25])[0]
    engine = Engine(model, num_blocks=32)
    chunks = list(engine.stream(prompt, SamplingParams(max_tokens=10)))
    assert [t for c in chunks for t in c.token_ids] == reference(model, prompt, 10)
    assert chunks[-1].finish_reason == "length"
    stream = engine.stream(prompt, SamplingParams(max_tokens=100))
    next(stream)
    stream.close()
    assert not engine.has_unfinished()
    assert engine.stats()["free_blocks"] == 31


def test_abort_frees_blocks_and_others_continue():
    model = tiny_model("qwen2")
    prompts = random_prompts([40, 70])
    engine = Engine(model, num_blocks=32)
    keep = engine.add_request(prompts[0], SamplingParams(max_tokens=10))
    drop = engine.add_request(prompts[1], SamplingParams(max_tokens=10))
    outputs = {}
    collect(engine.step(), outputs)
    last = engine.abort(drop)
    assert last.finish_reason == "abort"
    assert engine.abort(drop) is None
    while engine.has_unfinished():
        collect(engine.step(), outputs)
    assert outputs[keep] == reference(model, prompts[0], 10)
    assert engine.stats()["free_blocks"] == 31


def test_bad_input_is_rejected_and_nothing_is_lost():
    model = tiny_model("qwen3", max_position_embeddings=512)
    engine = Engine(model, num_blocks=20)  # 19 usable blocks: 304 tokens
    good = random_prompts([30])[0]
    rid = engine.add_request(good, SamplingParams(max_tokens=12))
    outputs = {}
    collect(engine.step(), outputs)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([])
    with pytest.raises(ValueError, match="KV cache: its budget of 0.3 MiB holds at most 303 prompt tokens; raise the budget"):
        engine.add_request(random_prompts([400])[0])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([5, 999])
    with pytest.raises(ValueError, match="text prompt needs a tokenizer"):
        engine.add_request("hello")
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-3)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        engine.generate([good, good], [SamplingParams()])
    while engine.has_unfinished():
        collect(engine.step(), outputs)
    assert outputs[rid] == reference(model, good, 12)
    assert engine.stats()["free_blocks"] == 19
    small = Engine(tiny_model("qwen3", max_position_embeddings=64), num_blocks=20)
    with pytest.raises(ValueError, match="model's context"):
        small.add_request(random_prompts([64])[0])


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("scheduler", "nope", "unknown scheduler 'nope'"),
        ("attention_kernel", "nope", "unknown attention kernel 'nope'"),
        ("swap_policy", "nope", "unknown swap policy 'nope'"),
        ("kv_budget_bytes", 10, "fewer than 2 blocks"),
    ],
)
def test_bad_engine_options(option, value, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny_model("llama"), **{option: value})


def test_unsupported_models_are_refused():
    with pytest.raises(ValueError, match=r"^deepseek_v41: needs LayerCache, not supported yet"):
        Engine(tiny_any("deepseek_v41"))


def test_priority_policy_serves_smaller_priority_first():
    model = tiny_model("llama")
    prompts = random_prompts([10, 10, 10, 10], seed=5)
    engine = Engine(model, num_blocks=32, max_num_seqs=1, scheduler="priority")
    ids = [engine.add_request(p, SamplingParams(max_tokens=3, priority=pri)) for p, pri in zip(prompts, [3, 1, 2, 0])]
    order = []
    while engine.has_unfinished():
        order += [c.request_id for c in engine.step() if c.finish_reason]
    assert order == [ids[3], ids[1], ids[2], ids[0]]


def test_preemption_takes_the_lowest_priority_request():
    model = tiny_model("llama")
    prompts = random_prompts([60, 60], seed=6)
    engine = Engine(model, num_blocks=9, scheduler="priority")  # 128 tokens: both cannot finish together
    low = engine.add_request(prompts[0], SamplingParams(max_tokens=40, priority=5))
    high = engine.add_request(prompts[1], SamplingParams(max_tokens=40, priority=0))
    outputs, order = {}, []
    while engine.has_unfinished():
        chunks = engine.step()
        collect(chunks, outputs)
        order += [c.request_id for c in chunks if c.finish_reason]
    assert engine.stats()["preemptions"] > 0
    assert order == [high, low]
    assert outputs[low] == reference(model, prompts[0], 40)
    assert outputs[high] == reference(model, prompts[1], 40)


def test_models_the_paged_cache_cannot_serve_are_refused():
    from mlx_lm.models import gpt_bigcode

    with pytest.raises(ValueError, match="DynamicNTKScalingRoPE"):
        Engine(tiny_model("llama", rope_scaling={"type": "dynamic", "factor": 2.0}))
    bigcode = gpt_bigcode.ModelArgs(
        model_type="gpt_bigcode", n_embd=64, n_layer=1, n_inner=128, n_head=4, n_positions=128,
        layer_norm_epsilon=1e-5, vocab_size=256,
    )
    with pytest.raises(ValueError, match="arange"):
        Engine(gpt_bigcode.Model(bigcode))


def test_interleaved_streams_share_steps_without_losing_chunks():
    model = tiny_model("qwen3")
    prompts = random_prompts([12, 40, 3])
    engine = Engine(model, num_blocks=32)
    streams = [engine.stream(p, SamplingParams(max_tokens=8 + 3 * i)) for i, p in enumerate(prompts)]
    got = [[] for _ in streams]
    live = set(range(len(streams)))
    while live:
        for i in sorted(live):
            chunk = next(streams[i])
            got[i] += chunk.token_ids
            if chunk.finish_reason:
                live.discard(i)
    assert got == [reference(model, p, 8 + 3 * i) for i, p in enumerate(prompts)]
    assert engine.stats()["free_blocks"] == 31 and not engine.outbox


def test_decode_runs_ahead_through_stops_and_aborts(monkeypatch, decode_launch):
    """Steady decoding builds each step on the last one's unread tokens. A request that stops or is
    aborted while a step runs ahead for it loses nothing of its own and takes nothing from others."""
    ahead = []
    run_ahead = StepPipeline.run_ahead
    monkeypatch.setattr(StepPipeline, "run_ahead", lambda self, launched: ahead.append(1) or run_ahead(self, launched))
    model = tiny_model("llama")
    prompts = random_prompts([12, 30, 45, 20], seed=12)
    full = [reference(model, p, 24) for p in prompts]
    stop = full[1][6]  # request 1 stops there, mid-run, on a token the others may also make
    engine = Engine(model, num_blocks=40)
    params = [SamplingParams(max_tokens=24, stop_token_ids=[stop] if i == 1 else None) for i in range(4)]
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    outputs = {}
    while len(outputs.get(ids[3], [])) < 5:
        collect(engine.step(), outputs)
    assert engine.steps.in_flight is not None and ahead  # a step is running ahead for request 3 right now
    engine.abort(ids[3])
    while engine.has_unfinished():
        collect(engine.step(), outputs)
    assert outputs[ids[0]] == full[0] and outputs[ids[2]] == full[2]
    assert outputs[ids[1]] == full[1][: full[1].index(stop)]
    assert outputs[ids[3]] == full[3][: len(outputs[ids[3]])]
    assert len(ahead) > 10
    assert engine.runner.writes_in_place == (decode_launch != "read first")
    engine.step()  # reads whatever ran ahead for the finished requests
    assert engine.stats()["free_blocks"] == 39 and engine.steps.in_flight is None and engine.steps.unread is None


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="MLX's scatters write in place while a step runs on the CPU")
def test_decode_steps_launched_ahead_on_the_cpu_write_the_pools_in_place(monkeypatch):
    """On the CPU a decode step is launched while the one before it runs, and MLX's scatter still writes its
    K/V in place: no step allocates a copy of a pool, also while other processes load the cores, and also
    where requests ending at different steps make some steps wait for the one before."""
    launched = []
    launch_ahead = StepPipeline._launch_ahead
    monkeypatch.setattr(StepPipeline, "_launch_ahead", lambda self, s: launched.append(1) or launch_ahead(self, s))
    model = tiny_model("llama")
    engine = Engine(model, num_blocks=4096)
    pool_bytes = min(a.nbytes for a in engine.runner.kv.arrays())
    for prompt, max_tokens in zip(random_prompts([40, 9, 23], seed=21), [48, 20, 34]):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    allocated = []  # the most memory each step held beyond what was held before it
    while engine.has_unfinished():
        mx.reset_peak_memory()
        held = mx.get_active_memory()
        collect(engine.step(), {})
        allocated.append(mx.get_peak_memory() - held)
    assert engine.runner.writes_in_place and len(launched) > 40
    assert max(allocated) < pool_bytes // 4, [round(a / pool_bytes, 2) for a in allocated]


@pytest.mark.parametrize("run_ahead", [True, False])
def test_an_interrupt_while_a_step_is_read_loses_nothing(monkeypatch, run_ahead):
    """Ctrl-C lands where the host waits: in reading a step. The next call reads it again, a step
    built ahead of it (to launch after the read) is dropped with its slots, and every request still gets
    mlx-lm's tokens."""
    from llm_paged_mlx.engine import engine as engine_module
    from llm_paged_mlx.engine.runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "writes_in_place", property(lambda self: False))
    model = tiny_model("llama")
    prompts = random_prompts([14, 31, 9], seed=13)
    engine = Engine(model, num_blocks=40)
    ids = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in prompts[:2]]
    outputs = {}
    for _ in range(4):
        collect(engine.step(), outputs)
    if not run_ahead:  # a waiting request: the next step is scheduled after reading this one
        ids.append(engine.add_request(prompts[2], SamplingParams(max_tokens=12)))
    free = engine.stats()["free_blocks"]
    synchronize = mx.synchronize

    def interrupted():
        monkeypatch.setattr(engine_module.mx, "synchronize", synchronize)
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_module.mx, "synchronize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.stats()["free_blocks"] == free  # nothing scheduled after the read kept its slots
    while engine.has_unfinished():
        collect(engine.step(), outputs)
    assert [outputs[i] for i in ids] == [reference(model, p, 12) for p in prompts[: len(ids)]]
    engine.step()
    assert engine.stats()["free_blocks"] == 39


def test_an_interrupt_while_reading_a_step_behind_one_launched_ahead_loses_nothing(monkeypatch, decode_launch):
    """Where a step is launched before the one in flight is read, Ctrl-C in that read leaves the step read
    at the next call, before anything else; every request still gets mlx-lm's tokens."""
    model = tiny_model("llama")
    prompts = random_prompts([14, 31, 9], seed=13)
    engine = Engine(model, num_blocks=40)
    ids = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in prompts]
    outputs = {}
    for _ in range(5):
        collect(engine.step(), outputs)
    wait, waits = StepPipeline.wait, []

    def interrupted(self, launched, *args, **kwargs):
        waits.append(launched)
        if len(waits) == 1:
            raise KeyboardInterrupt
        return wait(self, launched, *args, **kwargs)

    monkeypatch.setattr(StepPipeline, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    if decode_launch != "read first":
        assert engine.steps.unread is waits[0] and engine.steps.in_flight is not waits[0]
    collect(engine.step(), outputs)
    assert waits[1] is waits[0]  # the interrupted read first
    while engine.has_unfinished():
        collect(engine.step(), outputs)
    assert [outputs[i] for i in ids] == [reference(model, p, 12) for p in prompts]
    engine.step()
    assert engine.stats()["free_blocks"] == 39


def test_prefix_cache_reaches_every_full_block_after_an_eviction():
    """A and B share their first block and differ in the second; computed side by side, B's second
    block is cached under the first block A computed. A's blocks are evicted while B runs. From
    then on B's prompt finds both of its blocks (it used to stop one block short forever)."""
    model = tiny_model("llama")
    shared, a_own, b_own, filler = random_prompts([16, 16, 16, 176], seed=21)
    a, b = shared + a_own + [1], shared + b_own + [2]
    engine = Engine(model, num_blocks=16)
    engine.add_request(a, SamplingParams(max_tokens=1))
    b_id = engine.add_request(b, SamplingParams(max_tokens=30))
    while b_id in engine.requests and len(engine.requests) > 1:
        engine.step()  # until A is done
    engine.add_request(filler, SamplingParams(max_tokens=2))  # takes A's freed blocks
    while engine.has_unfinished():
        engine.step()
    runs = [engine.generate([b], SamplingParams(max_tokens=3))[0] for _ in range(4)]
    assert [r.num_cached_tokens for r in runs] == [0, 32, 32, 32]
    assert all(r.token_ids == reference(model, b, 3) for r in runs)


def finish_order(engine, outputs):
    order = []
    while engine.has_unfinished():
        chunks = engine.step()
        collect(chunks, outputs)
        order += [c.request_id for c in chunks if c.finish_reason]
    return order


def test_a_waiting_request_that_does_not_fit_lets_smaller_ones_in():
    model = tiny_model("llama")
    long_running, big, small = random_prompts([100, 120, 10], seed=22)
    engine = Engine(model, num_blocks=12)  # 11 blocks: the big prompt (8) cannot join the long one (7+)
    first = engine.add_request(long_running, SamplingParams(max_tokens=40))
    outputs = {}
    collect(engine.step(), outputs)
    waiting_big = engine.add_request(big, SamplingParams(max_tokens=4))
    waiting_small = engine.add_request(small, SamplingParams(max_tokens=3))
    order = finish_order(engine, outputs)
    assert order == [waiting_small, first, waiting_big]
    assert [outputs[i] for i in (first, waiting_big, waiting_small)] == [
        reference(model, long_running, 40), reference(model, big, 4), reference(model, small, 3)
    ]


def test_a_higher_priority_arrival_preempts_a_lower_one_on_admission():
    model = tiny_model("llama")
    low_prompt, high_prompt = random_prompts([130, 40], seed=23)
    engine = Engine(model, num_blocks=12, scheduler="priority")  # 176 tokens: not both (160 + 45)
    low = engine.add_request(low_prompt, SamplingParams(max_tokens=30, priority=5))
    outputs = {}
    for _ in range(3):
        collect(engine.step(), outputs)
    high = engine.add_request(high_prompt, SamplingParams(max_tokens=5, priority=0))
    order = finish_order(engine, outputs)
    assert order == [high, low] and engine.stats()["preemptions"] >= 1
    assert outputs[low] == reference(model, low_prompt, 30)
    assert outputs[high] == reference(model, high_prompt, 5)
