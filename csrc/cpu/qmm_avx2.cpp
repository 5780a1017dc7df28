// AVX2 + FMA + F16C quantized matmul, bits 4 and 8 (others: portable).
// MLX's layout: the same structure as qmm_avx512.cpp with 8-lane vectors and
// 16 registers: GEMV with pre-permuted activations (4 bits: per 16 values,
// evens then odds) and up to 4 activation rows per register block; GEMM
// with a 6x16 micro-kernel over [K][16] dequantized weight panels. The
// row-interleaved layout (Args::rows16, what the loader repacks 4- and
// 8-bit layers into on this path): one arithmetic at every number of rows
// (a tile, and a code-panel GEMM from 32 rows), see "rows16" below.
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

// n values of src (dtype dt) from off as fp32 into dst.
inline void cvt_row8(const void* src, DType dt, int64_t off, int64_t n, float* dst) {
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

// ------------------------------------------------------------- rows16 ----
//
// The row-interleaved layout (Args::rows16; ops.pack_rows16, done at load
// time on this path too): a 64-byte word holds 8 (4-bit) or 4 (8-bit)
// values of each row of a 16-row block, so its two 32-byte halves put 8 rows
// in the lanes of a vector: each value is masked in place and converted
// once, multiplied by a broadcast x, and the 8 lanes are 8 outputs (no
// dequantization FMA per value, no horizontal sums). Per group, for each
// output, in this order (qmm_avx512.cpp's rows16_tile, 8 lanes at a time):
//   two chains by k's parity, d_e = fma(q, x, d_e);  y = fma(s, d_0 + d_1, y);
//   y = fma(b, sum of the group's x, y)
// with x scaled as rows16_prepare scales it. Every output is the same chain
// whatever the number of rows or the pass that computes it, and calls of
// every size run this arithmetic (the tile, or from kR16GemmMinRows rows
// the GEMM below): a row's result is the same in any call (decode, verify,
// prefill chunks beside them). The tile alone on a 2-core Zen 3 (no
// AVX-512), fp32, against MLX's layout: the default model's five matmul
// shapes at one row 1.72 -> 0.84 ms; 72 to 2,048 rows 115-130 GFLOP/s
// against the dequantized-panel GEMM's 60-67; a 1B's 8192 x 2048 at one
// row 38 -> 79 GFLOP/s (10 -> 20 GB/s of weights).
constexpr int kR16MM = 2;      // activation rows per pass over a block (both halves)
constexpr int64_t kR16BandBytes = 256 << 10;  // activation rows kept in L2 per work unit
constexpr int kR16Ahead = 64;  // words (64 bytes) of software prefetch ahead

// Sums 16 lanes (lo: 0..7, hi: 8..15) in _mm512_reduce_add_ps's order.
inline float r16_reduce16(__m256 lo, __m256 hi) {
  const __m256 t3 = _mm256_add_ps(lo, hi);
  const __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

// The group sums of one row of x (fp32, unscaled), the GEMV's and the
// GEMM's: 16 lanes over a group, then r16_reduce16.
inline void r16_group_sums(const float* row, int64_t gs, int64_t G, float* sx) {
  for (int64_t g = 0; g < G; ++g) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 16) {  // gs: a multiple of 16
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(row + k));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(row + k + 8));
    }
    sx[g] = r16_reduce16(lo, hi);
  }
}

// x as fp32 rows [M][K], value k scaled by 2^-b(k % v) (b = BITS, v = 32 /
// BITS values a word; a word's last value unscaled: it is shifted down,
// not masked in place), then each row's group sums of the unscaled x [M][G]
// (16 lanes over the group, then r16_reduce16).
template <int BITS>
void r16_prepare_bits(const Args& a, float* rows, float* sx) {
  const int64_t M = a.M, K = a.K, gs = a.group_size, G = K / gs;
  const __m256 pow2 = BITS == 4 ? _mm256_setr_ps(1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f,
                                                 0x1p-24f, 1.f)
                                : _mm256_setr_ps(1.f, 0x1p-8f, 0x1p-16f, 1.f, 1.f, 0x1p-8f, 0x1p-16f, 1.f);
  for (int64_t m = 0; m < M; ++m) {
    float* row = rows + m * K;
    cvt_row8(a.x, a.x_dtype, m * K, K, row);
    r16_group_sums(row, gs, G, sx + m * G);
    for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(row + k, _mm256_mul_ps(_mm256_loadu_ps(row + k), pow2));
  }
}

