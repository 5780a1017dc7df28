// The pieces of the AVX2 attention kernels (paged_attention_avx2.cpp), in
// the shape of decode_span_avx512.h with 8-lane vectors and 16 registers:
// row loads, 8 dot products reduced together, the online-softmax step over a
// decode span's scores, and P.V with the rows' accumulators in registers.
// Compiled per ISA: everything lives in an anonymous namespace (see
// csrc/cpu/qmm.h, ODR).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/scratch.h"
#include "cpu/span_fold.h"
#include "cpu/span_seg.h"
#include "cpu/vec_exp.h"

namespace mlxfast {
namespace {

// 8 values of a row in dtype DT (0 fp32, 1 fp16, 2 bf16) as fp32. A
// compile-time dtype keeps the kernels' inner loops free of branches (stores
// through vector pointers may alias a run-time dtype field, so the compiler
// would reload and test it per vector).
template <int DT>
inline __m256 load8(const char* p) {
  if constexpr (DT == 0) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (DT == 1) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
}

inline __m256 load8(const char* p, int dt) {
  return dt == 0 ? load8<0>(p) : dt == 1 ? load8<1>(p) : load8<2>(p);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane k of the result = sum of the 8 lanes of v[k] (three add steps).
inline __m256 reduce8x8(const __m256 v[8]) {
  __m256 t[4], u[2];
  for (int i = 0; i < 4; ++i) t[i] = _mm256_hadd_ps(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 2; ++i) u[i] = _mm256_hadd_ps(t[2 * i], t[2 * i + 1]);
  // u[0] = [v0..v3 low-half sums | v0..v3 high-half sums], u[1] likewise for v4..v7.
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20),
                       _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

// exp(x - mu) where x > -inf, else exactly 0.
inline __m256 exp_shifted(__m256 x, __m256 mu) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
  return _mm256_and_ps(live, exp8(_mm256_sub_ps(x, mu)));
}

// Online-softmax step for R rows over a span's n scores (row r at
// S + r * sp, -inf where masked; each row has room up to the next multiple
// of 8): the span's exp(s - m_new) replace the scores, m/l are updated and
// alpha[r] = exp(m_old - m_new) rescales the rows' accumulators.
inline void span_softmax(float* S, int64_t sp, int R, int n, float* m, float* l, float* alpha) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  const int n8 = (n + 7) & ~7;
  for (int r = 0; r < R; ++r) {
    float* sr = S + r * sp;
    for (int i = n; i < n8; ++i) sr[i] = -INFINITY;
    __m256 mv = ninf;
    for (int i0 = 0; i0 < n8; i0 += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sr + i0));
    const float mb = hmax8(mv);
    const float mn = m[r] > mb ? m[r] : mb;
    const float mu = mn == -INFINITY ? 0.f : mn;
    alpha[r] = m[r] == -INFINITY ? 0.f : std::exp(m[r] - mu);
    const __m256 muv = _mm256_set1_ps(mu);
    __m256 sum = _mm256_setzero_ps();
    for (int i0 = 0; i0 < n8; i0 += 8) {
      const __m256 e = exp_shifted(_mm256_loadu_ps(sr + i0), muv);
      _mm256_storeu_ps(sr + i0, e);
      sum = _mm256_add_ps(sum, e);
    }
    l[r] = l[r] * alpha[r] + hsum8(sum);
    m[r] = mn;
  }
}

// Columns c0 .. c0+DC-1 of acc rows r0 .. r0+RG-1 ([R][DV] in memory) =
// alpha * acc + P^T V over the keys of every segment, P[key i of a
// segment][row r] at S[(seg.off + i) * si + r * sr]; the rows' outputs stay
// in registers across the segments. `values.template get<NV>(slot, c0, vv)`
// loads the NV vectors of columns c0 .. of a slot's value row.
template <int DV, int DC, int RG, class Values>
inline void pv_span(const Values& values, const SpanSeg* segs, int nseg, const float* S, int64_t si,
                    int64_t sr, int r0, int rg, int c0, const float* alpha, float* acc) {
  if constexpr (RG > 1) {
    if (rg < RG) return pv_span<DV, DC, RG - 1>(values, segs, nseg, S, si, sr, r0, rg, c0, alpha, acc);
  }
  constexpr int NV = DC / 8;
  __m256 o[RG][NV];
  for (int r = 0; r < RG; ++r) {
    const __m256 al = _mm256_set1_ps(alpha[r0 + r]);
    for (int v = 0; v < NV; ++v)
      o[r][v] = _mm256_mul_ps(al, _mm256_load_ps(acc + (r0 + r) * DV + c0 + v * 8));
  }
  for (int sg = 0; sg < nseg; ++sg) {
    const SpanSeg& seg = segs[sg];
    for (int i = 0; i < seg.nk; ++i) {
      __m256 vv[NV];
      values.template get<NV>(seg.slot0 + i, c0, vv);
      for (int r = 0; r < RG; ++r) {
        const __m256 p = _mm256_broadcast_ss(S + (seg.off + i) * si + (r0 + r) * sr);
        for (int v = 0; v < NV; ++v) o[r][v] = _mm256_fmadd_ps(p, vv[v], o[r][v]);
      }
    }
  }
  for (int r = 0; r < RG; ++r)
    for (int v = 0; v < NV; ++v) _mm256_store_ps(acc + (r0 + r) * DV + c0 + v * 8, o[r][v]);
}

