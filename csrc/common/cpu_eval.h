// The start every primitive's eval_cpu shares.
#pragma once

#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlxfast {

// Allocate the outputs and register inputs and outputs with the stream's CPU
// command encoder (it keeps them alive until the encoded work has run).
inline mlx::core::cpu::CommandEncoder& begin_eval(const mlx::core::Stream& stream,
                                                  const std::vector<mlx::core::array>& inputs,
                                                  std::vector<mlx::core::array>& outputs) {
  auto& enc = mlx::core::cpu::get_command_encoder(stream);
  for (auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) {
    o.set_data(mlx::core::allocator::malloc(o.nbytes()));
    enc.set_output_array(o);
  }
  return enc;
}

}  // namespace mlxfast
