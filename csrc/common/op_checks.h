// Helpers for the eager validation in op functions.
#pragma once

#include <stdexcept>
#include <string>

#include "mlx/array.h"

namespace mlxfast {

// Raise the ValueError every op uses: "[mlxfast.<op>] <what>".
[[noreturn]] inline void fail(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string("[mlxfast.") + op + "] " + what);
}

inline bool is_float(mlx::core::Dtype dt) {
  return dt == mlx::core::float32 || dt == mlx::core::float16 || dt == mlx::core::bfloat16;
}

} // namespace mlxfast
