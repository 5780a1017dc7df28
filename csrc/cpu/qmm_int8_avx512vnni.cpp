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
// The same tile runs every M (GEMV-shaped: a task is 16 weight rows, L1
// resident, against blocks of activation rows).
#include "cpu/qmm_x86.h"
#include "cpu/qmm_avx512.h"

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
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < B; ++b) {
    // quantize_block, vectorized (same operations, same numbers).
    const __m512 v0 = _mm512_loadu_ps(tmp + b * 32), v1 = _mm512_loadu_ps(tmp + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_and_ps(v1, absmask)));
    float d = amax / 127.0f;
    int32_t is = 0;
    if (amax > 0.0f) {
      const __m512 id = _mm512_set1_ps(127.0f / amax);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));  // round to nearest even
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
      _mm_store_si128(reinterpret_cast<__m128i*>(blk), _mm512_cvtepi32_epi8(q0));
      _mm_store_si128(reinterpret_cast<__m128i*>(blk + 16), _mm512_cvtepi32_epi8(q1));
      is = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    } else {
      std::memset(blk, 0, sizeof(blk));
      d = 0.0f;
    }
    sxb[b] = d * static_cast<float>(is);
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

// y[m0 + m][n + r] for r < R, m < MM into yb[m * kGemvRowBlock + r];
// sc, bi: the R rows' fp32 scales and biases ([R][G]).
template <int BITS, int GS, int MM, int R>
__attribute__((always_inline)) inline void tile(const Int8Ctx& c, int64_t m0, int64_t n,
                                                const float* sc, const float* bi, float* yb) {
  const Args& a = *c.a;
  constexpr int64_t VPC = vpc<BITS>();
  constexpr int64_t CB = VPC * BITS / 8;  // packed bytes per chunk (64)
  const int64_t K = a.K, G = c.G;
  const int64_t nch = c.Kp / VPC;
  const __mmask64 tail = c.tail;
  const __m512i idx = group_lanes<BITS, GS>();
  const __m512i nib = _mm512_set1_epi8(0x0f);
  __m512 acc[R][MM];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = _mm512_setzero_ps();
  const uint8_t* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const uint8_t*>(a.w) + (n + r) * c.row_bytes;
  const int64_t pf = kPrefetchRows * c.row_bytes;
  const int8_t* xq = c.xq + m0 * c.Kp;
  const float* dl = c.dl + m0 * c.nl;
  for (int64_t ch = 0; ch < nch; ++ch) {
    const __mmask64 wm = ch + 1 < nch ? ~0ull : tail;
    const int64_t g0 = ch * VPC / GS;
    const __mmask16 gm = tail_mask(G - g0);
    __m512i lo[R], hi[R];
    __m512 sv[R];
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(wr[r] + pf), _MM_HINT_T0);
      const __m512i w = _mm512_maskz_loadu_epi8(wm, wr[r]);
      wr[r] += CB;
      if (BITS == 4) {
        lo[r] = _mm512_and_si512(w, nib);
        hi[r] = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
      } else {
        lo[r] = w;
      }
      sv[r] = _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(gm, sc + r * G + g0));
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
      bv[r] = _mm512_permutexvar_ps(bidx, _mm512_maskz_loadu_ps(gm, bi + r * G + g0));
    }
    for (int m = 0; m < MM; ++m) {
      const __m512 s = _mm512_load_ps(sxb + m * c.Bp + b0);  // 0 past B
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(bv[r], s, acc[r][m]);
    }
  }
  store_tile_sums(acc, yb);
}

// Rows m0 .. m0+MM-1, columns [n0, n1).
template <int BITS, int GS, int MM>
void tiles(const Int8Ctx& c, int64_t m0, int64_t n0, int64_t n1, const float* sc,
           const float* bi) {
  constexpr int R = MM <= 3 ? 4 : 2;
  const int64_t G = c.G;
  alignas(64) float yb[MM * kGemvRowBlock];
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    tile<BITS, GS, MM, R>(c, m0, n, sc + (n - n0) * G, bi + (n - n0) * G, yb + (n - n0));
  }
  for (; n < n1; ++n) {
    tile<BITS, GS, MM, 1>(c, m0, n, sc + (n - n0) * G, bi + (n - n0) * G, yb + (n - n0));
  }
  const __mmask16 mk = tail_mask(n1 - n0);
  for (int m = 0; m < MM; ++m) {
    store_cvt(c.a->out, c.a->x_dtype, (m0 + m) * c.a->N + n0,
              _mm512_load_ps(yb + m * kGemvRowBlock), mk);
  }
}

