"""The fused CUDA kernel against the float64 reference; runs only where MLX has CUDA.

Quantized pools are compared with the reference over their dequantized values.
"""

import copy
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from models import tiny_model
from test_engine import random_prompts
from test_engine import reference as mlx_lm_tokens
from test_kernels import make_case, make_plan, reference, rel_error

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.engine.step import StepPipeline
from llm_paged_mlx.engine.runner import ModelRunner
from llm_paged_mlx.kernels import quantized_matvec, select_kernel
from llm_paged_mlx.kernels.dialect import CUDA, WRITE_TEMPLATE, read_template
from llm_paged_mlx.kernels.fused import CudaKernel
from llm_paged_mlx.kernels.fused_check import check_error, check_rope, spaced_view
from llm_paged_mlx.kernels.in_place import InPlaceWrites
from llm_paged_mlx.kernels.plan import window_tables
from llm_paged_mlx.kernels.quantized import QuantizedPool
from llm_paged_mlx.models import adapt as adapt_module
from llm_paged_mlx.models import quantized_rows
from llm_paged_mlx.models.deferred_rope import DeferredRoPE
from llm_paged_mlx.models.merged_projections import MergedPart

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX with CUDA")

LIMIT = {mx.bfloat16: 1e-2, mx.float16: 1e-2, mx.float32: 1e-5}
# The kernel applies scale and bias in float32 (and folds them into the logits), the reference reads
# values dequantized in the pool's dtype.
QUANTIZED_LIMIT = {mx.bfloat16: 1e-2, mx.float16: 1e-2, mx.float32: 1e-4}

CASES = [
    # dtype, q_heads, kv_heads, dim, block_size, context lengths
    (mx.bfloat16, 32, 8, 128, 16, [1, 15, 17, 512, 513, 1300]),
    (mx.bfloat16, 8, 8, 64, 32, [1, 31, 33, 1100]),
    (mx.bfloat16, 16, 2, 256, 16, [2, 700, 47]),
    (mx.bfloat16, 28, 4, 128, 32, [1025, 5, 1]),  # GQA 7
    (mx.bfloat16, 24, 2, 64, 16, [900, 3]),  # GQA 12: two head groups per KV head
    (mx.float32, 32, 8, 128, 16, [1, 15, 17, 513, 1300]),
    (mx.float32, 16, 4, 64, 32, [1, 95, 2049]),
    (mx.float32, 8, 1, 256, 16, [600, 9]),
    (mx.float16, 32, 8, 128, 16, [1, 200, 1500]),
    (mx.float16, 8, 2, 128, 32, [77, 1]),  # these four fit one partition: no reduce pass
    (mx.bfloat16, 16, 8, 128, 16, [1, 100, 512]),
    (mx.bfloat16, 8, 8, 64, 32, [31, 480]),
    (mx.float32, 32, 8, 128, 16, [3, 511]),
]


QUANTIZED_CASES = [
    # dtype, q_heads, kv_heads, dim, block_size, bits, group_size, context lengths
    (mx.bfloat16, 32, 8, 128, 16, 4, 64, [1, 15, 17, 512, 513, 1300]),
    (mx.bfloat16, 32, 8, 128, 16, 8, 64, [1, 15, 17, 512, 513, 1300]),
    (mx.bfloat16, 8, 8, 64, 32, 4, 64, [1, 31, 33, 1100]),  # GQA 1
    (mx.bfloat16, 8, 8, 64, 32, 8, 64, [1, 31, 33, 1100]),
    (mx.float16, 64, 8, 128, 32, 4, 64, [2, 700, 47]),  # GQA 8
    (mx.bfloat16, 16, 2, 64, 16, 8, 64, [1025, 5, 1]),  # GQA 8
    (mx.bfloat16, 8, 2, 128, 32, 4, 32, [600, 9, 2100]),
    (mx.float32, 16, 4, 128, 16, 8, 128, [95, 2049, 1]),
    (mx.bfloat16, 16, 4, 128, 16, 4, 64, [3, 511]),  # one partition: no reduce pass
    (mx.bfloat16, 8, 1, 64, 32, 8, 32, [480, 31]),
]


def quantize(pool_np, dtype, bits, group_size):
    """A numpy pool (NaN at hidden positions) as a QuantizedPool whose hidden rows have NaN scales,
    and the values it stands for (float32, for the reference)."""
    hidden = np.isnan(pool_np).any(axis=-1, keepdims=True)
    values = mx.array(np.where(np.isnan(pool_np), 0.0, pool_np)).astype(dtype)
    pool = QuantizedPool(*mx.quantize(values, group_size, bits), bits, group_size)
    poisoned = QuantizedPool(pool.data, mx.where(mx.array(hidden), mx.nan, pool.scales), pool.biases, bits, group_size)
    return poisoned, np.array(pool.dequantize(mx.float32))


def cast(x, dtype):
    """numpy float32 -> MLX ``dtype``, and the rounded values back for the reference."""
    a = mx.array(x).astype(dtype)
    return a, np.array(a.astype(mx.float32))


