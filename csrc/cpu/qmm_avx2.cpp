// AVX2 + FMA + F16C quantized matmul, bits 4 and 8 (others: portable).
// Same structure as qmm_avx512.cpp with 8-lane vectors and 16 registers:
// GEMV with pre-permuted activations (4 bits: per 16 values, evens then
// odds) and up to 4 activation rows per register block; GEMM with a 6x16
// micro-kernel over [K][16] dequantized weight panels.
#include "cpu/qmm_x86.h"

namespace mlxfast {
namespace qmm {

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 values from value k0 of a packed row, as 4 fp32 vectors.
// BITS 4: v0 = k0+0,2,..,14  v1 = k0+1,3,..,15  v2 = k0+16,..,30  v3 = k0+17,..,31
// BITS 8: v0..v3 = k0+0..7, 8..15, 16..23, 24..31.
template <int BITS>
inline void unpack32(const uint8_t* row, int64_t k0, __m256 v[4]) {
  if (BITS == 4) {
    const __m256i m4 = _mm256_set1_epi32(0xf);
    const uint8_t* p = row + (k0 >> 1);
    __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(q0, m4));
    v[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4));
    v[2] = _mm256_cvtepi32_ps(_mm256_and_si256(q1, m4));
    v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4));
  } else {
    const uint8_t* p = row + k0;
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
    }
  }
}

// ---------------------------------------------------------------- GEMV ----

// y[m0 + m][n + r] for r < R, m < MM, written to yb[m * 16 + r]: weights
// dequantized 32 at a time (scale * q + bias, one FMA per vector), then FMAs
// with every activation row; the same formula at any number of rows, as in
// qmm_avx512.cpp. Two accumulators per output halve the FMA chains.
template <int BITS, int MM, int R>
inline void gemv_tile(const GemvCtx& c, int64_t m0, int64_t n, const float* sc,
                      const float* bi, float* yb) {
  const Args& a = *c.a;
  const int64_t K = a.K, G = c.G, gs = a.group_size;
  const uint8_t* w0 = reinterpret_cast<const uint8_t*>(a.w) + n * c.row_bytes;
  const float* xp = c.xp + m0 * K;
  __m256 acc[R][MM], acc2[R][MM];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = acc2[r][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if ((g & 3) == 0) c.next->step();
    for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += 32) {
      const float* xc = xp + k0 * MM;
      const bool line = ((k0 * BITS / 8) & 63) == 0;  // one prefetch per line (qmm_avx512.cpp)
      for (int r = 0; r < R; ++r) {
        if (line) {
          prefetch_weights(w0 + (r + kPrefetchRows) * c.row_bytes + k0 * BITS / 8);
        }
        const __m256 s = _mm256_broadcast_ss(sc + r * G + g);
        const __m256 b = _mm256_broadcast_ss(bi + r * G + g);
        __m256 v[4];
        unpack32<BITS>(w0 + r * c.row_bytes, k0, v);
        for (int i = 0; i < 4; ++i) v[i] = _mm256_fmadd_ps(v[i], s, b);
        for (int m = 0; m < MM; ++m) {
          acc[r][m] = _mm256_fmadd_ps(v[0], _mm256_load_ps(xc + m * 32), acc[r][m]);
          acc2[r][m] = _mm256_fmadd_ps(v[1], _mm256_load_ps(xc + m * 32 + 8), acc2[r][m]);
          acc[r][m] = _mm256_fmadd_ps(v[2], _mm256_load_ps(xc + m * 32 + 16), acc[r][m]);
          acc2[r][m] = _mm256_fmadd_ps(v[3], _mm256_load_ps(xc + m * 32 + 24), acc2[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < MM; ++m) {
      yb[m * kGemvRowBlock + r] = hsum(_mm256_add_ps(acc[r][m], acc2[r][m]));
    }
  }
}

inline __m256 load8_cvt(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case F32: return _mm256_loadu_ps(static_cast<const float*>(p) + i);
    case F16:
      return _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
    default:
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i))),
          16));
  }
}

