// The MLX side of Edge0's kernels: one Primitive (CPU only) and its Python binding.
//
// edge0_qmm(x [Bx, M, K] float32, w [E, N, K*bits/32] uint32, scales, biases [E, N, K/gs],
//           indices [B] int32/uint32 or None, bits, group_size, x_repeat) -> [B, M, N] float32
// Batch entry b multiplies x[b / x_repeat] by expert indices[b]'s weight, transposed, as
// mx.gather_qmm(..., transpose=True) does; with indices None, E is 1 and B == Bx (the dense
// quantized_matmul). Shapes are checked when the op is built (ValueError); an index outside
// [0, E) is found when the op runs and raised at evaluation (nothing is written past the
// output). No vjp: training keeps MLX's kernels.
//
// edge0_qmm_at(x, indices, (mapping, offset) of the weight, the scales, the biases, ...): the
// same product with the experts' stacked tensors read where file mappings (`Mapping`, a
// read-only mmap of a checkpoint file) hold them, at byte offsets of those files: no copy of
// an expert into a slot. The primitive keeps the mappings alive until it has run.
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <tuple>
#include <cstring>
#include <optional>
#include <thread>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "mlx/version.h"
#include "binding.h"
#include "qmm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cerrno>
#include <csignal>
#include <mutex>
#include <memory>

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;
using edge0_binding::bad;
using edge0_binding::shape_str;
using edge0_binding::cpu_stream;

namespace {

// An input as the kernel reads it: its own memory when row-contiguous, else a packed copy
// made when the op runs (the strides are known when eval_cpu is called, the data later).
struct Input {
  const char* data = nullptr;
  bool contiguous = true;
  std::vector<int64_t> shape, strides;
  size_t itemsize = 0;
  std::vector<char> packed;

  explicit Input(const mx::array& a)
      : data(static_cast<const char*>(a.data<void>())),
        contiguous(a.flags().row_contiguous),
        itemsize(a.itemsize()) {
    if (!contiguous) {
      shape.assign(a.shape().begin(), a.shape().end());
      strides.assign(a.strides().begin(), a.strides().end());
    }
  }

  const void* ptr() {
    if (contiguous) return data;
    int64_t n = 1;
    for (auto d : shape) n *= d;
    packed.resize(size_t(n) * itemsize);
    std::vector<int64_t> pos(shape.size(), 0);
    for (int64_t i = 0; i < n; ++i) {
      int64_t off = 0;
      for (size_t d = 0; d < shape.size(); ++d) off += pos[d] * strides[d];
      std::memcpy(packed.data() + i * itemsize, data + off * int64_t(itemsize), itemsize);
      for (int d = int(shape.size()) - 1; d >= 0; --d) {
        if (++pos[d] < shape[d]) break;
        pos[d] = 0;
      }
    }
    return packed.data();
  }
};

// What qmm returned: -1, or the position of an index outside [0, E) (raised at evaluation).
void check_indices(const edge0::QmmArgs& a, int64_t bad) {
  if (bad < 0) return;
  const int64_t v = a.indices_signed ? int64_t(static_cast<const int32_t*>(a.indices)[bad])
                                     : int64_t(static_cast<const uint32_t*>(a.indices)[bad]);
  std::ostringstream msg;
  msg << "edge0 kernels: expert index " << v << " at position " << bad << " is outside [0, " << a.E << ")";
  throw std::out_of_range(msg.str());
}

class Edge0Qmm : public edge0_binding::CpuPrimitive {
 public:
  Edge0Qmm(mx::Stream s, int bits, int group_size, int64_t x_repeat, bool dense)
      : CpuPrimitive(s), bits_(bits), gs_(group_size), x_repeat_(x_repeat), dense_(dense) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = begin(in, out);
    const auto& x = in[0];
    const auto& w = in[1];
    const auto& s = in[2];
    edge0::QmmArgs a;
    a.scale_type = s.dtype() == mx::float32    ? edge0::ScaleType::F32
                   : s.dtype() == mx::bfloat16 ? edge0::ScaleType::BF16
                                               : edge0::ScaleType::F16;
    a.out = out.data<float>();
    a.B = out.shape(0);
    a.M = out.shape(1);
    a.N = out.shape(2);
    a.K = x.shape(2);
    a.E = dense_ ? 1 : w.shape(0);
    a.x_repeat = x_repeat_;
    a.bits = bits_;
    a.group_size = gs_;
    a.indices_signed = !dense_ && in[4].dtype() == mx::int32;
    std::vector<Input> inputs;
    inputs.reserve(in.size());
    for (auto& t : in) inputs.emplace_back(t);
    enc.dispatch([a, inputs = std::move(inputs), dense = dense_]() mutable {
      a.x = static_cast<const float*>(inputs[0].ptr());
      a.w = static_cast<const uint32_t*>(inputs[1].ptr());
      a.scales = inputs[2].ptr();
      a.biases = inputs[3].ptr();
      a.indices = dense ? nullptr : inputs[4].ptr();
      check_indices(a, edge0::qmm(a));
    });
  }

  const char* name() const override { return "Edge0QuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Edge0Qmm&>(other);
    return bits_ == o.bits_ && gs_ == o.gs_ && x_repeat_ == o.x_repeat_ && dense_ == o.dense_;
  }

 private:
  int bits_, gs_;
  int64_t x_repeat_;
  bool dense_;
};