// The tile's layout of xp: rows [M][K], then their group sums [M][G].
inline void r16_prepare(const Args& a, float* xp) {
  if (a.bits == 8) return r16_prepare_bits<8>(a, xp, xp + a.M * a.K);
  r16_prepare_bits<4>(a, xp, xp + a.M * a.K);
}

inline void r16_store8(const Args& a, int64_t i, __m256 v) {
  if (a.x_dtype == F32) return _mm256_storeu_ps(static_cast<float*>(a.out) + i, v);
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int j = 0; j < 8; ++j) store_f32(a.out, a.x_dtype, i + j, t[j]);
}

// Output columns 16 * blk .. +16 of activation rows m0 .. m0+MM-1. J: words
// per group (group size * BITS / 32).
template <int BITS, int J, int MM, bool PF>
__attribute__((always_inline)) inline void r16_tile(const Args& a, const float* xp, int64_t blk,
                                                    int64_t m0) {
  constexpr int V = 32 / BITS;  // values a word
  const int64_t K = a.K, G = K / a.group_size;
  const float* x = xp + m0 * K;
  const float* sx = xp + a.M * K + m0 * G;
  const __m256i* w = reinterpret_cast<const __m256i*>(a.w) + blk * (K * BITS / 32) * 2;
  const int64_t p0 = blk * G * 16;
  __m256 acc[MM][2];
  for (int m = 0; m < MM; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g, w += 2 * J, x += V * J) {
    __m256 d[2][MM][2];
    for (int e = 0; e < 2; ++e)
      for (int m = 0; m < MM; ++m) d[e][m][0] = d[e][m][1] = _mm256_setzero_ps();
    for (int j = 0; j < J; ++j) {
      if (PF) prefetch_stream(w + 2 * (j + kR16Ahead));
      const __m256i v0 = _mm256_loadu_si256(w + 2 * j), v1 = _mm256_loadu_si256(w + 2 * j + 1);
      for (int t = 0; t < V; ++t) {
        __m256 xb[MM];
        for (int m = 0; m < MM; ++m) xb[m] = _mm256_broadcast_ss(x + m * K + V * j + t);
        const __m256i mask = _mm256_set1_epi32(((1 << BITS) - 1) << (BITS * t));
        for (int h = 0; h < 2; ++h) {
          const __m256i v = h ? v1 : v0;
          const __m256 q = _mm256_cvtepi32_ps(t == V - 1 ? _mm256_srli_epi32(v, 32 - BITS)
                                                         : _mm256_and_si256(v, mask));
          for (int m = 0; m < MM; ++m) d[t % 2][m][h] = _mm256_fmadd_ps(q, xb[m], d[t % 2][m][h]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = load8_cvt(a.scales, a.s_dtype, p0 + g * 16 + 8 * h);
      const __m256 b = a.biases ? load8_cvt(a.biases, a.s_dtype, p0 + g * 16 + 8 * h)
                                : _mm256_mul_ps(s, _mm256_set1_ps(sym_bias(BITS)));
      for (int m = 0; m < MM; ++m) {
        acc[m][h] = _mm256_fmadd_ps(s, _mm256_add_ps(d[0][m][h], d[1][m][h]), acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(b, _mm256_broadcast_ss(sx + m * G + g), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < MM; ++m)
    for (int h = 0; h < 2; ++h) r16_store8(a, (m0 + m) * a.N + blk * 16 + 8 * h, acc[m][h]);
}

// Blocks [b0, b1) against activation rows [m_begin, m_end); the first pass
// over a block prefetches ahead, the later ones find it in L1/L2.
template <int BITS, int J>
void r16_blocks(const Args& a, const float* xp, int64_t b0, int64_t b1, int64_t m_begin,
                int64_t m_end) {
  for (int64_t blk = b0; blk < b1; ++blk) {
    for (int64_t m0 = m_begin; m0 < m_end; m0 += kR16MM) {
      const bool pf = m0 == m_begin;
      if (m_end - m0 >= 2) {
        pf ? r16_tile<BITS, J, 2, true>(a, xp, blk, m0) : r16_tile<BITS, J, 2, false>(a, xp, blk, m0);
      } else {
        pf ? r16_tile<BITS, J, 1, true>(a, xp, blk, m0) : r16_tile<BITS, J, 1, false>(a, xp, blk, m0);
      }
    }
  }
}

inline void r16_run_blocks(const Args& a, const float* xp, int64_t b0, int64_t b1,
                           int64_t m_begin, int64_t m_end) {
  if (a.bits == 8) {
    switch (a.group_size) {
      case 32: return r16_blocks<8, 8>(a, xp, b0, b1, m_begin, m_end);
      case 64: return r16_blocks<8, 16>(a, xp, b0, b1, m_begin, m_end);
      default: return r16_blocks<8, 32>(a, xp, b0, b1, m_begin, m_end);
    }
  }
  switch (a.group_size) {
    case 32: return r16_blocks<4, 4>(a, xp, b0, b1, m_begin, m_end);
    case 64: return r16_blocks<4, 8>(a, xp, b0, b1, m_begin, m_end);
    default: return r16_blocks<4, 16>(a, xp, b0, b1, m_begin, m_end);
  }
}

// The same arithmetic as a GEMM for many rows (r16_matmul picks it): a
// block's codes at kR16KC keys are converted to floats once (q, shifted and
// masked: with x unscaled, the same products as the tile's), then a
// micro-tile of kR16GMR activation rows runs over them: per key one load of
// each half, a broadcast of x per row and the FMAs, in the tile's two parity
// chains, with the per-group fold y = fma(s, d0 + d1, y), y = fma(b, sum x,
// y). No mask or conversion per row pass: the FMA units are what is left.
constexpr int kR16GMR = 3;       // activation rows per micro-tile: 12 chains + 2 + 1 registers
constexpr int64_t kR16KC = 256;  // keys per code panel (whole groups): 16 KB, L1
// Micro-tiles a band has at least, whatever K: each code panel is converted
// once per band, so at large K an L2-sized band (6 rows at K = 8192) spent
// about a third of the time converting. A longer band's x comes from L3 at
// ~4 bytes a cycle, which L3 keeps up with. 2-core Zen 3, alternating runs:
// 2048 x 8192 at 64-512 rows 88-105 -> 109-134 GFLOP/s, 16384 x 2048 at 512
// rows 105-108 -> 123-127; shapes whose band was already longer unchanged.
constexpr int64_t kR16MinBandTiles = 32;

// Block blk's codes at keys [kb, ke) as floats bp[k - kb][16], its groups'
// scales and biases as sp, bq [group - kb / gs][16].
template <int BITS>
void r16_code_panel(const Args& a, int64_t blk, int64_t kb, int64_t ke, float* bp, float* sp,
                    float* bq) {
  constexpr int V = 32 / BITS;
  const int64_t K = a.K, G = K / a.group_size, gs = a.group_size;
  const __m256i qmask = _mm256_set1_epi32((1 << BITS) - 1);
  const __m256i* w = reinterpret_cast<const __m256i*>(a.w) + blk * (K * BITS / 32) * 2;
  for (int64_t g = kb / gs; g < ke / gs; ++g) {
    for (int h = 0; h < 2; ++h) {
      const int64_t p = (blk * G + g) * 16 + 8 * h;
      const __m256 sv = load8_cvt(a.scales, a.s_dtype, p);
      _mm256_storeu_ps(sp + (g - kb / gs) * 16 + 8 * h, sv);
      _mm256_storeu_ps(bq + (g - kb / gs) * 16 + 8 * h,
                       a.biases ? load8_cvt(a.biases, a.s_dtype, p)
                                : _mm256_mul_ps(sv, _mm256_set1_ps(sym_bias(BITS))));
    }
    for (int64_t j = g * gs / V; j < (g + 1) * gs / V; ++j) {
      prefetch_stream(w + 2 * (j + kR16Ahead));  // the blocks are one stream, as for the tile
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(w + 2 * j + h);
        float* dst = bp + (V * j - kb) * 16 + 8 * h;
        for (int t = 0; t < V; ++t) {
          _mm256_storeu_ps(dst + t * 16, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, BITS * t), qmask)));
        }
      }
    }
  }
}

// Rows m0 .. m0 + mr - 1 (ap: their x, [k][kR16GMR] from the panel's first
// key; sx: their group sums [kR16GMR][G] from its first group) over the
// panel's ng groups. The sums continue from cs (first: zero) and go back
// there, or to the output (last).
inline void r16_micro(const float* ap, const float* bp, const float* sp, const float* bq,
                      const float* sx, int64_t G, int64_t ng, int64_t gs, float* cs, bool first,
                      bool last, const Args& a, int64_t m0, int mr, int64_t n0) {
  constexpr int MR = kR16GMR;
  __m256 c[MR][2];
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) c[r][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(cs + r * 16 + 8 * h);
  for (int64_t g = 0; g < ng; ++g) {
    __m256 d[2][MR][2];  // chains by k's parity, as the tile's
    for (int e = 0; e < 2; ++e)
      for (int r = 0; r < MR; ++r) d[e][r][0] = d[e][r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < gs; k += 2) {
      for (int e = 0; e < 2; ++e) {
        const __m256 b0 = _mm256_loadu_ps(bp), b1 = _mm256_loadu_ps(bp + 8);
        for (int r = 0; r < MR; ++r) {
          const __m256 x = _mm256_broadcast_ss(ap + r);
          d[e][r][0] = _mm256_fmadd_ps(b0, x, d[e][r][0]);
          d[e][r][1] = _mm256_fmadd_ps(b1, x, d[e][r][1]);
        }
        bp += 16;
        ap += MR;
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_loadu_ps(sp + g * 16 + 8 * h), b = _mm256_loadu_ps(bq + g * 16 + 8 * h);
      for (int r = 0; r < MR; ++r) {
        c[r][h] = _mm256_fmadd_ps(s, _mm256_add_ps(d[0][r][h], d[1][r][h]), c[r][h]);
        c[r][h] = _mm256_fmadd_ps(b, _mm256_broadcast_ss(sx + r * G + g), c[r][h]);
      }
    }
  }
  if (!last) {
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(cs + r * 16 + 8 * h, c[r][h]);
    return;
  }
  for (int r = 0; r < mr; ++r)
    for (int h = 0; h < 2; ++h) r16_store8(a, (m0 + r) * a.N + n0 + 8 * h, c[r][h]);
}

template <int BITS>
void r16_gemm_bits(const Args& a) {
  constexpr int MR = kR16GMR;
  const int64_t M = a.M, K = a.K, gs = a.group_size, G = K / gs;
  const int64_t P = ceil_div(M, MR);
  // The rows' x packed [P][K][MR] and their group sums [P][MR][G] (zero past M).
  float* ap = tl_x.get(static_cast<size_t>(P * MR * (K + G)));
  float* sxp = ap + P * MR * K;
  const Args* pa = &a;
  auto pack = [pa, ap, sxp, M, K, G, gs](int64_t p0, int64_t p1) {
    float* row = tl_t.get(static_cast<size_t>(K));
    for (int64_t p = p0; p < p1; ++p) {
      for (int r = 0; r < MR; ++r) {
        const int64_t m = p * MR + r;
        float* dst = ap + p * MR * K + r;
        float* sx = sxp + (p * MR + r) * G;
        if (m >= M) {
          for (int64_t k = 0; k < K; ++k) dst[k * MR] = 0.f;
          std::memset(sx, 0, sizeof(float) * G);
          continue;
        }
        cvt_row8(pa->x, pa->x_dtype, m * K, K, row);
        for (int64_t k = 0; k < K; ++k) dst[k * MR] = row[k];
        r16_group_sums(row, gs, G, sx);
      }
    }
  };
  par(P, 4, pack);
  const int64_t NB = a.N / 16;
  const int64_t kc_max = (kR16KC / gs > 0 ? kR16KC / gs : 1) * gs;
  int64_t pc = kR16BandBytes / (K * MR * 4);
  if (pc < kR16MinBandTiles) pc = kR16MinBandTiles;
  auto body = [pa, ap, sxp, K, M, G, gs, P, kc_max, pc, NB](int64_t t0, int64_t t1) {
    const Args& a = *pa;
    float* bp = tl_w.get(static_cast<size_t>(kc_max * 16 + 2 * (kc_max / gs) * 16));
    float* sp = bp + kc_max * 16;
    float* bq = sp + (kc_max / gs) * 16;
    float* cs = K > kc_max ? tl_c.get(static_cast<size_t>(P * MR * 16)) : nullptr;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pb = (t / NB) * pc, pe = pb + pc < P ? pb + pc : P;
      const int64_t blk = t % NB;
      for (int64_t kb = 0; kb < K; kb += kc_max) {
        const int64_t ke = kb + kc_max < K ? kb + kc_max : K;
        r16_code_panel<BITS>(a, blk, kb, ke, bp, sp, bq);
        for (int64_t p = pb; p < pe; ++p) {
          const int mr = static_cast<int>(M - p * MR < MR ? M - p * MR : MR);
          r16_micro(ap + (p * K + kb) * MR, bp, sp, bq, sxp + p * MR * G + kb / gs, G, (ke - kb) / gs,
                    gs, cs ? cs + p * MR * 16 : nullptr, kb == 0, ke == K, a, p * MR, mr, blk * 16);
        }
      }
    }
  };
  par_dynamic(ceil_div(P, pc) * NB, 1, body);
  tl_x.trim(kKeepScratchFloats);
}

constexpr int64_t kR16UnitBlocks = 4;
// Rows from which r16_matmul runs the code-panel GEMM: the default model's
// five shapes (its 8-bit head included) on a 2-core Zen 3, alternating runs
// (noisy): the tile ahead to 16 rows (8 rows 4.4 against 5.2-5.5 ms, 16
// rows 8.5-9.0 against 9.3-9.8), even at 24, the GEMM 20-30% ahead at 72
// and 512 rows (90-108 against 67-84 GFLOP/s per shape).
constexpr int64_t kR16GemmMinRows = 32;

// Every number of rows: from kR16GemmMinRows the code-panel GEMM, below it
// the tile (the same numbers). Work units: a run of blocks against a band of
// activation rows small enough to stay in L2 (kR16BandBytes of x) while
// the blocks pass over it; a block's weights come from memory once per
// band and from L1/L2 for its other passes.
void r16_matmul(const Args& a) {
  const int64_t M = a.M, K = a.K;
  if (M >= kR16GemmMinRows) return a.bits == 8 ? r16_gemm_bits<8>(a) : r16_gemm_bits<4>(a);
  float* xp = tl_x.get(gemv_prep_floats(a));
  r16_prepare(a, xp);
  int64_t band = kR16BandBytes / (K * 4) / kR16MM * kR16MM;
  if (band < kR16MM) band = kR16MM;
  if (band > M) band = M;
  const int64_t NB = a.N / 16, GB = ceil_div(NB, kR16UnitBlocks), MB = ceil_div(M, band);
  auto body = [&a, xp, band, NB, GB, M](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t m0 = (u / GB) * band, m1 = m0 + band < M ? m0 + band : M;
      const int64_t b0 = (u % GB) * kR16UnitBlocks;
      r16_run_blocks(a, xp, b0, b0 + kR16UnitBlocks < NB ? b0 + kR16UnitBlocks : NB, m0, m1);
    }
  };
  const int64_t units = MB * GB;
  par_dynamic(units, units / (8 * num_threads()), body);
  tl_x.trim(kKeepScratchFloats);
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
    cvt_row8(src, dt, off, n, dst);
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

void gemv_prepare_avx2(const Args& a, float* xp) {
  if (a.rows16) return r16_prepare(a, xp);
  Avx2::prepare_x(a, xp);
}

void gemv_block_avx2(const Args& a, const float* xp, int64_t n0, int64_t n1) {
  if (a.rows16) return r16_run_blocks(a, xp, n0 / 16, n1 / 16, 0, a.M);  // whole 16-row blocks
  Avx2Driver::gemv_unit(a, xp, n0, n1);
}

void run_avx2(const Args& a) {
  if (a.rows16) return r16_matmul(a);  // every M: one arithmetic (see above)
  Avx2Driver::run(a);
}

} // namespace qmm
} // namespace mlxfast
