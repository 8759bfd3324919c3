// Edge0's CPU kernels: the affine-quantized matmul (dense and gathered by expert index).
//
// Why these loops and not MLX's: on an x86-64 CPU, MLX 0.32's quantized matmul runs on one
// core at well under a tenth of the memory bandwidth. Here every weight word is loaded
// once per group of rows sharing an expert, decoded in registers (AVX2: broadcast, variable
// shift, mask, convert) and multiplied into float32 accumulators; the group's scale
// multiplies the group's partial sum, and its bias multiplies the sum of x over the group
// (computed once per row), so w = scale * q + bias is never materialised. From 8 rows against
// one expert's weights (prefill, large batches) the decoding would be repeated for every 4
// rows: there each weight row is decoded once into float32 (scale * q + bias) and the rows'
// products are register tiles of 4 rows by 3 weight rows, as a matmul is blocked (at 512
// tokens 1.9x the rows' loop here). A product's sum runs over k in the same order in every
// tile, so a row's result does not depend on the rows beside it.
//
// Threads split the output rows n, never the reduction over k: each output element is one
// thread's loop in a fixed order, so the result does not depend on the thread count.
#include "qmm.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define EDGE0_X86 1
#endif

namespace edge0 {
namespace {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while ((man & 0x400) == 0);
      u = sign | (uint32_t(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000 | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A 16-bit value at any address: a checkpoint mapped in place keeps the file's offsets,
// which safetensors does not align (plain loads on x86, never an aligned vector load).
inline uint16_t load_u16(const unsigned char* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// scales or biases [i0, i0 + n) as float32
void load_params(const void* p, ScaleType t, int64_t i0, int64_t n, float* dst) {
  switch (t) {
    case ScaleType::F32:
      std::memcpy(dst, static_cast<const unsigned char*>(p) + i0 * 4, n * sizeof(float));
      break;
    case ScaleType::BF16: {
      auto q = static_cast<const unsigned char*>(p) + i0 * 2;
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(load_u16(q + 2 * i));
      break;
    }
    case ScaleType::F16: {
      auto q = static_cast<const unsigned char*>(p) + i0 * 2;
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(load_u16(q + 2 * i));
      break;
    }
  }
}

// the group of position k0: group sizes are powers of two, so a shift (a division by a
// run-time value is an integer divide each block, as slow as the block's arithmetic)
inline int64_t group_of(int64_t k0, int gs) { return k0 >> __builtin_ctz(unsigned(gs)); }

// ---------------------------------------------------------------- portable loops
template <int BITS>
inline int quant_at(const uint32_t* wrow, int64_t k) {
  constexpr int per = 32 / BITS;
  uint32_t word;  // (any address: see load_u16)
  std::memcpy(&word, wrow + k / per, 4);
  return int((word >> ((k % per) * BITS)) & ((1u << BITS) - 1));
}

// res[r] = sum_g sc[g] * sum_{k in g} q[k] * xr[r][k]
template <int BITS>
void dot_portable(const uint32_t* wrow, const float* sc, int64_t K, int gs, const float* const* xr,
                  int rb, float* res) {
  for (int r = 0; r < rb; ++r) {
    const float* x = xr[r];
    float tot = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += gs) {
      float acc = 0.0f;
      for (int64_t k = k0; k < k0 + gs; ++k) acc += float(quant_at<BITS>(wrow, k)) * x[k];
      tot += acc * sc[k0 / gs];
    }
    res[r] = tot;
  }
}

#ifdef EDGE0_X86
// ---------------------------------------------------------------- AVX2 + FMA loops
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

template <int BITS>
constexpr int kBlock = 8 * (32 / BITS);  // elements per block: 64 (4-bit), 32 (8-bit)

template <int BITS>
void permute_x(const float* x, int64_t K, float* out) {
  constexpr int per = 32 / BITS;
  for (int64_t k0 = 0; k0 < K; k0 += kBlock<BITS>)
    for (int s = 0; s < per; ++s)
      for (int i = 0; i < 8; ++i) out[k0 + s * 8 + i] = x[k0 + i * per + s];
}

// The same order for the one-row loops (dot_avx2), each element of slice s < per - 1 times
// 2^(-BITS * s): those loops take slice s's values where they lie in the word, q * 2^(BITS * s),
// a mask and no shift, and the products are q * x exactly (powers of two; an x below 2^-100
// in magnitude may lose low bits as a subnormal). The last slice is shifted down, unscaled.
template <int BITS>
void permute_x_scaled(const float* x, int64_t K, float* out) {
  constexpr int per = 32 / BITS;
  float f[per];
  for (int s = 0; s < per; ++s) f[s] = s < per - 1 ? std::ldexp(1.0f, -BITS * s) : 1.0f;
  for (int64_t k0 = 0; k0 < K; k0 += kBlock<BITS>)
    for (int s = 0; s < per; ++s)
      for (int i = 0; i < 8; ++i) out[k0 + s * 8 + i] = x[k0 + i * per + s] * f[s];
}

// the scale of each lane's elements in block b (k0 = b * block): one group, or two groups
// of 32 side by side (4-bit, groups of 32: lanes 0-3 hold the first 32 elements)
template <int BITS>
__attribute__((target("avx2,fma"))) inline __m256 block_scale(const float* sc, int64_t k0, int gs) {
  if (BITS == 4 && gs == 32) {
    const __m128 a = _mm_set1_ps(sc[k0 / 32]), b = _mm_set1_ps(sc[k0 / 32 + 1]);
    return _mm256_insertf128_ps(_mm256_castps128_ps256(a), b, 1);
  }
  return _mm256_set1_ps(sc[group_of(k0, gs)]);
}

// RB rows of x (permute_x_scaled) against one weight row; U independent accumulators per row
// keep the FMA units busy when RB is small (one accumulator chain would wait on its latency).
// A slice is a mask (a shift for the last), a conversion and an FMA: three operations for
// eight weights where a shift, a mask, a conversion and an FMA were four (a gate projection
// at one row 1.11-1.15x faster on one thread, tools/qmm_vs.sh).
template <int BITS, int RB>
__attribute__((target("avx2,fma"))) void dot_avx2(const uint32_t* wrow, const float* sc, int64_t K,
                                                  int gs, const float* const* xr, float* res) {
  constexpr int per = 32 / BITS;
  constexpr int U = RB >= 4 ? 1 : 4 / RB;
  __m256 tot[RB];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r) tot[r] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += kBlock<BITS>) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + k0 / per));
    __m256 acc[RB][U];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) acc[r][u] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int s = 0; s < per; ++s) {
      const __m256i q = s < per - 1 ? _mm256_and_si256(v, _mm256_set1_epi32(((1 << BITS) - 1) << (s * BITS)))
                                    : _mm256_srli_epi32(v, s * BITS);
      const __m256 wf = _mm256_cvtepi32_ps(q);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r)
        acc[r][s % U] = _mm256_fmadd_ps(wf, _mm256_loadu_ps(xr[r] + k0 + s * 8), acc[r][s % U]);
    }
    const __m256 scale = block_scale<BITS>(sc, k0, gs);
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      __m256 a = acc[r][0];
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[r][u]);
      tot[r] = _mm256_fmadd_ps(a, scale, tot[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r) res[r] = hsum(tot[r]);
}

