// Integer-dot quantized matmul for the CPU, called from JAX through the XLA FFI (jax.ffi).
//
// y[N, O] = x[N, K] @ W[K, O], where W is a `pallas_kernels.quant_format.QuantizedArray` in the project's own layout
// (no repacking): "q4_1" / "q4_0" values are uint8 [K/2, O] (two 4-bit quants per byte; in group g, packed row j
// holds element j in its low nibble and element j + G/2 in its high nibble), "int8" values are int8 [K, O]; scales
// (and q4_1 mins) are [K/G, O], float16 or float32.
//
// As llama.cpp does on the CPU, the activations are quantized to int8 (one scale per block of `B` inputs, B = G for
// the q4 kinds) and every block is an integer dot product: AVX2 `maddubs` (u8 x s8 pairs) for 4-bit weights, `madd`
// (s16 x s16 pairs) for 8-bit ones, accumulated in int32 and scaled in float32 once per block. The output axis is
// the SIMD axis (32 columns per tile, the layout's minor axis), so each weight byte is read once per call whatever N
// is, and tiles are spread over threads with OpenMP.
//
//   q4_1: sum_k x_k (q_k d + m) = d * sum_k x_k q_k + m * sum_k x_k      (per group)
//   q4_0: sum_k x_k (q_k - 8) d = d * sum_k x_k q_k - 8 d * sum_k x_k
//   int8: sum_k x_k q_k d
// with x_k ~= dx * xq_k (xq = round(x / dx), dx = max|x| / 127 over the block) in both sums. Using the quantized x
// in the min term too (as llama.cpp's q8_1 `s`) matters: q_k d + m is a small difference of large terms, and with
// the exact sum of x there the activation error of the first term would not cancel (2-3% instead of ~0.5%).
//
// Columns past the last whole tile of 32 run a scalar loop with the same arithmetic. Everything AVX2 sits in
// functions compiled for that target; `jpg_cpu_supported()` says whether this CPU can run them.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTile = 32;  // output columns per SIMD tile
constexpr int kMaxRows = 4;  // activation rows per pass over a tile's weights
constexpr int kSpan = 8;     // adjacent tiles a thread takes together (see tile_rows)

enum Kind : int32_t { kQ4_1 = 0, kQ4_0 = 1, kInt8 = 2 };

