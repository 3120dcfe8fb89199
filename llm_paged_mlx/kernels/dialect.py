"""Renders the kernel template in ``csrc/`` as Metal or CUDA source for MLX.

The template holds the algorithm once, in C++ that both languages accept. A
dialect adds two things around it: a header of ``PA_*`` macros and helpers
(``pa_load``, ``PaRaw`` with ``pa_load_raw`` and ``pa_unpack``, ``pa_store``),
and a prelude at the top of each kernel body that names the thread and
threadgroup indices ``pa_tid`` and ``pa_group_{x,y,z}`` (Metal only passes the
index attributes that a body mentions, so they must appear in the body itself).
"""

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import mlx.core as mx

TEMPLATE = "paged_attention.in"
LATENT_TEMPLATE = "latent_attention.in"
WRITE_TEMPLATE = "write_rows.in"
_KERNEL_MARK = re.compile(r"^// @kernel (\w+)\n", re.MULTILINE)

# RoPE as mx.fast.rope computes it, for kernels that rotate what they read (both dialects).
ROPE_HELPERS = """\
// Value j of a row rotated by RoPE, given the value it pairs with: the first Rot values rotate in pairs (j, j +
// Rot / 2), or (j, j + 1) with Trad, by the angles whose cosines and sines table holds (Rot / 2 of each, times a
// scale of the rotated values); values past Rot are as given.
template <int Rot, int Trad, typename R>
PA_INLINE float pa_rope_value(float x, float pair, int j, R table) {
  if (j >= Rot) {
    return x;
  }
  const int i = Trad ? j / 2 : j % (Rot / 2);
  const float c = table[i];
  const float s = table[Rot / 2 + i];
  const bool first = Trad ? j % 2 == 0 : j < Rot / 2;
  return first ? x * c - pair * s : pair * s + x * c;
}

// The index of the value that value j of a row pairs with.
template <int Rot, int Trad>
PA_INLINE int pa_rope_pair(int j) {
  return j >= Rot ? j : (Trad ? j ^ 1 : (j < Rot / 2 ? j + Rot / 2 : j - Rot / 2));
}

// Where the values paired with a lane's values from j (an even index, none of them straddling Rot or Rot / 2)
// start: Trad pairs lie within the lane's own.
template <int Rot, int Trad>
PA_INLINE int pa_rope_lane_pair(int j) {
  return Trad ? j : pa_rope_pair<Rot, 0>(j);
}

// A lane's N values x from index j rotated (pair: the N values from pa_rope_lane_pair(j)), rounded to U.
template <typename U, int N, int Rot, int Trad, typename P, typename R>
PA_INLINE void pa_rope(P x, P pair, int j, R table) {
  float rotated[N];
  PA_UNROLL
  for (int e = 0; e < N; ++e) {
    rotated[e] = pa_rope_value<Rot, Trad>(x[e], Trad ? pair[e ^ 1] : pair[e], j + e, table);
  }
  PA_UNROLL
  for (int e = 0; e < N; ++e) {
    x[e] = static_cast<float>(static_cast<U>(rotated[e]));
  }
}
"""


@dataclass(frozen=True)
class Dialect:
    name: str
    header: str
    tile: int  # PA_TILE: the edge of a square matrix tile
    tiles: str
    prelude: str
    shared_memory: int  # bytes of static threadgroup memory one threadgroup may declare


@dataclass(frozen=True)
class KernelSource:
    """One kernel of one variant, as ``mx.fast.metal_kernel``/``cuda_kernel`` take it."""

    name: str
    input_names: list[str]
    output_names: list[str]
    header: str
    source: str


