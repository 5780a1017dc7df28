// AVX-512 (F/BW/VL/DQ) quantized matmul, bits 4 and 8 (others: portable).
//
// GEMV (M <= kGemvMaxRows): each thread streams its share of weight rows
// once. Activations are pre-permuted so that a 4-bit chunk of 32 values
// unpacks with one zero-extend + shift into "even" and "odd" lanes; the
// nibble -> float conversion is a 16-entry vpermps lookup whose table is the
// group's dequantized values (scale * i + bias); 8-bit values are converted
// and dequantized with one FMA. So every path computes y = dot(w, x) with w
// dequantized first: one formula whatever the number of rows, and no
// per-group rescaling. Up to 8 activation rows share each dequantized weight
// chunk, and each activation vector is loaded once for 2-4 weight rows (one
// accumulator per weight row x activation row, reduced together at the end
// of the tile).
//
// GEMM (M > kGemvMaxRows): activations packed once to fp32 panels of 12 rows
// ([K][12]); each thread dequantizes a 32-column weight panel ([K][32] fp32,
// L2-resident) and runs a 12x32 register-blocked FMA micro-kernel (24 zmm
// accumulators, activations broadcast from memory) over all row panels.
#include "cpu/qmm_x86.h"
#include "cpu/qmm_avx512.h"

namespace mlxfast {
namespace qmm {

namespace {

// Keeps loaded vectors in registers: left alone, GCC folds the load into
// every FMA that reads it (one load per weight row), and loads, not FMAs,
// then bound the GEMV (a standalone copy of the 8-row loop, two weight rows,
// L1-resident: 2.8 vs 3.3-3.7 G FMA/s per core).
inline void in_register(__m512& a) { asm("" : "+v"(a)); }
inline void in_register(__m512& a, __m512& b) { asm("" : "+v"(a), "+v"(b)); }
inline void in_register(__m512i& a) { asm("" : "+v"(a)); }

inline __m512 lut16() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

// 32 consecutive quantized values starting at value k0 of a packed row, as
// two fp32 vectors. BITS 4: lo = values k0+0,2,..,30, hi = k0+1,3,..,31.
// BITS 8: lo = k0+0..15, hi = k0+16..31.
template <int BITS>
inline void unpack32(const uint8_t* row, int64_t k0, __m512 lut, __m512& lo, __m512& hi) {
  if (BITS == 4) {
    __m512i q = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (k0 >> 1))));
    lo = _mm512_permutexvar_ps(q, lut);  // vpermps reads only index bits 3:0
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);
  } else {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 + 16))));
  }
}

// ---------------------------------------------------------------- GEMV ----