// Many rows against one expert's weights (prefill, batches): each weight row is decoded once
// into float32 (scale * q + bias, in the permuted order the AVX2 loops read x in), then the
// dot products are register tiles of MB rows of x by NB weight rows, one accumulator per
// pair, the k blocks in order: a pair's sum does not depend on the tile it was computed in.
template <int BITS>
__attribute__((target("avx2,fma"))) void dequant_avx2(const uint32_t* wrow, const float* sc, const float* bi,
                                                      int64_t K, int gs, float* out) {
  constexpr int per = 32 / BITS;
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  for (int64_t k0 = 0; k0 < K; k0 += kBlock<BITS>) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + k0 / per));
    const __m256 scale = block_scale<BITS>(sc, k0, gs), bias = block_scale<BITS>(bi, k0, gs);
#pragma GCC unroll 8
    for (int s = 0; s < per; ++s) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, s * BITS), mask));
      _mm256_storeu_ps(out + k0 + s * 8, _mm256_fmadd_ps(q, scale, bias));
    }
  }
}

template <int MB, int NB>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* const* xr, const float* wf, int64_t K, float* res) {
  __m256 acc[MB][NB];
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 3
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 w[NB];
#pragma GCC unroll 3
    for (int n = 0; n < NB; ++n) w[n] = _mm256_loadu_ps(wf + n * K + k);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      const __m256 x = _mm256_loadu_ps(xr[m] + k);
#pragma GCC unroll 3
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm256_fmadd_ps(x, w[n], acc[m][n]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 3
    for (int n = 0; n < NB; ++n) res[m * NB + n] = hsum(acc[m][n]);
}

constexpr int kTileM = 4, kTileN = 3;
constexpr int kTileM512 = 6, kTileN512 = 4;

template <int MB>
void tile_n(int nb, const float* const* xr, const float* wf, int64_t K, float* res) {
  if (nb == 3) return tile_avx2<MB, 3>(xr, wf, K, res);
  if (nb == 2) return tile_avx2<MB, 2>(xr, wf, K, res);
  tile_avx2<MB, 1>(xr, wf, K, res);
}

// res [mb][nb] = rows xr[0, mb) . the nb decoded weight rows at wf (K floats each)
void tile(int mb, int nb, const float* const* xr, const float* wf, int64_t K, float* res) {
  switch (mb) {
    case 4: return tile_n<4>(nb, xr, wf, K, res);
    case 3: return tile_n<3>(nb, xr, wf, K, res);
    case 2: return tile_n<2>(nb, xr, wf, K, res);
    default: return tile_n<1>(nb, xr, wf, K, res);
  }
}

// ---------------------------------------------------------------- AVX-512 loops
// The same loops on 16 lanes: one load is 16 words (128 values at 4 bits, 64 at 8), x is
// read in the matching order (permute_x512), and a block's lanes may span several groups
// (at 4 bits and groups of 64, lanes 0-7 the first group, 8-15 the second): each lane's
// scale is picked from the block's groups by a permute (lane i: group (i * per) / gs).
template <int BITS>
constexpr int kBlock512 = 16 * (32 / BITS);  // elements per block: 128 (4-bit), 64 (8-bit)

template <int BITS>
void permute_x512(const float* x, int64_t K, float* out) {
  constexpr int per = 32 / BITS;
  for (int64_t k0 = 0; k0 < K; k0 += kBlock512<BITS>)
    for (int s = 0; s < per; ++s)
      for (int i = 0; i < 16; ++i) out[k0 + s * 16 + i] = x[k0 + i * per + s];
}

// what block_scale512 needs for a call's group size: each lane's group within the block, and
// how many groups a block spans (the mask of the scales loaded); plain integers, so the
// struct passes between code built with and without AVX-512
struct Lanes512 {
  alignas(64) int32_t group[16];
  uint16_t load;
};

template <int BITS>
Lanes512 lanes512(int gs) {
  constexpr int per = 32 / BITS;
  Lanes512 l{};
  for (int i = 0; i < 16; ++i) l.group[i] = (i * per) / gs;
  l.load = uint16_t((1u << std::max(1, kBlock512<BITS> / gs)) - 1);
  return l;
}

template <int BITS>
__attribute__((target("avx512f"))) inline __m512 block_scale512(const float* sc, int64_t k0, int gs,
                                                                const Lanes512& l) {
  return _mm512_permutexvar_ps(_mm512_load_si512(l.group), _mm512_maskz_loadu_ps(__mmask16(l.load), sc + group_of(k0, gs)));
}

template <int BITS, int RB>
__attribute__((target("avx512f"))) void dot_avx512(const uint32_t* wrow, const float* sc, int64_t K, int gs,
                                                   const Lanes512& l, const float* const* xr, float* res) {
  constexpr int per = 32 / BITS;
  constexpr int U = RB >= 4 ? 1 : 4 / RB;
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  __m512 tot[RB];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r) tot[r] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += kBlock512<BITS>) {
    const __m512i v = _mm512_loadu_si512(wrow + k0 / per);
    __m512 acc[RB][U];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int s = 0; s < per; ++s) {
      const __m512 wf = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, s * BITS), mask));
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r)
        acc[r][s % U] = _mm512_fmadd_ps(wf, _mm512_loadu_ps(xr[r] + k0 + s * 16), acc[r][s % U]);
    }
    const __m512 scale = block_scale512<BITS>(sc, k0, gs, l);
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      __m512 a = acc[r][0];
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[r][u]);
      tot[r] = _mm512_fmadd_ps(a, scale, tot[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r) res[r] = _mm512_reduce_add_ps(tot[r]);
}

