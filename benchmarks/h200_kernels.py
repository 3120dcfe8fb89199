"""Checks and times paged decode attention on an MLX CUDA GPU (one command on the H200).

    PYTHONPATH=. python3 benchmarks/h200_kernels.py [--quick] [--engine] [--quantized] [--windowed]

1. Correctness: the fused CUDA kernel against the portable kernel (float32) per dtype / head dim /
   block size / GQA ratio, with every position a row must not see set to NaN.
2. Copy bandwidth: ``x * 2`` over 2 GiB of bf16 (bytes read + written).
3. Decode attention, 32 query / 8 KV heads, D=128, bf16, 16-token blocks scattered at random:
   contiguous SDPA (baseline), gather-then-SDPA, portable, fused, for 8 sequences at 1K-128K
   context and for 1 and 64 sequences. Each time is the median of 15 runs, each run one
   ``mx.eval`` of 4 independent calls, divided by 4; the methods of a row are timed in
   alternation, so drift of the shared machine hits them alike.
4. Fused variants (warps, partition size, another template) and prefill chunks served as
   rows of the fused kernel vs the portable prefill.
5. Quantized K/V (``--quantized`` runs this section alone): the fused kernel over bf16, 8-bit
   and 4-bit pools (group 64) of the same values, 1 and 8 sequences at 8K-128K context, timed
   in alternation; "GB/s" counts the K/V bytes a call reads (packed words, scales and biases).
6. Windows, sinks and softcap (``--windowed`` runs this section alone): decode rows of the
   gpt-oss-20B, Gemma-3-27B and Gemma-2-27B attention shapes at 8K and 32K context, 8 and 64
   sequences: SDPA over a contiguous cache of the window's last tokens (what mlx-lm's
   ``RotatingKVCache`` holds; the baseline), the portable kernel and the fused kernel, both over
   block tables narrowed to the window, timed in alternation.
7. With ``--engine``: then the end-to-end comparison of ``engine_throughput.py`` (the engine
   vs mlx-lm's BatchGenerator at 16 and 64 requests), so one command checks and times it all.

The last lines printed are the result table (followed by the engine's with ``--engine``).
"""

import argparse
import datetime
import json
import os
import statistics
import time

import engine_throughput  # this folder (a script's own directory is on sys.path)
import mlx.core as mx

from llm_paged_mlx.kernels.fused import CudaKernel
from llm_paged_mlx.kernels.fused_check import check_error
from llm_paged_mlx.kernels.plan import AttentionPlan, PrefillChunk, window_tables
from llm_paged_mlx.kernels.portable import decode_attention
from llm_paged_mlx.kernels.quantized import QuantizedPool

Q_HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
DTYPE = mx.bfloat16
INNER = 4


def timed(fn, runs=7, warmup=2):
    """Median milliseconds per call of ``fn``."""
    return timed_together({"fn": fn}, runs, warmup)["fn"]


def timed_together(fns, runs=15, warmup=2):
    """Median milliseconds per call of each function, timed in alternation (so drift hits all alike)."""
    for fn in fns.values():
        for _ in range(warmup):
            mx.eval([fn() for _ in range(INNER)])
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            start = time.perf_counter()
            mx.eval([fn() for _ in range(INNER)])
            times[name].append((time.perf_counter() - start) * 1e3 / INNER)
    return {name: statistics.median(t) for name, t in times.items()}


def copy_bandwidth(gib=2):
    x = mx.random.normal((gib << 29,)).astype(DTYPE)  # gib GiB of bf16
    mx.eval(x)
    ms = timed(lambda: x * 2)
    return 2 * x.nbytes / (ms * 1e-3) / 1e12


def make_case(batch, context, seed=0):
    """Scattered pools, their block tables and the same K/V laid out contiguously."""
    mx.random.seed(seed)
    width = context // BLOCK
    num_blocks = batch * width + 1
    shape = (num_blocks, KV_HEADS, BLOCK, DIM)
    k_pool = mx.random.normal(shape).astype(DTYPE)
    v_pool = mx.random.normal(shape).astype(DTYPE)
    tables = (mx.random.permutation(num_blocks - 1) + 1).reshape(batch, width).astype(mx.int32)
    lens = mx.full((batch,), context, mx.int32)
    queries = mx.random.normal((batch, Q_HEADS, 1, DIM)).astype(DTYPE)
    mx.eval(k_pool, v_pool, tables, queries, lens)
    return queries, k_pool, v_pool, tables, lens