// y[m0 + m][n + r] for r < R, m < MM, written to yb[m * 16 + r]: weights
// dequantized 32 at a time (BITS 4: through the group's lookup table; BITS
// 8: converted, then scale * q + bias), then FMAs with every activation row:
// one accumulator per (weight row, activation row), each activation vector
// loaded into a register once for all R weight rows. With the compile-time
// group loop and the one-reduction tile end, the default model's 8-row
// matmuls for one step went from 18.5 to 17.2 ms (medians of 6 alternating
// runs). The 8-bit form costs one FMA per 16 weights more than rescaling
// per-group dot products at one row, and saves MM FMAs plus MM scalar bias
// terms per group at MM rows: the model's 8-bit head, 49152 x 576 at 8 rows,
// went from 5.3 to 3.4 ms; one row is memory-bound either way.
//
// Always inlined into its row loop: left to GCC, the one- and two-row tiles
// became calls once the driver (qmm_x86.h) inlined the loops into its
// dispatch, and one-row decode GEMVs ran ~7% slower.
//
// SYM (one activation row, biases == nullptr): the bias is -2^(bits-1) *
// scale, so the table is (i - 8) * scale and the 8-bit bias scale * -128,
// computed instead of loaded: one load and one pointer per weight row
// fewer. The same numbers: fma(i, s, -8s) and (i - 8) * s both round the
// exact (i - 8) * s once.
template <int BITS, int MM, int R, int CPG, bool SYM = false>
__attribute__((always_inline)) inline void gemv_tile(const GemvCtx& c, int64_t m0, int64_t n,
                                                     const float* sc, const float* bi,
                                                     float* yb) {
  const Args& a = *c.a;
  const int64_t G = c.G;
  const float* xc = c.xp + m0 * a.K;  // [K / 32][MM][32]: see prepare_x
  const __m512 lut = lut16();
  const __m512 lut_sym = _mm512_sub_ps(lut, _mm512_set1_ps(8.0f));
  const __m512 neg128 = _mm512_set1_ps(-128.0f);
  __m512 acc[R][MM];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = _mm512_setzero_ps();
  // Running pointers, not row * row_bytes + k / 2 per load: at one row the
  // address arithmetic was a third of the loop's instructions.
  const uint8_t* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const uint8_t*>(a.w) + (n + r) * c.row_bytes;
  const int64_t pf = kPrefetchRows * c.row_bytes;
  for (int64_t g = 0; g < G; ++g) {
    if ((g & 3) == 0) c.next->step();
    // BITS 4: the group's dequantized values as a lookup table; BITS 8:
    // scale and bias for one FMA per 16 values.
    __m512 s[R], b[R];
    for (int r = 0; r < R; ++r) {
      s[r] = _mm512_set1_ps(sc[r * G + g]);
      if constexpr (SYM) {
        if (BITS == 4) {
          s[r] = _mm512_mul_ps(lut_sym, s[r]);
        } else {
          b[r] = _mm512_mul_ps(s[r], neg128);
        }
      } else {
        b[r] = _mm512_set1_ps(bi[r * G + g]);
        if (BITS == 4) s[r] = _mm512_fmadd_ps(lut, s[r], b[r]);
      }
    }
    // CPG (chunks of 32 per group) is a compile-time count: at group size 32
    // a run-time inner loop cost a fifth of the tile's time in loop setup.
    for (int ch = 0; ch < CPG; ++ch, xc += 32 * MM) {
      // One prefetch per cache line of each row, not one per chunk (a 4-bit
      // chunk is a quarter line): fewer instructions in a loop that issues
      // ~12 per 16 bytes of weights.
      constexpr int kChunksPerLine = 64 / (BITS * 4);
      const bool line = ((g * CPG + ch) & (kChunksPerLine - 1)) == 0;
      __m512 lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        if (line) prefetch_weights(wr[r] + pf);
        if (BITS == 4) {
          __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr[r])));
          lo[r] = _mm512_permutexvar_ps(q, s[r]);  // vpermps reads only index bits 3:0
          hi[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), s[r]);
        } else {
          unpack32<8>(wr[r], 0, lut, lo[r], hi[r]);
          lo[r] = _mm512_fmadd_ps(lo[r], s[r], b[r]);
          hi[r] = _mm512_fmadd_ps(hi[r], s[r], b[r]);
        }
        wr[r] += BITS * 4;
      }
      for (int m = 0; m < MM; ++m) {
        __m512 xlo = _mm512_load_ps(xc + m * 32), xhi = _mm512_load_ps(xc + m * 32 + 16);
        in_register(xlo, xhi);
        for (int r = 0; r < R; ++r) {
          acc[r][m] = _mm512_fmadd_ps(lo[r], xlo, acc[r][m]);
          acc[r][m] = _mm512_fmadd_ps(hi[r], xhi, acc[r][m]);
        }
      }
    }
  }
  store_tile_sums(acc, yb);
}

// Dense weights (bits == 0): y[m0 + m][n + r] = x[m] . w[n + r] with the
// weight row converted to fp32 16 values at a time (masked tail: any K).
template <int MM, int R>
inline void gemv_tile_dense(const GemvCtx& c, int64_t m0, int64_t n, float* yb) {
  const Args& a = *c.a;
  const int64_t K = a.K;
  const char* w0 = static_cast<const char*>(a.w) + n * c.row_bytes;
  const int es = dtype_size(a.w_dtype);
  const float* xp = c.xp + m0 * K;
  __m512 acc[R][MM];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mk = tail_mask(K - k);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) {
      prefetch_weights(w0 + (r + kPrefetchRows) * c.row_bytes + k * es);
      wv[r] = load_cvt(w0 + r * c.row_bytes, a.w_dtype, k, mk);
    }
    for (int m = 0; m < MM; ++m) {
      __m512 xv = _mm512_maskz_loadu_ps(mk, xp + m * K + k);
      in_register(xv);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  store_tile_sums(acc, yb);
}

// Rows m0 .. m0+MM-1, columns [n0, n1): tiles of R weight rows, then one
// store per activation row.
template <int BITS, int MM, int CPG, bool SYM = false>
void gemv_tiles(const GemvCtx& c, int64_t m0, int64_t n0, int64_t n1, const float* sc,
                const float* bi) {
  // Weight rows per tile: each activation vector loaded serves R rows.
  constexpr int R = MM <= 4 ? 4 : 2;
  const int64_t G = c.G;
  alignas(64) float yb[MM * kGemvRowBlock];
  int64_t n = n0;
  if constexpr (BITS == 0) {
    for (; n + R <= n1; n += R) gemv_tile_dense<MM, R>(c, m0, n, yb + (n - n0));
    for (; n < n1; ++n) gemv_tile_dense<MM, 1>(c, m0, n, yb + (n - n0));
  } else {
    for (; n + R <= n1; n += R) {
      gemv_tile<BITS, MM, R, CPG, SYM>(c, m0, n, sc + (n - n0) * G, bi + (n - n0) * G,
                                       yb + (n - n0));
    }
    for (; n < n1; ++n) {
      gemv_tile<BITS, MM, 1, CPG, SYM>(c, m0, n, sc + (n - n0) * G, bi + (n - n0) * G,
                                       yb + (n - n0));
    }
  }
  const __mmask16 mk = tail_mask(n1 - n0);
  for (int m = 0; m < MM; ++m) {
    store_cvt(c.a->out, c.a->x_dtype, (m0 + m) * c.a->N + n0,
              _mm512_load_ps(yb + m * kGemvRowBlock), mk);
  }
}

