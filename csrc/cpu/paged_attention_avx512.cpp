// Paged attention compiled with AVX-512 (see paged_attention.h).
//
// Head dims 64, 128 and 256 take one register-blocked tile kernel,
// decode_tile, for every tile (a sequence's run of up to 16 tokens): decode
// rows, speculative verify rows and prefill chunks alike, so that a row's
// result never depends on the rows it shares a call with (see
// cpu/span_fold.h); other head dims run the generic kernel. A work item
// holds a group of kv heads and reads the keys slot by slot; a single decode
// row over a long context is split across the pool (cpu/split_decode.h).
// Online softmax per span of keys on a fixed grid, float32 throughout.
// Sliding window: keys before a row's window start are masked like future
// keys, and a tile reads from the block holding its earliest window start
// (earlier table entries are never read). A separate prefill kernel (Q
// transposed, 16 rows per vector) measured no faster than decode_tile on
// 512-2,048-token prefills (default model, a 1B and a GQA-16 shape).
#include <immintrin.h>

#include "common/scratch.h"
#include "cpu/paged_attention.h"
#include "cpu/span_fold.h"
#include "cpu/attention_items.h"
#include "cpu/decode_span_avx512.h"
#include "cpu/reduce_avx512.h"
#include "cpu/split_decode.h"

