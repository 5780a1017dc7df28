// Portable C++ quantized matmul: any bits in 2..8 or dense weights, any CPU.
// Dequantizes a few weight rows at a time to fp32 and takes dot
// products against fp32 activations. Correctness reference for the SIMD
// paths and their fallback for bit widths they do not specialize.
#include "cpu/qmm.h"

namespace mlxfast {
namespace qmm {

namespace {

thread_local Scratch tl_x;
thread_local Scratch tl_w;

constexpr int kRows = 4;  // weight rows dequantized together

// Dequantize row n of w into dst[K] (fp32).
void dequant_row(const Args& a, int64_t n, float* dst) {
  if (a.bits == 0) {  // dense
    for (int64_t k = 0; k < a.K; ++k) dst[k] = load_f32(a.w, a.w_dtype, n * a.K + k);
    return;
  }
  const int64_t G = a.K / a.group_size;
  if (a.rows16) {  // bits 4 or 8
    for (int64_t g = 0; g < G; ++g) {
      const float s = load_f32(a.scales, a.s_dtype, rows16_param(a, n, g));
      const float b = a.biases ? load_f32(a.biases, a.s_dtype, rows16_param(a, n, g))
                               : sym_bias(a.bits) * s;
      for (int64_t k = g * a.group_size; k < (g + 1) * a.group_size; ++k) {
        const uint32_t q = rows16_code(a, n, k);
        dst[k] = s * static_cast<float>(q) + b;
      }
    }
    return;
  }
  const int64_t row_bytes = a.K * a.bits / 8;
  const uint8_t* row = reinterpret_cast<const uint8_t*>(a.w) + n * row_bytes;
  for (int64_t g = 0; g < G; ++g) {
    float s = load_f32(a.scales, a.s_dtype, n * G + g);
    float b = a.biases ? load_f32(a.biases, a.s_dtype, n * G + g) : sym_bias(a.bits) * s;
    int64_t k0 = g * a.group_size;
    if (a.bits == 4) {
      for (int64_t k = 0; k < a.group_size; k += 2) {
        uint8_t byte = row[(k0 + k) >> 1];
        dst[k0 + k] = s * static_cast<float>(byte & 0xf) + b;
        dst[k0 + k + 1] = s * static_cast<float>(byte >> 4) + b;
      }
    } else if (a.bits == 8) {
      for (int64_t k = 0; k < a.group_size; ++k) {
        dst[k0 + k] = s * static_cast<float>(row[k0 + k]) + b;
      }
    } else {
      for (int64_t k = 0; k < a.group_size; ++k) {
        dst[k0 + k] = s * static_cast<float>(unpack_value(row, k0 + k, a.bits)) + b;
      }
    }
  }
}

// 8 independent partial sums so that the compiler can vectorize without
// reassociating a single accumulator.
inline float dot(const float* x, const float* w, int64_t K) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += x[k + j] * w[k + j];
  }
  for (; k < K; ++k) acc[0] += x[k] * w[k];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

} // namespace

void gemv_prepare_portable(const Args& a, float* xp) {
  for (int64_t i = 0; i < a.M * a.K; ++i) xp[i] = load_f32(a.x, a.x_dtype, i);
}

// Output rows [0, M), columns [n0, n1): weight rows kRows at a time.
void gemv_block_portable(const Args& a, const float* xf, int64_t n0, int64_t n1) {
  const int64_t M = a.M, N = a.N, K = a.K;
  float* wbuf = tl_w.get(static_cast<size_t>(kRows * K));
  for (int64_t nb = n0; nb < n1; nb += kRows) {
    int rows = static_cast<int>(n1 - nb < kRows ? n1 - nb : kRows);
    for (int r = 0; r < rows; ++r) dequant_row(a, nb + r, wbuf + r * K);
    for (int64_t m = 0; m < M; ++m) {
      for (int r = 0; r < rows; ++r) {
        store_f32(a.out, a.x_dtype, m * N + nb + r, dot(xf + m * K, wbuf + r * K, K));
      }
    }
  }
}

void run_portable(const Args& a) {
  const int64_t M = a.M, N = a.N, K = a.K;
  // Activations in fp32 once.
  const float* xf;
  if (a.x_dtype == F32) {
    xf = static_cast<const float*>(a.x);
  } else {
    float* buf = tl_x.get(static_cast<size_t>(M * K));
    gemv_prepare_portable(a, buf);
    xf = buf;
  }
  const int64_t blocks = ceil_div(N, kRows);
  auto body = [&a, xf, N](int64_t b0, int64_t b1) {
    gemv_block_portable(a, xf, b0 * kRows, b1 * kRows < N ? b1 * kRows : N);
  };
  par(blocks, 1, body);
}

} // namespace qmm
} // namespace mlxfast