template <int BITS>
__attribute__((target("avx512f"))) void dequant_avx512(const uint32_t* wrow, const float* sc, const float* bi,
                                                       int64_t K, int gs, const Lanes512& l, float* out) {
  constexpr int per = 32 / BITS;
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  for (int64_t k0 = 0; k0 < K; k0 += kBlock512<BITS>) {
    const __m512i v = _mm512_loadu_si512(wrow + k0 / per);
    const __m512 scale = block_scale512<BITS>(sc, k0, gs, l), bias = block_scale512<BITS>(bi, k0, gs, l);
#pragma GCC unroll 8
    for (int s = 0; s < per; ++s) {
      const __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, s * BITS), mask));
      _mm512_storeu_ps(out + k0 + s * 16, _mm512_fmadd_ps(q, scale, bias));
    }
  }
}

template <int MB, int NB>
__attribute__((target("avx512f"))) void tile_avx512(const float* const* xr, const float* wf, int64_t K, float* res) {
  __m512 acc[MB][NB];
#pragma GCC unroll 6
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 w[NB];
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) w[n] = _mm512_loadu_ps(wf + n * K + k);
#pragma GCC unroll 6
    for (int m = 0; m < MB; ++m) {
      const __m512 x = _mm512_loadu_ps(xr[m] + k);
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_fmadd_ps(x, w[n], acc[m][n]);
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) res[m * NB + n] = _mm512_reduce_add_ps(acc[m][n]);
}

template <int MB>
void tile512_n(int nb, const float* const* xr, const float* wf, int64_t K, float* res) {
  switch (nb) {
    case 4: return tile_avx512<MB, 4>(xr, wf, K, res);
    case 3: return tile_avx512<MB, 3>(xr, wf, K, res);
    case 2: return tile_avx512<MB, 2>(xr, wf, K, res);
    default: return tile_avx512<MB, 1>(xr, wf, K, res);
  }
}

// res [mb][nb] = rows xr[0, mb) . the nb decoded weight rows at wf; tiles of up to 6 x 4
// (24 accumulators of the 32 registers)
void tile512(int mb, int nb, const float* const* xr, const float* wf, int64_t K, float* res) {
  switch (mb) {
    case 6: return tile512_n<6>(nb, xr, wf, K, res);
    case 5: return tile512_n<5>(nb, xr, wf, K, res);
    case 4: return tile512_n<4>(nb, xr, wf, K, res);
    case 3: return tile512_n<3>(nb, xr, wf, K, res);
    case 2: return tile512_n<2>(nb, xr, wf, K, res);
    default: return tile512_n<1>(nb, xr, wf, K, res);
  }
}

