"""How MLX's 4-bit matrix product scales with the rows a decode step multiplies, against bf16, in one process.

    python3 benchmarks/quantized_matmul_rows.py [--rows 1 2 4 8 16 32 64] [--shape 4096 14336]

One Llama-3.1-8B MLP projection (``K x N``), weights random, 4-bit in groups of 64 (``mx.quantize``). For
each number of rows ``M``: ``mx.quantized_matmul`` on rows folded into one product ``(1, M, K)`` (as the
engine's ``models.quantized_rows`` gives it), on rows as a batch ``(M, 1, K)``, and ``mx.matmul`` with the
bf16 weights; microseconds a call (``--calls`` calls per evaluation, medians of ``--repeats``), and the
weight bytes a call reads divided by its time (GB/s): a product that reads its weights once per call
reads at the memory's rate whatever ``M``.
"""

import argparse
import statistics
import time

import mlx.core as mx


def time_us(product, inputs, calls: int, repeats: int) -> float:
    mx.eval(product(inputs[0]))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([product(x) for x in inputs[:calls]])
        times.append((time.perf_counter() - start) / calls)
    return 1e6 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--shape", type=int, nargs=2, default=[4096, 14336], metavar=("K", "N"))
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    k, n = args.shape
    mx.random.seed(0)
    weight = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
    packed, scales, biases = mx.quantize(weight, group_size=64, bits=4)
    mx.eval(weight, packed, scales, biases)
    q_bytes = packed.nbytes + scales.nbytes + biases.nbytes

    def quantized(x):
        return mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=64, bits=4)

    print(f"# {time.strftime('%Y-%m-%d')}, mlx {mx.__version__} on {mx.default_device()}, K={k}, N={n}, "
          f"4-bit group 64 ({q_bytes / 2**20:.0f} MiB) and bf16 ({weight.nbytes / 2**20:.0f} MiB)")
    print("| rows | 4-bit, folded (us) | GB/s | 4-bit, as a batch (us) | bf16 (us) | GB/s | 4-bit folded / bf16 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for m in args.rows:
        xs = [mx.random.normal((1, m, k)).astype(mx.bfloat16) for _ in range(args.calls)]
        mx.eval(xs)
        folded = time_us(quantized, xs, args.calls, args.repeats)
        batched = time_us(lambda x: quantized(x.reshape(m, 1, k)), xs, args.calls, args.repeats)
        plain = time_us(lambda x: x @ weight.T, xs, args.calls, args.repeats)
        print(f"| {m} | {folded:.1f} | {q_bytes / folded / 1e3:.0f} | {batched:.1f} | {plain:.1f} | "
              f"{weight.nbytes / plain / 1e3:.0f} | {folded / plain:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
