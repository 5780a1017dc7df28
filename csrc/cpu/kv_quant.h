// Private interface of the quantized-KV CPU kernels (csrc/cpu/kv_quant_*.cpp):
// encode K/V rows into packed rows, dequantize packed rows, and fused paged
// attention over packed rows. Row layout: python/mlxfast/ops/kvquant.py.
//
// Attention: work items are (query tile, kv head, key chunk). Long contexts
// with few rows (decode) are split along the keys (flash-decoding) so every
// thread has work; each item keeps an online softmax (m, l, acc) per query
// row and a merge pass combines the chunks. Per block of keys the item
// decodes the packed K and V rows once into an L1-resident float tile
// (codes -> scale*code+bias, or TurboQuant w*c[code] in the rotated domain)
// shared by all G*tile query rows; the dense pool is never materialized.
// TurboQuant values are accumulated in the rotated domain and rotated back
// once per (token, head) after the merge. Sliding window (window > 0): a
// tile's chunks start at the block of its earliest window start, so earlier
// table entries are never read; keys before a row's start are masked.
//
// ODR: compiled with different ISA flags per file; everything defined here
// lives in an anonymous namespace (via paged_attention.h's helpers too).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu/paged_attention.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#include "cpu/reduce_avx512.h"
#endif

namespace mlxfast {
namespace kvq {

using pa::DType;

struct Fmt {
  int D, kbits, vbits, group;
  bool vturbo;
  int kcode, kbytes, vcode, vbytes, row;
};

inline Fmt make_fmt(int D, int kbits, int vbits, int group, bool vturbo) {
  Fmt f;
  f.D = D;
  f.kbits = kbits;
  f.vbits = vbits;
  f.group = group;
  f.vturbo = vturbo;
  f.kcode = D * kbits / 8;
  f.kbytes = f.kcode + 4 * (D / group);
  f.vcode = D * vbits / 8;
  f.vbytes = f.vcode + (vturbo ? 4 : 4 * (D / group));
  f.row = f.kbytes + f.vbytes;
  return f;
}

struct EncodeArgs {
  const void* k;  // [n, D] rows (n = product of leading dims) in dtype
  const void* v;
  uint8_t* out;   // [n, row]
  const float* signs;     // [D]
  const float* codebook;  // [2^vbits]
  int64_t n;
  DType dtype;
  Fmt f;
};

struct DequantArgs {
  const uint8_t* packed;  // [n, row]
  void* k;                // [n, D] in dtype
  void* v;
  const float* signs;
  const float* codebook;
  int64_t n;
  DType dtype;
  Fmt f;
};

struct AttnArgs {
  const void* q;          // [T, Hq, D] in q_dtype
  const uint8_t* packed;  // [num_slots, Hkv, row]
  void* out;              // [T, Hq, D] in q_dtype
  const int32_t* tables;  // [S, B]
  const int32_t* seq_idx; // [T]
  const int32_t* pos;     // [T]
  const float* signs;
  const float* codebook;
  int64_t T, S, B, num_slots;
  int Hq, Hkv, bs;
  int window;             // 0: full causal; W > 0: keys pos - W < j <= pos
  float scale;
  DType q_dtype;
  Fmt f;
};

// An ISA file may take over a work item (query tokens t0..t1 of one
// sequence, kv heads [kh0, kh1), key blocks [b0, b1)) with a faster kernel:
// it writes the item's partial state to part ([kh1 - kh0][rows][D + 2]:
// unnormalised acc, m, l; see Kernels::run_item) and returns true, or
// returns false to leave the item to the generic kernel. Items hold one
// head unless the ISA file asks for head groups (Kernels::attention's
// decode_heads).
using ItemFn = bool (*)(const AttnArgs& a, int64_t t0, int64_t t1, int kh0, int kh1, int b0,
                        int b1, float* part);
using DecodeHeadsFn = int (*)(const AttnArgs& a, int rows);

void encode_portable(const EncodeArgs& a);
void dequant_portable(const DequantArgs& a);
void attention_portable(const AttnArgs& a);
#if defined(MLXFAST_X86)
void encode_avx2(const EncodeArgs& a);
void dequant_avx2(const DequantArgs& a);
void attention_avx2(const AttnArgs& a);
void encode_avx512(const EncodeArgs& a);
void dequant_avx512(const DequantArgs& a);
void attention_avx512(const AttnArgs& a);
// The AVX2 prefill item (16 query rows or more; kv_quant_avx2.cpp) as an
// ItemFn, false for fewer rows or a scheme it does not take. The avx512
// path takes its prefill items with it (AVX-512 CPUs run AVX2 code): the
// generic kernel took ~10x the dequantize-then-dense time there.
bool prefill_item_avx2(const AttnArgs& a, int64_t t0, int64_t t1, int kh0, int kh1, int b0,
                       int b1, float* part);
#endif
#if defined(MLXFAST_ARM64)
void encode_neon(const EncodeArgs& a);
void dequant_neon(const DequantArgs& a);
void attention_neon(const AttnArgs& a);
#endif

namespace {

// The schemes the ISA files' fast kernels take, as one table: an item's
// widths, value kind, group (the engine's kv_group_size: 64 or 32) and head
// dim (64/128/256) as compile-time arguments of Kernel<D, KB, VB, VT,
// GR>::run (the ISA file's item kernel); false for any other format (the
// generic kernel runs it).
template <template <int, int, int, bool, int> class Kernel, int D, int GR>
bool fast_item_dg(const AttnArgs& a, int64_t t0, int64_t t1, int kh0, int kh1, int b0, int b1, float* part) {
  const Fmt& f = a.f;
  using Fn = void (*)(const AttnArgs&, int64_t, int64_t, int, int, int, int, float*);
  Fn fn = nullptr;
  if (!f.vturbo) {  // the affine schemes: K and V of one width
    if (f.kbits == 8 && f.vbits == 8) fn = &Kernel<D, 8, 8, false, GR>::run;
    if (f.kbits == 4 && f.vbits == 4) fn = &Kernel<D, 4, 4, false, GR>::run;
  } else if (f.kbits == 8 || f.kbits == 4) {
    const bool k8 = f.kbits == 8;
    switch (f.vbits) {
      case 2: fn = k8 ? &Kernel<D, 8, 2, true, GR>::run : &Kernel<D, 4, 2, true, GR>::run; break;
      case 3: fn = k8 ? &Kernel<D, 8, 3, true, GR>::run : &Kernel<D, 4, 3, true, GR>::run; break;
      case 4: fn = k8 ? &Kernel<D, 8, 4, true, GR>::run : &Kernel<D, 4, 4, true, GR>::run; break;
      default: break;
    }
  }
  if (fn == nullptr) return false;
  fn(a, t0, t1, kh0, kh1, b0, b1, part);
  return true;
}

template <template <int, int, int, bool, int> class Kernel, int D>
bool fast_item_d(const AttnArgs& a, int64_t t0, int64_t t1, int kh0, int kh1, int b0, int b1, float* part) {
  switch (a.f.group) {
    case 64: return fast_item_dg<Kernel, D, 64>(a, t0, t1, kh0, kh1, b0, b1, part);
    case 32: return fast_item_dg<Kernel, D, 32>(a, t0, t1, kh0, kh1, b0, b1, part);
    default: return false;
  }
}

template <template <int, int, int, bool, int> class Kernel>
bool fast_item(const AttnArgs& a, int64_t t0, int64_t t1, int kh0, int kh1, int b0, int b1, float* part) {
  if (a.f.group > a.f.D) return false;
  switch (a.f.D) {
    case 64: return fast_item_d<Kernel, 64>(a, t0, t1, kh0, kh1, b0, b1, part);
    case 128: return fast_item_d<Kernel, 128>(a, t0, t1, kh0, kh1, b0, b1, part);
    case 256: return fast_item_d<Kernel, 256>(a, t0, t1, kh0, kh1, b0, b1, part);
    default: return false;
  }
}

// A per-head item kernel f(kh, part) over an item's heads [kh0, kh1), each
// head's partials after the previous head's (ItemFn's layout).
template <class F>
inline void each_head(const AttnArgs& a, int64_t t0, int64_t t1, int kh0, int kh1, float* part, F f) {
  const size_t hp = static_cast<size_t>(t1 - t0) * (a.Hq / a.Hkv) * (a.f.D + 2);
  for (int kh = kh0; kh < kh1; ++kh) f(kh, part + (kh - kh0) * hp);
}

// An ISA item's partial state in the generic kernel's layout (ItemFn):
// per row r, part[r * (D + 2) ..] = acc [D] (unnormalised), m, l.
inline void store_partials(float* part, int R, int D, const float* acc, const float* m,
                           const float* l) {
  for (int r = 0; r < R; ++r) {
    float* pr = part + static_cast<size_t>(r) * (D + 2);
    std::memcpy(pr, acc + static_cast<size_t>(r) * D, sizeof(float) * D);
    pr[D] = m[r];
    pr[D + 1] = l[r];
  }
}

inline float rd_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return pa::h2f(h);
}

inline void wr_f16(uint8_t* p, float x) {
  uint16_t h = pa::f2h(x);
  std::memcpy(p, &h, 2);
}

// LSB-first bit stream: every 8 codes fill `bits` bytes.
inline void pack_codes(const uint8_t* c, int D, int bits, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, c, D);
    return;
  }
  for (int j = 0; j < D / 8; ++j) {
    uint64_t w = 0;
    for (int i = 0; i < 8; ++i) w |= static_cast<uint64_t>(c[j * 8 + i]) << (bits * i);
    for (int b = 0; b < bits; ++b) out[j * bits + b] = static_cast<uint8_t>(w >> (8 * b));
  }
}

