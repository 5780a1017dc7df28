// Paged attention compiled with AVX2/FMA/F16C (see paged_attention.h).
//
// The register-blocked paths of paged_attention_avx512.cpp with 8-lane
// vectors and 16 registers, for head dims 64, 128 and 256 (others run the
// generic kernel):
//   decode tiles (fewer than 16 query rows), a group of kv heads per work
//     item: scores for 8 keys at a time per row (8 dot products reduced
//     together), online softmax per span of kDecodeSpan keys, P.V with the
//     rows' outputs in registers; a single decode row over a long context is
//     split across the pool (cpu/split_decode.h).
//   prefill tiles: S[key][row] = K . Q^T with Q transposed once per tile, so
//     each vector holds 8 query rows of one key (4 keys x up to 2 row
//     vectors in registers per pass over d); mask, block maximum and exp
//     across rows in those vectors.
// Same online softmax as the generic kernel, float32 throughout. Sliding
// window: keys before a row's window start are masked like future keys, and
// a tile starts at the block holding its earliest window start (earlier
// table entries are never read).
#include <immintrin.h>

#include "common/scratch.h"
#include "cpu/decode_span_avx2.h"
#include "cpu/paged_attention.h"
#include "cpu/split_decode.h"
#include "cpu/vec_exp.h"

