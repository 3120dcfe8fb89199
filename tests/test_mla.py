"""Multi-head latent attention (MLA) on the paged engine: latent pools, their kernels, the models that use them."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.mla import MultiLinear
from models import nested_config, tiny_any, tiny_model
from test_engine import PROMPT_LENGTHS, random_prompts, reference, run_staggered

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.engine import model_check
from llm_paged_mlx.engine.disk.store import KVDiskCache
from llm_paged_mlx.engine.request import Request
from llm_paged_mlx.engine.scheduler import ScheduledChunk
from llm_paged_mlx.kernels import AttentionKernel, AttentionPlan, PrefillChunk
from llm_paged_mlx.kernels.dialect import CUDA
from llm_paged_mlx.kernels.fused import FusedKernel
from llm_paged_mlx.kernels.portable import PortableKernel, decode_attention
from llm_paged_mlx.models import attention_hook, paged_cache
from llm_paged_mlx.models.latent_shape import TILE_SCORE_BYTES, LatentShape, latent_shape, query_tile
from llm_paged_mlx.models.adapt import check_model
from llm_paged_mlx.models.paged_cache import PagedLatentCache

# The MLA models mlx-lm has, tiny: (architecture, ModelArgs overrides).
MODELS = {
    "deepseek_v2": ("deepseek_v2", dict(rope_scaling={"factor": 1.0})),  # caches full per-head K/V
    "minicpm3": ("minicpm3", dict(rope_scaling={})),  # caches full per-head K/V
    "deepseek_v3": ("deepseek_v3", {}),
    "glm4_moe_lite": ("glm4_moe_lite", {}),
    "longcat_flash": ("longcat_flash", {}),  # two attentions per layer, in a CacheList
    "kimi_k25": ("kimi_k25", {}),  # kv_lora_rank inside text_config
    "mistral3[mistral4]": ("mistral3", dict(text_config=nested_config("mistral4"))),
}
LATENT = {"deepseek_v3", "glm4_moe_lite", "longcat_flash", "kimi_k25", "mistral3[mistral4]"}


def tiny_mla(name, **overrides):
    arch, defaults = MODELS[name]
    return tiny_any(arch, **{**defaults, **overrides})


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_match_mlx_lm_with_preemption_and_prefix_caching(name, monkeypatch):
    """Ten requests of 1 to 640 tokens, staggered, in a pool that preempts; then a 250-token prompt twice, the
    second time from the prefix cache. MLA prompts take both formulations: the 600- and 640-token ones
    decompress their context, the others (and the 10 tokens after the cached prefix) are absorbed rows."""
    model = tiny_mla(name)
    prompts = random_prompts(PROMPT_LENGTHS, seed=5)
    engine = Engine(model, block_size=16, num_blocks=60, max_num_batched_tokens=128)
    assert all(layout.latent for layout in engine.runner.spec.attention) == (name in LATENT)
    calls = {"attend": 0, "attend_sequence": 0}
    for method in calls:
        def counted(*args, _method=getattr(PagedLatentCache, method), _name=method):
            calls[_name] += 1
            return _method(*args)

        monkeypatch.setattr(PagedLatentCache, method, counted)
    got = run_staggered(engine, prompts, SamplingParams(max_tokens=16), first=8)
    if name in LATENT:
        assert calls["attend"] > 0 and calls["attend_sequence"] > 0
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference(model, prompt, 16), f"prompt of {len(prompt)} tokens"
    assert engine.stats()["preemptions"] > 0
    first, again = (engine.generate([prompts[7]], SamplingParams(max_tokens=16))[0] for _ in range(2))
    assert again.num_cached_tokens == 240 and first.token_ids == again.token_ids == got[7]
    assert engine.stats()["free_blocks"] == 59


def test_a_latent_pool_holds_one_row_per_token_not_per_head():
    model = tiny_mla("deepseek_v3")  # 2 layers, 4 heads, latent 32 + RoPE 16, float32
    engine = Engine(model, num_blocks=16)
    assert [type(c) for c in engine.runner.kv.caches] == [PagedLatentCache] * 2
    assert [c.arrays[0].shape for c in engine.runner.kv.caches] == [(16 * 16, 48)] * 2
    assert sum(layout.bytes_per_token() for layout in engine.runner.spec.attention) == 2 * 48 * 4
    args = model.args  # what a cache of full per-head K/V would hold
    full = 2 * args.num_attention_heads * (args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim) * 4
    assert full / (2 * 48 * 4) == pytest.approx(4 * 64 / 48)


def test_latent_blocks_swap_to_cpu_and_come_back():
    model = tiny_mla("deepseek_v3")
    prompts = random_prompts([40, 300, 120, 7, 64, 200], seed=6)
    engine = Engine(model, num_blocks=30, max_num_batched_tokens=64, swap_policy="cpu")
    outs = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert engine.stats()["preemptions"] > 0
    assert [o.token_ids for o in outs] == [reference(model, p, 12) for p in prompts]
    assert engine.stats()["free_blocks"] == 29


def test_latent_blocks_round_trip_through_the_disk_tier(tmp_path):
    model = tiny_mla("glm4_moe_lite")
    prompt = random_prompts([70], seed=7)[0]
    params = SamplingParams(max_tokens=10)
    first = Engine(model, num_blocks=64, kv_disk_cache=KVDiskCache(tmp_path, "tiny-mla"))
    want = first.generate([prompt], params)[0].token_ids
    first.disk.flush()
    assert sorted(name for name, _, _ in first.runner.kv.block_layout())[:2] == ["latent.0", "latent.1"]
    second = Engine(model, num_blocks=64, kv_disk_cache=KVDiskCache(tmp_path, "tiny-mla"))
    out = second.generate([prompt], params)[0]
    assert out.num_disk_cached_tokens == 64 and out.token_ids == want == reference(model, prompt, 10)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_latent_rows_generate_with_preemption_and_prefix_caching(bits, monkeypatch, kv_bits_schedule_free):
    """Latent + RoPE rows of 64 values, quantized in groups of 32: a tight pool gives what a roomy one gives,
    and a 300-token prompt what it gives with every prompt token absorbed."""
    model = tiny_mla("deepseek_v3", kv_lora_rank=48)
    prompts = random_prompts([60, 90, 40, 75], seed=3)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    roomy = Engine(model, num_blocks=200, kv_bits=bits, kv_group_size=32)
    assert roomy.runner.kv.caches[0].arrays[0].dtype == mx.uint32
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    tight = Engine(model, num_blocks=14, kv_bits=bits, kv_group_size=32)
    assert [o.token_ids for o in tight.generate(prompts, params)] == want
    assert tight.stats()["preemptions"] > 0
    long = random_prompts([300], seed=4)
    decompressed = roomy.generate(long, params)[0].token_ids
    monkeypatch.setattr(LatentShape, "decompresses", lambda *args: False)
    assert Engine(model, num_blocks=200, kv_bits=bits, kv_group_size=32).generate(long, params)[0].token_ids == decompressed
    with pytest.raises(ValueError, match=r"kv_group_size 64 does not divide the width of the model's MLA rows "
                       r"\(latent \+ RoPE\) 48: no kv_group_size \(32, 64, 128\) does, so this model cannot use kv_bits"):
        Engine(tiny_mla("deepseek_v3"), kv_bits=8, kv_group_size=64)  # rows of 32 + 16


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", ["rotated", "straddling"])
@pytest.mark.parametrize("length", [40, 300])
def test_a_prompt_s_first_token_reads_no_quantized_latent(bits, rows, length):
    """Absorbed (40 tokens) and decompressed (300) prompt chunks attend to their own latent rows before
    quantization: the first token's log-probabilities are full precision's. Rows whose latent is whole groups
    are stored rotated, others (48 + 16) as they are."""
    dims = dict(kv_lora_rank=32, qk_rope_head_dim=32) if rows == "rotated" else dict(kv_lora_rank=48)
    model = tiny_mla("deepseek_v3", **dims)
    prompt = random_prompts([length], seed=4)[0]

    def first(**options):
        engine = Engine(model, num_blocks=64, **options)
        return engine, engine.generate([prompt], SamplingParams(max_tokens=1, logprobs=5))[0].logprobs[0].top

    _, want = first()
    engine, got = first(kv_bits=bits, kv_group_size=32)
    assert engine.runner.kv.caches[0].rotated == (rows == "rotated")
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-4


def test_prompt_chunks_decompress_when_that_takes_less_arithmetic_within_the_budget():
    """DeepSeek-V3's widths (latent 512, keys and values 128): absorbing wins only for a chunk of under 171
    queries after a long enough context; decompressing must leave room for 64 queries' scores at a time."""
    shape = LatentShape(heads=128, latent_dim=512, key_dim=128, value_dim=128, dtype=mx.bfloat16)
    roomy = 1 << 40
    assert not shape.decompresses(1, 100, roomy)
    assert shape.decompresses(64, 64, roomy)  # a whole short prompt
    assert shape.decompresses(171, 10**6, roomy) and not shape.decompresses(170, 10**6, roomy)
    assert shape.decompresses(100, 200, roomy) and not shape.decompresses(100, 300, roomy)  # 1/100 - 1/C vs 1/171
    # The model's RoPE scores, their masked copy and the per-head keys and values, and 64 queries' scores:
    per_query = 128 * 2048 * TILE_SCORE_BYTES
    need = 128 * 2048 * (512 + 256) * 2 * 2 + 64 * per_query
    assert shape.decompresses(512, 2048, need) and not shape.decompresses(512, 2048, need - 1)
    assert query_tile(128, 512, 2048, 256, mx.bfloat16, need + 10 * per_query) == 74
    assert shape.decompresses(60, 60, 128 * 60 * (60 + 256) * 4 + 60 * 128 * 60 * TILE_SCORE_BYTES)  # all 60 at once
    model = tiny_mla("glm4_moe_lite")
    args = model.args
    assert latent_shape(model, mx.float32) == LatentShape(
        args.num_attention_heads, args.kv_lora_rank, args.qk_nope_head_dim, args.v_head_dim, mx.float32
    )
    quantized = tiny_mla("glm4_moe_lite", qk_nope_head_dim=32)
    nn.quantize(quantized, group_size=32, bits=8, class_predicate=lambda _, m: isinstance(m, MultiLinear))
    assert latent_shape(quantized, mx.float16) == LatentShape(
        args.num_attention_heads, args.kv_lora_rank, 32, args.v_head_dim, mx.float16
    )
    assert latent_shape(tiny_mla("minicpm3"), mx.float32) is None  # caches full per-head K/V: never asked


