// Edge0's CPU attention: softmax(q k^T * scale [+ causal mask]) v in float32, for prompts.
//
// Why: MLX 0.32's fused attention on the CPU backend runs its products at a few GFLOP/s
// here, so at a few hundred prompt tokens attention costs more than the whole MoE block.
// Each query row is one thread's loop: its scores against the keys it sees (an AVX2 dot
// product a key), their softmax (a vectorised exp), then the weighted sum of the values, in a
// fixed order; rows are dealt to the pool's threads in turn (balanced under the causal
// triangle), so the result does not depend on the thread count. Grouped-query attention:
// query head h reads key/value head h / (Hq / Hkv). Causal: query i of L sees keys
// j <= S - L + i (the queries are the last L of S positions, as after a cache's offset).
// A boolean mask (a batch's left padding, a window) leaves keys out of a row: the keys it
// keeps are scored, exponentiated and summed in the same order as a row with no mask over
// those keys alone, so a sequence padded in a batch computes what it computes alone.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "qmm.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define EDGE0_X86 1
#endif

namespace edge0 {
namespace {

float dot_portable(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy_portable(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void exp_portable(float* x, int64_t n, float shift) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - shift);
}

#ifdef EDGE0_X86
__attribute__((target("avx2,fma"))) float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// n a multiple of 8
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  if (i < n) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  return hsum8(_mm256_add_ps(s0, s1));
}

__attribute__((target("avx2,fma"))) void axpy_avx2(float alpha, const float* x, float* y, int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
}

// exp(x) for x <= 0 (scores less their maximum): 2^k * p(r), x = k ln2 + r, |r| <= ln2 / 2,
// p of degree 6 (relative error about 2e-7); below -87 the result is 0.
__attribute__((target("avx2,fma"))) __m256 exp_avx2(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

__attribute__((target("avx2,fma"))) void exp_shifted_avx2(float* x, int64_t n, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
  if (i < n) {  // the tail through a zero-padded block (the same polynomial as the rest)
    alignas(32) float t[8] = {0};
    std::memcpy(t, x + i, size_t(n - i) * 4);
    const __m256 y = exp_avx2(_mm256_sub_ps(_mm256_load_ps(t), s));
    _mm256_store_ps(t, y);
    std::memcpy(x + i, t, size_t(n - i) * 4);
  }
}
#endif

}  // namespace

void attention(const AttnArgs& a) {
  const int64_t rows = a.B * a.Hq * a.L, D = a.D, group = a.Hq / a.Hkv;
#ifdef EDGE0_X86
  const bool vec = use_avx2() && D % 8 == 0;
#else
  const bool vec = false;
#endif
  auto part = [&](int p, int parts) {
    std::vector<float> scores(size_t(std::max<int64_t>(a.S, 1)));
    std::vector<int64_t> seen(a.mask != nullptr ? size_t(std::max<int64_t>(a.S, 1)) : 0);
    for (int64_t r = p; r < rows; r += parts) {
      const int64_t i = r % a.L, bh = r / a.L, h = bh % a.Hq, b = bh / a.Hq;
      const float* q = a.q + r * D;
      const float* k = a.k + b * a.k_b + (h / group) * a.k_h;
      const float* v = a.v + b * a.v_b + (h / group) * a.v_h;
      float* out = a.out + r * D;
      const int64_t keys = a.causal ? std::clamp<int64_t>(a.S - a.L + i + 1, 1, a.S) : a.S;
      // the keys this row sees, in order: with a mask, the masked ones are left out (not
      // scored as -inf), so a row's arithmetic is the same whatever padding sits beside it
      const uint8_t* m = a.mask != nullptr ? a.mask + b * a.mask_b + h * a.mask_h + i * a.mask_l : nullptr;
      int64_t n = 0;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < keys; ++j) {
        if (m != nullptr && !m[j]) continue;
#ifdef EDGE0_X86
        const float s = (vec ? dot_avx2(q, k + j * D, D) : dot_portable(q, k + j * D, D)) * a.scale;
#else
        const float s = dot_portable(q, k + j * D, D) * a.scale;
#endif
        if (m != nullptr) seen[size_t(n)] = j;
        scores[size_t(n++)] = s;
        top = std::max(top, s);
      }
      std::memset(out, 0, size_t(D) * 4);
      if (n == 0) continue;  // a row that sees no key (a padding position): zeros
#ifdef EDGE0_X86
      if (vec) exp_shifted_avx2(scores.data(), n, top); else exp_portable(scores.data(), n, top);
#else
      exp_portable(scores.data(), n, top);
#endif
      float total = 0.0f;
      for (int64_t j = 0; j < n; ++j) total += scores[size_t(j)];
      for (int64_t j = 0; j < n; ++j) {
        const float* vj = v + (m != nullptr ? seen[size_t(j)] : j) * D;
#ifdef EDGE0_X86
        if (vec) axpy_avx2(scores[size_t(j)], vj, out, D); else axpy_portable(scores[size_t(j)], vj, out, D);
#else
        axpy_portable(scores[size_t(j)], vj, out, D);
#endif
      }
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < D; ++d) out[d] *= inv;
    }
  };
  parallel_rows(rows, part);
}

}  // namespace edge0
