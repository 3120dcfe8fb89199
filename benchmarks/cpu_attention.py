"""Decode attention on the CPU: paged (portable kernel) against contiguous SDPA.

B=4 sequences, 32 query / 8 KV heads, D=128, fp32, 16-token blocks scattered at
random over the pool. Run with OpenBLAS preloaded, e.g.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        PYTHONPATH=. python benchmarks/cpu_attention.py
"""

import argparse
import statistics
import time

import mlx.core as mx

from llm_paged_mlx.kernels.portable import decode_attention


def median_ms(fns, warmup=2, runs=7):
    """Median milliseconds of each function, timed in alternation so both see the same load."""
    for _ in range(warmup):
        for fn in fns:
            mx.eval(fn())
    times = [[] for _ in fns]
    for _ in range(runs):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            mx.eval(fn())
            out.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def case(context, batch=4, q_heads=32, kv_heads=8, dim=128, block=16, dtype=mx.float32):
    """Contiguous K/V and the same K/V scattered over a block pool."""
    blocks_per_seq = context // block
    num_blocks = batch * blocks_per_seq + 1  # block 0 is the null block
    k = mx.random.normal((batch, kv_heads, context, dim)).astype(dtype)
    v = mx.random.normal((batch, kv_heads, context, dim)).astype(dtype)
    q = mx.random.normal((batch, q_heads, 1, dim)).astype(dtype)
    tables = (mx.random.permutation(num_blocks - 1) + 1).reshape(batch, blocks_per_seq).astype(mx.int32)

    def to_pool(x):  # (B, H, ctx, D) -> (num_blocks, H, block, D)
        x = x.reshape(batch, kv_heads, blocks_per_seq, block, dim).transpose(0, 2, 1, 3, 4)
        x = x.reshape(-1, kv_heads, block, dim)
        pool = mx.zeros((num_blocks, kv_heads, block, dim), dtype)
        pool[tables.reshape(-1)] = x
        return pool

    k_pool, v_pool = to_pool(k), to_pool(v)
    lens = mx.full((batch,), context, mx.int32)
    mx.eval(k, v, q, k_pool, v_pool, tables)
    return q, k, v, k_pool, v_pool, tables, lens


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="4096,8192,16384,32768")
    args = parser.parse_args()
    mx.random.seed(0)
    scale = 128**-0.5
    rows = []
    for context in map(int, args.contexts.split(",")):
        q, k, v, k_pool, v_pool, tables, lens = case(context)
        sdpa = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)  # noqa: E731
        paged = lambda: decode_attention(q, k_pool, v_pool, tables, lens, scale)  # noqa: E731
        ref, out = sdpa(), paged()
        err = (mx.abs(out - ref).max() / mx.abs(ref).max()).item()
        t_sdpa, t_paged = median_ms([sdpa, paged])
        rows.append((context, t_sdpa, t_paged, t_paged / t_sdpa, err))
        del q, k, v, k_pool, v_pool
    print("context  sdpa_ms  paged_ms  ratio  max_rel_err")
    for context, a, b, r, e in rows:
        print(f"{context:7d}  {a:7.1f}  {b:8.1f}  {r:5.2f}  {e:.1e}")


if __name__ == "__main__":
    main()