def test_a_decompressed_chunk_attends_in_tiles_of_queries_that_fit_the_budget(monkeypatch):
    """With no budget left for scores, the hook attends one query at a time: still mlx-lm's tokens."""
    model = tiny_mla("deepseek_v3")  # 2 layers
    prompt = random_prompts([300], seed=8)[0]
    calls = []

    def counted(queries, *args, **kwargs):
        calls.append(queries.shape[2])
        return original(queries, *args, **kwargs)

    engine = Engine(model, num_blocks=32, max_num_batched_tokens=256)
    original = attention_hook.original_sdpa
    monkeypatch.setattr(attention_hook, "original_sdpa", counted)  # once the engine has installed its hook
    monkeypatch.setattr(paged_cache, "PREFILL_ATTENTION_BYTES", 0)
    got = engine.generate([prompt], SamplingParams(max_tokens=8))[0].token_ids
    assert calls == [1] * 2 * 300
    assert got == reference(model, prompt, 8)


def test_a_request_takes_one_formulation_however_a_step_cuts_its_prompt():
    """Decided on the request (new prompt tokens, at most a step's worth, over its context), so chunks of any
    size of one prompt go the same way: the two formulations round differently in low precision."""
    engine = Engine(tiny_mla("deepseek_v3"), num_blocks=64, max_num_batched_tokens=512, verify_model=False)
    runner = engine.runner
    long, short = (Request(i, list(range(n)), SamplingParams(), max_total_tokens=2000) for i, n in ((1, 600), (2, 255)))
    assert [runner._as_sequence(ScheduledChunk(long, n, [])) for n in (2, 17, 512)] == [True] * 3
    assert [runner._as_sequence(ScheduledChunk(short, n, [])) for n in (2, 17, 255)] == [False] * 3
    short.output_token_ids = list(range(50))  # recomputed after a preemption, with its outputs: still absorbed
    assert not runner._as_sequence(ScheduledChunk(short, 305, []))
    long.num_cached_tokens = 500  # 100 new tokens after a cached prefix: absorbed
    assert not runner._as_sequence(ScheduledChunk(long, 100, []))