CUDA = Dialect(
    name="cuda",
    header="""\
#define PA_SHARED __shared__
#define PA_BARRIER() __syncthreads()
#define PA_DEVICE_BARRIER() __syncthreads()  // and the threadgroup's writes to device memory
#define PA_SHUFFLE_XOR(x, m) __shfl_xor_sync(0xffffffffu, (x), (m))
#define PA_EXP(x) expf(x)
#define PA_MAX(a, b) fmaxf((a), (b))
#define PA_TANH(x) tanhf(x)
#define PA_INLINE __device__ __forceinline__
#define PA_UNROLL _Pragma("unroll")
#define PA_WRITABLE(T, p) const_cast<T*>(p)
typedef long long pa_index_t;

// N elements as loaded (16-byte aligned, in 16-byte loads), kept in registers until pa_unpack converts them.
template <int N, typename U>
struct PaRaw {
  static_assert(N * sizeof(U) % 16 == 0, "PaRaw: whole 16-byte loads");
  uint4 r[N * sizeof(U) / 16];
};
template <int N, typename U>
__device__ __forceinline__ void pa_load_raw(PaRaw<N, U>& dst, const U* src) {
  _Pragma("unroll")
  for (int i = 0; i < N * (int)sizeof(U) / 16; ++i) {
    dst.r[i] = reinterpret_cast<const uint4*>(src)[i];
  }
}
template <int N, typename U>
__device__ __forceinline__ void pa_unpack(float* dst, const PaRaw<N, U>& src) {
  const U* e = reinterpret_cast<const U*>(src.r);
  _Pragma("unroll")
  for (int i = 0; i < N; ++i) {
    dst[i] = static_cast<float>(e[i]);
  }
}

// N elements starting at src (16-byte aligned) as floats, in 16-byte loads.
template <int N, typename U>
__device__ __forceinline__ void pa_load(float* dst, const U* src) {
  PaRaw<N, U> raw;
  pa_load_raw(raw, src);
  pa_unpack(dst, raw);
}

// Whether pa_load can read from p.
template <typename U>
__device__ __forceinline__ bool pa_aligned(const U* p) {
  return reinterpret_cast<unsigned long long>(p) % 16 == 0;
}

// N elements of a row whose element i is at src[i * step], as floats: in 16-byte loads where the row is
// contiguous and 16-byte aligned.
template <int N, typename U>
__device__ __forceinline__ void pa_load_strided(float* dst, const U* src, long long step) {
  if (step == 1 && pa_aligned(src)) {
    pa_load<N>(dst, src);
    return;
  }
  _Pragma("unroll")
  for (int i = 0; i < N; ++i) {
    dst[i] = static_cast<float>(src[i * step]);
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
"""
    + ROPE_HELPERS,
    tile=16,
    tiles="""\
// Tiles of one warp, for mma.sync.m16n8k16 (two per tile product; no header: NVRTC may lack mma.h's).
// A (row-major in memory), B (row-major), B read from its transpose (B's columns are rows in memory):
// four 32-bit registers of two 16-bit values each, in the instruction's fragment layout; the float
// accumulator: eight values. Pointers and ld: even numbers of values.
template <typename U>
struct pa_tile_a {
  unsigned int r[4];
};
template <typename U>
struct pa_tile_b {
  unsigned int r[4];
};
template <typename U>
struct pa_tile_bt {
  unsigned int r[4];
};
struct pa_tile_acc {
  float c[8];
};

#define PA_UNROLL_4 _Pragma("unroll 4")
#define PA_SHARED_ALIGNED __shared__ __align__(16)

// N values from src to dst, both 16-byte aligned, in 16-byte copies.
template <int N, typename U>
__device__ __forceinline__ void pa_copy(U* dst, const U* src) {
  _Pragma("unroll")
  for (int i = 0; i < N; i += 16 / sizeof(U)) {
    *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
  }
}

template <typename U>
__device__ __forceinline__ unsigned int pa_pair(const U* src) {  // src[0] low, src[1] high
  return *reinterpret_cast<const unsigned int*>(src);
}
template <typename U>
__device__ __forceinline__ unsigned int pa_join(U low, U high) {
  return (unsigned int)(*reinterpret_cast<unsigned short*>(&low)) |
         ((unsigned int)(*reinterpret_cast<unsigned short*>(&high)) << 16);
}

// Lane l holds rows l / 4 and l / 4 + 8, columns (l % 4) * 2 + {0, 1} and those + 8.
template <typename U>
__device__ __forceinline__ void pa_tile_load(pa_tile_a<U>& tile, const U* src, int ld) {
  const int g = (threadIdx.x % 32) / 4, c = (threadIdx.x % 4) * 2;
  tile.r[0] = pa_pair(src + g * ld + c);
  tile.r[1] = pa_pair(src + (g + 8) * ld + c);
  tile.r[2] = pa_pair(src + g * ld + c + 8);
  tile.r[3] = pa_pair(src + (g + 8) * ld + c + 8);
}
// B's element (k, n) at src[n * ld + k]: lane l holds columns n = l / 4 and l / 4 + 8, rows (l % 4) * 2 +
// {0, 1} and those + 8.
template <typename U>
__device__ __forceinline__ void pa_tile_load(pa_tile_bt<U>& tile, const U* src, int ld) {
  const int g = (threadIdx.x % 32) / 4, c = (threadIdx.x % 4) * 2;
  tile.r[0] = pa_pair(src + g * ld + c);
  tile.r[1] = pa_pair(src + g * ld + c + 8);
  tile.r[2] = pa_pair(src + (g + 8) * ld + c);
  tile.r[3] = pa_pair(src + (g + 8) * ld + c + 8);
}
// B's element (k, n) at src[k * ld + n]: the same registers, two values from two rows each.
template <typename U>
__device__ __forceinline__ void pa_tile_load(pa_tile_b<U>& tile, const U* src, int ld) {
  const int g = (threadIdx.x % 32) / 4, c = (threadIdx.x % 4) * 2;
  tile.r[0] = pa_join(src[c * ld + g], src[(c + 1) * ld + g]);
  tile.r[1] = pa_join(src[(c + 8) * ld + g], src[(c + 9) * ld + g]);
  tile.r[2] = pa_join(src[c * ld + g + 8], src[(c + 1) * ld + g + 8]);
  tile.r[3] = pa_join(src[(c + 8) * ld + g + 8], src[(c + 9) * ld + g + 8]);
}
__device__ __forceinline__ void pa_tile_zero(pa_tile_acc& tile) {
  _Pragma("unroll")
  for (int i = 0; i < 8; ++i) {
    tile.c[i] = 0.0f;
  }
}

template <typename U>
struct pa_mma8;  // c (16 x 8) += a (16 x 16) . b (16 x 8), for U = __half ("f16") and __nv_bfloat16 ("bf16")
#define PA_MMA8(U, TYPE) \\
  template <> \\
  struct pa_mma8<U> { \\
    static __device__ __forceinline__ void run(float* c, const unsigned int* a, const unsigned int* b) { \\
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 " \\
                   "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n" \\
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) \\
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1])); \\
    } \\
  };
PA_MMA8(__half, "f16")
PA_MMA8(__nv_bfloat16, "bf16")
// acc += a . b
template <typename U, template <typename> class B>
__device__ __forceinline__ void pa_tile_mma(pa_tile_acc& acc, const pa_tile_a<U>& a, const B<U>& b) {
  pa_mma8<U>::run(acc.c, a.r, b.r);
  pa_mma8<U>::run(acc.c + 4, a.r, b.r + 2);
}
// Lane l holds rows l / 4 and l / 4 + 8, columns (l % 4) * 2 + {0, 1} of each 8-column half.
__device__ __forceinline__ void pa_tile_store(float* dst, const pa_tile_acc& tile, int ld) {
  const int g = (threadIdx.x % 32) / 4, c = (threadIdx.x % 4) * 2;
  _Pragma("unroll")
  for (int h = 0; h < 2; ++h) {
    dst[g * ld + h * 8 + c] = tile.c[h * 4];
    dst[g * ld + h * 8 + c + 1] = tile.c[h * 4 + 1];
    dst[(g + 8) * ld + h * 8 + c] = tile.c[h * 4 + 2];
    dst[(g + 8) * ld + h * 8 + c + 1] = tile.c[h * 4 + 3];
  }
}
""",
    prelude="""\
const int pa_tid = int(threadIdx.x);
const int pa_group_x = int(blockIdx.x);
const int pa_group_y = int(blockIdx.y);
const int pa_group_z = int(blockIdx.z);
""",
    shared_memory=48 * 1024,
)

