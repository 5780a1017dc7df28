// An in-register 16 x 16 dword transpose for the AVX-512 kernels
// (kv_quant_avx512.cpp's key columns). Compiled per ISA: everything lives in an anonymous namespace
// (see csrc/cpu/qmm.h, ODR).
#pragma once

#include <immintrin.h>

namespace mlxfast {
namespace {

// In-register transpose of 16 rows of 16 dwords: r[i] lane j -> r[j] lane i.
inline void transpose16x16_epi32(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int q = 0; q < 4; ++q) {
    const int o = 4 * q;
    r[o + 0] = _mm512_shuffle_ps(t[o + 0], t[o + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[o + 1] = _mm512_shuffle_ps(t[o + 0], t[o + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[o + 2] = _mm512_shuffle_ps(t[o + 1], t[o + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[o + 3] = _mm512_shuffle_ps(t[o + 1], t[o + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int h = 0; h < 2; ++h) {
    const int o = 8 * h;
    for (int i = 0; i < 4; ++i) {
      t[o + i] = _mm512_shuffle_f32x4(r[o + i], r[o + 4 + i], 0x88);
      t[o + 4 + i] = _mm512_shuffle_f32x4(r[o + i], r[o + 4 + i], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
  }
}

inline void transpose16x16_epi32(__m512i r[16]) {
  __m512 f[16];
  for (int i = 0; i < 16; ++i) f[i] = _mm512_castsi512_ps(r[i]);
  transpose16x16_epi32(f);
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(f[i]);
}

}  // namespace
}  // namespace mlxfast