def test_the_model_check_refuses_a_prompt_formulation_that_forgets_the_context_before_a_chunk(monkeypatch):
    original = PagedLatentCache.attend_sequence

    def forgetting(self, queries, keys, values, scale, mask):
        earlier = keys.shape[2] - queries.shape[2]  # the tokens before the chunk: their keys zeroed
        keys = mx.concatenate([mx.zeros_like(keys[:, :, :earlier]), keys[:, :, earlier:]], axis=2)
        return original(self, queries, keys, values, scale, mask)

    monkeypatch.setattr(model_check, "_verdicts", {})
    monkeypatch.setattr(PagedLatentCache, "attend_sequence", forgetting)
    with pytest.raises(ValueError, match="deepseek_v3: paged attention gives different logits than mlx-lm .* at the "
                                         "270-token prompt's prefill"):  # fmt: skip
        Engine(tiny_mla("deepseek_v3"), num_blocks=64)


# -- the portable kernel's latent attention against a dense reference --------------------------------


def dense_latent_attention(queries, latent_rows, value_dim, scale):
    """Each query ``(H, D)`` over the rows ``(L, D)`` before it, causally: softmax(q k^T) v, v = rows[:, :value_dim]."""
    scores = (queries.astype(mx.float32) * scale) @ latent_rows.astype(mx.float32).T  # (n, H, L)
    n, length = queries.shape[0], latent_rows.shape[0]
    visible = mx.arange(length)[None] <= mx.arange(length - n, length)[:, None]
    scores = mx.where(visible[:, None], scores, -mx.inf)
    return mx.softmax(scores, axis=-1) @ latent_rows[:, :value_dim].astype(mx.float32)


