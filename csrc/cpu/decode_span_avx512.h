// The pieces the AVX-512 attention kernels share (paged_attention_avx512.cpp,
// kv_quant_avx512.cpp): the online-softmax step over a decode span's scores,
// and P.V with the rows' accumulators in registers, over values each kernel
// loads its own way (fp16/bf16/fp32 rows, or codes decoded in registers).
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

// Online-softmax step for R rows over a span's n scores (row r at
// S + r * sp, -inf where masked): the span's exp(s - m_new) replace the
// scores, m/l are updated and alpha[r] = exp(m_old - m_new) rescales the
// rows' accumulators.
inline void span_softmax(float* S, int64_t sp, int R, int n, float* m, float* l, float* alpha) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  const __mmask16 tail = static_cast<__mmask16>((n & 15) ? (1u << (n & 15)) - 1u : 0xffffu);
  for (int r = 0; r < R; ++r) {
    float* sr = S + r * sp;
    __m512 mv = ninf;
    for (int i0 = 0; i0 < n; i0 += 16)
      mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(ninf, n - i0 >= 16 ? 0xffff : tail, sr + i0));
    const float mb = _mm512_reduce_max_ps(mv);
    const float mn = m[r] > mb ? m[r] : mb;
    const float mu = mn == -INFINITY ? 0.f : mn;
    alpha[r] = m[r] == -INFINITY ? 0.f : std::exp(m[r] - mu);
    __m512 sum = _mm512_setzero_ps();
    for (int i0 = 0; i0 < n; i0 += 16) {
      const __mmask16 mk = n - i0 >= 16 ? 0xffff : tail;
      const __m512 x = _mm512_mask_loadu_ps(ninf, mk, sr + i0);
      const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ),
                                           exp16(_mm512_sub_ps(x, _mm512_set1_ps(mu))));
      _mm512_mask_storeu_ps(sr + i0, mk, e);
      sum = _mm512_add_ps(sum, e);
    }
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    m[r] = mn;
  }
}

// Columns c0 .. c0+DC-1 of acc rows r0 .. r0+RG-1 ([R][DV] in memory) =
// alpha * acc + P^T V over the keys of every segment, P[key i of a
// segment][row r] at S[(seg.off + i) * si + r * sr]; the rows' outputs stay
// in registers across the segments (a decode span's blocks, or a prefill
// tile's one block). `values.template get<NV>(slot, c0, vv)` loads the NV
// vectors of columns c0 .. of a slot's value row.
template <int DV, int DC, int RG, class Values>
inline void pv_span(const Values& values, const SpanSeg* segs, int nseg, const float* S, int64_t si,
                    int64_t sr, int r0, int rg, int c0, const float* alpha, float* acc) {
  if constexpr (RG > 1) {
    if (rg < RG) return pv_span<DV, DC, RG - 1>(values, segs, nseg, S, si, sr, r0, rg, c0, alpha, acc);
  }
  constexpr int NV = DC / 16;
  __m512 o[RG][NV];
  for (int r = 0; r < RG; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r0 + r]);
    for (int v = 0; v < NV; ++v)
      o[r][v] = _mm512_mul_ps(al, _mm512_load_ps(acc + (r0 + r) * DV + c0 + v * 16));
  }
  for (int sg = 0; sg < nseg; ++sg) {
    const SpanSeg& seg = segs[sg];
    for (int i = 0; i < seg.nk; ++i) {
      __m512 vv[NV];
      values.template get<NV>(seg.slot0 + i, c0, vv);
      for (int r = 0; r < RG; ++r) {
        const __m512 p = _mm512_set1_ps(S[(seg.off + i) * si + (r0 + r) * sr]);
        for (int v = 0; v < NV; ++v) o[r][v] = _mm512_fmadd_ps(p, vv[v], o[r][v]);
      }
    }
  }
  for (int r = 0; r < RG; ++r)
    for (int v = 0; v < NV; ++v) _mm512_store_ps(acc + (r0 + r) * DV + c0 + v * 16, o[r][v]);
}

// Register blocking of P.V per head dim: DC columns x RG rows of
// accumulators (RG * DC / 16 + DC / 16 <= 28 of the 32 vector registers).
template <int DV> struct PvCfg;
template <> struct PvCfg<64> { static constexpr int DC = 64, RG = 6; };
template <> struct PvCfg<128> { static constexpr int DC = 128, RG = 3; };
template <> struct PvCfg<256> { static constexpr int DC = 64, RG = 6; };

// pv_span over all R rows and all DV columns.
template <int DV, class Values>
inline void pv_rows(const Values& values, const SpanSeg* segs, int nseg, const float* S, int64_t si,
                    int64_t sr, int R, const float* alpha, float* acc) {
  constexpr int DC = PvCfg<DV>::DC, RG = PvCfg<DV>::RG;
  for (int r0 = 0; r0 < R; r0 += RG) {
    const int rg = R - r0 < RG ? R - r0 : RG;
    for (int c0 = 0; c0 < DV; c0 += DC)
      pv_span<DV, DC, RG>(values, segs, nseg, S, si, sr, r0, rg, c0, alpha, acc);
  }
}

}  // namespace
}  // namespace mlxfast