inline float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) {
        man <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Scales or mins: float16 or float32 [K/G, O].
struct Table {
  const void* data = nullptr;
  bool f16 = false;
  int64_t cols = 0;
  float at(int64_t g, int64_t o) const {
    return f16 ? half_to_float(static_cast<const uint16_t*>(data)[g * cols + o])
               : static_cast<const float*>(data)[g * cols + o];
  }
};

struct Problem {
  int32_t kind;
  int64_t n, k, o, g;  // rows of x, inputs, outputs, weight group size
  int64_t b;           // activation block (divides g)
  const uint8_t* values;
  Table scales, mins;
  // quantized activations
  const int8_t* xq;    // [n, k]
  const int16_t* xp16; // q4 kinds: [n, k / 2] the byte pairs (xq[j], xq[j + g/2]) of each group, as maddubs reads them
  const int32_t* xp32; // int8: [n, k / 2] the int16 pairs (xq[i], xq[i + 1]), as madd reads them
  const float* xd;     // [n, k / b]  block scales
  const float* xs;     // [n, k / g]  exact group sums of x (the q4 kinds' min term)
  float* y;            // [n, o]
};

// Quantize row `r` of x into xq/xd and the per-group sums xs.
void quantize_rows(const float* x, int64_t n, int64_t k, int64_t b, int64_t g, int8_t* xq, float* xd, float* xs) {
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * k;
    for (int64_t blk = 0; blk < k / b; ++blk) {
      float amax = 0.f;
      for (int64_t i = 0; i < b; ++i) amax = std::max(amax, std::fabs(xr[blk * b + i]));
      float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      xd[r * (k / b) + blk] = d;
      for (int64_t i = 0; i < b; ++i) {
        float v = std::nearbyint(xr[blk * b + i] * inv);
        xq[r * k + blk * b + i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
      }
    }
    for (int64_t grp = 0; grp < k / g; ++grp) {  // sum of the quantized x: the min term then cancels exactly
      float s = 0.f;
      for (int64_t blk = grp * g / b; blk < (grp + 1) * g / b; ++blk) {
        int32_t q = 0;
        for (int64_t i = 0; i < b; ++i) q += xq[r * k + blk * b + i];
        s += xd[r * (k / b) + blk] * static_cast<float>(q);
      }
      xs[r * (k / g) + grp] = s;
    }
  }
}

// ------------------------------------------------------------------------------------------------ scalar columns
void scalar_columns(const Problem& p, int64_t o_begin, int64_t o_end) {
  const int64_t nb = p.k / p.b, ng = p.k / p.g;
  for (int64_t r = 0; r < p.n; ++r) {
    for (int64_t o = o_begin; o < o_end; ++o) {
      float acc = 0.f;
      for (int64_t grp = 0; grp < ng; ++grp) {
        float gacc = 0.f;
        for (int64_t blk = grp * p.g / p.b; blk < (grp + 1) * p.g / p.b; ++blk) {
          int32_t dot = 0;
          for (int64_t i = blk * p.b; i < (blk + 1) * p.b; ++i) {
            int32_t q;
            if (p.kind == kInt8) {
              q = reinterpret_cast<const int8_t*>(p.values)[i * p.o + o];
            } else {
              int64_t j = i - grp * p.g, half = p.g / 2;
              uint8_t byte = p.values[(grp * half + (j % half)) * p.o + o];
              q = j < half ? (byte & 15) : (byte >> 4);
            }
            dot += q * p.xq[r * p.k + i];
          }
          gacc += p.xd[r * nb + blk] * static_cast<float>(dot);
        }
        float d = p.scales.at(grp, o);
        float m = p.kind == kQ4_1 ? p.mins.at(grp, o) : (p.kind == kQ4_0 ? -8.f * d : 0.f);
        acc += d * gacc + m * p.xs[r * ng + grp];
      }
      p.y[r * p.o + o] = acc;
    }
  }
}

// --------------------------------------------------------------------------------------------------- AVX2 tiles
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const Table& t, int64_t g, int64_t o) {
  if (t.f16) {
    const uint16_t* p = static_cast<const uint16_t*>(t.data) + g * t.cols + o;
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  return _mm256_loadu_ps(static_cast<const float*>(t.data) + g * t.cols + o);
}

// gacc[r][0..31] (float, columns in order) of one group, for R activation rows, 4-bit weights.
template <int R>
__attribute__((target("avx2,fma,f16c"))) void q4_group(const Problem& p, int64_t r0, int64_t grp, int64_t o0,
                                                       float gacc[][kTile]) {
  const int64_t half = p.g / 2;
  const __m256i low = _mm256_set1_epi8(15);
  __m256i acc32[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc32[r][v] = _mm256_setzero_si256();
  const int16_t* xp[R];
  for (int r = 0; r < R; ++r) xp[r] = p.xp16 + (r0 + r) * (p.k / 2) + grp * half;
  for (int64_t j0 = 0; j0 < half; j0 += 8) {  // int16 sums of <= 8 pairs (<= 8 * 2 * 15 * 127) cannot overflow
    __m256i acc16[R][2];
    for (int r = 0; r < R; ++r) acc16[r][0] = acc16[r][1] = _mm256_setzero_si256();
    const int64_t j1 = std::min<int64_t>(j0 + 8, half);
    for (int64_t j = j0; j < j1; ++j) {
      __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.values + (grp * half + j) * p.o + o0));
      __m256i lo = _mm256_and_si256(bytes, low);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
      __m256i a0 = _mm256_unpacklo_epi8(lo, hi);  // (lo, hi) pairs: columns 0-7 | 16-23
      __m256i a1 = _mm256_unpackhi_epi8(lo, hi);  // columns 8-15 | 24-31
      for (int r = 0; r < R; ++r) {
        __m256i bx = _mm256_set1_epi16(xp[r][j]);
        acc16[r][0] = _mm256_add_epi16(acc16[r][0], _mm256_maddubs_epi16(a0, bx));
        acc16[r][1] = _mm256_add_epi16(acc16[r][1], _mm256_maddubs_epi16(a1, bx));
      }
    }
    for (int r = 0; r < R; ++r) {
      acc32[r][0] = _mm256_add_epi32(acc32[r][0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc16[r][0])));  // 0-7
      acc32[r][1] = _mm256_add_epi32(acc32[r][1], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc16[r][1])));  // 8-15
      acc32[r][2] = _mm256_add_epi32(acc32[r][2], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc16[r][0], 1)));  // 16-23
      acc32[r][3] = _mm256_add_epi32(acc32[r][3], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc16[r][1], 1)));  // 24-31
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 dx = _mm256_set1_ps(p.xd[(r0 + r) * (p.k / p.b) + grp]);  // b == g for the q4 kinds
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(gacc[r] + 8 * v, _mm256_mul_ps(dx, _mm256_cvtepi32_ps(acc32[r][v])));
  }
}