class LatentRowsOnCpu(FusedKernel):
    """The fused kernel's routing of an MLA plan, with its latent decode kernel replaced by the portable
    rows that its self-check compares it with (the CPU has no fused kernels)."""

    name = "latent-rows-on-cpu"
    dialect = CUDA  # rendered, never compiled

    def __init__(self):
        super().__init__()
        self.latent.usable = lambda *args: True
        self.latent.decode = self.portable_rows

    @staticmethod
    def portable_rows(queries, pool, value_dim, tables, lens, params):
        return decode_attention(queries, pool, pool, tables, lens, params[0].item())[..., :value_dim]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("kernel", ["portable", "portable-tiled", "fused-rows", "fused-chunks"])
def test_latent_attention_of_decode_and_prefill_rows_matches_a_dense_reference(dtype, kernel, monkeypatch):
    """Two decode rows and a prefill chunk of 21 tokens over 16-token blocks scattered in the pool.

    ``fused-*``: the fused kernel's routing (the prefill chunk as single-query rows, or through the
    portable causal attention)."""
    if kernel == "portable-tiled":  # the prefill chunk goes over its context in 32-token tiles
        monkeypatch.setattr("llm_paged_mlx.kernels.portable.prefill_tile", lambda *args: 32)
    attention = PortableKernel() if kernel.startswith("portable") else LatentRowsOnCpu()
    if kernel == "fused-chunks":
        attention.row_prefill_max_reads = 0
    mx.random.seed(1)
    heads, row, value_dim, block = 8, 72, 64, 16
    pool = mx.random.normal((12, 1, block, row)).astype(dtype)
    tables = [[3, 7, 1], [9, 2, 0], [5, 11, 4, 8, 6]]
    lengths = [40, 20, 70]  # the prefill chunk's last query sees 70 tokens
    queries = mx.random.normal((2 + 21, heads, 1, row)).astype(dtype)
    width = 3
    plan = AttentionPlan(
        block_size=block,
        positions=mx.array([39, 19] + list(range(49, 70)), dtype=mx.int32),
        slots=mx.zeros(23, dtype=mx.int32),
        num_decode=2,
        decode_block_tables=mx.array([t[:width] for t in tables[:2]], dtype=mx.int32),
        decode_context_lens=mx.array(lengths[:2], dtype=mx.int32),
        prefills=[PrefillChunk(2, 21, 70, mx.array(tables[2], dtype=mx.int32))],
    )
    out = attention.latent_attention(queries, pool, value_dim, plan, 0.2)
    assert out.shape == (23, heads, 1, value_dim) and out.dtype == dtype
    tolerance = {mx.float32: 1e-5, mx.float16: 5e-3, mx.bfloat16: 3e-2}[dtype]
    rows = [slice(0, 1), slice(1, 2), slice(2, 23)]
    for table, length, part in zip(tables, lengths, rows):
        context = pool[mx.array(table)].reshape(-1, row)[:length]
        want = dense_latent_attention(queries[part, :, 0], context, value_dim, 0.2)
        have = out[part, :, 0].astype(mx.float32)
        assert (mx.abs(have - want).max() / mx.abs(want).max()).item() < tolerance


