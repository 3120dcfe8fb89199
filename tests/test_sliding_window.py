"""Sliding-window layers, attention sinks and softcapped scores on the paged engine: the kernels' masks and the
models that use them."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from models import ROPE, tiny_any
from test_engine import random_prompts, reference, run_staggered
from test_mla import BareKernel

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.engine.disk.store import KVDiskCache
from llm_paged_mlx.engine.request import Status
from llm_paged_mlx.kernels import AttentionPlan, PrefillChunk
from llm_paged_mlx.kernels.plan import window_tables
from llm_paged_mlx.kernels.dialect import CUDA
from llm_paged_mlx.kernels.fused import FusedKernel
from llm_paged_mlx.kernels.portable import PortableKernel, decode_attention

WINDOW = 32
# The window, and a layer stack of a sliding-window layer, then a full-attention one, in each model's own words.
MODELS = {
    "gemma3_text": dict(sliding_window=WINDOW),
    "gpt_oss": dict(sliding_window=WINDOW),  # attention sinks on every layer
    "cohere2": dict(sliding_window=WINDOW),
    "olmo3": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "exaone4": dict(sliding_window=WINDOW, sliding_window_pattern="LG"),
    "mimo_v2_flash": dict(sliding_window_size=WINDOW),
    "step3p5": dict(sliding_window=WINDOW),
}


@pytest.mark.parametrize("arch", list(MODELS))
def test_greedy_tokens_match_mlx_lm_past_the_window_with_preemption(arch):
    """Eight requests of up to 300 tokens (the window is 32), 40 new tokens each, in a pool that preempts."""
    model = tiny_any(arch, **MODELS[arch])
    prompts = random_prompts([3, 31, 32, 33, 70, 150, 250, 300], seed=8)
    engine = Engine(model, block_size=16, num_blocks=64, max_num_batched_tokens=64)
    assert WINDOW in {layout.window for layout in engine.runner.spec.attention}
    got = run_staggered(engine, prompts, SamplingParams(max_tokens=40), first=6)
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference(model, prompt, 40), f"prompt of {len(prompt)} tokens"
    assert engine.stats()["preemptions"] > 0
    assert engine.stats()["free_blocks"] == 63


BOUNDED = {  # a windowed layer beside a full one; every layer windowed (of the models mlx-lm lets have none full)
    "windowed-and-full": ("gemma3_text", dict(sliding_window=WINDOW)),
    "all-windowed": ("step3p5", dict(sliding_window=WINDOW, layer_types=["sliding_attention"] * 2)),
}


@pytest.mark.parametrize("arch, overrides", list(BOUNDED.values()), ids=list(BOUNDED))
def test_a_windowed_table_holds_its_window_s_blocks_only_as_generation_goes_on(arch, overrides):
    """One request of 20 tokens generating 300 in 16-token blocks, a 32-token window. The windowed layers'
    table holds at most the 3 blocks that the next query's window and its own block span, whatever the length;
    a full layers' table grows with it. The tokens are mlx-lm's."""
    model = tiny_any(arch, **overrides)
    engine = Engine(model, block_size=16, num_blocks=64)
    windows = engine.stats()["kv_groups"]
    assert WINDOW in windows and (None in windows) == (arch == "gemma3_text")
    prompt = random_prompts([20], seed=11)[0]
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=300))
    request, tokens, most = engine.requests[request_id], [], [0] * len(windows)
    while engine.has_unfinished():
        for chunk in engine.step():
            tokens += chunk.token_ids
        if request.status is Status.RUNNING:
            held = [sum(block != 0 for block in seq.table) for seq in request.tables]
            assert engine.stats()["used_blocks"] == sum(held)
            most = [max(m, h) for m, h in zip(most, held)]
    assert tokens == reference(model, prompt, 300)
    assert most == [-(-319 // 16) if window is None else 3 for window in windows]
    assert engine.stats()["free_blocks"] == 63


def test_a_follow_up_turn_reuses_a_windowed_model_s_cached_prefix_exactly():
    """The first turn's blocks stay cached after it ends, those its window passed included; the next turn
    (its prompt, its answer and more) finds them, and its tokens are mlx-lm's."""
    model = tiny_any("gemma3_text", sliding_window=WINDOW)
    engine = Engine(model, block_size=16, num_blocks=64)
    first = random_prompts([90], seed=12)[0]
    answer = engine.generate([first], SamplingParams(max_tokens=30))[0].token_ids
    follow_up = first + answer + random_prompts([25], seed=13)[0]
    output = engine.generate([follow_up], SamplingParams(max_tokens=20))[0]
    assert output.token_ids == reference(model, follow_up, 20)
    assert output.num_cached_tokens == (len(first) + len(answer) - 1) // 16 * 16