namespace mlxfast {
namespace pa {

namespace {

thread_local Scratch tl_buf;  // per-thread tile buffers

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

// A dense pool's value rows in dtype KV (fp32, fp16 or bf16).
template <int KV>
struct DenseValues {
  static constexpr int es = KV == F32 ? 4 : 2;
  const char* vbase;
  int64_t vrow;
  template <int NV>
  void get(int64_t slot, int c0, __m256* vv) const {
    const char* vp = vbase + slot * vrow + c0 * es;
    for (int v = 0; v < NV; ++v) vv[v] = load8<KV>(vp + v * 8 * es);
  }
};

// Tiles of fewer than 16 query rows (decode: one token x the kv head's
// query heads), several kv heads per work item: a slot's K (and V) rows of
// all heads are adjacent in the pool ([slot][Hkv][D]), and one item per head
// read each head's slice of them separately, at a third of the bandwidth
// with 3 heads (the prefetchers fetch the neighbours' lines, evicted before
// their heads get to them; measured on a 2-core EPYC: 3.3 vs 12 GB/s). Online
// softmax runs per span of kDecodeSpan keys, not per block (at 16-token
// blocks a per-block pass costs as much in reductions and rescales as the
// keys themselves).
constexpr int kDecodeSpan = 128;
constexpr int kItemRows = 32;  // query rows of one decode item, at most

inline int span_blocks_of(int bs) { return bs >= kDecodeSpan ? 1 : kDecodeSpan / bs; }

// kv heads of one decode item for tiles of nq tokens.
inline int decode_heads_per_item(const Args& a, int nq) {
  const int rows = nq * (a.Hq / a.Hkv), h = kItemRows / rows;
  return h < 1 ? 1 : (h > a.Hkv ? a.Hkv : h);
}

// kv heads [kh0, kh1), blocks [b_begin, b_end) of the context (b_end < 0:
// to its end; blocks before the tile's earliest window start are never
// read). Rows are ordered by head, then token, then query head. With `part`,
// the unnormalised state is stored there, [R][D] acc then m [R] and l [R],
// for split_decode to merge; otherwise the rows are written out.
// A dense pool's rows of kv heads kh0 .. kh0 + nh - 1 for decode_spans.
template <int D, int KV>
struct DensePool {
  static constexpr int es = KV == F32 ? 4 : 2;
  const char *kbase, *vbase;  // at head kh0
  int64_t row, num_slots;     // bytes between slots; slots in the pool
  int bs, item_bytes;         // a block's slots; the item's bytes of a slot's row
  bool slot_ok(int64_t blk) const { return blk >= 0 && (blk + 1) * bs <= num_slots; }
  void prefetch(int64_t blk) const {
    prefetch_rows(kbase, blk * bs * row, bs, row, item_bytes);
    prefetch_rows(vbase, blk * bs * row, bs, row, item_bytes);
  }
  void keys8(int64_t slot, int hh, int nv, float* kb) const {
    const char* rows = kbase + slot * row + hh * D * es;
    for (int k = 0; k < 8; ++k)
      for (int v = 0; v < D / 8; ++v)
        _mm256_store_ps(kb + k * D + v * 8, k < nv ? load8<KV>(rows + k * row + v * 8 * es) : _mm256_setzero_ps());
  }
  __m256 score8(const DecodeRows& t, int r) const { return float_score8<D>(t, r); }
  void pv(int hh, const SpanSeg* segs, int nseg, const float* P, int64_t sp, int Rh,
          const float* alpha, float* acc) const {
    pv_rows<D>(DenseValues<KV>{vbase + hh * D * es, row}, segs, nseg, P, 1, sp, Rh, alpha, acc);
  }
};

template <int D, int KV>
void decode_tile(const Args& a, int64_t t0, int64_t t1, int kh0, int kh1, int64_t b_begin = 0,
                 int64_t b_end = -1, float* part = nullptr) {
  constexpr int NV = D / 8;
  constexpr int kes = KV == F32 ? 4 : 2;
  const int G = a.Hq / a.Hkv, bs = a.bs, nh = kh1 - kh0;
  const int nq = static_cast<int>(t1 - t0), Rh = nq * G;  // Rh < 16
  const size_t qes = a.q_dtype == F32 ? 4 : 2;
  DecodeRows t(tl_buf, D, nh, Rh, G, bs, kDecodeSpan);
  const int32_t s = a.seq_idx[t0];
  const bool valid = s >= 0 && s < a.S;
  const auto [n_keys, lo_min] = tile_keys(a, t0, nq, t.qpos, t.qlo);
  const __m256 qscale = _mm256_set1_ps(a.scale);
  for (int r = 0; r < t.R; ++r) {
    const int kh = kh0 + r / Rh, j = (r % Rh) / G, h = kh * G + r % G;
    const char* qp = static_cast<const char*>(a.q) + (((t0 + j) * a.Hq + h) * D) * qes;
    for (int v = 0; v < NV; ++v) {
      _mm256_store_ps(t.qf + r * D + v * 8, _mm256_mul_ps(load8(qp + v * 8 * qes, a.q_dtype), qscale));
    }
  }
  if (valid && n_keys > 0) {
    const int64_t nblk = (n_keys + bs - 1) / bs;
    const int64_t row = static_cast<int64_t>(a.Hkv) * D * kes;  // bytes between slots
    const DensePool<D, KV> pool{static_cast<const char*>(a.k) + static_cast<int64_t>(kh0) * D * kes,
                                static_cast<const char*>(a.v) + static_cast<int64_t>(kh0) * D * kes,
                                row, a.num_slots, bs, nh * D * kes};
    const int64_t be = b_end < 0 || b_end > nblk ? nblk : b_end;
    const int64_t bb = b_begin > lo_min / bs ? b_begin : lo_min / bs;
    decode_spans<D>(pool, a.tables + static_cast<int64_t>(s) * a.B, bs, bb, be, n_keys, t);
  }
  if (part == nullptr) {
    for (int hh = 0; hh < nh; ++hh)
      write_rows(a, t0, kh0 + hh, Rh, t.acc + static_cast<size_t>(hh) * Rh * D, t.l + hh * Rh);
    return;
  }
  std::memcpy(part, t.acc, sizeof(float) * t.R * D);
  std::memcpy(part + t.R * D, t.m, sizeof(float) * t.R);
  std::memcpy(part + t.R * D + t.R, t.l, sizeof(float) * t.R);
}

// Prefill tiles (at least 16 query rows).
template <int D, int KV>
void tile(const Args& a, int64_t t0, int64_t t1, int kh) {
  const int G = a.Hq / a.Hkv, bs = a.bs;
  const int nq = static_cast<int>(t1 - t0), R = nq * G;
  const int RC = (R + 7) / 8;
  const int64_t Rp = static_cast<int64_t>(RC) * 8;
  const size_t qes = a.q_dtype == F32 ? 4 : 2, kes = KV == F32 ? 4 : 2;
  // scratch: Qt [D][Rp], S [bs][Rp], acc [R][D], m, l, alpha [Rp], qpos, qlo [Rp] int32,
  // kb [4][D]
  float* qt = tl_buf.get(static_cast<size_t>(D * Rp + bs * Rp + R * D + 5 * Rp + 4 * D));
  float* S = qt + D * Rp;
  float* acc = S + bs * Rp;
  float* m = acc + static_cast<size_t>(R) * D;
  float* l = m + Rp;
  float* alpha = l + Rp;
  int32_t* qpos = reinterpret_cast<int32_t*>(alpha + Rp);
  int32_t* qlo = qpos + Rp;
  float* kb = alpha + 3 * Rp;

  const int32_t s = a.seq_idx[t0];
  const bool valid = s >= 0 && s < a.S;
  int64_t n_keys = 0, lo_min = INT64_MAX;
  for (int r = 0; r < Rp; ++r) {
    int64_t p = -1, lo = 0;
    if (r < R) {
      p = a.pos[t0 + r / G];
      lo = key_lo(a.window, p);
      lo_min = lo < lo_min ? lo : lo_min;
      if (p > a.B * bs - 1) p = a.B * bs - 1;
    }
    qpos[r] = static_cast<int32_t>(p);
    qlo[r] = static_cast<int32_t>(lo);  // lo <= p, an int32 position
    if (p + 1 > n_keys) n_keys = p + 1;
  }
  for (int r = 0; r < Rp; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  std::memset(acc, 0, sizeof(float) * R * D);
  std::memset(qt, 0, sizeof(float) * D * Rp);
  for (int r = 0; r < R; ++r) {
    const int j = r / G, h = kh * G + r % G;
    const char* qp = static_cast<const char*>(a.q) + (((t0 + j) * a.Hq + h) * D) * qes;
    for (int d0 = 0; d0 < D; d0 += 8) {
      alignas(32) float t[8];
      _mm256_store_ps(t, _mm256_mul_ps(load8(qp + d0 * qes, a.q_dtype), _mm256_set1_ps(a.scale)));
      for (int d = 0; d < 8; ++d) qt[(d0 + d) * Rp + r] = t[d];
    }
  }
  if (valid && n_keys > 0) {
    const int32_t* table = a.tables + static_cast<int64_t>(s) * a.B;
    const int64_t nblk = (n_keys + bs - 1) / bs;
    const int64_t krow = static_cast<int64_t>(a.Hkv) * D * kes;
    const int64_t vrow = krow;
    const char* kbase = static_cast<const char*>(a.k) + static_cast<int64_t>(kh) * D * kes;
    const char* vbase = static_cast<const char*>(a.v) + static_cast<int64_t>(kh) * D * kes;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t b = lo_min / bs; b < nblk; ++b) {  // blocks before every window: unread
      const int64_t blk = table[b];
      if (blk < 0 || (blk + 1) * bs > a.num_slots) continue;
      const int64_t key0 = b * bs;
      const int nk = static_cast<int>(n_keys - key0 < bs ? n_keys - key0 : bs);
      for (int i0 = 0; i0 < nk; i0 += 4) {
        const int nv = nk - i0 < 4 ? nk - i0 : 4;
        for (int j = 0; j < 4; ++j) {
          for (int d0 = 0; d0 < D; d0 += 8) {
            _mm256_storeu_ps(kb + j * D + d0,
                             j < nv ? load8<KV>(kbase + (blk * bs + i0 + j) * krow + d0 * kes)
                                    : _mm256_setzero_ps());
          }
        }
        int c = 0;
        for (; c + 2 <= RC; c += 2)
          qk_keys4<D, 2>(kb, qt, Rp, c, qpos, qlo, key0 + i0, nv, S + i0 * Rp);
        if (c < RC) qk_keys4<D, 1>(kb, qt, Rp, c, qpos, qlo, key0 + i0, nv, S + i0 * Rp);
      }
      for (int c = 0; c < RC; ++c) {
        __m256 mb = ninf;
        for (int i = 0; i < nk; ++i) mb = _mm256_max_ps(mb, _mm256_load_ps(S + i * Rp + c * 8));
        const __m256 m_old = _mm256_load_ps(m + c * 8);
        const __m256 m_new = _mm256_max_ps(m_old, mb);
        // Rows with no visible key yet keep m = -inf: shift by 0 there.
        const __m256 m_use = _mm256_andnot_ps(_mm256_cmp_ps(m_new, ninf, _CMP_EQ_OQ), m_new);
        const __m256 al = exp_shifted(m_old, m_use);
        __m256 sum = _mm256_setzero_ps();
        for (int i = 0; i < nk; ++i) {
          const __m256 e = exp_shifted(_mm256_load_ps(S + i * Rp + c * 8), m_use);
          _mm256_store_ps(S + i * Rp + c * 8, e);
          sum = _mm256_add_ps(sum, e);
        }
        _mm256_store_ps(l + c * 8, _mm256_fmadd_ps(_mm256_load_ps(l + c * 8), al, sum));
        _mm256_store_ps(m + c * 8, m_new);
        _mm256_store_ps(alpha + c * 8, al);
      }
      const SpanSeg seg{blk * bs, nk, 0};
      pv_rows<D>(DenseValues<KV>{vbase, vrow}, &seg, 1, S, Rp, 1, R, alpha, acc);
    }
  }
  write_rows(a, t0, kh, R, acc, l);
}

// Decode items hold several kv heads, for split_decode (cpu/split_decode.h).
struct Tiles {
  static int heads_per_item(const Args& a) { return decode_heads_per_item(a, 1); }
  static int64_t span_blocks(int bs) { return span_blocks_of(bs); }
  // One item may hold every head: split from two spans on (a 256-key row on
  // 2 threads).
  static int64_t split_min_keys(int) { return 2 * kDecodeSpan; }
  template <int D>
  static void decode_tile(const Args& a, int64_t t0, int64_t t1, int kh0, int kh1,
                          int64_t b_begin, int64_t b_end, float* part) {
    switch (a.kv_dtype) {
      case F32: return pa::decode_tile<D, F32>(a, t0, t1, kh0, kh1, b_begin, b_end, part);
      case F16: return pa::decode_tile<D, F16>(a, t0, t1, kh0, kh1, b_begin, b_end, part);
      default: return pa::decode_tile<D, BF16>(a, t0, t1, kh0, kh1, b_begin, b_end, part);
    }
  }
};

// Work items: a tile of tokens against kv heads [kh0, kh1) (one head for a
// prefill tile, a head group for a decode tile).
struct Item {
  int64_t t0, t1;
  int kh0, kh1;
};

struct RunCtx {
  const Args* a;
  const Item* items;
};

template <int D, int KV>
void run_items(void* vctx, int64_t i0, int64_t i1) {
  const RunCtx& c = *static_cast<const RunCtx*>(vctx);
  const Args& a = *c.a;
  for (int64_t i = i0; i < i1; ++i) {
    const Item& it = c.items[i];
    if ((it.t1 - it.t0) * (a.Hq / a.Hkv) >= 16) {
      tile<D, KV>(a, it.t0, it.t1, it.kh0);
    } else {
      decode_tile<D, KV>(a, it.t0, it.t1, it.kh0, it.kh1);
    }
  }
}

template <int D>
RangeFn items_fn(DType kv) {
  return kv == F32 ? &run_items<D, F32> : kv == F16 ? &run_items<D, F16> : &run_items<D, BF16>;
}

void run_tiles(const Args& a) {
  int64_t* tiles = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * (a.T + 1)));
  Item* items = static_cast<Item*>(std::malloc(sizeof(Item) * (a.T + 1) * a.Hkv));
  const int64_t nt = make_tiles(a, tiles);
  int64_t n = 0;
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t ti = interleaved_tile(i, nt), t0 = tiles[ti], t1 = tiles[ti + 1];
    const bool prefill = (t1 - t0) * (a.Hq / a.Hkv) >= 16;
    const int step = prefill ? 1 : decode_heads_per_item(a, static_cast<int>(t1 - t0));
    for (int kh = 0; kh < a.Hkv; kh += step) {
      items[n++] = Item{t0, t1, kh, kh + step < a.Hkv ? kh + step : a.Hkv};
    }
  }
  RunCtx c{&a, items};
  const RangeFn fn = a.D == 64 ? items_fn<64>(a.kv_dtype)
                     : a.D == 128 ? items_fn<128>(a.kv_dtype) : items_fn<256>(a.kv_dtype);
  parallel_for(n, 1, fn, &c);
  std::free(items);
  std::free(tiles);
}

}  // namespace

void run_avx2(const Args& a) {
  if (a.D != a.Dv || (a.D != 64 && a.D != 128 && a.D != 256)) {
    Kernel<8>::run(a);
    return;
  }
  if ((a.D == 64 && split_decode<64, Tiles>(a)) || (a.D == 128 && split_decode<128, Tiles>(a)) ||
      (a.D == 256 && split_decode<256, Tiles>(a))) {
    return;
  }
  run_tiles(a);
}

}  // namespace pa
}  // namespace mlxfast
