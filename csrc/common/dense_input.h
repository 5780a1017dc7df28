// Dense (row-major) views of primitive inputs without graph nodes.
//
// mx::contiguous() in an op function adds a Contiguous primitive to every
// call (the inputs are usually lazy, so their layout is not known yet), and
// each primitive costs ~5-20 us on the CPU. Instead, ops pass inputs as they
// are and eval_cpu asks for a DenseInput: the array's own memory when it is
// row-contiguous (the usual case), else a temporary that pack() fills inside
// the dispatched task.
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlxfast {

struct DenseInput {
  const void* data = nullptr;  // dense row-major elements, valid after pack()
  // Set only when a copy is needed.
  const char* src = nullptr;
  char* dst = nullptr;
  std::vector<int64_t> shape, strides;
  size_t itemsize = 0;

  template <typename T>
  const T* as() const { return static_cast<const T*>(data); }
  // Call first thing in the dispatched task.
  void pack() const;
};

DenseInput dense_input(const mlx::core::array& a, mlx::core::cpu::CommandEncoder& enc);

// Copies a strided array (any ndim, 1/2/4/8-byte elements) to dense memory.
void pack_strided(const char* src, const std::vector<int64_t>& shape,
                  const std::vector<int64_t>& strides, size_t itemsize, char* dst);

} // namespace mlxfast
