// AVX2 + FMA + F16C quantized matmul, bits 4 and 8 (others: portable).
// Same structure as qmm_avx512.cpp with 8-lane vectors and 16 registers:
// GEMV with pre-permuted activations (4 bits: per 16 values, evens then
// odds) and up to 4 activation rows per register block; GEMM with a 6x16
// micro-kernel over [K][16] dequantized weight panels.
#include <immintrin.h>

#include "cpu/qmm.h"

namespace mlxfast {
namespace qmm {

namespace {

thread_local Scratch tl_x;
thread_local Scratch tl_w;
thread_local Scratch tl_t;
thread_local Scratch tl_c;

inline void cvt_row(const void* src, DType dt, int64_t off, int64_t n, float* dst) {
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

constexpr int kGemvRowBlock = 16;
constexpr int kGemvMaxMM = 4;

struct GemvCtx {
  const Args* a;
  const float* xp;  // dense: [M][K]; quantized: blocks of <= 4 rows, [K / 32][mm][32]
  int64_t G, row_bytes;
};

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
    for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += 32) {
      const float* xc = xp + k0 * MM;
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(w0 + (r + kPrefetchRows) * c.row_bytes +
                                                   k0 * BITS / 8),
                     _MM_HINT_T0);
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
      _mm_prefetch(w0 + (r + kPrefetchRows) * c.row_bytes + k * es, _MM_HINT_T0);
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

template <int BITS, int MM>
void gemv_rows(const GemvCtx& c, int64_t m0, int64_t n0, int64_t n1, const float* sc,
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

template <int BITS>
void gemv_dispatch(const GemvCtx& c, int64_t m0, int mm, int64_t n0, int64_t n1,
                   const float* sc, const float* bi) {
  switch (mm) {
    case 1: gemv_rows<BITS, 1>(c, m0, n0, n1, sc, bi); break;
    case 2: gemv_rows<BITS, 2>(c, m0, n0, n1, sc, bi); break;
    case 3: gemv_rows<BITS, 3>(c, m0, n0, n1, sc, bi); break;
    default: gemv_rows<BITS, 4>(c, m0, n0, n1, sc, bi); break;
  }
}

// Activations as fp32 into xp ((M + 1) * K floats): dense rows [M][K]; for
// quantized weights blocks of up to 4 rows interleaved per 32-value chunk,
// [K / 32][mm][32] (4 bits: per 16 values, evens then odds), so the tile
// addresses them as one pointer plus constants (see qmm_avx512.cpp).
void prepare_x(const Args& a, float* xp) {
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

// Output rows [0, M), columns [n0, n1) (at most kGemvRowBlock of them).
void gemv_unit(const Args& a, const float* xp, int64_t n0, int64_t n1) {
  const bool dense = a.bits == 0;
  const int64_t M = a.M, K = a.K, G = dense ? 0 : K / a.group_size;
  GemvCtx c{&a, xp, G, dense ? K * dtype_size(a.w_dtype) : K * a.bits / 8};
  float* sb = tl_w.get(static_cast<size_t>(2 * kGemvRowBlock * G + 1));
  float* sc = sb;
  float* bi = sb + kGemvRowBlock * G;
  prefetch_group_params(a, n1, kGemvRowBlock, G);
  if (!dense) {
    cvt_row(a.scales, a.s_dtype, n0 * G, (n1 - n0) * G, sc);
    if (a.biases) {
      cvt_row(a.biases, a.s_dtype, n0 * G, (n1 - n0) * G, bi);
    } else {
      sym_biases(sc, (n1 - n0) * G, a.bits, bi);
    }
  }
  for (int64_t m0 = 0; m0 < M; m0 += kGemvMaxMM) {
    int mm = static_cast<int>(M - m0 < kGemvMaxMM ? M - m0 : kGemvMaxMM);
    if (a.bits == 4) {
      gemv_dispatch<4>(c, m0, mm, n0, n1, sc, bi);
    } else if (a.bits == 8) {
      gemv_dispatch<8>(c, m0, mm, n0, n1, sc, bi);
    } else {
      gemv_dispatch<0>(c, m0, mm, n0, n1, sc, bi);
    }
  }
}

void gemv(const Args& a) {
  float* xp = tl_x.get(gemv_prep_floats(a));
  prepare_x(a, xp);
  const int64_t units = ceil_div(a.N, kGemvRowBlock);
  auto body = [&a, xp](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t n0 = u * kGemvRowBlock;
      gemv_unit(a, xp, n0, n0 + kGemvRowBlock < a.N ? n0 + kGemvRowBlock : a.N);
    }
  };
  par_dynamic(units, units / (8 * num_threads()), body);
}

// ---------------------------------------------------------------- GEMM ----

constexpr int kMR = 6;
constexpr int kNR = 16;
constexpr int64_t kKC = 256;
constexpr int64_t kABlockBytes = 768 << 10;  // packed activation rows kept in L2

// In-register transpose of 16 rows of 16 bytes: t[b][j] = r[j][b].
inline void transpose16x16_u8(const __m128i r[16], __m128i t[16]) {
  __m128i a[16], c[16], d[16];
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);      // rows 2i,2i+1; b 0..7
    a[8 + i] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);  // b 8..15
  }
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) {
      c[8 * h + i] = _mm_unpacklo_epi16(a[8 * h + 2 * i], a[8 * h + 2 * i + 1]);
      c[8 * h + 4 + i] = _mm_unpackhi_epi16(a[8 * h + 2 * i], a[8 * h + 2 * i + 1]);
    }
  }
  for (int q = 0; q < 4; ++q) {
    for (int i = 0; i < 2; ++i) {
      d[4 * q + i] = _mm_unpacklo_epi32(c[4 * q + 2 * i], c[4 * q + 2 * i + 1]);
      d[4 * q + 2 + i] = _mm_unpackhi_epi32(c[4 * q + 2 * i], c[4 * q + 2 * i + 1]);
    }
  }
  for (int e = 0; e < 8; ++e) {
    t[2 * e] = _mm_unpacklo_epi64(d[2 * e], d[2 * e + 1]);
    t[2 * e + 1] = _mm_unpackhi_epi64(d[2 * e], d[2 * e + 1]);
  }
}

