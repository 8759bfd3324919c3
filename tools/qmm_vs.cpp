// Edge0's quantized matmul against the same kernel at another commit, in one process: the two
// builds' calls alternate on the same weights, x and fresh expert indices (a gathered call at
// decode: one row of x, top-k experts of 256, int4 in groups of 64, bfloat16 scales and
// biases), so a machine that slows down halfway slows both. Prints each build's median call
// and how many calls' outputs differ in any bit. Built and run by tools/qmm_vs.sh.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "qmm.h"
#include "qmm_other.h"  // the other commit's qmm.h, its namespace renamed edge0_other

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: qmm_vs N K THREADS\n");
    return 2;
  }
  const int n = std::atoi(argv[1]), k = std::atoi(argv[2]), threads = std::atoi(argv[3]);
  const int experts = 256, topk = 8, calls = 300;
  if (n <= 0 || k <= 0 || k % 64 != 0 || threads <= 0) {
    std::fprintf(stderr, "N and THREADS must be positive, K a multiple of 64\n");
    return 2;
  }
  edge0::set_threads(threads);
  edge0_other::set_threads(threads);
  std::mt19937 rng(0);
  std::vector<uint32_t> w(size_t(experts) * n * k / 8);
  for (auto& v : w) v = rng();
  std::vector<uint16_t> scales(size_t(experts) * n * k / 64), biases(scales.size());
  for (auto& v : scales) v = uint16_t(0x3c00 + rng() % 64);  // bfloat16 near 0.008
  for (auto& v : biases) v = uint16_t(0xbc00 + rng() % 64);
  std::vector<float> x(k), here(size_t(topk) * n), there(here.size());
  for (auto& v : x) v = float(int(rng() % 2001) - 1000) / 1000.0f;
  std::vector<uint32_t> idx(topk);
  std::vector<double> t_here, t_there;
  int differ = 0;
  for (int c = 0; c < calls; ++c) {
    for (auto& i : idx) i = rng() % experts;
    edge0::QmmArgs a;
    edge0_other::QmmArgs o;
    a.x = o.x = x.data();
    a.w = o.w = w.data();
    a.scales = o.scales = scales.data();
    a.biases = o.biases = biases.data();
    a.indices = o.indices = idx.data();
    a.scale_type = edge0::ScaleType::BF16;
    o.scale_type = edge0_other::ScaleType::BF16;
    a.out = here.data();
    o.out = there.data();
    a.B = o.B = topk;
    a.M = o.M = 1;
    a.N = o.N = n;
    a.K = o.K = k;
    a.E = o.E = experts;
    a.x_repeat = o.x_repeat = topk;
    for (int turn = 0; turn < 2; ++turn) {  // who goes first alternates
      const bool mine = (turn == 0) == (c % 2 == 0);
      const auto t0 = std::chrono::steady_clock::now();
      if (mine)
        edge0::qmm(a);
      else
        edge0_other::qmm(o);
      (mine ? t_here : t_there).push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    differ += std::memcmp(here.data(), there.data(), here.size() * sizeof(float)) != 0;
  }
  std::sort(t_here.begin(), t_here.end());
  std::sort(t_there.begin(), t_there.end());
  const double mh = t_here[calls / 2] * 1e3, mt = t_there[calls / 2] * 1e3;
  std::printf("n %d k %d threads %d: this tree %.3f ms, other %.3f ms (other / this %.3f); outputs differing: %d of %d calls\n",
              n, k, threads, mh, mt, mt / mh, differ, calls);
  return 0;
}
