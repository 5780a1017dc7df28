// Int8-activation quantized matmul, AVX-512 VNNI (vpdpbusd), bits 4 and 8
// (others: run_int8_portable). Entered only where cpu_has_avx512_vnni().
//
// Activations: each row of x is quantized in blocks of kActBlock (32) values
// (quantize_block's numbers, vectorized: d = max|x| / 127, xq = rint(x * 127
// / max|x|)) into the byte order the weights' natural loads have, so that
// one vpdpbusd multiplies 64 unsigned weight values by 64 int8 activations
// and adds each group of 4 products into one int32 lane:
//   4 bits: a chunk is 128 values, 64 packed bytes; (byte & 15) holds the
//           even values, (byte >> 4) the odd ones, so the chunk's activations
//           are stored as its 64 even values, then its 64 odd ones; lane l
//           covers values 8l .. 8l+7 (block 4c + l / 4 of chunk c);
//   8 bits: a chunk is 64 values in their order; lane l covers 4l .. 4l+3
//           (block 2c + l / 8).
// Every lane lies in one block (and one weight group), so per chunk and
// (weight row, activation row) the int32 lanes are converted once, scaled by
// the lane's d (activation) and scale (weight) and added into an fp32
// accumulator: 2 (4 bits) or 1 (8 bits) vpdpbusd + cvt + mul + FMA per 128 /
// 64 values, against 8 / 4 FMAs plus the lookups of the fp32 GEMV. The bias
// term, sum over blocks of bias * (d * sum(xq)), is one FMA per 16 blocks.
// The accumulators are reduced horizontally once, at the tile's end.
//
// That GEMV tile runs up to kInt8GemvMaxRows (7) activation rows; more rows
// run the GEMM below (weights re-laid per 16 rows so that the int32 lanes
// are whole block sums: one conversion per 32 values instead of per 64 or
// 128).
#include "common/cpu_features.h"
#include "cpu/qmm_x86.h"
#include "cpu/qmm_avx512.h"
#include "cpu/transpose_avx512.h"

namespace mlxfast {
namespace qmm {

namespace {

constexpr int kMaxMM = 8;  // activation rows per register block

// The prepared activations of a.M rows.
struct Int8Ctx {
  const Args* a;
  const int8_t* xq;  // [M][Kp] int8 in the chunk byte order above (0 past K)
  const float* dl;   // [M][Kp / VPL] d of each lane's block
  const float* sxb;  // [M][Bp] d * sum(xq) of each block (0 past K / 32)
  int64_t G, row_bytes, Kp, nl, Bp;
  __mmask64 tail;  // the weight bytes of a row's last chunk
  ParamPrefetch* next = nullptr;  // per row block: the next one's parameters
};

template <int BITS>
constexpr int64_t vpc() { return BITS == 4 ? 128 : 64; }  // values per chunk (16 lanes)

inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

inline void cvt_row(const void* src, DType dt, int64_t off, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(dst + i, m, load_cvt(src, dt, off + i, m));
  }
}

// One 32-value block of x to int8 (blk), vectorized quantize_block (same
// operations, same numbers): returns d, and d * sum(xq) in *sx.
inline float quantize_block32(const float* x, int8_t* blk, float* sx) {
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(
      _mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_and_ps(v1, absmask)));
  if (!(amax > 0.0f)) {
    std::memset(blk, 0, kActBlock);
    *sx = 0.0f;
    return 0.0f;
  }
  const float d = amax / 127.0f;
  const __m512 id = _mm512_set1_ps(127.0f / amax);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));  // round to nearest even
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(blk), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(blk + 16), _mm512_cvtepi32_epi8(q1));
  *sx = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  return d;
}