// softmax(q k^T * scale) v (edge0::attention): the prompt's attention on the CPU.
class Edge0Attention : public edge0_binding::CpuPrimitive {
 public:
  Edge0Attention(mx::Stream s, float scale, bool causal) : CpuPrimitive(s), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = begin(in, out);
    edge0::AttnArgs a;
    a.out = out.data<float>();
    a.B = in[0].shape(0);
    a.Hq = in[0].shape(1);
    a.L = in[0].shape(2);
    a.D = in[0].shape(3);
    a.Hkv = in[1].shape(1);
    a.S = in[1].shape(2);
    a.scale = scale_;
    a.causal = causal_;
    if (in.size() > 3) {  // the mask [1 or B, 1 or Hq, 1 or L, S], packed row-major by Input
      const auto& m = in[3];
      const int64_t S = m.shape(3), ml = m.shape(2), mh = m.shape(1);
      a.mask_l = ml > 1 ? S : 0;
      a.mask_h = mh > 1 ? ml * S : 0;
      a.mask_b = m.shape(0) > 1 ? mh * ml * S : 0;
    }
    // k and v where they lie when each head's positions are rows of D floats one after the
    // other (a cache's buffer sliced to its length: no copy a decode step), else packed
    const auto rows_of = [&](const mx::array& t) { return t.strides()[3] == 1 && t.strides()[2] == a.D; };
    const bool direct = rows_of(in[1]) && rows_of(in[2]);
    if (direct) {
      a.k_b = in[1].strides()[0], a.k_h = in[1].strides()[1];
      a.v_b = in[2].strides()[0], a.v_h = in[2].strides()[1];
    } else {
      a.k_b = a.v_b = a.Hkv * a.S * a.D, a.k_h = a.v_h = a.S * a.D;
    }
    const float* k_at = direct ? in[1].data<float>() : nullptr;
    const float* v_at = direct ? in[2].data<float>() : nullptr;
    std::vector<Input> inputs;
    inputs.reserve(in.size());
    for (size_t i = 0; i < in.size(); ++i)
      if (!direct || (i != 1 && i != 2)) inputs.emplace_back(in[i]);
    // (k and v read where they lie stay alive until the kernel ran: they are the encoder's inputs)
    enc.dispatch([a, inputs = std::move(inputs), direct, k_at, v_at]() mutable {
      a.q = static_cast<const float*>(inputs[0].ptr());
      a.k = direct ? k_at : static_cast<const float*>(inputs[1].ptr());
      a.v = direct ? v_at : static_cast<const float*>(inputs[2].ptr());
      const size_t m = direct ? 1 : 3;  // the mask's place among the inputs
      if (inputs.size() > m) a.mask = static_cast<const uint8_t*>(inputs[m].ptr());
      edge0::attention(a);
    });
  }

  const char* name() const override { return "Edge0Attention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Edge0Attention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }

 private:
  float scale_;
  bool causal_;
};

// A file truncated under its mapping turns a read of the pages past its new end into
// SIGBUS, which would end the process. Every live mapping is registered here; the handler,
// for an address inside one, maps a page of zeros over the faulting page and marks the
// mapping poisoned, so the read completes; the op that ran on it then fails with a typed
// error (and so does every later op on it), and the engine maps the file anew. An address
// outside every mapping goes to the handler that was there before (or the default action).
struct Guarded {
  std::atomic<uintptr_t> base{0};
  std::atomic<size_t> size{0};
  std::atomic<int> poisoned{0};
};
constexpr int kGuarded = 1024;
Guarded g_guarded[kGuarded];
struct sigaction g_prev_bus {};
long g_page = 4096;

void on_sigbus(int sig, siginfo_t* info, void* ctx) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(info->si_addr);
  for (auto& g : g_guarded) {
    const uintptr_t b = g.base.load(std::memory_order_acquire);
    if (b > 1 && a >= b && a < b + g.size.load(std::memory_order_acquire)) {
      void* page = reinterpret_cast<void*>(a & ~uintptr_t(g_page - 1));
      if (::mmap(page, size_t(g_page), PROT_READ, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) != MAP_FAILED) {
        g.poisoned.store(1, std::memory_order_release);
        return;
      }
      break;
    }
  }
  if ((g_prev_bus.sa_flags & SA_SIGINFO) && g_prev_bus.sa_sigaction != nullptr) {
    g_prev_bus.sa_sigaction(sig, info, ctx);
    return;
  }
  if (!(g_prev_bus.sa_flags & SA_SIGINFO) && g_prev_bus.sa_handler != SIG_DFL && g_prev_bus.sa_handler != SIG_IGN) {
    g_prev_bus.sa_handler(sig);
    return;
  }
  ::signal(SIGBUS, SIG_DFL);
  ::raise(SIGBUS);
}

Guarded* guard(const char* base, size_t size) {
  static std::once_flag once;
  std::call_once(once, [] {
    g_page = ::sysconf(_SC_PAGESIZE);
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, &g_prev_bus);
  });
  for (auto& g : g_guarded) {
    uintptr_t free = 0;
    if (!g.base.compare_exchange_strong(free, 1, std::memory_order_acq_rel)) continue;  // 1: being set up
    g.size.store(size, std::memory_order_release);
    g.poisoned.store(0, std::memory_order_release);
    g.base.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
    return &g;
  }
  return nullptr;  // more live mappings than the table holds: unguarded
}

