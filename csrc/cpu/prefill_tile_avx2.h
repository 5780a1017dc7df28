// The prefill tile of the quantized AVX2 attention kernels (16 query rows
// or more; kv_quant_avx2.cpp, which decodes a block's codes into fp32 rows
// first, and the AVX-512 quantized path's prefill items). The dense kernels
// dropped it: their one tile kernel keeps a row's result independent of
// its call (cpu/span_fold.h). S[key][row] =
// K . Q^T with Q transposed once per tile, so each vector holds 8 query
// rows of one key (4 keys x up to 2 row vectors in registers per pass over
// d); mask, block maximum and exp across rows in those vectors; P.V with
// the rows' accumulators in registers (pv_rows). Compiled per ISA:
// everything lives in an anonymous namespace (see csrc/cpu/qmm.h, ODR).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/scratch.h"
#include "cpu/decode_span_avx2.h"
#include "cpu/paged_attention.h"

namespace mlxfast {
namespace {

// S[i][c*8 ..] for keys i0 .. i0+3 (kb: their rows in fp32, [4][D]) and row
// vectors c0 .. c0+NC-1; keys past the query's position or before its
// window start (qlo) get -inf.
template <int D, int NC>
inline void qk_keys4(const float* kb, const float* qt, int64_t Rp, int c0, const int32_t* qpos,
                     const int32_t* qlo, int64_t key, int nvalid, float* S) {
  __m256 acc[4][NC];
  for (int j = 0; j < 4; ++j)
    for (int c = 0; c < NC; ++c) acc[j][c] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m256 qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = _mm256_load_ps(qt + d * Rp + (c0 + c) * 8);
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = _mm256_broadcast_ss(kb + j * D + d);
      for (int c = 0; c < NC; ++c) acc[j][c] = _mm256_fmadd_ps(kv, qv[c], acc[j][c]);
    }
  }
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int j = 0; j < nvalid; ++j) {
    const __m256i kidx = _mm256_set1_epi32(static_cast<int>(key + j));
    for (int c = 0; c < NC; ++c) {
      const __m256i qp = _mm256_load_si256(reinterpret_cast<const __m256i*>(qpos + (c0 + c) * 8));
      const __m256i ql = _mm256_load_si256(reinterpret_cast<const __m256i*>(qlo + (c0 + c) * 8));
      const __m256 out = out_of_range(kidx, qp, ql, _mm256_setzero_si256());
      _mm256_store_ps(S + j * Rp + (c0 + c) * 8, _mm256_blendv_ps(acc[j][c], ninf, out));
    }
  }
}

// fp32 value rows [slot][D] (a pool's block decoded into a tile) for pv_rows.
template <int D>
struct FloatValues {
  const float* base;
  template <int NV>
  void get(int64_t slot, int c0, __m256* vv) const {
    const float* vp = base + slot * D + c0;
    for (int v = 0; v < NV; ++v) vv[v] = _mm256_loadu_ps(vp + v * 8);
  }
};

// A prefill tile's R query rows (R = tokens x the kv head's query heads,
// row r = token r / G, query head r % G) and buffers. The caller fills
// qt [D][Rp] (the queries, scaled, transposed; padding rows zero) with
// set_query; prefill_blocks fills acc [R][D] (unnormalised), m [R], l [R].
struct PrefillRows {
  int R, RC;
  int64_t Rp, n_keys, lo_min;
  float *qt, *S, *acc, *m, *l, *alpha, *kb;
  int32_t *qpos, *qlo;

