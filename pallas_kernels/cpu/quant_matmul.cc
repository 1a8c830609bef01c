// Integer-dot quantized matmul for the CPU, called from JAX through the XLA FFI (jax.ffi).
//
// y[N, O] = x[N, K] @ W[K, O], where W is a `pallas_kernels.quant_format.QuantizedArray` in the project's own layout
// (no repacked copy): "q4_1" / "q4_0" values are uint8 [K/2, O] (two 4-bit quants per byte; in group g, packed row
// j holds element j in its low nibble and element j + G/2 in its high nibble), "int8" values are int8 [K, O];
// scales (and q4_1 mins) are [K/G, O], float16 or float32.
//
// As llama.cpp does on the CPU, the activations are quantized to int8 (one scale per block of `B` inputs, B = G for
// the q4 kinds) and every block is an integer dot product accumulated in int32 and scaled in float32 once per
// block:
//
//   q4_1: sum_k x_k (q_k d + m) = d * sum_k x_k q_k + m * sum_k x_k      (per group)
//   q4_0: sum_k x_k (q_k - 8) d = d * sum_k x_k q_k - 8 d * sum_k x_k
//   int8: sum_k x_k q_k d
// with x_k ~= dx * xq_k (xq = round(x / dx), dx = max|x| / 127 over the block) in both sums. Using the quantized x
// in the min term too (as llama.cpp's q8_1 `s`) matters: q_k d + m is a small difference of large terms, and with
// the exact sum of x there the activation error of the first term would not cancel (2-3% instead of ~0.5%).
//
// The column kernel (quant_matmul_body.inc) is compiled for three instruction sets and picked at run time (or by
// the `isa` attribute): AVX2, AVX-VNNI and AVX512-VNNI (the last two add `vpdpbusd`, four u8 x s8 products summed
// into int32 in one instruction). The output axis is the SIMD axis (tiles of 32 columns, 64 in the 512-bit
// AVX512 build; the layout's minor axis); each thread takes an equal run of tiles; rows of x are quantized in parallel first (on the calling thread alone
// when x is small). The threads are XLA's own intra-op pool (the FFI's ThreadPool context), not a second pool: on
// a small machine two pools' spinning threads took the cores from each other between calls (single-stream decode
// ran 20-30% slower with OpenMP's). Columns past the last whole tile (of 32 after the 512-bit build's tiles of 64)
// run a scalar loop with the same arithmetic. Built with GCC (the `#pragma GCC target` sections). `jpg_isa_supported()` says what this CPU can run.

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "fork_join.h"

namespace ffi = xla::ffi;

namespace {

using jpg::fork_join;

constexpr int kSpan = 8;  // adjacent tiles taken together, so each weight row is read 256-512 contiguous bytes

struct alignas(64) Reg {  // storage for one __m512i, or two __m256i
  unsigned char bytes[64];
};

enum Kind : int32_t { kQ4_1 = 0, kQ4_0 = 1, kInt8 = 2 };
enum Isa : int32_t { kAuto = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3, kAvx512Amx = 4 };

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
  int64_t b;           // activation block (divides g; b == g for the q4 kinds)
  int64_t nb;          // k / b activation blocks per row
  int64_t steps;       // steps (4 inputs each, see quant_matmul_body.inc) per block: ceil(g / 4) or ceil(b / 4)
  int64_t nsteps;      // nb * steps
  const uint8_t* values;
  Table scales, mins;
  // quantized activations
  int8_t* xq;          // [n, k]
  int32_t* xw;         // [n, nsteps]  4 int8 per step, in the order the weight steps hold their inputs
  float* xd;           // [n, nb]  block scales
  int32_t* xqs;        // [n, nb]  sums of xq per block (VNNI's int8 weights run as w + 128)
  float* xs;           // [n, k / g]  group sums of the quantized x (the q4 kinds' min term)
  float* y;            // [n, o]
  bool stream;         // prefetch the weights non-temporally (see `prefetch` in quant_matmul_body.inc)
};

// ------------------------------------------------------------------------------------------- activation quantizing
// 8 floats times `inv`, rounded half to even (the default mode, like nearbyint) and clamped to [-127, 127].
__attribute__((target("avx2,fma,f16c"))) inline __m256i quantize8(const float* x, __m256 inv, __m256i top,
                                                                  __m256i bottom) {
  const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), inv));
  return _mm256_max_epi32(_mm256_min_epi32(v, top), bottom);
}