// A read-only, shared mapping of a whole file (closed with its last reference).
class Mapping {
 public:
  explicit Mapping(const std::string& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error("edge0: cannot open " + path + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      throw std::runtime_error("edge0: cannot stat " + path + ": " + std::strerror(e));
    }
    size_ = size_t(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
      const int e = errno;
      ::close(fd);
      if (p == MAP_FAILED) throw std::runtime_error("edge0: cannot map " + path + ": " + std::strerror(e));
      base_ = static_cast<const char*>(p);
      guard_ = guard(base_, size_);
    } else {
      ::close(fd);
    }
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (guard_ != nullptr) guard_->base.store(0, std::memory_order_release);
    if (base_ != nullptr) ::munmap(const_cast<char*>(base_), size_);
  }
  // Whether a read past the file's end (it was truncated under the mapping) hit it.
  bool poisoned() const { return guard_ != nullptr && guard_->poisoned.load(std::memory_order_acquire) != 0; }
  const char* base() const { return base_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Puts the pages of bytes [offset, offset + length) into this mapping's page tables now
  // (madvise MADV_POPULATE_READ, Linux 5.14+), reading from the file those not in the page
  // cache, so a kernel that later reads them takes no page fault. False where the kernel does
  // not know the advice or a page could not be read (a file truncated under the mapping).
  bool populate(size_t offset, size_t length) const {
    constexpr int kPopulateRead = 22;  // MADV_POPULATE_READ, absent from older headers
    if (base_ == nullptr || offset >= size_) return true;
    const size_t page = size_t(::sysconf(_SC_PAGESIZE));
    const size_t start = offset - offset % page;
    const size_t end = std::min(size_, offset + length);
    return ::madvise(const_cast<char*>(base_) + start, end - start, kPopulateRead) == 0;
  }
  // Bytes of the mapping resident in memory now (mincore), for the stats and tests.
  size_t resident() const {
    if (base_ == nullptr) return 0;
    const size_t page = size_t(::sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> v((size_ + page - 1) / page);
    if (::mincore(const_cast<char*>(base_), size_, v.data()) != 0) return 0;
    size_t n = 0;
    for (auto c : v) n += c & 1;
    return n * page;
  }

 private:
  std::string path_;
  const char* base_ = nullptr;
  size_t size_ = 0;
  Guarded* guard_ = nullptr;
};

class Edge0QmmAt : public edge0_binding::CpuPrimitive {
 public:
  // maps: the files holding the weight, the scales and the biases (one file or several shards)
  Edge0QmmAt(mx::Stream s, std::array<std::shared_ptr<Mapping>, 3> maps, int64_t w_off, int64_t s_off,
             int64_t b_off, edge0::ScaleType st, int64_t E, int64_t K, int bits, int group_size, int64_t x_repeat)
      : CpuPrimitive(s), maps_(std::move(maps)), w_off_(w_off), s_off_(s_off), b_off_(b_off), st_(st),
        E_(E), K_(K), bits_(bits), gs_(group_size), x_repeat_(x_repeat) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = begin(in, out);
    edge0::QmmArgs a;
    a.scale_type = st_;
    a.out = out.data<float>();
    a.B = out.shape(0);
    a.M = out.shape(1);
    a.N = out.shape(2);
    a.K = K_;
    a.E = E_;
    a.x_repeat = x_repeat_;
    a.bits = bits_;
    a.group_size = gs_;
    a.indices_signed = in[1].dtype() == mx::int32;
    a.w = reinterpret_cast<const uint32_t*>(maps_[0]->base() + w_off_);
    a.scales = maps_[1]->base() + s_off_;
    a.biases = maps_[2]->base() + b_off_;
    std::vector<Input> inputs;
    inputs.reserve(in.size());
    for (auto& t : in) inputs.emplace_back(t);
    enc.dispatch([a, inputs = std::move(inputs), keep = maps_]() mutable {
      a.x = static_cast<const float*>(inputs[0].ptr());
      a.indices = inputs[1].ptr();
      const int64_t bad = edge0::qmm(a);
      for (const auto& m : keep)
        if (m->poisoned())
          throw std::runtime_error("edge0: the checkpoint file " + m->path() +
                                   " was truncated while mapped: its experts past the new end read as nothing");
      check_indices(a, bad);
    });
  }

  const char* name() const override { return "Edge0QuantizedMatmulAt"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Edge0QmmAt&>(other);
    return maps_ == o.maps_ && w_off_ == o.w_off_ && s_off_ == o.s_off_ && b_off_ == o.b_off_ && st_ == o.st_ &&
           E_ == o.E_ && K_ == o.K_ && bits_ == o.bits_ && gs_ == o.gs_ && x_repeat_ == o.x_repeat_;
  }

 private:
  std::array<std::shared_ptr<Mapping>, 3> maps_;
  int64_t w_off_, s_off_, b_off_;
  edge0::ScaleType st_;
  int64_t E_, K_;
  int bits_, gs_;
  int64_t x_repeat_;
};

// One routed-expert block (mlx-lm's SwitchGLU) in one op: for each row t and each of its k
// experts e, h = act(x_t W_gate[e]^T, x_t W_up[e]^T), y = h W_down[e]^T, out [T * k, D].
// The three products are qmm's (rows grouped by expert inside, so no sort and no unsort
// of the rows as SwitchGLU does from 64 pairs), the activation a loop between them; a row's
// result is the same as the three calls' on the same rows but for the activation's exp.
// Each stack is read from arrays (inputs after x and the indices) or from file mappings.
struct Stack {
  bool mapped = false;
  std::array<std::shared_ptr<Mapping>, 3> maps;  // mapped: the weight's, scales' and biases' files
  std::array<int64_t, 3> offs{};
  edge0::ScaleType st = edge0::ScaleType::F32;
  int64_t E = 0, N = 0;
  int bits = 4, gs = 64;
};

edge0::ScaleType scale_type(const mx::array& s) {
  return s.dtype() == mx::float32 ? edge0::ScaleType::F32
         : s.dtype() == mx::bfloat16 ? edge0::ScaleType::BF16 : edge0::ScaleType::F16;
}

// The gated activations of mlx-lm's SwitchGLU blocks, h = act(g, u) of the gate's and the up
// projection's outputs, in float32 (a, b: the activation's parameters):
//   swiglu            silu(g) u                                     SwiGLU, PreciseSwiGLU
//   geglu_tanh        gelu_approx(g) u (the tanh form)              GeGLU
//   swiglu_clamp_in   silu(min(g, a)) clip(u, -a, a)                DeepSeek-V4.1's, a > 0
//   swiglu_clamp_out  min(silu(g), a) clip(u, -a, a)                Step-3.5's ClampedSwiGLU
//   swiglu_oai        g' sigmoid(a g') (clip(u, -b, b) + 1),
//                     g' = min(g, b)                                SwigluOAI (a = alpha, b = limit)
//   situ              a tanh(g / a) sigmoid(g) u', u' = b tanh(u / b)
//                     where b > 0, else u                           SiTU (a = beta, b = linear beta)
// and those of its SwitchMLP blocks (two projections, fc1 and fc2), h = act(g) of fc1's g:
//   relu2             max(g, 0)^2                                   ReLU2
//   gelu              g (1 + erf(g / sqrt 2)) / 2                   GELU (approx "none")
//   gelu_tanh         gelu_approx(g), the tanh form                 GELU (approx "precise", "tanh")
enum class Act : int { SwiGLU = 0, GeGLUTanh, SwiGLUClampIn, SwiGLUClampOut, SwiGLUOAI, SiTU, ReLU2, GELU, GELUTanh };

inline bool gated(Act a) { return a != Act::ReLU2 && a != Act::GELU && a != Act::GELUTanh; }

inline float gelu_tanh(float g) {
  const float c = std::sqrt(2.0f / 3.14159265358979323846f);
  return 0.5f * g * (1.0f + std::tanh(c * (g + 0.044715f * g * g * g)));
}

struct ActSpec {
  Act act = Act::SwiGLU;
  float a = 0.f, b = 0.f;
  bool operator==(const ActSpec& o) const { return act == o.act && a == o.a && b == o.b; }
};

ActSpec parse_act(const std::string& name, const std::vector<double>& params) {
  static const std::vector<std::pair<std::string, std::pair<Act, size_t>>> known = {
      {"swiglu", {Act::SwiGLU, 0}},          {"geglu_tanh", {Act::GeGLUTanh, 0}},
      {"swiglu_clamp_in", {Act::SwiGLUClampIn, 1}}, {"swiglu_clamp_out", {Act::SwiGLUClampOut, 1}},
      {"swiglu_oai", {Act::SwiGLUOAI, 2}},   {"situ", {Act::SiTU, 2}},
      {"relu2", {Act::ReLU2, 0}},            {"gelu", {Act::GELU, 0}},
      {"gelu_tanh", {Act::GELUTanh, 0}}};
  std::string names;
  for (const auto& [n, how] : known) {
    if (n == name) {
      if (params.size() != how.second)
        bad("the activation " + name + " takes " + std::to_string(how.second) + " parameters, got " +
            std::to_string(params.size()));
      for (double p : params)
        if (!std::isfinite(p)) bad("the activation " + name + "'s parameters must be finite");
      ActSpec spec{how.first, params.size() > 0 ? float(params[0]) : 0.f, params.size() > 1 ? float(params[1]) : 0.f};
      if ((spec.act == Act::SwiGLUClampIn || spec.act == Act::SwiGLUClampOut || spec.act == Act::SwiGLUOAI) &&
          (spec.act == Act::SwiGLUOAI ? spec.b : spec.a) <= 0.f)
        bad("the activation " + name + "'s limit must be > 0");
      if (spec.act == Act::SiTU && spec.a <= 0.f) bad("the activation situ's beta must be > 0");
      return spec;
    }
    names += (names.empty() ? "" : ", ") + n;
  }
  bad("the experts' activation must be one of " + names + ", got '" + name + "'");
  return {};
}

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// gate[i] = act(gate[i], up[i]) over n values (up: nullptr where the activation is not gated)
void activate(const ActSpec& s, float* gate, const float* up, size_t n) {
  const float a = s.a, b = s.b;
  switch (s.act) {
    case Act::SwiGLU:
      for (size_t i = 0; i < n; ++i) gate[i] = gate[i] * sigmoid(gate[i]) * up[i];
      break;
    case Act::GeGLUTanh:
      for (size_t i = 0; i < n; ++i) gate[i] = gelu_tanh(gate[i]) * up[i];
      break;
    case Act::SwiGLUClampIn:
      for (size_t i = 0; i < n; ++i) {
        const float g = std::min(gate[i], a);
        gate[i] = g * sigmoid(g) * std::clamp(up[i], -a, a);
      }
      break;
    case Act::SwiGLUClampOut:
      for (size_t i = 0; i < n; ++i) gate[i] = std::min(gate[i] * sigmoid(gate[i]), a) * std::clamp(up[i], -a, a);
      break;
    case Act::SwiGLUOAI:
      for (size_t i = 0; i < n; ++i) {
        const float g = std::min(gate[i], b);
        gate[i] = g * sigmoid(a * g) * (std::clamp(up[i], -b, b) + 1.0f);
      }
      break;
    case Act::SiTU:
      for (size_t i = 0; i < n; ++i) {
        const float g = gate[i], u = b > 0.f ? b * std::tanh(up[i] / b) : up[i];
        gate[i] = a * std::tanh(g / a) * sigmoid(g) * u;
      }
      break;
    case Act::ReLU2:
      for (size_t i = 0; i < n; ++i) gate[i] = gate[i] > 0.f ? gate[i] * gate[i] : 0.f;
      break;
    case Act::GELU:
      for (size_t i = 0; i < n; ++i) gate[i] = gate[i] * (1.0f + std::erf(gate[i] / std::sqrt(2.0f))) / 2.0f;
      break;
    case Act::GELUTanh:
      for (size_t i = 0; i < n; ++i) gate[i] = gelu_tanh(gate[i]);
      break;
  }
}

class Edge0Experts : public edge0_binding::CpuPrimitive {
 public:
  Edge0Experts(mx::Stream s, std::vector<Stack> stacks, int64_t k, ActSpec act)
      : CpuPrimitive(s), stacks_(std::move(stacks)), k_(k), act_(act) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = begin(in, out);
    const int64_t T = in[0].shape(0), D = in[0].shape(1), I = stacks_[0].N, k = k_;
    const int n = int(stacks_.size());  // 3: gate, up, down; 2: fc1, fc2
    std::vector<edge0::QmmArgs> args(n);
    for (int j = 0; j < n; ++j) {
      auto& a = args[j];
      const Stack& st = stacks_[j];
      const bool first = j < n - 1;  // takes x (gate, up; fc1), else the activation (down; fc2)
      a.B = T * k, a.M = 1, a.N = st.N, a.K = first ? D : I, a.E = st.E;
      a.x_repeat = first ? k : 1;
      a.bits = st.bits, a.group_size = st.gs, a.scale_type = st.st;
      a.indices_signed = in[1].dtype() == mx::int32;
      if (st.mapped) {
        a.w = reinterpret_cast<const uint32_t*>(st.maps[0]->base() + st.offs[0]);
        a.scales = st.maps[1]->base() + st.offs[1];
        a.biases = st.maps[2]->base() + st.offs[2];
      } else {
        a.scale_type = scale_type(in[2 + 3 * j + 1]);
      }
    }
    std::vector<Input> inputs;
    inputs.reserve(in.size());
    for (auto& t : in) inputs.emplace_back(t);
    float* o = out.data<float>();
    enc.dispatch([args, inputs = std::move(inputs), stacks = stacks_, act = act_, o, T, I, k, n]() mutable {
      const float* x = static_cast<const float*>(inputs[0].ptr());
      const void* idx = inputs[1].ptr();
      for (int j = 0; j < n; ++j) {
        args[j].indices = idx;
        if (!stacks[j].mapped) {
          args[j].w = static_cast<const uint32_t*>(inputs[2 + 3 * j].ptr());
          args[j].scales = inputs[2 + 3 * j + 1].ptr();
          args[j].biases = inputs[2 + 3 * j + 2].ptr();
        }
      }
      std::vector<float> gate(size_t(T * k * I)), up(n == 3 ? size_t(T * k * I) : 0);
      args[0].x = x, args[0].out = gate.data();
      check_indices(args[0], edge0::qmm(args[0]));
      if (n == 3) {
        args[1].x = x, args[1].out = up.data();
        check_indices(args[1], edge0::qmm(args[1]));
      }
      activate(act, gate.data(), n == 3 ? up.data() : nullptr, gate.size());
      args[n - 1].x = gate.data(), args[n - 1].out = o;
      check_indices(args[n - 1], edge0::qmm(args[n - 1]));
      for (const auto& st : stacks)
        for (const auto& m : st.maps)
          if (m && m->poisoned())
            throw std::runtime_error("edge0: the checkpoint file " + m->path() +
                                     " was truncated while mapped: its experts past the new end read as nothing");
    });
  }

