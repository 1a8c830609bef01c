// exp in 8 AVX2 lanes, shared by the native kernels that normalise (paged_attention.cc's online softmax,
// greedy_final.cc's log-softmax).
#pragma once

#include <immintrin.h>

namespace jpg {

// exp(x) in 8 lanes for x <= 0 (values minus their max): Cephes' expf (x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6
// polynomial for exp(r), times 2^n through the exponent bits), within ~1 ulp. Below -87.3 (where expf underflows)
// it returns exp(-87.3) ~ 1e-38, which callers mask or treat as the zero it is to float32 precision: n >= -126 keeps
// 2^n a normal float.
__attribute__((target("avx2,fma"))) inline __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts (Cody-Waite)
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

}  // namespace jpg