// Register blocking of P.V: 4 rows x 16 columns of accumulators (8 vectors,
// with 2 value vectors and 4 broadcasts: 14 of the 16 registers), so both a
// GQA group of 3 or 4 query heads and a prefill tile's rows fill it.
constexpr int kPvCols = 16, kPvRows = 4;

// pv_span over all R rows and all DV columns.
template <int DV, class Values>
inline void pv_rows(const Values& values, const SpanSeg* segs, int nseg, const float* S, int64_t si,
                    int64_t sr, int R, const float* alpha, float* acc) {
  for (int r0 = 0; r0 < R; r0 += kPvRows) {
    const int rg = R - r0 < kPvRows ? R - r0 : kPvRows;
    for (int c0 = 0; c0 < DV; c0 += kPvCols)
      pv_span<DV, kPvCols, kPvRows>(values, segs, nseg, S, si, sr, r0, rg, c0, alpha, acc);
  }
}

// Key indices key0 + lane masked out (all ones) where they fall after qpos,
// before qlo or at lane >= nvalid.
inline __m256 out_of_range(__m256i kidx, __m256i qpos, __m256i qlo, __m256i valid_lanes) {
  const __m256i after = _mm256_cmpgt_epi32(kidx, qpos);
  const __m256i before = _mm256_cmpgt_epi32(qlo, kidx);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_or_si256(after, before), valid_lanes));
}

// A decode tile's rows and buffers: nh kv heads x Rh query rows each
// (R = nh * Rh, ordered by head, then token, then query head). The caller
// fills qf [R][D] (the rows' queries, scaled) and qpos/qlo per token;
// decode_spans fills acc [R][D] (unnormalised), m [R] and l [R].
struct DecodeRows {
  int nh, Rh, G, R, span_blocks;
  int64_t spanp;  // a row's score stride in St (one span of keys + slack)
  float *qf, *St, *acc, *acc_s, *m, *l, *ms, *ls, *alpha, *kb;  // acc_s, ms, ls: a span's own state
  SpanSeg* segs;
  int64_t qpos[16], qlo[16];

  DecodeRows(Scratch& buf, int D, int nh_, int Rh_, int G_, int bs, int span_keys)
      : nh(nh_), Rh(Rh_), G(G_), R(nh_ * Rh_), span_blocks(bs >= span_keys ? 1 : span_keys / bs) {
    spanp = (static_cast<int64_t>(span_blocks) * bs + 31) / 16 * 16;  // + 16 slack
    const int Rm = ((R > 8 ? R : 8) + 7) & ~7;  // keeps kb 32-byte aligned
    // qf [R][D], St [R][spanp], acc, acc_s [R][D], m, l, ms, ls, alpha [Rm],
    // kb [8][D] (the pool's tile of 8 keys), segs
    qf = buf.get(static_cast<size_t>(3 * R * D + R * spanp + 5 * Rm + 8 * D) +
                 sizeof(SpanSeg) * span_blocks / sizeof(float) + 16);
    St = qf + R * D;
    acc = St + static_cast<size_t>(R) * spanp;
    acc_s = acc + static_cast<size_t>(R) * D;
    m = acc_s + static_cast<size_t>(R) * D;
    l = m + Rm;
    ms = l + Rm;
    ls = ms + Rm;
    alpha = ls + Rm;
    kb = alpha + Rm;
    segs = reinterpret_cast<SpanSeg*>(kb + 8 * D);
    for (int r = 0; r < R; ++r) {
      m[r] = -INFINITY;
      l[r] = 0.f;
    }
    std::memset(acc, 0, sizeof(float) * R * D);
  }
};

