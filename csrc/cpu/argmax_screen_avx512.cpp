// quantized_argmax's screening pass on AVX-512: a 16-row block's bounds and
// logits are one vector each (csrc/cpu/argmax_screen.h).
#include <immintrin.h>

#include <cmath>

#include "cpu/argmax_screen.h"

namespace mlxfast {
namespace argmax_screen {

void bound_avx512(const Screen& s, int64_t b0, int64_t b1, float* lo) {
  const int64_t N = s.N, NB = s.N / 16, nb = s.nb, M = s.M;
  const __m512 widen = _mm512_set1_ps(1.0f + 0x1p-10f), rel = _mm512_set1_ps(0x1p-20f);
  const __m512 tiny = _mm512_set1_ps(0x1p-96f);
  const __m512 zero = _mm512_setzero_ps();
  constexpr int64_t kTile = 64;  // blocks whose coefficients (~37 KB at K = 576) stay in L2
  __m512 lmax[kMaxRows];
  for (int64_t m = 0; m < M; ++m) lmax[m] = _mm512_set1_ps(-INFINITY);
  for (int64_t t0 = b0; t0 < b1; t0 += kTile) {
    const int64_t t1 = t0 + kTile < b1 ? t0 + kTile : b1;
    for (int64_t m = 0; m < M; ++m) {
      const float* d = s.d + m * nb;
      for (int64_t blk = t0; blk < t1; ++blk) {
        const uint16_t* c = s.c + blk * nb * 16;
        __m512 e = zero;
        for (int64_t b = 0; b < nb; ++b) {
          const __m512 cv =
              _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + b * 16)));
          e = _mm512_fmadd_ps(_mm512_set1_ps(d[b]), cv, e);
        }
        const __m512 y = _mm512_loadu_ps(s.y + m * N + blk * 16);
        e = _mm512_fmadd_ps(e, widen, _mm512_fmadd_ps(_mm512_abs_ps(y), rel, tiny));
        const __m512 l = _mm512_sub_ps(y, e), h = _mm512_add_ps(y, e);
        const __m512 z = _mm512_mul_ps(_mm512_sub_ps(h, l), zero);  // 0 where finite, else NaN
        const bool finite = _mm512_cmp_ps_mask(z, z, _CMP_ORD_Q) == 0xFFFF;
        s.hi[m * NB + blk] = finite ? _mm512_reduce_max_ps(h) : NAN;
        lmax[m] = _mm512_max_ps(lmax[m], l);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) lo[m] = _mm512_reduce_max_ps(lmax[m]);
}

}  // namespace argmax_screen
}  // namespace mlxfast
