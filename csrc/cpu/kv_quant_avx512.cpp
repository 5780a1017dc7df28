// Quantized-KV kernels compiled for the avx512 path (see kv_quant.h).
//
// Decode items (fewer than 16 query rows: a token's query heads sharing a kv
// head) at head dims 64/128/256, on CPUs with AVX-512 VNNI, take the dense
// decode tile's shape (paged_attention_avx512.cpp) instead of the generic
// kernel's per-block pass: the scores of 16 keys at a time from int8 dot
// products of the rounded query with the key codes (one vector per 16 keys),
// online softmax once per span of kSpan keys (vectorised exp), and P.V with
// the rows' accumulators in registers, each V chunk decoded from its codes in
// registers (scale * code + bias, or TurboQuant's w * c[code] in the rotated
// domain) right before its FMAs. The generic kernel decoded K and V into
// float tiles and ran scalar max/exp/sum and a rescale per 16-key block:
// about 3x the dense f16 kernel's time at 8,000 keys for half its bytes.
// Prefill items take the AVX2 prefill tile (prefill_item_avx2).
#include "cpu/kv_quant.h"

#include "common/cpu_features.h"
#include "common/scratch.h"
#include "cpu/decode_span_avx512.h"

namespace mlxfast {
namespace kvq {

namespace {

thread_local Scratch tl_decode;

constexpr int kSpan = 256;  // keys per online-softmax step

// An fp16 scalar broadcast to 16 lanes (one load-broadcast and a convert).
inline __m512 f16x16(const uint8_t* p) {
  int16_t h;
  std::memcpy(&h, p, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(h));
}

// Codes 16j .. 16j+15 of a packed row (LSB-first bit stream) as int32 lanes.
template <int BITS>
inline __m512i codes16(const uint8_t* p, int j) {
  if constexpr (BITS == 8) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * j)));
  } else if constexpr (BITS == 4) {  // byte i holds codes 2i (low nibble) and 2i + 1
    const __m128i w = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j));
    const __m128i lo = _mm_set1_epi8(15);
    return _mm512_cvtepu8_epi32(
        _mm_unpacklo_epi8(_mm_and_si128(w, lo), _mm_and_si128(_mm_srli_epi16(w, 4), lo)));
  } else {
    return _mm512_inserti64x4(_mm512_castsi256_si512(codes8(p, BITS, 2 * j)),
                              codes8(p, BITS, 2 * j + 1), 1);
  }
}

// The D values of an affine part (codes, then fp16 scales, then biases, one
// per group of 2^gshift chunks of 16) as NV vectors.
template <int D, int BITS>
inline void affine_row(const uint8_t* part, int gshift, __m512* out) {
  constexpr int NV = D / 16;
  const uint8_t* sp = part + D * BITS / 8;
  const int ng = NV >> gshift;
  __m512 sc = _mm512_setzero_ps(), bi = sc;
  for (int j = 0; j < NV; ++j) {
    if ((j & ((1 << gshift) - 1)) == 0) {
      sc = f16x16(sp + 2 * (j >> gshift));
      bi = f16x16(sp + 2 * ng + 2 * (j >> gshift));
    }
    out[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes16<BITS>(part, j)), sc, bi);
  }
}

// Chunks c0/16 .. c0/16 + NV - 1 of a value part; TurboQuant: w * tab[code]
// (the rotated domain).
template <int D, int VB, bool VT, int NV>
inline void value_chunks(const uint8_t* vp, int vcode, int gshift, int c0, __m512 tab, __m512* vv) {
  if constexpr (VT) {
    float w;
    std::memcpy(&w, vp + vcode, 4);
    const __m512 wv = _mm512_set1_ps(w);
    for (int v = 0; v < NV; ++v)
      vv[v] = _mm512_mul_ps(_mm512_permutexvar_ps(codes16<VB>(vp, c0 / 16 + v), tab), wv);
  } else if constexpr (NV == D / 16) {
    affine_row<D, VB>(vp, gshift, vv);
  } else {
    const uint8_t* sp = vp + D * VB / 8;
    const int ng = (D / 16) >> gshift;
    for (int v = 0; v < NV; ++v) {
      const int j = c0 / 16 + v, g = j >> gshift;
      vv[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes16<VB>(vp, j)), f16x16(sp + 2 * g),
                              f16x16(sp + 2 * ng + 2 * g));
    }
  }
}