def gather(pool, tables):
    batch, width = tables.shape
    blocks = pool[tables]  # (B, W, H, bs, D)
    return mx.contiguous(blocks.transpose(0, 2, 1, 3, 4).reshape(batch, KV_HEADS, width * BLOCK, DIM))


def bench_decode(batch, context, fused, methods, alt=None):
    queries, k_pool, v_pool, tables, lens = make_case(batch, context)
    k, v = gather(k_pool, tables), gather(v_pool, tables)
    mx.eval(k, v)
    scale = DIM**-0.5
    fns = {
        "sdpa": lambda: mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale),
        "gather_sdpa": lambda: mx.fast.scaled_dot_product_attention(
            queries, gather(k_pool, tables), gather(v_pool, tables), scale=scale
        ),
        "portable": lambda: decode_attention(queries, k_pool, v_pool, tables, lens, scale),
        "fused": lambda: fused.decode(queries, k_pool, v_pool, tables, lens, scale),
        "alt": lambda: alt.decode(queries, k_pool, v_pool, tables, lens, scale),
    }
    row = {"batch": batch, "context": context}
    ref = fns["sdpa"]().astype(mx.float32)
    for name in ("fused", "portable"):
        out = fns[name]().astype(mx.float32)
        row[f"{name}_err"] = (mx.abs(out - ref).max() / mx.abs(ref).max()).item()
    runnable = {}
    for name in methods:
        try:
            mx.eval(fns[name]())
            runnable[name] = fns[name]
        except Exception as exc:  # report and go on with the other methods
            row[name] = None
            print(f"  {name} failed at B={batch} ctx={context}: {exc}", flush=True)
    row.update(timed_together(runnable))
    row["kv_bytes"] = 2 * k.nbytes
    del queries, k_pool, v_pool, tables, lens, k, v, ref, out
    mx.clear_cache()
    return row


def bench_variants(batch, context, variants):
    queries, k_pool, v_pool, tables, lens = make_case(batch, context)
    out = timed_together(
        {
            name: lambda kernel=kernel: kernel.decode(queries, k_pool, v_pool, tables, lens, DIM**-0.5)
            for name, kernel in variants.items()
        }
    )
    del queries, k_pool, v_pool, tables, lens
    mx.clear_cache()
    return out


def bench_prefill(context, chunk, decode_batch=8):
    """A step of ``decode_batch`` decode rows plus one prefill chunk ending at ``context``."""
    queries, k_pool, v_pool, tables, lens = make_case(decode_batch + 1, context)
    rows = decode_batch + chunk
    q = mx.random.normal((rows, Q_HEADS, 1, DIM)).astype(DTYPE)
    plan = AttentionPlan(
        block_size=BLOCK,
        positions=mx.zeros((rows,), mx.int32),
        slots=mx.zeros((rows,), mx.int32),
        num_decode=decode_batch,
        decode_block_tables=tables[:decode_batch],
        decode_context_lens=lens[:decode_batch],
        prefills=[PrefillChunk(decode_batch, chunk, context, tables[decode_batch])],
    )
    result = {}
    for mode, limit in (("rows", 1 << 30), ("portable", 0)):
        kernel = CudaKernel()
        kernel.row_prefill_max_reads = limit
        result[mode] = timed(lambda: kernel(q, k_pool, v_pool, plan, DIM**-0.5))
    del queries, k_pool, v_pool, tables, q
    mx.clear_cache()
    return result


def pool_bytes(pool) -> int:
    if isinstance(pool, QuantizedPool):
        return pool.data.nbytes + pool.scales.nbytes + pool.biases.nbytes
    return pool.nbytes


