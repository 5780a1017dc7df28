// Portable C++ int8-activation quantized matmul (Args::int8_acts): any bits
// in 2..8, any CPU. Same math as the VNNI kernel: activations quantized by
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

} // namespace

void run_int8_portable(const Args& a) {
  const int64_t M = a.M, N = a.N, K = a.K, B = K / kActBlock, G = K / a.group_size;
  const int64_t bpg = a.group_size / kActBlock;
  // xq [M][K] int8, then d and d * sum(xq) [M][B].
  const int64_t xq_floats = ceil_div(M * K, 4);
  float* buf = tl_x.get(static_cast<size_t>(xq_floats + 2 * M * B + 1));
  int8_t* xq = reinterpret_cast<int8_t*>(buf);
  float* d = buf + xq_floats;
  float* sx = d + M * B;
  float tmp[kActBlock];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < kActBlock; ++i) tmp[i] = load_f32(a.x, a.x_dtype, m * K + b * kActBlock + i);
      int32_t is;
      d[m * B + b] = quantize_block(tmp, kActBlock, xq + m * K + b * kActBlock, &is);
      sx[m * B + b] = d[m * B + b] * static_cast<float>(is);
    }
  }
  const int64_t row_bytes = K * a.bits / 8;
  auto body = [&](int64_t n0, int64_t n1) {
    int32_t* q = reinterpret_cast<int32_t*>(tl_w.get(static_cast<size_t>(K)));
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = reinterpret_cast<const uint8_t*>(a.w) + n * row_bytes;
      for (int64_t k = 0; k < K; ++k) q[k] = static_cast<int32_t>(unpack_value(row, k, a.bits));
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.0f;
        for (int64_t b = 0; b < B; ++b) {
          const int8_t* xb = xq + m * K + b * kActBlock;
          const int32_t* qb = q + b * kActBlock;
          int32_t isum = 0;
          for (int64_t i = 0; i < kActBlock; ++i) isum += qb[i] * static_cast<int32_t>(xb[i]);
          const int64_t g = b / bpg;
          const float s = load_f32(a.scales, a.s_dtype, n * G + g);
          const float bi = a.biases ? load_f32(a.biases, a.s_dtype, n * G + g) : sym_bias(a.bits) * s;
          acc += s * (d[m * B + b] * static_cast<float>(isum)) + bi * sx[m * B + b];
        }
        store_f32(a.out, a.x_dtype, m * N + n, acc);
      }
    }
  };
  par(N, 4, body);
}

} // namespace qmm
} // namespace mlxfast
