// quantized_argmax's screening pass on AVX2: a 16-row block as two 8-lane
// halves (csrc/cpu/argmax_screen.h).
#include <immintrin.h>

#include <cmath>

#include "cpu/argmax_screen.h"

namespace mlxfast {
namespace argmax_screen {

namespace {

inline float hmax(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

}  // namespace

void bound_avx2(const Screen& s, int64_t b0, int64_t b1, float* lo) {
  const int64_t N = s.N, NB = s.N / 16, nb = s.nb, M = s.M;
  const __m256 widen = _mm256_set1_ps(1.0f + 0x1p-10f), rel = _mm256_set1_ps(0x1p-20f);
  const __m256 tiny = _mm256_set1_ps(0x1p-96f);
  const __m256 zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
  constexpr int64_t kTile = 64;  // blocks whose coefficients (~37 KB at K = 576) stay in L2
  __m256 lmax[kMaxRows];
  for (int64_t m = 0; m < M; ++m) lmax[m] = _mm256_set1_ps(-INFINITY);
  for (int64_t t0 = b0; t0 < b1; t0 += kTile) {
    const int64_t t1 = t0 + kTile < b1 ? t0 + kTile : b1;
    for (int64_t m = 0; m < M; ++m) {
      const float* d = s.d + m * nb;
      for (int64_t blk = t0; blk < t1; ++blk) {
        const uint16_t* c = s.c + blk * nb * 16;
        __m256 e[2] = {zero, zero};
        for (int64_t b = 0; b < nb; ++b) {
          const __m256 dv = _mm256_set1_ps(d[b]);
          const __m128i* cp = reinterpret_cast<const __m128i*>(c + b * 16);
          e[0] = _mm256_fmadd_ps(dv, _mm256_cvtph_ps(_mm_loadu_si128(cp)), e[0]);
          e[1] = _mm256_fmadd_ps(dv, _mm256_cvtph_ps(_mm_loadu_si128(cp + 1)), e[1]);
        }
        const float* yp = s.y + m * N + blk * 16;
        __m256 hmx = _mm256_set1_ps(-INFINITY), z = zero;
        for (int half = 0; half < 2; ++half) {
          const __m256 y = _mm256_loadu_ps(yp + 8 * half);
          const __m256 ev = _mm256_fmadd_ps(e[half], widen,
                                            _mm256_fmadd_ps(_mm256_andnot_ps(sign, y), rel, tiny));
          const __m256 l = _mm256_sub_ps(y, ev), h = _mm256_add_ps(y, ev);
          z = _mm256_add_ps(z, _mm256_mul_ps(_mm256_sub_ps(h, l), zero));  // 0 where finite
          hmx = _mm256_max_ps(hmx, h);
          lmax[m] = _mm256_max_ps(lmax[m], l);
        }
        const bool finite = _mm256_movemask_ps(_mm256_cmp_ps(z, z, _CMP_ORD_Q)) == 0xFF;
        s.hi[m * NB + blk] = finite ? hmax(hmx) : NAN;
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) lo[m] = hmax(lmax[m]);
}

}  // namespace argmax_screen
}  // namespace mlxfast
