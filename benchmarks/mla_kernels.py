"""Checks and times MLA decode attention over paged latent rows on an MLX GPU (one command on the H200).

    PYTHONPATH=. python3 benchmarks/mla_kernels.py [--quick]

DeepSeek-V3 shapes: 128 query heads, latent 512 + RoPE 64 per token, bf16, 16-token blocks scattered
at random. For 8 and 64 sequences at 4K, 32K and 128K context, timed in alternation (the median of
``--runs`` runs of one call each, after a warm-up call):

- ``mlx-lm``: mlx-lm's own absorbed decode over a contiguous cache (``deepseek_v3``'s code path:
  RoPE scores ``(q_pe * scale) @ k_pe.T`` as the mask of ``scaled_dot_product_attention`` over the
  latent as keys and values), the baseline;
- ``portable``: ``latent_attention`` of the portable kernel over the paged pool;
- ``fused``: ``latent_attention`` of the kernel the engine picks (``auto``) over the paged pool.

"TB/s" is the bytes of latent rows (latent + RoPE) a call reads over its time, against ``x * 2`` copy
bandwidth (read + written). First, both paged paths are checked against mlx-lm's in float32, per dtype.
``--sweep`` times the fused kernel's partition sizes and simd groups per threadgroup on one case.
``--mma-peak`` (CUDA; only this) measures what the instruction the fused kernel multiplies with, ``mma.sync``
(bf16, float32 sums), does with every warp busy and nothing else to do, against the arithmetic rate
that reading the cache at 70% of copy bandwidth would take at these shapes.
"""

import argparse
import datetime
import json
import statistics
import time

import mlx.core as mx
from h200_kernels import copy_bandwidth  # this folder

from llm_paged_mlx.kernels import AttentionPlan, select_kernel
from llm_paged_mlx.kernels.portable import PortableKernel

HEADS, LATENT, ROPE, BLOCK = 128, 512, 64, 16
DTYPE = mx.bfloat16
SCALE = 192**-0.5  # DeepSeek-V3: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)


