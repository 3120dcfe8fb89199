"""Sliding-window attention against full attention, portable kernel, in one process (CPU or GPU).

    PYTHONPATH=. python3 benchmarks/window_attention.py

A 256-query prefill chunk and 8 decode rows at the end of contexts of 2K-32K tokens, 8 query / 4
KV heads of 64, float32, 16-token blocks: the same call with a 128-token window and without
one. The windowed call reads only the blocks its window reaches, so its time should stay flat
as the context grows. Median of 5 runs after a warm-up.
"""

import datetime
import statistics
import time

import mlx.core as mx

from llm_paged_mlx.kernels.plan import window_tables
from llm_paged_mlx.kernels.portable import decode_attention, prefill_attention

BLOCK, KV_HEADS, Q_HEADS, DIM, CHUNK, ROWS, WINDOW = 16, 4, 8, 64, 256, 8, 128


def timed(fn, runs=5):
    mx.eval(fn())
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def decode(queries, k_pool, v_pool, tables, lens, window):
    start = None
    if window is not None:
        tables, start = window_tables(tables, lens, window, BLOCK)
    return decode_attention(queries, k_pool, v_pool, tables, lens, 0.125, window, None, start)


def main():
    print(f"# {datetime.date.today()}, mlx {mx.__version__} on {mx.default_device()}")
    print("| context | prefill full ms | prefill window ms | ratio | decode full ms | decode window ms | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for context in (2048, 8192, 32768):
        blocks = context // BLOCK
        k_pool = mx.random.normal((blocks + 1, KV_HEADS, BLOCK, DIM))
        v_pool = mx.random.normal((blocks + 1, KV_HEADS, BLOCK, DIM))
        table = mx.arange(1, blocks + 1, dtype=mx.int32)
        chunk = mx.random.normal((CHUNK, Q_HEADS, 1, DIM))
        rows = mx.random.normal((ROWS, Q_HEADS, 1, DIM))
        tables = mx.broadcast_to(table[None], (ROWS, blocks))
        lens = mx.full((ROWS,), context, mx.int32)
        mx.eval(k_pool, v_pool, chunk, rows)
        prefill = [timed(lambda: prefill_attention(chunk, k_pool, v_pool, table, context, 0.125, w)) for w in (None, WINDOW)]
        dec = [timed(lambda: decode(rows, k_pool, v_pool, tables, lens, w)) for w in (None, WINDOW)]
        print(f"| {context} | {prefill[0]:.1f} | {prefill[1]:.1f} | {prefill[1] / prefill[0]:.3f} | "
              f"{dec[0]:.1f} | {dec[1]:.1f} | {dec[1] / dec[0]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