// Row r's scores of 8 keys (their rows in fp32 in t.kb, [8][D]): 8 dot
// products reduced together.
template <int D>
inline __m256 float_score8(const DecodeRows& t, int r) {
  __m256 part8[8];
  for (int k = 0; k < 8; ++k) part8[k] = _mm256_setzero_ps();
  for (int v = 0; v < D / 8; ++v) {
    const __m256 qv = _mm256_load_ps(t.qf + r * D + v * 8);
    for (int k = 0; k < 8; ++k) part8[k] = _mm256_fmadd_ps(qv, _mm256_load_ps(t.kb + k * D + v * 8), part8[k]);
  }
  return reduce8x8(part8);
}

// The key loop of a decode tile over blocks [bb, be) of a sequence's table:
// per 8 keys of a head, each row's 8 scores from the pool, masked; online
// softmax per span; P.V with the rows' outputs in
// registers. The pool supplies
//   slot_ok(blk)             whether a table entry names a block in the pool
//   prefetch(blk)            the rows of a block read next
//   keys8(slot, hh, nv, kb)  head hh's keys at slot .. slot + 7 (nv of them
//                            valid) into the tile kb ([8][D] floats), in the
//                            pool's own form (fp32 rows for float_score8)
//   score8(t, r)             row r's 8 scores of the keys in t.kb (unmasked)
//   pv(hh, segs, nseg, P, sp, Rh, alpha, acc)
//                            head hh's rows' acc = alpha * acc + P.V over
//                            the span's segments (P [Rh][sp]; pv_rows with
//                            the pool's value source, or a quantized pool's
//                            own form)
template <int D, class Pool>
inline void decode_spans(const Pool& pool, const int32_t* table, int bs, int64_t bb, int64_t be,
                         int64_t n_keys, DecodeRows& t) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  // Spans on the grid from block 0 (fold_span); blocks before bb are unread.
  for (int64_t b0 = span_start(bb, t.span_blocks); b0 < be; b0 += t.span_blocks) {
    const int64_t b1 = b0 + t.span_blocks < be ? b0 + t.span_blocks : be;
    // n: the span's scores so far. A key's score sits at its offset in the
    // span whichever blocks are read (the sums' lanes follow it); blocks not
    // read (before bb, or not in the pool) score -inf.
    int nseg = 0, n = 0;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t key0 = b * bs;
      const int nk = static_cast<int>(n_keys - key0 < bs ? n_keys - key0 : bs);
      const int64_t blk = b < bb ? -1 : table[b];
      if (!pool.slot_ok(blk)) {
        for (int r = 0; r < t.R; ++r)
          for (int i = 0; i < nk; ++i) t.St[r * t.spanp + n + i] = -INFINITY;
        n += nk;
        continue;
      }
      if (b + 1 < be && pool.slot_ok(table[b + 1])) pool.prefetch(table[b + 1]);
      t.segs[nseg++] = SpanSeg{blk * bs, nk, n};
      for (int i0 = 0; i0 < nk; i0 += 8) {
        const int nv = nk - i0 < 8 ? nk - i0 : 8;
        const __m256i kidx = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(key0 + i0)));
        const __m256i past = _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(nv - 1));
        for (int hh = 0; hh < t.nh; ++hh) {
          pool.keys8(blk * bs + i0, hh, nv, t.kb);
          for (int r = hh * t.Rh; r < (hh + 1) * t.Rh; ++r) {
            const int j = (r % t.Rh) / t.G;
            const __m256 out = out_of_range(kidx, _mm256_set1_epi32(static_cast<int>(t.qpos[j])),
                                            _mm256_set1_epi32(static_cast<int>(t.qlo[j])), past);
            // Lanes past the block's keys are overwritten by the next block's.
            _mm256_storeu_ps(t.St + r * t.spanp + n + i0,
                             _mm256_blendv_ps(pool.score8(t, r), _mm256_set1_ps(-INFINITY), out));
          }
        }
      }
      n += nk;
    }
    if (nseg == 0) continue;
    for (int r = 0; r < t.R; ++r) {
      t.ms[r] = -INFINITY;
      t.ls[r] = 0.f;
    }
    std::memset(t.acc_s, 0, sizeof(float) * t.R * D);
    span_softmax(t.St, t.spanp, t.R, n, t.ms, t.ls, t.alpha);
    for (int hh = 0; hh < t.nh; ++hh) {
      pool.pv(hh, t.segs, nseg, t.St + hh * t.Rh * t.spanp, t.spanp, t.Rh, t.alpha + hh * t.Rh,
              t.acc_s + static_cast<size_t>(hh) * t.Rh * D);
    }
    for (int r = 0; r < t.R; ++r)
      fold_span(t.m[r], t.l[r], t.acc + r * D, t.ms[r], t.ls[r], t.acc_s + r * D, D);
  }
}

}  // namespace
}  // namespace mlxfast