inline void unpack_codes(const uint8_t* p, int D, int bits, uint8_t* c) {
  switch (bits) {
    case 8:
      std::memcpy(c, p, D);
      return;
    case 4:
      for (int j = 0; j < D / 2; ++j) {
        c[2 * j] = p[j] & 15;
        c[2 * j + 1] = p[j] >> 4;
      }
      return;
    case 2:
      for (int j = 0; j < D / 4; ++j) {
        const uint8_t b = p[j];
        c[4 * j] = b & 3;
        c[4 * j + 1] = (b >> 2) & 3;
        c[4 * j + 2] = (b >> 4) & 3;
        c[4 * j + 3] = b >> 6;
      }
      return;
    default:  // 3
      for (int j = 0; j < D / 8; ++j) {
        const uint32_t w = p[3 * j] | (p[3 * j + 1] << 8) | (p[3 * j + 2] << 16);
        for (int i = 0; i < 8; ++i) c[8 * j + i] = (w >> (3 * i)) & 7;
      }
  }
}

// In-place unnormalized Walsh-Hadamard transform (Sylvester order), n = 2^k.
inline void fwht(float* x, int n) {
  for (int h = 1; h < n; h <<= 1)
    for (int i = 0; i < n; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

// Affine group encode, bit-exact with the MLX reference (fp16 scale/bias,
// codes from the rounded values, round half to even).
inline void encode_affine(const float* x, int D, int bits, int g, uint8_t* out, uint8_t* codes) {
  const int ng = D / g;
  const float levels = static_cast<float>((1 << bits) - 1);
  uint8_t* sp = out + D * bits / 8;
  uint8_t* bp = sp + 2 * ng;
  for (int gi = 0; gi < ng; ++gi) {
    const float* xg = x + gi * g;
    float lo = xg[0], hi = xg[0];
    for (int i = 1; i < g; ++i) {
      lo = xg[i] < lo ? xg[i] : lo;
      hi = xg[i] > hi ? xg[i] : hi;
    }
    const uint16_t sh = pa::f2h((hi - lo) / levels), bh = pa::f2h(lo);
    const float s = pa::h2f(sh), b = pa::h2f(bh);
    std::memcpy(sp + 2 * gi, &sh, 2);
    std::memcpy(bp + 2 * gi, &bh, 2);
    for (int i = 0; i < g; ++i) {
      float q = s > 0.f ? std::nearbyint((xg[i] - b) / s) : 0.f;
      q = q < 0.f ? 0.f : (q > levels ? levels : q);
      codes[gi * g + i] = static_cast<uint8_t>(q);
    }
  }
  pack_codes(codes, D, bits, out);
}

#if defined(__AVX2__)
// 8 codes (chunk j of a row) as int32 lanes.
inline __m256i codes8(const uint8_t* p, int bits, int j) {
  if (bits == 8) return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j)));
  uint32_t w;
  std::memcpy(&w, p + bits * j, 4);  // rows always have >= 4 bytes after their codes
  const __m256i sh = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), sh),
                          _mm256_set1_epi32((1 << bits) - 1));
}
#endif

