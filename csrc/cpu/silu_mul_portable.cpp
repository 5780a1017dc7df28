// act(g) * u, baseline ISA (see silu_mul.h).
#include <cmath>

#include "cpu/silu_mul.h"

namespace mlxfast {
namespace act {

namespace {

template <Kind K>
void rows(const Args& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j = 0; j < a.m; ++j) {
      const float x = load1(a.g, a.dtype, r * a.stride + j);
      const float y = load1(a.u, a.dtype, r * a.stride + j);
      store1(a.out, a.dtype, r * a.m + j, act1<K>(x) * y);
    }
  }
}

}  // namespace

void gated_mul_rows_portable(const Args& a, int64_t r0, int64_t r1) {
  if (a.kind == GeluTanh) {
    rows<GeluTanh>(a, r0, r1);
  } else {
    rows<Silu>(a, r0, r1);
  }
}

}  // namespace act
}  // namespace mlxfast
