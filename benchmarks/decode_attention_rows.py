"""The device time of one decode step's attention for a few rows: the fused kernel's variants against SDPA.

    PYTHONPATH=. python3 benchmarks/decode_attention_rows.py [--rows 1 4] [--contexts 16 128 384 1024 4096]

One layer of the Llama-3.1-8B shape (32 query and 8 KV heads, D=128, bf16, 16-token blocks scattered at
random in a pool of at least 64K tokens). For each number of rows and context: microseconds of GPU kernel
time a call (PyTorch's profiler, CUPTI: every kernel a call launches, summed, over ``--calls`` calls), and
the wall time of a call within ``--calls`` calls per evaluation (launch gaps included), for

- SDPA: ``mx.fast.scaled_dot_product_attention`` over a contiguous cache (mlx-lm's decode, without the copy
  of the step's K/V into its cache);
- fused: the engine's kernel (``FusedKernel`` defaults: simd groups a threadgroup chosen for the call's
  grid), and as a decode step runs it, with each row's own K/V given and written into the pools (``new``);
- fused with 4 simd groups a threadgroup, whatever the grid;
- "fused, new, RoPE": as a decode step runs it with the RoPE left to it (unrotated queries and own keys, the
  cosines and sines of the rows' angles given; Llama 3's base);
- with ``--variants PART:WARPS ...`` (WARPS a number or ``auto``), the fused kernel with PART-token partitions
  and WARPS simd groups a threadgroup instead of the two above;
- with ``--baseline FILE ...``, the fused kernel of each other template (a copy of ``csrc/paged_attention.in``
  as it was, say), alone and as a decode step with RoPE runs it: a change to the kernel timed against the
  source before it in one process, in turn, as the machine's spread asks.

``--ncu CONTEXT`` instead runs the default kernel 20 times at that context and one row, for Nsight Compute.
"""

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx

from llm_paged_mlx.kernels.fused import CudaKernel
from llm_paged_mlx.kernels.rope import RopeSpec

Q_HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
POOL_BLOCKS = 4096
DTYPE = mx.bfloat16
ROPE = RopeSpec(DIM, False, 500000.0 ** (-mx.arange(0, DIM, 2, dtype=mx.float32) / DIM))  # Llama 3's base
VARIANTS = {"fused": (512, None), "4 warps": (512, 4)}  # name: (tokens per partition, simd groups a threadgroup)


