// What the int8-activation kernels over the row-interleaved layout
// (Args::rows16 and Args::int8_acts: qmm_int8_rows16_avx2.cpp and
// qmm_int8_rows16_avx512vnni.cpp) share: the prepared activations they read
// and the fan-out over 16-row blocks. Both compute the same integer block
// sums and the same fp32 chain per output, so their results are the same
// bits. Included after qmm_x86.h with the including file's ISA flags:
// anonymous namespace (see qmm.h's ODR note).
#pragma once

#include "cpu/qmm_x86.h"

namespace mlxfast {
namespace qmm {
namespace {

constexpr int64_t kBandBytes = 256 << 10;  // int8 activation rows kept in L2 per unit
constexpr int64_t kUnitBlocks = 4;         // 16-row blocks per work unit

// The prepared activations of a.M rows (prepare_int8_rows16_avx2), in
// groups of kRowGroup rows so that a tile addresses all its rows from one
// pointer (a pointer per row spilled the general registers): xq holds, per
// group and 4-value word t (t = k / 4), the word of each of the group's rows
// (4 int8 in the word byte order, see qmm_int8_rows16_avx2.cpp); then per
// group, 32-value block and row d, d * sum(xq) (fp32) and sum(xq) (int32).
// gemv_prep_floats(a) holds them.
constexpr int64_t kRowGroup = 12;

struct Prep {
  int8_t* xq;
  float* d;
  float* sxd;
  int32_t* xs;
  int64_t B, W;  // 32-value blocks and 4-value words per row
  // Row m's word t, and the index of row m's block b in d / sxd / xs.
  const int8_t* word(int64_t m, int64_t t) const {
    return xq + ((m / kRowGroup) * W + t) * (4 * kRowGroup) + (m % kRowGroup) * 4;
  }
  int64_t blk(int64_t m, int64_t b) const { return ((m / kRowGroup) * B + b) * kRowGroup + m % kRowGroup; }
};

inline Prep prep_at(const Args& a, float* buf) {
  const int64_t B = a.K / kActBlock, Mg = ceil_div(a.M, kRowGroup) * kRowGroup;
  float* d = buf + ceil_div(Mg * a.K, 64) * 16;
  return {reinterpret_cast<int8_t*>(buf), d, d + Mg * B, reinterpret_cast<int32_t*>(d + 2 * Mg * B), B,
          a.K / 4};
}

// The whole matmul: a.x's rows quantized (in parallel), then units of
// kUnitBlocks 16-row weight blocks against a band of activation rows (a
// multiple of `pass`, the rows one tile computes) that stays in L2:
// blocks(p, b0, b1, m0, m1) computes blocks [b0, b1) for rows [m0, m1).
template <class Blocks>
void run_int8_rows16(const Args& a, int64_t pass, const Blocks& blocks) {
  const int64_t M = a.M, K = a.K;
  float* buf = tl_x.get(gemv_prep_floats(a));
  const Prep p = prep_at(a, buf);
  const Args* pa = &a;
  auto prep = [pa, buf](int64_t m0, int64_t m1) { prepare_int8_rows16_avx2(*pa, buf, m0, m1); };
  par(M, 8, prep);
  int64_t band = kBandBytes / K / pass * pass;
  if (band < pass) band = pass;
  if (band > M) band = M;
  const int64_t NB = a.N / 16, GB = ceil_div(NB, kUnitBlocks), MB = ceil_div(M, band);
  const Prep* pp = &p;
  auto body = [pp, &blocks, band, NB, GB, M](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t m0 = (u / GB) * band, m1 = m0 + band < M ? m0 + band : M;
      const int64_t b0 = (u % GB) * kUnitBlocks, b1 = b0 + kUnitBlocks < NB ? b0 + kUnitBlocks : NB;
      blocks(*pp, b0, b1, m0, m1);
    }
  };
  const int64_t units = MB * GB;
  par_dynamic(units, units / (8 * num_threads()), body);
  tl_x.trim(kKeepScratchFloats);
}

} // namespace
} // namespace qmm
} // namespace mlxfast