@pytest.mark.parametrize("warps", [None, 4], ids=["warps chosen", "4 warps"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype,q_heads,kv_heads,dim,block_size,lens", CASES)
def test_fused_decode_matches_reference(seed, dtype, q_heads, kv_heads, dim, block_size, lens, warps):
    """Few rows take up to 16 simd groups a threadgroup (GQA 8: 8, whose sums at D=256 add up 3 at a time), or 4."""
    rng = np.random.default_rng(seed)
    k_np, v_np, tables = make_case(rng, lens, q_heads, kv_heads, dim, block_size, strict=True)
    q, q_np = cast(rng.standard_normal((len(lens), q_heads, 1, dim)).astype(np.float32), dtype)
    k_pool, k_np = cast(k_np, dtype)
    v_pool, v_np = cast(v_np, dtype)
    scale = dim**-0.5
    kernel = CudaKernel(poison_outputs=True, warps=warps)
    out = kernel.decode(q, k_pool, v_pool, mx.array(tables), mx.array(lens, mx.int32), scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_error(out, reference(q_np, k_np, v_np, tables, lens, scale)) <= LIMIT[dtype]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype,q_heads,kv_heads,dim,block_size,bits,group_size,lens", QUANTIZED_CASES)
def test_fused_decode_of_quantized_pools_matches_reference(
    seed, dtype, q_heads, kv_heads, dim, block_size, bits, group_size, lens
):
    rng = np.random.default_rng(seed)
    k_np, v_np, tables = make_case(rng, lens, q_heads, kv_heads, dim, block_size, strict=True)
    q, q_np = cast(rng.standard_normal((len(lens), q_heads, 1, dim)).astype(np.float32), dtype)
    k_pool, k_np = quantize(k_np, dtype, bits, group_size)
    v_pool, v_np = quantize(v_np, dtype, bits, group_size)
    scale = dim**-0.5
    kernel = CudaKernel(poison_outputs=True)
    assert kernel.supports(dtype, k_pool, v_pool, q_heads)
    out = kernel.decode(q, k_pool, v_pool, mx.array(tables), mx.array(lens, mx.int32), scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_error(out, reference(q_np, k_np, v_np, tables, lens, scale)) <= QUANTIZED_LIMIT[dtype]


WINDOW_CASES = [
    # dtype, q_heads, kv_heads, dim, block_size, window, sinks, softcap, context lengths
    (mx.bfloat16, 64, 8, 64, 16, 128, True, None, [1, 100, 128, 129, 700, 1300]),  # gpt-oss
    (mx.bfloat16, 32, 16, 128, 16, 1024, False, None, [1, 1000, 1024, 1025, 1500, 3000]),  # Gemma 3
    (mx.bfloat16, 16, 8, 256, 16, 4096, False, 50.0, [5, 4097, 4100, 5000]),  # Gemma 2
    (mx.float32, 8, 2, 64, 32, 33, True, 2.0, [1, 33, 34, 65, 600, 1100]),
    (mx.float16, 12, 4, 128, 16, 600, True, 1.0, [1, 599, 601, 1300, 2200]),  # GQA 3, a window over partitions
    (mx.bfloat16, 8, 8, 64, 32, None, True, 1.0, [1, 31, 33, 1100]),  # sinks and softcap, no window
]


def windowed_case(rng, lens, q_heads, kv_heads, dim, block_size, window):
    """``make_case``'s pools and tables, with what a window hides also NaN and, as in a windowed block
    table, the null block wherever a row's window no longer reaches."""
    k_np, v_np, tables = make_case(rng, lens, q_heads, kv_heads, dim, block_size, strict=True)
    for row, n in enumerate(lens if window else []):
        for position in range(max(0, n - window)):
            block, offset = tables[row, position // block_size], position % block_size
            k_np[block, :, offset] = v_np[block, :, offset] = np.nan
        tables[row, : max(0, n - window) // block_size] = 0
    return k_np, v_np, tables


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype,q_heads,kv_heads,dim,block_size,window,sinks,softcap,lens", WINDOW_CASES)
def test_fused_decode_with_windows_sinks_and_softcap_matches_reference(
    seed, dtype, q_heads, kv_heads, dim, block_size, window, sinks, softcap, lens
):
    """Over whole tables (partitions before a window are skipped) and over tables narrowed as the engine
    narrows them."""
    rng = np.random.default_rng(seed)
    k_np, v_np, tables = windowed_case(rng, lens, q_heads, kv_heads, dim, block_size, window)
    q, q_np = cast(rng.standard_normal((len(lens), q_heads, 1, dim)).astype(np.float32), dtype)
    k_pool, k_np = cast(k_np, dtype)
    v_pool, v_np = cast(v_np, dtype)
    sink_logits, sinks_np = cast(rng.standard_normal(q_heads).astype(np.float32) * 3, dtype) if sinks else (None,) * 2
    scale = dim**-0.5
    want = reference(q_np, k_np, v_np, tables, lens, scale, window, sinks_np, softcap)
    context_lens = mx.array(lens, mx.int32)
    whole = (mx.array(tables), None)
    layouts = [whole] if window is None else [whole, window_tables(mx.array(tables), context_lens, window, block_size)]
    for table, starts in layouts:
        out = CudaKernel(poison_outputs=True).decode(
            q, k_pool, v_pool, table, context_lens, scale, window, sink_logits, softcap, table_starts=starts
        )
        assert out.dtype == dtype and out.shape == q.shape
        assert rel_error(out, want) <= LIMIT[dtype], "narrowed" if starts is not None else "whole"


@pytest.mark.parametrize("row_prefill_max_reads", [0, 1 << 30])
@pytest.mark.parametrize("window,softcap", [(40, None), (200, 30.0), (None, 2.0)])
def test_cuda_kernel_serves_windowed_rows_through_the_plan(window, softcap, row_prefill_max_reads):
    """Decode rows and prefill chunks with a window, sinks and softcap: as rows of the fused kernel, or
    (long chunks) through the portable prefill; the self-check of each configuration passes."""
    rng = np.random.default_rng(9)
    plan, queries, k_np, v_np, row_tables, row_lens = make_plan(
        rng, 16, 4, 128, 16, decode_lens=[1, 17, 600], prefills=[(500, 30), (0, 9), (0, 1)], strict=False
    )
    q, q_np = cast(queries, mx.bfloat16)
    k_pool, k_np = cast(np.nan_to_num(k_np), mx.bfloat16)
    v_pool, v_np = cast(np.nan_to_num(v_np), mx.bfloat16)
    sinks, sinks_np = cast(rng.standard_normal(16).astype(np.float32), mx.bfloat16)
    kernel = CudaKernel()
    kernel.row_prefill_max_reads = row_prefill_max_reads
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the self-check passes
        out = kernel(q, k_pool, v_pool, plan, 0.1, window=window, sinks=sinks, softcap=softcap)
    want = reference(q_np, k_np, v_np, row_tables, row_lens, 0.1, window, sinks_np, softcap)
    assert rel_error(out, want) <= LIMIT[mx.bfloat16]
    assert all(kernel._checked.values())
    if row_prefill_max_reads:  # every row in the fused kernel: sinks in another dtype than the queries read the same
        again = kernel(q, k_pool, v_pool, plan, 0.1, window=window, sinks=sinks.astype(mx.float32), softcap=softcap)
        assert mx.array_equal(again, out).item()


@pytest.mark.parametrize(
    "broken",
    [
        ("const int lo = WINDOW && context - WINDOW > start ? context - WINDOW - start : 0;", "const int lo = 0;"),
        ("float total = SINKS ? PA_EXP(sink_logit - m) : 0.0f;", "float total = 0.0f;"),
    ],
)
def test_a_broken_window_or_sink_fails_the_self_check_of_those_configurations_only(broken):
    template = read_template()
    assert broken[0] in template
    kernel = CudaKernel(template=template.replace(*broken))
    pool = mx.zeros((2, 8, 16, 64), mx.bfloat16)
    with pytest.warns(RuntimeWarning, match="disagrees"):
        assert not kernel.usable(mx.bfloat16, pool, pool, 64, window=128, sinks=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel.usable(mx.bfloat16, pool, pool, 64)  # no window, no sinks: the same kernel passes


@pytest.mark.parametrize("row_prefill_max_reads", [0, 1 << 30])
@pytest.mark.parametrize("bits", [8, 4])
def test_cuda_kernel_serves_quantized_pools(bits, row_prefill_max_reads):
    """Decode rows and prefill chunks over quantized pools: as rows of the fused kernel, or (long chunks)
    through the portable prefill."""
    rng = np.random.default_rng(8)
    plan, queries, k_np, v_np, row_tables, row_lens = make_plan(
        rng, 16, 4, 128, 16, decode_lens=[1, 17, 600], prefills=[(500, 30), (0, 9), (0, 1)], strict=False
    )
    q, q_np = cast(queries, mx.bfloat16)
    k_pool, k_np = quantize(np.nan_to_num(k_np), mx.bfloat16, bits, 64)
    v_pool, v_np = quantize(np.nan_to_num(v_np), mx.bfloat16, bits, 64)
    kernel = CudaKernel()
    kernel.row_prefill_max_reads = row_prefill_max_reads
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the self-check passes
        out = kernel(q, k_pool, v_pool, plan, 0.1)
    assert rel_error(out, reference(q_np, k_np, v_np, row_tables, row_lens, 0.1)) <= LIMIT[mx.bfloat16]


@pytest.mark.parametrize("row_prefill_max_reads", [0, 1 << 30])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_cuda_kernel_serves_decode_and_prefill_rows(dtype, row_prefill_max_reads):
    rng = np.random.default_rng(7)
    plan, queries, k_np, v_np, row_tables, row_lens = make_plan(
        rng, 16, 4, 128, 16, decode_lens=[1, 17, 600], prefills=[(500, 30), (0, 9), (0, 1)], strict=False
    )
    q, q_np = cast(queries, dtype)
    k_pool, k_np = cast(np.nan_to_num(k_np), dtype)
    v_pool, v_np = cast(np.nan_to_num(v_np), dtype)
    kernel = CudaKernel()
    kernel.row_prefill_max_reads = row_prefill_max_reads
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the self-check passes
        out = kernel(q, k_pool, v_pool, plan, 0.1)
    # Long chunks go to MLX's SDPA (portable prefill), which is good to about 1e-4 in float32 on CUDA.
    limit = LIMIT[dtype] if row_prefill_max_reads else max(LIMIT[dtype], 2e-4)
    assert rel_error(out, reference(q_np, k_np, v_np, row_tables, row_lens, 0.1)) <= limit


def test_auto_picks_cuda():
    assert select_kernel("auto").name == "cuda"


def test_self_check_passes_for_the_shipped_source():
    kernel = CudaKernel()
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        assert kernel.usable(dtype, mx.zeros((2, 8, 16, 128), dtype), mx.zeros((2, 8, 16, 128), dtype), 32)


@pytest.mark.parametrize("bits,group_size", [(8, 64), (4, 64), (4, 32), (8, 128)])
def test_self_check_passes_for_quantized_pools(bits, group_size):
    kernel = CudaKernel()
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        pool = QuantizedPool(*mx.quantize(mx.zeros((2, 8, 16, 128), dtype), group_size, bits), bits, group_size)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert kernel.usable(dtype, pool, pool, 32)
        key = (str(mx.default_device()), dtype, 128, 16, 4, bits, group_size, None, False, False, False, None)
        assert key in kernel._checked


def test_broken_quantized_source_falls_back_for_quantized_pools_only():
    """A wrong dequantization fails the quantized self-check; full precision still uses the kernel."""
    broken = "dot[h] = k_scale * dot[h] + k_bias * q_sum[h];"
    template = read_template()
    assert broken in template
    kernel = CudaKernel(template=template.replace(broken, "dot[h] = k_scale * dot[h];"))
    rng = np.random.default_rng(12)
    plan, queries, k_np, v_np, row_tables, row_lens = make_plan(
        rng, 8, 2, 64, 16, decode_lens=[1, 40, 700], prefills=[], strict=False
    )
    k_pool, k_deq = quantize(np.nan_to_num(k_np), mx.float32, 4, 32)
    v_pool, v_deq = quantize(np.nan_to_num(v_np), mx.float32, 4, 32)
    with pytest.warns(RuntimeWarning, match="disagrees"):
        out = kernel(mx.array(queries), k_pool, v_pool, plan, 0.125)
    assert rel_error(out, reference(queries, k_deq, v_deq, row_tables, row_lens, 0.125)) < 1e-4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k, v = mx.array(np.nan_to_num(k_np)), mx.array(np.nan_to_num(v_np))
        out = kernel(mx.array(queries), k, v, plan, 0.125)
    ref = reference(queries, np.nan_to_num(k_np), np.nan_to_num(v_np), row_tables, row_lens, 0.125)
    assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize(
    "broken,message",
    [
        (("q[h][e] *= params[0];", "q[h][e] *= 2.0f * params[0];"), "disagrees"),  # wrong numbers
        (("const int lane = pa_tid % SIMD;", "const int lane = pa_tid % SIMD"), "failed"),  # no compile
    ],
)
def test_broken_source_fails_the_self_check_and_falls_back(broken, message):
    template = read_template()
    assert broken[0] in template
    kernel = CudaKernel(template=template.replace(*broken))
    rng = np.random.default_rng(11)
    plan, queries, k_np, v_np, row_tables, row_lens = make_plan(
        rng, 8, 2, 64, 16, decode_lens=[1, 40, 700], prefills=[], strict=False
    )
    args = (mx.array(queries), mx.array(np.nan_to_num(k_np)), mx.array(np.nan_to_num(v_np)), plan, 0.125)
    with pytest.warns(RuntimeWarning, match=message):
        out = kernel(*args)
    ref = reference(queries, np.nan_to_num(k_np), np.nan_to_num(v_np), row_tables, row_lens, 0.125)
    assert rel_error(out, ref) < 1e-5
    # the device is still healthy: the shipped kernel runs after the broken one
    good = CudaKernel()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rel_error(good(*args), ref) < 1e-5


# -- multi-head latent attention ------------------------------------------------------------------------

# The probabilities weigh the latent rounded to the dtype, as in flash attention.
LATENT_LIMIT = {mx.bfloat16: 2e-2, mx.float16: 1e-2}
LATENT_CASES = [
    # dtype, q_heads, row width, latent, block_size, context lengths
    (mx.bfloat16, 128, 576, 512, 16, [1, 15, 16, 17, 255, 256, 257, 1300]),  # DeepSeek-V3
    (mx.float16, 16, 576, 512, 16, [3, 700, 33]),  # DeepSeek-V2-Lite
    (mx.bfloat16, 32, 576, 512, 32, [1, 31, 600]),
    (mx.float16, 16, 288, 256, 16, [100, 513]),  # MiniCPM3: latent 256 + RoPE 32
    (mx.bfloat16, 16, 576, 512, 128, [1, 127, 129, 700]),  # a few bytes of block ids before the staged values
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype,q_heads,row,latent,block_size,lens", LATENT_CASES)
def test_fused_latent_decode_matches_reference(seed, dtype, q_heads, row, latent, block_size, lens):
    """Every slot a row must not see (past its context, unreferenced blocks) holds NaN."""
    rng = np.random.default_rng(seed)
    pool_np, _, tables = make_case(rng, lens, q_heads, 1, row, block_size, strict=True)
    q, q_np = cast(rng.standard_normal((len(lens), q_heads, 1, row)).astype(np.float32), dtype)
    pool, pool_np = cast(pool_np, dtype)
    scale = row**-0.5
    kernel = CudaKernel(poison_outputs=True)
    assert kernel.latent.supports(dtype, pool, q_heads, latent)
    params = mx.array([scale], mx.float32)
    out = kernel.latent.decode(q, pool, latent, mx.array(tables), mx.array(lens, mx.int32), params)
    assert out.dtype == dtype and out.shape == (len(lens), q_heads, 1, latent)
    want = reference(q_np, pool_np, pool_np, tables, lens, scale)[..., :latent]
    assert rel_error(out, want) <= LATENT_LIMIT[dtype]


@pytest.mark.parametrize("row_prefill_max_reads", [0, 1 << 30])
def test_cuda_kernel_serves_latent_rows_of_a_step(row_prefill_max_reads):
    """Decode rows and prefill chunks of an MLA layer: as rows of the fused kernel, or (long chunks)
    through the portable prefill; the self-check passes."""
    rng = np.random.default_rng(13)
    plan, queries, pool_np, _, row_tables, row_lens = make_plan(
        rng, 16, 1, 576, 16, decode_lens=[1, 17, 600], prefills=[(500, 30), (0, 9), (0, 1)], strict=False
    )
    q, q_np = cast(queries, mx.bfloat16)
    pool, pool_np = cast(np.nan_to_num(pool_np), mx.bfloat16)
    kernel = CudaKernel()
    kernel.row_prefill_max_reads = row_prefill_max_reads
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the self-check passes
        out = kernel.latent_attention(q, pool, 512, plan, 0.1)
    want = reference(q_np, pool_np, pool_np, row_tables, row_lens, 0.1)[..., :512]
    assert out.shape == (q.shape[0], 16, 1, 512)
    assert rel_error(out, want) <= LATENT_LIMIT[mx.bfloat16]
    assert list(kernel.latent._checked.values()) == [True]


@pytest.mark.parametrize(
    "broken,message",
    [
        (("probs[h * PROW + i] = static_cast<T>(p);", "probs[h * PROW + i] = static_cast<T>(2.0f * p);"),
         "disagrees"),
        (("    if (t + r < tokens) {\n      pa_copy", "    if (true) {\n      pa_copy"), "disagrees"),  # NaN slots
        (("const int lane = pa_tid % SIMD;", "const int lane = pa_tid % SIMD"), "failed"),  # no compile
    ],
)
def test_broken_latent_source_fails_the_self_check_and_falls_back(broken, message):
    template = read_template("latent_attention.in")
    assert broken[0] in template
    kernel = CudaKernel(latent_template=template.replace(*broken))
    rng = np.random.default_rng(14)
    plan, queries, pool_np, _, row_tables, row_lens = make_plan(
        rng, 16, 1, 576, 16, decode_lens=[1, 40, 700], prefills=[], strict=False
    )
    q, q_np = cast(queries, mx.bfloat16)
    pool, pool_np = cast(np.nan_to_num(pool_np), mx.bfloat16)
    with pytest.warns(RuntimeWarning, match=message):
        out = kernel.latent_attention(q, pool, 512, plan, 0.1)
    want = reference(q_np, pool_np, pool_np, row_tables, row_lens, 0.1)[..., :512]
    assert rel_error(out, want) <= LIMIT[mx.bfloat16]
    assert list(kernel.latent._checked.values()) == [False]


# -- K/V written in place -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_in_place_write_passes_its_self_check(dtype):
    writes = CudaKernel().writes
    assert writes.check_error(dtype, dtype) == 0.0
    assert writes.check_error(dtype, mx.float32) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert writes.usable(dtype, dtype)


@pytest.mark.parametrize("dtype,dim,block_size,rep,window,sinks", [
    (mx.bfloat16, 128, 16, 4, None, False), (mx.float32, 64, 32, 1, None, False), (mx.float16, 128, 16, 8, None, False),
    (mx.bfloat16, 128, 16, 12, None, False), (mx.bfloat16, 64, 16, 2, 100, True),
])  # fmt: skip
def test_decode_kernel_reads_and_writes_the_rows_own_k_v(dtype, dim, block_size, rep, window, sinks):
    """The rows' own slots are NaN in the pools: the kernel reads their K/V as given and writes them there."""
    kernel = CudaKernel()
    for one in (False, True):
        error = check_error(
            kernel, dtype, dim, block_size, rep, one_partition=one, window=window, sinks=sinks, new=True
        )
        assert error <= LIMIT[dtype]
    assert kernel.usable(dtype, mx.zeros((2, 2, block_size, dim), dtype), mx.zeros((2, 2, block_size, dim), dtype),
                         2 * rep, window, sinks, new=True)  # fmt: skip


@pytest.mark.parametrize("dtype,dim,rep,window,rotation", [
    (mx.bfloat16, 128, 4, None, (128, False)), (mx.float32, 64, 1, None, (64, True)),
    (mx.float16, 128, 8, None, (64, False)), (mx.bfloat16, 64, 2, 100, (32, True)),
    (mx.bfloat16, 128, 16, None, (128, False)),  # two head groups: each writes the own K/V it reads back
])  # fmt: skip
def test_decode_kernel_rotates_the_queries_and_keys_it_is_given(dtype, dim, rep, window, rotation):
    """RoPE in the kernel: unrotated queries and own keys, rotated as ``RopeSpec.rotate`` rotates them (whole
    rows and their first half, in pairs of halves or neighbours), the keys written rotated."""
    kernel = CudaKernel()
    for one in (False, True):
        error = check_error(kernel, dtype, dim, 16, rep, one_partition=one, window=window, new=True, rotation=rotation)
        assert error <= LIMIT[dtype]
    pools = [mx.zeros((2, 2, 16, dim), dtype)] * 2
    assert kernel.usable(dtype, *pools, 2 * rep, window, new=True, rope=check_rope(*rotation))
    assert not kernel.usable(dtype, *pools, 2 * rep, window, new=True, rope=check_rope(8, False))  # lanes straddle


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_an_engine_on_the_gpu_leaves_rope_to_the_kernel_and_gives_the_tokens_of_the_model_s_rope(arch, monkeypatch):
    """Decode steps hand the kernel unrotated rows: token for token the engine's whose layers rotate them, but
    where the kernel's rounding (its cosines, its float32 queries) flips a near tie (each request agrees up to 20
    tokens, all but one whole)."""
    model = tiny_model(arch)
    model.set_dtype(mx.bfloat16)
    apart = copy.deepcopy(model)
    prompts = random_prompts([12, 30, 45, 20, 1, 100, 17], seed=6)
    params = [SamplingParams(max_tokens=30 + 3 * i) for i in range(len(prompts))]
    ropes = []
    decode = CudaKernel.decode
    monkeypatch.setattr(CudaKernel, "decode",
                        lambda self, *a, **k: ropes.append(k.get("rope")) or decode(self, *a, **k))  # fmt: skip
    deferred = [o.token_ids for o in Engine(model, num_blocks=64).generate(prompts, params)]
    assert all(isinstance(layer.self_attn.rope, DeferredRoPE) for layer in model.layers)
    assert any(rope is not None for rope in ropes)
    monkeypatch.setattr(adapt_module, "defer_rope", lambda model: 0)
    separate = [o.token_ids for o in Engine(apart, num_blocks=64).generate(prompts, params)]
    assert all(got[:20] == want[:20] for got, want in zip(deferred, separate))
    assert sum(got == want for got, want in zip(deferred, separate)) >= len(prompts) - 1


def misaligned(x):
    """A view of ``x`` one element past a 16-byte boundary."""
    wide = mx.zeros((*x.shape[:-1], x.shape[-1] + 1), x.dtype)
    wide[..., 1:] = x
    return wide[..., 1:]


@pytest.mark.parametrize("view", [misaligned, spaced_view])
def test_a_decode_step_reads_inputs_of_any_strides(view):
    """Queries, own K/V, block tables and context lengths that no 16-byte load can read (misaligned, or
    strided within a row) give the output of the same values laid out contiguously (up to the order of
    a sum: the own token is attended apart) and the same pool writes."""
    rng = np.random.default_rng(0)
    lens = [1, 17, 300, 1300]  # one partition and several
    k_np, v_np, tables = make_case(rng, lens, 32, 8, 128, 16)
    q = mx.array(rng.standard_normal((len(lens), 32, 1, 128)).astype(np.float32)).astype(mx.bfloat16)
    own = [mx.array(rng.standard_normal((len(lens), 8, 128)).astype(np.float32)).astype(mx.bfloat16)
           for _ in range(2)]  # fmt: skip
    kernel = CudaKernel()

    def run(layout):
        pools = [mx.array(x).astype(mx.bfloat16) for x in (k_np, v_np)]  # fresh: written in place
        mx.eval(pools)
        out = kernel.decode(layout(q), *pools, layout(mx.array(tables)), layout(mx.array(lens, mx.int32)),
                            128**-0.5, new_rows=[layout(x) for x in own])  # fmt: skip
        mx.eval(out, pools)
        return [np.array(a.astype(mx.float32)) for a in (out, *pools)]

    (out, *pools), (want, *want_pools) = run(view), run(lambda x: x)
    np.testing.assert_allclose(out, want, rtol=2**-7, atol=1e-6)
    for got, expected in zip(pools, want_pools):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("line,rotated", [
    ("    PA_WRITABLE(T, v_pool)[slot_at + i] = new_v[own_v + i * new_v_strides[2]];\n", False),  # no own V written
    ("    pa_rope<T, VEC, ROT, TRAD>(q[h], pair, sub * VEC, rope + angles);\n", True),  # queries not rotated
], ids=["own k/v not written", "queries not rotated"])  # fmt: skip
def test_a_decode_kernel_that_misses_a_step_falls_back(line, rotated):
    template = read_template()
    assert line in template
    kernel = CudaKernel(template=template.replace(line, ""))
    pools = [mx.zeros((2, 2, 16, 64), mx.bfloat16)] * 2
    rope = {"rope": check_rope(64, False)} if rotated else {}
    with pytest.warns(RuntimeWarning, match="disagrees"):
        assert not kernel.usable(mx.bfloat16, *pools, 4, new=True, **rope)
    if rotated:  # the other configurations stand
        assert kernel.usable(mx.bfloat16, *pools, 4, new=True)
    assert kernel.usable(mx.bfloat16, *pools, 4)  # the other configurations stand


@pytest.mark.parametrize(
    "broken,message",
    [(("index[i / dk]", "index[0]"), "disagrees"), (("const pa_index_t dv", "const pa_index_t dv ="), "failed")],
)
def test_a_broken_in_place_write_fails_its_self_check(broken, message):
    template = read_template(WRITE_TEMPLATE)
    assert broken[0] in template
    writes = InPlaceWrites(CUDA, template=template.replace(*broken))
    with pytest.warns(RuntimeWarning, match=message):
        assert not writes.usable(mx.bfloat16, mx.bfloat16)


def _decode_peak(engine, prompt, steps):
    """Peak memory above the pools' while ``engine`` decodes ``prompt`` for ``steps`` tokens (after a warm-up),
    each step's pools held until the next is launched, as a GPU backend holds them while a step runs (a
    tiny model's steps end before the host has built the next)."""
    held, launch = [], engine.runner.launch

    def launch_holding(*outputs, **options):
        launch(*outputs, **options)
        held[:] = engine.runner.kv.arrays()

    engine.runner.launch = launch_holding
    request = engine.add_request(prompt, SamplingParams(max_tokens=steps + 8))
    for _ in range(8):
        engine.step()
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    while engine.has_unfinished():
        engine.step()
    assert request not in engine.requests
    return mx.get_peak_memory() - before


def test_decode_steps_launched_ahead_write_the_pools_in_place(monkeypatch):
    """With in-place writes, a step launched while the one before it runs copies no pool; with scatter
    writes (``write_and_attend`` declining) the same launches copy one, which the measure sees."""
    launched = []
    launch_ahead = StepPipeline._launch_ahead
    monkeypatch.setattr(StepPipeline, "_launch_ahead", lambda self, s: launched.append(1) or launch_ahead(self, s))
    model = tiny_model("llama")
    engine = Engine(model, num_blocks=4096)  # a pool array of 16 MiB
    array_bytes = engine.runner.kv.arrays()[0].nbytes
    in_place = _decode_peak(engine, random_prompts([20], seed=4)[0], 40)
    assert engine.runner.writes_in_place
    assert len(launched) >= 40 and in_place < array_bytes / 4
    monkeypatch.setattr(CudaKernel, "write_and_attend", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(ModelRunner, "writes_in_place", property(lambda self: True))  # launched ahead all the same
    engine = Engine(model, num_blocks=4096)
    assert _decode_peak(engine, random_prompts([20], seed=4)[0], 40) >= array_bytes


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_in_place_writes_and_steps_launched_ahead_give_the_tokens_of_scatter_writes(arch, dtype, monkeypatch):
    """Token for token what the engine gives with MLX's scatter writes, each step read before the next is
    launched; and, in float32, mlx-lm's tokens (but where the fused kernel's rounding, not the writes,
    flips a near tie: each request's tokens agree with mlx-lm's at least up to 30)."""
    model = tiny_model(arch)
    model.set_dtype(dtype)
    unmerged = copy.deepcopy(model)  # mlx-lm's reference runs on the model's own projections
    prompts = random_prompts([12, 30, 45, 20, 1, 100, 17], seed=3)
    params = [SamplingParams(max_tokens=30 + 3 * i) for i in range(len(prompts))]
    engine = Engine(model, num_blocks=64)
    in_place = [o.token_ids for o in engine.generate(prompts, params)]
    assert engine.runner.writes_in_place and engine.stats()["free_blocks"] == 63
    monkeypatch.setattr(CudaKernel, "write_and_attend", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(ModelRunner, "writes_in_place", property(lambda self: False))
    assert in_place == [o.token_ids for o in Engine(model, num_blocks=64).generate(prompts, params)]
    if dtype == mx.float32:
        expected = [mlx_lm_tokens(unmerged, p, q.max_tokens) for p, q in zip(prompts, params)]
        assert all(got[:30] == want[:30] for got, want in zip(in_place, expected))
        assert sum(got == want for got, want in zip(in_place, expected)) >= len(prompts) - 1


@pytest.mark.parametrize("bits", [None, 4])
def test_an_engine_on_the_gpu_merges_projections_and_gives_the_tokens_of_unmerged_ones(bits, monkeypatch):
    """Merged, a layer's q/k/v and gate/up products round as MLX's separate ones do (bf16 one unit in the
    last place at some row counts): token for token the engine's with unmerged projections, but where
    such a rounding flips a near tie (each request agrees up to 20 tokens, all but one whole)."""
    model = tiny_model("qwen3")
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    unmerged = copy.deepcopy(model)
    prompts = random_prompts([12, 30, 45, 20, 1, 100, 17], seed=5)
    params = [SamplingParams(max_tokens=30 + 3 * i) for i in range(len(prompts))]
    merged = [o.token_ids for o in Engine(model, num_blocks=64).generate(prompts, params)]
    assert type(model.layers[0].self_attn.q_proj) is MergedPart and type(model.layers[0].mlp.up_proj) is MergedPart
    monkeypatch.setattr(adapt_module, "merge_projections", lambda model: 0)
    separate = [o.token_ids for o in Engine(unmerged, num_blocks=64).generate(prompts, params)]
    assert type(unmerged.layers[0].self_attn.q_proj) is not MergedPart
    assert all(got[:20] == want[:20] for got, want in zip(merged, separate))
    assert sum(got == want for got, want in zip(merged, separate)) >= len(prompts) - 1


@pytest.mark.parametrize("dtype,bits,group_size", [
    (mx.bfloat16, 4, 64), (mx.float16, 4, 32), (mx.float32, 4, 128), (mx.bfloat16, 8, 64), (mx.float16, 8, 32),
])  # fmt: skip
def test_quantized_matvec_gives_the_product_of_the_dequantized_weights(bits, group_size, dtype):
    """The rows the engine gives it (1 and 2) and more (5: fewer outputs a simd group), outputs that fill no whole
    simd group (N = 1000), inputs that are not a multiple of a simd group's 1024 values (K = 1280), and one row
    that starts one value into an array (read a value at a time); against float64."""
    k, n = 1280, 1000
    mx.random.seed(bits + group_size)
    w = mx.random.normal((n, k)).astype(dtype)
    packed = mx.quantize(w, group_size=group_size, bits=bits)
    exact = np.asarray(mx.dequantize(*packed, group_size=group_size, bits=bits, dtype=mx.float32), dtype=np.float64)
    inputs = [mx.random.normal((rows, k)).astype(dtype) for rows in (1, 2, 5)]
    inputs.append(mx.random.normal((1, k + 1)).astype(dtype)[:, 1:])
    for x in inputs:
        got = quantized_matvec.quantized_matvec(x, *packed, bits, group_size)
        want = np.asarray(x.astype(mx.float32), dtype=np.float64) @ exact.T
        assert got.shape == want.shape and got.dtype == dtype
        error = np.linalg.norm(np.asarray(got.astype(mx.float32), dtype=np.float64) - want) / np.linalg.norm(want)
        assert error <= LIMIT[dtype], (x.shape, error)


def test_a_4_bit_engine_on_the_gpu_takes_the_matvec_kernel_and_gives_mlx_lm_s_tokens(monkeypatch):
    """One stream of a model whose products take the kernel (its threshold lowered to the tiny model's sizes):
    the tokens of mlx-lm's own loop on the same weights, in float32."""
    monkeypatch.setattr(quantized_rows, "MATVEC_MIN_WEIGHTS", 1)
    monkeypatch.setattr(quantized_rows, "_routes_agree", {})
    calls = []
    real = quantized_rows.quantized_matvec
    monkeypatch.setattr(quantized_rows, "quantized_matvec", lambda *a: calls.append(a[0].shape) or real(*a))
    model = tiny_model("llama")
    nn.quantize(model, group_size=32, bits=4)
    unfolded = copy.deepcopy(model)
    prompt = random_prompts([40], seed=4)[0]
    (out,) = Engine(model).generate([prompt], SamplingParams(max_tokens=12))
    assert calls and all(shape[0] <= quantized_rows.MATVEC_ROWS for shape in calls)
    assert out.token_ids == mlx_lm_tokens(unfolded, prompt, 12)