  const char* name() const override { return "Edge0Experts"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Edge0Experts&>(other);
    if (stacks_.size() != o.stacks_.size()) return false;
    for (size_t j = 0; j < stacks_.size(); ++j) {
      const Stack &a = stacks_[j], &b = o.stacks_[j];
      if (a.mapped != b.mapped || a.maps != b.maps || a.offs != b.offs || a.st != b.st || a.E != b.E ||
          a.N != b.N || a.bits != b.bits || a.gs != b.gs)
        return false;
    }
    return k_ == o.k_ && act_ == o.act_;
  }

 private:
  std::vector<Stack> stacks_;
  int64_t k_;
  ActSpec act_;
};

// edge0_wait(x, flags, index, value, timeout_s, waited) -> x, once flags[index] == value.
// A staged layer's input passes through it, so everything the layer computes waits where
// its data is consumed, inside the step's one graph, not in the thread that built it: the
// reader that fills the layer's slots stores `value` (or -value: the reads failed) in the
// flag. The wait spins briefly, then sleeps in short naps; `waited[index]` accumulates the
// nanoseconds it waited. Past `timeout_s` it raises, as -value does (at evaluation).
class Edge0Wait : public edge0_binding::CpuPrimitive {
 public:
  Edge0Wait(mx::Stream s, int64_t index, int32_t value, double timeout_s)
      : CpuPrimitive(s), index_(index), value_(value), timeout_s_(timeout_s) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = begin(in, out, false);
    out.copy_shared_buffer(in[0]);
    auto* flag = const_cast<int32_t*>(in[1].data<int32_t>()) + index_;
    auto* waited = const_cast<int64_t*>(in[2].data<int64_t>()) + index_;
    enc.dispatch([flag, waited, value = value_, timeout = timeout_s_, index = index_]() {
      std::atomic_ref<int32_t> f(*flag);
      if (f.load(std::memory_order_acquire) == value) return;
      const auto t0 = std::chrono::steady_clock::now();
      for (int spins = 0;; ++spins) {
        const int32_t v = f.load(std::memory_order_acquire);
        const auto dt = std::chrono::steady_clock::now() - t0;
        if (v == value || v == -value) {
          std::atomic_ref<int64_t>(*waited).fetch_add(
              std::chrono::duration_cast<std::chrono::nanoseconds>(dt).count(), std::memory_order_relaxed);
          if (v == value) return;
          throw std::runtime_error("edge0: the slots of staged layer #" + std::to_string(index) +
                                   " failed to load (step ticket " + std::to_string(value) + ")");
        }
        if (std::chrono::duration<double>(dt).count() > timeout)
          throw std::runtime_error("edge0: the slots of staged layer #" + std::to_string(index) +
                                   " were not ready after " + std::to_string(timeout) + " s");
        if (spins < 64)
          std::this_thread::yield();
        else
          std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    });
  }

