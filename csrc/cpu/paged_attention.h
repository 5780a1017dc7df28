// Private interface of the paged-attention CPU kernels (csrc/cpu/paged_attention_*.cpp).
//
// For each query token t (sequence seq_idx[t], position pos[t]) and each query
// head h: softmax(scale * q[t,h] . K[j]) . V[j] over keys j = 0..pos[t] of its
// sequence, where key j lives in slot tables[seq][j / bs] * bs + j % bs of the
// pools ([num_slots, Hkv, D]). GQA: head h reads kv head h / (Hq / Hkv).
// float32 accumulation, online softmax one block at a time. Work items are
// (token, kv head): the G query heads that share a kv head read each K/V row
// once.
//
// ODR: compiled with different ISA flags per file, so everything defined here
// lives in an anonymous namespace, and no std:: containers are used.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

namespace mlxfast {
namespace pa {

enum DType : int { F32 = 0, F16 = 1, BF16 = 2 };

// Limits checked by the op (stack-free buffers are sized from them).
constexpr int kMaxHeadDim = 512;
constexpr int kMaxGroup = 64;
constexpr int kMaxBlock = 1024;

struct Args {
  const void* q;        // [T, Hq, D] in q_dtype
  const void* k;        // [num_slots, Hkv, D] in kv_dtype
  const void* v;        // [num_slots, Hkv, Dv] in kv_dtype
  void* out;            // [T, Hq, Dv] in q_dtype
  const int32_t* tables;   // [S, B]
  const int32_t* seq_idx;  // [T]
  const int32_t* pos;      // [T]
  int64_t T, S, B, num_slots;
  int Hq, Hkv, D, Dv, bs;
  float scale;
  DType q_dtype, kv_dtype;
};

// parallel_for over the shared pool, defined in ops/paged_attention.cpp.
void parallel(int64_t n, int64_t grain, void (*fn)(void* ctx, int64_t, int64_t), void* ctx);

void run_portable(const Args& a);
#if defined(MLXFAST_X86)
void run_avx2(const Args& a);
void run_avx512(const Args& a);
#endif

namespace {

inline float h2f(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    float f = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -f : f;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f2h(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0u));
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (x < 0x38800000u) {
    float a;
    std::memcpy(&a, &x, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  x += 0xfffu + ((x >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((x - 0x38000000u) >> 13));
}

inline float b2f(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f2b(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Row of n elements -> float. Returns a pointer to float data (src itself for F32).
inline const float* load_row(const void* src, DType dt, int n, float* buf) {
  if (dt == F32) return static_cast<const float*>(src);
  const uint16_t* s = static_cast<const uint16_t*>(src);
  if (dt == BF16) {
    for (int i = 0; i < n; ++i) {
      uint32_t u = static_cast<uint32_t>(s[i]) << 16;
      std::memcpy(buf + i, &u, 4);
    }
    return buf;
  }
  int i = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) buf[i] = h2f(s[i]);
  return buf;
}

// Dot product with W independent partial sums (vectorizes without -ffast-math).
template <int W>
inline float dot(const float* a, const float* b, int n) {
  float acc[W] = {0};
  int i = 0;
  for (; i + W <= n; i += W)
    for (int u = 0; u < W; ++u) acc[u] += a[i + u] * b[i + u];
  float s = 0;
  for (int u = 0; u < W; ++u) s += acc[u];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void scal(float* y, float a, int n) {
  for (int i = 0; i < n; ++i) y[i] *= a;
}

inline size_t elem_size(DType d) { return d == F32 ? 4 : 2; }

template <int W>
struct Kernel {
  static void run_range(void* ctx, int64_t begin, int64_t end) {
    const Args& a = *static_cast<const Args*>(ctx);
    const int G = a.Hq / a.Hkv, D = a.D, Dv = a.Dv, bs = a.bs;
    const size_t qes = elem_size(a.q_dtype), kes = elem_size(a.kv_dtype);
    // Scratch: q (G*D), acc (G*Dv), scores (G*bs), m, l (G), k row, v row.
    size_t n = static_cast<size_t>(G) * D + static_cast<size_t>(G) * Dv +
               static_cast<size_t>(G) * bs + 2 * G + D + Dv + 64;
    float* scratch = static_cast<float*>(std::malloc(n * sizeof(float)));
    float* qf = scratch;
    float* acc = qf + static_cast<size_t>(G) * D;
    float* sc = acc + static_cast<size_t>(G) * Dv;
    float* m = sc + static_cast<size_t>(G) * bs;
    float* l = m + G;
    float* kbuf = l + G;
    float* vbuf = kbuf + D;
    const int64_t T = a.T;
    for (int64_t it = begin; it < end; ++it) {
      // Interleave light and heavy tokens: item i -> token from alternate ends.
      int64_t ti = it / a.Hkv;
      const int kh = static_cast<int>(it % a.Hkv);
      const int64_t t = (ti % 2 == 0) ? ti / 2 : T - 1 - ti / 2;
      const int32_t s = a.seq_idx[t];
      int64_t n_keys = static_cast<int64_t>(a.pos[t]) + 1;
      const bool valid = s >= 0 && s < a.S && n_keys >= 1;
      if (n_keys > a.B * bs) n_keys = a.B * bs;
      for (int g = 0; g < G; ++g) {
        const int h = kh * G + g;
        const char* qp = static_cast<const char*>(a.q) + ((t * a.Hq + h) * D) * qes;
        const float* qr = load_row(qp, a.q_dtype, D, qf + static_cast<size_t>(g) * D);
        for (int d = 0; d < D; ++d) qf[static_cast<size_t>(g) * D + d] = qr[d] * a.scale;
        m[g] = -INFINITY;
        l[g] = 0.f;
      }
      std::memset(acc, 0, sizeof(float) * G * Dv);
      if (valid) {
        const int32_t* table = a.tables + static_cast<int64_t>(s) * a.B;
        const int64_t nblk = (n_keys + bs - 1) / bs;
        for (int64_t b = 0; b < nblk; ++b) {
          const int64_t blk = table[b];
          if (blk < 0 || (blk + 1) * bs > a.num_slots) continue;
          const int nk = static_cast<int>(n_keys - b * bs < bs ? n_keys - b * bs : bs);
          for (int i = 0; i < nk; ++i) {
            const int64_t slot = blk * bs + i;
            const char* kp = static_cast<const char*>(a.k) + ((slot * a.Hkv + kh) * D) * kes;
            const float* kr = load_row(kp, a.kv_dtype, D, kbuf);
            for (int g = 0; g < G; ++g)
              sc[g * bs + i] = dot<W>(qf + static_cast<size_t>(g) * D, kr, D);
          }
          for (int g = 0; g < G; ++g) {
            float* sg = sc + g * bs;
            float mb = sg[0];
            for (int i = 1; i < nk; ++i) mb = sg[i] > mb ? sg[i] : mb;
            const float mn = m[g] > mb ? m[g] : mb;
            if (m[g] != mn) {
              const float alpha = std::exp(m[g] - mn);  // exp(-inf) = 0 on the first block
              l[g] *= alpha;
              scal(acc + static_cast<size_t>(g) * Dv, alpha, Dv);
              m[g] = mn;
            }
            float sum = 0.f;
            for (int i = 0; i < nk; ++i) {
              const float e = std::exp(sg[i] - mn);
              sg[i] = e;
              sum += e;
            }
            l[g] += sum;
          }
          for (int i = 0; i < nk; ++i) {
            const int64_t slot = blk * bs + i;
            const char* vp = static_cast<const char*>(a.v) + ((slot * a.Hkv + kh) * Dv) * kes;
            const float* vr = load_row(vp, a.kv_dtype, Dv, vbuf);
            for (int g = 0; g < G; ++g) axpy(acc + static_cast<size_t>(g) * Dv, sc[g * bs + i], vr, Dv);
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        const int h = kh * G + g;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        const float* ag = acc + static_cast<size_t>(g) * Dv;
        const int64_t o = (t * a.Hq + h) * Dv;
        if (a.q_dtype == F32) {
          float* op = static_cast<float*>(a.out) + o;
          for (int d = 0; d < Dv; ++d) op[d] = ag[d] * inv;
        } else if (a.q_dtype == F16) {
          uint16_t* op = static_cast<uint16_t*>(a.out) + o;
          for (int d = 0; d < Dv; ++d) op[d] = f2h(ag[d] * inv);
        } else {
          uint16_t* op = static_cast<uint16_t*>(a.out) + o;
          for (int d = 0; d < Dv; ++d) op[d] = f2b(ag[d] * inv);
        }
      }
    }
    std::free(scratch);
  }

  static void run(const Args& a) {
    Args copy = a;
    parallel(a.T * a.Hkv, 1, &Kernel::run_range, &copy);
  }
};

}  // namespace
}  // namespace pa
}  // namespace mlxfast
