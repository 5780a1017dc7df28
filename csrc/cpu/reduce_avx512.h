// Horizontal sums of 16 vectors at once for the AVX-512 attention kernels
// (paged_attention_avx512.cpp, kv_quant.h's avx512 build). Compiled per
// ISA: everything lives in an anonymous namespace (see csrc/cpu/qmm.h, ODR).
#pragma once

#include <immintrin.h>

namespace mlxfast {
namespace {

// Lane k of the result = sum of the 16 lanes of v[k]: four transpose-and-add
// steps, one vector out, instead of 16 separate reductions.
inline __m512 reduce16x16(__m512 v[16]) {
  __m512 t[8], u[4], z[2];
  for (int i = 0; i < 8; ++i) {
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; ++i) {
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

}  // namespace
}  // namespace mlxfast
