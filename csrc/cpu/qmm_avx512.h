// AVX-512 helpers shared by the AVX-512 quantized-matmul files
// (qmm_avx512.cpp, qmm_int8_rows16_avx512vnni.cpp): masked dtype conversion
// on load and store, the transposed horizontal reduction of a GEMV tile,
// and a 4-bit code's high nibble.
// Included after qmm_x86.h, with the including file's ISA flags: anonymous
// namespace (see qmm.h's ODR note).
#pragma once

#include <immintrin.h>

#include "cpu/qmm_x86.h"

namespace mlxfast {
namespace qmm {
namespace {

inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff)
                 : static_cast<__mmask16>((1u << n) - 1u);
}

inline __m512 load_cvt(const void* p, DType dt, int64_t i, __mmask16 m) {
  switch (dt) {
    case F32: return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
    case F16:
      return _mm512_cvtph_ps(
          _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i));
    default:
      return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(
              _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i)),
          16));
  }
}

inline __m256i f32_to_bf16_vec(__m512 v) {  // round to nearest even, quiet NaN
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16),
                                                    _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

inline void store_cvt(void* p, DType dt, int64_t i, __m512 v, __mmask16 m) {
  switch (dt) {
    case F32: _mm512_mask_storeu_ps(static_cast<float*>(p) + i, m, v); break;
    case F16:
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, m,
                               _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT |
                                                      _MM_FROUND_NO_EXC));
      break;
    default:
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, m, f32_to_bf16_vec(v));
      break;
  }
}

// The horizontal sums of n <= 16 vectors, written to out[i]: one transposed
// reduction (30 shuffles and 15 adds for 16 sums) instead of a reduce each
// (~8 dependent instructions apiece, half of them shuffles). Every vector is
// summed by the same tree as _mm512_reduce_add_ps (lanes i + i+8, then +4,
// +2, +1), whatever n is: a row's result does not depend on how many rows
// share its tile.
inline void reduce_add_many(const __m512* v, int n, float* out) {
  __m512 s[8], u[4], w[2];
  auto at = [&](int i) { return i < n ? v[i] : _mm512_setzero_ps(); };
  for (int k = 0; k < 8; ++k) {  // s[k] = v[2k] lanes i+(i+8) | v[2k+1] same
    const __m512 a = at(2 * k), b = at(2 * k + 1);
    s[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int k = 0; k < 4; ++k) {  // u[k]: 128-bit lane j holds v[4k + j], +4 folded
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int k = 0; k < 2; ++k) {  // w[k], lane j: v[8k + j] | v[8k + 4 + j], +2 folded
    w[k] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Lane 4j + q now sums v[4q + j]; transpose back to v's order.
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_mask_storeu_ps(out, tail_mask(n), _mm512_permutexvar_ps(order, t));
}

// (w >> 4) & 15 per byte. GF (a CPU with GFNI; matrix =
// _mm512_set1_epi64(0x1020408000000000)): one gf2p8affineqb, whose bit matrix
// moves bits 4-7 of each byte to 0-3, for the shift and the mask: a
// one-row 4-bit int8 GEMV (the former VNNI kernel over MLX's layout) went
// from 18-19 to 21 GB/s on one Zen 4 core (L3); on two it streamed from
// DRAM at ~35 GB/s either way. Inline asm, so that
// no file is built with -mgfni and the compiler emits GFNI nowhere else.
template <bool GF>
inline __m512i high_nibbles(__m512i w, __m512i nib, __m512i matrix) {
  if constexpr (GF) {
    __m512i r;
    asm("vgf2p8affineqb $0, %2, %1, %0" : "=v"(r) : "v"(w), "v"(matrix));
    return r;
  } else {
    (void)matrix;
    return _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
  }
}

// Writes the horizontal sums of acc[r][m] to yb[m * kGemvRowBlock + r].
template <int R, int MM>
inline void store_tile_sums(const __m512 (&acc)[R][MM], float* yb) {
  static_assert(R * MM <= 16, "one transposed reduction per tile");
  alignas(64) float sums[16];
  reduce_add_many(&acc[0][0], R * MM, sums);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) yb[m * kGemvRowBlock + r] = sums[r * MM + m];
}

} // namespace
} // namespace qmm
} // namespace mlxfast