// Row m of a.x quantized into c's buffers (tmp: K floats).
template <int BITS>
void prepare_row(const Int8Ctx& c, int64_t m, float* tmp) {
  const Args& a = *c.a;
  const int64_t K = a.K, B = K / kActBlock;
  constexpr int64_t VPC = vpc<BITS>();
  cvt_row(a.x, a.x_dtype, m * K, K, tmp);
  int8_t* xq = const_cast<int8_t*>(c.xq) + m * c.Kp;
  float* dl = const_cast<float*>(c.dl) + m * c.nl;
  float* sxb = const_cast<float*>(c.sxb) + m * c.Bp;
  alignas(64) int8_t blk[kActBlock];
  for (int64_t b = 0; b < B; ++b) {
    const float d = quantize_block32(tmp + b * 32, blk, sxb + b);
    // Into the chunk byte order.
    const int64_t k0 = b * kActBlock, ch = k0 / VPC, o = k0 % VPC;
    int8_t* dst = xq + ch * VPC;
    if (BITS == 4) {
      for (int i = 0; i < 16; ++i) {
        dst[o / 2 + i] = blk[2 * i];
        dst[64 + o / 2 + i] = blk[2 * i + 1];
      }
      for (int l = 0; l < 4; ++l) dl[ch * 16 + o / 8 + l] = d;
    } else {
      std::memcpy(dst + o, blk, kActBlock);
      for (int l = 0; l < 8; ++l) dl[ch * 16 + o / 4 + l] = d;
    }
  }
  // Padding: the last chunk past K, the blocks up to Bp.
  const int64_t kpad = c.Kp - K;
  if (kpad) {
    const int64_t ch = K / VPC, o = K % VPC;
    int8_t* dst = xq + ch * VPC;
    if (BITS == 4) {
      std::memset(dst + o / 2, 0, (VPC - o) / 2);
      std::memset(dst + 64 + o / 2, 0, (VPC - o) / 2);
    } else {
      std::memset(dst + o, 0, VPC - o);
    }
    for (int64_t l = ch * 16 + o * 16 / VPC; l < c.nl; ++l) dl[l] = 0.0f;
  }
  for (int64_t b = B; b < c.Bp; ++b) sxb[b] = 0.0f;
}

// Lane l of chunk ch reads group ch * VPC / GS + idx[l] of a weight row's
// scales.
template <int BITS, int GS>
inline __m512i group_lanes() {
  constexpr int VPC = vpc<BITS>(), VPL = VPC / 16;
  if constexpr (GS >= VPC) return _mm512_setzero_si512();
  return _mm512_setr_epi32(0 * VPL / GS, 1 * VPL / GS, 2 * VPL / GS, 3 * VPL / GS, 4 * VPL / GS,
                           5 * VPL / GS, 6 * VPL / GS, 7 * VPL / GS, 8 * VPL / GS, 9 * VPL / GS,
                           10 * VPL / GS, 11 * VPL / GS, 12 * VPL / GS, 13 * VPL / GS,
                           14 * VPL / GS, 15 * VPL / GS);
}

// Lane j of 16 blocks from block b0 reads group b0 * 32 / GS + idx[j].
template <int GS>
inline __m512i block_groups() {
  constexpr int F = GS / kActBlock;
  return _mm512_setr_epi32(0 / F, 1 / F, 2 / F, 3 / F, 4 / F, 5 / F, 6 / F, 7 / F, 8 / F, 9 / F,
                           10 / F, 11 / F, 12 / F, 13 / F, 14 / F, 15 / F);
}

