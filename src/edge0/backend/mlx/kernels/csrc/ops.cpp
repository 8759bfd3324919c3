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

#include <array>
#include <atomic>
#include <chrono>
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

class Edge0Qmm : public mx::UnaryPrimitive {
 public:
  Edge0Qmm(mx::Stream s, int bits, int group_size, int64_t x_repeat, bool dense)
      : mx::UnaryPrimitive(s), bits_(bits), gs_(group_size), x_repeat_(x_repeat), dense_(dense) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
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

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("edge0 kernels run on the CPU device only");
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
class Edge0Attention : public mx::UnaryPrimitive {
 public:
  Edge0Attention(mx::Stream s, float scale, bool causal) : mx::UnaryPrimitive(s), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
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
    std::vector<Input> inputs;
    inputs.reserve(in.size());
    for (auto& t : in) inputs.emplace_back(t);
    enc.dispatch([a, inputs = std::move(inputs)]() mutable {
      a.q = static_cast<const float*>(inputs[0].ptr());
      a.k = static_cast<const float*>(inputs[1].ptr());
      a.v = static_cast<const float*>(inputs[2].ptr());
      edge0::attention(a);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("edge0 kernels run on the CPU device only");
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

class Edge0QmmAt : public mx::UnaryPrimitive {
 public:
  // maps: the files holding the weight, the scales and the biases (one file or several shards)
  Edge0QmmAt(mx::Stream s, std::array<std::shared_ptr<Mapping>, 3> maps, int64_t w_off, int64_t s_off,
             int64_t b_off, edge0::ScaleType st, int64_t E, int64_t K, int bits, int group_size, int64_t x_repeat)
      : mx::UnaryPrimitive(s), maps_(std::move(maps)), w_off_(w_off), s_off_(s_off), b_off_(b_off), st_(st),
        E_(E), K_(K), bits_(bits), gs_(group_size), x_repeat_(x_repeat) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
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

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("edge0 kernels run on the CPU device only");
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

// edge0_wait(x, flags, index, value, timeout_s, waited) -> x, once flags[index] == value.
// A staged layer's input passes through it, so everything the layer computes waits where
// its data is consumed, inside the step's one graph, not in the thread that built it: the
// reader that fills the layer's slots stores `value` (or -value: the reads failed) in the
// flag. The wait spins briefly, then sleeps in short naps; `waited[index]` accumulates the
// nanoseconds it waited. Past `timeout_s` it raises, as -value does (at evaluation).
class Edge0Wait : public mx::UnaryPrimitive {
 public:
  Edge0Wait(mx::Stream s, int64_t index, int32_t value, double timeout_s)
      : mx::UnaryPrimitive(s), index_(index), value_(value), timeout_s_(timeout_s) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
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

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("edge0's slot wait runs on the CPU device only");
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

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument("edge0 kernels: " + what); }

std::string shape_str(const mx::array& a) {
  std::ostringstream s;
  s << "(";
  for (int i = 0; i < a.ndim(); ++i) s << (i ? ", " : "") << a.shape(i);
  s << (a.ndim() == 1 ? ",)" : ")");
  return s.str();
}

mx::array qmm_op(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                 std::optional<mx::array> indices, int bits, int group_size, int64_t x_repeat) {
  auto stream = mx::to_stream({});
  if (stream.device.type != mx::Device::DeviceType::cpu) bad("the default device is not the CPU");
  if (bits != 4 && bits != 8) bad("bits must be 4 or 8, got " + std::to_string(bits));
  if (group_size != 32 && group_size != 64 && group_size != 128)
    bad("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  if (x.dtype() != mx::float32) bad("x must be float32");
  if (x.ndim() != 3) bad("x must be [batch, rows, K], got shape " + shape_str(x));
  const bool dense = !indices.has_value();
  const int wd = dense ? 2 : 3;
  if (w.dtype() != mx::uint32 || w.ndim() != wd)
    bad("the weight must be uint32 of " + std::to_string(wd) + " dimensions, got shape " + shape_str(w));
  if (scales.dtype() != biases.dtype() ||
      (scales.dtype() != mx::float32 && scales.dtype() != mx::bfloat16 && scales.dtype() != mx::float16))
    bad("scales and biases must share one dtype of float32, bfloat16, float16");
  const int64_t K = x.shape(2);
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
  if (x_repeat < 1) bad("x_repeat must be >= 1");
  int64_t B = x.shape(0) * x_repeat;
  std::vector<mx::array> inputs = {x, w, scales, biases};
  if (!dense) {
    const auto& idx = *indices;
    if (idx.ndim() != 1 || (idx.dtype() != mx::int32 && idx.dtype() != mx::uint32))
      bad("indices must be a 1-D int32 or uint32 array, got shape " + shape_str(idx));
    if (idx.shape(0) != B)
      bad("indices hold " + std::to_string(idx.shape(0)) + " entries, x's batch " +
          std::to_string(x.shape(0)) + " x x_repeat " + std::to_string(x_repeat) + " = " + std::to_string(B));
    inputs.push_back(idx);
  } else if (x_repeat != 1) {
    bad("x_repeat must be 1 without indices");
  }
  return mx::array(mx::Shape{int(B), int(x.shape(1)), int(N)}, mx::float32,
                   std::make_shared<Edge0Qmm>(stream, bits, group_size, x_repeat, dense), std::move(inputs));
}

mx::array qmm_at_op(const mx::array& x, const mx::array& indices, std::shared_ptr<Mapping> w_map, int64_t w_off,
                    std::shared_ptr<Mapping> s_map, int64_t s_off, std::shared_ptr<Mapping> b_map, int64_t b_off,
                    const std::string& scale_dtype, int64_t E, int64_t N, int bits, int group_size,
                    int64_t x_repeat) {
  auto stream = mx::to_stream({});
  if (stream.device.type != mx::Device::DeviceType::cpu) bad("the default device is not the CPU");
  if (!w_map || !s_map || !b_map) bad("no mapping");
  if (bits != 4 && bits != 8) bad("bits must be 4 or 8, got " + std::to_string(bits));
  if (group_size != 32 && group_size != 64 && group_size != 128)
    bad("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  if (x.dtype() != mx::float32) bad("x must be float32");
  if (x.ndim() != 3) bad("x must be [batch, rows, K], got shape " + shape_str(x));
  const int64_t K = x.shape(2);
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
  inside(*w_map, w_off, wbytes, "the weight");
  inside(*s_map, s_off, gbytes, "the scales");
  inside(*b_map, b_off, gbytes, "the biases");
  if (x_repeat < 1) bad("x_repeat must be >= 1");
  const int64_t B = x.shape(0) * x_repeat;
  if (indices.ndim() != 1 || (indices.dtype() != mx::int32 && indices.dtype() != mx::uint32))
    bad("indices must be a 1-D int32 or uint32 array, got shape " + shape_str(indices));
  if (indices.shape(0) != B)
    bad("indices hold " + std::to_string(indices.shape(0)) + " entries, x's batch " + std::to_string(x.shape(0)) +
        " x x_repeat " + std::to_string(x_repeat) + " = " + std::to_string(B));
  return mx::array(mx::Shape{int(B), int(x.shape(1)), int(N)}, mx::float32,
                   std::make_shared<Edge0QmmAt>(stream, std::array<std::shared_ptr<Mapping>, 3>{w_map, s_map, b_map},
                                                w_off, s_off, b_off, st, E, K, bits, group_size, x_repeat),
                   {x, indices});
}

mx::array wait_op(const mx::array& x, const mx::array& flags, const mx::array& waited, int64_t index,
                  int32_t value, double timeout_s) {
  auto stream = mx::to_stream({});
  if (stream.device.type != mx::Device::DeviceType::cpu) bad("the default device is not the CPU");
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

mx::array attention_op(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal) {
  auto stream = mx::to_stream({});
  if (stream.device.type != mx::Device::DeviceType::cpu) bad("the default device is not the CPU");
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
  return mx::array(q.shape(), mx::float32, std::make_shared<Edge0Attention>(stream, scale, causal), {q, k, v});
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
      .def("resident", &Mapping::resident);
  m.def("qmm_at", &qmm_at_op, "x"_a, "indices"_a, "w_mapping"_a, "w_offset"_a, "s_mapping"_a, "s_offset"_a,
        "b_mapping"_a, "b_offset"_a, "scale_dtype"_a, "E"_a, "N"_a, "bits"_a, "group_size"_a, "x_repeat"_a = 1);
  m.def("wait_flag", &wait_op, "x"_a, "flags"_a, "waited"_a, "index"_a, "value"_a, "timeout_s"_a);
  m.def("evaluated", [](const mx::array& a) { return a.is_available(); }, "a"_a);
  m.def("attention", &attention_op, "q"_a, "k"_a, "v"_a, "scale"_a, "causal"_a);
  m.def("set_threads", &edge0::set_threads, "n"_a);
  m.def("get_threads", &edge0::get_threads);
  m.def("isa", []() { return std::string(edge0::isa()); });
  m.def("force_portable", &edge0::force_portable, "on"_a);
  m.def("mlx_version", []() {
    return std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) + "." +
           std::to_string(MLX_VERSION_PATCH);
  });
}