// gemv_tiles, with the one-row symmetric tile where it applies (see gemv_tile).
template <int BITS, int MM, int CPG>
void gemv_tiles_sym(const GemvCtx& c, int64_t m0, int64_t n0, int64_t n1, const float* sc,
                    const float* bi) {
  if (MM == 1 && c.a->biases == nullptr) {
    gemv_tiles<BITS, MM, CPG, MM == 1>(c, m0, n0, n1, sc, bi);
  } else {
    gemv_tiles<BITS, MM, CPG>(c, m0, n0, n1, sc, bi);
  }
}

// ------------------------------------------------------ rows16 GEMV ----
//
// The row-interleaved layout (Args::rows16): lane r of a 64-byte word holds
// 8 (4-bit) or 4 (8-bit) values of row 16b + r, so 16 rows run in the lanes
// of one vector, and per group
//   y[m][rows] += s[g][rows] * sum_k q[k][rows] * x[m][k] + b[g][rows] * sum_k x[m][k]
// (MLX's own qmv form): each value is masked, converted with one
// cvtdq2ps and multiplied by a broadcast x, the scales and biases are one
// vector per group, and the 16 sums are the output: no per-group lookup
// table, no vpermps (the shuffle unit bound the MLX-layout tile), no
// horizontal reduction. One core, weights in L1/L2, group size 32: 2.25 ns
// per 32 weights and row in the lookup-table tile against 1.4 here (a
// standalone copy of both loops); an in-register transpose of the MLX
// layout into this one cost what it saved, hence the load-time repack.
// Each activation row's sums run in the same order whatever the number of
// rows (two chains, even and odd values of a word): rows stay
// batch-invariant.
constexpr int kRows16MM = 4;  // activation rows per pass over a block
// FMA chains per activation row (values t % kChains of a word): 4 measured
// as 2 at one row, in L2.
constexpr int kChains = 2;
// Software prefetch (first pass over a block only; prefetch_stream, into
// L1), in words (64 bytes) ahead: 4 KB. The default model's 120 GEMVs of a
// step from DRAM, 2 threads, alternating with the MLX-layout tile: 1.28-1.35x
// its speed with an L2 prefetch, 1.12-1.17x without; the L1 prefetch took a
// standalone copy from 23-24 to 28-29 GB/s (2 KB and 16 KB ahead alike).
constexpr int kRows16Ahead = 64;

// x as fp32 rows [M][K], value k scaled by 2^-b(k % v) (b = BITS, v =
// 32 / BITS values a word; the word's last value unscaled: see rows16_tile),
// then each row's group sums of the unscaled x [M][G] (fixed order).
// Row m's group sums of x (the GEMV's and the GEMM's: one order).
inline void rows16_group_sums(const Args& a, int64_t m, float* sx) {
  const int64_t K = a.K, gs = a.group_size, G = K / gs;
  for (int64_t g = 0; g < G; ++g) {
    __m512 t = _mm512_setzero_ps();
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 16)  // gs: a multiple of 16
      t = _mm512_add_ps(t, load_cvt(a.x, a.x_dtype, m * K + k, 0xffff));
    sx[g] = _mm512_reduce_add_ps(t);
  }
}

template <int BITS>
void rows16_prepare_bits(const Args& a, float* xp) {
  const int64_t M = a.M, K = a.K, gs = a.group_size, G = K / gs;
  float* sx = xp + M * K;
  const __m512 pow2 = BITS == 4 ? _mm512_setr_ps(1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f,
                                                 0x1p-24f, 1.f, 1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f,
                                                 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.f)
                                : _mm512_setr_ps(1.f, 0x1p-8f, 0x1p-16f, 1.f, 1.f, 0x1p-8f, 0x1p-16f,
                                                 1.f, 1.f, 0x1p-8f, 0x1p-16f, 1.f, 1.f, 0x1p-8f,
                                                 0x1p-16f, 1.f);
  for (int64_t m = 0; m < M; ++m) {
    float* row = xp + m * K;
    for (int64_t k = 0; k < K; k += 16)  // K: a multiple of the group size, of 16
      _mm512_storeu_ps(row + k, _mm512_mul_ps(load_cvt(a.x, a.x_dtype, m * K + k, 0xffff), pow2));
    rows16_group_sums(a, m, sx + m * G);
  }
}