def test_a_shared_prompt_longer_than_the_window_is_found_in_the_prefix_cache():
    """A second prompt sharing a 200-token prefix (the window is 32) starts from the cache. The blocks the first
    one's windowed table returned entered the cache first, though the step that returned them was planned
    (run ahead) before the one that filled them had ended."""
    model = tiny_any("gemma3_text", sliding_window=WINDOW)
    engine = Engine(model, block_size=16, num_blocks=200)
    shared = random_prompts([200], seed=5)[0]
    first, second = (shared + tail for tail in random_prompts([10, 12], seed=6))
    engine.generate([first], SamplingParams(max_tokens=4))
    output = engine.generate([second], SamplingParams(max_tokens=4))[0]
    assert output.num_cached_tokens == 192
    assert output.token_ids == reference(model, second, 4)


def test_the_disk_tier_is_off_for_models_with_windowed_tables(tmp_path):
    """It keeps one table per prompt; a windowed table has passed most of its blocks by the end."""
    disk = KVDiskCache(tmp_path, "windowed")
    engine = Engine(tiny_any("gemma3_text", sliding_window=WINDOW), num_blocks=64, kv_disk_cache=disk)
    assert engine.stats()["kv_groups"] == [None, WINDOW]
    assert engine.stats()["disk_cache"] is False and engine.stats()["prefix_caching"] is True
    disk.close()


def reference_logprobs(model, prompt, max_tokens):
    """mlx-lm's greedy tokens and each one's log-probability."""
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, -1))
    return [(int(token), logprobs[int(token)].item()) for token, logprobs in steps]


@pytest.mark.parametrize("cap", [5.0, 50.0])  # 50: Gemma 2's own
def test_gemma2_s_softcapped_attention_matches_mlx_lm_with_preemption(cap):
    """Its own attention code softcaps the scores; the engine hands its layers to the kernel with the cap.
    The reference is a model of its own, which the engine has not adapted. The tiny model repeats its
    tokens, so their log-probabilities are compared too."""
    prompts = random_prompts([3, 31, 33, 70, 150, 250, 300, 90], seed=10)
    expected = [reference_logprobs(tiny_any("gemma2", attn_logit_softcapping=cap), p, 20) for p in prompts]
    model = tiny_any("gemma2", attn_logit_softcapping=cap)
    engine = Engine(model, block_size=16, num_blocks=64, max_num_batched_tokens=64)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=20, logprobs=0))
    for output, want in zip(outputs, expected):
        assert output.token_ids == [token for token, _ in want]
        assert max(abs(got.logprob - logprob) for got, (_, logprob) in zip(output.logprobs, want)) < 1e-4
    assert engine.stats()["preemptions"] > 0


def test_ministral3_s_positions_are_per_row():
    """Its attention scale grows with each row's own position (Llama 4 scaling)."""
    rope = {**ROPE, "llama_4_scaling_beta": 0.5, "original_max_position_embeddings": 16}
    model = tiny_any("ministral3", rope_parameters=rope)
    prompts = random_prompts([20, 45], seed=9)
    outputs = Engine(model, num_blocks=16).generate(prompts, SamplingParams(max_tokens=8))
    assert [o.token_ids for o in outputs] == [reference(model, p, 8) for p in prompts]


# -- the portable kernel's window, sinks and softcap against a dense reference ---------------------------


def dense_attention(queries, keys, values, scale, window, sinks, softcap=None):
    """Queries ``(n, Hq, D)`` at the last n positions over keys and values ``(L, Hkv, D)``, causal."""
    n, q_heads, _ = queries.shape
    length, kv_heads, _ = keys.shape
    rep = q_heads // kv_heads
    k = mx.repeat(keys, rep, axis=1).transpose(1, 2, 0)  # (Hq, D, L)
    v = mx.repeat(values, rep, axis=1).transpose(1, 0, 2)  # (Hq, L, D)
    scores = (queries.transpose(1, 0, 2) * scale) @ k  # (Hq, n, L)
    if softcap is not None:
        scores = mx.tanh(scores / softcap) * softcap
    q_pos, k_pos = mx.arange(length - n, length)[:, None], mx.arange(length)[None]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - (window or length))
    scores = mx.where(visible, scores, -mx.inf)
    if sinks is not None:
        scores = mx.concatenate([mx.broadcast_to(sinks[:, None, None], (q_heads, n, 1)), scores], axis=-1)
    probs = mx.softmax(scores, axis=-1)
    if sinks is not None:
        probs = probs[..., 1:]
    return (probs @ v).transpose(1, 0, 2)