// gacc for 8-bit weights: blocks of b inputs inside the group, each scaled by its activation scale.
template <int R>
__attribute__((target("avx2,fma,f16c"))) void int8_group(const Problem& p, int64_t r0, int64_t grp, int64_t o0,
                                                         float gacc[][kTile]) {
  const int8_t* w = reinterpret_cast<const int8_t*>(p.values);
  __m256 facc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) facc[r][v] = _mm256_setzero_ps();
  for (int64_t blk = grp * p.g / p.b; blk < (grp + 1) * p.g / p.b; ++blk) {
    __m256i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_si256();
    for (int64_t i = blk * p.b; i < (blk + 1) * p.b; i += 2) {
      __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * p.o + o0));
      __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (i + 1) * p.o + o0));
      __m256i w0a = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w0)), w1a = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w1));
      __m256i w0b = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w0, 1)), w1b = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w1, 1));
      __m256i pa0 = _mm256_unpacklo_epi16(w0a, w1a), pa1 = _mm256_unpackhi_epi16(w0a, w1a);  // 0-3|8-11, 4-7|12-15
      __m256i pb0 = _mm256_unpacklo_epi16(w0b, w1b), pb1 = _mm256_unpackhi_epi16(w0b, w1b);  // 16-19|24-27, 20-23|28-31
      for (int r = 0; r < R; ++r) {
        __m256i bx = _mm256_set1_epi32(p.xp32[(r0 + r) * (p.k / 2) + i / 2]);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(pa0, bx));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(pa1, bx));
        acc[r][2] = _mm256_add_epi32(acc[r][2], _mm256_madd_epi16(pb0, bx));
        acc[r][3] = _mm256_add_epi32(acc[r][3], _mm256_madd_epi16(pb1, bx));
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 dx = _mm256_set1_ps(p.xd[(r0 + r) * (p.k / p.b) + blk]);
      __m256i c0 = _mm256_permute2x128_si256(acc[r][0], acc[r][1], 0x20);  // 0-7
      __m256i c1 = _mm256_permute2x128_si256(acc[r][0], acc[r][1], 0x31);  // 8-15
      __m256i c2 = _mm256_permute2x128_si256(acc[r][2], acc[r][3], 0x20);  // 16-23
      __m256i c3 = _mm256_permute2x128_si256(acc[r][2], acc[r][3], 0x31);  // 24-31
      facc[r][0] = _mm256_fmadd_ps(dx, _mm256_cvtepi32_ps(c0), facc[r][0]);
      facc[r][1] = _mm256_fmadd_ps(dx, _mm256_cvtepi32_ps(c1), facc[r][1]);
      facc[r][2] = _mm256_fmadd_ps(dx, _mm256_cvtepi32_ps(c2), facc[r][2]);
      facc[r][3] = _mm256_fmadd_ps(dx, _mm256_cvtepi32_ps(c3), facc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(gacc[r] + 8 * v, facc[r][v]);
}