// Up to 8 consecutive parameters (scales) of dtype SD from p[i] as fp32
// lanes 0..7 (n valid; the rest 0): two chunks span at most 8 groups.
template <DType SD>
inline __m256 load_params8(const void* p, int64_t i, int64_t n) {
  const __mmask8 m = n >= 8 ? 0xff : static_cast<__mmask8>((1u << n) - 1u);
  if constexpr (SD == F32) return _mm256_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
  const __m128i h = _mm_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i);
  if constexpr (SD == F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// y[m0 + m][n + r] for r < R, m < MM into yb[m * kGemvRowBlock + r]. The
// rows' scales (and biases; none: symmetric, bias = sym_bias * scale) are
// read in their dtype SD where they are used: a conversion pass into an
// fp32 buffer per 16-row block cost ~7% of a MoE decode (its loads missed).
template <int BITS, int GS, int MM, int R, DType SD, bool GF>
__attribute__((always_inline)) inline void tile(const Int8Ctx& c, int64_t m0, int64_t n,
                                                float* yb) {
  const Args& a = *c.a;
  constexpr int64_t VPC = vpc<BITS>();
  constexpr int64_t CB = VPC * BITS / 8;  // packed bytes per chunk (64)
  const int64_t K = a.K, G = c.G;
  const int64_t nch = c.Kp / VPC;
  const __mmask64 tail = c.tail;
  const __m512i idx = group_lanes<BITS, GS>();
  const __m512i nib = _mm512_set1_epi8(0x0f);
  const __m512i matrix = _mm512_set1_epi64(0x1020408000000000ll);  // high_nibbles
  __m512 acc[R][MM];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = _mm512_setzero_ps();
  const uint8_t* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const uint8_t*>(a.w) + (n + r) * c.row_bytes;
  const int64_t pf = kPrefetchRows * c.row_bytes;
  const int8_t* xq = c.xq + m0 * c.Kp;
  const float* dl = c.dl + m0 * c.nl;
  const int64_t p0 = n * G;  // the first row's first parameter
  // Chunk ch + 1's lanes read its groups from the pair's first group on.
  const __m512i idx1 = _mm512_add_epi32(idx, _mm512_set1_epi32(GS <= VPC ? VPC / GS : 0));
  // One chunk, its rows' scales from pv (the pair's parameters).
  auto chunk = [&](int64_t ch, __m512i ix, const __m512 (&pv)[R]) __attribute__((always_inline)) {
    c.next->step();
    const __mmask64 wm = ch + 1 < nch ? ~0ull : tail;
    __m512i lo[R], hi[R];
    __m512 sv[R];
    for (int r = 0; r < R; ++r) {
      prefetch_weights(wr[r] + pf);
      const __m512i w = _mm512_maskz_loadu_epi8(wm, wr[r]);
      wr[r] += CB;
      if (BITS == 4) {
        lo[r] = _mm512_and_si512(w, nib);
        hi[r] = high_nibbles<GF>(w, nib, matrix);
      } else {
        lo[r] = w;
      }
      sv[r] = _mm512_permutexvar_ps(ix, pv[r]);
    }
    for (int m = 0; m < MM; ++m) {
      const int8_t* xm = xq + m * c.Kp + ch * VPC;
      const __m512i xa = _mm512_load_si512(xm);
      const __m512i xb = BITS == 4 ? _mm512_load_si512(xm + 64) : xa;
      const __m512 dv = _mm512_load_ps(dl + m * c.nl + ch * 16);
      for (int r = 0; r < R; ++r) {
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], xa);
        if (BITS == 4) s = _mm512_dpbusd_epi32(s, hi[r], xb);
        acc[r][m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), dv), sv[r], acc[r][m]);
      }
    }
  };
  // Chunks in pairs: one load and conversion of the scales for both.
  for (int64_t ch = 0; ch < nch; ch += 2) {
    const int64_t g0 = ch * VPC / GS;
    __m512 pv[R];
    for (int r = 0; r < R; ++r) {
      pv[r] = _mm512_castps256_ps512(load_params8<SD>(a.scales, p0 + r * G + g0, G - g0));
    }
    chunk(ch, idx, pv);
    if (ch + 1 < nch) chunk(ch + 1, idx1, pv);
  }
  // + bias * (d * sum(xq)) per block: block b is in group b * 32 / gs.
  const int64_t B = K / kActBlock;
  const __m512i bidx = block_groups<GS>();
  const float* sxb = c.sxb + m0 * c.Bp;
  for (int64_t b0 = 0; b0 < B; b0 += 16) {
    const int64_t g0 = b0 * kActBlock / GS;
    const __mmask16 gm = tail_mask(G - g0);
    __m512 bv[R];
    for (int r = 0; r < R; ++r) {
      const __m512 v = a.biases ? load_cvt(a.biases, SD, p0 + r * G + g0, gm)
                                : _mm512_mul_ps(load_cvt(a.scales, SD, p0 + r * G + g0, gm),
                                                _mm512_set1_ps(sym_bias(BITS)));
      bv[r] = _mm512_permutexvar_ps(bidx, v);
    }
    for (int m = 0; m < MM; ++m) {
      const __m512 s = _mm512_load_ps(sxb + m * c.Bp + b0);  // 0 past B
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(bv[r], s, acc[r][m]);
    }
  }
  store_tile_sums(acc, yb);
}

