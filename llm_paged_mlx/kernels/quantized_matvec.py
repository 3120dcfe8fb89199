"""A quantized matrix product for a few rows on MLX's CUDA backend (``csrc/quantized_matvec.cu``).

MLX 0.32's CUDA backend multiplies one row by 4-bit weights reading them at about a fifth of the
memory's rate (benchmarks/RESULTS.md), so a decode step of a 4-bit model is bound by that product. In
this kernel each simd group computes a few outputs alone, reading their packed codes in 16-byte chunks,
converting them once for all the rows and summing in float32. CUDA only: Metal has MLX's own fast
quantized matrix-vector product. Callers check it against the exact product before taking it
(``models.quantized_rows``).
"""

import hashlib

import mlx.core as mx

from .dialect import source_dir

SOURCE = "quantized_matvec.cu"
MAX_ROWS = 8  # rows of x the kernel takes: past that each output's sums hold too many registers
THREADS = 128
BITS = (4, 8)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
CHUNK_BITS = 128  # one thread's load of codes: a chunk of 128 / bits values


def available() -> bool:
    """Whether MLX runs on a CUDA GPU here."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def supports(bits: int, group_size: int, dtype, input_dims: int) -> bool:
    """Whether the kernel takes weights of ``bits`` in groups of ``group_size`` with ``input_dims`` inputs and
    x, scales and biases of ``dtype``."""
    codes = CHUNK_BITS // bits if bits in BITS else 0
    return bool(codes) and dtype in DTYPES and group_size % codes == 0 and input_dims % group_size == 0


def outputs_per_simd_group(rows: int) -> int:
    """Outputs a simd group computes: fewer as rows grow, so that the sums stay in registers."""
    return 4 if rows <= 4 else 2


def source() -> tuple[str, str]:
    """The kernel's header and body, as ``mx.fast.cuda_kernel`` takes them."""
    header, body = (source_dir() / SOURCE).read_text().split("// @kernel matvec\n")
    return header, body


_kernel = None


def _built():
    global _kernel
    if _kernel is None:
        header, body = source()
        tag = hashlib.sha1((header + body).encode()).hexdigest()[:12]  # MLX keeps compiled kernels by name
        _kernel = mx.fast.cuda_kernel(
            name=f"quantized_matvec_{tag}",
            input_names=["x", "w", "scales", "biases"],
            output_names=["y"],
            header=header,
            source=body,
        )
    return _kernel


def quantized_matvec(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int):
    """``x @ W.T`` for ``x`` of shape ``(rows, K)``, 1 to ``MAX_ROWS`` rows, and ``W`` as ``mx.quantize``
    packs it in affine mode (``w``, ``scales``, ``biases``), where ``supports`` says so; the result has x's
    dtype, which the scales and biases share."""
    rows, k = x.shape
    outputs = w.shape[0]
    if not (1 <= rows <= MAX_ROWS and supports(bits, group_size, x.dtype, k)):
        raise ValueError(f"quantized_matvec: {rows} rows of {k} {x.dtype} values, {bits} bits in groups of "
                         f"{group_size}: not what the kernel takes")  # fmt: skip
    if w.shape != (outputs, k * bits // 32) or not scales.shape == biases.shape == (outputs, k // group_size):
        raise ValueError(f"quantized_matvec: weights {w.shape}, scales {scales.shape} and biases {biases.shape} "
                         f"do not pack {outputs} x {k} values of {bits} bits in groups of {group_size}")  # fmt: skip
    if not scales.dtype == biases.dtype == x.dtype:
        raise ValueError("quantized_matvec: x, scales and biases must share their dtype")
    per_simd_group = outputs_per_simd_group(rows)
    per_threadgroup = THREADS // 32 * per_simd_group
    (y,) = _built()(
        inputs=[x, w, scales, biases],
        template=[("T", x.dtype), ("BITS", bits), ("GROUP", group_size), ("ROWS", rows), ("OUTS", per_simd_group),
                  ("NT", THREADS)],  # fmt: skip
        grid=(-(-outputs // per_threadgroup) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, outputs)],
        output_dtypes=[x.dtype],
    )
    return y