// Row r of x -> xq, xd, xqs, xs and the step words xw (every instruction set has AVX2, which this uses).
__attribute__((target("avx2,fma,f16c"))) void quantize_row(const Problem& p, const float* x, int64_t r) {
  const float* xr = x + r * p.k;
  int8_t* q = p.xq + r * p.k;
  for (int64_t blk = 0; blk < p.nb; ++blk) {
    const float* xb = xr + blk * p.b;
    float amax = 0.f;
    int64_t i = 0;
    if (p.b % 8 == 0) {
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 m = _mm256_setzero_ps();
      for (; i < p.b; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      amax = _mm_cvtss_f32(h);
    } else {
      for (; i < p.b; ++i) amax = std::max(amax, std::fabs(xb[i]));
    }
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    p.xd[r * p.nb + blk] = d;
    int32_t sum = 0;
    i = 0;
    if (p.b % 8 == 0) {  // round half to even (the default mode), like nearbyint
      const __m256 vinv = _mm256_set1_ps(inv);
      const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
      __m256i vsum = _mm256_setzero_si256();
      // 32 at a time: the int32 values packed to int8 in registers (packs work within 128-bit lanes: the dwords
      // of the packed bytes come out as a0 b0 c0 d0 | a1 b1 c1 d1 for the quarters a-d, hence the permute)
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      for (; i + 32 <= p.b; i += 32) {
        const __m256i a = quantize8(xb + i, vinv, top, bottom), b = quantize8(xb + i + 8, vinv, top, bottom);
        const __m256i c = quantize8(xb + i + 16, vinv, top, bottom), d = quantize8(xb + i + 24, vinv, top, bottom);
        vsum = _mm256_add_epi32(_mm256_add_epi32(vsum, _mm256_add_epi32(a, b)), _mm256_add_epi32(c, d));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + blk * p.b + i), _mm256_permutevar8x32_epi32(bytes, order));
      }
      for (; i < p.b; i += 8) {
        const __m256i v = quantize8(xb + i, vinv, top, bottom);
        vsum = _mm256_add_epi32(vsum, v);
        alignas(32) int32_t tmp[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), v);
        for (int u = 0; u < 8; ++u) q[blk * p.b + i + u] = static_cast<int8_t>(tmp[u]);
      }
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(vsum), _mm256_extracti128_si256(vsum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      sum = _mm_cvtsi128_si32(s4);
    } else {
      for (; i < p.b; ++i) {
        const float v = std::nearbyint(xb[i] * inv);
        const int8_t c = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
        q[blk * p.b + i] = c;
        sum += c;
      }
    }
    p.xqs[r * p.nb + blk] = sum;
  }
  const int64_t ng = p.k / p.g, bpg = p.g / p.b;
  for (int64_t grp = 0; grp < ng; ++grp) {  // sum of the quantized x: the min term then cancels exactly
    float s = 0.f;
    for (int64_t blk = grp * bpg; blk < (grp + 1) * bpg; ++blk)
      s += p.xd[r * p.nb + blk] * static_cast<float>(p.xqs[r * p.nb + blk]);
    p.xs[r * ng + grp] = s;
  }
  int32_t* w = p.xw + r * p.nsteps;
  auto word = [](int8_t a, int8_t b, int8_t c, int8_t d) {
    return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint8_t>(a)) |
                                (static_cast<uint32_t>(static_cast<uint8_t>(b)) << 8) |
                                (static_cast<uint32_t>(static_cast<uint8_t>(c)) << 16) |
                                (static_cast<uint32_t>(static_cast<uint8_t>(d)) << 24));
  };
  for (int64_t blk = 0; blk < p.nb; ++blk) {
    const int8_t* qb = q + blk * p.b;
    if (p.kind == kInt8 && p.b % 4 == 0) {  // step t holds inputs 4t .. 4t + 3: the bytes as they are
      std::memcpy(w + blk * p.steps, qb, static_cast<size_t>(p.b));
      continue;
    }
    if (p.kind != kInt8 && p.g == 32) {  // step t: inputs 2t, 2t + 16, 2t + 1, 2t + 17, the bytes of the two
      const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb));  // halves interleaved
      const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(w + blk * p.steps), _mm_unpacklo_epi8(lo, hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(w + blk * p.steps + 4), _mm_unpackhi_epi8(lo, hi));
      continue;
    }
    for (int64_t t = 0; t < p.steps; ++t) {
      if (p.kind == kInt8) {
        auto at = [&](int64_t i) -> int8_t { return i < p.b ? qb[i] : 0; };
        w[blk * p.steps + t] = word(at(4 * t), at(4 * t + 1), at(4 * t + 2), at(4 * t + 3));
      } else {
        const int64_t half = p.g / 2, j = 2 * t;
        const bool second = j + 1 < half;
        w[blk * p.steps + t] = word(qb[j], qb[j + half], second ? qb[j + 1] : 0, second ? qb[j + 1 + half] : 0);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------ scalar columns
void scalar_columns(const Problem& p, int64_t o_begin, int64_t o_end) {
  const int64_t ng = p.k / p.g;
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
          gacc += p.xd[r * p.nb + blk] * static_cast<float>(dot);
        }
        float d = p.scales.at(grp, o);
        float m = p.kind == kQ4_1 ? p.mins.at(grp, o) : (p.kind == kQ4_0 ? -8.f * d : 0.f);
        acc += d * gacc + m * p.xs[r * ng + grp];
      }
      p.y[r * p.o + o] = acc;
    }
  }
}