// A row's scales or biases as float32 (load_params), and the bias term's dot product over
// the groups: per output row these were scalar loops as long as a quarter of the row's
// vector work at one row of x.
__attribute__((target("avx2"))) void load_params_avx2(const void* p, ScaleType t, int64_t i0, int64_t n,
                                                      float* dst) {
  if (t != ScaleType::BF16) return load_params(p, t, i0, n, dst);
  auto q = static_cast<const unsigned char*>(p) + i0 * 2;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {  // bfloat16 is float32's upper half: widen and shift
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 2 * i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  if (i < n) load_params(p, t, i0 + i, n - i, dst + i);
}

__attribute__((target("avx512f"))) void load_params_avx512(const void* p, ScaleType t, int64_t i0, int64_t n,
                                                           float* dst) {
  if (t != ScaleType::BF16) return load_params(p, t, i0, n, dst);
  auto q = static_cast<const unsigned char*>(p) + i0 * 2;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 2 * i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  if (i < n) load_params(p, t, i0 + i, n - i, dst + i);
}

__attribute__((target("avx2,fma"))) float dot_groups_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float tot = hsum(acc);
  for (; i < n; ++i) tot += a[i] * b[i];
  return tot;
}

__attribute__((target("avx512f"))) float dot_groups_avx512(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float tot = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) tot += a[i] * b[i];
  return tot;
}

// Integer products (int8_products on): x quantized to int8 per 32 values, symmetric (d = max
// |x| / 127, q = round(x / d)), and AVX-512 VNNI's vpdpbusd multiplying the weights' codes
// (u8) by it (s8), four products into each int32 lane. At 4 bits a block of 128 values is one
// 64-byte load of 16 words; its low nibbles (values 8i, 8i+2, 8i+4, 8i+6 in lane i) and high
// nibbles (8i+1, ...) are two byte vectors, and x is laid out to match: per block 64 bytes of
// x's even values then 64 of its odd ones. At 8 bits a load is 64 values, lane i values 4i to
// 4i+3, x in its own order. Each lane has its d (one float a word of the row). A lane's int32
// sum is converted once and multiplied by its group's scale times its d: a convert and an FMA
// per 64-byte load where the float loops take eight (4 bits) or four (8 bits) of each. The
// bias term takes the quantized x's sums (qsum: each 32 values' d * sum q), so a row computes
// the dequantized weights against the quantized x exactly as llama.cpp's q8 products do: its
// error is x's rounding against the weights, not against the codes (which are not centred: up
// to twice the error).
template <int BITS>
void quantize_x8(const float* x, int64_t K, int8_t* q, float* d, float* qsum) {
  constexpr int block = kBlock512<BITS>, lane = block / 16;  // values a load covers, and a lane
  for (int64_t k0 = 0; k0 < K; k0 += block) {
    int8_t v[128];
    float dg[4];
    for (int g = 0; g < block / 32; ++g) {
      float m = 0.0f;
      for (int i = 0; i < 32; ++i) m = std::max(m, std::fabs(x[k0 + g * 32 + i]));
      dg[g] = m / 127.0f;
      const float inv = m > 0.0f ? 127.0f / m : 0.0f;
      int sum = 0;
      for (int i = 0; i < 32; ++i) {
        v[g * 32 + i] = int8_t(std::lrint(x[k0 + g * 32 + i] * inv));
        sum += v[g * 32 + i];
      }
      qsum[k0 / 32 + g] = dg[g] * float(sum);
    }
    int8_t* out = q + k0;
    if (BITS == 4) {
      for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 4; ++j) {
          out[4 * i + j] = v[8 * i + 2 * j];
          out[64 + 4 * i + j] = v[8 * i + 2 * j + 1];
        }
    } else {
      std::memcpy(out, v, block);
    }
    for (int i = 0; i < 16; ++i) d[k0 / lane + i] = dg[i * lane / 32];
  }
}

// one 64-byte load of weights into tot (dot_vnni)
template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512 vnni_block(
    const uint32_t* wrow, const float* sc, int64_t k0, int gs, const Lanes512& l, const int8_t* xq, const float* xd,
    __m512 tot) {
  constexpr int lane = kBlock512<BITS> / 16;
  const __m512i v = _mm512_loadu_si512(wrow + k0 / lane);
  __m512i acc;
  if (BITS == 4) {
    const __m512i m = _mm512_set1_epi8(15);
    const __m512i lo = _mm512_and_si512(v, m), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
    acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xq + k0));
    acc = _mm512_dpbusd_epi32(acc, hi, _mm512_loadu_si512(xq + k0 + 64));
  } else {
    acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_loadu_si512(xq + k0));
  }
  const __m512 f = _mm512_mul_ps(block_scale512<BITS>(sc, k0, gs, l), _mm512_loadu_ps(xd + k0 / lane));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), f, tot);
}

template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) float dot_vnni(const uint32_t* wrow, const float* sc,
                                                                      int64_t K, int gs, const Lanes512& l,
                                                                      const int8_t* xq, const float* xd) {
  constexpr int block = kBlock512<BITS>;
  __m512 t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps();  // two chains, in registers
  int64_t k0 = 0;
  for (; k0 + 2 * block <= K; k0 += 2 * block) {
    t0 = vnni_block<BITS>(wrow, sc, k0, gs, l, xq, xd, t0);
    t1 = vnni_block<BITS>(wrow, sc, k0 + block, gs, l, xq, xd, t1);
  }
  if (k0 < K) t0 = vnni_block<BITS>(wrow, sc, k0, gs, l, xq, xd, t0);
  return _mm512_reduce_add_ps(_mm512_add_ps(t0, t1));
}