// Rows m0 .. m0+MM-1, columns [n0, n1).
template <int BITS, int GS, int MM, DType SD, bool GF>
void tiles(const Int8Ctx& c, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int R = MM <= 3 ? 4 : 2;
  alignas(64) float yb[MM * kGemvRowBlock];
  int64_t n = n0;
  for (; n + R <= n1; n += R) tile<BITS, GS, MM, R, SD, GF>(c, m0, n, yb + (n - n0));
  for (; n < n1; ++n) tile<BITS, GS, MM, 1, SD, GF>(c, m0, n, yb + (n - n0));
  const __mmask16 mk = tail_mask(n1 - n0);
  for (int m = 0; m < MM; ++m) {
    store_cvt(c.a->out, c.a->x_dtype, (m0 + m) * c.a->N + n0,
              _mm512_load_ps(yb + m * kGemvRowBlock), mk);
  }
}

template <int BITS, int GS, DType SD, bool GF, int MM = 1>
void rows(const Int8Ctx& c, int64_t m0, int mm, int64_t n0, int64_t n1) {
  if constexpr (MM < kMaxMM) {
    if (mm > MM) return rows<BITS, GS, SD, GF, MM + 1>(c, m0, mm, n0, n1);
  }
  tiles<BITS, GS, MM, SD, GF>(c, m0, n0, n1);
}

template <int BITS, int GS, bool GF>
void rows_dtype(const Int8Ctx& c, int64_t m0, int mm, int64_t n0, int64_t n1) {
  switch (c.a->s_dtype) {
    case F32: rows<BITS, GS, F32, GF>(c, m0, mm, n0, n1); break;
    case F16: rows<BITS, GS, F16, GF>(c, m0, mm, n0, n1); break;
    default: rows<BITS, GS, BF16, GF>(c, m0, mm, n0, n1); break;
  }
}

// 4 bits: with GFNI where the CPU has it (high_nibbles); 8 bits take none.
template <int BITS, int GS>
void rows_gfni(const Int8Ctx& c, int64_t m0, int mm, int64_t n0, int64_t n1) {
  if constexpr (BITS == 4) {
    static const bool gf = cpu_has_gfni();
    if (gf) return rows_dtype<BITS, GS, true>(c, m0, mm, n0, n1);
  }
  rows_dtype<BITS, GS, false>(c, m0, mm, n0, n1);
}

// Output rows [m_begin, m_end), columns [n0, n1) (at most kGemvRowBlock).
template <int BITS>
void unit(const Int8Ctx& shared, int64_t m_begin, int64_t m_end, int64_t n0, int64_t n1) {
  Int8Ctx c = shared;
  const Args& a = *c.a;
  ParamPrefetch next = next_params(a, n1, kGemvRowBlock, c.G);
  c.next = &next;  // this thread's copy of the context
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kMaxMM) {
    const int mm = static_cast<int>(m_end - m0 < kMaxMM ? m_end - m0 : kMaxMM);
    switch (a.group_size) {
      case 32: rows_gfni<BITS, 32>(c, m0, mm, n0, n1); break;
      case 64: rows_gfni<BITS, 64>(c, m0, mm, n0, n1); break;
      default: rows_gfni<BITS, 128>(c, m0, mm, n0, n1); break;
    }
  }
}


// ---------------------------------------------------------------- GEMM ----
//
// M > kGemvMaxRows: the weights are re-laid once per task so that one zmm
// holds the same 4 values of 16 weight rows, [k / 4][16 rows][4 bytes] u8
// (4-bit values unpacked to bytes): a 32-value block is then 8 vpdpbusd
// per activation row into one int32 vector whose lanes are the 16 rows'
// complete block sums, converted and scaled once per block:
//   acc[m] += cvt(isum) * d[m][b] * scale[rows][b] + bias[rows][b] * sx[m][b]
// The 12 x 16 micro-tile keeps 12 int32 and 12 fp32 accumulators; the
// activations (4 bytes of a row) are broadcast from memory into vpdpbusd.
// Activations are quantized once and packed per 12 rows as
// [block][8][12 rows][4 bytes], with d and d * sum(xq) as [block][12].