def make_case(batch, context, dtype=DTYPE, seed=0):
    """A scattered latent pool, its plan, the same rows laid out contiguously, and queries. Built a
    piece at a time: MLX's CUDA backend does not launch random draws or gathers of 2^32 values."""
    mx.random.seed(seed)
    width = context // BLOCK
    num_blocks = batch * width + 1
    pieces = -(-num_blocks // (1 << 17))  # 2^17 blocks of 16 rows of 576 values: 1.2e9 values
    pool = mx.concatenate([
        mx.random.normal((len(ids), 1, BLOCK, LATENT + ROPE)).astype(dtype)
        for ids in (range(num_blocks)[i::pieces] for i in range(pieces))
    ])  # fmt: skip
    tables = (mx.random.permutation(num_blocks - 1) + 1).reshape(batch, width).astype(mx.int32)
    lens = mx.full((batch,), context, mx.int32)
    plan = AttentionPlan(BLOCK, lens - 1, lens - 1, batch, tables, lens)
    rows = [pool[tables[b]].reshape(1, 1, context, LATENT + ROPE) for b in range(batch)]  # (1, 1, L, R + P)
    latent = mx.concatenate([r[..., :LATENT] for r in rows])
    k_pe = mx.concatenate([r[..., LATENT:] for r in rows])
    q_nope = mx.random.normal((batch, HEADS, 1, LATENT)).astype(dtype)
    q_pe = mx.random.normal((batch, HEADS, 1, ROPE)).astype(dtype)
    mx.eval(pool, tables, latent, k_pe, q_nope, q_pe)
    return pool, plan, latent, k_pe, q_nope, q_pe


def mlx_lm_absorbed(q_nope, q_pe, latent, k_pe):
    """deepseek_v3's decode attention (L == 1) over a contiguous cache, before ``unembed_out``."""
    pe_scores = (q_pe * SCALE) @ k_pe.swapaxes(-1, -2)
    return mx.fast.scaled_dot_product_attention(q_nope, latent, latent, scale=SCALE, mask=pe_scores)


def paged(kernel, q_nope, q_pe, pool, plan):
    """What ``PagedLatentCache.attend`` hands the kernel."""
    rows = mx.concatenate([q_nope * SCALE, q_pe * SCALE], axis=-1)
    return kernel.latent_attention(rows, pool, LATENT, plan, 1.0)


def timed_together(fns, runs):
    """Median milliseconds per call of each function, timed in alternation (so drift hits all alike)."""
    for fn in fns.values():
        mx.eval(fn())
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            start = time.perf_counter()
            mx.eval(fn())
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def check(kernels):
    """Max |paged - mlx-lm| / max |mlx-lm| per kernel and dtype, mlx-lm's path in float32 over the same
    values: 3 sequences of 700 to 1600 tokens."""
    errors = {}
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        pool, plan, latent, k_pe, q_nope, q_pe = make_case(3, 1600, dtype, seed=1)
        lens = [700, 1600, 1033]
        plan.decode_context_lens = mx.array(lens, mx.int32)
        for name, kernel in kernels.items():
            have = paged(kernel, q_nope, q_pe, pool, plan).astype(mx.float32)
            worst = 0.0
            for row, length in enumerate(lens):
                inputs = (q_nope[row : row + 1], q_pe[row : row + 1], latent[row : row + 1, :, :length],
                          k_pe[row : row + 1, :, :length])  # fmt: skip
                want = mlx_lm_absorbed(*(x.astype(mx.float32) for x in inputs))
                worst = max(worst, (mx.abs(have[row : row + 1] - want).max() / mx.abs(want).max()).item())
            errors[f"{name} {dtype}"] = f"{worst:.1e}"
    return errors


def report(rows, bandwidth):
    print(f"\n{datetime.date.today()} {mx.device_info().get('device_name', '')} mlx {mx.__version__}")
    print("| seqs | context | mlx-lm ms | portable ms | fused ms | fused / mlx-lm | fused / portable | fused TB/s "
          "| of copy |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch, context, t, tbs in rows:
        print(f"| {batch} | {context // 1024}K | {t['mlx-lm']:.3f} | {t['portable']:.3f} | {t['fused']:.3f} | "
              f"{t['fused'] / t['mlx-lm']:.2f}x | {t['fused'] / t['portable']:.2f}x | {tbs:.2f} | "
              f"{tbs / bandwidth:.0%} |", flush=True)


def sweep(runs):
    """The fused kernel's partition sizes and simd groups, on 8 sequences of 32K tokens."""
    pool, plan, latent, k_pe, q_nope, q_pe = make_case(8, 32768)
    variants = {}
    for partition_size in (128, 256):
        for warps in (4, 8):
            kernel = select_kernel("auto")
            kernel.latent.partition_size, kernel.latent.warps = partition_size, warps
            if kernel.latent.usable(DTYPE, pool, HEADS, LATENT):
                variants[f"part {partition_size}, {warps} simd groups"] = kernel
    times = timed_together({name: (lambda k=k: paged(k, q_nope, q_pe, pool, plan)) for name, k in variants.items()},
                           runs)  # fmt: skip
    for name, ms in times.items():
        print(f"sweep 8 x 32K: {name}: {ms:.3f} ms", flush=True)


MMA_PEAK_SOURCE = """
const unsigned int one = 0x3f803f80u;  // two bf16 ones: sums stay finite over the loop
float c[CHAINS][4];
for (int j = 0; j < CHAINS; ++j) {
  for (int k = 0; k < 4; ++k) {
    c[j][k] = float(j);  // chains that start apart: the compiler cannot fold them into one
  }
}
for (int i = 0; i < ITERS; ++i) {
#pragma unroll
  for (int j = 0; j < CHAINS; ++j) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%4,%4,%4}, {%4,%4}, "
                 "{%0,%1,%2,%3};\\n"
                 : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3]) : "r"(one));
  }
}
float total = 0.0f;
for (int j = 0; j < CHAINS; ++j) {
  for (int k = 0; k < 4; ++k) {
    total += c[j][k];
  }
}
out[blockIdx.x * blockDim.x + threadIdx.x] = total;
"""


def mma_peak(runs, bandwidth):
    """TFLOP/s of independent ``mma.sync.m16n8k16`` chains in every warp of a full grid (from the time
    difference of two loop lengths, so launch costs cancel), and the rate 70% of copy bandwidth would need
    at 128 heads."""
    if not mx.cuda.is_available():
        raise SystemExit("--mma-peak times a CUDA instruction: it needs MLX's CUDA backend")
    chains, blocks, threads = 8, 2048, 256
    kernel = mx.fast.cuda_kernel("mma_sync_peak", ["unused"], ["out"], MMA_PEAK_SOURCE)
    unused = mx.zeros((1,), mx.float32)

    def run(iters):
        out = kernel(inputs=[unused], template=[("CHAINS", chains), ("ITERS", iters)], grid=(blocks * threads, 1, 1),
                     threadgroup=(threads, 1, 1), output_shapes=[(blocks * threads,)], output_dtypes=[mx.float32])[0]
        return out

    short, long = 1024, 8192
    for iters in (short, long):  # every product adds 16 ones to each of a thread's 4 x CHAINS sums
        got, want = run(iters)[0].item(), 16.0 * iters * 4 * chains + 4 * sum(range(chains))
        assert got == want, f"mma_sync_peak computed {got}, not {want}"
    times = timed_together({n: (lambda n=n: run(n)) for n in (short, long)}, runs)
    flops = blocks * threads // 32 * (long - short) * chains * 16 * 8 * 16 * 2
    per_byte = HEADS * (LATENT + ROPE + LATENT) * 2 / ((LATENT + ROPE) * DTYPE.size)
    print(f"mma.sync bf16 peak: {flops / ((times[long] - times[short]) * 1e-3) / 1e12:.0f} TFLOP/s "
          f"({times[short]:.3f} ms for {short} products per chain, {times[long]:.3f} ms for {long}); reading latent "
          f"rows at 70% of copy bandwidth at {HEADS} heads needs {0.7 * bandwidth * per_byte:.0f} TFLOP/s "
          f"({per_byte:.0f} FLOP per byte)", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--mma-peak", action="store_true")
    args = parser.parse_args()
    if args.mma_peak:
        mma_peak(args.runs, copy_bandwidth())
        return
    kernels = {"portable": PortableKernel(), "fused": select_kernel("auto")}
    print(f"check (fused: the {kernels['fused'].name} kernel):", json.dumps(check(kernels)), flush=True)
    if args.sweep:
        sweep(args.runs)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth: {bandwidth:.2f} TB/s", flush=True)
    cases = [(8, 4096), (64, 4096)] if args.quick else [(b, c) for c in (4096, 32768, 131072) for b in (8, 64)]
    rows = []
    for batch, context in cases:
        try:
            pool, plan, latent, k_pe, q_nope, q_pe = make_case(batch, context)
            times = timed_together({
                "mlx-lm": lambda: mlx_lm_absorbed(q_nope, q_pe, latent, k_pe),
                "portable": lambda: paged(kernels["portable"], q_nope, q_pe, pool, plan),
                "fused": lambda: paged(kernels["fused"], q_nope, q_pe, pool, plan),
            }, args.runs)  # fmt: skip
        except Exception as exc:  # report the case and go on to the next
            print(batch, context, "failed:", exc, flush=True)
            continue
        print(batch, context, json.dumps(times), flush=True)
        read = batch * context * (LATENT + ROPE) * DTYPE.size
        rows.append((batch, context, times, read / (times["fused"] * 1e-3) / 1e12))
        del pool, plan, latent, k_pe, q_nope, q_pe
        mx.clear_cache()  # the next case's arrays are larger: free what this one held, not just reuse it
    report(rows, bandwidth)


if __name__ == "__main__":
    main()
