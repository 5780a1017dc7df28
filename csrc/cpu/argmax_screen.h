// The screening pass of quantized_argmax (csrc/ops/quantized_argmax.h), per
// ISA: from a head's int8 logits and their error bounds, each row's best
// lower bound and each 16-row block's best upper bound.
#pragma once

#include <cstdint>

namespace mlxfast {
namespace argmax_screen {

// The most rows a call screens (qmm::kRows16InvariantMaxRows: above it
// quantized_argmax computes the whole head).
constexpr int64_t kMaxRows = 128;

struct Screen {
  const float* y;      // [M][N] int8 logits
  const uint16_t* c;   // [N / 16][nb][16] float16 bound coefficients (ops.argmax_bounds)
  const float* d;      // [M][nb] int8 activation scales (max|x| / 127 per 32 values)
  float* hi;           // [M][N / 16] out: per row and 16-row block, the best upper bound
  int64_t M, N, nb;
};

// 16-row blocks [b0, b1): with e = (sum_b d[m][b] c[n][b]) (1 + 2^-10) +
// |y| 2^-20 + 2^-96 (the bound, widened for its own fp32 rounding, and for
// x below 2^-102, whose products the fp32 kernels round), hi[m][blk] = max
// of y + e over the block (NaN where some y, e or y +- e there is not
// finite) and lo[m] = max of y - e over the blocks.
void bound_avx512(const Screen& s, int64_t b0, int64_t b1, float* lo);
void bound_avx2(const Screen& s, int64_t b0, int64_t b1, float* lo);

}  // namespace argmax_screen
}  // namespace mlxfast