constexpr int kGNR = 16;  // weight rows per micro-tile (one zmm of lanes)

// Rows up to which the GEMV tile runs; the GEMM from 8 rows on. The default
// model's matmul shapes for one step, one thread, interleaved runs (int8
// GEMV vs GEMM): 6 rows 2.18 vs 2.68 ms, 8 rows 3.11 vs 2.87 ms, 16 rows
// 5.70 vs 3.66 ms (the 8-bit head: GEMV ~1.0x of fp32, GEMM 1.6x). Hence
// kInt8GemvMaxRows (qmm.h) = 7.

struct GemmCtx {
  const Args* a;
  const int8_t* ap;  // [P][B][8][MR][4]
  const float* ad;   // [P][B][MR] d
  const float* as;   // [P][B][MR] d * sum(xq)
  int64_t B, P;
};

// Quantize rows p*MR .. +MR-1 of a.x into panel p (missing rows: 0).
template <int BITS, int kGMR>
void pack_rows(const GemmCtx& c, int64_t p, float* tmp) {
  const Args& a = *c.a;
  const int64_t K = a.K, B = c.B;
  int8_t* ap = const_cast<int8_t*>(c.ap) + p * B * 32 * kGMR;
  float* ad = const_cast<float*>(c.ad) + p * B * kGMR;
  float* as = const_cast<float*>(c.as) + p * B * kGMR;
  for (int r = 0; r < kGMR; ++r) {
    const int64_t m = p * kGMR + r;
    if (m >= a.M) {
      for (int64_t b = 0; b < B; ++b) {
        for (int j = 0; j < 8; ++j) std::memset(ap + (b * 8 + j) * kGMR * 4 + r * 4, 0, 4);
        ad[b * kGMR + r] = 0.0f;
        as[b * kGMR + r] = 0.0f;
      }
      continue;
    }
    cvt_row(a.x, a.x_dtype, m * K, K, tmp);
    for (int64_t b = 0; b < B; ++b) {
      alignas(64) int8_t blk[kActBlock];
      float sx;
      const float d = quantize_block32(tmp + b * 32, blk, &sx);
      if (BITS == 4) {  // even values, then odd (see pack_panel)
        alignas(16) int8_t eo[kActBlock];
        for (int i = 0; i < 16; ++i) {
          eo[i] = blk[2 * i];
          eo[16 + i] = blk[2 * i + 1];
        }
        std::memcpy(blk, eo, sizeof(eo));
      }
      for (int j = 0; j < 8; ++j) std::memcpy(ap + (b * 8 + j) * kGMR * 4 + r * 4, blk + 4 * j, 4);
      ad[b * kGMR + r] = d;
      as[b * kGMR + r] = sx;
    }
  }
}