// ----------------------------------------------------------------------------------- the column kernel, per ISA
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define JPG_VNNI 0
#define JPG_ZMM 0
#define JPG_ROWS 2
#define JPG_DIRECT_ROWS 2
#include "quant_matmul_body.inc"
#undef JPG_ZMM
#undef JPG_VNNI
#undef JPG_ROWS
#undef JPG_DIRECT_ROWS
}  // namespace avx2
#pragma GCC pop_options

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define JPG_HAVE_AVXVNNI 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace avxvnni {
#define JPG_VNNI 1
#define JPG_ZMM 0
#define JPG_ROWS 2
#define JPG_DIRECT_ROWS 2
#define JPG_DPBUSD(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#include "quant_matmul_body.inc"
#undef JPG_ZMM
#undef JPG_VNNI
#undef JPG_ROWS
#undef JPG_DIRECT_ROWS
#undef JPG_DPBUSD
}  // namespace avxvnni
#pragma GCC pop_options
#else
#define JPG_HAVE_AVXVNNI 0
#endif

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
namespace avx512 {  // 256-bit registers (32 of them): the 32-column tile left over by avx512z's tiles of 64
#define JPG_VNNI 1
#define JPG_ZMM 0
#define JPG_ROWS 4
#define JPG_DIRECT_ROWS 5
#define JPG_DPBUSD(acc, w, x) _mm256_dpbusd_epi32(acc, w, x)
#include "quant_matmul_body.inc"
#undef JPG_VNNI
#undef JPG_ZMM
#undef JPG_ROWS
#undef JPG_DIRECT_ROWS
#undef JPG_DPBUSD
}  // namespace avx512
namespace avx512z {  // 512-bit registers, tiles of 64 columns
#define JPG_VNNI 1
#define JPG_ZMM 1
#define JPG_ROWS 4
#define JPG_DIRECT_ROWS 5
#define JPG_DPBUSD(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#include "quant_matmul_body.inc"
#undef JPG_VNNI
#undef JPG_ZMM
#undef JPG_ROWS
#undef JPG_DIRECT_ROWS
#undef JPG_DPBUSD
}  // namespace avx512z
#pragma GCC pop_options

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define JPG_HAVE_AMX 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")
namespace avx512amx {  // avx512z's passes, and AMX tiles from JPG_AMX_MIN_ROWS rows of x on (quant_matmul_body.inc)
#define JPG_VNNI 1
#define JPG_ZMM 1
#define JPG_AMX 1
#define JPG_AMX_MIN_ROWS 6
#define JPG_ROWS 4
#define JPG_DIRECT_ROWS 5
#define JPG_DPBUSD(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#define JPG_ADD32(a, b) _mm512_add_epi32(a, b)
#include "quant_matmul_body.inc"
#undef JPG_VNNI
#undef JPG_ZMM
#undef JPG_AMX
#undef JPG_AMX_MIN_ROWS
#undef JPG_ROWS
#undef JPG_DIRECT_ROWS
#undef JPG_DPBUSD
#undef JPG_ADD32
}  // namespace avx512amx
#pragma GCC pop_options
#else
#define JPG_HAVE_AMX 0
#endif