def inputs(rows: int, context: int):
    width = -(-context // BLOCK)
    key = mx.random.key(rows * 100003 + context)
    kq, kk, kv, kt, kn = mx.random.split(key, 5)
    queries = mx.random.normal((rows, Q_HEADS, 1, DIM), key=kq).astype(DTYPE)
    blocks = max(POOL_BLOCKS, rows * width + 1)  # block 0 is never given
    k_pool = mx.random.normal((blocks, KV_HEADS, BLOCK, DIM), key=kk).astype(DTYPE)
    v_pool = mx.random.normal((blocks, KV_HEADS, BLOCK, DIM), key=kv).astype(DTYPE)
    tables = (mx.random.permutation(blocks - 1, key=kt)[: rows * width] + 1).reshape(rows, width)
    lens = mx.full((rows,), context, mx.int32)
    new = [mx.random.normal((rows, KV_HEADS, DIM), key=k).astype(DTYPE) for k in mx.random.split(kn, 2)]
    keys, values = (  # the rows' blocks as one contiguous cache
        p[tables.reshape(-1)].reshape(rows, width, KV_HEADS, BLOCK, DIM).swapaxes(1, 2).reshape(rows, KV_HEADS, -1, DIM)
        for p in (k_pool, v_pool)
    )
    keys, values = keys[:, :, :context], values[:, :, :context]
    arrays = dict(queries=queries, k_pool=k_pool, v_pool=v_pool, tables=tables.astype(mx.int32), lens=lens,
                  new=new, keys=keys, values=values, angles=ROPE.table(lens - 1))  # fmt: skip
    mx.eval(list(arrays.values()))
    return arrays


def methods(a, kernels, baselines):
    scale = DIM**-0.5
    out = {"SDPA": lambda: mx.fast.scaled_dot_product_attention(a["queries"], a["keys"], a["values"], scale=scale)}

    def decode(kernel, **step):
        return lambda: kernel.decode(a["queries"], a["k_pool"], a["v_pool"], a["tables"], a["lens"], scale, **step)

    for name, kernel in kernels.items():
        out[name] = decode(kernel)
    first = next(iter(kernels.values()))  # the first variant as a decode step runs it
    out["fused, new"] = decode(first, new_rows=a["new"])
    out["fused, new, RoPE"] = decode(first, new_rows=a["new"], rope=ROPE, rope_table=a["angles"])
    for name, kernel in baselines.items():
        out[name] = decode(kernel)
        out[f"{name}, new, RoPE"] = decode(kernel, new_rows=a["new"], rope=ROPE, rope_table=a["angles"])
    return out


def kernel_us(fn, calls: int) -> float:
    """GPU kernel time a call, microseconds (all the call's kernels)."""
    from torch.profiler import ProfilerActivity, profile

    mx.eval(fn())
    mx.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(calls):
            mx.eval(fn())
        mx.synchronize()
    return sum(e.self_device_time_total for e in profiler.key_averages()) / calls


def wall_us(fn, calls: int, repeats: int = 5) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        times.append((time.perf_counter() - start) / calls)
    return 1e6 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--contexts", type=int, nargs="+", default=[16, 128, 384, 1024, 4096])
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--ncu", type=int, metavar="CONTEXT")
    parser.add_argument("--variants", nargs="+", metavar="PART:WARPS", help="fused kernels to time")
    parser.add_argument("--baseline", nargs="+", default=[], metavar="FILE", help="templates to time beside")
    args = parser.parse_args()
    variants = dict(VARIANTS)
    if args.variants:
        variants = {}
        for v in args.variants:
            part, warps = v.split(":")
            variants[v] = (int(part), None if warps == "auto" else int(warps))
    kernels = {name: CudaKernel(partition_size=part, warps=warps) for name, (part, warps) in variants.items()}
    baselines = {Path(f).stem: CudaKernel(template=Path(f).read_text()) for f in args.baseline}
    if len(baselines) < len(args.baseline):
        parser.error("--baseline: two files of one name (the name heads their columns)")
    if args.ncu:
        a = inputs(1, args.ncu)
        for _ in range(20):
            mx.eval(methods(a, kernels, {})[next(iter(kernels))]())
        return
    pool = mx.zeros((1, KV_HEADS, BLOCK, DIM), DTYPE)  # the self-checks, before any timing
    for kernel in kernels.values():
        assert kernel.usable(DTYPE, pool, pool, Q_HEADS), "the fused kernel failed its self-check"
    for kernel in [next(iter(kernels.values())), *baselines.values()]:
        assert kernel.usable(DTYPE, pool, pool, Q_HEADS, new=True)
        assert kernel.usable(DTYPE, pool, pool, Q_HEADS, new=True, rope=ROPE)
    names = ["SDPA", *variants, "fused, new", "fused, new, RoPE"]
    names += [n for name in baselines for n in (name, f"{name}, new, RoPE")]
    print(f"# {time.strftime('%Y-%m-%d')}, mlx {mx.__version__} on {mx.default_device()}, {Q_HEADS}/{KV_HEADS} heads, "
          f"D={DIM}, bf16, {BLOCK}-token blocks; kernel time a call (us), wall time a call in brackets")
    print("| rows | context | " + " | ".join(names) + " |")
    print("|---:|---:|" + "---:|" * len(names))
    for rows in args.rows:
        for context in args.contexts:
            a = inputs(rows, context)
            fns = methods(a, kernels, baselines)
            ref = fns["SDPA"]().astype(mx.float32)
            for name in [*variants, *baselines]:  # every variant gives SDPA's output
                error = (mx.abs(fns[name]().astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()
                assert error < 2e-2, (name, rows, context, error)
            cells = [f"{kernel_us(fns[n], args.calls):.1f} ({wall_us(fns[n], args.calls):.1f})" for n in names]
            print(f"| {rows} | {context} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