METAL = Dialect(
    name="metal",
    header="""\
#define PA_SHARED threadgroup
#define PA_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define PA_DEVICE_BARRIER() threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup)
#define PA_SHUFFLE_XOR(x, m) simd_shuffle_xor((x), ushort(m))
#define PA_EXP(x) metal::exp(x)
#define PA_MAX(a, b) metal::max((a), (b))
#define PA_TANH(x) metal::precise::tanh(x)
#define PA_INLINE inline
#define PA_UNROLL _Pragma("clang loop unroll(full)")
#define PA_WRITABLE(T, p) const_cast<device T*>(p)
typedef long pa_index_t;

// N elements starting at src as floats.
template <int N, typename U>
inline void pa_load(thread float* dst, const device U* src) {
  for (int i = 0; i < N; ++i) {
    dst[i] = static_cast<float>(src[i]);
  }
}

// N elements as loaded, kept until pa_unpack converts them.
template <int N, typename U>
struct PaRaw {
  U v[N];
};
template <int N, typename U>
inline void pa_load_raw(thread PaRaw<N, U>& dst, const device U* src) {
  for (int i = 0; i < N; ++i) {
    dst.v[i] = src[i];
  }
}
template <int N, typename U>
inline void pa_unpack(thread float* dst, const thread PaRaw<N, U>& src) {
  for (int i = 0; i < N; ++i) {
    dst[i] = static_cast<float>(src.v[i]);
  }
}

// Whether pa_load can read from p: always (it reads element by element).
template <typename U>
inline bool pa_aligned(const device U* p) {
  return true;
}

// N elements of a row whose element i is at src[i * step], as floats.
template <int N, typename U>
inline void pa_load_strided(thread float* dst, const device U* src, long step) {
  for (int i = 0; i < N; ++i) {
    dst[i] = static_cast<float>(src[i * step]);
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
"""
    + ROPE_HELPERS,
    tile=8,
    tiles="""\
#include <metal_simdgroup_matrix>
#define PA_UNROLL_4 _Pragma("clang loop unroll_count(4)")
#define PA_SHARED_ALIGNED threadgroup

// N values from src to dst.
template <int N, typename P, typename Q>
inline void pa_copy(P dst, Q src) {
  for (int i = 0; i < N; ++i) {
    dst[i] = src[i];
  }
}

// Tiles of one simd group: A (row-major in memory), B (row-major), B read from its transpose (B's columns
// are rows in memory), and a float accumulator.
template <typename U>
using pa_tile_a = simdgroup_matrix<U, 8, 8>;
template <typename U>
using pa_tile_b = simdgroup_matrix<U, 8, 8>;
template <typename U>
struct pa_tile_bt {
  simdgroup_matrix<U, 8, 8> m;
};
typedef simdgroup_matrix<float, 8, 8> pa_tile_acc;

template <typename U, typename P>
inline void pa_tile_load(thread simdgroup_matrix<U, 8, 8>& tile, P src, int ld) {
  simdgroup_load(tile, src, ulong(ld));
}
template <typename U, typename P>
inline void pa_tile_load(thread pa_tile_bt<U>& tile, P src, int ld) {
  simdgroup_load(tile.m, src, ulong(ld), ulong2(0, 0), true);
}
inline void pa_tile_zero(thread pa_tile_acc& tile) {
  tile = pa_tile_acc(0.0f);
}
// acc += a . b
template <typename U>
inline void pa_tile_mma(thread pa_tile_acc& acc, thread const simdgroup_matrix<U, 8, 8>& a,
                        thread const simdgroup_matrix<U, 8, 8>& b) {
  simdgroup_multiply_accumulate(acc, a, b, acc);
}
template <typename U>
inline void pa_tile_mma(thread pa_tile_acc& acc, thread const simdgroup_matrix<U, 8, 8>& a,
                        thread const pa_tile_bt<U>& b) {
  simdgroup_multiply_accumulate(acc, a, b.m, acc);
}
template <typename P>
inline void pa_tile_store(P dst, thread const pa_tile_acc& tile, int ld) {
  simdgroup_store(tile, dst, ulong(ld));
}
""",
    prelude="""\
const int pa_tid = int(thread_index_in_threadgroup);
const int pa_group_x = int(threadgroup_position_in_grid.x);
const int pa_group_y = int(threadgroup_position_in_grid.y);
const int pa_group_z = int(threadgroup_position_in_grid.z);
""",
    shared_memory=32 * 1024,
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


def render(
    template: str, dialect: Dialect, defines: dict[str, int] | None = None, tiles: bool = False
) -> dict[str, tuple[str, str]]:
    """``{kernel: (header, body)}`` ready for ``mx.fast.metal_kernel``/``cuda_kernel``.

    ``defines``: the macros that choose one variant of the template (``{"PA_BITS": 4, ...}``), written
    as ``#define`` lines at the head of every kernel's header; ``tiles``: the template multiplies
    ``pa_tile_*`` matrix tiles (``PA_TILE`` values square).
    """
    if tiles:
        defines = {**(defines or {}), "PA_TILE": dialect.tile}
    macros = "".join(f"#define {name} {value}\n" for name, value in (defines or {}).items())
    header = macros + dialect.header + (dialect.tiles if tiles else "")
    return {name: (header, dialect.prelude + body) for name, body in split_kernels(template).items()}


def build(source: KernelSource, dialect: Dialect, contiguous: bool = True):
    """The MLX kernel for ``source`` in ``dialect`` (MLX compiles it at its first call); unless
    ``contiguous``, MLX passes inputs as they are (no copy of a strided view): the source must read every
    input that may be a view through its strides."""
    make = mx.fast.cuda_kernel if dialect is CUDA else mx.fast.metal_kernel
    return make(
        name=source.name,
        input_names=source.input_names,
        output_names=source.output_names,
        header=source.header,
        source=source.source,
        ensure_row_contiguous=contiguous,
    )