// AMX needs the CPU's tile and int8 units, the OS saving tile state (XCR0 bits 17-18), and the process's
// permission to use it (Linux: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once; process-wide).
bool amx_usable() {
#if JPG_HAVE_AMX && defined(__linux__)
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE: xgetbv is there
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

bool isa_supported(int32_t isa) {
  __builtin_cpu_init();
  const bool base = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  switch (isa) {
    case kAvx2:
      return base;
    case kAvxVnni:
#if JPG_HAVE_AVXVNNI  // older compilers do not know the feature name
      return base && __builtin_cpu_supports("avxvnni");
#else
      return false;
#endif
    case kAvx512Vnni:
      return base && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    case kAvx512Amx:
      return isa_supported(kAvx512Vnni) && amx_usable();
    default:
      return false;
  }
}

int32_t best_isa() {
  for (int32_t isa : {kAvx512Amx, kAvx512Vnni, kAvxVnni, kAvx2})
    if (isa_supported(isa)) return isa;
  return kAuto;  // none: jpg_cpu_supported() says so before any call
}

using ColumnsFn = void (*)(const Problem&, int64_t, int64_t);

struct IsaImpl {
  int64_t tile;        // columns per tile of `columns`
  ColumnsFn columns;   // tiles [begin, end) for every row
  ColumnsFn columns32; // a leftover tile of 32 columns (tiles of 64 only), or null
};

IsaImpl impl_for(int32_t isa) {
  switch (isa) {
    case kAvx512Vnni:
      return {64, avx512z::columns, avx512::columns};
#if JPG_HAVE_AMX
    case kAvx512Amx:
      return {64, avx512amx::columns_amx, avx512::columns};
#endif
#if JPG_HAVE_AVXVNNI
    case kAvxVnni:
      return {32, avxvnni::columns, nullptr};
#endif
    default:
      return {32, avx2::columns, nullptr};
  }
}

// --------------------------------------------------------------------------------------------------- the handler
// `values`, `scales` and `mins` are one matrix ([rows, O]) or a stack of them ([L, rows, O], e.g. a model's layers):
// then `layer` (an int32 scalar operand) picks the matrix, read in place. Inside a `lax.scan` over layers this is
// what keeps XLA from copying each layer's slice into a fresh buffer for the call (a copy of every weight byte,
// which cost as much as the matmul itself).
ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values, ffi::AnyBuffer scales, ffi::AnyBuffer mins,
                           ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int32_t kind,
                           int64_t group_size, int64_t block, int64_t threads, int32_t isa, int32_t stream) {
  auto xd = x.dimensions();
  auto sd = scales.dimensions();
  const size_t rank = sd.size();
  if (xd.size() != 2 || (rank != 2 && rank != 3) || values.dimensions().size() != rank)
    return ffi::Error::InvalidArgument("quant_matmul: x must be 2-D, values and scales 2-D or 3-D (stacked)");
  const int64_t stack = rank == 3 ? sd[0] : 1;
  const int64_t li = rank == 3 ? static_cast<int64_t>(layer.typed_data()[0]) : 0;
  if (li < 0 || li >= stack) return ffi::Error::InvalidArgument("quant_matmul: layer index out of range");
  if (isa == kAuto) isa = best_isa();
  if (!isa_supported(isa)) return ffi::Error::InvalidArgument("quant_matmul: this CPU cannot run the requested isa");
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
  const int64_t rows_stored = kind == kInt8 ? p.k : p.k / 2;
  auto vd = values.dimensions();
  auto yd = y->dimensions();
  if (vd[rank - 2] != rows_stored || vd[rank - 1] != p.o || (rank == 3 && vd[0] != stack) || yd.size() != 2 ||
      yd[0] != p.n || yd[1] != p.o)
    return ffi::Error::InvalidArgument("quant_matmul: values, scales and y do not fit x's shape");
  if (kind == kQ4_1) {
    auto md = mins.dimensions();
    if (md.size() != rank || md[rank - 2] != p.k / p.g || md[rank - 1] != p.o || (rank == 3 && md[0] != stack))
      return ffi::Error::InvalidArgument("quant_matmul: q4_1 mins must have the scales' shape");
  }
  if (p.k == 0 || p.n == 0) {  // an empty product: zeros (and nothing to divide by below)
    std::fill(y->typed_data(), y->typed_data() + p.n * p.o, 0.f);
    return ffi::Error::Success();
  }
  p.nb = p.k / p.b;
  p.steps = (p.b + 3) / 4;
  p.nsteps = p.nb * p.steps;
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
  p.stream = stream != 0;
  // The quantized activations, in scratch memory kept per calling thread and grown as needed (the call's pool
  // threads write into the caller's): `quantize_row` writes every element before anything reads it, so nothing is
  // cleared, and a call allocates nothing once the largest x has been seen.
  static thread_local std::vector<Reg> scratch;
  int64_t regs[5] = {p.n * p.k, p.n * p.nsteps * 4, p.n * p.nb * 4, p.n * p.nb * 4, p.n * (p.k / p.g) * 4};
  int64_t total = 0;
  for (int64_t& r : regs) {
    r = (r + sizeof(Reg) - 1) / sizeof(Reg);  // bytes -> whole (aligned) Regs
    total += r;
  }
  if (static_cast<int64_t>(scratch.size()) < total) scratch.resize(total);
  Reg* parts[5];
  Reg* at = scratch.data();
  for (int i = 0; i < 5; ++i) {
    parts[i] = at;
    at += regs[i];
  }
  p.xq = reinterpret_cast<int8_t*>(parts[0]);
  p.xw = reinterpret_cast<int32_t*>(parts[1]);
  p.xd = reinterpret_cast<float*>(parts[2]);
  p.xqs = reinterpret_cast<int32_t*>(parts[3]);
  p.xs = reinterpret_cast<float*>(parts[4]);
  p.y = y->typed_data();
  const float* xdata = x.typed_data();
  const IsaImpl impl = impl_for(isa);
  const int64_t tiles = p.o / impl.tile;
  // Threads: the `threads` attribute, at most the pool's workers plus the calling thread.
  const int64_t workers = std::max<int64_t>(1, pool.num_threads() + 1);
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min({threads, workers, std::max(tiles, p.n)})));
  if (p.n * p.k <= (int64_t{1} << 16) || nt == 1) {  // decode-sized x: not worth a fork
    for (int64_t r = 0; r < p.n; ++r) quantize_row(p, xdata, r);
  } else {
    fork_join(pool, nt, [&](int c, int count) {
      for (int64_t r = p.n * c / count; r < p.n * (c + 1) / count; ++r) quantize_row(p, xdata, r);
    });
  }
  if (tiles > 0) {
    const int ct = static_cast<int>(std::min<int64_t>(nt, tiles));
    fork_join(pool, ct, [&](int c, int count) {  // an equal run of tiles each
      const int64_t begin = tiles * c / count, end = tiles * (c + 1) / count;
      if (begin < end) impl.columns(p, begin, end);
    });
  }
  int64_t done = tiles * impl.tile;
  if (impl.columns32 && p.o - done >= 32) {  // the 32-column tile after the last whole tile of 64
    impl.columns32(p, done / 32, done / 32 + 1);
    done += 32;
  }
  if (done < p.o) scalar_columns(p, done, p.o);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpgQuantMatmul, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA:CPU's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [N, K]
                                  .Arg<ffi::AnyBuffer>()         // values
                                  .Arg<ffi::AnyBuffer>()         // scales [K/G, O]
                                  .Arg<ffi::AnyBuffer>()         // mins [K/G, O] (q4_1) or anything
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer: which matrix of a stack
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [N, O]
                                  .Attr<int32_t>("kind")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("threads")
                                  .Attr<int32_t>("isa")      // 0: the best this CPU has, else an Isa
                                  .Attr<int32_t>("stream"));  // 1: prefetch the weights with the NTA hint, 0: T0

extern "C" int jpg_cpu_supported() { return isa_supported(kAvx2); }

extern "C" int jpg_isa_supported(int isa) { return isa_supported(isa); }
