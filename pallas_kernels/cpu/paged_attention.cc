// Ragged paged attention for the CPU, called from JAX through the XLA FFI (jax.ffi): the contract of
// `pallas_kernels.paged_attention` (the reference `ragged_paged_attention_reference` is the spec).
//
// Row r owns the query tokens [query_start[r], query_start[r] + query_lens[r]) at positions
// kv_lens[r] - query_lens[r] + j; each attends to the keys at positions <= its own (and, with a sliding window w,
// > its own - w) of the row's pages page_table[r, :], read in place from the engine's stacked cache
// [L, KH, N, page_size, D] at `layer` (float32, bfloat16, float16, or int8 with per-token float32 scales: the
// scores are multiplied by the key's scale, the softmax weights by the value's, as the reference does). Keys stop at
// the end of the page table (P * page_size) even where kv_lens runs past it, as in the reference. Tokens of no row are
// zero, or, with `has_base`, what `base` holds there (the output aliases it: where `native_attention.MAX_QUERY_LEN` is
// set, the Python side passes the XLA path's output of the long prefill windows and the decode rows' tokens are
// written over it, with no second pass).
//
// What XLA:CPU does instead is gather every row's pages into one contiguous block per layer and call (a transposing
// copy of K and V per layer and step, ~27 us each at one row of 256 keys: more than the arithmetic) before two
// small batched contractions. Here a task is (row, KV head, block of query tokens): the G query heads of the KV
// head and the block's tokens (M = tokens * G query vectors) walk the visible pages once, each page's keys and
// values converted to float32 once for all M, with an online softmax (running max and sum per query vector, as
// flash attention) so nothing of size [M, context] is stored. The exp is a polynomial (Cephes' expf: range
// reduction to [-ln2/2, ln2/2] and a degree-6 polynomial, ~1 ulp) in 8 AVX2 lanes. Tasks are claimed from a
// counter by the calling thread and XLA's intra-op threads (`fork_join`).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "fork_join.h"
#include "vec_exp.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jpg::exp_ps;

constexpr int kQueryBlock = 16;  // query tokens per task (a decode row has 1, a verification row W)

enum Cache : int { kF32 = 0, kBF16 = 1, kS8 = 2, kF16 = 3 };

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// acc[0:8 NV] = alpha * acc + sum_j w_j v_j (w_j = s[j], times vsc[j] when given; rows of v D = 8 NV apart), the
// accumulator held in NV registers across the keys (the general loop reloads and stores it per key).
template <int NV>
inline void accumulate_pv(float* acc, float alpha, const float* s, const float* vsc, const float* v, int64_t n) {
  __m256 c[NV];
  const __m256 va = _mm256_set1_ps(alpha);
  for (int i = 0; i < NV; ++i) c[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * i), va);
  for (int64_t j = 0; j < n; ++j) {
    if (s[j] == 0.0f) continue;
    const __m256 w = _mm256_set1_ps(vsc ? s[j] * vsc[j] : s[j]);
    const float* vv = v + j * 8 * NV;
    for (int i = 0; i < NV; ++i) c[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vv + 8 * i), c[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + 8 * i, c[i]);
}

struct Problem {
  const float* q;  // [T, nH, D]
  const void* k;   // [L, KH, N, ps, D]
  const void* v;
  const float* ks;  // [L, KH, N, ps] (int8 cache) or null
  const float* vs;
  const int32_t* query_start;
  const int32_t* query_lens;
  const int32_t* kv_lens;
  const int32_t* page_table;  // [S, P]
  float* o;                   // [T, nH, D]
  int64_t t_count, nh, d, kh, g, num_pages, ps, p, layer;
  int cache;
  float sm_scale, soft_cap;
  int64_t window;  // 0: none
};