inline void rows16_prepare(const Args& a, float* xp) {
  if (a.bits == 8) return rows16_prepare_bits<8>(a, xp);
  rows16_prepare_bits<4>(a, xp);
}

// Output columns 16 * blk .. +16 of activation rows m0 .. m0+MM-1. J: words
// per group (group size * BITS / 32), a compile-time count as CPG is for
// gemv_tile.
template <int BITS, int J, int MM, bool PF>
__attribute__((always_inline)) inline void rows16_tile(const Args& a, const float* xp,
                                                       int64_t blk, int64_t m0) {
  constexpr int V = 32 / BITS;  // values a word
  const int64_t K = a.K, G = K / a.group_size;
  const float* x = xp + m0 * K;
  const float* sx = xp + a.M * K + m0 * G;
  // Value t of a word is masked in place, (v & m << bt) = q * 2^bt, and
  // converted exactly (< 2^31); the x it meets was scaled by 2^-bt, so the
  // product is q * x exactly as with a shifted q (the FMA's rounding is the
  // same) while the shift is saved: V - 1 masks and a shift per word
  // instead of V - 1 shifts and V - 1 masks (4-bit, a standalone copy of
  // the loop: 1.40 -> 1.18 ns per 32 weights and row). Only |x| < 2^-102
  // would lose bits. The last value is shifted down (q << 28 or q << 24
  // could reach 2^31).
  __m512i mask[V - 1];
  for (int t = 0; t < V - 1; ++t) mask[t] = _mm512_set1_epi32(((1 << BITS) - 1) << (BITS * t));
  const __m512i* w = reinterpret_cast<const __m512i*>(a.w) + blk * (K * BITS / 32);
  const int64_t p0 = blk * G * 16;
  __m512 acc[MM];
  for (int m = 0; m < MM; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g, w += J, x += V * J) {
    __m512 d[kChains][MM];
    for (int c = 0; c < kChains; ++c)
      for (int m = 0; m < MM; ++m) d[c][m] = _mm512_setzero_ps();
    for (int j = 0; j < J; ++j) {
      if (PF) prefetch_stream(w + j + kRows16Ahead);
      __m512i v = _mm512_loadu_si512(w + j);
      in_register(v);  // one load, not one folded into each of the shifts
      for (int t = 0; t < V; ++t) {
        const __m512 q = _mm512_cvtepi32_ps(t == V - 1 ? _mm512_srli_epi32(v, 32 - BITS)
                                                       : _mm512_and_si512(v, mask[t]));
        for (int m = 0; m < MM; ++m) {
          d[t % kChains][m] = _mm512_fmadd_ps(q, _mm512_set1_ps(x[m * K + V * j + t]), d[t % kChains][m]);
        }
      }
    }
    const __m512 s = load_cvt(a.scales, a.s_dtype, p0 + g * 16, 0xffff);
    const __m512 b = a.biases ? load_cvt(a.biases, a.s_dtype, p0 + g * 16, 0xffff)
                              : _mm512_mul_ps(s, _mm512_set1_ps(sym_bias(BITS)));
    for (int m = 0; m < MM; ++m) {
      __m512 sum = d[0][m];
      for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, d[c][m]);
      acc[m] = _mm512_fmadd_ps(s, sum, acc[m]);
      acc[m] = _mm512_fmadd_ps(b, _mm512_set1_ps(sx[m * G + g]), acc[m]);
    }
  }
  for (int m = 0; m < MM; ++m) {
    store_cvt(a.out, a.x_dtype, (m0 + m) * a.N + blk * 16, acc[m], 0xffff);
  }
}

// The first pass over a block prefetches ahead; later passes (activation
// rows 5..16) find it in L1/L2.
template <int BITS, int J, int MM>
inline void rows16_pass(const Args& a, const float* xp, int64_t blk, int64_t m0) {
  if (m0 == 0) {
    rows16_tile<BITS, J, MM, true>(a, xp, blk, m0);
  } else {
    rows16_tile<BITS, J, MM, false>(a, xp, blk, m0);
  }
}

template <int BITS, int J>
void rows16_blocks(const Args& a, const float* xp, int64_t b0, int64_t b1) {
  for (int64_t blk = b0; blk < b1; ++blk) {
    for (int64_t m0 = 0; m0 < a.M; m0 += kRows16MM) {
      switch (a.M - m0 < kRows16MM ? a.M - m0 : kRows16MM) {
        case 1: rows16_pass<BITS, J, 1>(a, xp, blk, m0); break;
        case 2: rows16_pass<BITS, J, 2>(a, xp, blk, m0); break;
        case 3: rows16_pass<BITS, J, 3>(a, xp, blk, m0); break;
        default: rows16_pass<BITS, J, 4>(a, xp, blk, m0); break;
      }
    }
  }
}