  PrefillRows(Scratch& buf, int D, int bs, int R_, int G, int64_t t0, const int32_t* pos,
              int window, int64_t max_key)
      : R(R_), RC((R_ + 7) / 8), Rp(static_cast<int64_t>((R_ + 7) / 8) * 8), n_keys(0),
        lo_min(INT64_MAX) {
    // Qt [D][Rp], S [bs][Rp], acc [R][D], m, l, alpha [Rp], qpos, qlo [Rp]
    // int32, kb [4][D]
    qt = buf.get(static_cast<size_t>(D * Rp + bs * Rp + R * D + 5 * Rp + 4 * D));
    S = qt + D * Rp;
    acc = S + bs * Rp;
    m = acc + static_cast<size_t>(R) * D;
    l = m + Rp;
    alpha = l + Rp;
    qpos = reinterpret_cast<int32_t*>(alpha + Rp);
    qlo = qpos + Rp;
    kb = alpha + 3 * Rp;
    for (int r = 0; r < Rp; ++r) {
      int64_t p = -1, lo = 0;
      if (r < R) {
        p = pos[t0 + r / G];
        lo = pa::key_lo(window, p);
        lo_min = lo < lo_min ? lo : lo_min;
        if (p > max_key) p = max_key;
      }
      qpos[r] = static_cast<int32_t>(p);
      qlo[r] = static_cast<int32_t>(lo);  // lo <= p, an int32 position
      if (p + 1 > n_keys) n_keys = p + 1;
      m[r] = -INFINITY;
      l[r] = 0.f;
    }
    std::memset(acc, 0, sizeof(float) * R * D);
    std::memset(qt, 0, sizeof(float) * D * Rp);
  }

  // Row r's query (D floats, already scaled) into column r of qt.
  void set_query(int r, const float* q, int D) {
    for (int d = 0; d < D; ++d) qt[d * Rp + r] = q[d];
  }
};

// The key loop of a prefill tile over blocks [bb, be) of a sequence's table.
// The pool supplies
//   slot_ok(blk)               whether a table entry names a block in the pool
//   keys4(slot, nv, kb)        the keys at slot .. slot + 3 (nv valid, the
//                              others zero) as fp32 rows into kb ([4][D])
//   pv_block(blk, nk, S, Rp, R, alpha, acc)
//                              acc = alpha * acc + P.V over the block's nk
//                              keys (P[key i][row r] at S[i * Rp + r])
template <int D, class Pool>
inline void prefill_blocks(const Pool& pool, const int32_t* table, int bs, int64_t bb, int64_t be,
                           PrefillRows& t) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  const int64_t Rp = t.Rp;
  for (int64_t b = bb; b < be; ++b) {
    const int64_t blk = table[b];
    if (!pool.slot_ok(blk)) continue;
    const int64_t key0 = b * bs;
    const int nk = static_cast<int>(t.n_keys - key0 < bs ? t.n_keys - key0 : bs);
    for (int i0 = 0; i0 < nk; i0 += 4) {
      const int nv = nk - i0 < 4 ? nk - i0 : 4;
      pool.keys4(blk * bs + i0, nv, t.kb);
      int c = 0;
      for (; c + 2 <= t.RC; c += 2)
        qk_keys4<D, 2>(t.kb, t.qt, Rp, c, t.qpos, t.qlo, key0 + i0, nv, t.S + i0 * Rp);
      if (c < t.RC) qk_keys4<D, 1>(t.kb, t.qt, Rp, c, t.qpos, t.qlo, key0 + i0, nv, t.S + i0 * Rp);
    }
    for (int c = 0; c < t.RC; ++c) {
      __m256 mb = ninf;
      for (int i = 0; i < nk; ++i) mb = _mm256_max_ps(mb, _mm256_load_ps(t.S + i * Rp + c * 8));
      const __m256 m_old = _mm256_load_ps(t.m + c * 8);
      const __m256 m_new = _mm256_max_ps(m_old, mb);
      // Rows with no visible key yet keep m = -inf: shift by 0 there.
      const __m256 m_use = _mm256_andnot_ps(_mm256_cmp_ps(m_new, ninf, _CMP_EQ_OQ), m_new);
      const __m256 al = exp_shifted(m_old, m_use);
      __m256 sum = _mm256_setzero_ps();
      for (int i = 0; i < nk; ++i) {
        const __m256 e = exp_shifted(_mm256_load_ps(t.S + i * Rp + c * 8), m_use);
        _mm256_store_ps(t.S + i * Rp + c * 8, e);
        sum = _mm256_add_ps(sum, e);
      }
      _mm256_store_ps(t.l + c * 8, _mm256_fmadd_ps(_mm256_load_ps(t.l + c * 8), al, sum));
      _mm256_store_ps(t.m + c * 8, m_new);
      _mm256_store_ps(t.alpha + c * 8, al);
    }
    pool.pv_block(blk, nk, t.S, Rp, t.R, t.alpha, t.acc);
  }
}

}  // namespace
}  // namespace mlxfast
