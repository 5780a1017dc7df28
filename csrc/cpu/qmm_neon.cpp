// NEON (arm64) quantized matmul, bits 4 and 8 (others: portable).
// Deliberately simple: four weight rows at a time are dequantized to fp32
// with NEON (nibble split + zip restores the natural order), then each
// activation row takes fp32 dot products against them (4 accumulators).
// Weights are streamed once per call for any M; activations in fp32 stay
// in cache. Not compiled on x86 hosts: keep it obviously correct.
#include <arm_neon.h>

#include "cpu/qmm.h"

namespace mlxfast {
namespace qmm {

namespace {

thread_local Scratch tl_x;
thread_local Scratch tl_w;

constexpr int kRows = 4;

inline void store_u8x16(uint8x16_t q, float32x4_t s, float32x4_t b, float* dst) {
  uint16x8_t h0 = vmovl_u8(vget_low_u8(q));
  uint16x8_t h1 = vmovl_u8(vget_high_u8(q));
  vst1q_f32(dst + 0, vfmaq_f32(b, vcvtq_f32_u32(vmovl_u16(vget_low_u16(h0))), s));
  vst1q_f32(dst + 4, vfmaq_f32(b, vcvtq_f32_u32(vmovl_u16(vget_high_u16(h0))), s));
  vst1q_f32(dst + 8, vfmaq_f32(b, vcvtq_f32_u32(vmovl_u16(vget_low_u16(h1))), s));
  vst1q_f32(dst + 12, vfmaq_f32(b, vcvtq_f32_u32(vmovl_u16(vget_high_u16(h1))), s));
}

// Row n of w dequantized to dst[K] (fp32). bits 4 or 8, group_size % 32 == 0.
void dequant_row(const Args& a, int64_t n, float* dst) {
  const int64_t K = a.K, G = K / a.group_size, gs = a.group_size;
  const int64_t row_bytes = K * a.bits / 8;
  const uint8_t* row = reinterpret_cast<const uint8_t*>(a.w) + n * row_bytes;
  const uint8x16_t m4 = vdupq_n_u8(0x0f);
  for (int64_t g = 0; g < G; ++g) {
    const float sf = load_f32(a.scales, a.s_dtype, n * G + g);
    float32x4_t s = vdupq_n_f32(sf);
    float32x4_t b = vdupq_n_f32(a.biases ? load_f32(a.biases, a.s_dtype, n * G + g)
                                         : sym_bias(a.bits) * sf);
    for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += 32) {
      if (a.bits == 4) {
        uint8x16_t q = vld1q_u8(row + (k0 >> 1));
        uint8x16_t lo = vandq_u8(q, m4);    // values k0 + 0, 2, 4, ...
        uint8x16_t hi = vshrq_n_u8(q, 4);   // values k0 + 1, 3, 5, ...
        store_u8x16(vzip1q_u8(lo, hi), s, b, dst + k0);        // k0 + 0..15
        store_u8x16(vzip2q_u8(lo, hi), s, b, dst + k0 + 16);   // k0 + 16..31
      } else {
        store_u8x16(vld1q_u8(row + k0), s, b, dst + k0);
        store_u8x16(vld1q_u8(row + k0 + 16), s, b, dst + k0 + 16);
      }
    }
  }
}

inline float dot(const float* x, const float* w, int64_t K) {  // K % 16 == 0
  float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < K; k += 16) {
    a0 = vfmaq_f32(a0, vld1q_f32(x + k), vld1q_f32(w + k));
    a1 = vfmaq_f32(a1, vld1q_f32(x + k + 4), vld1q_f32(w + k + 4));
    a2 = vfmaq_f32(a2, vld1q_f32(x + k + 8), vld1q_f32(w + k + 8));
    a3 = vfmaq_f32(a3, vld1q_f32(x + k + 12), vld1q_f32(w + k + 12));
  }
  return vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
}

} // namespace

void gemv_prepare_neon(const Args& a, float* xp) {
  for (int64_t i = 0; i < a.M * a.K; ++i) xp[i] = load_f32(a.x, a.x_dtype, i);
}

// Output rows [0, M), columns [n0, n1): weight rows kRows at a time (bits 4, 8).
void gemv_block_neon(const Args& a, const float* xf, int64_t n0, int64_t n1) {
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

void run_neon(const Args& a) {
  if (a.bits != 4 && a.bits != 8) {
    run_portable(a);
    return;
  }
  const int64_t M = a.M, N = a.N, K = a.K;
  const float* xf;
  if (a.x_dtype == F32) {
    xf = static_cast<const float*>(a.x);
  } else {
    float* buf = tl_x.get(static_cast<size_t>(M * K));
    gemv_prepare_neon(a, buf);
    xf = buf;
  }
  const Args* pa = &a;
  auto body = [pa, xf, N](int64_t b0, int64_t b1) {
    gemv_block_neon(*pa, xf, b0 * kRows, b1 * kRows < N ? b1 * kRows : N);
  };
  par(ceil_div(N, kRows), 1, body);
}

} // namespace qmm
} // namespace mlxfast