inline void decode_affine(const uint8_t* part, int D, int bits, int g, float* out, uint8_t* codes) {
  const uint8_t* sp = part + D * bits / 8;
  const uint8_t* bp = sp + 2 * (D / g);
#if defined(__AVX512F__)
  if (bits == 8 && g % 16 == 0) {  // 16 codes a step: one load, convert, FMA
    for (int gi = 0; gi < D / g; ++gi) {
      const __m512 s = _mm512_set1_ps(rd_f16(sp + 2 * gi)), b = _mm512_set1_ps(rd_f16(bp + 2 * gi));
      for (int j = gi * g / 16; j < (gi + 1) * g / 16; ++j) {
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(part + 16 * j)));
        _mm512_storeu_ps(out + 16 * j, _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), s, b));
      }
    }
    return;
  }
#endif
#if defined(__AVX2__)
  (void)codes;
  for (int gi = 0; gi < D / g; ++gi) {
    const __m256 s = _mm256_set1_ps(rd_f16(sp + 2 * gi)), b = _mm256_set1_ps(rd_f16(bp + 2 * gi));
    for (int j = gi * g / 8; j < (gi + 1) * g / 8; ++j)
      _mm256_storeu_ps(out + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes8(part, bits, j)), s, b));
  }
#else
  unpack_codes(part, D, bits, codes);
  for (int gi = 0; gi < D / g; ++gi) {
    const float s = rd_f16(sp + 2 * gi), b = rd_f16(bp + 2 * gi);
    for (int i = gi * g; i < (gi + 1) * g; ++i) out[i] = s * static_cast<float>(codes[i]) + b;
  }
#endif
}

// TurboQuant value encode; y is scratch [D].
inline void encode_turbo(const float* v, const Fmt& f, const float* signs, const float* cb,
                         uint8_t* out, uint8_t* codes, float* y) {
  const int D = f.D, nb = 1 << f.vbits;
  float ss = 0.f;
  for (int i = 0; i < D; ++i) {
    y[i] = v[i] * signs[i];
    ss += v[i] * v[i];
  }
  fwht(y, D);
  const float norm = std::sqrt(ss);
  const float rs = 1.0f / std::sqrt(static_cast<float>(D));
  const float k = std::sqrt(static_cast<float>(D)) / (norm > 1e-30f ? norm : 1e-30f);
  float cn = 0.f;
  for (int i = 0; i < D; ++i) {
    const float x = (y[i] * rs) * k;
    int c = 0;
    for (int j = 0; j + 1 < nb; ++j) c += x > 0.5f * (cb[j] + cb[j + 1]);
    codes[i] = static_cast<uint8_t>(c);
    cn += cb[c] * cb[c];
  }
  cn = std::sqrt(cn);
  const float w = cn > 0.f ? norm / cn : 0.f;
  pack_codes(codes, D, f.vbits, out);
  std::memcpy(out + f.vcode, &w, 4);
}

// w * c[codes]: the value in the rotated domain (cb padded to 16 entries).
inline void decode_turbo_rot(const uint8_t* part, const Fmt& f, const float* cb, float* out,
                             uint8_t* codes) {
  float w;
  std::memcpy(&w, part + f.vcode, 4);
#if defined(__AVX512F__)
  if (f.D % 16 == 0) {  // 16 codes a step, one 16-entry lookup (vbits <= 4)
    const __m512 tab = _mm512_loadu_ps(cb);  // cb is padded to 16 entries
    const __m512 wv = _mm512_set1_ps(w);
    for (int j = 0; j < f.D / 16; ++j) {
      const __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(codes8(part, f.vbits, 2 * j)),
                                           codes8(part, f.vbits, 2 * j + 1), 1);
      _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(_mm512_permutexvar_ps(c, tab), wv));
    }
    return;
  }
#endif
#if defined(__AVX2__)
  (void)codes;
  const __m256 lo = _mm256_loadu_ps(cb);  // cb is padded to 16 entries
  const __m256 hi = f.vbits == 4 ? _mm256_loadu_ps(cb + 8) : lo;
  const __m256 wv = _mm256_set1_ps(w);
  for (int j = 0; j < f.D / 8; ++j) {
    const __m256i c = codes8(part, f.vbits, j);
    __m256 x = _mm256_permutevar8x32_ps(lo, c);
    if (f.vbits == 4)
      x = _mm256_blendv_ps(x, _mm256_permutevar8x32_ps(hi, c),
                           _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, _mm256_set1_epi32(7))));
    _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(x, wv));
  }
