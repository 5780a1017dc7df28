// Flash-decoding for the ISA attention files (paged_attention_avx2.cpp,
// paged_attention_avx512.cpp): one decode row over a long context has too
// few work items in its kv heads for the pool (3 heads on 2 threads leave one
// idle a third of the time; one item holding every head leaves the other
// thread idle throughout), so each head group's blocks are split into ranges
// of whole spans, run in parallel by the file's decode tile, and the spans'
// softmax states folded in key order (cpu/span_fold.h): the same result,
// bit for bit, as the tile over the whole row. Compiled per ISA: everything
// lives in an anonymous namespace (see csrc/cpu/qmm.h, ODR).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/parallel.h"
#include "common/scratch.h"
#include "cpu/paged_attention.h"
#include "cpu/span_fold.h"

namespace mlxfast {
namespace pa {
namespace {

constexpr int kSplitItems = 8;
thread_local Scratch tl_part;
thread_local Scratch tl_merge;

struct SplitCtx {
  const Args* a;
  int64_t first_span, spans, span_blocks;  // grid spans first_span .. + spans - 1 of each group
  int heads_per_item, stride;
  float* parts;  // [groups][spans][stride]: R * D acc, then m [R] and l [R]
};

// Tiles (the ISA file's decode tile and its split policy):
//   heads_per_item(a)   kv heads one work item covers (a head group)
//   span_blocks(bs)     blocks per span of its online softmax
//   split_min_keys(D)   keys in range from which a decode row is split
//   decode_tile<D>(a, t0, t1, kh0, kh1, b_begin, b_end, part)
//                       blocks [b_begin, b_end) of kv heads [kh0, kh1), the
//                       unnormalised state stored in part: R * D acc, then
//                       m [R] and l [R], rows ordered by head then query head.
// A work item is one span of one head group: the tile over exactly one grid
// span stores that span's own state (its first fold_span is a copy), and the
// merge folds the spans in key order, as the tile does over a whole row.
template <int D, class Tiles>
void split_range(void* vctx, int64_t i0, int64_t i1) {
  const SplitCtx& c = *static_cast<const SplitCtx*>(vctx);
  const int Hkv = c.a->Hkv;
  for (int64_t i = i0; i < i1; ++i) {
    const int grp = static_cast<int>(i / c.spans);
    const int64_t b0 = (c.first_span + i % c.spans) * c.span_blocks;
    const int kh0 = grp * c.heads_per_item;
    const int kh1 = kh0 + c.heads_per_item < Hkv ? kh0 + c.heads_per_item : Hkv;
    Tiles::template decode_tile<D>(*c.a, 0, 1, kh0, kh1, b0, b0 + c.span_blocks,
                                   c.parts + i * c.stride);
  }
}

// The split path for a single decode row (T == 1) with enough keys in range;
// false leaves the call to the per-item kernels.
template <int D, class Tiles>
bool split_decode(const Args& a) {
  const int G = a.Hq / a.Hkv, bs = a.bs;
  if (a.T != 1) return false;
  const int hpi = Tiles::heads_per_item(a);
  const int groups = (a.Hkv + hpi - 1) / hpi;
  if (groups >= kSplitItems) return false;
  const int32_t s = a.seq_idx[0];
  if (s < 0 || s >= a.S) return false;
  int64_t p = a.pos[0];
  const int64_t lo = key_lo(a.window, p);
  if (p > a.B * bs - 1) p = a.B * bs - 1;
  if (p - lo + 1 < Tiles::split_min_keys(D)) return false;  // keys in range
  // The grid spans from the window's first block (earlier ones are never read).
  const int64_t span_blocks = Tiles::span_blocks(bs);
  const int64_t first_span = lo / bs / span_blocks, spans = p / bs / span_blocks + 1 - first_span;
  if (spans < 2 && groups < 2) return false;
  const int Rmax = hpi * G, stride = Rmax * D + 2 * Rmax;
  SplitCtx c{&a, first_span, spans, span_blocks, hpi, stride,
             tl_part.get(static_cast<size_t>(groups) * spans * stride)};
  parallel_for(static_cast<int64_t>(groups) * spans, 1, &split_range<D, Tiles>, &c);
  float* acc = tl_merge.get(static_cast<size_t>(Rmax) * D + 2 * Rmax);
  float* m = acc + static_cast<size_t>(Rmax) * D;
  float* l = m + Rmax;
  for (int grp = 0; grp < groups; ++grp) {
    const int kh0 = grp * hpi, nh = (kh0 + hpi < a.Hkv ? kh0 + hpi : a.Hkv) - kh0, R = nh * G;
    const float* pk = c.parts + static_cast<int64_t>(grp) * spans * stride;
    for (int r = 0; r < R; ++r) {
      m[r] = -INFINITY;
      l[r] = 0.f;
      std::memset(acc + r * D, 0, sizeof(float) * D);
      for (int64_t k = 0; k < spans; ++k) {
        const float* ps = pk + k * stride;
        fold_span(m[r], l[r], acc + r * D, ps[R * D + r], ps[R * D + R + r], ps + r * D, D);
      }
    }
    for (int h = 0; h < nh; ++h) write_rows(a, 0, kh0 + h, G, acc + h * G * D, l + h * G);
  }
  return true;
}

}  // namespace
}  // namespace pa
}  // namespace mlxfast