  const char* name() const override { return "Edge0SlotWait"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Edge0Wait&>(other);
    return index_ == o.index_ && value_ == o.value_;
  }

 private:
  int64_t index_;
  int32_t value_;
  double timeout_s_;
};


void check_layout(int bits, int group_size) {
  if (bits != 4 && bits != 8) bad("bits must be 4 or 8, got " + std::to_string(bits));
  if (group_size != 32 && group_size != 64 && group_size != 128)
    bad("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
}

// A weight stack (w, scales, biases) a product over rows of width K reads: its N (output
// rows) and E (experts; 1 dense), or a ValueError naming what does not fit.
std::pair<int64_t, int64_t> check_stack(const mx::array& w, const mx::array& scales, const mx::array& biases,
                                        int64_t K, int bits, int group_size, bool dense) {
  check_layout(bits, group_size);
  const int wd = dense ? 2 : 3;
  if (w.dtype() != mx::uint32 || w.ndim() != wd)
    bad("the weight must be uint32 of " + std::to_string(wd) + " dimensions, got shape " + shape_str(w));
  if (scales.dtype() != biases.dtype() ||
      (scales.dtype() != mx::float32 && scales.dtype() != mx::bfloat16 && scales.dtype() != mx::float16))
    bad("scales and biases must share one dtype of float32, bfloat16, float16");
  if (K % group_size != 0)
    bad("K = " + std::to_string(K) + " is not a multiple of group_size " + std::to_string(group_size));
  const int64_t words = w.shape(-1);
  if (words * 32 / bits != K)
    bad("the weight's last axis holds " + std::to_string(words * 32 / bits) + " values of " +
        std::to_string(bits) + " bits, x has K = " + std::to_string(K));
  const int64_t N = w.shape(-2), E = dense ? 1 : w.shape(0);
  mx::Shape gshape = dense ? mx::Shape{int(N), int(K / group_size)} : mx::Shape{int(E), int(N), int(K / group_size)};
  if (scales.shape() != gshape || biases.shape() != gshape)
    bad("scales " + shape_str(scales) + " and biases " + shape_str(biases) + " must both be " +
        (dense ? "[N, K / group_size]" : "[E, N, K / group_size]") + " for the weight " + shape_str(w));
  return {N, E};
}

void check_indices_shape(const mx::array& idx, int64_t B, const std::string& what) {
  if (idx.ndim() != 1 || (idx.dtype() != mx::int32 && idx.dtype() != mx::uint32))
    bad("indices must be a 1-D int32 or uint32 array, got shape " + shape_str(idx));
  if (idx.shape(0) != B) bad("indices hold " + std::to_string(idx.shape(0)) + " entries, " + what);
}

std::string batch_str(const mx::array& x, int64_t x_repeat) {
  return "x's batch " + std::to_string(x.shape(0)) + " x x_repeat " + std::to_string(x_repeat) + " = " +
         std::to_string(x.shape(0) * x_repeat);
}

mx::array qmm_op(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                 std::optional<mx::array> indices, int bits, int group_size, int64_t x_repeat) {
  auto stream = cpu_stream();
  check_layout(bits, group_size);
  if (x.dtype() != mx::float32) bad("x must be float32");
  if (x.ndim() != 3) bad("x must be [batch, rows, K], got shape " + shape_str(x));
  const bool dense = !indices.has_value();
  const int64_t N = check_stack(w, scales, biases, x.shape(2), bits, group_size, dense).first;
  if (x_repeat < 1) bad("x_repeat must be >= 1");
  int64_t B = x.shape(0) * x_repeat;
  std::vector<mx::array> inputs = {x, w, scales, biases};
  if (!dense) {
    check_indices_shape(*indices, B, batch_str(x, x_repeat));
    inputs.push_back(*indices);
  } else if (x_repeat != 1) {
    bad("x_repeat must be 1 without indices");
  }
  return mx::array(mx::Shape{int(B), int(x.shape(1)), int(N)}, mx::float32,
                   std::make_shared<Edge0Qmm>(stream, bits, group_size, x_repeat, dense), std::move(inputs));
}

// A stack held by file mappings: its scales' type, or a ValueError naming what does not fit
// (a range past a file's end, a dtype the kernels do not read).
edge0::ScaleType check_mapped(const std::array<std::shared_ptr<Mapping>, 3>& maps,
                              const std::array<int64_t, 3>& offs, const std::string& scale_dtype, int64_t E,
                              int64_t N, int64_t K, int bits, int group_size) {
  if (!maps[0] || !maps[1] || !maps[2]) bad("no mapping");
  check_layout(bits, group_size);
  if (K % group_size != 0)
    bad("K = " + std::to_string(K) + " is not a multiple of group_size " + std::to_string(group_size));
  if (E < 1 || N < 1) bad("E and N must be positive");
  edge0::ScaleType st;
  int64_t ssize;
  if (scale_dtype == "F32") {
    st = edge0::ScaleType::F32, ssize = 4;
  } else if (scale_dtype == "BF16") {
    st = edge0::ScaleType::BF16, ssize = 2;
  } else if (scale_dtype == "F16") {
    st = edge0::ScaleType::F16, ssize = 2;
  } else {
    bad("scales must be F32, BF16 or F16, got " + scale_dtype);
  }
  const int64_t wbytes = E * N * (K * bits / 8), gbytes = E * N * (K / group_size) * ssize;
  auto inside = [&](const Mapping& m, int64_t off, int64_t n, const char* what) {
    const int64_t size = int64_t(m.size());
    if (off < 0 || off + n > size)
      bad(std::string(what) + ": " + std::to_string(n) + " bytes at byte " + std::to_string(off) +
          ", past the end of " + m.path() + " (" + std::to_string(size) + " bytes)");
  };
  inside(*maps[0], offs[0], wbytes, "the weight");
  inside(*maps[1], offs[1], gbytes, "the scales");
  inside(*maps[2], offs[2], gbytes, "the biases");
  return st;
}

mx::array qmm_at_op(const mx::array& x, const mx::array& indices, std::shared_ptr<Mapping> w_map, int64_t w_off,
                    std::shared_ptr<Mapping> s_map, int64_t s_off, std::shared_ptr<Mapping> b_map, int64_t b_off,
                    const std::string& scale_dtype, int64_t E, int64_t N, int bits, int group_size,
                    int64_t x_repeat) {
  auto stream = cpu_stream();
  if (x.dtype() != mx::float32) bad("x must be float32");
  if (x.ndim() != 3) bad("x must be [batch, rows, K], got shape " + shape_str(x));
  const int64_t K = x.shape(2);
  const std::array<std::shared_ptr<Mapping>, 3> maps{w_map, s_map, b_map};
  const auto st = check_mapped(maps, {w_off, s_off, b_off}, scale_dtype, E, N, K, bits, group_size);
  if (x_repeat < 1) bad("x_repeat must be >= 1");
  const int64_t B = x.shape(0) * x_repeat;
  check_indices_shape(indices, B, batch_str(x, x_repeat));
  return mx::array(mx::Shape{int(B), int(x.shape(1)), int(N)}, mx::float32,
                   std::make_shared<Edge0QmmAt>(stream, maps, w_off, s_off, b_off, st, E, K, bits, group_size,
                                                x_repeat),
                   {x, indices});
}

// x [T, D] float32, indices [T * k]; stacks: gate, up, down (their N: I, I, D) for a gated
// activation, fc1, fc2 (I, D) for another
void check_experts(const mx::array& x, const mx::array& indices, int64_t k, const std::vector<int64_t>& N,
                   const std::vector<int64_t>& E) {
  if (x.dtype() != mx::float32 || x.ndim() != 2) bad("x must be float32 [rows, D], got shape " + shape_str(x));
  if (k < 1) bad("k must be >= 1");
  check_indices_shape(indices, x.shape(0) * k, "x's rows " + std::to_string(x.shape(0)) + " x k " +
                                                   std::to_string(k) + " = " + std::to_string(x.shape(0) * k));
  const size_t n = N.size();
  if ((n == 3 && N[0] != N[1]) || N[n - 1] != x.shape(1))
    bad(n == 3 ? "the stacks do not chain: gate and up give " + std::to_string(N[0]) + " and " +
                     std::to_string(N[1]) + " values, down gives " + std::to_string(N[2]) + " for x of width " +
                     std::to_string(x.shape(1))
               : "the stacks do not chain: fc2 gives " + std::to_string(N[1]) + " values for x of width " +
                     std::to_string(x.shape(1)));
  for (size_t j = 1; j < n; ++j)
    if (E[j] != E[0]) bad("the stacks must hold as many experts");
}

// how many stacks an activation takes: 3 (gate, up, down) where it is gated, else 2 (fc1, fc2)
size_t stacks_for(const ActSpec& spec, size_t given, const std::string& what) {
  const size_t n = gated(spec.act) ? 3 : 2;
  if (given != n)
    bad(what + ": the activation takes " + std::to_string(n) + " stacks (" +
        (n == 3 ? "gate, up, down" : "fc1, fc2") + "), got " + std::to_string(given));
  return n;
}

mx::array experts_op(const mx::array& x, const mx::array& indices, int64_t k, const std::vector<mx::array>& stacks,
                     const std::vector<int>& bits, const std::vector<int>& group_sizes, const std::string& act,
                     const std::vector<double>& act_params) {
  auto stream = cpu_stream();
  const ActSpec spec = parse_act(act, act_params);
  if (stacks.size() % 3 || bits.size() != stacks.size() / 3 || group_sizes.size() != stacks.size() / 3)
    bad("experts takes 3 arrays a stack (weight, scales, biases) and a bits and group size each");
  const size_t n = stacks_for(spec, stacks.size() / 3, "experts");
  if (x.ndim() != 2) bad("x must be float32 [rows, D], got shape " + shape_str(x));
  std::vector<Stack> st(n);
  std::vector<int64_t> N(n), E(n);
  for (size_t j = 0; j < n; ++j) {
    const int64_t K = j < n - 1 ? x.shape(1) : N[0];
    std::tie(N[j], E[j]) = check_stack(stacks[3 * j], stacks[3 * j + 1], stacks[3 * j + 2], K, bits[j],
                                       group_sizes[j], false);
    st[j].E = E[j], st[j].N = N[j], st[j].bits = bits[j], st[j].gs = group_sizes[j];
  }
  check_experts(x, indices, k, N, E);
  std::vector<mx::array> inputs{x, indices};
  inputs.insert(inputs.end(), stacks.begin(), stacks.end());
  return mx::array(mx::Shape{int(x.shape(0) * k), int(x.shape(1))}, mx::float32,
                   std::make_shared<Edge0Experts>(stream, st, k, spec), std::move(inputs));
}

// the same over file mappings: maps and offsets 3 a stack (weight, scales, biases)
mx::array experts_at_op(const mx::array& x, const mx::array& indices, int64_t k,
                        const std::vector<std::shared_ptr<Mapping>>& maps, const std::vector<int64_t>& offsets,
                        const std::vector<std::string>& scale_dtypes, const std::vector<int64_t>& experts,
                        const std::vector<int64_t>& outputs, const std::vector<int>& bits,
                        const std::vector<int>& group_sizes, const std::string& act,
                        const std::vector<double>& act_params) {
  auto stream = cpu_stream();
  const ActSpec spec = parse_act(act, act_params);
  const size_t n = scale_dtypes.size();
  if (maps.size() != 3 * n || offsets.size() != 3 * n || experts.size() != n || outputs.size() != n ||
      bits.size() != n || group_sizes.size() != n)
    bad("experts_at takes 3 mappings and offsets a stack and one of everything else a stack");
  stacks_for(spec, n, "experts_at");
  if (x.ndim() != 2) bad("x must be float32 [rows, D], got shape " + shape_str(x));
  std::vector<Stack> st(n);
  std::vector<int64_t> N(n), E(n);
  for (size_t j = 0; j < n; ++j) {
    st[j].mapped = true;
    st[j].maps = {maps[3 * j], maps[3 * j + 1], maps[3 * j + 2]};
    st[j].offs = {offsets[3 * j], offsets[3 * j + 1], offsets[3 * j + 2]};
    N[j] = outputs[j], E[j] = experts[j];
    const int64_t K = j < n - 1 ? x.shape(1) : N[0];
    st[j].st = check_mapped(st[j].maps, st[j].offs, scale_dtypes[j], E[j], N[j], K, bits[j], group_sizes[j]);
    st[j].E = E[j], st[j].N = N[j], st[j].bits = bits[j], st[j].gs = group_sizes[j];
  }
  check_experts(x, indices, k, N, E);
  return mx::array(mx::Shape{int(x.shape(0) * k), int(x.shape(1))}, mx::float32,
                   std::make_shared<Edge0Experts>(stream, st, k, spec), {x, indices});
}

mx::array wait_op(const mx::array& x, const mx::array& flags, const mx::array& waited, int64_t index,
                  int32_t value, double timeout_s) {
  auto stream = cpu_stream();
  if (flags.dtype() != mx::int32 || flags.ndim() != 1 || !flags.is_available() || !flags.flags().row_contiguous)
    bad("flags must be an evaluated, contiguous 1-D int32 array");
  if (waited.dtype() != mx::int64 || waited.shape() != flags.shape() || !waited.is_available() ||
      !waited.flags().row_contiguous)
    bad("waited must be an evaluated, contiguous int64 array shaped as flags");
  if (index < 0 || index >= flags.shape(0)) bad("the flag index " + std::to_string(index) + " is out of range");
  if (value <= 0) bad("the awaited value must be positive");
  return mx::array(x.shape(), x.dtype(), std::make_shared<Edge0Wait>(stream, index, value, timeout_s),
                   {x, flags, waited});
}

}  // namespace