// `span` adjacent tiles (starting at column o0) for R activation rows. Groups are the outer loop and the tiles the
// inner one, so the rows of a group are read `span * 32` contiguous bytes at a time (whole cache lines, used while
// they are in L1) instead of 32 bytes per row `O` bytes apart -- the strided pattern ran at a fraction of memory
// speed on wide matrices (the LM head).
template <int R>
__attribute__((target("avx2,fma,f16c"))) void tile_rows(const Problem& p, int64_t r0, int64_t o0, int span) {
  alignas(32) float gacc[R][kTile];
  alignas(32) float out[kSpan][R][kTile];
  std::memset(out, 0, sizeof(out));
  const int64_t ng = p.k / p.g;
  for (int64_t grp = 0; grp < ng; ++grp) {
    for (int s = 0; s < span; ++s) {
      const int64_t oc = o0 + s * kTile;
      if (p.kind == kInt8) {
        int8_group<R>(p, r0, grp, oc, gacc);
      } else {
        q4_group<R>(p, r0, grp, oc, gacc);
      }
      for (int v = 0; v < 4; ++v) {
        __m256 d = load8(p.scales, grp, oc + 8 * v);
        __m256 m = _mm256_setzero_ps();
        if (p.kind == kQ4_1) m = load8(p.mins, grp, oc + 8 * v);
        if (p.kind == kQ4_0) m = _mm256_mul_ps(_mm256_set1_ps(-8.f), d);
        for (int r = 0; r < R; ++r) {
          __m256 acc = _mm256_load_ps(out[s][r] + 8 * v);
          acc = _mm256_fmadd_ps(d, _mm256_load_ps(gacc[r] + 8 * v), acc);
          if (p.kind != kInt8) acc = _mm256_fmadd_ps(m, _mm256_set1_ps(p.xs[(r0 + r) * ng + grp]), acc);
          _mm256_store_ps(out[s][r] + 8 * v, acc);
        }
      }
    }
  }
  for (int s = 0; s < span; ++s)
    for (int r = 0; r < R; ++r) std::memcpy(p.y + (r0 + r) * p.o + o0 + s * kTile, out[s][r], sizeof(float) * kTile);
}

__attribute__((target("avx2,fma,f16c"))) void tile(const Problem& p, int64_t o0, int span) {
  int64_t r0 = 0;
  for (; r0 + 4 <= p.n; r0 += 4) tile_rows<4>(p, r0, o0, span);
  switch (p.n - r0) {
    case 3: tile_rows<3>(p, r0, o0, span); break;
    case 2: tile_rows<2>(p, r0, o0, span); break;
    case 1: tile_rows<1>(p, r0, o0, span); break;
    default: break;
  }
}

