// Private interface of the gated-activation kernels (csrc/cpu/silu_mul_*.cpp):
// out[r][j] = act(g[r*stride + j]) * u[r*stride + j] for rows [r0, r1),
// j < m, computed in float32 and rounded once (dtype: 0 f32, 1 f16, 2 bf16
// for all three).
//
// Both activations are x * sigmoid(z) = x / (1 + e^-z):
//   silu:            z = x
//   gelu (tanh form) z = 2 * sqrt(2/pi) * (x + 0.044715 x^3), since
//                    0.5 x (1 + tanh(w)) = x * sigmoid(2w) exactly.
// The sigmoid form needs no tanh and has no cancellation where tanh(w) is
// near -1; e^-z saturates (the vector exp clamps its argument), so large
// |x| gives x or a signed tiny value, never NaN/inf.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/half.h"

namespace mlxfast {
namespace act {

enum Kind : int { Silu = 0, GeluTanh = 1 };

struct Args {
  const void* g;
  const void* u;
  void* out;
  int64_t m, stride;
  int dtype;
  Kind kind = Silu;
};

void gated_mul_rows_portable(const Args& a, int64_t r0, int64_t r1);
#if defined(MLXFAST_X86)
void gated_mul_rows_avx2(const Args& a, int64_t r0, int64_t r1);
void gated_mul_rows_avx512(const Args& a, int64_t r0, int64_t r1);
#endif

namespace {  // compiled per ISA: keep these out of the linker's reach (ODR)

// z of x * sigmoid(z) for the gelu tanh approximation: x * (k + k*0.044715 x^2).
constexpr float kGeluK = 1.5957691216057308f;       // 2 * sqrt(2 / pi)
constexpr float kGeluK3 = 0.07135481627260025f;     // 2 * sqrt(2 / pi) * 0.044715

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

// The scalar activation (portable path and vector tails). std::exp of a
// large argument is inf: x / inf is a signed zero.
template <Kind K>
inline float act1(float x) {
  if (K == Silu) return x / (1.0f + std::exp(-x));
  const float z = x * (kGeluK + kGeluK3 * (x * x));
  return x / (1.0f + std::exp(-z));
}

}  // namespace
}  // namespace act
}  // namespace mlxfast