mx::array attention_op(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
                       const std::optional<mx::array>& mask) {
  auto stream = cpu_stream();
  for (const auto* t : {&q, &k, &v})
    if (t->dtype() != mx::float32 || t->ndim() != 4)
      bad("q, k and v must be float32 [batch, heads, positions, head_dim], got shape " + shape_str(*t));
  if (k.shape() != v.shape()) bad("k " + shape_str(k) + " and v " + shape_str(v) + " must have one shape");
  if (k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) || k.shape(1) < 1 || q.shape(1) % k.shape(1) != 0)
    bad("k " + shape_str(k) + " does not serve q " + shape_str(q) +
        ": the same batch and head_dim, q's heads a multiple of k's");
  if (causal && k.shape(2) < q.shape(2))
    bad("causal attention needs at least as many keys as queries, got " + std::to_string(k.shape(2)) + " keys for " +
        std::to_string(q.shape(2)) + " queries");
  std::vector<mx::array> inputs{q, k, v};
  if (mask) {
    const auto& m = *mask;
    const auto fits = [&](int d, int64_t n) { return m.shape(d) == 1 || m.shape(d) == n; };
    if (m.dtype() != mx::bool_ || m.ndim() != 4 || m.shape(3) != k.shape(2) || !fits(0, q.shape(0)) ||
        !fits(1, q.shape(1)) || !fits(2, q.shape(2)))
      bad("the mask must be boolean [batch or 1, heads or 1, queries or 1, keys] for q " + shape_str(q) + " and k " +
          shape_str(k) + ", got " + std::string(m.dtype() == mx::bool_ ? "" : "a non-boolean ") + shape_str(m));
    inputs.push_back(m);
  }
  return mx::array(q.shape(), mx::float32, std::make_shared<Edge0Attention>(stream, scale, causal), std::move(inputs));
}