// The first n keys/values of page `page` of KV head `h` (layer `p.layer`) as float32 rows [n, D]: a float32 cache in
// place, the others converted into `out`.
const float* load_rows(const Problem& p, const void* base, int64_t h, int64_t page, int64_t n, float* out) {
  const int64_t offset = ((p.layer * p.kh + h) * p.num_pages + page) * p.ps * p.d;
  const int64_t count = n * p.d;
  if (p.cache == kF32) {
    return static_cast<const float*>(base) + offset;
  } else if (p.cache == kBF16) {
    const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
    for (int64_t i = 0; i < count; ++i) {
      uint32_t bits = uint32_t(src[i]) << 16;
      std::memcpy(out + i, &bits, sizeof(float));
    }
  } else if (p.cache == kF16) {  // count is a multiple of 8 (D is)
    const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
    for (int64_t i = 0; i < count; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  } else {
    const int8_t* src = static_cast<const int8_t*>(base) + offset;
    for (int64_t i = 0; i < count; ++i) out[i] = float(src[i]);
  }
  return out;
}

// One task: row r, KV head h, query vectors [v0, v1) of the row's vectors of that head (vector j * G + i: query token j,
// the head's i-th query head).
void attend(const Problem& p, int64_t r, int64_t h, int64_t v0, int64_t v1, std::vector<float>& scratch) {
  const int64_t qlen = p.query_lens[r];
  const int64_t kvl = p.kv_lens[r];  // the queries' positions come from it; keys stop at the page table's end too
  const int64_t d = p.d, g = p.g, m_count = v1 - v0, ps = p.ps;
  const int64_t first_pos = kvl - qlen + v0 / g, last_pos = kvl - qlen + (v1 - 1) / g;
  const int64_t hi = std::min(last_pos, p.p * p.ps - 1);  // the last key any of the block's queries sees
  if (hi < 0) return;  // nothing visible (more queries than context, or no pages): the output stays 0
  // scratch: Q [M, D] | K [ps, D] | V [ps, D] | scores [M, ps8] | acc [M, D] | mx [M] | l [M]
  const int64_t ps8 = (ps + 7) / 8 * 8;
  scratch.resize(m_count * d + 2 * ps * d + m_count * ps8 + m_count * d + 2 * m_count + 8);
  float* qb = scratch.data();
  float* kb = qb + m_count * d;
  float* vb = kb + ps * d;
  float* sb = vb + ps * d;
  float* acc = sb + m_count * ps8;
  float* mx = acc + m_count * d;
  float* lsum = mx + m_count;
  for (int64_t m = 0; m < m_count; ++m) {
    const int64_t t = p.query_start[r] + (v0 + m) / g;
    std::memcpy(qb + m * d, p.q + (t * p.nh + h * g + (v0 + m) % g) * d, d * sizeof(float));
  }
  std::fill(acc, acc + m_count * d, 0.0f);
  std::fill(mx, mx + m_count, -std::numeric_limits<float>::infinity());
  std::fill(lsum, lsum + m_count, 0.0f);
  const int64_t lo = p.window ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
  if (lo > hi) return;
  const int32_t* table = p.page_table + r * p.p;
  const float* kscale_base = p.ks ? p.ks + (p.layer * p.kh + h) * p.num_pages * ps : nullptr;
  const float* vscale_base = p.vs ? p.vs + (p.layer * p.kh + h) * p.num_pages * ps : nullptr;
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t pi = lo / ps; pi <= hi / ps; ++pi) {
    const int64_t page = std::clamp<int64_t>(table[pi], 0, p.num_pages - 1);
    // keys [k0, k1): from the page's start even where the window starts later (masked below), so that a key's lane
    // and group below depend on its place in the page only, never on the block: a query's result is the same whichever
    // block (decode row, verification row, prefill chunk) it is computed in
    const int64_t k0 = pi * ps, k1 = std::min(hi + 1, (pi + 1) * ps);
    const int64_t n = k1 - k0;
    const float* kr = load_rows(p, p.k, h, page, n, kb);
    const float* vr = load_rows(p, p.v, h, page, n, vb);
    const float* ksc = kscale_base ? kscale_base + page * ps : nullptr;
    const float* vsc = vscale_base ? vscale_base + page * ps : nullptr;
    for (int64_t m = 0; m < m_count; ++m) {
      const int64_t pos = kvl - qlen + (v0 + m) / g;
      const float* qv = qb + m * d;
      float* s = sb + m * ps8;
      for (int64_t j = 0; j < n; j += 4) {  // q . k of 4 keys at once, their sums reduced together; a last group of
        // fewer repeats its last key (every key gets the same reduction order, whatever n is)
        const float* k_0 = kr + j * d;
        const float* k_1 = kr + std::min(j + 1, n - 1) * d;
        const float* k_2 = kr + std::min(j + 2, n - 1) * d;
        const float* k_3 = kr + std::min(j + 3, n - 1) * d;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t e = 0; e < d; e += 8) {
          const __m256 x = _mm256_loadu_ps(qv + e);
          a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k_0 + e), a0);
          a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k_1 + e), a1);
          a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k_2 + e), a2);
          a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k_3 + e), a3);
        }
        const __m256 h4 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        float four[4];
        _mm_storeu_ps(four, _mm_add_ps(_mm256_castps256_ps128(h4), _mm256_extractf128_ps(h4, 1)));
        for (int64_t i = 0; i < 4 && j + i < n; ++i) s[j + i] = four[i];
      }
      float page_max = -std::numeric_limits<float>::infinity();
      if (!ksc && p.soft_cap <= 0) {  // scale and visibility in 8 lanes (the same product per key as below)
        const __m256 vscale = _mm256_set1_ps(p.sm_scale);
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        // key position kp is visible where first <= kp <= pos, and its slot j < n
        const __m256i after = _mm256_set1_epi32(int32_t(pos) + 1);
        const __m256i before = _mm256_set1_epi32(int32_t(std::max<int64_t>(
            p.window ? pos - p.window : std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::min())));
        const __m256i slots = _mm256_set1_epi32(int32_t(n));
        __m256 vmax = neg_inf;
        for (int64_t j = 0; j < ps8; j += 8) {
          const __m256i jj = _mm256_add_epi32(_mm256_set1_epi32(int32_t(j)), lane);
          const __m256i kp = _mm256_add_epi32(_mm256_set1_epi32(int32_t(k0)), jj);
          const __m256i ok = _mm256_and_si256(_mm256_and_si256(_mm256_cmpgt_epi32(after, kp), _mm256_cmpgt_epi32(kp, before)),
                                              _mm256_cmpgt_epi32(slots, jj));
          const __m256 x = _mm256_blendv_ps(neg_inf, _mm256_mul_ps(_mm256_loadu_ps(s + j), vscale), _mm256_castsi256_ps(ok));
          _mm256_storeu_ps(s + j, x);
          vmax = _mm256_max_ps(vmax, x);
        }
        page_max = hmax(vmax);
      } else {
        for (int64_t j = 0; j < n; ++j) {  // scale, key scale, soft cap, visibility
          float x = s[j] * p.sm_scale;
          if (ksc) x *= ksc[j];
          if (p.soft_cap > 0) x = p.soft_cap * std::tanh(x / p.soft_cap);
          const int64_t kp = k0 + j;
          const bool visible = kp <= pos && (p.window == 0 || pos - kp < p.window);
          s[j] = visible ? x : -std::numeric_limits<float>::infinity();
        }
        for (int64_t j = n; j < ps8; ++j) s[j] = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) page_max = std::max(page_max, s[j]);
      }
      if (page_max == -std::numeric_limits<float>::infinity()) continue;  // nothing visible to m on this page
      const float new_max = std::max(mx[m], page_max);
      const float alpha = mx[m] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(mx[m] - new_max);
      mx[m] = new_max;
      const __m256 vmax = _mm256_set1_ps(new_max);
      __m256 total = _mm256_setzero_ps();
      for (int64_t j = 0; j < ps8; j += 8) {  // weights; invisible keys (-inf) -> 0
        __m256 x = _mm256_loadu_ps(s + j);
        __m256 w = _mm256_blendv_ps(exp_ps(_mm256_sub_ps(x, vmax)), _mm256_setzero_ps(),
                                    _mm256_cmp_ps(x, neg_inf, _CMP_EQ_OQ));
        _mm256_storeu_ps(s + j, w);
        total = _mm256_add_ps(total, w);
      }
      lsum[m] = lsum[m] * alpha + hsum(total);
      float* am = acc + m * d;
      if (d == 64) {
        accumulate_pv<8>(am, alpha, s, vsc, vr, n);
      } else if (d == 128) {
        accumulate_pv<16>(am, alpha, s, vsc, vr, n);
      } else {
        const __m256 va = _mm256_set1_ps(alpha);
        for (int64_t e = 0; e < d; e += 8) _mm256_storeu_ps(am + e, _mm256_mul_ps(_mm256_loadu_ps(am + e), va));
        for (int64_t j = 0; j < n; ++j) {
          if (s[j] == 0.0f) continue;
          const __m256 w = _mm256_set1_ps(vsc ? s[j] * vsc[j] : s[j]);
          const float* vv = vr + j * d;
          for (int64_t e = 0; e < d; e += 8)
            _mm256_storeu_ps(am + e, _mm256_fmadd_ps(w, _mm256_loadu_ps(vv + e), _mm256_loadu_ps(am + e)));
        }
      }
    }
  }
  for (int64_t m = 0; m < m_count; ++m) {
    const int64_t t = p.query_start[r] + (v0 + m) / g;
    float* out = p.o + (t * p.nh + h * g + (v0 + m) % g) * d;
    const __m256 inv = _mm256_set1_ps(1.0f / std::max(lsum[m], 1e-30f));
    for (int64_t e = 0; e < d; e += 8) _mm256_storeu_ps(out + e, _mm256_mul_ps(_mm256_loadu_ps(acc + m * d + e), inv));
  }
}