#else
  unpack_codes(part, f.D, f.vbits, codes);
  for (int i = 0; i < f.D; ++i) out[i] = w * cb[codes[i]];
#endif
}

inline void inverse_rotation(float* y, int D, const float* signs) {
  fwht(y, D);
  const float rs = 1.0f / std::sqrt(static_cast<float>(D));
  for (int i = 0; i < D; ++i) y[i] *= signs[i] * rs;
}

inline void store_row(void* dst, DType dt, int64_t off, const float* x, int n) {
  if (dt == pa::F32) {
    std::memcpy(static_cast<float*>(dst) + off, x, n * 4);
  } else if (dt == pa::F16) {
    uint16_t* o = static_cast<uint16_t*>(dst) + off;
    for (int i = 0; i < n; ++i) o[i] = pa::f2h(x[i]);
  } else {
    uint16_t* o = static_cast<uint16_t*>(dst) + off;
    for (int i = 0; i < n; ++i) o[i] = pa::f2b(x[i]);
  }
}

// exp(x) for x <= ~0 (softmax), vectorizable: 2^round(t) * e^(f ln2), |f| <= 1/2,
// degree-6 Taylor (relative error ~2e-7). -inf -> 0.
inline float fexp(float x) {
  float t = x * 1.44269504088896341f;
  t = t < -126.f ? -126.f : (t > 126.f ? 126.f : t);
  const float r = (t + 12582912.f) - 12582912.f;  // round to nearest
  const float f = (t - r) * 0.693147180559945309f;
  float p = 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  int32_t bits = (static_cast<int32_t>(r) + 127) << 23;
  float s;
  std::memcpy(&s, &bits, 4);
  return x == -INFINITY ? 0.f : p * s;
}

// The scaled query row rounded to 8 bits in place, per block of g values
// (the keys' group; ops/kvquant.py, "Scores": d = max|q| / 127,
// q -> d * round(q * 127 / max|q|)); the integer codes into q8 and the
// blocks' d into d when given. Same float operations on every path.
inline void round_query(float* q, int D, int g, int8_t* q8, float* d) {
  for (int b = 0; b < D / g; ++b) {
    float* x = q + b * g;
    float amax = 0.f;
    for (int i = 0; i < g; ++i) amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
    const float inv = amax > 0.f ? 127.f / amax : 0.f, db = amax / 127.f;
    for (int i = 0; i < g; ++i) {
      const float c = std::nearbyint(x[i] * inv);
      if (q8) q8[b * g + i] = static_cast<int8_t>(c);
      x[i] = c * db;
    }
    if (d) d[b] = db;
  }
}

// Dot product with W partial sums and a tree reduction (no serial tail).
template <int W>
inline float dotw(const float* a, const float* b, int n) {
  float acc[W] = {0};
  for (int i = 0; i < n; i += W)
    for (int u = 0; u < W; ++u) acc[u] += a[i + u] * b[i + u];
  for (int w = W / 2; w >= 1; w /= 2)
    for (int u = 0; u < w; ++u) acc[u] += acc[u + w];
  return acc[0];
}

#if defined(__AVX512F__)
// Scores of keys k0 .. k0+15 of a decoded block (rows of kb, D floats each;
// rows past nk read as 0) against one query row, as one vector: 16 partial
// sums reduced together. One horizontal reduction per key (dotw) was the
// quantized decode's hottest loop (~15% of its samples, through the stack).
// DC, the head dim, is a compile-time count where it can be (0: D at run
// time) so the 16 keys' FMA chains unroll and interleave (a run-time loop
// left one chain waiting on each FMA's latency).
template <int DC>
inline __m512 scores16(const float* q, const float* kb, int D, int nk) {
  const int dn = DC ? DC : D;
  __m512 part[16];
  for (int k = 0; k < 16; ++k) {
    __m512 p = _mm512_setzero_ps();
    if (k < nk) {
      for (int d = 0; d < dn; d += 16)
        p = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(kb + k * dn + d), p);
    }
    part[k] = p;
  }
  return reduce16x16(part);
}

inline __m512 scores16(const float* q, const float* kb, int D, int nk) {
  switch (D) {
    case 64: return scores16<64>(q, kb, D, nk);
    case 128: return scores16<128>(q, kb, D, nk);
    case 256: return scores16<256>(q, kb, D, nk);
    default: return scores16<0>(q, kb, D, nk);
  }
}
#endif

// acc[0 .. DC) += sum over the block's keys of p[i] * v[i] (keys in order:
// the same sums as one key at a time). DC compile-time: the DC / W
// accumulator vectors stay in registers and their chains interleave; one
// vector at a time over all keys waited on each FMA (the decode's second
// hottest loop).
template <int DC>
inline void pv_accumulate(float* acc, const float* p, const float* v, int nk) {
  float a[DC];
  for (int d = 0; d < DC; ++d) a[d] = acc[d];
  for (int i = 0; i < nk; ++i) {
    const float pi = p[i];
    const float* vr = v + static_cast<size_t>(i) * DC;
    for (int d = 0; d < DC; ++d) a[d] += pi * vr[d];
  }
  for (int d = 0; d < DC; ++d) acc[d] = a[d];
}

// Keys of one work item, at most: a chunk's kv heads run one after another
// on one thread (Kernels::attention), and the later heads find the slots'
// rows the first one read still in L2 only if the chunk is small (512 slots
// of 3 heads of 8-bit codes: ~200 KB).
constexpr int64_t kMaxChunkKeys = 512;