// Blocks b0 .. b1 for the layer's bits and group size (J = words a group).
inline void rows16_run_blocks(const Args& a, const float* xp, int64_t b0, int64_t b1) {
  if (a.bits == 8) {
    switch (a.group_size) {
      case 32: return rows16_blocks<8, 8>(a, xp, b0, b1);
      case 64: return rows16_blocks<8, 16>(a, xp, b0, b1);
      default: return rows16_blocks<8, 32>(a, xp, b0, b1);
    }
  }
  switch (a.group_size) {
    case 32: return rows16_blocks<4, 4>(a, xp, b0, b1);
    case 64: return rows16_blocks<4, 8>(a, xp, b0, b1);
    default: return rows16_blocks<4, 16>(a, xp, b0, b1);
  }
}

void rows16_gemv(const Args& a) {
  float* xp = tl_x.get(gemv_prep_floats(a));
  rows16_prepare(a, xp);
  const int64_t blocks = a.N / 16;
  auto body = [&a, xp](int64_t b0, int64_t b1) { rows16_run_blocks(a, xp, b0, b1); };
  par_dynamic(blocks, blocks / (8 * num_threads()), body);
}

// The layout's GEMM above the GEMV's rows, to kRows16InvariantMaxRows
// (qmm.h), computes every output in the GEMV's arithmetic (rows16_tile):
// per group, the codes' products with x in two chains by k's parity, their
// sum scaled, then b times the row's group sum of x (rows16_group_sums: the
// same numbers). So a row's result is the same bit for bit in any call of
// up to that many rows: a speculative step's verify rows and the plain
// steps they stand for give one answer (greedy speculation is lossless
// only so). The codes are
// converted to floats once per panel (kR16NR columns: two row blocks, kKC
// keys of whole groups), then a micro-tile of kR16MR activation rows runs
// over it: 2 chains x 4 rows x 2 vectors plus 8 accumulators, 24 registers.
constexpr int kR16MR = 4;
constexpr int kR16NR = 32;

// Row blocks blk0, blk0 + 1 (nblk of them) at keys [kb, ke) as a float
// panel bp [ke - kb][kR16NR]: the codes, with their groups' scales and
// biases in sp and bq [groups][kR16NR] (rows16_gemm), or with DEQUANT the
// weights s * q + b (one rounding: the MLX-layout panel's values; the
// dequantized-panel GEMM, sp and bq unused). A missing second block reads
// as zero weights.
template <int BITS, bool DEQUANT>
void rows16_panel(const Args& a, int64_t blk0, int nblk, int64_t kb, int64_t ke, float* bp,
                  float* sp, float* bq) {
  constexpr int V = 32 / BITS;  // values a word
  const int64_t K = a.K, G = K / a.group_size, gs = a.group_size;
  const __m512i qmask = _mm512_set1_epi32((1 << BITS) - 1);
  for (int h = 0; h < 2; ++h) {
    if (h >= nblk) {
      for (int64_t k = kb; k < ke; ++k) _mm512_storeu_ps(bp + (k - kb) * kR16NR + 16, _mm512_setzero_ps());
      for (int64_t g = 0; !DEQUANT && g < (ke - kb) / gs; ++g) {
        _mm512_storeu_ps(sp + g * kR16NR + 16, _mm512_setzero_ps());
        _mm512_storeu_ps(bq + g * kR16NR + 16, _mm512_setzero_ps());
      }
      continue;
    }
    const int64_t blk = blk0 + h;
    const __m512i* w = reinterpret_cast<const __m512i*>(a.w) + blk * (K * BITS / 32);
    for (int64_t g = kb / gs; g < ke / gs; ++g) {
      const int64_t p = (blk * G + g) * 16;
      const __m512 s = load_cvt(a.scales, a.s_dtype, p, 0xffff);
      const __m512 b = a.biases ? load_cvt(a.biases, a.s_dtype, p, 0xffff)
                                : _mm512_mul_ps(s, _mm512_set1_ps(sym_bias(BITS)));
      if (!DEQUANT) {
        _mm512_storeu_ps(sp + (g - kb / gs) * kR16NR + 16 * h, s);
        _mm512_storeu_ps(bq + (g - kb / gs) * kR16NR + 16 * h, b);
      }
      for (int64_t j = g * gs / V; j < (g + 1) * gs / V; ++j) {
        const __m512i v = _mm512_loadu_si512(w + j);
        float* dst = bp + (V * j - kb) * kR16NR + 16 * h;
        for (int t = 0; t < V; ++t) {
          const __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, BITS * t), qmask));
          _mm512_storeu_ps(dst + t * kR16NR, DEQUANT ? _mm512_fmadd_ps(q, s, b) : q);
        }
      }
    }
  }
}