namespace mlxfast {
namespace pa {

namespace {

thread_local Scratch tl_buf;  // per-thread tile buffers

inline __m512 load16(const char* p, DType dt) {
  switch (dt) {
    case F32: return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
    case F16: return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    default:
      return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
}

// A dense pool's value rows (fp32, fp16 or bf16).
struct DenseValues {
  const char* vbase;
  int64_t vrow;
  DType dt;
  int es;
  template <int NV>
  void get(int64_t slot, int c0, __m512* vv) const {
    const char* vp = vbase + slot * vrow + c0 * es;
    for (int v = 0; v < NV; ++v) vv[v] = load16(vp + v * 16 * es, dt);
  }
};

// The tile kernel, a group of kv heads per work item: scores for 16 keys at
// a time per row (16 dot products reduced together), then softmax and P.V
// with the rows' outputs in registers. A slot's K and V rows of all
// heads are adjacent in the pool ([slot][Hkv][D]); an item per head read
// each head's slice of every slot on its own, a strided pattern that DRAM
// served at a third of a linear read (a standalone read of 3 heads x 64
// fp16 on one Zen 4 core: 8-9 GB/s per head against 23-25 GB/s for whole
// slots, the same arithmetic). So an item converts a chunk's keys of all
// its heads slot by slot, and its P.V passes per head read the span's
// values. There is no software prefetch: the in-order key stream is what
// the hardware prefetchers follow, and a prefetch of the next block's rows
// (K and V, every line) was bound by the L1's miss buffers (default model,
// 8,000 tokens, engine decode: 36-41 tok/s with it, 47 without). Online
// softmax runs per span of kDecodeSpan keys, not per block: at the engine's
// 16-token blocks a per-block pass spent as much on the max/exp/sum
// reductions and the accumulator rescale as on the keys.
constexpr int kDecodeSpan = 256;
constexpr int kItemKbFloats = 4096;  // converted keys of an item's heads per 16-key chunk (16 KB, L1)
constexpr int kItemRows = 48;        // query rows of one decode item, at most

// kv heads of one decode item for tiles of nq tokens.
inline int decode_heads_per_item(const Args& a, int nq) {
  const int rows = nq * (a.Hq / a.Hkv);
  int h = kItemKbFloats / (16 * a.D);
  if (h * rows > kItemRows) h = kItemRows / rows;
  return h < 1 ? 1 : (h > a.Hkv ? a.Hkv : h);
}

// kv heads [kh0, kh1), blocks [b_begin, b_end) of the context (b_end < 0:
// to its end; blocks before the tile's earliest window start are never
// read). Rows are ordered by head, then token, then query head. With
// `part`, the unnormalised state is stored there, [R][D] acc then m [R] and
// l [R], for split_decode to merge; otherwise the rows are written out.
template <int D>
void decode_tile(const Args& a, int64_t t0, int64_t t1, int kh0, int kh1, int64_t b_begin = 0,
                 int64_t b_end = -1, float* part = nullptr) {
  constexpr int NV = D / 16;
  const int G = a.Hq / a.Hkv, bs = a.bs, nh = kh1 - kh0;
  const int nq = static_cast<int>(t1 - t0), Rh = nq * G;  // rows per head; nq <= kTile
  const int R = nh * Rh;
  const int span_blocks = bs >= kDecodeSpan ? 1 : kDecodeSpan / bs;
  const int64_t spanp = (static_cast<int64_t>(span_blocks) * bs + 31) / 16 * 16;  // + 16 slack
  const int Rp = (R + 15) / 16 * 16;
  const size_t qes = a.q_dtype == F32 ? 4 : 2, kes = a.kv_dtype == F32 ? 4 : 2;
  // scratch: q [R][D], St [R][spanp], acc, acc_s [R][D], m, l, ms, ls, alpha [Rp],
  // kb [nh][16][D], segs
  float* qf = tl_buf.get(static_cast<size_t>(R * D + R * spanp + 2 * R * D + 5 * Rp + nh * 16 * D) +
                         sizeof(SpanSeg) * span_blocks / sizeof(float) + 16);
  float* St = qf + R * D;
  float* acc = St + static_cast<size_t>(R) * spanp;
  float* acc_s = acc + static_cast<size_t>(R) * D;  // the span's own state (fold_span)
  float* m = acc_s + static_cast<size_t>(R) * D;
  float* l = m + Rp;
  float* ms = l + Rp;
  float* ls = ms + Rp;
  float* alpha = ls + Rp;
  float* kb = alpha + Rp;
  SpanSeg* segs = reinterpret_cast<SpanSeg*>(kb + nh * 16 * D);
  int64_t qpos[16], qlo[16];
  const int32_t s = a.seq_idx[t0];
  const bool valid = s >= 0 && s < a.S;
  const auto [n_keys, lo_min] = tile_keys(a, t0, nq, qpos, qlo);
  for (int r = 0; r < R; ++r) {
    const int kh = kh0 + r / Rh, j = (r % Rh) / G, h = kh * G + r % G;
    const char* qp = static_cast<const char*>(a.q) + (((t0 + j) * a.Hq + h) * D) * qes;
    for (int v = 0; v < NV; ++v) {
      _mm512_store_ps(qf + r * D + v * 16, _mm512_mul_ps(load16(qp + v * 16 * qes, a.q_dtype),
                                                         _mm512_set1_ps(a.scale)));
    }
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  std::memset(acc, 0, sizeof(float) * R * D);
  if (valid && n_keys > 0) {
    const int32_t* table = a.tables + static_cast<int64_t>(s) * a.B;
    const int64_t nblk = (n_keys + bs - 1) / bs;
    const int64_t krow = static_cast<int64_t>(a.Hkv) * D * kes;
    const int64_t vrow = krow;
    const char* kbase = static_cast<const char*>(a.k) + static_cast<int64_t>(kh0) * D * kes;
    const char* vbase = static_cast<const char*>(a.v) + static_cast<int64_t>(kh0) * D * kes;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int64_t be = b_end < 0 || b_end > nblk ? nblk : b_end;
    const int64_t bb = b_begin > lo_min / bs ? b_begin : lo_min / bs;
    // Spans on the grid from block 0 (fold_span); blocks before bb are unread.
    for (int64_t b0 = span_start(bb, span_blocks); b0 < be; b0 += span_blocks) {
      const int64_t b1 = b0 + span_blocks < be ? b0 + span_blocks : be;
      // n: the span's scores so far. A key's score sits at its offset in the
      // span whichever blocks are read (the sums' lanes follow it); blocks
      // not read (before bb, or not in the pool) score -inf.
      int nseg = 0, n = 0;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t key0 = b * bs;
        const int nk = static_cast<int>(n_keys - key0 < bs ? n_keys - key0 : bs);
        const int64_t blk = b < bb ? -1 : table[b];
        if (blk < 0 || (blk + 1) * bs > a.num_slots) {
          for (int r = 0; r < R; ++r)
            for (int i = 0; i < nk; ++i) St[r * spanp + n + i] = -INFINITY;
          n += nk;
          continue;
        }
        segs[nseg++] = SpanSeg{blk * bs, nk, n};
        for (int i0 = 0; i0 < nk; i0 += 16) {
          const int nv = nk - i0 < 16 ? nk - i0 : 16;
          // Slot by slot, every head of the item: the rows are read in order.
          for (int k = 0; k < 16; ++k) {
            const char* kr = kbase + (blk * bs + i0 + k) * krow;
            for (int hh = 0; hh < nh; ++hh) {
              for (int v = 0; v < NV; ++v) {
                _mm512_store_ps(kb + (hh * 16 + k) * D + v * 16,
                                k < nv ? load16(kr + (hh * D + v * 16) * kes, a.kv_dtype)
                                       : _mm512_setzero_ps());
              }
            }
          }
          const __m512i kidx = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(key0 + i0)));
          const __mmask16 in_block = nv >= 16 ? static_cast<__mmask16>(0xffff)
                                              : static_cast<__mmask16>((1u << nv) - 1u);
          for (int r = 0; r < R; ++r) {
            const float* kh_b = kb + (r / Rh) * 16 * D;
            const int j = (r % Rh) / G;
            __m512 part[16];
            for (int k = 0; k < 16; ++k) {
              __m512 p = _mm512_mul_ps(_mm512_load_ps(qf + r * D), _mm512_load_ps(kh_b + k * D));
              for (int v = 1; v < NV; ++v) {
                p = _mm512_fmadd_ps(_mm512_load_ps(qf + r * D + v * 16),
                                    _mm512_load_ps(kh_b + k * D + v * 16), p);
              }
              part[k] = p;
            }
            __mmask16 ok = _mm512_mask_cmple_epi32_mask(
                in_block, kidx, _mm512_set1_epi32(static_cast<int>(qpos[j])));
            if (a.window > 0)
              ok = _mm512_mask_cmpge_epi32_mask(ok, kidx, _mm512_set1_epi32(static_cast<int>(qlo[j])));
            // Lanes past the block's keys are overwritten by the next block's.
            _mm512_storeu_ps(St + r * spanp + n + i0, _mm512_mask_mov_ps(ninf, ok, reduce16x16(part)));
          }
        }
        n += nk;
      }
      if (nseg == 0) continue;
      for (int r = 0; r < R; ++r) {
        ms[r] = -INFINITY;
        ls[r] = 0.f;
      }
      std::memset(acc_s, 0, sizeof(float) * R * D);
      span_softmax(St, spanp, R, n, ms, ls, alpha);
      for (int hh = 0; hh < nh; ++hh) {
        pv_rows<D>(DenseValues{vbase + hh * D * kes, vrow, a.kv_dtype, static_cast<int>(kes)}, segs,
                   nseg, St + hh * Rh * spanp, 1, spanp, Rh, alpha + hh * Rh, acc_s + hh * Rh * D);
      }
      for (int r = 0; r < R; ++r) fold_span(m[r], l[r], acc + r * D, ms[r], ls[r], acc_s + r * D, D);
    }
  }
  if (part == nullptr) {
    for (int hh = 0; hh < nh; ++hh) write_rows(a, t0, kh0 + hh, Rh, acc + hh * Rh * D, l + hh * Rh);
    return;
  }
  std::memcpy(part, acc, sizeof(float) * R * D);
  std::memcpy(part + R * D, m, sizeof(float) * R);
  std::memcpy(part + R * D + R, l, sizeof(float) * R);
}

// Decode items hold a group of kv heads, for split_decode (cpu/split_decode.h).
struct Tiles {
  static int heads_per_item(const Args& a) { return decode_heads_per_item(a, 1); }
  static int64_t span_blocks(int bs) { return bs >= kDecodeSpan ? 1 : kDecodeSpan / bs; }
  // An item may hold every head: split from two spans on (head dim 256
  // costs 4x per key what 64 does: from 256 keys, a 512-key sliding window,
  // 1 kv head: 1.7x on 2 threads, measured). Shorter rows: run_items (cpu/attention_items.h).
  static int64_t split_min_keys(int D) { return D >= 256 ? 256 : 2 * kDecodeSpan; }
  template <int D>
  static void decode_tile(const Args& a, int64_t t0, int64_t t1, int kh0, int kh1,
                          int64_t b_begin, int64_t b_end, float* part) {
    pa::decode_tile<D>(a, t0, t1, kh0, kh1, b_begin, b_end, part);
  }
};

template <int D>
void run_range(void* vctx, int64_t i0, int64_t i1) {
  const ItemCtx& c = *static_cast<const ItemCtx*>(vctx);
  const Args& a = *c.a;
  for (int64_t i = i0; i < i1; ++i) {
    const Item& it = c.items[i];
    decode_tile<D>(a, it.t0, it.t1, it.kh0, it.kh1);
  }
}

}  // namespace

void run_avx512(const Args& a) {
  if (a.D == a.Dv && ((a.D == 64 && split_decode<64, Tiles>(a)) ||
                      (a.D == 128 && split_decode<128, Tiles>(a)) ||
                      (a.D == 256 && split_decode<256, Tiles>(a)))) {
    return;
  }
  if (a.D != a.Dv || (a.D != 64 && a.D != 128 && a.D != 256)) {
    Kernel<16>::run(a);
    return;
  }
  run_items(a, &decode_heads_per_item,
            a.D == 64 ? &run_range<64> : a.D == 128 ? &run_range<128> : &run_range<256>);
}

}  // namespace pa
}  // namespace mlxfast