// sum_g a[g] * b[g] for the integer products' bias term, the tail a masked load (a down
// projection's rows have few groups: 8 at K = 512 and groups of 64)
__attribute__((target("avx512f"))) float dot_groups_vnni(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 k = __mmask16((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") != 0;
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
struct Lanes {
  Lanes512 l512;
};
#else
bool cpu_has_avx2() { return false; }
bool cpu_has_avx512() { return false; }
bool cpu_has_vnni() { return false; }
struct Lanes {};
#endif

// the widest loops allowed (EDGE0_KERNEL_ISA at start-up, limit_isa later): the CPU's own
// widest by default
int g_isa_cap = [] {
  const char* v = std::getenv("EDGE0_KERNEL_ISA");
  if (v == nullptr) return int(Isa::Avx512);
  const std::string name(v);
  return name == "portable" ? int(Isa::Portable) : name == "avx2" ? int(Isa::Avx2) : int(Isa::Avx512);
}();

Isa current_isa() {
  static const Isa has = cpu_has_avx512() ? Isa::Avx512 : cpu_has_avx2() ? Isa::Avx2 : Isa::Portable;
  return Isa(std::min(int(has), g_isa_cap));
}

bool avx2_on() { return current_isa() >= Isa::Avx2; }

std::atomic<bool> g_int8{false};  // int8_products: asked for (set_int8_products)

// whether the one-row loops take integer products now: asked for, and the
// AVX-512 loops running on a CPU with VNNI
bool int8_on() {
  static const bool vnni = cpu_has_vnni();  // asked once: this runs on every call
  return g_int8.load(std::memory_order_relaxed) && current_isa() == Isa::Avx512 && vnni;
}

// the loops a call over rows of width K runs: the widest allowed whose block divides K
template <int BITS>
Isa isa_for(int64_t K) {
  Isa isa = current_isa();
#ifdef EDGE0_X86
  if (isa == Isa::Avx512 && K % kBlock512<BITS> != 0) isa = Isa::Avx2;
  if (isa == Isa::Avx2 && K % kBlock<BITS> != 0) isa = Isa::Portable;
#else
  (void)K;
#endif
  return isa;
}

void load_row_params(Isa isa, const void* p, ScaleType t, int64_t i0, int64_t n, float* dst) {
#ifdef EDGE0_X86
  if (isa == Isa::Avx512) return load_params_avx512(p, t, i0, n, dst);
  if (isa == Isa::Avx2) return load_params_avx2(p, t, i0, n, dst);
#endif
  (void)isa;
  load_params(p, t, i0, n, dst);
}

// sum_g a[g] * b[g] (the bias term: a row's biases against x's group sums)
float dot_groups(Isa isa, const float* a, const float* b, int64_t n) {
#ifdef EDGE0_X86
  if (isa == Isa::Avx512) return dot_groups_avx512(a, b, n);
  if (isa == Isa::Avx2) return dot_groups_avx2(a, b, n);
#endif
  (void)isa;
  float tot = 0.0f;
  for (int64_t g = 0; g < n; ++g) tot += a[g] * b[g];
  return tot;
}

template <int BITS>
void dot_rows(Isa isa, const Lanes& lanes, const uint32_t* wrow, const float* sc, int64_t K, int gs,
              const float* const* xr, int rb, float* res) {
#ifdef EDGE0_X86
  if (isa == Isa::Avx512) {
    if (rb == 4) return dot_avx512<BITS, 4>(wrow, sc, K, gs, lanes.l512, xr, res);
    if (rb == 2) return dot_avx512<BITS, 2>(wrow, sc, K, gs, lanes.l512, xr, res);
    if (rb == 1) return dot_avx512<BITS, 1>(wrow, sc, K, gs, lanes.l512, xr, res);
    dot_avx512<BITS, 2>(wrow, sc, K, gs, lanes.l512, xr, res);  // 3 rows: 2 + 1
    return dot_avx512<BITS, 1>(wrow, sc, K, gs, lanes.l512, xr + 2, res + 2);
  }
  if (isa == Isa::Avx2) {
    if (rb == 4) return dot_avx2<BITS, 4>(wrow, sc, K, gs, xr, res);
    if (rb == 2) return dot_avx2<BITS, 2>(wrow, sc, K, gs, xr, res);
    if (rb == 1) return dot_avx2<BITS, 1>(wrow, sc, K, gs, xr, res);
    dot_avx2<BITS, 2>(wrow, sc, K, gs, xr, res);  // 3 rows: 2 + 1
    return dot_avx2<BITS, 1>(wrow, sc, K, gs, xr + 2, res + 2);
  }
#endif
  (void)isa;
  (void)lanes;
  dot_portable<BITS>(wrow, sc, K, gs, xr, rb, res);
}

// ---------------------------------------------------------------- thread pool
// One parallel call at a time; a second caller (another MLX stream's thread) runs its parts
// itself, in order. After a call a worker spins for a bounded time (100 us;
// EDGE0_KERNEL_SPIN_US sets it, 0 never spins)
// watching for the next one, then sleeps on a condition variable: a forward pass makes its
// calls a few microseconds apart, and waking a sleeping thread costs tens to hundreds of
// microseconds on a virtual machine, as much as a one-row call's whole share. The spin is
// bounded so that between steps the workers sleep and leave the cores to the reader threads.
class Pool {
 public:
  void run(int parts, const std::function<void(int, int)>& fn) {
    if (parts <= 1) {
      fn(0, 1);
      return;
    }
    std::unique_lock<std::mutex> call(call_, std::try_to_lock);
    if (!call.owns_lock()) {
      for (int p = 0; p < parts; ++p) fn(p, parts);
      return;
    }
    ensure_workers(parts - 1);
    {
      std::lock_guard<std::mutex> lk(m_);
      job_ = &fn;
      parts_ = parts;
      remaining_.store(parts - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    fn(0, parts);
    if (!spin_until([&] { return remaining_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock<std::mutex> lk(m_);
      done_.wait(lk, [&] { return remaining_.load(std::memory_order_acquire) == 0; });
    }
    std::lock_guard<std::mutex> lk(m_);
    job_ = nullptr;
  }

 private:
  template <typename Pred>
  static bool spin_until(Pred ready) {
    static const std::chrono::microseconds spin = [] {
      const char* v = std::getenv("EDGE0_KERNEL_SPIN_US");
      return std::chrono::microseconds(v != nullptr ? std::max(0L, std::atol(v)) : 100L);
    }();
    const auto until = std::chrono::steady_clock::now() + spin;
    for (int i = 0;; ++i) {
      if (ready()) return true;
#ifdef EDGE0_X86
      _mm_pause();
#endif
      if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) return false;
    }
  }

  void ensure_workers(int n) {
    const pid_t pid = getpid();
    if (pid != pid_) {  // a forked child has none of its parent's threads
      workers_ = 0;
      pid_ = pid;
    }
    while (workers_ < n) {
      int id = workers_++;
      const uint64_t gen = generation_.load(std::memory_order_acquire);
      std::thread([this, id, gen] { loop(id, gen); }).detach();
    }
  }

  void loop(int id, uint64_t seen) {
    for (;;) {
      auto fresh = [&] { return generation_.load(std::memory_order_acquire) != seen; };
      if (!spin_until(fresh)) {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, fresh);
      }
      const std::function<void(int, int)>* job;
      int parts;
      {
        std::lock_guard<std::mutex> lk(m_);
        seen = generation_.load(std::memory_order_acquire);
        job = job_;
        parts = parts_;
      }
      if (job != nullptr && id + 1 < parts) {
        (*job)(id + 1, parts);
        if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
          std::lock_guard<std::mutex> lk(m_);
          done_.notify_one();
        }
      }
    }
  }

  std::mutex call_, m_;
  std::condition_variable cv_, done_;
  const std::function<void(int, int)>* job_ = nullptr;
  int parts_ = 0, workers_ = 0;
  std::atomic<int> remaining_{0};
  std::atomic<uint64_t> generation_{0};
  pid_t pid_ = 0;
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: detached workers may outlive statics
  return *p;
}

int g_threads = [] {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : int(n);
}();

// below this many weight elements per call, waking another thread costs more than it saves
constexpr int64_t kParallelMin = int64_t(1) << 16;
// from this many rows against one expert's weights, decode each weight row once and tile
constexpr int64_t kTileRows = 8;

template <typename I>
int64_t first_bad_index(const void* p, int64_t n, int64_t E) {
  auto q = static_cast<const I*>(p);
  for (int64_t i = 0; i < n; ++i)
    if (int64_t(q[i]) < 0 || int64_t(q[i]) >= E) return i;
  return -1;
}

template <typename I>
int64_t index_at(const void* p, int64_t i) {
  return int64_t(static_cast<const I*>(p)[i]);
}

// A part's scales and biases of the row it computes, on cache lines of their own. Written
// every row, they had shared a line with what the other threads read every row (the call's
// small arrays of row pointers, allocated just before): a down projection's integer products
// on two threads took 0.57 ms against 0.31 with them apart (tools/qmm_bench.cpp).
class RowParams {
 public:
  explicit RowParams(int64_t groups) : stride_((groups + 15) / 16 * 16), buf_(size_t(2 * stride_ + 32)) {
    base_ = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf_.data()) + 63) & ~uintptr_t(63));
  }
  float* scales() { return base_; }
  float* biases() { return base_ + stride_; }

 private:
  int64_t stride_;
  std::vector<float> buf_;
  float* base_;
};

template <int BITS>
void run_qmm(const QmmArgs& a) {
  const int64_t R = a.B * a.M, G = a.K / a.group_size;
  const int64_t words = a.K * BITS / 32;
  // rows (b * M + m) grouped by expert, each group in ascending row order
  std::vector<int64_t> rows(R), start, expert;
  if (a.indices == nullptr) {
    for (int64_t r = 0; r < R; ++r) rows[r] = r;
    start = {0, R};
    expert = {0};
  } else {
    auto idx = [&](int64_t b) {
      return a.indices_signed ? index_at<int32_t>(a.indices, b) : index_at<uint32_t>(a.indices, b);
    };
    std::vector<int64_t> count(a.E + 1, 0);
    for (int64_t b = 0; b < a.B; ++b) count[idx(b) + 1] += a.M;
    for (int64_t e = 0; e < a.E; ++e) count[e + 1] += count[e];
    std::vector<int64_t> fill(count.begin(), count.end() - 1);
    for (int64_t b = 0; b < a.B; ++b)
      for (int64_t m = 0; m < a.M; ++m) rows[fill[idx(b)]++] = b * a.M + m;
    for (int64_t e = 0; e < a.E; ++e) {
      if (count[e + 1] > count[e]) {
        start.push_back(count[e]);
        expert.push_back(e);
      }
    }
    start.push_back(R);
  }
  auto xrow = [&](int64_t r) {
    const int64_t b = r / a.M, m = r % a.M;
    return a.x + ((b / a.x_repeat) * a.M + m) * a.K;
  };
  // sum of x over each group, per row: the bias term's other factor
  std::vector<float> xsum(R * G);
  for (int64_t r = 0; r < R; ++r) {
    const float* x = xrow(r);
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int64_t k = g * a.group_size; k < (g + 1) * a.group_size; ++k) s += x[k];
      xsum[r * G + g] = s;
    }
  }
  // the vector loops read x block-transposed (permute_x, permute_x512), whole blocks of words
  const Isa use = isa_for<BITS>(a.K);
  Lanes lanes{};
  std::vector<float> xp, xq;  // x permuted for the tiles; for the AVX2 one-row loops, scaled too
  std::vector<int8_t> x8;  // x quantized for the integer products (int8_on), each lane's scale,
  std::vector<float> d8, s8;  // and the quantized x's sums over each weight group
  bool q8 = false;
