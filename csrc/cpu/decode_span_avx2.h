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

}  // namespace
}  // namespace mlxfast