template <int W>
struct Kernels {
  // ---- encode / dequant -----------------------------------------------------
  static void encode_range(void* vctx, int64_t b, int64_t e) {
    const EncodeArgs& a = *static_cast<const EncodeArgs*>(vctx);
    const Fmt& f = a.f;
    float* buf = static_cast<float*>(std::malloc(sizeof(float) * 4 * f.D));
    float *kb = buf, *vb = buf + f.D, *y = buf + 2 * f.D;
    uint8_t codes[pa::kMaxHeadDim];
    const size_t es = pa::elem_size(a.dtype);
    for (int64_t r = b; r < e; ++r) {
      const float* k = pa::load_row(static_cast<const char*>(a.k) + r * f.D * es, a.dtype, f.D, kb);
      const float* v = pa::load_row(static_cast<const char*>(a.v) + r * f.D * es, a.dtype, f.D, vb);
      uint8_t* o = a.out + r * f.row;
      encode_affine(k, f.D, f.kbits, f.group, o, codes);
      if (f.vturbo)
        encode_turbo(v, f, a.signs, a.codebook, o + f.kbytes, codes, y);
      else
        encode_affine(v, f.D, f.vbits, f.group, o + f.kbytes, codes);
    }
    std::free(buf);
  }

  static void encode(const EncodeArgs& a) {
    parallel_for(a.n, 64, &Kernels::encode_range, const_cast<EncodeArgs*>(&a));
  }

  static void dequant_range(void* vctx, int64_t b, int64_t e) {
    const DequantArgs& a = *static_cast<const DequantArgs*>(vctx);
    const Fmt& f = a.f;
    float cbp[16] = {0};
    if (f.vturbo) std::memcpy(cbp, a.codebook, sizeof(float) * (1 << f.vbits));
    float buf[2 * pa::kMaxHeadDim];
    uint8_t codes[pa::kMaxHeadDim];
    for (int64_t r = b; r < e; ++r) {
      const uint8_t* p = a.packed + r * f.row;
      decode_affine(p, f.D, f.kbits, f.group, buf, codes);
      if (f.vturbo) {
        decode_turbo_rot(p + f.kbytes, f, cbp, buf + f.D, codes);
        inverse_rotation(buf + f.D, f.D, a.signs);
      } else {
        decode_affine(p + f.kbytes, f.D, f.vbits, f.group, buf + f.D, codes);
      }
      store_row(a.k, a.dtype, r * f.D, buf, f.D);
      store_row(a.v, a.dtype, r * f.D, buf + f.D, f.D);
    }
  }

  static void dequant(const DequantArgs& a) {
    parallel_for(a.n, 64, &Kernels::dequant_range, const_cast<DequantArgs*>(&a));
  }

  // ---- attention ------------------------------------------------------------
  struct Item {
    int64_t tile;     // index into tiles
    int32_t kh, kh1;  // kv heads [kh, kh1)
    int32_t b0, b1;   // key blocks [b0, b1) of the sequence
    int64_t part;     // offset of this item's partials (floats)
  };

  struct Ctx {
    const AttnArgs* a;
    const int64_t* tiles;     // [n_tiles + 1] token offsets
    const Item* items;
    const int64_t* order;     // items in bucket order
    const int64_t* bucket;    // [n_buckets + 1] offsets into order
    float* parts;             // partials: per item rows * (D + 2)
    const int64_t* item_lo;   // [n_tiles * Hkv]: the items holding (tile, kh) are
    const int64_t* item_hi;   // [item_lo, item_hi), contiguous
    ItemFn fast;              // the ISA file's kernel for the items it takes, or null
  };

  static void run_item(const Ctx& c, const Item& it, float* scratch) {
    const AttnArgs& a = *c.a;
    const int64_t t0 = c.tiles[it.tile], t1 = c.tiles[it.tile + 1];
    if (c.fast && c.fast(a, t0, t1, it.kh, it.kh1, it.b0, it.b1, c.parts + it.part)) return;
    each_head(a, t0, t1, it.kh, it.kh1, c.parts + it.part,
              [&](int kh, float* part) { run_head(c, it, kh, part, scratch); });
  }