// ---- keys' scores from int8 dot products (VNNI) -----------------------------
// The query row is rounded to 8 bits per key group (kv_quant.h's
// round_query: q^ = d_g * xq), so q^ . k^ = sum over groups of
// d_g * (scale_g * sum(xq * code) + bias_g * sum(xq)),
// the sums exact in int32: one vpdpbusd per 64 codes per key and row instead
// of decoding K to floats and 4 FMAs per 64 values. The same numbers as the
// float path up to float rounding order.

// 16 keys' codes as bytes (8-bit rows as stored; 4-bit rows unpacked into
// `tile`) and their groups' scales and biases as floats, s16/b16 [ng][16]
// (keys past nv: a zero row, scale and bias 0).
template <int D, int KB, int G>
inline void key_block16(const uint8_t* kp0, int64_t rowb, int nv, const uint8_t** cp,
                        uint8_t* tile, float* s16, float* b16) {
  constexpr int ng = D / G;
  alignas(64) static const uint8_t zero_row[D] = {};
  for (int k = 0; k < 16; ++k) {
    const uint8_t* kp = kp0 + k * rowb;
    if (k >= nv) {
      cp[k] = zero_row;
      for (int g = 0; g < ng; ++g) s16[16 * g + k] = b16[16 * g + k] = 0.f;
      continue;
    }
    const uint8_t* sp = kp + D * KB / 8;
    for (int g = 0; g < ng; ++g) {
      uint16_t h;
      std::memcpy(&h, sp + 2 * g, 2);
      s16[16 * g + k] = _cvtsh_ss(h);
      std::memcpy(&h, sp + 2 * ng + 2 * g, 2);
      b16[16 * g + k] = _cvtsh_ss(h);
    }
    if constexpr (KB == 8) {
      cp[k] = kp;
    } else {  // byte i holds codes 2i (low nibble) and 2i + 1: one code per byte
      uint8_t* t = tile + k * D;
      for (int c = 0; c < D / 64; ++c) {
        const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + 32 * c)));
        const __m512i y = _mm512_or_si512(_mm512_and_si512(x, _mm512_set1_epi16(0x0F)),
                                          _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0xF0)), 4));
        _mm512_store_si512(t + 64 * c, y);
      }
      cp[k] = t;
    }
  }
}

// One row's scores of the 16 keys: xq its codes [D / 64] vectors, J [D / G]
// the sums of xq per group, d [D / G] its groups' scales. Groups of G codes (G < 64 splits a
// 64-code chunk by lane masks).
template <int D, int G>
inline __m512 int_scores16(const uint8_t* const* cp, const __m512i* xq, const float* s16,
                           const float* b16, const float* J, const float* d) {
  __m512 score = _mm512_setzero_ps();
  for (int u = 0; u < D / G; ++u) {
    __m512 part[16];
    if constexpr (G >= 64) {
      for (int k = 0; k < 16; ++k) {
        __m512i acc = _mm512_setzero_si512();
        for (int c = u * (G / 64); c < (u + 1) * (G / 64); ++c)
          acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(cp[k] + 64 * c), xq[c]);
        part[k] = _mm512_cvtepi32_ps(acc);
      }
    } else {
      constexpr int upc = 64 / G;
      const __mmask16 lanes = static_cast<__mmask16>(((1u << (G / 4)) - 1u) << ((u % upc) * (G / 4)));
      for (int k = 0; k < 16; ++k)
        part[k] = _mm512_cvtepi32_ps(_mm512_maskz_dpbusd_epi32(
            lanes, _mm512_setzero_si512(), _mm512_loadu_si512(cp[k] + 64 * (u / upc)), xq[u / upc]));
    }
    const __m512 g = _mm512_fmadd_ps(_mm512_loadu_ps(s16 + 16 * u), reduce16x16(part),
                                     _mm512_mul_ps(_mm512_loadu_ps(b16 + 16 * u), _mm512_set1_ps(J[u])));
    score = _mm512_fmadd_ps(g, _mm512_set1_ps(d[u]), score);
  }
  return score;
}