// Weight rows n0 .. n0+15 as bp[B][8][16][4] u8 (rows >= N are 0): dword
// (b, j, row) holds 4 values of the row's block b, in the order the
// activations are packed (pack_rows): 8 bits: values 4j .. 4j+3; 4 bits:
// j < 4 the even values 8j, 8j+2, 8j+4, 8j+6, j >= 4 the odd ones (the low
// and high nibbles of the packed bytes, no reordering). Two blocks at a
// time: one 64-byte vector per row, one 16 x 16 dword transpose. Also the
// rows' scales and biases per block as sb[B][16], bb[B][16]; sgt: 2 * 16 * G
// floats.
template <int BITS>
void pack_panel(const Args& a, int64_t n0, uint8_t* bp, float* sb, float* bb, float* sgt) {
  const int64_t K = a.K, G = K / a.group_size, B = K / kActBlock;
  const int64_t row_bytes = K * BITS / 8;
  const int64_t nc = a.N - n0 < kGNR ? a.N - n0 : kGNR;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(a.w) + n0 * row_bytes;
  const __m256i nib = _mm256_set1_epi8(0x0f);
  // The next panel's rows (contiguous after these) are fetched while this
  // one is packed: the rows are read 64 bytes at a time across 16 rows,
  // a pattern the hardware prefetchers follow poorly.
  const int64_t pf_bytes = n0 + 2 * kGNR <= a.N ? kGNR * row_bytes : 0;
  const int64_t pf_step = ceil_div(pf_bytes, ceil_div(B, 2) * 64) * 64;
  for (int64_t b = 0; b < B; b += 2) {
    const bool two = b + 1 < B;
    if (pf_bytes) {
      const int64_t off = (b / 2) * pf_step;
      prefetch_bytes(w + kGNR * row_bytes, off, off + pf_step <= pf_bytes ? pf_step : pf_bytes - off);
    }
    __m512 r[16];
    for (int j = 0; j < kGNR; ++j) {
      // Rows >= nc: masked loads read nothing (and give 0).
      const uint8_t* row = w + j * row_bytes;
      const bool in = j < nc;
      __m512i v;
      if (BITS == 4) {
        // 32 packed bytes = blocks b, b+1: [b even | b+1 even | b odd | b+1 odd]
        const __mmask32 m = in ? (two ? ~0u : 0xffffu) : 0u;
        const __m256i p = _mm256_maskz_loadu_epi8(m, row + b * 16);
        const __m256i lo = _mm256_and_si256(p, nib);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), nib);
        v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        // -> [b even | b odd | b+1 even | b+1 odd]
        v = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
      } else {
        const __mmask64 m = in ? (two ? ~0ull : 0xffffffffull) : 0ull;
        v = _mm512_maskz_loadu_epi8(m, row + b * 32);
      }
      r[j] = _mm512_castsi512_ps(v);
    }
    transpose16x16_epi32(r);
    float* dst = reinterpret_cast<float*>(bp + b * 8 * 64);
    for (int j = 0; j < (two ? 16 : 8); ++j) _mm512_store_ps(dst + j * 16, r[j]);
  }
  // Scales / biases per (block, row).
  float* sc = sgt;
  float* bi = sgt + kGNR * G;
  cvt_row(a.scales, a.s_dtype, n0 * G, nc * G, sc);
  if (a.biases) {
    cvt_row(a.biases, a.s_dtype, n0 * G, nc * G, bi);
  } else {
    sym_biases(sc, nc * G, a.bits, bi);
  }
  const int64_t bpg = a.group_size / kActBlock;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t g = b / bpg;
    for (int64_t j = 0; j < kGNR; ++j) {
      sb[b * kGNR + j] = j < nc ? sc[j * G + g] : 0.0f;
      bb[b * kGNR + j] = j < nc ? bi[j * G + g] : 0.0f;
    }
  }
}

// out[m0 + r][n0 .. n0+nc) for r < mr: the MR x 16 micro-tile over all K.
template <int kGMR>
inline void gemm_micro(const GemmCtx& c, int64_t p, const uint8_t* bp, const float* sb,
                       const float* bb, int64_t n0, int mr, int64_t nc) {
  const Args& a = *c.a;
  const int64_t B = c.B;
  const int8_t* ap = c.ap + p * B * 32 * kGMR;
  const float* ad = c.ad + p * B * kGMR;
  const float* as = c.as + p * B * kGMR;
  __m512 acc[kGMR];
#pragma GCC unroll 12
  for (int r = 0; r < kGMR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m512i s[kGMR];
#pragma GCC unroll 12
    for (int r = 0; r < kGMR; ++r) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512i wv = _mm512_load_si512(bp + j * 64);
      const int32_t* x4 = reinterpret_cast<const int32_t*>(ap + j * kGMR * 4);
#pragma GCC unroll 12
      for (int r = 0; r < kGMR; ++r) s[r] = _mm512_dpbusd_epi32(s[r], wv, _mm512_set1_epi32(x4[r]));
    }
    const __m512 sv = _mm512_load_ps(sb + b * kGNR);
    const __m512 bv = _mm512_load_ps(bb + b * kGNR);
#pragma GCC unroll 12
    for (int r = 0; r < kGMR; ++r) {
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s[r]), _mm512_set1_ps(ad[r]));
      acc[r] = _mm512_fmadd_ps(t, sv, acc[r]);
      acc[r] = _mm512_fmadd_ps(bv, _mm512_set1_ps(as[r]), acc[r]);
    }
    bp += 8 * 64;
    ap += 8 * kGMR * 4;
    ad += kGMR;
    as += kGMR;
  }
  const int64_t N = a.N, m0 = p * kGMR;
  const __mmask16 mk = tail_mask(nc);
  for (int r = 0; r < mr; ++r) store_cvt(a.out, a.x_dtype, (m0 + r) * N + n0, acc[r], mk);
}