class RowsOnCpu(FusedKernel):
    """The fused kernel's routing of a plan, with its decode kernels replaced by the portable rows that
    the self-check compares them with (the CPU has no fused kernels)."""

    name = "rows-on-cpu"
    dialect = CUDA  # rendered, never compiled

    def usable(self, *args) -> bool:
        return True

    def decode(self, queries, k_pool, v_pool, tables, lens, scale, window, sinks, softcap, table_starts):
        return decode_attention(queries, k_pool, v_pool, tables, lens, scale, window, sinks, table_starts, softcap)


@pytest.mark.parametrize("window", [None, 5, 24])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("kernel", ["portable", "portable-tiled", "fused-rows", "fused-chunks"])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_window_sinks_and_softcap_of_decode_and_prefill_rows_match_a_dense_reference(
    window, with_sinks, kernel, softcap, monkeypatch
):
    """Two decode rows and a 21-token prefill chunk over scattered 8-token blocks, 6 query / 2 KV heads.

    ``fused-*``: the fused kernel's plan routing (its decode rows over tables narrowed to the window, the
    prefill chunk as rows or through the portable prefill)."""
    if kernel == "portable-tiled":  # the prefill chunk goes over its context in 16-token tiles, some wholly
        monkeypatch.setattr("llm_paged_mlx.kernels.portable.prefill_tile", lambda *args: 16)  # before a window
    attention = PortableKernel() if kernel.startswith("portable") else RowsOnCpu()
    if kernel == "fused-chunks":
        attention.row_prefill_max_reads = 0
    mx.random.seed(3)
    block, kv_heads, q_heads, dim = 8, 2, 6, 16
    k_pool = mx.random.normal((20, kv_heads, block, dim))
    v_pool = mx.random.normal((20, kv_heads, block, dim))
    sinks = mx.random.normal((q_heads,)) if with_sinks else None
    tables = [[3, 7, 1, 12, 2], [9, 4, 0, 0, 0], list(range(10, 20))]
    lengths = [37, 11, 75]  # the prefill chunk's last query sees 75 tokens
    queries = mx.random.normal((2 + 21, q_heads, 1, dim))
    plan = AttentionPlan(
        block_size=block,
        positions=mx.array([36, 10] + list(range(54, 75)), dtype=mx.int32),
        slots=mx.zeros(23, dtype=mx.int32),
        num_decode=2,
        decode_block_tables=mx.array(tables[:2], dtype=mx.int32),
        decode_context_lens=mx.array(lengths[:2], dtype=mx.int32),
        prefills=[PrefillChunk(2, 21, 75, mx.array(tables[2], dtype=mx.int32))],
    )
    out = attention(queries, k_pool, v_pool, plan, 0.25, window=window, sinks=sinks, softcap=softcap)
    for table, length, rows in zip(tables, lengths, [slice(0, 1), slice(1, 2), slice(2, 23)]):
        keys = k_pool[mx.array(table)].transpose(0, 2, 1, 3).reshape(-1, kv_heads, dim)[:length]
        values = v_pool[mx.array(table)].transpose(0, 2, 1, 3).reshape(-1, kv_heads, dim)[:length]
        want = dense_attention(queries[rows, :, 0], keys, values, 0.25, window, sinks, softcap)
        assert mx.allclose(out[rows, :, 0], want, atol=1e-5).item()


def test_decode_reads_only_the_blocks_a_window_reaches():
    tables = mx.array([[5, 6, 7, 8, 9, 10], [1, 2, 3, 0, 0, 0], [11, 12, 13, 14, 15, 16]], dtype=mx.int32)
    lens = mx.array([45, 20, 8], dtype=mx.int32)  # 8-token blocks, window 10: at most 3 blocks
    narrow, start = window_tables(tables, lens, 10, 8)
    # Row 0 sees 35..44: blocks 4 and 5 (the third column repeats the last one; its positions are past the
    # context); row 1 sees 10..19: blocks 1 and 2; row 2 sees 0..7.
    assert narrow.tolist() == [[9, 10, 10], [2, 3, 0], [11, 12, 13]]
    assert start.tolist() == [32, 8, 0]
    same, start = window_tables(tables, lens, 40, 8)  # a window that can reach 6 blocks: all of them
    assert same is tables and start is None


def test_a_kernel_without_windows_is_refused_for_sliding_window_models(monkeypatch):
    monkeypatch.setattr("llm_paged_mlx.engine.engine.select_kernel", lambda name: BareKernel())
    with pytest.raises(ValueError, match="^gemma3_text: attention kernel 'bare' does not take a window"):
        Engine(tiny_any("gemma3_text"), num_blocks=16)


def test_a_kernel_without_softcapping_is_refused_for_gemma2(monkeypatch):
    monkeypatch.setattr("llm_paged_mlx.engine.engine.select_kernel", lambda name: BareKernel())
    with pytest.raises(ValueError, match="^gemma2: attention kernel 'bare' does not take softcapped scores"):
        Engine(tiny_any("gemma2"), num_blocks=16)
