// Private interface of the gated-activation kernels (csrc/cpu/silu_mul_*.cpp):
// out[r][j] = silu(g[r*stride + j]) * u[r*stride + j] for rows [r0, r1),
// j < m, computed in float32 (dtype: 0 f32, 1 f16, 2 bf16 for all three).
#pragma once

#include <cstdint>

#include "common/half.h"

namespace mlxfast {
namespace act {

struct Args {
  const void* g;
  const void* u;
  void* out;
  int64_t m, stride;
  int dtype;
};

void silu_mul_rows_portable(const Args& a, int64_t r0, int64_t r1);
#if defined(MLXFAST_X86)
void silu_mul_rows_avx2(const Args& a, int64_t r0, int64_t r1);
void silu_mul_rows_avx512(const Args& a, int64_t r0, int64_t r1);
#endif

namespace {  // compiled per ISA: keep these out of the linker's reach (ODR)

inline float load1(const void* p, int dt, int64_t i) {
  if (dt == 0) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return dt == 1 ? f16_to_f32(h) : bf16_to_f32(h);
}

inline void store1(void* p, int dt, int64_t i, float v) {
  if (dt == 0) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = dt == 1 ? f32_to_f16(v) : f32_to_bf16(v);
  }
}

}  // namespace
}  // namespace act
}  // namespace mlxfast
