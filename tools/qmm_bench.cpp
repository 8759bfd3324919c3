// The kernels alone, without MLX: one gathered quantized matmul call timed in C++ around
// edge0::qmm, fresh expert indices every call (the weights come from memory, not cache).
//
//   g++ -O2 -std=c++17 -I edge0/backend/mlx/kernels/csrc tools/qmm_bench.cpp \
//       edge0/backend/mlx/kernels/csrc/qmm.cpp -o qmm_bench -lpthread
//   ./qmm_bench --n 512 --k 2048 --rows 1 --threads 2      # gate/up projection at one row
//   ./qmm_bench --n 2048 --k 512 --rows 1 --threads 2      # down projection
//   ./qmm_bench --n 2048 --k 2048 --topk 1 --threads 2     # a dense 2048 x 2048 projection
//
// Prints the 10th, 50th and 90th percentile of the calls' times. The weights are random
// int4 words (256 experts of n x k), float32 scales and biases, group size 64; x_repeat = topk,
// as SwitchGLU's gate and up projections call it at decode.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "qmm.h"

int main(int argc, char** argv) {
  int experts = 256, n = 512, k = 2048, topk = 8, rows = 1, threads = 1, calls = 200, int8 = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const int v = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--n")) n = v;
    else if (!std::strcmp(argv[i], "--k")) k = v;
    else if (!std::strcmp(argv[i], "--topk")) topk = v;
    else if (!std::strcmp(argv[i], "--rows")) rows = v;
    else if (!std::strcmp(argv[i], "--threads")) threads = v;
    else if (!std::strcmp(argv[i], "--calls")) calls = v;
    else if (!std::strcmp(argv[i], "--experts")) experts = v;
    else if (!std::strcmp(argv[i], "--int8")) int8 = v;
    else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  if (n <= 0 || k <= 0 || k % 64 != 0 || topk <= 0 || rows <= 0 || threads <= 0 || calls < 10 || experts <= 0) {
    std::fprintf(stderr, "n, topk, rows, threads, experts must be positive, k a multiple of 64, calls >= 10\n");
    return 2;
  }
  edge0::set_threads(threads);
  if (int8 && !edge0::set_int8_products(true)) {
    std::fprintf(stderr, "--int8 1: this CPU has no AVX-512 VNNI\n");
    return 2;
  }
  std::mt19937 rng(0);
  std::vector<uint32_t> w(size_t(experts) * n * k / 8);
  for (auto& v : w) v = rng();
  const size_t groups = size_t(experts) * n * k / 64;
  std::vector<float> scales(groups, 0.01f), biases(groups, -0.05f), x(size_t(rows) * k, 0.5f);
  std::vector<float> out(size_t(rows) * topk * n);
  std::vector<uint32_t> idx(size_t(rows) * topk);
  std::vector<double> times;
  for (int c = 0; c < calls; ++c) {
    for (auto& i : idx) i = rng() % experts;
    edge0::QmmArgs a;
    a.x = x.data();
    a.w = w.data();
    a.scales = scales.data();
    a.biases = biases.data();
    a.indices = idx.data();
    a.out = out.data();
    a.B = rows * topk;
    a.M = 1;
    a.N = n;
    a.K = k;
    a.E = experts;
    a.x_repeat = topk;
    const auto t0 = std::chrono::steady_clock::now();
    edge0::qmm(a);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  const size_t m = times.size();
  std::printf("n %d k %d topk %d rows %d threads %d int8 %d: p10 %.3f p50 %.3f p90 %.3f ms\n", n, k, topk, rows, threads, int8,
              times[m / 10] * 1e3, times[m / 2] * 1e3, times[m * 9 / 10] * 1e3);
  return 0;
}