// Activation rows m0 .. m0 + mr - 1 (ap: their x, [k][kR16MR] from kb) over
// the panel's ng groups; sx: the rows' group sums [kR16MR][G] from the
// panel's first group. The accumulators continue from cs (first: zero) and
// go back there, or to the output (last).
inline void rows16_micro(const float* ap, const float* bp, const float* sp, const float* bq,
                         const float* sx, int64_t G, int64_t ng, int gs, float* cs, bool first,
                         bool last, const Args& a, int64_t m0, int mr, int64_t n0, int nblk) {
  constexpr int MR = kR16MR;
  __m512 c[MR][2];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 2; ++v)
      c[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(cs + r * kR16NR + 16 * v);
  for (int64_t g = 0; g < ng; ++g) {
    __m512 d[2][MR][2];  // chains by k's parity, as rows16_tile's kChains
    for (int e = 0; e < 2; ++e)
      for (int r = 0; r < MR; ++r) d[e][r][0] = d[e][r][1] = _mm512_setzero_ps();
    for (int k = 0; k < gs; k += 2) {
      for (int e = 0; e < 2; ++e) {
        const __m512 b0 = _mm512_loadu_ps(bp), b1 = _mm512_loadu_ps(bp + 16);
        for (int r = 0; r < MR; ++r) {
          const __m512 x = _mm512_set1_ps(ap[r]);
          d[e][r][0] = _mm512_fmadd_ps(b0, x, d[e][r][0]);
          d[e][r][1] = _mm512_fmadd_ps(b1, x, d[e][r][1]);
        }
        bp += kR16NR;
        ap += MR;
      }
    }
    for (int v = 0; v < 2; ++v) {
      const __m512 s = _mm512_loadu_ps(sp + g * kR16NR + 16 * v);
      const __m512 b = _mm512_loadu_ps(bq + g * kR16NR + 16 * v);
      for (int r = 0; r < MR; ++r) {
        c[r][v] = _mm512_fmadd_ps(s, _mm512_add_ps(d[0][r][v], d[1][r][v]), c[r][v]);
        c[r][v] = _mm512_fmadd_ps(b, _mm512_set1_ps(sx[r * G + g]), c[r][v]);
      }
    }
  }
  if (!last) {
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 2; ++v) _mm512_storeu_ps(cs + r * kR16NR + 16 * v, c[r][v]);
    return;
  }
  for (int r = 0; r < mr; ++r)
    for (int v = 0; v < nblk; ++v)
      store_cvt(a.out, a.x_dtype, (m0 + r) * a.N + n0 + 16 * v, c[r][v], 0xffff);
}

template <int BITS>
void rows16_gemm_bits(const Args& a) {
  constexpr int MR = kR16MR;
  const int64_t M = a.M, N = a.N, K = a.K, gs = a.group_size, G = K / gs;
  const int64_t P = ceil_div(M, MR);
  // The rows' x packed [P][K][MR] and their group sums [P][MR][G] (zero past M).
  float* ap = tl_x.get(static_cast<size_t>(P * MR * (K + G)));
  float* sxp = ap + P * MR * K;
  const Args* pa = &a;
  auto pack = [pa, ap, sxp, M, K, G](int64_t p0, int64_t p1) {
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
        for (int64_t k0 = 0; k0 < K; k0 += 16) {
          alignas(64) float t[16];
          _mm512_store_ps(t, load_cvt(pa->x, pa->x_dtype, m * K + k0, 0xffff));
          for (int i = 0; i < 16; ++i) dst[(k0 + i) * MR] = t[i];
        }
        rows16_group_sums(*pa, m, sx);
      }
    }
  };
  par(P, 4, pack);
  const int64_t NB = ceil_div(N / 16, 2);  // panels of two row blocks
  const int64_t kc_max = (kKC / gs > 0 ? kKC / gs : 1) * gs;
  const int64_t pc = kABlockBytes / (K * MR * 4) > 1 ? kABlockBytes / (K * MR * 4) : 1;
  auto body = [pa, ap, sxp, K, M, G, gs, P, kc_max, pc, NB](int64_t t0, int64_t t1) {
    const Args& a = *pa;
    float* bp = tl_w.get(static_cast<size_t>(kc_max * kR16NR + 2 * (kc_max / gs) * kR16NR));
    float* sp = bp + kc_max * kR16NR;
    float* bq = sp + (kc_max / gs) * kR16NR;
    float* cs = K > kc_max ? tl_c.get(static_cast<size_t>(P * MR * kR16NR)) : nullptr;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pb = (t / NB) * pc, pe = pb + pc < P ? pb + pc : P;
      const int64_t blk0 = (t % NB) * 2;
      const int nblk = blk0 + 1 < a.N / 16 ? 2 : 1;
      for (int64_t kb = 0; kb < K; kb += kc_max) {
        const int64_t ke = kb + kc_max < K ? kb + kc_max : K;
        rows16_panel<BITS, false>(a, blk0, nblk, kb, ke, bp, sp, bq);
        for (int64_t p = pb; p < pe; ++p) {
          const int mr = static_cast<int>(M - p * MR < MR ? M - p * MR : MR);
          rows16_micro(ap + (p * K + kb) * MR, bp, sp, bq, sxp + p * MR * G + kb / gs, G,
                       (ke - kb) / gs, static_cast<int>(gs), cs ? cs + p * MR * kR16NR : nullptr,
                       kb == 0, ke == K, a, p * MR, mr, blk0 * 16, nblk);
        }
      }
    }
  };
  par_dynamic(ceil_div(P, pc) * NB, 1, body);
  tl_x.trim(kKeepScratchFloats);
}

