// What the extension's op builders share: typed errors and shapes in messages.
#pragma once

#include <nanobind/nanobind.h>

#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace edge0_binding {

// A bad input, named: raised as ValueError in Python (then KernelError).
[[noreturn]] inline void bad(const std::string& what) { throw std::invalid_argument("edge0 kernels: " + what); }

inline std::string shape_str(const mlx::core::array& a) {
  std::ostringstream s;
  s << "(";
  for (int i = 0; i < a.ndim(); ++i) s << (i ? ", " : "") << a.shape(i);
  s << (a.ndim() == 1 ? ",)" : ")");
  return s.str();
}

// The default stream, which must be the CPU's: the kernels run there only.
inline mlx::core::Stream cpu_stream() {
  auto stream = mlx::core::to_stream({});
  if (stream.device.type != mlx::core::Device::DeviceType::cpu) bad("the default device is not the CPU");
  return stream;
}

// A primitive of the kernels: CPU only (another device is an error naming it).
class CpuPrimitive : public mlx::core::UnaryPrimitive {
 public:
  using UnaryPrimitive::UnaryPrimitive;

  void eval_gpu(const std::vector<mlx::core::array>&, mlx::core::array&) override {
    throw std::runtime_error(std::string(name()) + ": Edge0's kernels run on the CPU device only");
  }

 protected:
  // the stream's encoder with the inputs and the output registered; `alloc`: the output's
  // memory allocated (a pass-through shares its input's instead)
  mlx::core::cpu::CommandEncoder& begin(const std::vector<mlx::core::array>& in, mlx::core::array& out,
                                        bool alloc = true) {
    if (alloc) out.set_data(mlx::core::allocator::malloc(out.nbytes()));
    auto& enc = mlx::core::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
    return enc;
  }
};

}  // namespace edge0_binding

// The row ops (layer_ops.cpp): rms_norm, rope.
void bind_layer_ops(nanobind::module_& m);

// An expert's byte ranges into its slot rows (reads.cpp): read_rows.
void bind_reads(nanobind::module_& m);