#ifdef EDGE0_X86
  if (use == Isa::Avx512) lanes.l512 = lanes512<BITS>(a.group_size);
  if (use != Isa::Portable) {
    bool tiles = false, one_rows = false;  // which loops run: an expert's rows many or few
    for (size_t gi = 0; gi + 1 < start.size(); ++gi) (start[gi + 1] - start[gi] >= kTileRows ? tiles : one_rows) = true;
    const int64_t X = (a.B / a.x_repeat) * a.M;  // distinct rows of x
    q8 = one_rows && use == Isa::Avx512 && int8_on();
    if (q8) {
      x8.resize(X * a.K);
      d8.resize(X * words);  // a lane's d for each word of a row
      s8.assign(X * G, 0.0f);
      std::vector<float> qs(a.K / 32);
      for (int64_t i = 0; i < X; ++i) {
        quantize_x8<BITS>(a.x + i * a.K, a.K, x8.data() + i * a.K, d8.data() + i * words, qs.data());
        for (int64_t j = 0; j < a.K / 32; ++j) s8[i * G + j * 32 / a.group_size] += qs[j];
      }
    }
    // the AVX-512 loops read x permuted, the one-row ones too unless they take integer products
    const bool wide_x = use == Isa::Avx512 && (tiles || !q8);
    if (wide_x || (use == Isa::Avx2 && tiles)) xp.resize(X * a.K);
    if (use == Isa::Avx2 && one_rows) xq.resize(X * a.K);
    for (int64_t i = 0; i < X; ++i) {
      if (use == Isa::Avx512) {
        if (wide_x) permute_x512<BITS>(a.x + i * a.K, a.K, xp.data() + i * a.K);
        continue;
      }
      if (tiles) permute_x<BITS>(a.x + i * a.K, a.K, xp.data() + i * a.K);
      if (one_rows) permute_x_scaled<BITS>(a.x + i * a.K, a.K, xq.data() + i * a.K);
    }
  }