def bench_quantized(batch, context, kernels, group_size=64):
    """The fused kernel over bf16, 8-bit and 4-bit pools of the same values (each quantized kind also
    with the other ``kernels``, e.g. other partition sizes): ms per call, GB/s read, error."""
    queries, k_pool, v_pool, tables, lens = make_case(batch, context)
    pools = {"bf16": (k_pool, v_pool)}
    for bits in (8, 4):
        pools[f"q{bits}"] = tuple(
            QuantizedPool(*mx.quantize(p, group_size, bits), bits, group_size) for p in (k_pool, v_pool)
        )
        mx.eval([(p.data, p.scales, p.biases) for p in pools[f"q{bits}"]])
    scale = DIM**-0.5
    fns = {}
    for name, kernel in kernels.items():
        for kind, (k, v) in pools.items():
            if name == "fused" or kind != "bf16":
                label = kind if name == "fused" else f"{kind}_{name}"
                fns[label] = lambda kernel=kernel, k=k, v=v: kernel.decode(queries, k, v, tables, lens, scale)
    row = {"batch": batch, "context": context}
    for kind, (k, v) in pools.items():
        # against the portable kernel over the values the pools stand for (bf16)
        values = [p.dequantize() if isinstance(p, QuantizedPool) else p for p in (k, v)]
        ref = decode_attention(queries, *values, tables, lens, scale).astype(mx.float32)
        out = fns[kind]().astype(mx.float32)
        row[f"{kind}_err"] = (mx.abs(out - ref).max() / mx.abs(ref).max()).item()
        row[f"{kind}_bytes"] = sum(pool_bytes(p) for p in (k, v))
        del values, ref, out
    row.update(timed_together(fns))
    del queries, k_pool, v_pool, tables, lens, pools, fns
    mx.clear_cache()
    return row