template <int BITS, int kGMR>
void gemm_bits(const Args& a) {
  const int64_t M = a.M, N = a.N, K = a.K, B = K / kActBlock, G = K / a.group_size;
  const int64_t P = ceil_div(M, kGMR);
  // ap (bytes), then ad and as.
  const int64_t ap_floats = P * B * 32 * kGMR / 4;
  float* buf = tl_x.get(static_cast<size_t>(ap_floats + 2 * P * B * kGMR + 16));
  GemmCtx c{&a, reinterpret_cast<const int8_t*>(buf), buf + ap_floats,
            buf + ap_floats + P * B * kGMR, B, P};
  const GemmCtx* pc = &c;
  auto pack = [pc, K](int64_t p0, int64_t p1) {
    float* tmp = tl_t.get(static_cast<size_t>(K));
    for (int64_t p = p0; p < p1; ++p) pack_rows<BITS, kGMR>(*pc, p, tmp);
  };
  par(P, 2, pack);
  const int64_t NB = ceil_div(N, kGNR);
  // Row panels per task: their packed activations (K + 8 B floats per row)
  // stay in L2 while the task's weight panel passes over them.
  const int64_t panel_bytes = kGMR * (K + 8 * B);
  int64_t pcn = (int64_t(512) << 10) / panel_bytes;
  if (pcn < 1) pcn = 1;
  auto body = [pc, pcn, NB, K, B, G, M, N](int64_t t0, int64_t t1) {
    const Args& a = *pc->a;
    // bp ((B rounded up to 2) * 32 * 16 bytes), sb, bb ([B][16]), the panel's
    // fp32 scales and biases ([16][G] each).
    const int64_t wfl = (B + 1) / 2 * 2 * 32 * kGNR / 4;
    float* w = tl_w.get(static_cast<size_t>(wfl + 2 * B * kGNR + 2 * kGNR * G + 16));
    uint8_t* bp = reinterpret_cast<uint8_t*>(w);
    float* sb = w + wfl;
    float* bb = sb + B * kGNR;
    float* sgt = bb + B * kGNR;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pb = (t / NB) * pcn;
      const int64_t pe = pb + pcn < pc->P ? pb + pcn : pc->P;
      const int64_t n0 = (t % NB) * kGNR;
      const int64_t nc = N - n0 < kGNR ? N - n0 : kGNR;
      pack_panel<BITS>(a, n0, bp, sb, bb, sgt);
      for (int64_t p = pb; p < pe; ++p) {
        const int mr = static_cast<int>(M - p * kGMR < kGMR ? M - p * kGMR : kGMR);
        gemm_micro<kGMR>(*pc, p, bp, sb, bb, n0, mr, nc);
      }
    }
  };
  // Several consecutive panels per pull: the next panel's prefetch (see
  // pack_panel) is then mostly this thread's next panel.
  const int64_t units = ceil_div(pc->P, pcn) * NB;
  par_dynamic(units, units / (16 * num_threads()), body);
  tl_x.trim(kKeepScratchFloats);
}

// The prepared activations of a.M rows in buf (64-byte aligned, at least
// gemv_prep_floats(a) floats): the xq bytes, then the lane and block scales.
template <int BITS>
Int8Ctx int8_ctx(const Args& a, const float* buf) {
  constexpr int64_t VPC = vpc<BITS>();
  const int64_t K = a.K;
  Int8Ctx c{&a, nullptr, nullptr, nullptr, K / a.group_size, K * BITS / 8, 0, 0, 0, 0};
  c.Kp = round_up(K, VPC);
  const int64_t tail_bytes = (K - (c.Kp - VPC)) * BITS / 8;
  c.tail = tail_bytes >= 64 ? ~0ull : (1ull << tail_bytes) - 1;
  c.nl = c.Kp / VPC * 16;
  c.Bp = round_up(K / kActBlock, 16);
  const int64_t xq_floats = round_up(a.M * c.Kp / 4, 16);
  c.xq = reinterpret_cast<const int8_t*>(buf);
  c.dl = buf + xq_floats;
  c.sxb = c.dl + a.M * c.nl;
  return c;
}