def test_float32_decode_with_more_query_heads_per_kv_head_than_one_product_takes():
    """70 query heads per KV head go in slices of MAX_GATHER_ROWS (64, then 6); 2 KV heads keep their own."""
    mx.random.seed(2)
    pool = mx.random.normal((9, 2, 16, 40))
    queries = mx.random.normal((2, 140, 1, 40))
    tables, lengths = [[1, 2, 3], [4, 5, 0]], [40, 20]
    out = decode_attention(queries, pool, pool, mx.array(tables, dtype=mx.int32), mx.array(lengths, dtype=mx.int32), 0.3)
    for row, (table, length) in enumerate(zip(tables, lengths)):
        for kv_head in range(2):
            context = pool[mx.array(table), kv_head].reshape(-1, 40)
            heads = slice(70 * kv_head, 70 * (kv_head + 1))
            want = dense_latent_attention(queries[row : row + 1, heads, 0], context[:length], 40, 0.3)[0]
            assert mx.allclose(out[row, heads, 0], want, atol=1e-5).item()


# -- what is refused, and why ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, reason",
    [
        ("deepseek_v32", "sparse attention is not supported: its indexer reads cached keys directly"),
        ("glm_moe_dsa", "sparse attention is not supported: its indexer reads cached keys directly"),
        ("kimi_linear", "multi-head latent attention beside recurrent layers"),  # linear attention layers
        ("bailing_hybrid", "multi-head latent attention beside recurrent layers"),
    ],
)
def test_sparse_and_linear_attention_variants_are_refused_with_what_is_missing(arch, reason):
    with pytest.raises(ValueError, match=f"^{arch}: ") as refused:
        Engine(tiny_any(arch), num_blocks=16)
    assert reason in str(refused.value)


class TiedKVAttention(nn.Module):
    """One KV head whose cached K is also its V, with a float bias as the mask: not MLA."""

    def __init__(self, attention):
        super().__init__()
        self.inner = attention

    def __call__(self, x, mask=None, cache=None):
        a, (B, L, _) = self.inner, x.shape
        q = a.q_proj(x).reshape(B, L, a.n_heads, -1).transpose(0, 2, 1, 3)
        k = a.k_proj(x).reshape(B, L, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = a.rope(q, offset=cache.offset), a.rope(k, offset=cache.offset)
        k, _ = cache.update_and_fetch(k, k)
        bias = mx.broadcast_to(-0.1 * mx.arange(k.shape[2], dtype=q.dtype)[::-1], (B, a.n_heads, L, k.shape[2]))
        out = scaled_dot_product_attention(q, k, k, cache=cache, scale=a.scale, mask=bias)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def test_one_kv_head_used_as_k_and_v_with_a_float_mask_is_not_taken_for_mla():
    model = tiny_model("llama", num_key_value_heads=1)
    for layer in model.model.layers:
        layer.self_attn = TiedKVAttention(layer.self_attn)
    assert [layout.latent for layout in check_model(model).caches] == [False, False]


class BareKernel(AttentionKernel):
    """A plugin kernel with only the required interface: no ``latent_attention``, not ``windowed``."""

    name = "bare"
    auto_priority = 0

    def is_available(self):
        return True

    def __call__(self, *args):
        return PortableKernel()(*args)


def test_a_kernel_without_latent_attention_is_refused_for_mla_models(monkeypatch):
    monkeypatch.setattr("llm_paged_mlx.engine.engine.select_kernel", lambda name: BareKernel())
    with pytest.raises(ValueError, match="^deepseek_v3: attention kernel 'bare' has no latent_attention"):
        Engine(tiny_mla("deepseek_v3"), num_blocks=16)