// --------------------------------------------------------------------------------------------------- the handler
// `values`, `scales` and `mins` are one matrix ([rows, O]) or a stack of them ([L, rows, O], e.g. a model's layers):
// then `layer` (an int32 scalar operand) picks the matrix, read in place. Inside a `lax.scan` over layers this is
// what keeps XLA from copying each layer's slice into a fresh buffer for the call (a copy of every weight byte,
// which cost as much as the matmul itself).
ffi::Error QuantMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values, ffi::AnyBuffer scales, ffi::AnyBuffer mins,
                           ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int32_t kind,
                           int64_t group_size, int64_t block, int64_t threads) {
  auto xd = x.dimensions();
  auto sd = scales.dimensions();
  const size_t rank = sd.size();
  if (xd.size() != 2 || (rank != 2 && rank != 3) || values.dimensions().size() != rank)
    return ffi::Error::InvalidArgument("quant_matmul: x must be 2-D, values and scales 2-D or 3-D (stacked)");
  const int64_t stack = rank == 3 ? sd[0] : 1;
  const int64_t li = rank == 3 ? static_cast<int64_t>(layer.typed_data()[0]) : 0;
  if (li < 0 || li >= stack) return ffi::Error::InvalidArgument("quant_matmul: layer index out of range");
  Problem p{};
  p.kind = kind;
  p.n = xd[0];
  p.k = xd[1];
  p.o = sd[rank - 1];
  p.g = group_size;
  p.b = block;
  if (p.g <= 0 || p.k % p.g || p.b <= 0 || p.g % p.b || (kind != kInt8 && p.b != p.g) || p.b % 2 ||
      sd[rank - 2] != p.k / p.g || (kind != kInt8 && p.g % 2))
    return ffi::Error::InvalidArgument("quant_matmul: group_size/block do not fit the shapes");
  const int64_t table_elems = (p.k / p.g) * p.o;  // one matrix's scales (or mins)
  const int64_t value_bytes = (kind == kInt8 ? p.k : p.k / 2) * p.o;
  auto vk = values.element_type();
  if ((kind == kInt8 && vk != ffi::DataType::S8) || (kind != kInt8 && vk != ffi::DataType::U8))
    return ffi::Error::InvalidArgument("quant_matmul: values must be uint8 (q4) or int8 (int8)");
  auto table = [&](const ffi::AnyBuffer& t, Table* out) -> bool {
    if (t.element_type() == ffi::DataType::F16) {
      out->f16 = true;
    } else if (t.element_type() != ffi::DataType::F32) {
      return false;
    }
    out->data = static_cast<const char*>(t.untyped_data()) + li * table_elems * (out->f16 ? 2 : 4);
    out->cols = p.o;
    return true;
  };
  if (!table(scales, &p.scales) || (kind == kQ4_1 && !table(mins, &p.mins)))
    return ffi::Error::InvalidArgument("quant_matmul: scales and mins must be float16 or float32");
  p.values = static_cast<const uint8_t*>(values.untyped_data()) + li * value_bytes;
  std::vector<int8_t> xq(p.n * p.k);
  std::vector<float> xdv(p.n * (p.k / p.b)), xs(p.n * (p.k / p.g));
  quantize_rows(x.typed_data(), p.n, p.k, p.b, p.g, xq.data(), xdv.data(), xs.data());
  p.xq = xq.data();
  std::vector<int16_t> xp16;
  std::vector<int32_t> xp32;
  if (kind == kInt8) {
    xp32.resize(p.n * (p.k / 2));
    for (int64_t r = 0; r < p.n; ++r)
      for (int64_t i = 0; i < p.k; i += 2)
        xp32[r * (p.k / 2) + i / 2] = static_cast<int32_t>(
            static_cast<uint16_t>(static_cast<int16_t>(xq[r * p.k + i])) |
            (static_cast<uint32_t>(static_cast<uint16_t>(static_cast<int16_t>(xq[r * p.k + i + 1]))) << 16));
    p.xp32 = xp32.data();
  } else {
    const int64_t half = p.g / 2;
    xp16.resize(p.n * (p.k / 2));
    for (int64_t r = 0; r < p.n; ++r)
      for (int64_t grp = 0; grp < p.k / p.g; ++grp)
        for (int64_t j = 0; j < half; ++j) {
          const int8_t* g0 = xq.data() + r * p.k + grp * p.g;
          xp16[r * (p.k / 2) + grp * half + j] = static_cast<int16_t>(
              static_cast<uint8_t>(g0[j]) | (static_cast<uint16_t>(static_cast<uint8_t>(g0[j + half])) << 8));
        }
    p.xp16 = xp16.data();
  }
  p.xd = xdv.data();
  p.xs = xs.data();
  p.y = y->typed_data();
  const int64_t tiles = p.o / kTile;
  const int64_t spans = (tiles + kSpan - 1) / kSpan;  // units of work: kSpan adjacent tiles (the last may be fewer)
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, spans)));
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t u = 0; u < spans; ++u)
    tile(p, u * kSpan * kTile, static_cast<int>(std::min<int64_t>(kSpan, tiles - u * kSpan)));
  if (tiles * kTile < p.o) scalar_columns(p, tiles * kTile, p.o);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpgQuantMatmul, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [N, K]
                                  .Arg<ffi::AnyBuffer>()         // values
                                  .Arg<ffi::AnyBuffer>()         // scales [K/G, O]
                                  .Arg<ffi::AnyBuffer>()         // mins [K/G, O] (q4_1) or anything
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer: which matrix of a stack
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [N, O]
                                  .Attr<int32_t>("kind")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("threads"));

extern "C" int jpg_cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

extern "C" int jpg_max_threads() { return omp_get_max_threads(); }