void rows16_gemm(const Args& a) {
  if (a.bits == 8) return rows16_gemm_bits<8>(a);
  rows16_gemm_bits<4>(a);
}

// The kernels Driver<Avx512> runs (see qmm_x86.h).
struct Avx512 {
  static constexpr int kGemvMaxMM = 8;
  static constexpr bool kSymmetricOneRow = true;
  static constexpr int kMR = 12;
  static constexpr int kNR = 32;

  using Vec = __m512;
  static constexpr int kLanes = 16;
  static Vec vzero() { return _mm512_setzero_ps(); }
  static Vec vload(const float* p) { return _mm512_load_ps(p); }
  static void vstore(float* p, Vec v) { _mm512_store_ps(p, v); }
  static void vstoreu(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
  static Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static void vstore_out(void* out, DType dt, int64_t i, Vec v, int64_t n) {
    store_cvt(out, dt, i, v, tail_mask(n));
  }

  static void cvt_row(const void* src, DType dt, int64_t off, int64_t n, float* dst) {
    int64_t i = 0;
    if (dt == F16) {
      const uint16_t* h = static_cast<const uint16_t*>(src) + off;
      for (; i + 16 <= n; i += 16) {
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
      }
    }
    for (; i < n; i += 16) {
      __mmask16 m = tail_mask(n - i);
      _mm512_mask_storeu_ps(dst + i, m, load_cvt(src, dt, off + i, m));
    }
  }

  // CPG, the 32-value chunks per group, is a compile-time count (see gemv_tile).
  template <int BITS, int MM>
  static void gemv_rows(const GemvCtx& c, int64_t m0, int64_t n0, int64_t n1, const float* sc,
                        const float* bi) {
    if constexpr (BITS == 0) {
      gemv_tiles<0, MM, 0>(c, m0, n0, n1, sc, bi);
    } else {
      switch (c.a->group_size) {
        case 32: gemv_tiles_sym<BITS, MM, 1>(c, m0, n0, n1, sc, bi); break;
        case 64: gemv_tiles_sym<BITS, MM, 2>(c, m0, n0, n1, sc, bi); break;
        default: gemv_tiles_sym<BITS, MM, 4>(c, m0, n0, n1, sc, bi); break;
      }
    }
  }

  // Activations as fp32 into xp ((M + 1) * K floats). Dense weights read rows
  // [M][K]. Quantized weights read blocks of up to 8 rows interleaved per
  // 32-value chunk, [K / 32][mm][32] (4 bits: each chunk permuted to even then
  // odd values), so that the tile addresses every activation vector of a chunk
  // as one pointer plus a constant: indexed (base + index) memory operands of
  // the FMAs are split into two uops on Intel cores (8 rows of 3072 x 576,
  // single thread: ~2.0 -> 2.05-2.2 G FMA/s, near this machine's noise).
  static void prepare_x(const Args& a, float* xp) {
    const int64_t M = a.M, K = a.K;
    if (a.bits == 0) {
      for (int64_t m = 0; m < M; ++m) cvt_row(a.x, a.x_dtype, m * K, K, xp + m * K);
      return;
    }
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                           24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    float* row = xp + M * K;
    for (int64_t m0 = 0; m0 < M; m0 += kGemvMaxMM) {
      const int64_t mm = M - m0 < kGemvMaxMM ? M - m0 : kGemvMaxMM;
      for (int64_t m = 0; m < mm; ++m) {
        cvt_row(a.x, a.x_dtype, (m0 + m) * K, K, row);
        float* dst = xp + m0 * K + m * 32;
        for (int64_t k = 0; k < K; k += 32, dst += mm * 32) {
          __m512 v0 = _mm512_loadu_ps(row + k), v1 = _mm512_loadu_ps(row + k + 16);
          if (a.bits == 4) {
            const __m512 e = _mm512_permutex2var_ps(v0, even, v1);
            v1 = _mm512_permutex2var_ps(v0, odd, v1);
            v0 = e;
          }
          _mm512_store_ps(dst, v0);
          _mm512_store_ps(dst + 16, v1);
        }
      }
    }
  }

  // Dequantize weight rows n0..n0+31 into bp[K][32] (fp32; rows >= N are 0).
  // 16 rows at a time: the packed bytes of one 32-value chunk of each row are
  // transposed in registers so that each zero-extended vector holds one k
  // across 16 columns; scale/bias vectors come from a gather per group.
  // sb: the panel's scales then biases as fp32 ([32][G] each, see load_sb).
  // Fills k in [kb, ke) (group-aligned) at bp[(k - kb) * 32].
  template <int BITS>
  static void dequant_panel(const Args& a, int64_t n0, int64_t kb, int64_t ke, float* bp,
                            const float* sb) {
    if (a.rows16) return dequant_panel_rows16<BITS>(a, n0, kb, ke, bp);
    const int64_t K = a.K, G = K / a.group_size, gs = a.group_size;
    const int64_t row_bytes = K * BITS / 8;
    const int64_t ncols = a.N - n0 < kNR ? a.N - n0 : kNR;
    const float* scf = sb;
    const float* bif = sb + kNR * G;
    const __m512 lut = lut16();
    const __m512i gidx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(static_cast<int>(G)));
    const uint8_t* w = reinterpret_cast<const uint8_t*>(a.w);
    for (int half = 0; half < 2; ++half) {
      const int64_t j0 = half * 16;
      for (int64_t g = kb / gs; g < ke / gs; ++g) {
        const __m512 s = _mm512_i32gather_ps(gidx, scf + j0 * G + g, 4);
        const __m512 b = _mm512_i32gather_ps(gidx, bif + j0 * G + g, 4);
        for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += (BITS == 4 ? 32 : 16)) {
          __m128i r[16], t[16];
          const int64_t off = BITS == 4 ? (k0 >> 1) : k0;
          for (int j = 0; j < 16; ++j) {
            r[j] = (j0 + j < ncols)
                       ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                             w + (n0 + j0 + j) * row_bytes + off))
                       : _mm_setzero_si128();
          }
          transpose16x16_u8(r, t);
          float* dst = bp + (k0 - kb) * kNR + j0;
          for (int i = 0; i < 16; ++i) {
            __m512i z = _mm512_cvtepu8_epi32(t[i]);
            if (BITS == 4) {
              _mm512_storeu_ps(dst + (2 * i) * kNR,
                               _mm512_fmadd_ps(_mm512_permutexvar_ps(z, lut), s, b));
              _mm512_storeu_ps(dst + (2 * i + 1) * kNR,
                               _mm512_fmadd_ps(_mm512_permutexvar_ps(
                                                   _mm512_srli_epi32(z, 4), lut),
                                               s, b));
            } else {
              _mm512_storeu_ps(dst + i * kNR, _mm512_fmadd_ps(_mm512_cvtepi32_ps(z), s, b));
            }
          }
        }
      }
    }
  }

  // dequant_panel for the row-interleaved layout (Args::rows16, bits 4 or
  // 8): each 16-column half is one row block (N % 16 == 0: a missing half
  // is whole).
  template <int BITS>
  static void dequant_panel_rows16(const Args& a, int64_t n0, int64_t kb, int64_t ke,
                                   float* bp) {
    static_assert(kNR == kR16NR, "the panel's columns: two row blocks");
    rows16_panel<BITS, true>(a, n0 >> 4, n0 + 16 < a.N ? 2 : 1, kb, ke, bp, nullptr, nullptr);
  }
};

using Avx512Driver = Driver<Avx512>;

} // namespace

void gemv_prepare_avx512(const Args& a, float* xp) {
  if (a.rows16) return rows16_prepare(a, xp);
  Avx512::prepare_x(a, xp);
}

void gemv_block_avx512(const Args& a, const float* xp, int64_t n0, int64_t n1) {
  if (a.rows16) return rows16_run_blocks(a, xp, n0 / 16, n1 / 16);  // whole 16-row blocks
  Avx512Driver::gemv_unit(a, xp, n0, n1);
}

void run_avx512(const Args& a) {
  if (a.rows16) {  // the layout's own kernels (the MLX-layout GEMV can't read it)
    if (a.M <= rows16_gemv_max_rows(a.bits)) return rows16_gemv(a);
    if (a.M <= kRows16InvariantMaxRows) return rows16_gemm(a);
    return Avx512Driver::gemm(a);
  }
  Avx512Driver::run(a);
}

} // namespace qmm
} // namespace mlxfast
