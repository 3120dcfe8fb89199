"""Quantized matrix products by the rows a decode step multiplies: MLX's, this package's kernel, bf16, in one process.

    python3 benchmarks/quantized_matmul_rows.py [--rows 1 2 4 8 16 32 64] [--shape 4096 14336] [--bits 4]
    python3 benchmarks/quantized_matmul_rows.py --llama-8b  # the Llama-3.1-8B shapes, as the engine merges them

One projection (``K x N``), weights random, quantized in groups of 64 (``mx.quantize``, ``--bits``). For each
number of rows ``M``: ``mx.quantized_matmul`` on rows folded into one product ``(1, M, K)`` (as the engine's
``models.quantized_rows`` gives it), with ``--all`` also on rows as a batch ``(M, 1, K)`` and the weights
dequantized to bf16 and then multiplied (``mx.dequantize``, ``mx.matmul``), on CUDA this package's kernel
(``kernels.quantized_matvec``, up to its ``MAX_ROWS``) and ``mx.matmul`` with the bf16 weights; microseconds
a call (``--calls`` calls per evaluation, medians of ``--repeats``), and the weight bytes a call reads divided
by its time (GB/s): a product that reads its weights once per call reads at the memory's rate whatever ``M``. The calls take
``--copies`` different weights in turn, so that a GPU's cache does not hold them from one call to the next, as
a model's layers do not. "kernel error": the kernel's relative L2 distance from the float64 product of the
same dequantized weights, beside MLX's own.
"""

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from llm_paged_mlx.kernels import quantized_matvec as matvec

MAX_BATCH_ROWS = 64  # rows as a batch are one product each: past this, slower than anything else by far
# The Llama-3.1-8B projections as the engine runs them on a GPU: q/k/v merged, o, gate/up merged, down, the head.
LLAMA_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256)]


def time_us(product, inputs, calls: int, repeats: int, copies: int) -> float:
    """Microseconds a call of ``product(x, copy)``, the calls cycling through ``copies`` weights."""
    mx.eval(product(inputs[0], 0))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([product(x, i % copies) for i, x in enumerate(inputs[:calls])])
        times.append((time.perf_counter() - start) / calls)
    return 1e6 * statistics.median(times)


def relative_error(got: mx.array, want: np.ndarray) -> float:
    got = np.asarray(got.astype(mx.float32), dtype=np.float64).reshape(want.shape)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def one_shape(k: int, n: int, bits: int, args) -> None:
    mx.random.seed(0)
    weights = [(mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16) for _ in range(args.copies)]
    quantized_weights = [mx.quantize(w, group_size=64, bits=bits) for w in weights]
    mx.eval(weights, quantized_weights)
    q_bytes = sum(a.nbytes for a in quantized_weights[0])
    w_bytes = weights[0].nbytes
    kernel = matvec.available()

    def quantized(x, copy):
        return mx.quantized_matmul(x, *quantized_weights[copy], transpose=True, group_size=64, bits=bits)

    def dequantized(x, copy):
        return x @ mx.dequantize(*quantized_weights[copy], group_size=64, bits=bits).T

    def ours(x, copy):
        return matvec.quantized_matvec(x.reshape(-1, k), *quantized_weights[copy], bits, 64)

    print(f"\n# {time.strftime('%Y-%m-%d')}, mlx {mx.__version__} on {mx.default_device()}, K={k}, N={n}, "
          f"{bits}-bit group 64 ({q_bytes / 2**20:.0f} MiB) and bf16 ({w_bytes / 2**20:.0f} MiB), {args.copies} copies")
    print("| rows | MLX folded (us) | GB/s | as a batch (us) | dequantized, then bf16 (us) | kernel (us) | GB/s "
          "| kernel / MLX | kernel error | MLX error | bf16 (us) | GB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    exact = np.asarray(mx.dequantize(*quantized_weights[0], group_size=64, bits=bits, dtype=mx.float32), np.float64)
    for m in args.rows:
        xs = [mx.random.normal((1, m, k)).astype(mx.bfloat16) for _ in range(args.calls)]
        mx.eval(xs)
        folded = time_us(quantized, xs, args.calls, args.repeats, args.copies)
        batched = None if m > MAX_BATCH_ROWS or not args.all else time_us(
            lambda x, c: quantized(x.reshape(m, 1, k), c), xs, args.calls, args.repeats, args.copies
        )
        through_bf16 = time_us(dequantized, xs, args.calls, args.repeats, args.copies) if args.all else None
        plain = time_us(lambda x, c: x @ weights[c].T, xs, args.calls, args.repeats, args.copies)
        want = np.asarray(xs[0].reshape(m, k).astype(mx.float32), np.float64) @ exact.T
        mlx_error = relative_error(quantized(xs[0], 0), want)
        cells = ["-"] * 4
        if kernel and m <= matvec.MAX_ROWS:
            theirs = time_us(ours, xs, args.calls, args.repeats, args.copies)
            error = relative_error(ours(xs[0], 0), want)
            cells = [f"{theirs:.1f}", f"{q_bytes / theirs / 1e3:.0f}", f"{theirs / folded:.2f}x", f"{error:.1e}"]
        batch_cell = "-" if batched is None else f"{batched:.1f}"
        bf16_cell = "-" if through_bf16 is None else f"{through_bf16:.1f}"
        print(f"| {m} | {folded:.1f} | {q_bytes / folded / 1e3:.0f} | {batch_cell} | {bf16_cell} | {' | '.join(cells)} "
              f"| {mlx_error:.1e} | {plain:.1f} | {w_bytes / plain / 1e3:.0f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--shape", type=int, nargs=2, default=[4096, 14336], metavar=("K", "N"))
    parser.add_argument("--llama-8b", action="store_true", help="each of the Llama-3.1-8B shapes instead")
    parser.add_argument("--bits", type=int, nargs="+", default=[4])
    parser.add_argument("--all", action="store_true", help="also rows as a batch and dequantized weights")
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--copies", type=int, default=4, help="different weights the calls take in turn")
    args = parser.parse_args()
    for bits in args.bits:
        for k, n in LLAMA_8B if args.llama_8b else [args.shape]:
            one_shape(k, n, bits, args)


if __name__ == "__main__":
    main()