// Dense weights (bits == 0): y[m0 + m][n + r] = x[m] . w[n + r], 8 values
// at a time, scalar tail (any K).
template <int MM, int R>
inline void gemv_tile_dense(const GemvCtx& c, int64_t m0, int64_t n, float* yb) {
  const Args& a = *c.a;
  const int64_t K = a.K;
  const char* w0 = static_cast<const char*>(a.w) + n * c.row_bytes;
  const int es = dtype_size(a.w_dtype);
  const float* xp = c.xp + m0 * K;
  __m256 acc[R][MM];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    for (int r = 0; r < R; ++r) {
      prefetch_weights(w0 + (r + kPrefetchRows) * c.row_bytes + k * es);
      __m256 wv = load8_cvt(w0 + r * c.row_bytes, a.w_dtype, k);
      for (int m = 0; m < MM; ++m) {
        acc[r][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp + m * K + k), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < MM; ++m) {
      float v = hsum(acc[r][m]);
      for (int64_t t = k; t < K; ++t) {
        v += load_f32(w0 + r * c.row_bytes, a.w_dtype, t) * xp[m * K + t];
      }
      yb[m * kGemvRowBlock + r] = v;
    }
  }
}

// The kernels Driver<Avx2> runs (see qmm_x86.h).
struct Avx2 {
  static constexpr int kGemvMaxMM = 4;
  static constexpr bool kSymmetricOneRow = false;
  static constexpr int kMR = 6;
  static constexpr int kNR = 16;

