// Shared pieces of the RoPE kernels (rope, qkv_rope).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace mlxfast::rope_detail {

// inv_freq[i] = base^(-2i/dims), or 1 / freqs[i].
inline std::vector<float> inverse_frequencies(int dims, float base, const float* freqs) {
  std::vector<float> inv(dims / 2);
  for (int i = 0; i < dims / 2; ++i) {
    inv[i] = freqs ? 1.0f / freqs[i]
                   : std::pow(base, -2.0f * static_cast<float>(i) / static_cast<float>(dims));
  }
  return inv;
}

inline void angles(float position, const float* inv_freq, int half, float* cs, float* sn) {
  for (int i = 0; i < half; ++i) {
    float a = position * inv_freq[i];
    cs[i] = std::cos(a);
    sn[i] = std::sin(a);
  }
}

// o = rotate(x * gain) for one head of d features; gain (per feature) may be null.
template <typename T>
inline void rotate_head(const T* x, T* o, int64_t d, int dims, bool traditional, const float* cs,
                        const float* sn, const float* gain) {
  const int half = dims / 2;
  auto in = [&](int64_t i) {
    float v = static_cast<float>(x[i]);
    return gain ? v * gain[i] : v;
  };
  for (int i = 0; i < half; ++i) {
    int i0 = traditional ? 2 * i : i;
    int i1 = traditional ? 2 * i + 1 : i + half;
    float x0 = in(i0), x1 = in(i1);
    o[i0] = static_cast<T>(x0 * cs[i] - x1 * sn[i]);
    o[i1] = static_cast<T>(x0 * sn[i] + x1 * cs[i]);
  }
  for (int64_t i = dims; i < d; ++i) o[i] = static_cast<T>(in(i));
}

} // namespace mlxfast::rope_detail
