// The work items of one paged-attention call for the ISA attention files
// (paged_attention_avx2.cpp, paged_attention_avx512.cpp): a tile of tokens
// against kv heads [kh0, kh1), one head for a prefill tile and a head group
// for a decode tile (a slot's rows of all heads are adjacent in the pool, and
// a head's slice read on its own streams at a third of the rate). Compiled
// per ISA: everything lives in an anonymous namespace (see csrc/cpu/qmm.h,
// ODR).
#pragma once

#include <cstdint>
#include <cstdlib>

#include "common/parallel.h"
#include "cpu/paged_attention.h"

namespace mlxfast {
namespace pa {
namespace {

struct Item {
  int64_t t0, t1;
  int kh0, kh1;
};

struct ItemCtx {
  const Args* a;
  const Item* items;
};

// Builds the call's items (tiles alternating light and heavy; a tile of nq
// tokens in groups of heads_per_item(a, nq) kv heads, smaller groups where
// the call would have fewer items than threads: one short row) and
// runs fn over them on the pool, with an ItemCtx.
template <class HeadsFn>
void run_items(const Args& a, HeadsFn heads_per_item, RangeFn fn) {
  int64_t* tiles = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * (a.T + 1)));
  Item* items = static_cast<Item*>(std::malloc(sizeof(Item) * (a.T + 1) * a.Hkv));
  const int64_t nt = make_tiles(a, tiles);
  const int threads = num_threads();
  int64_t n = 0;
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t ti = interleaved_tile(i, nt), t0 = tiles[ti], t1 = tiles[ti + 1];
    int step = heads_per_item(a, static_cast<int>(t1 - t0));
    while (step > 1 && nt * ((a.Hkv + step - 1) / step) < threads) --step;
    for (int kh = 0; kh < a.Hkv; kh += step) {
      items[n++] = Item{t0, t1, kh, kh + step < a.Hkv ? kh + step : a.Hkv};
    }
  }
  ItemCtx c{&a, items};
  parallel_for(n, 1, fn, &c);
  std::free(items);
  std::free(tiles);
}

}  // namespace
}  // namespace pa
}  // namespace mlxfast