def quantized_section(report, quick=False):
    print("== quantized K/V: self-check errors (bf16, D=128, block 16, GQA 4) ==", flush=True)
    checker = CudaKernel()
    for bits in (8, 4):
        for one in (False, True):
            err = check_error(checker, DTYPE, DIM, BLOCK, Q_HEADS // KV_HEADS, one_partition=one, bits=bits)
            print(f"  {bits}-bit group 64, one partition {one}: {err:.2e}", flush=True)
    kernels = {"fused": CudaKernel(), "p1024": CudaKernel(partition_size=1024), "w8": CudaKernel(warps=8)}
    grid = [(batch, context) for batch in (1, 8) for context in (8192, 32768, 131072)]
    if quick:
        grid = [(1, 131072), (8, 131072)]
    rows = []
    print("== decode attention over quantized pools (ms per call) ==", flush=True)
    for batch, context in grid:
        row = bench_quantized(batch, context, kernels)
        rows.append(row)
        print("  ", json.dumps(row), flush=True)
    report["quantized"] = rows
    return rows


def print_quantized(rows):
    print("\nfused decode, 32/8 heads, D=128, bf16 values, block 16, group 64: ms per call (GB/s of K/V read)")
    print("  B  context        bf16              8-bit             4-bit     4-bit/bf16  err bf16/q8/q4    "
          "q8 p1024  q4 p1024   q8 w8   q4 w8")
    for r in rows:
        cells = [f"{r[k]:7.3f} ({r[f'{k}_bytes'] / (r[k] * 1e-3) / 1e9:5.0f})" for k in ("bf16", "q8", "q4")]
        alts = "".join(f"  {r[k]:7.3f}" for k in ("q8_p1024", "q4_p1024", "q8_w8", "q4_w8"))
        errs = "/".join(f"{r[f'{k}_err']:.0e}" for k in ("bf16", "q8", "q4"))
        print(f"{r['batch']:3d} {r['context']:8d}  {'  '.join(cells)}  {r['q4'] / r['bf16']:9.2f}  {errs}  {alts}")


# name: (query heads, KV heads, head dim, window, sinks, softcap)
WINDOWED_SHAPES = {
    "gpt-oss-20b": (64, 8, 64, 128, True, None),
    "gemma-3-27b": (32, 16, 128, 1024, False, None),
    "gemma-2-27b": (32, 16, 128, 4096, False, 50.0),
}


def bench_windowed(shape, batch, context):
    """One windowed shape: ms per call of SDPA over the window's last tokens, portable and fused."""
    q_heads, kv_heads, dim, window, with_sinks, softcap = WINDOWED_SHAPES[shape]
    mx.random.seed(0)
    width = context // BLOCK
    num_blocks = batch * width + 1
    k_pool, v_pool = (mx.random.normal((num_blocks, kv_heads, BLOCK, dim)).astype(DTYPE) for _ in range(2))
    tables = (mx.random.permutation(num_blocks - 1) + 1).reshape(batch, width).astype(mx.int32)
    lens = mx.full((batch,), context, mx.int32)
    queries = mx.random.normal((batch, q_heads, 1, dim)).astype(DTYPE)
    sinks = mx.random.normal((q_heads,)).astype(DTYPE) if with_sinks else None
    narrowed, starts = window_tables(tables, lens, window, BLOCK)
    last = tables[:, -(-window // BLOCK) :]  # the window's blocks (context is a multiple of the block size)

    def contiguous(pool):
        blocks = pool[last]  # (B, W, H, bs, D)
        keys = blocks.transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, -1, dim)
        return mx.contiguous(keys[:, :, -window:])

    k, v = contiguous(k_pool), contiguous(v_pool)
    mx.eval(k_pool, v_pool, tables, lens, queries, narrowed, starts, k, v)
    scale = dim**-0.5
    fused, masking = CudaKernel(), {"window": window, "sinks": sinks, "softcap": softcap}
    fns = {
        "portable": lambda: decode_attention(queries, k_pool, v_pool, narrowed, lens, scale, window, sinks, starts,
                                             softcap),
        "fused": lambda: fused.decode(queries, k_pool, v_pool, narrowed, lens, scale, **masking, table_starts=starts),
    }  # fmt: skip
    if softcap is None:  # MLX's attention does not cap scores (mlx-lm's Gemma 2 computes them in full)
        fns["sdpa"] = lambda: mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, sinks=sinks)
    ref = fns["portable"]().astype(mx.float32)
    out = fns["fused"]().astype(mx.float32)
    error = (mx.abs(out - ref).max() / mx.abs(ref).max()).item()
    row = {"shape": shape, "batch": batch, "context": context, "fused_err": error}
    if "sdpa" in fns:  # the baseline computes the same attention
        row["sdpa_err"] = (mx.abs(fns["sdpa"]().astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()
    row.update(timed_together(fns))
    del k_pool, v_pool, k, v, ref, out
    mx.clear_cache()
    return row


def windowed_section(report, quick=False):
    print("== windows, sinks, softcap: self-check errors ==", flush=True)
    checker = CudaKernel()
    for shape, (q_heads, kv_heads, dim, window, sinks, softcap) in WINDOWED_SHAPES.items():
        for one in (False, True):
            err = check_error(checker, DTYPE, dim, BLOCK, q_heads // kv_heads, kv_heads, one, None, None, window,
                                      sinks, softcap is not None)  # fmt: skip
            print(f"  {shape}, one partition {one}: {err:.2e}", flush=True)
    grid = [
        (shape, batch, context)
        for shape, (_, kv_heads, dim, *_) in WINDOWED_SHAPES.items()
        for batch in (8, 64)
        for context in (8192, 32768)
        if batch * context * kv_heads * dim < 1 << 31  # MLX's CUDA backend fails to make larger random pools
    ]
    if quick:
        grid = grid[:2]
    rows = []
    print("== windowed decode attention (ms per call) ==", flush=True)
    for case in grid:
        rows.append(bench_windowed(*case))
        print("  ", json.dumps(rows[-1]), flush=True)
    report["windowed"] = rows
    return rows


def print_windowed(rows):
    print("\nwindowed decode, bf16, block 16, tables narrowed to the window: ms per call")
    print("  shape          B  context    sdpa  portable    fused  fused/sdpa  fused/portable  err")
    for r in rows:
        sdpa = f"{r['sdpa']:7.3f}" if "sdpa" in r else "      -"
        ratio = f"{r['fused'] / r['sdpa']:10.2f}" if "sdpa" in r else "         -"
        print(f"  {r['shape']:12s} {r['batch']:3d} {r['context']:8d} {sdpa} {r['portable']:9.3f} {r['fused']:8.3f}"
              f"  {ratio}  {r['fused'] / r['portable']:14.2f}  {r['fused_err']:.0e}")


def save(report: dict, name: str) -> None:
    """The report as JSON in $OUT (what the device tool brings back), if set."""
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(report, f, indent=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    parser.add_argument("--alt-template", help="also time the fused kernel built from this template")
    parser.add_argument("--engine", action="store_true", help="then run engine_throughput.py at 16 and 64 requests")
    parser.add_argument("--quantized", action="store_true", help="only the quantized K/V section")
    parser.add_argument("--windowed", action="store_true", help="only the windows, sinks and softcap section")
    args = parser.parse_args()
    report = {"date": datetime.date.today().isoformat(), "mlx": mx.__version__}
    try:
        report["gpu"] = mx.device_info().get("device_name", "?")
    except Exception:
        report["gpu"] = "?"
    print(f"MLX {report['mlx']} on {report['gpu']}, {report['date']}", flush=True)
    sections = {"quantized": (quantized_section, print_quantized), "windowed": (windowed_section, print_windowed)}
    for name, (section, show) in sections.items():
        if getattr(args, name):  # that section alone
            rows = section(report, args.quick)
            save(report, f"h200_kernels_{name}.json")
            show(rows)
            return

    print("== correctness: fused vs portable (relative error) ==", flush=True)
    checker = CudaKernel()
    checks = []
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        for dim, block, rep in ((128, 16, 4), (64, 32, 1), (256, 16, 8), (128, 32, 7), (128, 16, 16)):
            err = check_error(checker, dtype, dim, block, rep)
            checks.append((str(dtype), dim, block, rep, err))
            print(f"  {dtype} D={dim} bs={block} gqa={rep}: {err:.2e}", flush=True)
    report["checks"] = checks

    report["copy_tbps"] = copy_bandwidth()
    print(f"== copy bandwidth (x*2, read+write): {report['copy_tbps']:.2f} TB/s ==", flush=True)

    fused = CudaKernel()
    all_methods = ["sdpa", "gather_sdpa", "portable", "fused"]
    alt = None
    if args.alt_template:
        with open(args.alt_template) as f:
            alt = CudaKernel(template=f.read())
        print(f"alt = {args.alt_template}: error {check_error(alt, DTYPE, DIM, BLOCK, 4):.1e}", flush=True)
        all_methods.append("alt")
    grid = [(8, c) for c in (1024, 4096, 8192, 32768, 131072)]
    grid += [(1, c) for c in (4096, 32768, 131072)] + [(64, c) for c in (1024, 4096, 32768)]
    if args.quick:
        grid = [(8, 4096), (8, 131072)]
    rows = []
    print("== decode attention (ms per call) ==", flush=True)
    for batch, context in grid:
        methods = [m for m in all_methods if m != "gather_sdpa" or batch * context <= 8 * 131072]
        row = bench_decode(batch, context, fused, methods, alt)
        rows.append(row)
        print("  ", json.dumps(row), flush=True)
    report["decode"] = rows

    print("== fused variants (ms) ==", flush=True)
    variants = {
        "default": CudaKernel(),
        "warps8": CudaKernel(warps=8),
        "part256": CudaKernel(partition_size=256),
        "part1024_w8": CudaKernel(partition_size=1024, warps=8),
    }
    if alt:
        variants["alt"] = alt
    report["variants"] = []
    for batch, context in [(8, 4096), (8, 32768), (8, 131072), (1, 131072), (64, 4096)][: 2 if args.quick else None]:
        v = bench_variants(batch, context, variants)
        report["variants"].append({"batch": batch, "context": context, **v})
        print(f"  B={batch} ctx={context}: {json.dumps(v)}", flush=True)

    print("== prefill chunk with 8 decode rows: rows in the fused kernel vs portable prefill (ms) ==", flush=True)
    report["prefill"] = []
    prefill_cases = [(4096, 16), (4096, 32), (4096, 64), (4096, 128), (4096, 512), (32768, 16), (32768, 64), (32768, 512)]
    for context, chunk in prefill_cases[: 2 if args.quick else None]:
        p = bench_prefill(context, chunk)
        report["prefill"].append({"context": context, "chunk": chunk, **p})
        print(f"  ctx={context} chunk={chunk}: {json.dumps(p)}", flush=True)

    quantized_rows = quantized_section(report, args.quick)

    save(report, "h200_kernels.json")

    print(f"\nMLX {report['mlx']}, {report['gpu']}, {report['date']}; copy {report['copy_tbps']:.2f} TB/s")
    print("  B  context   sdpa  gather  portable   fused  fused/sdpa  fused TB/s  % copy  err     alt")
    for r in rows:
        cell = lambda k: f"{r[k]:7.3f}" if r.get(k) is not None else "      -"  # noqa: E731
        tbps = r["kv_bytes"] / (r["fused"] * 1e-3) / 1e12
        print(
            f"{r['batch']:3d} {r['context']:8d} {cell('sdpa')} {cell('gather_sdpa')} {cell('portable')}"
            f" {cell('fused')}  {r['fused'] / r['sdpa']:9.2f}  {tbps:9.2f}  {100 * tbps / report['copy_tbps']:5.0f}%"
            f"  {r['fused_err']:.0e}  {cell('alt')}"
        )
    print_quantized(quantized_rows)

    if args.engine:
        print()
        engine_throughput.main(["--concurrency", "16", "64", "--kernels", "auto"])


if __name__ == "__main__":
    main()
