// Per-thread float scratch that only grows (pool threads live for the
// process), 64-byte aligned. Header-only in an anonymous namespace: the
// per-ISA kernel files include it under different compiler flags (see the
// ODR note in csrc/cpu/qmm.h).
#pragma once

#include <cstddef>
#include <cstdlib>

namespace mlxfast {
namespace {

struct Scratch {
  float* p = nullptr;
  size_t cap = 0;
  float* get(size_t n) {
    if (n > cap) {
      std::free(p);
      size_t bytes = ((n * sizeof(float)) + 63) & ~static_cast<size_t>(63);
      p = static_cast<float*>(std::aligned_alloc(64, bytes));
      cap = bytes / sizeof(float);
    }
    return p;
  }
  // Drop a buffer above max_floats (a one-off long prefill should not pin
  // its buffers for the life of the process).
  void trim(size_t max_floats) {
    if (cap > max_floats) {
      std::free(p);
      p = nullptr;
      cap = 0;
    }
  }
};

}  // namespace
}  // namespace mlxfast