#pragma GCC pop_options

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> query_start,
                              ffi::Buffer<ffi::S32> query_lens, ffi::Buffer<ffi::S32> kv_lens,
                              ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::F32> base,
                              ffi::ResultBuffer<ffi::F32> o, float sm_scale, int64_t window, float soft_cap,
                              int64_t threads, int32_t scaled, int32_t has_base) {
  auto qd = q.dimensions(), kd = k.dimensions(), pd = page_table.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || v.dimensions().size() != 5 || pd.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: q must be [T, nH, D], k and v [L, KH, N, ps, D], "
                                       "page_table [S, P]");
  Problem p{};
  p.t_count = qd[0];
  p.nh = qd[1];
  p.d = qd[2];
  p.kh = kd[1];
  p.num_pages = kd[2];
  p.ps = kd[3];
  p.p = pd[1];
  const int64_t s_count = pd[0];
  if (kd[4] != p.d || p.d % 8 || p.kh == 0 || p.nh % p.kh || p.num_pages == 0)
    return ffi::Error::InvalidArgument("paged_attention: head_dim must match and be a multiple of 8, the query "
                                       "heads a multiple of the KV heads");
  for (int i = 0; i < 5; ++i)
    if (v.dimensions()[i] != kd[i]) return ffi::Error::InvalidArgument("paged_attention: k and v differ in shape");
  if (int64_t(query_start.element_count()) != s_count || int64_t(query_lens.element_count()) != s_count ||
      int64_t(kv_lens.element_count()) != s_count)
    return ffi::Error::InvalidArgument("paged_attention: query_start, query_lens, kv_lens must have one entry per "
                                       "page_table row");
  p.g = p.nh / p.kh;
  p.layer = layer.typed_data()[0];
  if (p.layer < 0 || p.layer >= kd[0]) return ffi::Error::InvalidArgument("paged_attention: layer out of range");
  const auto kt = k.element_type();
  if (kt != v.element_type()) return ffi::Error::InvalidArgument("paged_attention: k and v dtypes differ");
  if (kt == ffi::DataType::F32) {
    p.cache = kF32;
  } else if (kt == ffi::DataType::BF16) {
    p.cache = kBF16;
  } else if (kt == ffi::DataType::S8) {
    p.cache = kS8;
  } else if (kt == ffi::DataType::F16) {
    p.cache = kF16;
  } else {
    return ffi::Error::InvalidArgument("paged_attention: the cache must be float32, bfloat16, float16 or int8");
  }
  if (scaled) {
    if (int64_t(k_scales.element_count()) != kd[0] * kd[1] * kd[2] * kd[3] ||
        v_scales.element_count() != k_scales.element_count())
      return ffi::Error::InvalidArgument("paged_attention: scales must be [L, KH, N, page_size]");
    p.ks = k_scales.typed_data();
    p.vs = v_scales.typed_data();
  }
  p.q = q.typed_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.query_start = query_start.typed_data();
  p.query_lens = query_lens.typed_data();
  p.kv_lens = kv_lens.typed_data();
  p.page_table = page_table.typed_data();
  p.o = o->typed_data();
  p.sm_scale = sm_scale;
  p.soft_cap = soft_cap;
  p.window = window;
  const int64_t out_count = p.t_count * p.nh * p.d;
  if (!has_base) {
    std::memset(p.o, 0, out_count * sizeof(float));
  } else if (int64_t(base.element_count()) != out_count) {
    return ffi::Error::InvalidArgument("paged_attention: base must have q's shape");
  } else if (base.typed_data() != p.o) {  // aliased by XLA, it is already there
    std::memcpy(p.o, base.typed_data(), out_count * sizeof(float));
  }
  struct Task {
    int32_t r, h, v0, v1;
  };
  // A task takes up to kQueryBlock tokens' query vectors of one row and KV head. With few of them (a decode row: one
  // per KV head; SmolLM2's 3 on 2 threads leave one thread twice the work) a float32 cache's tasks are cut finer, to
  // about 4 per thread: each reads its pages in place, so the split costs only the walk over them (a converted cache
  // would convert each page once per task). A query's result is the same whichever task computes it.
  std::vector<std::pair<int64_t, int64_t>> rows;  // (row, its query vectors per KV head)
  int64_t vectors = 0;
  for (int64_t r = 0; r < s_count; ++r) {
    const int64_t start = p.query_start[r];
    const int64_t len = std::min<int64_t>(p.query_lens[r], p.t_count - start);  // never past the tokens
    if (len <= 0 || start < 0 || p.kv_lens[r] <= 0) continue;
    rows.push_back({r, len * p.g});
    vectors += len * p.g * p.kh;
  }
  int64_t per_task = kQueryBlock * p.g;
  if (p.cache == kF32 && threads > 1)
    per_task = std::clamp<int64_t>((vectors + 4 * threads - 1) / (4 * threads), 1, per_task);
  std::vector<Task> tasks;
  for (const auto& [r, n] : rows)
    for (int64_t h = 0; h < p.kh; ++h)
      for (int64_t v = 0; v < n; v += per_task)
        tasks.push_back({int32_t(r), int32_t(h), int32_t(v), int32_t(std::min<int64_t>(n, v + per_task))});
  const int n_tasks = int(tasks.size());
  std::atomic<int> next{0};
  const int chunks = int(std::min<int64_t>(std::max<int64_t>(threads, 1), n_tasks));
  jpg::fork_join(pool, chunks, [&](int, int) {
    std::vector<float> scratch;
    for (int i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n_tasks;)
      attend(p, tasks[i].r, tasks[i].h, tasks[i].v0, tasks[i].v1, scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpgPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA:CPU's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, nH, D]
                                  .Arg<ffi::AnyBuffer>()         // k pages [L, KH, N, ps, D]
                                  .Arg<ffi::AnyBuffer>()         // v pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k scales [L, KH, N, ps] (int8 cache) or [1]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table [S, P]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // base [T, nH, D] (has_base) or [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o [T, nH, D], aliased to base
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("window")      // 0: no sliding window
                                  .Attr<float>("soft_cap")      // 0: none
                                  .Attr<int64_t>("threads")
                                  .Attr<int32_t>("scaled")      // 1: int8 cache with scales
                                  .Attr<int32_t>("has_base"));  // 1: o starts as base (else zeros); the rows' tokens
                                                                // are written over it