  // The generic kernel on one kv head of an item, its partials to part.
  static void run_head(const Ctx& c, const Item& it, int kh, float* part, float* scratch) {
    const AttnArgs& a = *c.a;
    const Fmt& f = a.f;
    const int D = f.D, bs = a.bs, G = a.Hq / a.Hkv;
    const int64_t t0 = c.tiles[it.tile], t1 = c.tiles[it.tile + 1];
    const int nq = static_cast<int>(t1 - t0), rows = nq * G;
    float* qf = scratch;                                   // [rows, D]
    float* kblk = qf + static_cast<size_t>(rows) * D;      // [bs, D]
    float* vblk = kblk + static_cast<size_t>(bs) * D;      // [bs, D]
    float* sc = vblk + static_cast<size_t>(bs) * D;        // [rows, bs]
    float* kT = sc + static_cast<size_t>(rows) * bs;       // [D, bs]
    uint8_t codes[pa::kMaxHeadDim];
    float cbp[16] = {0};
    if (f.vturbo) std::memcpy(cbp, a.codebook, sizeof(float) * (1 << f.vbits));
    // part: [rows][D + 2]: acc, m, l
    const size_t qes = pa::elem_size(a.q_dtype);
    int64_t qpos[pa::kTile], qlo[pa::kTile];
    const int32_t s = a.seq_idx[t0];
    for (int j = 0; j < nq; ++j) {
      int64_t p = a.pos[t0 + j];
      qlo[j] = pa::key_lo(a.window, p);
      if (p > a.B * bs - 1) p = a.B * bs - 1;
      qpos[j] = p;
      for (int g = 0; g < G; ++g) {
        const int r = j * G + g, h = kh * G + g;
        const char* qp = static_cast<const char*>(a.q) + ((t0 + j) * a.Hq + h) * D * qes;
        float* dst = qf + static_cast<size_t>(r) * D;
        const float* qr = pa::load_row(qp, a.q_dtype, D, dst);
        for (int d = 0; d < D; ++d) dst[d] = qr[d] * a.scale;
        round_query(dst, D, f.group, nullptr, nullptr);
        float* pr = part + static_cast<size_t>(r) * (D + 2);
        std::memset(pr, 0, sizeof(float) * D);
        pr[D] = -INFINITY;
        pr[D + 1] = 0.f;
      }
    }
    if (s < 0 || s >= a.S) return;
    const int32_t* table = a.tables + static_cast<int64_t>(s) * a.B;
    const int64_t rowb = static_cast<int64_t>(a.Hkv) * f.row;  // bytes between slots
    for (int b = it.b0; b < it.b1; ++b) {
      const int64_t blk = table[b];
      if (blk < 0 || (blk + 1) * bs > a.num_slots) continue;
      const int64_t key0 = static_cast<int64_t>(b) * bs;
      int64_t last = 0;  // keys this block contributes to any row of the tile
      for (int j = 0; j < nq; ++j) last = qpos[j] + 1 > last ? qpos[j] + 1 : last;
      const int nk = static_cast<int>(last - key0 < bs ? last - key0 : bs);
      if (nk <= 0) continue;
      const uint8_t* base = a.packed + blk * bs * rowb + static_cast<int64_t>(kh) * f.row;
      if (b + 1 < it.b1) {
        const int64_t nxt = table[b + 1];
        if (nxt >= 0 && (nxt + 1) * bs <= a.num_slots)
          pa::prefetch_rows(reinterpret_cast<const char*>(a.packed),
                            nxt * bs * rowb + static_cast<int64_t>(kh) * f.row, bs, rowb, f.row);
      }
      for (int i = 0; i < nk; ++i)
        decode_affine(base + i * rowb, D, f.kbits, f.group, kblk + static_cast<size_t>(i) * D, codes);
      // scores
      if (rows >= 8) {
        // many rows (prefill tiles): K tile transposed to [D][nk], scores of
        // all nk keys at once per row -- vectorized over keys, no reductions
        for (int i = 0; i < nk; ++i)
          for (int d = 0; d < D; ++d) kT[d * nk + i] = kblk[static_cast<size_t>(i) * D + d];
        for (int j = 0; j < nq; ++j)
          for (int g = 0; g < G; ++g) {
            const int r = j * G + g;
            const float* qr = qf + static_cast<size_t>(r) * D;
            float* sr = sc + static_cast<size_t>(r) * bs;
            for (int i = 0; i < nk; ++i) sr[i] = 0.f;
            for (int d = 0; d < D; ++d) {
              const float qd = qr[d];
              const float* kd = kT + d * nk;
              for (int i = 0; i < nk; ++i) sr[i] += qd * kd[i];
            }
            for (int i = 0; i < nk; ++i)
              if ((key0 + i > qpos[j]) | (key0 + i < qlo[j])) sr[i] = -INFINITY;
          }
      } else {
        for (int j = 0; j < nq; ++j)
          for (int g = 0; g < G; ++g) {
            const int r = j * G + g;
            const float* qr = qf + static_cast<size_t>(r) * D;
            float* sr = sc + static_cast<size_t>(r) * bs;
#if defined(__AVX512F__)
            if constexpr (W == 16) {  // D % 16 == 0 here (see attention)
              const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                     13, 14, 15);
              for (int i0 = 0; i0 < nk; i0 += 16) {
                const int nv = nk - i0 < 16 ? nk - i0 : 16;
                const __mmask16 in = static_cast<__mmask16>((1u << nv) - 1u);
                const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(key0 + i0)));
                __mmask16 ok = _mm512_mask_cmple_epi32_mask(in, key, _mm512_set1_epi32(static_cast<int>(qpos[j])));
                ok = _mm512_mask_cmpge_epi32_mask(ok, key, _mm512_set1_epi32(static_cast<int>(qlo[j])));
                const __m512 s16 = scores16(qr, kblk + static_cast<size_t>(i0) * D, D, nv);
                _mm512_mask_storeu_ps(sr + i0, in, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), ok, s16));
              }
              continue;
            }
