// Private interface of the gated-activation kernels (csrc/cpu/silu_mul_*.cpp):
// out[r][j] = silu(g[r*stride + j]) * u[r*stride + j] for rows [r0, r1),
// j < m, computed in float32 (dtype: 0 f32, 1 f16, 2 bf16 for all three).
#pragma once

#include <cstdint>

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

}  // namespace act
}  // namespace mlxfast
