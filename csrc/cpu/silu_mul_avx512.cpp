// act(g) * u with AVX-512 and the vector exp (see silu_mul.h).
#include <immintrin.h>

#include "cpu/silu_mul.h"
#include "cpu/vec_exp.h"

namespace mlxfast {
namespace act {

namespace {

inline __m512 load16(const void* p, int dt, int64_t i, __mmask16 k) {
  if (dt == 0) return _mm512_maskz_loadu_ps(k, static_cast<const float*>(p) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(p) + i);
  if (dt == 1) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store16(void* p, int dt, int64_t i, __m512 v, __mmask16 k) {
  if (dt == 0) {
    _mm512_mask_storeu_ps(static_cast<float*>(p) + i, k, v);
  } else if (dt == 1) {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, k,
                             _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {  // bf16: round to nearest even (act * u of finite inputs is finite or inf)
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16),
                                                      _mm512_set1_epi32(0x40)));
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, k, _mm512_cvtepi32_epi16(r));
  }
}

// x / (1 + e^-z) with z = x (silu) or the gelu argument (silu_mul.h).
template <Kind K>
inline __m512 act16(__m512 x) {
  __m512 z = x;
  if (K == GeluTanh) {
    z = _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_set1_ps(kGeluK3), _mm512_mul_ps(x, x),
                                         _mm512_set1_ps(kGeluK)));
  }
  return _mm512_div_ps(
      x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), z))));
}

template <Kind K>
void rows(const Args& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j = 0; j < a.m; j += 16) {
      const __mmask16 k = a.m - j >= 16 ? static_cast<__mmask16>(0xffff)
                                        : static_cast<__mmask16>((1u << (a.m - j)) - 1u);
      const __m512 x = load16(a.g, a.dtype, r * a.stride + j, k);
      const __m512 y = load16(a.u, a.dtype, r * a.stride + j, k);
      store16(a.out, a.dtype, r * a.m + j, _mm512_mul_ps(act16<K>(x), y), k);
    }
  }
}

}  // namespace

void gated_mul_rows_avx512(const Args& a, int64_t r0, int64_t r1) {
  if (a.kind == GeluTanh) {
    rows<GeluTanh>(a, r0, r1);
  } else {
    rows<Silu>(a, r0, r1);
  }
}

}  // namespace act
}  // namespace mlxfast
