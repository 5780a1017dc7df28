// silu(g) * u, baseline ISA (see silu_mul.h).
#include <cmath>

#include "common/half.h"
#include "cpu/silu_mul.h"

namespace mlxfast {
namespace act {

namespace {
inline float load(const void* p, int dt, int64_t i) {
  if (dt == 0) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return dt == 1 ? f16_to_f32(h) : bf16_to_f32(h);
}
inline void store(void* p, int dt, int64_t i, float v) {
  if (dt == 0) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = dt == 1 ? f32_to_f16(v) : f32_to_bf16(v);
  }
}
}  // namespace

void silu_mul_rows_portable(const Args& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j = 0; j < a.m; ++j) {
      const float x = load(a.g, a.dtype, r * a.stride + j);
      const float y = load(a.u, a.dtype, r * a.stride + j);
      store(a.out, a.dtype, r * a.m + j, x / (1.0f + std::exp(-x)) * y);
    }
  }
}

}  // namespace act
}  // namespace mlxfast
