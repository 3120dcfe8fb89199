"""Issue E: quantized K/V blocks, bounded long prefill, pools that grow to a budget, and the auto budget."""

import mlx.core as mx
import pytest

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.engine import memory
from llm_paged_mlx.kernels import PrefillChunk, portable
from llm_paged_mlx.kernels.quantized import QuantizedPool, rotate, unrotate
from llm_paged_mlx.models.paged_cache import PagedLayerCache
from models import tiny_model
from test_engine import random_prompts, reference


def quantized_pool(pool, bits, group):
    return QuantizedPool(*mx.quantize(pool, group_size=group, bits=bits), bits, group)


def pools_and_tables(block_size, kv_heads, dim, rows=3, seed=0):
    lens = [1, block_size + 3, 5 * block_size - 2][:rows]
    width = -(-max(lens) // block_size)
    num_blocks = rows * width + 1
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    k_pool = mx.random.normal((num_blocks, kv_heads, block_size, dim), key=k1)
    v_pool = mx.random.normal((num_blocks, kv_heads, block_size, dim), key=k2)
    tables = (mx.random.permutation(num_blocks - 1, key=k3) + 1).reshape(rows, width).astype(mx.int32)
    return k_pool, v_pool, tables, mx.array(lens, mx.int32)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("dim", [64, 128])
def test_portable_kernel_reads_quantized_blocks_as_their_values(bits, block_size, gqa, dim):
    """Decode rows and a prefill chunk over quantized pools equal the same over the dequantized pools."""
    kv_heads, group = 2, 64
    k_pool, v_pool, tables, lens = pools_and_tables(block_size, kv_heads, dim)
    kq, vq = quantized_pool(k_pool, bits, group), quantized_pool(v_pool, bits, group)
    k_values, v_values = kq.dequantize(), vq.dequantize()
    assert not mx.allclose(k_values, k_pool)  # quantizing loses something: the test can tell the two apart
    queries = mx.random.normal((3, kv_heads * gqa, 1, dim), key=mx.random.key(5))
    scale = dim**-0.5
    got = portable.decode_attention(queries, kq, vq, tables, lens, scale)
    want = portable.decode_attention(queries, k_values, v_values, tables, lens, scale)
    assert mx.allclose(got, want, atol=1e-5).item()
    chunk = mx.random.normal((7, kv_heads * gqa, 1, dim), key=mx.random.key(6))
    context = int(lens[2])
    got = portable.prefill_attention(chunk, kq, vq, tables[2], context, scale)
    want = portable.prefill_attention(chunk, k_values, v_values, tables[2], context, scale)
    assert mx.allclose(got, want, atol=1e-5).item()


def test_a_quantized_cache_writes_keys_rotated_with_less_error_than_as_they_are_and_values_as_they_are():
    from llm_paged_mlx.kernels.plan import AttentionPlan

    cache = PagedLayerCache(4, 16, 2, 64, 64, mx.float32, portable.PortableKernel(), kv_bits=4, kv_group_size=32)
    keys, values = (mx.random.normal((3, 2, 1, 64), key=mx.random.key(seed)) for seed in (1, 2))
    keys[:, :, :, 5] = 20.0  # an outlier channel, as keys have
    slots = mx.array([16, 17, 40], mx.int32)
    cache.plan = AttentionPlan(16, slots, slots, 3, mx.zeros((3, 1), mx.int32), mx.ones(3, mx.int32))
    cache.update_and_fetch(keys, values)
    rows = cache.plan.write_indices(2)
    rows_of_keys, rows_of_values = keys.reshape(3, 2, 64), values.reshape(3, 2, 64)
    for part, written in zip(mx.quantize(rotate(rows_of_keys, 32), group_size=32, bits=4), cache.arrays[:3]):
        assert mx.array_equal(written[rows], part).item()
    for part, written in zip(mx.quantize(rows_of_values, group_size=32, bits=4), cache.arrays[3:]):
        assert mx.array_equal(written[rows], part).item()
    stored = mx.dequantize(*(a[rows] for a in cache.arrays[:3]), group_size=32, bits=4)
    error = mx.mean((unrotate(stored, 32) - rows_of_keys) ** 2).item()
    plain = mx.dequantize(*mx.quantize(rows_of_keys, group_size=32, bits=4), group_size=32, bits=4)
    assert error < 0.5 * mx.mean((plain - rows_of_keys) ** 2).item()  # rotated, an outlier no longer sets the step
    assert cache.nbytes < 4 * 2 * 16 * 64 * 4 * 2 / 4  # packed: less than a quarter of float32


def mixed_pools(pool, quantized, own, table, start):
    """The values a chunk over ``quantized`` should attend: the dequantized pool, with its own rows ``own``
    ``(n, H, D)`` (positions ``start`` on, through ``table``) as they were before quantization."""
    values = quantized.dequantize()
    block_size = pool.shape[2]
    for i in range(own.shape[0]):
        block, offset = int(table[(start + i) // block_size]), (start + i) % block_size
        values[block, :, offset] = own[i]
    return values


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("route", ["grouped", "head-grouped", "tiled", "tiled-windowed"])
def test_a_prefill_chunk_attends_to_its_own_k_v_before_quantization(bits, route):
    """Over quantized pools carrying the step's rows, a chunk reads earlier tokens quantized and its own as
    written, in each way the portable kernel computes a chunk."""
    kv_heads, dim, group, block_size = 2, 64, 64, 16
    k_pool, v_pool, tables, lens = pools_and_tables(block_size, kv_heads, dim)
    context, n = int(lens[2]), 20  # the chunk: the last 20 of 78 tokens
    table = tables[2]
    own_k, own_v = (mx.random.normal((n, kv_heads, dim), key=mx.random.key(s)) for s in (7, 8))
    kq, vq = (
        QuantizedPool(*mx.quantize(p, group_size=group, bits=bits), bits, group, step_rows=rows)
        for p, rows in ((k_pool, own_k), (v_pool, own_v))
    )
    own = portable.chunk_own_rows(kq, vq, PrefillChunk(0, n, context, table))
    want_k, want_v = (mixed_pools(*pools, table, context - n) for pools in ((k_pool, kq, own_k), (v_pool, vq, own_v)))
    queries = mx.random.normal((n, kv_heads * 4, 1, dim), key=mx.random.key(9))
    chunk, want_chunk = (queries, kq, vq, table, context, 0.125), (queries, want_k, want_v, table, context, 0.125)
    attend = {
        "grouped": lambda c, **kw: portable.grouped_prefill_attention(*c, kv_heads, **kw),
        "head-grouped": lambda c, **kw: portable.grouped_prefill_attention(*c, 1, **kw),
        "tiled": lambda c, **kw: portable.tiled_prefill_attention(*c, 32, **kw),
        "tiled-windowed": lambda c, **kw: portable.tiled_prefill_attention(*c, 32, window=30, **kw),
    }[route]
    got, want = attend(chunk, own=own), attend(want_chunk)
    assert mx.allclose(got, want, atol=1e-5).item()
    assert not mx.allclose(attend(chunk), want, atol=1e-3).item()  # reading its own rows quantized differs


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("tiles", [False, True])
def test_a_prompt_s_first_token_does_not_depend_on_quantized_k_v(bits, tiles, monkeypatch):
    """A prompt prefilled in one chunk reads no quantized K/V: its first token's log-probabilities are those of
    full precision (as in mlx-lm, whose cache quantizes a prompt only after its first chunk)."""
    if tiles:
        monkeypatch.setattr(portable, "PREFILL_ATTENTION_BYTES", 1 << 16)
    model = tiny_model("llama")
    prompt = random_prompts([300 if tiles else 40], seed=4)[0]

    def first(**options):
        engine = Engine(model, num_blocks=64, attention_kernel="portable", **options)
        return engine.generate([prompt], SamplingParams(max_tokens=1, logprobs=5))[0].logprobs[0].top

    want, got = first(), first(kv_bits=bits, kv_group_size=32)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-4


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_bytes_per_token_follow_the_bits(bits):
    engine = Engine(tiny_model("llama"), kv_budget_bytes=1 << 22, kv_bits=bits, kv_group_size=32)
    stats = engine.stats()
    assert stats["kv_bits"] == bits
    per_token = engine.runner.kv.nbytes / ((stats["num_blocks"] + 1) * stats["block_size"])
    full = 2 * 2 * 2 * 32 * 4  # layers x (K, V) x KV heads x head dim x float32
    expected = full if bits is None else full / 32 * bits + 2 * 2 * 2 * 2 * 4  # + a scale and bias per group
    assert per_token == expected


def test_quantized_k_v_generate_with_preemption_and_prefix_caching(kv_bits_schedule_free):
    """8-bit K/V through the whole engine: a tight pool (preemption, swapping), then a repeated prompt
    (prefix cache hit) gives the tokens it gave with room to spare."""
    model = tiny_model("qwen3")
    prompts = random_prompts([60, 90, 40, 75], seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    roomy = Engine(model, num_blocks=200, kv_bits=8, kv_group_size=32)
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    tight = Engine(model, num_blocks=14, kv_bits=8, kv_group_size=32)
    assert [o.token_ids for o in tight.generate(prompts, params)] == want
    assert tight.stats()["preemptions"] > 0
    again = tight.generate([prompts[2]], params)[0]
    assert again.token_ids == want[2] and again.num_cached_tokens > 0


def test_bad_quantization_settings_are_refused_with_the_reason():
    model = tiny_model("llama")  # head dim 32
    with pytest.raises(ValueError, match="kv_bits must be one of 8, 4"):
        Engine(model, kv_bits=3)
    with pytest.raises(ValueError, match="kv_group_size 64 does not divide the model's K/V head dimension 32"):
        Engine(model, kv_bits=4, kv_group_size=64)
    with pytest.raises(ValueError, match="kv_group_size must be one of"):
        Engine(model, kv_bits=4, kv_group_size=48)
    with pytest.raises(ValueError, match="kv_group_size must be a positive integer, got 0"):
        Engine(model, kv_bits=4, kv_group_size=0)


# -- long prefill in bounded memory ----------------------------------------------------------------


def test_a_prefill_chunk_over_a_long_context_goes_in_tiles_and_gives_mlx_lm_s_tokens(monkeypatch):
    """With a tiny attention bound every prefill chunk is computed tile by tile; the tokens stay mlx-lm's."""
    monkeypatch.setattr(portable, "PREFILL_ATTENTION_BYTES", 1 << 16)
    tiled = []
    real = portable.tiled_prefill_attention
    recording = lambda *a, **kw: tiled.append(a[6]) or real(*a, **kw)  # noqa: E731 (a[6]: the tile)
    monkeypatch.setattr(portable, "tiled_prefill_attention", recording)
    model = tiny_model("llama")
    prompt = random_prompts([300], seed=4)[0]
    engine = Engine(model, max_num_batched_tokens=64, attention_kernel="portable")  # fused ones serve short chunks as rows
    out = engine.generate([prompt], SamplingParams(max_tokens=8))[0]
    assert tiled and max(tiled) < 300
    assert out.token_ids == reference(model, prompt, 8)


@pytest.mark.parametrize("bits", [None, 4])
def test_prefill_by_groups_of_heads_and_by_tiles_agree(bits):
    """The fused-attention route, gathering the context for 1, 2 or all 4 KV heads at a time, and the
    tiled route give the same attention over a paged, possibly quantized, context."""
    k_pool, v_pool, tables, lens = pools_and_tables(16, 4, 64)
    if bits:
        k_pool, v_pool = quantized_pool(k_pool, bits, 64), quantized_pool(v_pool, bits, 64)
    queries = mx.random.normal((20, 8, 1, 64), key=mx.random.key(7))
    context = int(lens[2])
    args = (queries, k_pool, v_pool, tables[2], context, 0.125)
    want = portable.tiled_prefill_attention(*args, 32)
    for heads in (1, 2, 4):
        got = portable.grouped_prefill_attention(*args, heads)
        assert mx.allclose(got, want, atol=1e-5).item(), heads


def test_where_attention_runs_fused_the_context_is_gathered_a_few_heads_at_a_time(monkeypatch):
    """With MLX's fused attention (stood in for by its CPU path) and a bound that holds one KV head's
    context, prefill chunks gather one head at a time; the tokens stay mlx-lm's."""
    model = tiny_model("llama")  # 2 KV heads of 32
    prompt = random_prompts([300], seed=4)[0]
    bound = 300 * 2 * 2 * 32 * 4  # one head's K and V over the prompt, twice, in float32
    monkeypatch.setattr(portable, "PREFILL_ATTENTION_BYTES", bound)
    monkeypatch.setattr(portable, "fused_prefill", lambda n, k_pool, v_pool: n > 8)
    groups = []
    real = portable.grouped_prefill_attention
    recording = lambda *a, **kw: groups.append(a[6]) or real(*a, **kw)  # noqa: E731 (a[6]: the heads)
    monkeypatch.setattr(portable, "grouped_prefill_attention", recording)
    engine = Engine(model, max_num_batched_tokens=64, attention_kernel="portable")
    out = engine.generate([prompt], SamplingParams(max_tokens=8))[0]
    assert 1 in groups and 2 in groups  # short contexts: both heads at once; long ones: one at a time
    assert out.token_ids == reference(model, prompt, 8)


def test_fused_prefill_is_only_taken_on_a_gpu():
    k_pool = mx.zeros((4, 2, 16, 128), mx.bfloat16)
    assert portable.fused_prefill(64, k_pool, k_pool) == (mx.default_device() == mx.gpu)
    assert not portable.fused_prefill(64, k_pool.astype(mx.float32), k_pool.astype(mx.float32))  # float32: no
    assert not portable.fused_prefill(4, k_pool, k_pool)  # a few queries go through MLX's vector kernel


def test_tiled_prefill_memory_does_not_grow_with_the_context():
    """What a 256-query chunk's attention allocates is the same over 4K and over 16K tokens of context."""
    block_size, heads, dim = 16, 2, 64

    def peak(context):
        k_pool = mx.random.normal((context // block_size + 1, heads, block_size, dim))
        v_pool = mx.random.normal(k_pool.shape)
        queries = mx.random.normal((256, 4 * heads, 1, dim))
        table = mx.arange(1, context // block_size + 1).astype(mx.int32)
        mx.eval(k_pool, v_pool, queries, table)
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(portable.tiled_prefill_attention(queries, k_pool, v_pool, table, context, 0.1, 512))
        return mx.get_peak_memory() - base

    small, large = peak(4096), peak(16384)
    assert large < 1.1 * small + (1 << 20), (small, large)


# -- pools that grow to the budget -------------------------------------------------------------------


def test_the_pool_starts_small_and_grows_keeping_its_blocks(monkeypatch):
    from llm_paged_mlx.engine import sizing

    monkeypatch.setattr(sizing, "INITIAL_POOL_BYTES", 1)
    model = tiny_model("llama")
    engine = Engine(model, kv_budget_bytes=1 << 24, max_num_batched_tokens=32, max_num_seqs=2)
    start = engine.stats()["num_blocks"]
    assert start < engine.max_blocks - 1
    short, long = random_prompts([40, 700], seed=6)
    params = SamplingParams(max_tokens=6)
    assert engine.generate([short], params)[0].token_ids == reference(model, short, 6)
    assert engine.generate([long], params)[0].token_ids == reference(model, long, 6)
    assert engine.stats()["num_blocks"] > start
    again = engine.generate([short], params)[0]  # its blocks, cached before the pool grew, are still right
    assert again.num_cached_tokens == 32 and again.token_ids == reference(model, short, 6)


def test_a_prompt_that_can_never_fit_names_the_largest_context():
    engine = Engine(tiny_model("llama"), num_blocks=11)  # 10 usable blocks of 16 tokens
    with pytest.raises(ValueError, match="holds at most 159 prompt tokens; raise the budget"):
        engine.add_request(list(range(160)))
    engine.add_request(list(range(159)))  # the largest that fits is taken


# -- the auto budget ------------------------------------------------------------------------------


@pytest.fixture
def memory_limit(monkeypatch):
    """MLX's memory limit, put back after the test (an auto budget lowers it); the host memory available held at
    its value now, so that the test and the engine size from the same figure while other processes (other
    test workers) take and give back memory."""
    ram = memory.available_ram()
    monkeypatch.setattr(memory, "available_ram", lambda: ram)
    limit = mx.get_memory_limit()
    yield
    mx.set_memory_limit(limit)


def test_the_auto_budget_is_what_the_device_leaves(memory_limit):
    model = tiny_model("llama")
    total = 0.5 * memory.device_memory()
    engine = Engine(model, kv_budget_bytes="auto", memory_fraction=0.5)
    assert 0 < engine.kv_budget_bytes < total - mx.get_active_memory() + engine.runner.kv.nbytes
    assert mx.get_memory_limit() <= total
    with pytest.raises(ValueError, match=r"memory_fraction must be in \(0, 1\], got 1.5"):
        Engine(model, kv_budget_bytes="auto", memory_fraction=1.5)
    with pytest.raises(ValueError, match="no memory is left for the KV cache"):
        Engine(model, kv_budget_bytes="auto", memory_fraction=1e-6)
    with pytest.raises(ValueError, match="kv_budget_bytes must be a positive number of bytes, 'auto' or None, got 'lots'"):
        Engine(model, kv_budget_bytes="lots")


def test_a_workload_larger_than_the_budget_stays_under_the_cap(memory_limit):
    """A budget that holds a fraction of the work: requests are preempted and swapped, and peak memory stays
    under the total the auto budget was sized from."""
    model = tiny_model("llama", hidden_size=256, intermediate_size=512)
    mx.eval(model.parameters())
    reserve = memory.step_reserve(model, 64, 4)
    pool = 40 * 16 * 2 * 2 * 2 * 64 * 4  # 40 blocks
    fraction = (mx.get_active_memory() + reserve + pool) / memory.device_memory()
    cap = fraction * memory.device_memory()
    engine = Engine(model, kv_budget_bytes="auto", memory_fraction=fraction, max_num_batched_tokens=64, max_num_seqs=4)
    prompts = random_prompts([200, 260, 180, 240, 220, 300], seed=8)
    mx.reset_peak_memory()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    assert engine.stats()["preemptions"] > 0
    assert mx.get_peak_memory() <= cap
    assert outputs[0].token_ids == reference(model, prompts[0], 40)


def test_a_prompt_s_step_stays_within_its_reserve(monkeypatch):
    """A 2,000-token prompt's step, every layer paced as on a GPU (two layers in flight), allocates no more than
    ``step_reserve`` counts for it, the prefill attention's allowance cut to 16 MiB; in float32, the dtype the
    reserve counts every activation in. (The CPU backend computes a queued layer before it allocates much of
    the next, so this checks the reserve's size more than what pacing holds on a GPU.)"""
    from llm_paged_mlx.engine import runner
    from llm_paged_mlx.kernels.plan import LayerPacer
    from llm_paged_mlx.models import paged_cache

    overlapped, pace = [], LayerPacer.__call__

    def recorded(pacer, out, overlap):
        overlapped.append(overlap)
        return pace(pacer, out, overlap)

    monkeypatch.setattr(runner, "paces_layers", lambda: True)
    monkeypatch.setattr(paged_cache, "_overlaps", lambda *args: True)
    monkeypatch.setattr(LayerPacer, "__call__", recorded)
    monkeypatch.setattr(portable, "PREFILL_ATTENTION_BYTES", 16 << 20)
    monkeypatch.setattr(memory, "PREFILL_ATTENTION_BYTES", 16 << 20)
    model = tiny_model("llama", num_hidden_layers=6, hidden_size=512, intermediate_size=2048,
                       num_attention_heads=8, num_key_value_heads=2)  # fmt: skip
    engine = Engine(model, num_blocks=140, max_num_batched_tokens=2048, enable_prefix_caching=False)
    prompt = random_prompts([2000], seed=9)[0]
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    engine.generate([prompt], SamplingParams(max_tokens=1))
    assert mx.get_peak_memory() - base <= memory.step_reserve(model, 2048, 1)
    assert overlapped[-6:] == [True] * 6


@pytest.mark.parametrize("layout", ["keys rotated", "as mx.quantize gives them"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_blocks_round_trip_through_the_disk_tier(tmp_path, bits, layout, kv_read_from_pool, monkeypatch):
    """Blocks saved at ``kv_bits`` are read back by a new engine (another process, in effect) bit for bit."""
    from llm_paged_mlx.engine.disk.store import KVDiskCache

    monkeypatch.setattr(PagedLayerCache, "rotates_quantized_rows", layout == "keys rotated")
    model = tiny_model("llama")
    prompt = random_prompts([70], seed=12)[0]
    params = SamplingParams(max_tokens=10)
    options = dict(num_blocks=64, kv_bits=bits, kv_group_size=32)
    first = Engine(model, kv_disk_cache=KVDiskCache(tmp_path, f"tiny-q{bits}"), **options)
    want = first.generate([prompt], params)[0].token_ids
    first.disk.flush()
    second = Engine(model, kv_disk_cache=KVDiskCache(tmp_path, f"tiny-q{bits}"), **options)
    out = second.generate([prompt], params)[0]
    assert out.num_disk_cached_tokens == 64 and out.token_ids == want


def test_block_files_of_another_quantized_layout_are_never_read(tmp_path, kv_read_from_pool, monkeypatch):
    """Files of unrotated keys (an older layout: the same shapes and dtypes) under the same model id are
    removed as malformed when keys are stored rotated, and the prompt is computed: the tokens are the
    rotated engine's own."""
    from llm_paged_mlx.engine.disk.store import KVDiskCache, KVDiskCacheWarning

    model = tiny_model("llama")
    prompt = random_prompts([70], seed=12)[0]
    params = SamplingParams(max_tokens=10)
    options = dict(num_blocks=64, kv_bits=4, kv_group_size=32)

    def run(rotated: bool, disk: bool):
        monkeypatch.setattr(PagedLayerCache, "rotates_quantized_rows", rotated)
        engine = Engine(model, kv_disk_cache=KVDiskCache(tmp_path, "tiny-q4") if disk else None, **options)
        out = engine.generate([prompt], params)[0]
        if disk:
            engine.disk.flush()
        return out, engine

    old, _ = run(rotated=False, disk=True)
    want, _ = run(rotated=True, disk=False)
    assert want.token_ids != old.token_ids  # the layouts differ enough that reading one as the other shows
    with pytest.warns(KVDiskCacheWarning, match=r"has tensors \['k\.0'.*not the \['k_rotated\.0'.*removed it"):
        got, engine = run(rotated=True, disk=True)
    assert got.num_disk_cached_tokens == 0 and got.token_ids == want.token_ids
    assert engine.runner.kv.block_layout()[0][0] == "k_rotated.0"


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_a_rotation_keeps_every_score_and_its_inverse_undoes_it_in_each_dtype(group_size, dtype):
    keys, queries = (mx.random.normal((5, 256), key=mx.random.key(seed)).astype(dtype) for seed in (1, 2))
    want = (queries.astype(mx.float32) @ keys.astype(mx.float32).T)
    got = unrotate(queries, group_size).astype(mx.float32) @ rotate(keys, group_size).astype(mx.float32).T
    tolerance = 1e-4 if dtype == mx.float32 else 0.25  # the rotated rows are rounded to the dtype
    assert mx.allclose(got, want, atol=tolerance).item()
    assert not mx.allclose(rotate(keys, group_size), keys, atol=0.1).item()  # it does rotate
    back = unrotate(rotate(keys.astype(mx.float32), group_size), group_size)
    assert mx.allclose(back, keys.astype(mx.float32), atol=1e-5).item()


def test_pools_grow_at_least_twofold_up_to_the_budget():
    from llm_paged_mlx.engine.sizing import PoolSize

    pool = PoolSize(block_bytes=1024, max_blocks=100, initial_blocks=10, step_blocks=5, max_num_seqs=4, state_bytes=64)
    assert pool.budget_bytes == 100 * 1024 + 64
    assert pool.grown(10, 0) == pool.grown(10, -3) == 10  # nothing wanted: as they are
    assert pool.grown(10, 1) == 20  # doubled
    assert pool.grown(10, 25) == 35  # what is wanted, when that is more
    assert pool.grown(60, 1) == pool.grown(60, 500) == 100  # never past the budget
