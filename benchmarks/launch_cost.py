"""What the host spends to launch one operation, by kind and by rows, on MLX's default device.

    PYTHONPATH=. python3 benchmarks/launch_cost.py [--rows 1 8 16 64 256] [--ops 128] [--max-ops-per-buffer N]

For each kind of operation and number of rows, a chain of ``--ops`` operations (each reads the output of
the one before, as a model's layers do) is built, launched with ``mx.async_eval`` (MLX encodes the
operations: the host's share) and then waited for (the device's share that was not hidden). Microseconds
per operation, medians over ``--repeats`` chains after a warm-up; for the products, also one call's relative
error against the float32 product of the bf16 weight (the 4-bit one's is its quantization's). The kinds:

- ``bf16 product``: ``x @ w.T`` over a 4096 x 4096 bf16 weight, as ``nn.Linear`` calls it;
- ``bf16 gather_mm``: the same product as ``mx.gather_mm`` of one weight (sorted indices), which MLX's CUDA
  backend runs as a kernel of its own, not through cuBLAS;
- ``4-bit product``: ``mx.quantized_matmul`` over the same weight in 4 bits, group 64;
- ``custom kernel``: an ``mx.fast.cuda_kernel`` (or ``metal_kernel``) that copies its input (GPUs only);
- ``add``: ``x + 1``, one of MLX's own elementwise kernels.

On CUDA, MLX records a step's kernels into CUDA graphs of ``MLX_MAX_OPS_PER_BUFFER`` nodes (``--max-ops-per-
buffer`` sets it for this process) and takes a product through cuBLAS by capturing a stream; what that costs
the host against a kernel it launches itself is what this measures.
"""

import argparse
import os
import statistics
import time


def copy_kernel(mx):
    make = mx.fast.cuda_kernel if mx.cuda.is_available() else mx.fast.metal_kernel
    index = "blockIdx.x * blockDim.x + threadIdx.x" if mx.cuda.is_available() else "thread_position_in_grid.x"
    return make(name="copy_rows", input_names=["x"], output_names=["y"], source=f"y[{index}] = x[{index}];")


def chain_cost(mx, operation, x, ops: int, repeats: int) -> tuple[float, float, float]:
    """Medians, microseconds per operation: building the chain, launching it, waiting for it."""
    build, launch, wait = [], [], []
    for repeat in range(repeats + 1):
        mx.eval(x)
        start = time.perf_counter()
        h = x
        for i in range(ops):
            h = operation(h, i)
        built = time.perf_counter()
        mx.async_eval(h)
        launched = time.perf_counter()
        mx.eval(h)
        done = time.perf_counter()
        if repeat:  # the first chain is a warm-up
            build.append((built - start) / ops * 1e6)
            launch.append((launched - built) / ops * 1e6)
            wait.append((done - launched) / ops * 1e6)
    return statistics.median(build), statistics.median(launch), statistics.median(wait)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16, 64, 256])
    parser.add_argument("--ops", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--width", type=int, default=4096, help="the weights' side, a multiple of 256")
    parser.add_argument("--copies", type=int, default=4, help="different weights the products take in turn")
    parser.add_argument("--max-ops-per-buffer", type=int, default=None)
    args = parser.parse_args()
    if min(args.rows) < 1 or args.ops < 1 or args.repeats < 1 or args.copies < 1:
        parser.error("--rows, --ops, --repeats and --copies must be positive")
    if args.width % 256:
        parser.error("--width must be a multiple of 256 (the copy kernel's threadgroup)")
    if args.max_ops_per_buffer is not None:  # MLX reads it once, at its first launch
        os.environ["MLX_MAX_OPS_PER_BUFFER"] = str(args.max_ops_per_buffer)
    import mlx.core as mx

    width = args.width
    weights = [(mx.random.normal((width, width)) * width**-0.5).astype(mx.bfloat16) for _ in range(args.copies)]
    quantized = [mx.quantize(w, group_size=64, bits=4) for w in weights]
    mx.eval(weights, quantized)
    kernel = copy_kernel(mx)

    def custom(h, i):
        return kernel(inputs=[h], output_shapes=[h.shape], output_dtypes=[h.dtype], grid=(h.size, 1, 1),
                      threadgroup=(256, 1, 1))[0]

    transposed = [w.T[None] for w in weights]
    indices = {rows: mx.zeros((rows,), mx.uint32) for rows in args.rows}

    def gathered(h, i):
        rows = h.shape[0]
        product = mx.gather_mm(h.reshape(rows, 1, width), transposed[i % args.copies], rhs_indices=indices[rows],
                               sorted_indices=True)  # fmt: skip
        return product.reshape(h.shape)

    kinds = {
        "bf16 product": lambda h, i: h @ weights[i % args.copies].T,
        "bf16 gather_mm": gathered,
        "4-bit product": lambda h, i: mx.quantized_matmul(h, *quantized[i % args.copies], group_size=64, bits=4),
        "custom kernel": custom,
        "add": lambda h, i: h + 1,
    }
    if not (mx.cuda.is_available() or mx.metal.is_available()):
        del kinds["custom kernel"]  # no GPU backend to compile it for
    buffer = os.environ.get("MLX_MAX_OPS_PER_BUFFER", "MLX's default")
    print(f"\n# {time.strftime('%Y-%m-%d')}, mlx {mx.__version__} on {mx.default_device()}, chains of {args.ops} "
          f"operations, width {width}, MLX_MAX_OPS_PER_BUFFER {buffer}; us per operation, medians of {args.repeats}")
    exact = weights[0].astype(mx.float32).T

    def error(name, operation, x) -> str:
        """A product's relative L2 error against the float32 product of its first weight."""
        if "product" not in name and "gather_mm" not in name:
            return ""
        want = x.astype(mx.float32) @ exact
        return f"{(mx.linalg.norm(operation(x, 0).astype(mx.float32) - want) / mx.linalg.norm(want)).item():.1e}"

    print("| operation | rows | build | launch | wait | error |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, operation in kinds.items():
        for rows in args.rows:
            x = mx.random.normal((rows, width)).astype(mx.bfloat16)
            try:
                build, launch, wait = chain_cost(mx, operation, x, args.ops, args.repeats)
            except RuntimeError as e:  # an operation this backend does not have for bf16
                print(f"| {name} | {rows} | {e} | | | |", flush=True)
                break
            print(f"| {name} | {rows} | {build:.1f} | {launch:.1f} | {wait:.1f} | {error(name, operation, x)} |", flush=True)


if __name__ == "__main__":
    main()
