"""Renders the kernel template in ``csrc/`` as Metal or CUDA source for MLX.

The template holds the algorithm once, in C++ that both languages accept. A
dialect adds two things around it: a header of ``PA_*`` macros and helpers
(``pa_load``, ``pa_store``), and a prelude at the top of each kernel body that
names the thread and threadgroup indices ``pa_tid`` and ``pa_group_{x,y,z}``
(Metal only passes the index attributes that a body mentions, so they must
appear in the body itself).
"""

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

TEMPLATE = "paged_attention.in"
_KERNEL_MARK = re.compile(r"^// @kernel (\w+)\n", re.MULTILINE)


@dataclass(frozen=True)
class Dialect:
    name: str
    header: str
    prelude: str


CUDA = Dialect(
    name="cuda",
    header="""\
#define PA_SHARED __shared__
#define PA_BARRIER() __syncthreads()
#define PA_SHUFFLE_XOR(x, m) __shfl_xor_sync(0xffffffffu, (x), (m))
#define PA_EXP(x) expf(x)
#define PA_MAX(a, b) fmaxf((a), (b))
#define PA_TANH(x) tanhf(x)
#define PA_UNROLL _Pragma("unroll")
typedef long long pa_index_t;

// N elements starting at src (16-byte aligned) as floats, in 16-byte loads.
template <int N, typename U>
__device__ __forceinline__ void pa_load(float* dst, const U* src) {
  constexpr int per = 16 / sizeof(U);
  _Pragma("unroll")
  for (int i = 0; i < N; i += per) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src + i);
    const U* e = reinterpret_cast<const U*>(&raw);
    _Pragma("unroll")
    for (int j = 0; j < per; ++j) {
      dst[i + j] = static_cast<float>(e[j]);
    }
  }
}

// N codes of B bits, packed from the low bits of 32-bit words upwards (mx.quantize's layout), as
// floats. src holds N * B / 32 words, aligned to their size, and is read in one load.
template <int W>
struct alignas(4 * W) PaWords {
  unsigned int w[W];
};
template <int N, int B>
__device__ __forceinline__ void pa_load_codes(float* dst, const unsigned int* src) {
  const PaWords<N * B / 32> raw = *reinterpret_cast<const PaWords<N * B / 32>*>(src);
  _Pragma("unroll")
  for (int i = 0; i < N; ++i) {
    const unsigned int code = (raw.w[i * B / 32] >> ((i * B) % 32)) & ((1u << B) - 1u);
    dst[i] = __uint_as_float(0x4b000000u | code) - 8388608.0f;  // 2^23 + code, exactly: no int-to-float convert
  }
}

// Stores v as the element type of dst.
template <typename P>
__device__ __forceinline__ void pa_store(P* dst, float v) {
  *dst = static_cast<P>(v);
}
""",
    prelude="""\
const int pa_tid = int(threadIdx.x);
const int pa_group_x = int(blockIdx.x);
const int pa_group_y = int(blockIdx.y);
const int pa_group_z = int(blockIdx.z);
""",
)

METAL = Dialect(
    name="metal",
    header="""\
#define PA_SHARED threadgroup
#define PA_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define PA_SHUFFLE_XOR(x, m) simd_shuffle_xor((x), ushort(m))
#define PA_EXP(x) metal::exp(x)
#define PA_MAX(a, b) metal::max((a), (b))
#define PA_TANH(x) metal::precise::tanh(x)
#define PA_UNROLL _Pragma("clang loop unroll(full)")
typedef long pa_index_t;

// N elements starting at src as floats.
template <int N, typename U>
inline void pa_load(thread float* dst, const device U* src) {
  for (int i = 0; i < N; ++i) {
    dst[i] = static_cast<float>(src[i]);
  }
}

// N codes of B bits, packed from the low bits of 32-bit words upwards (mx.quantize's layout), as floats.
template <int N, int B>
inline void pa_load_codes(thread float* dst, const device unsigned int* src) {
  for (int i = 0; i < N; ++i) {
    dst[i] = static_cast<float>((src[i * B / 32] >> ((i * B) % 32)) & ((1u << B) - 1u));
  }
}

// Stores v as the element type of dst.
template <typename P>
inline void pa_store(device P* dst, float v) {
  *dst = static_cast<P>(v);
}
""",
    prelude="""\
const int pa_tid = int(thread_index_in_threadgroup);
const int pa_group_x = int(threadgroup_position_in_grid.x);
const int pa_group_y = int(threadgroup_position_in_grid.y);
const int pa_group_z = int(threadgroup_position_in_grid.z);
""",
)

DIALECTS = {d.name: d for d in (CUDA, METAL)}


def source_dir() -> Path:
    """``csrc/``: inside the installed package, or beside it in a source checkout."""
    packaged = resources.files("llm_paged_mlx") / "csrc"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "csrc"


@cache
def read_template(name: str = TEMPLATE) -> str:
    return (source_dir() / name).read_text()


def split_kernels(template: str) -> dict[str, str]:
    """The kernel bodies of a template, by the name after each ``// @kernel`` line."""
    pieces = _KERNEL_MARK.split(template)
    return {name: body.strip() + "\n" for name, body in zip(pieces[1::2], pieces[2::2])}


def render(template: str, dialect: Dialect, defines: dict[str, int] | None = None) -> dict[str, tuple[str, str]]:
    """``{kernel: (header, body)}`` ready for ``mx.fast.metal_kernel``/``cuda_kernel``.

    ``defines``: the macros that choose one variant of the template (``{"PA_BITS": 4, ...}``), written
    as ``#define`` lines at the head of every kernel's header.
    """
    macros = "".join(f"#define {name} {value}\n" for name, value in (defines or {}).items())
    return {name: (macros + dialect.header, dialect.prelude + body) for name, body in split_kernels(template).items()}
