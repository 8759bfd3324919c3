// Edge0's CPU kernels for MLX's affine quantized layout (no MLX types here).
//
// Layout (as mlx-lm checkpoints carry it, transpose=True): a weight is uint32 words
// [E, N, K * bits / 32], element k of row n in word k * bits / 32, bits (k % (32 / bits))
// * bits from the low end; scales and biases [E, N, K / group_size] in float32, bfloat16
// or float16. Dequantized w[e, n, k] = scale[e, n, g] * q + bias[e, n, g], g = k / group_size.
// The weight, scales and biases may sit at any byte address (a checkpoint file mapped in
// place keeps its offsets, which safetensors does not align): they are read with unaligned
// loads.
#pragma once

#include <cstdint>
#include <functional>

namespace edge0 {

enum class ScaleType : int { F32 = 0, BF16 = 1, F16 = 2 };

struct QmmArgs {
  const float* x = nullptr;        // [Bx, M, K], row-contiguous
  const uint32_t* w = nullptr;     // [E, N, K * bits / 32]
  const void* scales = nullptr;    // [E, N, K / group_size]
  const void* biases = nullptr;    // [E, N, K / group_size]
  ScaleType scale_type = ScaleType::F32;
  const void* indices = nullptr;   // [B] expert of each batch entry; nullptr: dense (E == 1)
  bool indices_signed = false;     // int32 (true) or uint32 (false)
  float* out = nullptr;            // [B, M, N]
  int64_t B = 0, M = 0, N = 0, K = 0, E = 1;
  int64_t x_repeat = 1;            // batch entry b reads x[b / x_repeat]
  int bits = 4, group_size = 64;
};

// out[b, m, n] = sum_k x[b / x_repeat, m, k] * w[idx[b], n, k]. Output rows are split over
// the pool's threads (never the reduction), so the result does not depend on the thread
// count. Returns -1, or the position b of the first index outside [0, E) (nothing computed).
int64_t qmm(const QmmArgs& a);

// Reads n byte ranges (ptrs[i], sizes[i]) with the pool's threads, as qmm reads its weights
// (each thread a share of every range), and returns a checksum so nothing is optimised
// away: the memory limit a kernel over the same bytes is measured against.
uint64_t stream_bytes(const char* const* ptrs, const int64_t* sizes, int64_t n);

// softmax(q k^T * scale) v for float32 q [B, Hq, L, D], k and v [B, Hkv, S, D], out [B, Hq, L, D],
// row-contiguous; Hq a multiple of Hkv. causal: query i sees keys j <= S - L + i.
struct AttnArgs {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  float* out = nullptr;
  int64_t B = 0, Hq = 0, Hkv = 0, L = 0, S = 0, D = 0;
  float scale = 1.0f;
  bool causal = true;
  // a boolean mask (nullptr: none): key j of query i, head h, batch b is seen where
  // mask[b * mask_b + h * mask_h + i * mask_l + j] (strides 0 where the mask broadcasts)
  const uint8_t* mask = nullptr;
  int64_t mask_b = 0, mask_h = 0, mask_l = 0;
  // k's and v's strides (in floats) from one batch entry and one head to the next; a head's
  // positions are rows of D floats one after the other (a cache's buffer, sliced to its
  // length, is read where it lies)
  int64_t k_b = 0, k_h = 0, v_b = 0, v_h = 0;
};
void attention(const AttnArgs& a);

// fn(part, parts) on the pool's threads, rows dealt among them (fewer parts for few rows).
void parallel_rows(int64_t rows, const std::function<void(int, int)>& fn);
// Which loops run: the widest the CPU has (AVX-512, then AVX2 with FMA), unless limited.
enum class Isa : int { Portable = 0, Avx2 = 1, Avx512 = 2 };
// Whether the AVX2 loops may run (the attention kernel's widest).
bool use_avx2();

// The number of threads qmm splits output rows over (1 = the calling thread only).
void set_threads(int n);
int get_threads();
// Which inner loops run: "avx512", "avx2" or "portable".
const char* isa();
// Integer products for the one-row loops (x quantized to int8 per 32 values,
// AVX-512 VNNI): false where the CPU lacks VNNI (nothing changed). int8_products: whether
// they run now (asked for, and the AVX-512 loops allowed).
bool set_int8_products(bool on);
bool int8_products();
// The widest loops allowed ("avx512": the CPU decides; "avx2"; "portable"). Returns false
// for another name. EDGE0_KERNEL_ISA sets it at start-up.
bool limit_isa(const char* name);

}  // namespace edge0
