// The small ops of a transformer layer on the CPU, each one primitive: RMS norm and rotary
// position embedding (RoPE).
//
// Why: on MLX's CPU backend mx.fast.rms_norm and mx.fast.rope are compositions of several
// elementwise ops (each dispatched and run on its own), and a decode step runs four norms and
// two ropes a layer on a single row: at 12 layers of a 35B-shaped model they took about a
// quarter of mlx-lm's whole step around Edge0's matmul kernels. Here each is one loop over
// rows, float32 in and out:
//   rms_norm: y = x / sqrt(mean(x^2) + eps) * w, the sum of squares in double, per row;
//   rope:     positions along axis -2 (offset + l; an offset per batch entry, or one),
//             theta_i = position * scale * base^(-2i / dims) (or position * scale / freqs[i]),
//             in double; pairs (x_i, x_{i + dims/2}) rotated (or (x_2i, x_2i+1),
//             traditional); values past `dims` copied.
// A row's result does not depend on the rows beside it or on the thread count (rows are
// dealt to threads whole).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include <cmath>
#include <optional>
#include <vector>

#include "binding.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "qmm.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;
using edge0_binding::bad;
using edge0_binding::shape_str;
using edge0_binding::cpu_stream;

namespace {

// element offsets of a 4-D view [B, H, L, D] (strides in elements, any sign-free layout)
struct View4 {
  int64_t shape[4];
  int64_t strides[4];
};

View4 view4(const mx::array& a) {
  View4 v{};
  const int pad = 4 - a.ndim();
  for (int i = 0; i < 4; ++i) {
    v.shape[i] = i < pad ? 1 : a.shape(i - pad);
    v.strides[i] = i < pad ? 0 : a.strides()[i - pad];
  }
  return v;
}

void rms_norm_rows(const float* x, const View4& xv, const float* w, float eps, float* out) {
  const int64_t D = xv.shape[3], rows = xv.shape[0] * xv.shape[1] * xv.shape[2];
  edge0::parallel_rows(rows >= 16 ? rows : 1, [&](int p, int parts) {
    for (int64_t r = p; r < rows; r += parts) {
      const int64_t l = r % xv.shape[2], h = (r / xv.shape[2]) % xv.shape[1], b = r / (xv.shape[2] * xv.shape[1]);
      const float* xr = x + b * xv.strides[0] + h * xv.strides[1] + l * xv.strides[2];
      const int64_t s = xv.strides[3];
      double ss = 0.0;
      for (int64_t d = 0; d < D; ++d) ss += double(xr[d * s]) * double(xr[d * s]);
      const float inv = float(1.0 / std::sqrt(ss / double(D) + double(eps)));
      float* o = out + r * D;
      for (int64_t d = 0; d < D; ++d) o[d] = xr[d * s] * inv * w[d];
    }
  });
}

struct RopeArgs {
  int dims = 0;
  bool traditional = false;
  float base = 10000.0f, scale = 1.0f;
};

void rope_rows(const float* x, const View4& xv, const int32_t* offsets, int64_t n_offsets, const float* freqs,
               const RopeArgs& a, float* out) {
  const int64_t B = xv.shape[0], H = xv.shape[1], L = xv.shape[2], D = xv.shape[3], half = a.dims / 2;
  // cos and sin of each (batch entry with its own offset, position, pair)
  const int64_t Bo = n_offsets == 1 ? 1 : B;
  std::vector<double> inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    inv[size_t(i)] = freqs != nullptr ? 1.0 / double(freqs[i]) : std::pow(double(a.base), -2.0 * double(i) / a.dims);
  std::vector<float> cs(size_t(Bo * L * half)), sn(size_t(Bo * L * half));
  for (int64_t b = 0; b < Bo; ++b)
    for (int64_t l = 0; l < L; ++l)
      for (int64_t i = 0; i < half; ++i) {
        const double theta = (double(offsets[b]) + double(l)) * double(a.scale) * inv[size_t(i)];
        cs[size_t((b * L + l) * half + i)] = float(std::cos(theta));
        sn[size_t((b * L + l) * half + i)] = float(std::sin(theta));
      }
  const int64_t rows = B * H * L;
  edge0::parallel_rows(rows >= 64 ? rows : 1, [&](int p, int parts) {
    for (int64_t r = p; r < rows; r += parts) {
      const int64_t l = r % L, h = (r / L) % H, b = r / (L * H);
      const float* xr = x + b * xv.strides[0] + h * xv.strides[1] + l * xv.strides[2];
      const int64_t s = xv.strides[3];
      const float* c = cs.data() + ((Bo == 1 ? 0 : b) * L + l) * half;
      const float* sv = sn.data() + ((Bo == 1 ? 0 : b) * L + l) * half;
      float* o = out + r * D;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t i1 = a.traditional ? 2 * i : i, i2 = a.traditional ? 2 * i + 1 : i + half;
        const float x1 = xr[i1 * s], x2 = xr[i2 * s];
        o[i1] = x1 * c[i] - x2 * sv[i];
        o[i2] = x1 * sv[i] + x2 * c[i];
      }
      for (int64_t d = a.dims; d < D; ++d) o[d] = xr[d * s];
    }
  });
}