#endif
            for (int i = 0; i < nk; ++i)
              sr[i] = (key0 + i <= qpos[j]) & (key0 + i >= qlo[j])
                          ? dotw<W>(qr, kblk + static_cast<size_t>(i) * D, D)
                          : -INFINITY;
          }
      }
      // values of the block (rotated domain for TurboQuant)
      for (int i = 0; i < nk; ++i) {
        const uint8_t* vp = base + i * rowb + f.kbytes;
        if (f.vturbo)
          decode_turbo_rot(vp, f, cbp, vblk + static_cast<size_t>(i) * D, codes);
        else
          decode_affine(vp, D, f.vbits, f.group, vblk + static_cast<size_t>(i) * D, codes);
      }
      // online softmax + accumulate, row by row (acc stays in registers/L1)
      for (int r = 0; r < rows; ++r) {
        float* sr = sc + static_cast<size_t>(r) * bs;
        float* pr = part + static_cast<size_t>(r) * (D + 2);
        float mb = -INFINITY;
        for (int i = 0; i < nk; ++i) mb = sr[i] > mb ? sr[i] : mb;
        if (mb == -INFINITY) continue;
        const float m = pr[D];
        const float mn = m > mb ? m : mb;
        float sum = 0.f;
        for (int i = 0; i < nk; ++i) {
          const float e = fexp(sr[i] - mn);
          sr[i] = e;
          sum += e;
        }
        if (m != mn) {
          const float alpha = fexp(m - mn);
          pr[D + 1] *= alpha;
          for (int d = 0; d < D; ++d) pr[d] *= alpha;
          pr[D] = mn;
        }
        pr[D + 1] += sum;
        if (D == 64) {
          pv_accumulate<64>(pr, sr, vblk, nk);
          continue;
        }
        if (D == 128) {
          pv_accumulate<128>(pr, sr, vblk, nk);
          continue;
        }
        for (int c0 = 0; c0 < D; c0 += W) {  // one register of acc over the block's keys
          float av[W];
          for (int u = 0; u < W; ++u) av[u] = pr[c0 + u];
          for (int i = 0; i < nk; ++i) {
            const float p = sr[i];
            const float* vr = vblk + static_cast<size_t>(i) * D + c0;
            for (int u = 0; u < W; ++u) av[u] += p * vr[u];
          }
          for (int u = 0; u < W; ++u) pr[c0 + u] = av[u];
        }
      }
    }
  }

  static void run_bucket(void* vctx, int64_t b, int64_t e) {
    const Ctx& c = *static_cast<const Ctx*>(vctx);
    const AttnArgs& a = *c.a;
    const int G = a.Hq / a.Hkv, D = a.f.D;
    size_t n = static_cast<size_t>(pa::kTile) * G * (D + a.bs) + 3 * static_cast<size_t>(a.bs) * D + 64;
    float* scratch = static_cast<float*>(std::malloc(n * sizeof(float)));
    for (int64_t k = b; k < e; ++k)
      for (int64_t i = c.bucket[k]; i < c.bucket[k + 1]; ++i) run_item(c, c.items[c.order[i]], scratch);
    std::free(scratch);
  }

  // Merge the key chunks of each (tile, kv head), normalize, rotate back, store.
  static void merge_range(void* vctx, int64_t b, int64_t e) {
    const Ctx& c = *static_cast<const Ctx*>(vctx);
    const AttnArgs& a = *c.a;
    const int D = a.f.D, G = a.Hq / a.Hkv;
    float acc[pa::kMaxHeadDim];
    for (int64_t th = b; th < e; ++th) {
      const int64_t tile = th / a.Hkv;
      const int kh = static_cast<int>(th % a.Hkv);
      const int64_t t0 = c.tiles[tile], nq = c.tiles[tile + 1] - t0;
      const int64_t i0 = c.item_lo[th], i1 = c.item_hi[th];
      // kh's first row within each item's partials (an item of a head
      // group holds its heads' rows one head after another)
      const size_t r0 = static_cast<size_t>(kh - c.items[i0].kh) * nq * G;
      for (int j = 0; j < nq; ++j)
        for (int g = 0; g < G; ++g) {
          const size_t r = r0 + j * G + g;
          float M = -INFINITY;
          for (int64_t i = i0; i < i1; ++i) {
            const float m = c.parts[c.items[i].part + r * (D + 2) + D];
            M = m > M ? m : M;
          }
          float L = 0.f;
          for (int d = 0; d < D; ++d) acc[d] = 0.f;
          if (M != -INFINITY) {
            for (int64_t i = i0; i < i1; ++i) {
              const float* pr = c.parts + c.items[i].part + r * (D + 2);
              if (pr[D] == -INFINITY) continue;
              const float w = std::exp(pr[D] - M);
              L += w * pr[D + 1];
              for (int d = 0; d < D; ++d) acc[d] += w * pr[d];
            }
          }
          const float inv = L > 0.f ? 1.f / L : 0.f;
          for (int d = 0; d < D; ++d) acc[d] *= inv;
          if (a.f.vturbo) inverse_rotation(acc, D, a.signs);
          const int h = kh * G + g;
          store_row(a.out, a.q_dtype, ((t0 + j) * a.Hq + h) * D, acc, D);
        }
    }
  }

  // decode_heads(a, rows): how many kv heads `fast` takes in one decode item
  // of `rows` query rows (null: one).
  static void attention(const AttnArgs& a, ItemFn fast = nullptr, DecodeHeadsFn decode_heads = nullptr) {
    if (a.f.D % W != 0) {  // the inner loops step W floats at a time
      Kernels<4>::attention(a, fast, decode_heads);
      return;
    }
    const int G = a.Hq / a.Hkv, D = a.f.D, bs = a.bs;
    int64_t* tiles = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * (a.T + 1)));
    int64_t nt = 0;
    for (int64_t t = 0; t < a.T; ++t)
      if (t == 0 || a.seq_idx[t] != a.seq_idx[t - 1] || t - tiles[nt - 1] >= pa::kTile) tiles[nt++] = t;
    tiles[nt] = a.T;
    // key blocks per tile [fblk, nblk) (fblk: the block of the tile's earliest
    // window start) and the chunk size: enough items for every thread
    int64_t total_blocks = 0;
    int32_t* nblk = static_cast<int32_t*>(std::malloc(sizeof(int32_t) * 2 * (nt + 1)));
    int32_t* fblk = nblk + nt + 1;
    for (int64_t i = 0; i < nt; ++i) {
      int64_t last = 0, lo_min = INT64_MAX;
      for (int64_t t = tiles[i]; t < tiles[i + 1]; ++t) {
        int64_t p = a.pos[t];
        const int64_t lo = pa::key_lo(a.window, p);
        lo_min = lo < lo_min ? lo : lo_min;
        if (p > a.B * bs - 1) p = a.B * bs - 1;
        last = p + 1 > last ? p + 1 : last;
      }
      nblk[i] = static_cast<int32_t>((last + bs - 1) / bs);
      fblk[i] = static_cast<int32_t>(lo_min / bs < nblk[i] ? lo_min / bs : nblk[i]);
      total_blocks += nblk[i] - fblk[i];
    }
    const int threads = num_threads_hint();
    int64_t chunk = (total_blocks * a.Hkv + 8 * threads - 1) / (8 * threads);  // in blocks
    const int64_t min_chunk = (256 + bs - 1) / bs;
    const int64_t max_chunk = (kMaxChunkKeys + bs - 1) / bs;
    if (chunk > max_chunk) chunk = max_chunk;
    if (chunk < min_chunk) chunk = min_chunk;
    // Items: per tile, its kv heads in groups (one head for a prefill tile;
    // decode_heads(a, rows) for a decode tile, fewer where the call would
    // have fewer items than threads), each group's chunks in key order.
    int64_t* nchunk = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * (nt + 1)));
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t nb = nblk[i] - fblk[i];
      nchunk[i] = nb > 0 ? (nb + chunk - 1) / chunk : 1;
    }
    auto rows_of = [&](int64_t i) { return static_cast<int>(tiles[i + 1] - tiles[i]) * G; };
    auto step_of = [&](int64_t i, int cap) {
      const int hs = rows_of(i) < 16 && decode_heads ? decode_heads(a, rows_of(i)) : 1;
      return hs < cap ? (hs < 1 ? 1 : hs) : cap;
    };
    int cap = a.Hkv;
    auto count_items = [&](int cp) {
      int64_t n = 0;
      for (int64_t i = 0; i < nt; ++i) {
        const int st = step_of(i, cp);
        n += (a.Hkv + st - 1) / st * nchunk[i];
      }
      return n;
    };
    while (cap > 1 && count_items(cap) < threads) --cap;
    const int64_t n_items = count_items(cap);
    Item* items = static_cast<Item*>(std::malloc(sizeof(Item) * n_items));
    int64_t* item_lo = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * 2 * (nt * a.Hkv + 1)));
    int64_t* item_hi = item_lo + nt * a.Hkv + 1;
    int64_t* group_first = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * (nt * a.Hkv + 1)));
    int64_t k = 0, off = 0;
    for (int64_t i = 0; i < nt; ++i) {
      const int st = step_of(i, cap);
      const int64_t nb = nblk[i] - fblk[i];
      for (int kh0 = 0; kh0 < a.Hkv; kh0 += st) {
        const int kh1 = kh0 + st < a.Hkv ? kh0 + st : a.Hkv;
        group_first[i * a.Hkv + kh0 / st] = k;
        for (int kh = kh0; kh < kh1; ++kh) {
          item_lo[i * a.Hkv + kh] = k;
          item_hi[i * a.Hkv + kh] = k + nchunk[i];
        }
        for (int64_t ci = 0; ci < nchunk[i]; ++ci) {
          Item& it = items[k++];
          it.tile = i;
          it.kh = kh0;
          it.kh1 = kh1;
          it.b0 = static_cast<int32_t>(fblk[i] + ci * chunk);
          it.b1 = static_cast<int32_t>((ci + 1) * chunk < nb ? fblk[i] + (ci + 1) * chunk : nblk[i]);
          it.part = off;
          off += static_cast<int64_t>(rows_of(i)) * (kh1 - kh0) * (D + 2);
        }
      }
    }
    // Buckets: one contiguous run of `order` per thread (parallel_for hands
    // out contiguous ranges), cut where the running cost passes each
    // thread's share. `order` visits a tile's chunks in key order with the
    // kv heads of one chunk together: the heads' packed rows share cache
    // lines (a slot holds all heads' rows), so the thread that reads one
    // head's keys finds the next head's in its cache instead of a second
    // thread fetching the same lines again.
    const int nbk = threads;
    int64_t* order = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * (n_items + 1)));
    int64_t* bucket = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * (nbk + 1)));
    auto cost = [&](int64_t i) {
      const Item& it = items[i];
      return (it.b1 - it.b0 + 1.0) * (tiles[it.tile + 1] - tiles[it.tile] + 2.0) * (it.kh1 - it.kh);
    };
    double total = 0;
    k = 0;
    for (int64_t i = 0; i < nt; ++i) {
      const int st = step_of(i, cap), ng = (a.Hkv + st - 1) / st;
      for (int64_t ci = 0; ci < nchunk[i]; ++ci)
        for (int gi = 0; gi < ng; ++gi) {
          order[k] = group_first[i * a.Hkv + gi] + ci;
          total += cost(order[k++]);
        }
    }
    int t = 0;
    double run = 0;
    bucket[0] = 0;
    for (int64_t i = 0; i < n_items; ++i) {
      run += cost(order[i]);
      while (t + 1 < nbk && run >= total * (t + 1) / nbk) bucket[++t] = i + 1;
    }
    while (t + 1 <= nbk) bucket[++t] = n_items;
    float* parts = static_cast<float*>(std::malloc(sizeof(float) * (off > 0 ? off : 1)));
    Ctx c{&a, tiles, items, order, bucket, parts, item_lo, item_hi, fast};
    parallel_for(nbk, 1, &Kernels::run_bucket, &c);
    parallel_for(nt * a.Hkv, 4, &Kernels::merge_range, &c);
    std::free(parts);
    std::free(bucket);
    std::free(order);
    std::free(group_first);
    std::free(item_lo);
    std::free(nchunk);
    std::free(items);
    std::free(nblk);
    std::free(tiles);
  }

  static int num_threads_hint();
};

}  // namespace

int threads_for_kernels();  // defined in ops/kv_quant.cpp

namespace {
template <int W>
int Kernels<W>::num_threads_hint() {
  return threads_for_kernels();
}
}  // namespace

}  // namespace kvq
}  // namespace mlxfast