// Scales and biases of weight rows n0..n0+15 as fp32 [16][G] each (0 past N).
void load_sb(const Args& a, int64_t n0, float* sb) {
  const int64_t G = a.K / a.group_size;
  const int64_t ncols = a.N - n0 < kNR ? a.N - n0 : kNR;
  cvt_row(a.scales, a.s_dtype, n0 * G, ncols * G, sb);
  if (a.biases) {
    cvt_row(a.biases, a.s_dtype, n0 * G, ncols * G, sb + kNR * G);
  } else {
    sym_biases(sb, ncols * G, a.bits, sb + kNR * G);
  }
  if (ncols < kNR) {
    std::memset(sb + ncols * G, 0, sizeof(float) * (kNR - ncols) * G);
    std::memset(sb + kNR * G + ncols * G, 0, sizeof(float) * (kNR - ncols) * G);
  }
}

// Dequantize weight rows n0..n0+15, k in [kb, ke) (group-aligned), into
// bp[k - kb][16] (fp32; rows >= N are 0). The packed bytes of one chunk of
// the 16 rows are transposed in registers so that each zero-extended vector
// holds one k across 8 columns.
template <int BITS>
void dequant_panel(const Args& a, int64_t n0, int64_t kb, int64_t ke, float* bp,
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

// Pack rows p*6 .. p*6+5 of x as ap[K][6] fp32 (missing rows are 0).
void pack_a(const Args& a, int64_t p, float* ap, float* tmp) {
  const int64_t K = a.K;
  for (int r = 0; r < kMR; ++r) {
    int64_t m = p * kMR + r;
    if (m < a.M) {
      cvt_row(a.x, a.x_dtype, m * K, K, tmp);
      for (int64_t k = 0; k < K; ++k) ap[k * kMR + r] = tmp[k];
    } else {
      for (int64_t k = 0; k < K; ++k) ap[k * kMR + r] = 0.0f;
    }
  }
}

// C[6][16] (+)= ap[kc][6]^T . bp[kc][16]; partial sums in cs[6][16] between
// k blocks; the last block writes rows < mr, columns < nc of the output.
void micro_6x16(const float* ap, const float* bp, int64_t kc, float* cs, bool first,
                bool last, const Args& a, int64_t m0, int64_t n0, int mr, int64_t nc) {
  __m256 c0[kMR], c1[kMR];
  if (first) {
#pragma GCC unroll 6
    for (int r = 0; r < kMR; ++r) {
      c0[r] = _mm256_setzero_ps();
      c1[r] = _mm256_setzero_ps();
    }
  } else {
#pragma GCC unroll 6
    for (int r = 0; r < kMR; ++r) {
      c0[r] = _mm256_load_ps(cs + r * kNR);
      c1[r] = _mm256_load_ps(cs + r * kNR + 8);
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    __m256 b0 = _mm256_load_ps(bp);
    __m256 b1 = _mm256_load_ps(bp + 8);
#pragma GCC unroll 6
    for (int r = 0; r < kMR; ++r) {
      __m256 x = _mm256_broadcast_ss(ap + r);
      c0[r] = _mm256_fmadd_ps(x, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(x, b1, c1[r]);
    }
    ap += kMR;
    bp += kNR;
  }
  if (!last) {
#pragma GCC unroll 6
    for (int r = 0; r < kMR; ++r) {
      _mm256_store_ps(cs + r * kNR, c0[r]);
      _mm256_store_ps(cs + r * kNR + 8, c1[r]);
    }
    return;
  }
  const int64_t N = a.N;
  if (a.x_dtype == F32 && mr == kMR && nc == kNR) {
    float* out = static_cast<float*>(a.out) + m0 * N + n0;
#pragma GCC unroll 6
    for (int r = 0; r < kMR; ++r) {
      _mm256_storeu_ps(out + r * N, c0[r]);
      _mm256_storeu_ps(out + r * N + 8, c1[r]);
    }
    return;
  }
  alignas(32) float t[kNR];
  for (int r = 0; r < mr; ++r) {
    _mm256_store_ps(t, c0[r]);
    _mm256_store_ps(t + 8, c1[r]);
    for (int64_t j = 0; j < nc; ++j) store_f32(a.out, a.x_dtype, (m0 + r) * N + n0 + j, t[j]);
  }
}

void gemm(const Args& a) {
  const int64_t M = a.M, N = a.N, K = a.K;
  const int64_t P = ceil_div(M, kMR);
  float* ap = tl_x.get(static_cast<size_t>(P * K * kMR));
  const Args* pa = &a;
  auto pack = [pa, ap, K](int64_t p0, int64_t p1) {
    float* tmp = tl_t.get(static_cast<size_t>(K));
    for (int64_t p = p0; p < p1; ++p) pack_a(*pa, p, ap + p * K * kMR, tmp);
  };
  par(P, 8, pack);
  const int64_t NB = ceil_div(N, kNR);
  const bool dense = a.bits == 0;
  const int64_t kc_max = dense ? kKC : (kKC / a.group_size) * a.group_size;
  const int64_t pc = kABlockBytes / (K * kMR * 4) > 1 ? kABlockBytes / (K * kMR * 4) : 1;
  auto body = [pa, ap, K, M, N, P, kc_max, pc, NB, dense](int64_t t0, int64_t t1) {
    const Args& a = *pa;
    const int64_t G = dense ? 0 : K / a.group_size;
    float* bp = tl_w.get(static_cast<size_t>(kc_max * kNR));
    // scales/biases, or the dense panel's row-major staging buffer
    float* sb = tl_t.get(static_cast<size_t>(dense ? kc_max * kNR : 2 * kNR * G));
    float* cs = K > kc_max ? tl_c.get(static_cast<size_t>(P * kMR * kNR)) : nullptr;
    // Task t: weight panel t % NB against activation row block t / NB (pc
    // panels, small enough to stay in L2 while the panels pass over it).
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pb = (t / NB) * pc;
      const int64_t pe = pb + pc < P ? pb + pc : P;
      const int64_t n0 = (t % NB) * kNR;
      const int64_t nc = N - n0 < kNR ? N - n0 : kNR;
      if (!dense) load_sb(a, n0, sb);
      for (int64_t kb = 0; kb < K; kb += kc_max) {
        const int64_t ke = kb + kc_max < K ? kb + kc_max : K;
        if (dense) {
          dense_panel<kNR>(a, n0, kb, ke, bp, sb);
        } else if (a.bits == 4) {
          dequant_panel<4>(a, n0, kb, ke, bp, sb);
        } else {
          dequant_panel<8>(a, n0, kb, ke, bp, sb);
        }
        for (int64_t p = pb; p < pe; ++p) {
          int mr = static_cast<int>(M - p * kMR < kMR ? M - p * kMR : kMR);
          micro_6x16(ap + p * K * kMR + kb * kMR, bp, ke - kb,
                      cs ? cs + p * kMR * kNR : nullptr, kb == 0, ke == K, a, p * kMR, n0,
                      mr, nc);
        }
      }
    }
  };
  par_dynamic(ceil_div(P, pc) * NB, 1, body);
  tl_x.trim(kKeepScratchFloats);
}

} // namespace

void gemv_prepare_avx2(const Args& a, float* xp) { prepare_x(a, xp); }

void gemv_block_avx2(const Args& a, const float* xp, int64_t n0, int64_t n1) {
  gemv_unit(a, xp, n0, n1);
}

void run_avx2(const Args& a) {
  if (a.bits != 0 && a.bits != 4 && a.bits != 8) {
    run_portable(a);
  } else if (a.M <= kGemvMaxRows) {
    gemv(a);
  } else {
    gemm(a);
  }
}

} // namespace qmm
} // namespace mlxfast