class Edge0RmsNorm : public edge0_binding::CpuPrimitive {
 public:
  Edge0RmsNorm(mx::Stream s, float eps) : CpuPrimitive(s), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = begin(in, out);
    const View4 xv = view4(in[0]);
    const float* x = in[0].data<float>();
    const float* w = in[1].data<float>();
    float* o = out.data<float>();
    const float eps = eps_;
    enc.dispatch([=]() { rms_norm_rows(x, xv, w, eps, o); });
  }
  const char* name() const override { return "Edge0RmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const Edge0RmsNorm&>(other).eps_;
  }

 private:
  float eps_;
};

class Edge0Rope : public edge0_binding::CpuPrimitive {
 public:
  Edge0Rope(mx::Stream s, RopeArgs a, bool has_freqs) : CpuPrimitive(s), a_(a), has_freqs_(has_freqs) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = begin(in, out);
    const View4 xv = view4(in[0]);
    const float* x = in[0].data<float>();
    const int32_t* off = in[1].data<int32_t>();
    const int64_t n_off = int64_t(in[1].size());
    const float* freqs = has_freqs_ ? in[2].data<float>() : nullptr;
    float* o = out.data<float>();
    const RopeArgs a = a_;
    enc.dispatch([=]() { rope_rows(x, xv, off, n_off, freqs, a, o); });
  }
  const char* name() const override { return "Edge0Rope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Edge0Rope&>(other);
    return a_.dims == o.a_.dims && a_.traditional == o.a_.traditional && a_.base == o.a_.base &&
           a_.scale == o.a_.scale && has_freqs_ == o.has_freqs_;
  }

 private:
  RopeArgs a_;
  bool has_freqs_;
};

// An input the kernel reads as rows of plain values: as it is where it already lies so (a
// layer's weight, a position made from a number), else a contiguous copy first (a decode
// step of the bench's 12-layer checkpoint makes 73 such calls: a node each in its graph).
mx::array as_rows(const mx::array& a, mx::Stream stream) {
  if (a.is_available() && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, stream);
}

mx::array rms_norm_op(const mx::array& x, const mx::array& w, float eps) {
  auto stream = cpu_stream();
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32)
    bad("rms_norm takes float32 x and weight, got " + shape_str(x) + " and " + shape_str(w) + " of other dtypes");
  if (x.ndim() < 1 || x.ndim() > 4) bad("rms_norm's x must have 1 to 4 dimensions, got shape " + shape_str(x));
  if (w.ndim() != 1 || w.shape(0) != x.shape(-1))
    bad("rms_norm's weight " + shape_str(w) + " must be [D] for x " + shape_str(x));
  if (x.shape(-1) == 0) bad("rms_norm's x has rows of width 0");
  return mx::array(x.shape(), mx::float32, std::make_shared<Edge0RmsNorm>(stream, eps), {x, as_rows(w, stream)});
}

mx::array rope_op(const mx::array& x, int dims, bool traditional, std::optional<float> base, float scale,
                  const mx::array& offsets, std::optional<mx::array> freqs) {
  auto stream = cpu_stream();
  if (x.dtype() != mx::float32 || x.ndim() < 2 || x.ndim() > 4)
    bad("rope takes float32 x of 2 to 4 dimensions [..., positions, D], got shape " + shape_str(x));
  if (dims < 2 || dims % 2 != 0 || dims > x.shape(-1))
    bad("rope's dims must be even and at most x's last dimension " + std::to_string(x.shape(-1)) + ", got " +
        std::to_string(dims));
  if (offsets.dtype() != mx::int32 || offsets.ndim() != 1 ||
      (offsets.shape(0) != 1 && (x.ndim() < 3 || offsets.shape(0) != x.shape(0))))
    bad("rope's offsets must be int32 [1] or [batch], got shape " + shape_str(offsets) + " for x " + shape_str(x));
  if (base.has_value() == freqs.has_value()) bad("rope takes a base or freqs, one of the two");
  RopeArgs a{dims, traditional, base.value_or(0.0f), scale};
  std::vector<mx::array> inputs{x, as_rows(offsets, stream)};
  if (freqs) {
    if (freqs->dtype() != mx::float32 || freqs->ndim() != 1 || freqs->shape(0) != dims / 2)
      bad("rope's freqs must be float32 [dims / 2], got shape " + shape_str(*freqs));
    inputs.push_back(as_rows(*freqs, stream));
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<Edge0Rope>(stream, a, freqs.has_value()),
                   std::move(inputs));
}

}  // namespace

void bind_layer_ops(nb::module_& m) {
  m.def("rms_norm", &rms_norm_op, "x"_a, "weight"_a, "eps"_a);
  m.def("rope", &rope_op, "x"_a, "dims"_a, "traditional"_a, "base"_a.none(), "scale"_a, "offsets"_a,
        "freqs"_a.none() = nb::none());
}
