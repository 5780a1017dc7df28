// The decode kernels' span state fold (paged_attention_avx2.cpp,
// paged_attention_avx512.cpp, cpu/split_decode.h, cpu/decode_span_avx2.h).
// Compiled per ISA: everything lives in an anonymous namespace (see
// csrc/cpu/qmm.h, ODR).
#pragma once

#include <cmath>
#include <cstdint>

namespace mlxfast {
namespace {

// Folds one span's softmax state (its max ms, sum ls and unnormalised
// acc_s [D], all relative to ms) into a row's running state (m, l, acc):
// the decode kernels' spans lie on a fixed grid of the sequence's blocks and
// each is computed from an empty state, then folded in key order, here, by
// both the sequential decode tile and the split path's merge. So a row's
// result does not depend on how the call split its keys across threads, nor
// on the other rows of its tile or step: greedy speculative decoding
// verifies k drafts in one call and must get the logits of k plain steps,
// bit for bit. The first fold copies the span's state exactly (a = 0, b = 1).
inline void fold_span(float& m, float& l, float* acc, float ms, float ls, const float* acc_s,
                      int D) {
  if (ms == -INFINITY) return;  // no visible key in the span
  const float mn = m > ms ? m : ms;
  const float a = m == -INFINITY ? 0.f : std::exp(m - mn), b = std::exp(ms - mn);
  l = std::fma(ls, b, l * a);
  for (int d = 0; d < D; ++d) acc[d] = std::fma(acc_s[d], b, acc[d] * a);
  m = mn;
}

// The first block of the span-grid span holding block b (spans of
// span_blocks blocks from block 0).
inline int64_t span_start(int64_t b, int64_t span_blocks) { return b / span_blocks * span_blocks; }

}  // namespace
}  // namespace mlxfast