  using Vec = __m256;
  static constexpr int kLanes = 8;
  static Vec vzero() { return _mm256_setzero_ps(); }
  static Vec vload(const float* p) { return _mm256_load_ps(p); }
  static void vstore(float* p, Vec v) { _mm256_store_ps(p, v); }
  static void vstoreu(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static void vstore_out(void* out, DType dt, int64_t i, Vec v, int64_t n) {
    alignas(32) float t[kLanes];
    _mm256_store_ps(t, v);
    for (int64_t j = 0; j < n; ++j) store_f32(out, dt, i + j, t[j]);
  }

  static void cvt_row(const void* src, DType dt, int64_t off, int64_t n, float* dst) {
    int64_t i = 0;
    if (dt == F32) {
      std::memcpy(dst, static_cast<const float*>(src) + off, sizeof(float) * n);
      return;
    }
    const uint16_t* p = static_cast<const uint16_t*>(src) + off;
    if (dt == F16) {
      for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                      reinterpret_cast<const __m128i*>(p + i))));
      }
    } else {
      for (; i + 8 <= n; i += 8) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      }
    }
    for (; i < n; ++i) dst[i] = load_f32(src, dt, off + i);
  }

  template <int BITS, int MM>
  static void gemv_rows(const GemvCtx& c, int64_t m0, int64_t n0, int64_t n1, const float* sc,
                        const float* bi) {
    constexpr int R = MM == 1 ? 4 : (MM == 2 ? 2 : 1);
    const int64_t G = c.G;
    alignas(32) float yb[kGemvMaxMM * kGemvRowBlock];
    int64_t n = n0;
    if constexpr (BITS == 0) {
      for (; n + R <= n1; n += R) gemv_tile_dense<MM, R>(c, m0, n, yb + (n - n0));
      for (; n < n1; ++n) gemv_tile_dense<MM, 1>(c, m0, n, yb + (n - n0));
    } else {
      for (; n + R <= n1; n += R) {
        gemv_tile<BITS, MM, R>(c, m0, n, sc + (n - n0) * G, bi + (n - n0) * G, yb + (n - n0));
      }
      for (; n < n1; ++n) {
        gemv_tile<BITS, MM, 1>(c, m0, n, sc + (n - n0) * G, bi + (n - n0) * G, yb + (n - n0));
      }
    }
    for (int m = 0; m < MM; ++m) {
      for (int64_t r = 0; r < n1 - n0; ++r) {
        store_f32(c.a->out, c.a->x_dtype, (m0 + m) * c.a->N + n0 + r, yb[m * kGemvRowBlock + r]);
      }
    }
  }

  // Activations as fp32 into xp ((M + 1) * K floats): dense rows [M][K]; for
  // quantized weights blocks of up to 4 rows interleaved per 32-value chunk,
  // [K / 32][mm][32] (4 bits: per 16 values, evens then odds), so the tile
  // addresses them as one pointer plus constants (see qmm_avx512.cpp).
  static void prepare_x(const Args& a, float* xp) {
    const int64_t M = a.M, K = a.K;
    float* tmp = xp + M * K;
    if (a.bits == 0) {
      for (int64_t m = 0; m < M; ++m) cvt_row(a.x, a.x_dtype, m * K, K, xp + m * K);
      return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += kGemvMaxMM) {
      const int64_t mm = M - m0 < kGemvMaxMM ? M - m0 : kGemvMaxMM;
      for (int64_t m = 0; m < mm; ++m) {
        cvt_row(a.x, a.x_dtype, (m0 + m) * K, K, tmp);
        float* dst = xp + m0 * K + m * 32;
        for (int64_t k = 0; k < K; k += 32, dst += mm * 32) {
          if (a.bits == 4) {
            for (int h = 0; h < 32; h += 16) {
              for (int j = 0; j < 8; ++j) {
                dst[h + j] = tmp[k + h + 2 * j];
                dst[h + 8 + j] = tmp[k + h + 2 * j + 1];
              }
            }
          } else {
            std::memcpy(dst, tmp + k, sizeof(float) * 32);
          }
        }
      }
    }
  }

  // Dequantize weight rows n0..n0+15, k in [kb, ke) (group-aligned), into
  // bp[k - kb][16] (fp32; rows >= N are 0). The packed bytes of one chunk of
  // the 16 rows are transposed in registers so that each zero-extended vector
  // holds one k across 8 columns.
  template <int BITS>
  static void dequant_panel(const Args& a, int64_t n0, int64_t kb, int64_t ke, float* bp,
                            const float* sb) {
    const int64_t K = a.K, G = K / a.group_size, gs = a.group_size;
    const int64_t row_bytes = K * BITS / 8;
    const int64_t ncols = a.N - n0 < kNR ? a.N - n0 : kNR;
    const float* scf = sb;
    const float* bif = sb + kNR * G;
    const __m256i m4 = _mm256_set1_epi32(0xf);
    const uint8_t* w = reinterpret_cast<const uint8_t*>(a.w);
    alignas(32) float st[4][8];
    for (int64_t g = kb / gs; g < ke / gs; ++g) {
      for (int j = 0; j < 8; ++j) {
        st[0][j] = scf[j * G + g];
        st[1][j] = scf[(j + 8) * G + g];
        st[2][j] = bif[j * G + g];
        st[3][j] = bif[(j + 8) * G + g];
      }
      const __m256 s0 = _mm256_load_ps(st[0]), s1 = _mm256_load_ps(st[1]);
      const __m256 b0 = _mm256_load_ps(st[2]), b1 = _mm256_load_ps(st[3]);
      for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += (BITS == 4 ? 32 : 16)) {
        __m128i r[16], t[16];
        const int64_t off = BITS == 4 ? (k0 >> 1) : k0;
        for (int j = 0; j < 16; ++j) {
          r[j] = (j < ncols) ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                   w + (n0 + j) * row_bytes + off))
                             : _mm_setzero_si128();
        }
        transpose16x16_u8(r, t);
        float* dst = bp + (k0 - kb) * kNR;
        for (int i = 0; i < 16; ++i) {
          __m256i z0 = _mm256_cvtepu8_epi32(t[i]);                        // columns 0..7
          __m256i z1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(t[i], t[i]));  // 8..15
          if (BITS == 4) {
            float* d0 = dst + (2 * i) * kNR;
            float* d1 = dst + (2 * i + 1) * kNR;
            _mm256_storeu_ps(d0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(z0, m4)), s0, b0));
            _mm256_storeu_ps(d0 + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(z1, m4)), s1, b1));
            _mm256_storeu_ps(d1, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(z0, 4)), s0, b0));
            _mm256_storeu_ps(d1 + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(z1, 4)), s1, b1));
          } else {
            float* d0 = dst + i * kNR;
            _mm256_storeu_ps(d0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(z0), s0, b0));
            _mm256_storeu_ps(d0 + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(z1), s1, b1));
          }
        }
      }
    }
  }
};

using Avx2Driver = Driver<Avx2>;

} // namespace

void gemv_prepare_avx2(const Args& a, float* xp) { Avx2::prepare_x(a, xp); }

void gemv_block_avx2(const Args& a, const float* xp, int64_t n0, int64_t n1) {
  Avx2Driver::gemv_unit(a, xp, n0, n1);
}

void run_avx2(const Args& a) { Avx2Driver::run(a); }

} // namespace qmm
} // namespace mlxfast