template <int BITS, int GS, int MM = 1>
void rows(const Int8Ctx& c, int64_t m0, int mm, int64_t n0, int64_t n1, const float* sc,
          const float* bi) {
  if constexpr (MM < kMaxMM) {
    if (mm > MM) return rows<BITS, GS, MM + 1>(c, m0, mm, n0, n1, sc, bi);
  }
  tiles<BITS, GS, MM>(c, m0, n0, n1, sc, bi);
}

// Output rows [m_begin, m_end), columns [n0, n1) (at most kGemvRowBlock).
template <int BITS>
void unit(const Int8Ctx& c, int64_t m_begin, int64_t m_end, int64_t n0, int64_t n1) {
  const Args& a = *c.a;
  const int64_t G = c.G;
  float* sb = tl_w.get(static_cast<size_t>(2 * kGemvRowBlock * G + 1));
  float* sc = sb;
  float* bi = sb + kGemvRowBlock * G;
  prefetch_group_params(a, n1, kGemvRowBlock, G);
  cvt_row(a.scales, a.s_dtype, n0 * G, (n1 - n0) * G, sc);
  if (a.biases) {
    cvt_row(a.biases, a.s_dtype, n0 * G, (n1 - n0) * G, bi);
  } else {
    sym_biases(sc, (n1 - n0) * G, a.bits, bi);
  }
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kMaxMM) {
    const int mm = static_cast<int>(m_end - m0 < kMaxMM ? m_end - m0 : kMaxMM);
    switch (a.group_size) {
      case 32: rows<BITS, 32>(c, m0, mm, n0, n1, sc, bi); break;
      case 64: rows<BITS, 64>(c, m0, mm, n0, n1, sc, bi); break;
      default: rows<BITS, 128>(c, m0, mm, n0, n1, sc, bi); break;
    }
  }
}

template <int BITS>
void run_bits(const Args& a) {
  constexpr int64_t VPC = vpc<BITS>();
  const int64_t M = a.M, K = a.K;
  Int8Ctx c{&a, nullptr, nullptr, nullptr, K / a.group_size, K * BITS / 8, 0, 0, 0, 0};
  c.Kp = round_up(K, VPC);
  const int64_t tail_bytes = (K - (c.Kp - VPC)) * BITS / 8;
  c.tail = tail_bytes >= 64 ? ~0ull : (1ull << tail_bytes) - 1;
  c.nl = c.Kp / VPC * 16;
  c.Bp = round_up(K / kActBlock, 16);
  // One scratch: xq bytes, then the lane and block scales (64-byte aligned).
  const int64_t xq_floats = round_up(M * c.Kp / 4, 16);
  float* buf = tl_x.get(static_cast<size_t>(xq_floats + M * c.nl + M * c.Bp + 16));
  c.xq = reinterpret_cast<const int8_t*>(buf);
  c.dl = buf + xq_floats;
  c.sxb = buf + xq_floats + M * c.nl;
  const Int8Ctx* pc = &c;
  auto prep = [pc, K](int64_t m0, int64_t m1) {
    float* tmp = tl_t.get(static_cast<size_t>(K));
    for (int64_t m = m0; m < m1; ++m) prepare_row<BITS>(*pc, m, tmp);
  };
  if (M >= 32) {
    par(M, 16, prep);
  } else {
    prep(0, M);
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

void run_int8_avx512vnni(const Args& a) {
  if (a.bits == 4) {
    run_bits<4>(a);
  } else if (a.bits == 8) {
    run_bits<8>(a);
  } else {
    run_int8_portable(a);
  }
}

} // namespace qmm
} // namespace mlxfast