// A packed pool's value parts, decoded in registers; TurboQuant's in the
// rotated domain.
template <int D, int VB, bool VT>
struct PackedValues {
  const uint8_t* vbase;
  int64_t rowb;
  int vcode, gshift;
  __m512 tab;
  template <int NV>
  void get(int64_t slot, int c0, __m512* vv) const {
    value_chunks<D, VB, VT, NV>(vbase + slot * rowb, vcode, gshift, c0, tab, vv);
  }
};

template <int D, int KB, int VB, bool VT, int GR>
void decode_item(const AttnArgs& a, int64_t t0, int64_t t1, int kh, int b0, int b1, float* part) {
  const Fmt& f = a.f;
  const int G = a.Hq / a.Hkv, bs = a.bs;
  const int nq = static_cast<int>(t1 - t0), R = nq * G;  // R < 16
  const int span_blocks = bs >= kSpan ? 1 : kSpan / bs;
  const int64_t spanp = (static_cast<int64_t>(span_blocks) * bs + 31) / 16 * 16;  // + 16 slack
  // scratch: S [R][spanp], acc [R][D], m, l, alpha [16], segs
  float* S = tl_decode.get(static_cast<size_t>(R * D + R * spanp + 48) +
                           sizeof(SpanSeg) * span_blocks / sizeof(float) + 16);
  float* acc = S + R * spanp;
  float* m = acc + R * D;
  float* l = m + 16;
  float* alpha = l + 16;
  SpanSeg* segs = reinterpret_cast<SpanSeg*>(alpha + 16);
  const int gshift = __builtin_ctz(f.group / 16);
  float cbp[16] = {0};
  if (VT) std::memcpy(cbp, a.codebook, sizeof(float) * (1 << f.vbits));
  const __m512 tab = _mm512_loadu_ps(cbp);
  int64_t qpos[16], qlo[16];
  const size_t qes = pa::elem_size(a.q_dtype);
  int64_t n_keys = 0;
  for (int j = 0; j < nq; ++j) {
    int64_t p = a.pos[t0 + j];
    qlo[j] = pa::key_lo(a.window, p);
    if (p > a.B * bs - 1) p = a.B * bs - 1;
    qpos[j] = p;
    n_keys = p + 1 > n_keys ? p + 1 : n_keys;
  }
  float qbuf[pa::kMaxHeadDim], qd[D];
  constexpr int ng = D / GR;
  alignas(64) int8_t xq8[16 * D];
  alignas(64) uint8_t ktile[KB == 8 ? 64 : 16 * D];
  float qscale[16 * 16], J[16 * 16], s16[16 * 16], b16[16 * 16];
  const uint8_t* cp[16];
  for (int r = 0; r < R; ++r) {
    const int j = r / G, h = kh * G + r % G;
    const float* qr = pa::load_row(static_cast<const char*>(a.q) + ((t0 + j) * a.Hq + h) * D * qes,
                                   a.q_dtype, D, qbuf);
    for (int i = 0; i < D; ++i) qd[i] = qr[i] * a.scale;
    round_query(qd, D, GR, xq8 + r * D, qscale + r * 16);
    for (int u = 0; u < ng; ++u) {
      int sum = 0;
      for (int i = u * GR; i < (u + 1) * GR; ++i) sum += xq8[r * D + i];
      J[r * 16 + u] = static_cast<float>(sum);
    }
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  std::memset(acc, 0, sizeof(float) * R * D);
  const int32_t s = a.seq_idx[t0];
  if (s >= 0 && s < a.S && n_keys > 0) {
    const int32_t* table = a.tables + static_cast<int64_t>(s) * a.B;
    const int64_t rowb = static_cast<int64_t>(a.Hkv) * f.row;  // bytes between slots
    const uint8_t* kbase = a.packed + static_cast<int64_t>(kh) * f.row;
    const uint8_t* vbase = kbase + f.kbytes;
    const int64_t nblk = (n_keys + bs - 1) / bs;
    const int64_t be = b1 < nblk ? b1 : nblk;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t s0 = b0; s0 < be; s0 += span_blocks) {
      const int64_t s1 = s0 + span_blocks < be ? s0 + span_blocks : be;
      int nseg = 0, n = 0;  // n: scores in the span so far
      for (int64_t b = s0; b < s1; ++b) {
        const int64_t blk = table[b];
        if (blk < 0 || (blk + 1) * bs > a.num_slots) continue;
        // The next block's slots whole, every head's rows: they are
        // contiguous, and the items of the chunk's other heads (next on this
        // thread) then read them from cache (see Kernels::attention).
        if (b + 1 < be) {
          const int64_t nxt = table[b + 1];
          if (nxt >= 0 && (nxt + 1) * bs <= a.num_slots)
            pa::prefetch_rows(reinterpret_cast<const char*>(a.packed), nxt * bs * rowb, 1, rowb,
                              static_cast<int>(bs * rowb));
        }
        const int64_t key0 = b * bs;
        const int nk = static_cast<int>(n_keys - key0 < bs ? n_keys - key0 : bs);
        segs[nseg++] = SpanSeg{blk * bs, nk, n};
        for (int i0 = 0; i0 < nk; i0 += 16) {
          const int nv = nk - i0 < 16 ? nk - i0 : 16;
          const uint8_t* kp0 = kbase + (blk * bs + i0) * rowb;
          key_block16<D, KB, GR>(kp0, rowb, nv, cp, ktile, s16, b16);
          const __m512i kidx = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(key0 + i0)));
          const __mmask16 in_block = static_cast<__mmask16>(nv >= 16 ? 0xffffu : (1u << nv) - 1u);
          for (int r = 0; r < R; ++r) {
            __m512i xq[D / 64];
            for (int c = 0; c < D / 64; ++c) xq[c] = _mm512_load_si512(xq8 + r * D + 64 * c);
            const __m512 s16k = int_scores16<D, GR>(cp, xq, s16, b16, J + r * 16, qscale + r * 16);
            __mmask16 ok = _mm512_mask_cmple_epi32_mask(in_block, kidx,
                                                        _mm512_set1_epi32(static_cast<int>(qpos[r / G])));
            ok = _mm512_mask_cmpge_epi32_mask(ok, kidx, _mm512_set1_epi32(static_cast<int>(qlo[r / G])));
            // Lanes past the block's keys are overwritten by the next block's.
            _mm512_storeu_ps(S + r * spanp + n + i0, _mm512_mask_mov_ps(ninf, ok, s16k));
          }
        }
        n += nk;
      }
      if (n == 0) continue;
      span_softmax(S, spanp, R, n, m, l, alpha);
      pv_rows<D>(PackedValues<D, VB, VT>{vbase, rowb, f.vcode, gshift, tab}, segs, nseg, S, 1, spanp, R,
                 alpha, acc);
    }
  }
  store_partials(part, R, D, acc, m, l);
}

template <int D, int KB, int VB, bool VT, int GR>
struct DecodeKernel {
  static void run(const AttnArgs& a, int64_t t0, int64_t t1, int kh, int b0, int b1, float* part) {
    decode_item<D, KB, VB, VT, GR>(a, t0, t1, kh, b0, b1, part);
  }
};

// Prefill items (16 rows or more): the AVX2 prefill tile (prefill_item_avx2);
// decode items: this file's, where VNNI scores the keys.
bool take_item(const AttnArgs& a, int64_t t0, int64_t t1, int kh, int b0, int b1, float* part) {
  if ((t1 - t0) * (a.Hq / a.Hkv) >= 16) return prefill_item_avx2(a, t0, t1, kh, b0, b1, part);
  static const bool vnni = cpu_has_avx512_vnni();
  if (!vnni) return false;
  return fast_item<DecodeKernel>(a, t0, t1, kh, b0, b1, part);
}

}  // namespace

void encode_avx512(const EncodeArgs& a) { Kernels<16>::encode(a); }
void dequant_avx512(const DequantArgs& a) { Kernels<16>::dequant(a); }
void attention_avx512(const AttnArgs& a) { Kernels<16>::attention(a, &take_item); }

}  // namespace kvq
}  // namespace mlxfast