NB_MODULE(_ext, m) {
  m.doc() = "Edge0's CPU kernels for MLX's affine quantized layout (edge0.kernels wraps them).";
  m.def("qmm", &qmm_op, "x"_a, "w"_a, "scales"_a, "biases"_a, "indices"_a.none(), "bits"_a, "group_size"_a,
        "x_repeat"_a = 1);
  m.def(
      "stream_bytes",
      [](const std::vector<mx::array>& arrays, const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes,
         const std::vector<int>& which) {
        // byte range i: `sizes[i]` bytes at byte `starts[i]` of arrays[which[i]] (evaluated)
        std::vector<const char*> ptrs;
        for (size_t i = 0; i < starts.size(); ++i) {
          auto& a = arrays.at(which.at(i));
          if (starts[i] < 0 || sizes.at(i) < 0 || size_t(starts[i] + sizes[i]) > a.nbytes())
            throw std::out_of_range("edge0 kernels: a byte range runs past its array");
          ptrs.push_back(static_cast<const char*>(a.data<void>()) + starts[i]);
        }
        nb::gil_scoped_release release;
        return edge0::stream_bytes(ptrs.data(), sizes.data(), int64_t(ptrs.size()));
      },
      "arrays"_a, "starts"_a, "sizes"_a, "which"_a);
  nb::class_<Mapping>(m, "Mapping")
      .def(nb::init<const std::string&>(), "path"_a)
      .def_prop_ro("size", &Mapping::size)
      .def_prop_ro("address", [](const Mapping& m) { return reinterpret_cast<uintptr_t>(m.base()); })
      .def("resident", &Mapping::resident)
      .def("populate", &Mapping::populate, "offset"_a, "length"_a, nb::call_guard<nb::gil_scoped_release>());
  m.def("qmm_at", &qmm_at_op, "x"_a, "indices"_a, "w_mapping"_a, "w_offset"_a, "s_mapping"_a, "s_offset"_a,
        "b_mapping"_a, "b_offset"_a, "scale_dtype"_a, "E"_a, "N"_a, "bits"_a, "group_size"_a, "x_repeat"_a = 1);
  m.def("wait_flag", &wait_op, "x"_a, "flags"_a, "waited"_a, "index"_a, "value"_a, "timeout_s"_a);
  m.def("evaluated", [](const mx::array& a) { return a.is_available(); }, "a"_a);
  m.def("attention", &attention_op, "q"_a, "k"_a, "v"_a, "scale"_a, "causal"_a, "mask"_a = nb::none());
  m.def("experts", &experts_op, "x"_a, "indices"_a, "k"_a, "stacks"_a, "bits"_a, "group_sizes"_a, "activation"_a,
        "activation_params"_a = std::vector<double>{});
  m.def("experts_at", &experts_at_op, "x"_a, "indices"_a, "k"_a, "maps"_a, "offsets"_a, "scale_dtypes"_a,
        "experts"_a, "outputs"_a, "bits"_a, "group_sizes"_a, "activation"_a,
        "activation_params"_a = std::vector<double>{});
  bind_layer_ops(m);
  bind_reads(m);
  m.def("set_threads", &edge0::set_threads, "n"_a);
  m.def("get_threads", &edge0::get_threads);
  m.def("isa", []() { return std::string(edge0::isa()); });
  m.def("set_int8_products", &edge0::set_int8_products, "on"_a);
  m.def("int8_products", &edge0::int8_products);
  m.def(
      "limit_isa",
      [](const std::string& name) {
        if (!edge0::limit_isa(name.c_str()))
          throw std::invalid_argument("edge0 kernels: isa must be avx512, avx2 or portable, got '" + name + "'");
      },
      "name"_a);
  m.def("mlx_version", []() {
    return std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) + "." +
           std::to_string(MLX_VERSION_PATCH);
  });
}
