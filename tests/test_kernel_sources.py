"""The Metal and CUDA kernels are one algorithm rendered through two thin dialects."""

import re
import shutil
import subprocess

import mlx.core as mx
import pytest

from llm_paged_mlx.kernels.dialect import CUDA, DIALECTS, METAL, read_template, render, split_kernels
from llm_paged_mlx.kernels.fused import MetalKernel

# Words that belong to one language: the template must leave them to the dialects.
DIALECT_WORDS = r"__shared__|__syncthreads|__shfl|threadIdx|blockIdx|threadgroup|simd_|device|constant|\buint\b"


def strip_dialect(body: str, dialect) -> str:
    assert body.startswith(dialect.prelude)
    return body[len(dialect.prelude) :]


def test_both_dialects_render_the_same_algorithm():
    template = read_template()
    kernels = split_kernels(template)
    assert set(kernels) == {"partition", "reduce"}
    metal, cuda = render(template, METAL), render(template, CUDA)
    for name, algorithm in kernels.items():
        metal_body = strip_dialect(metal[name][1], METAL)
        cuda_body = strip_dialect(cuda[name][1], CUDA)
        assert metal_body == cuda_body == algorithm
        assert metal[name][1] != cuda[name][1]  # the dialects do differ


def test_template_code_has_no_language_specific_words():
    for name, body in split_kernels(read_template()).items():
        code = re.sub(r"//.*", "", body)
        assert not re.search(DIALECT_WORDS, code), (name, re.search(DIALECT_WORDS, code))


def test_dialects_define_the_same_names():
    def names(dialect):
        defined = set(re.findall(r"#define (PA_\w+)", dialect.header))
        defined |= set(re.findall(r"\b(pa_\w+)\b", dialect.header + dialect.prelude))
        return defined

    assert names(METAL) == names(CUDA)
    used = set(re.findall(r"\b(PA_\w+|pa_\w+)\b", "".join(split_kernels(read_template()).values())))
    assert used <= names(CUDA)
    assert set(DIALECTS) == {"cuda", "metal"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("one", [False, True])
def test_cuda_rendering_compiles_with_nvcc(tmp_path, one):
    """Wraps the CUDA rendering the way mx.fast.cuda_kernel does and compiles it for sm_90.

    With ONE (a single partition per row) the partition kernel writes T outputs."""
    header, partition = render(read_template(), CUDA)["partition"]
    _, reduce = render(read_template(), CUDA)["reduce"]
    source = (
        "#include <cuda_bf16.h>\n"
        "struct Shape { int d[8]; __device__ int operator[](int i) const { return d[i]; } };\n"
        + header
        + "using T = __nv_bfloat16;\n"
        "constexpr int D = 128, BS = 16, REP = 4, HPG = 4, PART = 512, NW = 4;\n"
        f"constexpr bool ONE = {str(one).lower()};\n"
        "__global__ void partition(const T* queries, const T* k_pool, const __grid_constant__ Shape k_pool_shape,\n"
        "    const T* v_pool, const int* block_tables, const __grid_constant__ Shape block_tables_shape,\n"
        f"    const int* context_lens, const float* scale, {'T' if one else 'float'}* part_out, float* part_m,\n"
        "    float* part_l) {\n"
        + partition
        + "}\n"
        "__global__ void reduce(const float* part_out, const float* part_m, const __grid_constant__ Shape part_m_shape,\n"
        "    const float* part_l, const int* context_lens, T* out) {\n" + reduce + "}\n"
    )
    (tmp_path / "k.cu").write_text(source)
    result = subprocess.run(
        ["nvcc", "-arch=sm_90", "-c", "k.cu", "-o", "k.o"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal")
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("dim,block_size,rep", [(64, 16, 1), (128, 16, 4), (128, 32, 8), (256, 16, 2)])
def test_metal_kernel_compiles_and_matches_portable(dtype, dim, block_size, rep):
    kernel = MetalKernel()
    with mx.stream(mx.gpu):
        error = kernel.check_error(dtype, dim, block_size, rep)
    assert error <= {mx.float32: 1e-5, mx.float16: 5e-3, mx.bfloat16: 1e-2}[dtype]
