// Paged attention compiled with AVX2/FMA/F16C (see paged_attention.h).
//
// The register-blocked tile kernel of paged_attention_avx512.cpp with
// 8-lane vectors and 16 registers, for head dims 64, 128 and 256 (others
// run the generic kernel), for every tile (decode, verify and prefill rows
// alike: a row's result never depends on its call, cpu/span_fold.h): a
// group of kv heads per work item, scores for 8 keys at a time per row (8
// dot products reduced together), online softmax per span of kDecodeSpan
// keys on a fixed grid, P.V with the rows' outputs in registers; a single
// decode row over a long context is split across the pool
// (cpu/split_decode.h). Prefill attention costs 15-25% more than with the
// transposed-Q prefill tile this file had (prefill_tile_avx2.h, still the
// quantized kernels' prefill path), which made a row's result depend on
// how many tokens its call held. float32 throughout. Sliding window: keys
// before a row's window start are masked like future keys, and a tile
// reads from the block holding its earliest window start (earlier table
// entries are never read).
#include <immintrin.h>

#include "common/scratch.h"
#include "cpu/attention_items.h"
#include "cpu/decode_span_avx2.h"
#include "cpu/paged_attention.h"
#include "cpu/split_decode.h"

namespace mlxfast {
namespace pa {

namespace {

thread_local Scratch tl_buf;  // per-thread tile buffers

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

// Tiles of up to 16 tokens, several kv heads per work item (decode: one
// token x the kv head's query heads per head): a slot's K (and V) rows of
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
  // P.V reads a head's 32-byte column chunk of every value row of the span,
  // one pass per chunk and head (12 strided passes at D = 64 and 3 heads),
  // so its first pass met every line cold, a miss at a time. Reading the
  // span's value lines once in slot order first, before the first head's
  // pass, lets the loads overlap and brings them to the cache in the order
  // the prefetchers follow. Default model, one decode step at 700 / 2,000 /
  // 8,000 tokens of f16 KV in scattered blocks (2-core Zen 3, with and
  // without it alternating in one process): 1.06x / 1.08x / 1.25x, the same
  // bits (docs/architecture.md, session 33).
  void pv(int hh, const SpanSeg* segs, int nseg, const float* P, int64_t sp, int Rh,
          const float* alpha, float* acc) const {
    if (hh == 0) {
      for (int sg = 0; sg < nseg; ++sg) touch_rows(vbase, segs[sg].slot0 * row, segs[sg].nk, row, item_bytes);
    }
    pv_rows<D>(DenseValues<KV>{vbase + hh * D * es, row}, segs, nseg, P, 1, sp, Rh, alpha, acc);
  }
};

// A decode tile: kv heads [kh0, kh1), blocks [b_begin, b_end) of the context (b_end < 0:
// to its end; blocks before the tile's earliest window start are never
// read). Rows are ordered by head, then token, then query head. With `part`,
// the unnormalised state is stored there, [R][D] acc then m [R] and l [R],
// for split_decode to merge; otherwise the rows are written out.
template <int D, int KV>
void decode_tile(const Args& a, int64_t t0, int64_t t1, int kh0, int kh1, int64_t b_begin = 0,
                 int64_t b_end = -1, float* part = nullptr) {
  constexpr int NV = D / 8;
  constexpr int kes = KV == F32 ? 4 : 2;
  const int G = a.Hq / a.Hkv, bs = a.bs, nh = kh1 - kh0;
  const int nq = static_cast<int>(t1 - t0), Rh = nq * G;  // rows per head; nq <= kTile
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

template <int D, int KV>
void run_range(void* vctx, int64_t i0, int64_t i1) {
  const ItemCtx& c = *static_cast<const ItemCtx*>(vctx);
  const Args& a = *c.a;
  for (int64_t i = i0; i < i1; ++i) {
    const Item& it = c.items[i];
    decode_tile<D, KV>(a, it.t0, it.t1, it.kh0, it.kh1);
  }
}

template <int D>
RangeFn range_fn(DType kv) {
  return kv == F32 ? &run_range<D, F32> : kv == F16 ? &run_range<D, F16> : &run_range<D, BF16>;
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
  const RangeFn fn = a.D == 64 ? range_fn<64>(a.kv_dtype)
                     : a.D == 128 ? range_fn<128>(a.kv_dtype) : range_fn<256>(a.kv_dtype);
  run_items(a, &decode_heads_per_item, fn);
}

}  // namespace pa
}  // namespace mlxfast