#endif
  const float* xtile = !xp.empty() ? xp.data() : a.x;  // (a.x: the portable loops', or none read it)
  const float* xone = !xq.empty() ? xq.data() : xtile;
  auto xat = [&](const float* base, int64_t r) {  // the x a row's dot products read
    const int64_t b = r / a.M, m = r % a.M;
    return base + ((b / a.x_repeat) * a.M + m) * a.K;
  };
  // each row's x (as the one-row loops and as the tiles read it), its sums and its output,
  // found once (not per output row n)
  std::vector<const float*> xs_of(R), xd_of(R), xt_of(R), d8_of(q8 ? R : 0), s8_of(q8 ? R : 0);
  std::vector<const int8_t*> x8_of(q8 ? R : 0);
  std::vector<float*> out_of(R);
  for (int64_t i = 0; i < R; ++i) {
    if (q8) {
      const int64_t b = rows[i] / a.M, m = rows[i] % a.M, xi = (b / a.x_repeat) * a.M + m;
      x8_of[i] = x8.data() + xi * a.K;
      d8_of[i] = d8.data() + xi * words;
      s8_of[i] = s8.data() + xi * G;
    }
    xd_of[i] = xat(xone, rows[i]);
    xt_of[i] = xat(xtile, rows[i]);
    xs_of[i] = xsum.data() + rows[i] * G;
    out_of[i] = a.out + rows[i] * a.N;
  }
  auto part = [&](int p, int parts) {
    const int64_t n0 = a.N * p / parts, n1 = a.N * (p + 1) / parts;
    RowParams params(G);
    float *sc = params.scales(), *bi = params.biases();
#ifdef EDGE0_X86
    std::vector<float> wf;  // the tiles' decoded weight rows
    const bool wide = use == Isa::Avx512;
    const int tm = wide ? kTileM512 : kTileM, tn = wide ? kTileN512 : kTileN;
#endif
    for (size_t gi = 0; gi + 1 < start.size(); ++gi) {
      const int64_t e = expert[gi], s0 = start[gi], s1 = start[gi + 1];
#ifdef EDGE0_X86
      if (use != Isa::Portable && s1 - s0 >= kTileRows) {
        wf.resize(size_t(tn) * a.K);
        for (int64_t n = n0; n < n1; n += tn) {
          const int nb = int(std::min<int64_t>(tn, n1 - n));
          for (int j = 0; j < nb; ++j) {
            const int64_t row = e * a.N + n + j;
            load_row_params(use, a.scales, a.scale_type, row * G, G, sc);
            load_row_params(use, a.biases, a.scale_type, row * G, G, bi);
            if (wide)
              dequant_avx512<BITS>(a.w + row * words, sc, bi, a.K, a.group_size, lanes.l512,
                                   wf.data() + j * a.K);
            else
              dequant_avx2<BITS>(a.w + row * words, sc, bi, a.K, a.group_size, wf.data() + j * a.K);
          }
          for (int64_t s = s0; s < s1; s += tm) {
            const int mb = int(std::min<int64_t>(tm, s1 - s));
            float res[kTileM512 * kTileN512];
            if (wide)
              tile512(mb, nb, xt_of.data() + s, wf.data(), a.K, res);
            else
              tile(mb, nb, xt_of.data() + s, wf.data(), a.K, res);
            for (int i = 0; i < mb; ++i)
              for (int j = 0; j < nb; ++j) out_of[s + i][n + j] = res[i * nb + j];
          }
        }
        continue;
      }
#endif
      for (int64_t n = n0; n < n1; ++n) {
        const int64_t row = e * a.N + n;
        const uint32_t* wrow = a.w + row * words;
        load_row_params(use, a.scales, a.scale_type, row * G, G, sc);
        load_row_params(use, a.biases, a.scale_type, row * G, G, bi);
        for (int64_t s = s0; s < s1; s += 4) {
          const int rb = int(std::min<int64_t>(4, s1 - s));
          float res[4];
#ifdef EDGE0_X86
          if (q8) {
            for (int i = 0; i < rb; ++i)
              res[i] = dot_vnni<BITS>(wrow, sc, a.K, a.group_size, lanes.l512, x8_of[s + i], d8_of[s + i]);
            for (int i = 0; i < rb; ++i) out_of[s + i][n] = res[i] + dot_groups_vnni(bi, s8_of[s + i], G);
            continue;
          }
#endif
          dot_rows<BITS>(use, lanes, wrow, sc, a.K, a.group_size, xd_of.data() + s, rb, res);
          for (int i = 0; i < rb; ++i) out_of[s + i][n] = res[i] + dot_groups(use, bi, xs_of[s + i], G);
        }
      }
    }
  };
  const int64_t work = R * a.N * a.K;
  int parts = work < kParallelMin ? 1 : std::min<int64_t>(g_threads, a.N);
  pool().run(std::max(parts, 1), part);
}

}  // namespace

