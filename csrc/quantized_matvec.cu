// y = x @ W.T for a few rows of x, W affine-quantized as mx.quantize packs it (CUDA only: on Metal MLX's own
// quantized matrix-vector product is the fast one; on CUDA it reads the weights at a fraction of the memory's
// rate, benchmarks/RESULTS.md).
//
// Compile-time values: T (x, scales, biases and y), BITS (4 or 8), GROUP (values per scale), ROWS (rows of x),
// OUTS (outputs a simd group computes), NT (threads a threadgroup). Inputs: x (ROWS, K) of T; w (N, K * BITS / 32)
// words, value k of a row in bits (k * BITS) % 32 upwards of word k * BITS / 32; scales and biases (N, K / GROUP)
// of T, W[n, k] = scale * code + bias. Output: y (ROWS, N) of T.
//
// grid: (ceil(N / (NT / 32 * OUTS)) * NT, 1, 1); threadgroup: (NT, 1, 1). Each simd group computes OUTS
// consecutive outputs for every row, alone (no threadgroup memory, no barrier): lane l takes the 16-byte chunks
// of packed codes c = l, l + 32, ... of each output's row of w (CODES values of k each, all in one group: GROUP
// is a multiple of CODES), so a simd group reads 512 consecutive bytes of a row at a time. Codes become
// half-precision numbers two at a time: one bitwise operation makes 1024 + code of each (exact), one
// half-precision subtraction takes the 1024 away (exact). Per chunk a lane sums x * code per (output, row) and
// x per row, once for all OUTS outputs, and adds scale * sum(x * code) + bias * sum(x); float32 sums
// throughout. The lanes' sums are then added across the simd group. x and w may start anywhere a view of
// theirs does: off 16-byte boundaries they are read a value at a time.

// A load of B bytes (16, 8, 4 or 2) in one instruction.
template <int B> struct QmLoad;
template <> struct QmLoad<16> { typedef uint4 type; };
template <> struct QmLoad<8> { typedef uint2 type; };
template <> struct QmLoad<4> { typedef unsigned int type; };
template <> struct QmLoad<2> { typedef unsigned short type; };

// N values of U from src as floats: in loads of up to 16 bytes where src is aligned to their size (aligned),
// else one value at a time.
template <int N, typename U>
__device__ __forceinline__ void qm_load(float* dst, const U* src, bool aligned) {
  constexpr int bytes = N * sizeof(U) < 16 ? N * sizeof(U) : 16;
  constexpr int per = bytes / sizeof(U);
  if (aligned) {
#pragma unroll
    for (int i = 0; i < N; i += per) {
      const typename QmLoad<bytes>::type raw = *reinterpret_cast<const typename QmLoad<bytes>::type*>(src + i);
      const U* e = reinterpret_cast<const U*>(&raw);
#pragma unroll
      for (int j = 0; j < per; ++j) {
        dst[i + j] = static_cast<float>(e[j]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      dst[i] = static_cast<float>(src[i]);
    }
  }
}

// @kernel matvec
constexpr int CODES = 128 / BITS;  // codes in a 16-byte chunk
constexpr int PER_WORD = 32 / BITS;
constexpr unsigned int PAIR_MASK = ((1u << BITS) - 1u) * 0x00010001u;  // one code in each half of a word
constexpr int WARPS = NT / 32;

const int K = x_shape[1];
const int N = w_shape[0];
const long long words_per_row = K / PER_WORD;
const long long groups_per_row = K / GROUP;
const int chunks = K / CODES;
const int lane = threadIdx.x % 32;
const int n0 = (blockIdx.x * WARPS + threadIdx.x / 32) * OUTS;
if (n0 >= N) {
  return;
}
// Rows of x and w start on 16-byte boundaries when their first does (K is a multiple of 32 values).
const bool aligned = ((reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(w)) & 15) == 0;

float acc[OUTS][ROWS];
#pragma unroll
for (int o = 0; o < OUTS; ++o) {
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    acc[o][m] = 0.0f;
  }
}

#pragma unroll 2
for (int c = lane; c < chunks; c += 32) {
  uint4 packed[OUTS];
  float scale[OUTS], bias[OUTS];
  const long long g = (long long)c * CODES / GROUP;
#pragma unroll
  for (int o = 0; o < OUTS; ++o) {
    const long long n = n0 + o < N ? n0 + o : N - 1;  // past the last output: read the last row, write nothing
    const unsigned int* words = w + n * words_per_row + c * 4;
    packed[o] = aligned ? *reinterpret_cast<const uint4*>(words) : make_uint4(words[0], words[1], words[2], words[3]);
    scale[o] = static_cast<float>(scales[n * groups_per_row + g]);
    bias[o] = static_cast<float>(biases[n * groups_per_row + g]);
  }
  float dot[OUTS][ROWS], xsum[ROWS];
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    xsum[m] = 0.0f;
#pragma unroll
    for (int o = 0; o < OUTS; ++o) {
      dot[o][m] = 0.0f;
    }
  }
#pragma unroll
  for (int s = 0; s < 4; ++s) {  // the chunk's four words, PER_WORD codes each
    float code[OUTS][PER_WORD];
#pragma unroll
    for (int o = 0; o < OUTS; ++o) {
      const unsigned int word = s == 0 ? packed[o].x : s == 1 ? packed[o].y : s == 2 ? packed[o].z : packed[o].w;
#pragma unroll
      for (int p = 0; p < PER_WORD / 2; ++p) {  // codes p and p + PER_WORD / 2
        const unsigned int pair = ((word >> (p * BITS)) & PAIR_MASK) | 0x64006400u;  // 1024 + each code
        const unsigned int offset = 0x64006400u;
        const float2 both = __half22float2(
            __hsub2(*reinterpret_cast<const __half2*>(&pair), *reinterpret_cast<const __half2*>(&offset)));
        code[o][p] = both.x;
        code[o][p + PER_WORD / 2] = both.y;
      }
    }
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      float xv[PER_WORD];
      qm_load<PER_WORD>(xv, x + (long long)m * K + c * CODES + s * PER_WORD, aligned);
#pragma unroll
      for (int j = 0; j < PER_WORD; ++j) {
        xsum[m] += xv[j];
#pragma unroll
        for (int o = 0; o < OUTS; ++o) {
          dot[o][m] += xv[j] * code[o][j];
        }
      }
    }
  }
#pragma unroll
  for (int o = 0; o < OUTS; ++o) {
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      acc[o][m] += scale[o] * dot[o][m] + bias[o] * xsum[m];
    }
  }
}

#pragma unroll
for (int o = 0; o < OUTS; ++o) {
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    float v = acc[o][m];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      v += __shfl_xor_sync(0xffffffffu, v, off);
    }
    if (lane == (o * ROWS + m) % 32 && n0 + o < N) {
      y[(long long)m * N + n0 + o] = static_cast<T>(v);
    }
  }
}
