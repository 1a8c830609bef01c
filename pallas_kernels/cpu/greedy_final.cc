// The greedy sampler's normalisation on the CPU (`paged.sampling.greedy_final`'s native path), through jax.ffi:
// rows of logits x f32 [S, V] -> final = x - logsumexp(x) f32 [S, V], token = the first maximal x (the first NaN of
// a row that has one, as jnp.argmax) s32 [S], logprob = final[token] f32 [S].
//
// XLA:CPU runs `greedy_final` as separate passes over [S, V] (the max, a NaN check, exp-and-sum, the subtraction,
// the first index equal to the max), ~0.25 ms at 5 x 49152 (docs/kernels.md, "The native greedy normalisation").
// Here a row takes three passes in 8 lanes: the max with each lane's first index of it, the sum of exp(x - max)
// by the shared vectorised exp (vec_exp.h; added in double), the subtraction. A row with a NaN or a maximum that is
// not finite takes a scalar path with std::exp / std::log, which gives IEEE's answers there (a row of NaN, as
// XLA's). Rows are spread over XLA:CPU's intra-op threads (fork_join.h).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "fork_join.h"
#include "vec_exp.h"

namespace ffi = xla::ffi;

namespace {

// A row with a NaN or a maximum that is not finite (+inf, or a row of -inf): XLA's formulation in scalar IEEE
// arithmetic. max is NaN if any element is; the token the first NaN, else the first element equal to the max.
void row_scalar(const float* x, int64_t v, float* out, int32_t* token, float* logprob) {
  int64_t first_nan = -1;
  float m = -INFINITY;
  for (int64_t i = 0; i < v; ++i) {
    if (std::isnan(x[i])) {
      if (first_nan < 0) first_nan = i;
    } else if (x[i] > m) {
      m = x[i];
    }
  }
  int64_t t = first_nan;
  if (t < 0) {
    t = 0;
    while (t < v && !(x[t] == m)) ++t;
  } else {
    m = NAN;
  }
  float sum = 0.f;
  for (int64_t i = 0; i < v; ++i) sum += std::exp(x[i] - m);
  const float lse = m + std::log(sum);
  for (int64_t i = 0; i < v; ++i) out[i] = x[i] - lse;
  *token = static_cast<int32_t>(t);
  *logprob = out[t];
}

__attribute__((target("avx2,fma"))) void row(const float* x, int64_t v, float* out, int32_t* token,
                                              float* logprob) {
  const int64_t v8 = v & ~int64_t{7};
  if (v8 == 0) return row_scalar(x, v, out, token, logprob);
  // Pass 1: each lane's maximum and the first index where it occurs (updated on a strictly greater value), and
  // whether any lane saw a NaN.
  __m256 best = _mm256_loadu_ps(x);
  __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
  __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), where = at;
  const __m256i eight = _mm256_set1_epi32(8);
  for (int64_t i = 8; i < v8; i += 8) {
    const __m256 c = _mm256_loadu_ps(x + i);
    at = _mm256_add_epi32(at, eight);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(c, c, _CMP_UNORD_Q));
    const __m256 up = _mm256_cmp_ps(c, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, c, up);
    where = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(where), _mm256_castsi256_ps(at), up));
  }
  alignas(32) float lane_max[8];
  alignas(32) int32_t lane_at[8];
  _mm256_store_ps(lane_max, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at), where);
  float m = lane_max[0];
  for (int l = 1; l < 8; ++l) m = lane_max[l] > m ? lane_max[l] : m;
  int64_t t = v;
  for (int l = 0; l < 8; ++l)
    if (lane_max[l] == m && lane_at[l] < t) t = lane_at[l];  // the first occurrence: the lowest lane index
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t i = v8; i < v; ++i) {  // the tail, after every vector index
    any_nan |= std::isnan(x[i]);
    if (x[i] > m) {
      m = x[i];
      t = i;
    }
  }
  if (any_nan || !std::isfinite(m)) return row_scalar(x, v, out, token, logprob);
  // Pass 2: sum of exp(x - m), in double (8 lanes of float would each add up V / 8 terms: ~1e-6 off)
  const __m256 vm = _mm256_set1_ps(m);
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i < v8; i += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + i), vm);  // exp(d), 0 where d < -87.3 (under FLT_MIN)
    const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-87.3f), _CMP_LT_OQ), jpg::exp_ps(d));
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(s0, s1));
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (i = v8; i < v; ++i) sum += std::exp(static_cast<double>(x[i] - m));
  const float lse = m + static_cast<float>(std::log(sum));
  // Pass 3: final = x - lse.
  const __m256 vl = _mm256_set1_ps(lse);
  for (i = 0; i < v8; i += 8) _mm256_storeu_ps(out + i, _mm256_sub_ps(_mm256_loadu_ps(x + i), vl));
  for (i = v8; i < v; ++i) out[i] = x[i] - lse;
  *token = static_cast<int32_t>(t);
  *logprob = out[t];
}

ffi::Error GreedyFinalImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> final,
                           ffi::ResultBuffer<ffi::S32> token, ffi::ResultBuffer<ffi::F32> logprob, int64_t threads) {
  auto d = x.dimensions();
  if (d.size() != 2 || final->dimensions().size() != 2 || token->dimensions().size() != 1 ||
      logprob->dimensions().size() != 1 || final->dimensions()[0] != d[0] || final->dimensions()[1] != d[1] ||
      token->dimensions()[0] != d[0] || logprob->dimensions()[0] != d[0])
    return ffi::Error::InvalidArgument("greedy_final: x must be [S, V], final [S, V], token and logprob [S]");
  const int64_t s = d[0], v = d[1];
  if (v <= 0 || v > (int64_t{1} << 31) - 1)
    return ffi::Error::InvalidArgument("greedy_final: V must be in [1, 2^31)");
  const float* xd = x.typed_data();
  float* fd = final->typed_data();
  int32_t* td = token->typed_data();
  float* ld = logprob->typed_data();
  const int64_t workers = pool.num_threads() + 1;
  const int count = static_cast<int>(std::max<int64_t>(1, std::min({threads, workers, s})));
  jpg::fork_join(pool, count, [&](int c, int n) {
    for (int64_t r = s * c / n; r < s * (c + 1) / n; ++r) row(xd + r * v, v, fd + r * v, td + r, ld + r);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpgGreedyFinal, GreedyFinalImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA:CPU's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits x [S, V]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // final [S, V]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // token [S]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // logprob [S]
                                  .Attr<int64_t>("threads"));
