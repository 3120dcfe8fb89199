"""How MLX's 4-bit matrix product scales with the rows a decode step multiplies, against bf16, in one process.

    python3 benchmarks/quantized_matmul_rows.py [--rows 1 2 4 8 16 32 64] [--shape 4096 14336]

One Llama-3.1-8B MLP projection (``K x N``), weights random, 4-bit in groups of 64 (``mx.quantize``). For
each number of rows ``M``: ``mx.quantized_matmul`` on rows folded into one product ``(1, M, K)`` (as the
engine's ``models.quantized_rows`` gives it), on rows as a batch ``(M, 1, K)``, the weights dequantized
to bf16 and then multiplied (``mx.dequantize``, ``mx.matmul``), and ``mx.matmul`` with the bf16 weights;
microseconds a call (``--calls`` calls per evaluation, medians of ``--repeats``), and the weight bytes a
call reads divided by its time (GB/s): a product that reads its weights once per call reads at the
memory's rate whatever ``M``. The calls take ``--copies`` different weights in turn, so that a GPU's
cache does not hold them from one call to the next, as a model's layers do not.
"""

import argparse
import statistics
import time

import mlx.core as mx

MAX_BATCH_ROWS = 64  # rows as a batch are one product each: past this, slower than anything else by far


def time_us(product, inputs, calls: int, repeats: int, copies: int) -> float:
    """Microseconds a call of ``product(x, copy)``, the calls cycling through ``copies`` weights."""
    mx.eval(product(inputs[0], 0))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([product(x, i % copies) for i, x in enumerate(inputs[:calls])])
        times.append((time.perf_counter() - start) / calls)
    return 1e6 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--shape", type=int, nargs=2, default=[4096, 14336], metavar=("K", "N"))
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--copies", type=int, default=4, help="different weights the calls take in turn")
    args = parser.parse_args()
    k, n = args.shape
    mx.random.seed(0)
    weights = [(mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16) for _ in range(args.copies)]
    quantized_weights = [mx.quantize(w, group_size=64, bits=4) for w in weights]
    mx.eval(weights, quantized_weights)
    q_bytes = sum(a.nbytes for a in quantized_weights[0])
    w_bytes = weights[0].nbytes

    def quantized(x, copy):
        return mx.quantized_matmul(x, *quantized_weights[copy], transpose=True, group_size=64, bits=4)

    def dequantized(x, copy):
        return x @ mx.dequantize(*quantized_weights[copy], group_size=64, bits=4).T

    print(f"# {time.strftime('%Y-%m-%d')}, mlx {mx.__version__} on {mx.default_device()}, K={k}, N={n}, "
          f"4-bit group 64 ({q_bytes / 2**20:.0f} MiB) and bf16 ({w_bytes / 2**20:.0f} MiB), {args.copies} copies")
    print("| rows | 4-bit, folded (us) | GB/s | 4-bit, as a batch (us) | dequantized, then bf16 (us) | bf16 (us) "
          "| GB/s | 4-bit folded / bf16 |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in args.rows:
        xs = [mx.random.normal((1, m, k)).astype(mx.bfloat16) for _ in range(args.calls)]
        mx.eval(xs)
        folded = time_us(quantized, xs, args.calls, args.repeats, args.copies)
        batched = None if m > MAX_BATCH_ROWS else time_us(
            lambda x, c: quantized(x.reshape(m, 1, k), c), xs, args.calls, args.repeats, args.copies
        )
        through_bf16 = time_us(dequantized, xs, args.calls, args.repeats, args.copies)
        plain = time_us(lambda x, c: x @ weights[c].T, xs, args.calls, args.repeats, args.copies)
        batch_cell = "-" if batched is None else f"{batched:.1f}"
        print(f"| {m} | {folded:.1f} | {q_bytes / folded / 1e3:.0f} | {batch_cell} | {through_bf16:.1f} | "
              f"{plain:.1f} | {w_bytes / plain / 1e3:.0f} | {folded / plain:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