int64_t qmm(const QmmArgs& a) {
  if (a.indices != nullptr) {
    int64_t bad = a.indices_signed ? first_bad_index<int32_t>(a.indices, a.B, a.E)
                                   : first_bad_index<uint32_t>(a.indices, a.B, a.E);
    if (bad >= 0) return bad;
  }
  if (a.B * a.M == 0 || a.N == 0) return -1;
  if (a.bits == 4)
    run_qmm<4>(a);
  else
    run_qmm<8>(a);
  return -1;
}

uint64_t stream_bytes(const char* const* ptrs, const int64_t* sizes, int64_t n) {
  std::vector<uint64_t> sums(std::max(1, g_threads), 0);
  auto part = [&](int p, int parts) {
    uint64_t acc = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t words = sizes[i] / 8;
      const int64_t w0 = words * p / parts, w1 = words * (p + 1) / parts;
      auto q = reinterpret_cast<const uint64_t*>(ptrs[i]);
      uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
      int64_t w = w0;
      for (; w + 4 <= w1; w += 4) {
        a0 ^= q[w];
        a1 ^= q[w + 1];
        a2 ^= q[w + 2];
        a3 ^= q[w + 3];
      }
      for (; w < w1; ++w) a0 ^= q[w];
      acc ^= a0 ^ a1 ^ a2 ^ a3;
    }
    sums[p] = acc;
  };
  const int parts = std::max(1, g_threads);
  pool().run(parts, part);
  uint64_t total = 0;
  for (auto v : sums) total ^= v;
  return total;
}

void parallel_rows(int64_t rows, const std::function<void(int, int)>& fn) {
  pool().run(int(std::max<int64_t>(1, std::min<int64_t>(g_threads, rows))), fn);
}

bool use_avx2() { return avx2_on(); }

void set_threads(int n) { g_threads = std::max(1, n); }
int get_threads() { return g_threads; }
const char* isa() {
  switch (current_isa()) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "portable";
  }
}
bool set_int8_products(bool on) {
  if (on && !cpu_has_vnni()) return false;
  g_int8.store(on, std::memory_order_relaxed);
  return true;
}
bool int8_products() { return int8_on(); }
bool limit_isa(const char* name) {
  const std::string n(name);
  if (n != "avx512" && n != "avx2" && n != "portable") return false;
  g_isa_cap = int(n == "portable" ? Isa::Portable : n == "avx2" ? Isa::Avx2 : Isa::Avx512);
  return true;
}

}  // namespace edge0