template <int BITS>
void prepare_rows(const Int8Ctx& c, int64_t m0, int64_t m1) {
  float* tmp = tl_t.get(static_cast<size_t>(c.a->K));
  for (int64_t m = m0; m < m1; ++m) prepare_row<BITS>(c, m, tmp);
}

template <int BITS>
void run_bits(const Args& a) {
  const int64_t M = a.M;
  float* buf = tl_x.get(gemv_prep_floats(a));
  Int8Ctx c = int8_ctx<BITS>(a, buf);
  const Int8Ctx* pc = &c;
  if (M >= 32) {
    auto prep = [pc](int64_t m0, int64_t m1) { prepare_rows<BITS>(*pc, m0, m1); };
    par(M, 16, prep);
  } else {
    prepare_rows<BITS>(c, 0, M);
  }
  // Tasks: 16 weight rows (L1-resident) against a block of activation rows
  // small enough to stay in L2 (their int8 rows and scales).
  const int64_t row_bytes = c.Kp + 4 * (c.nl + c.Bp);
  int64_t mb = (int64_t(512) << 10) / row_bytes;
  mb = mb < kMaxMM ? kMaxMM : (mb / kMaxMM) * kMaxMM;
  if (mb > M) mb = M;
  const int64_t MB = ceil_div(M, mb);
  const int64_t NB = ceil_div(a.N, kGemvRowBlock);
  auto body = [pc, mb, M, NB](int64_t u0, int64_t u1) {
    const Args& a = *pc->a;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t m0 = (u / NB) * mb, m1 = m0 + mb < M ? m0 + mb : M;
      const int64_t n0 = (u % NB) * kGemvRowBlock;
      unit<BITS>(*pc, m0, m1, n0, n0 + kGemvRowBlock < a.N ? n0 + kGemvRowBlock : a.N);
    }
  };
  const int64_t units = MB * NB;
  par_dynamic(units, units / (8 * num_threads()), body);
  tl_x.trim(kKeepScratchFloats);
}

} // namespace

void gemv_prepare_int8_avx512vnni(const Args& a, float* xp) {
  if (a.bits == 4) {
    prepare_rows<4>(int8_ctx<4>(a, xp), 0, a.M);
  } else if (a.bits == 8) {
    prepare_rows<8>(int8_ctx<8>(a, xp), 0, a.M);
  } else {
    gemv_prepare_int8_portable(a, xp);
  }
}

void gemv_block_int8_avx512vnni(const Args& a, const float* xp, int64_t n0, int64_t n1) {
  if (a.bits == 4) {
    unit<4>(int8_ctx<4>(a, xp), 0, a.M, n0, n1);
  } else if (a.bits == 8) {
    unit<8>(int8_ctx<8>(a, xp), 0, a.M, n0, n1);
  } else {
    gemv_block_int8_portable(a, xp, n0, n1);
  }
}

void run_int8_avx512vnni(const Args& a) {
  if (a.bits != 4 && a.bits != 8) return run_int8_portable(a);
  if (a.M > kInt8GemvMaxRows) {
    // The micro-tile height that pads M least (ties: the taller one).
    const int64_t pad12 = ceil_div(a.M, 12) * 12, pad8 = ceil_div(a.M, 8) * 8;
    if (pad8 < pad12) {
      a.bits == 4 ? gemm_bits<4, 8>(a) : gemm_bits<8, 8>(a);
    } else {
      a.bits == 4 ? gemm_bits<4, 12>(a) : gemm_bits<8, 12>(a);
    }
  } else {
    a.bits == 4 ? run_bits<4>(a) : run_bits<8>(a);
  }
}

} // namespace qmm
} // namespace mlxfast
