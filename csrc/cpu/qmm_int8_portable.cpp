// Portable C++ int8-activation quantized matmul (Args::int8_acts): any bits
// in 2..8 (the row-interleaved layout, Args::rows16: 4 and 8), any CPU. Same math as the VNNI kernel: activations quantized by
// quantize_block, integer dot products per 32-value block, then
//   y += scale * (d * isum) + bias * (d * sum(xq))
// in fp32. The correctness reference for the SIMD int8 path and its
// fallback for the widths (and CPUs) it does not take.
#include "cpu/qmm.h"

namespace mlxfast {
namespace qmm {

namespace {

thread_local Scratch tl_x;
thread_local Scratch tl_w;

// The prepared activations in xp: xq [M][K] int8, then d and d * sum(xq)
// per block, [M][B] each.
struct Prepared {
  int8_t* xq;
  float* d;
  float* sx;
};

Prepared prepared(const Args& a, const float* xp) {
  const int64_t B = a.K / kActBlock;
  float* buf = const_cast<float*>(xp);
  float* d = buf + ceil_div(a.M * a.K, 4);
  return {reinterpret_cast<int8_t*>(buf), d, d + a.M * B};
}

} // namespace

void gemv_prepare_int8_portable(const Args& a, float* xp) {
  const int64_t K = a.K, B = K / kActBlock;
  const Prepared p = prepared(a, xp);
  float tmp[kActBlock];
  for (int64_t m = 0; m < a.M; ++m) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < kActBlock; ++i) tmp[i] = load_f32(a.x, a.x_dtype, m * K + b * kActBlock + i);
      int32_t is;
      p.d[m * B + b] = quantize_block(tmp, kActBlock, p.xq + m * K + b * kActBlock, &is);
      p.sx[m * B + b] = p.d[m * B + b] * static_cast<float>(is);
    }
  }
}

void gemv_block_int8_portable(const Args& a, const float* xp, int64_t n0, int64_t n1) {
  const int64_t M = a.M, N = a.N, K = a.K, B = K / kActBlock, G = K / a.group_size;
  const int64_t bpg = a.group_size / kActBlock;
  const Prepared p = prepared(a, xp);
  const int64_t row_bytes = K * a.bits / 8;
  int32_t* q = reinterpret_cast<int32_t*>(tl_w.get(static_cast<size_t>(K)));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(a.w) + n * row_bytes;
    for (int64_t k = 0; k < K; ++k) {
      q[k] = static_cast<int32_t>(a.rows16 ? rows16_code(a, n, k) : unpack_value(row, k, a.bits));
    }
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.0f;
      for (int64_t b = 0; b < B; ++b) {
        const int8_t* xb = p.xq + m * K + b * kActBlock;
        const int32_t* qb = q + b * kActBlock;
        int32_t isum = 0;
        for (int64_t i = 0; i < kActBlock; ++i) isum += qb[i] * static_cast<int32_t>(xb[i]);
        const int64_t g = b / bpg, pi = a.rows16 ? rows16_param(a, n, g) : n * G + g;
        const float s = load_f32(a.scales, a.s_dtype, pi);
        const float bi = a.biases ? load_f32(a.biases, a.s_dtype, pi) : sym_bias(a.bits) * s;
        acc += s * (p.d[m * B + b] * static_cast<float>(isum)) + bi * p.sx[m * B + b];
      }
      store_f32(a.out, a.x_dtype, m * N + n, acc);
    }
  }
}

void run_int8_portable(const Args& a) {
  float* xp = tl_x.get(gemv_prep_floats(a));
  gemv_prepare_int8_portable(a, xp);
  auto body = [&](int64_t n0, int64_t n1) { gemv_block_int8_portable(a, xp, n0, n1); };
  par(a.N, 4, body);
}

} // namespace qmm
} // namespace mlxfast
