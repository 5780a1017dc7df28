// act(g) * u with AVX2/FMA/F16C and the vector exp (see silu_mul.h).
#include <immintrin.h>

#include <cmath>

#include "cpu/silu_mul.h"
#include "cpu/vec_exp.h"

namespace mlxfast {
namespace act {

namespace {

inline __m256 load8(const void* p, int dt, int64_t i) {
  if (dt == 0) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
  if (dt == 1) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// x / (1 + e^-z) with z = x (silu) or the gelu argument (silu_mul.h).
template <Kind K>
inline __m256 act8(__m256 x) {
  __m256 z = x;
  if (K == GeluTanh) {
    z = _mm256_mul_ps(x, _mm256_fmadd_ps(_mm256_set1_ps(kGeluK3), _mm256_mul_ps(x, x),
                                         _mm256_set1_ps(kGeluK)));
  }
  return _mm256_div_ps(
      x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
}

template <Kind K>
void rows(const Args& a, int64_t r0, int64_t r1) {
  alignas(32) float t[8];
  for (int64_t r = r0; r < r1; ++r) {
    int64_t j = 0;
    for (; j + 8 <= a.m; j += 8) {
      const __m256 x = load8(a.g, a.dtype, r * a.stride + j);
      const __m256 y = load8(a.u, a.dtype, r * a.stride + j);
      const __m256 v = _mm256_mul_ps(act8<K>(x), y);
      if (a.dtype == 0) {
        _mm256_storeu_ps(static_cast<float*>(a.out) + r * a.m + j, v);
      } else {
        _mm256_store_ps(t, v);
        for (int i = 0; i < 8; ++i) store1(a.out, a.dtype, r * a.m + j + i, t[i]);
      }
    }
    for (; j < a.m; ++j) {
      const float x = load1(a.g, a.dtype, r * a.stride + j);
      const float y = load1(a.u, a.dtype, r * a.stride + j);
      store1(a.out, a.dtype, r * a.m + j, act1<K>(x) * y);
    }
  }
}

}  // namespace

void gated_mul_rows_avx2(const Args& a, int64_t r0, int64_t r1) {
  if (a.kind == GeluTanh) {
    rows<GeluTanh>(a, r0, r1);
  } else {
    rows<Silu>(a, r0, r1);
  }
}

}  // namespace act
}  // namespace mlxfast
