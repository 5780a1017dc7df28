// Quantized-KV kernels compiled for the avx512 path (see kv_quant.h).
//
// Decode items (fewer than 16 query rows: a token's query heads sharing a kv
// head) at head dims 64/128/256 take the dense decode tile's shape
// (paged_attention_avx512.cpp) instead of the generic kernel's per-block
// pass: K rows decoded 16 keys at a time into an L1 tile and scored 16 keys
// per vector, online softmax once per span of kSpan keys (vectorised exp),
// and P.V with the rows' accumulators in registers, each V chunk decoded
// from its codes in registers (codes -> scale * code + bias, or TurboQuant's
// w * c[code] in the rotated domain) right before its FMAs. The generic
// kernel decoded K and V into tiles and ran scalar max/exp/sum and a
// rescale per 16-key block: about 3x the dense f16 kernel's time at 8,000
// keys for half its bytes.
#include "cpu/kv_quant.h"

#include "common/scratch.h"
#include "cpu/vec_exp.h"

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

struct Seg {  // one block's keys inside a span
  int64_t slot0;
  int nk, off;
};

// acc rows r0 .. r0+RG-1, columns c0 .. c0+DC-1 ([R][D] in memory) =
// alpha * acc + sum over the span's keys of P[row][key] * V[key], V decoded
// per chunk in registers. TurboQuant: V is w * tab[code] (rotated domain).
template <int D, int VB, bool VT, int DC, int RG>
void pv_span(const AttnArgs& a, const uint8_t* vbase, int64_t rowb, const Seg* segs, int nseg,
             const float* S, int64_t sr, int r0, int rg, int c0, const float* alpha, float* acc,
             const __m512 tab, int gshift) {
  if constexpr (RG > 1) {
    if (rg < RG)
      return pv_span<D, VB, VT, DC, RG - 1>(a, vbase, rowb, segs, nseg, S, sr, r0, rg, c0, alpha, acc,
                                            tab, gshift);
  }
  constexpr int NV = DC / 16;
  const Fmt& f = a.f;
  __m512 o[RG][NV];
  for (int r = 0; r < RG; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r0 + r]);
    for (int v = 0; v < NV; ++v) o[r][v] = _mm512_mul_ps(al, _mm512_load_ps(acc + (r0 + r) * D + c0 + v * 16));
  }
  for (int sg = 0; sg < nseg; ++sg) {
    const Seg& seg = segs[sg];
    for (int i = 0; i < seg.nk; ++i) {
      const uint8_t* vp = vbase + (seg.slot0 + i) * rowb;
      __m512 vv[NV];
      value_chunks<D, VB, VT, NV>(vp, f.vcode, gshift, c0, tab, vv);
      for (int r = 0; r < RG; ++r) {
        const __m512 p = _mm512_set1_ps(S[(r0 + r) * sr + seg.off + i]);
        for (int v = 0; v < NV; ++v) o[r][v] = _mm512_fmadd_ps(p, vv[v], o[r][v]);
      }
    }
  }
  for (int r = 0; r < RG; ++r)
    for (int v = 0; v < NV; ++v) _mm512_store_ps(acc + (r0 + r) * D + c0 + v * 16, o[r][v]);
}

// Register blocking (RG * DC / 16 + DC / 16 <= 28 of the 32 vector registers).
template <int D> struct PvCfg;
template <> struct PvCfg<64> { static constexpr int DC = 64, RG = 6; };
template <> struct PvCfg<128> { static constexpr int DC = 128, RG = 3; };
template <> struct PvCfg<256> { static constexpr int DC = 64, RG = 6; };

template <int D, int KB, int VB, bool VT>
void decode_item(const AttnArgs& a, int64_t t0, int64_t t1, int kh, int b0, int b1, float* part) {
  constexpr int NV = D / 16;
  const Fmt& f = a.f;
  const int G = a.Hq / a.Hkv, bs = a.bs;
  const int nq = static_cast<int>(t1 - t0), R = nq * G;  // R < 16
  const int span_blocks = bs >= kSpan ? 1 : kSpan / bs;
  const int64_t spanp = (static_cast<int64_t>(span_blocks) * bs + 31) / 16 * 16;  // + 16 slack
  // scratch: q [R][D], S [R][spanp], acc [R][D], m, l, alpha [16], kb [16][D], segs
  float* qf = tl_decode.get(static_cast<size_t>(2 * R * D + R * spanp + 48 + 16 * D) +
                            sizeof(Seg) * span_blocks / sizeof(float) + 16);
  float* S = qf + R * D;
  float* acc = S + R * spanp;
  float* m = acc + R * D;
  float* l = m + 16;
  float* alpha = l + 16;
  float* kb = alpha + 16;
  Seg* segs = reinterpret_cast<Seg*>(kb + 16 * D);
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
  float qbuf[pa::kMaxHeadDim];
  for (int r = 0; r < R; ++r) {
    const int j = r / G, h = kh * G + r % G;
    const float* qr = pa::load_row(static_cast<const char*>(a.q) + ((t0 + j) * a.Hq + h) * D * qes,
                                   a.q_dtype, D, qbuf);
    for (int v = 0; v < NV; ++v)
      _mm512_store_ps(qf + r * D + v * 16, _mm512_mul_ps(_mm512_loadu_ps(qr + v * 16), _mm512_set1_ps(a.scale)));
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
        if (b + 1 < be) {
          const int64_t nxt = table[b + 1];
          if (nxt >= 0 && (nxt + 1) * bs <= a.num_slots)
            pa::prefetch_rows(reinterpret_cast<const char*>(kbase), nxt * bs * rowb, bs, rowb, f.row);
        }
        const int64_t key0 = b * bs;
        const int nk = static_cast<int>(n_keys - key0 < bs ? n_keys - key0 : bs);
        segs[nseg++] = Seg{blk * bs, nk, n};
        for (int i0 = 0; i0 < nk; i0 += 16) {
          const int nv = nk - i0 < 16 ? nk - i0 : 16;
          for (int k = 0; k < 16; ++k) {
            __m512 kv[NV];
            if (k < nv) {
              affine_row<D, KB>(kbase + (blk * bs + i0 + k) * rowb, gshift, kv);
            } else {
              for (int v = 0; v < NV; ++v) kv[v] = _mm512_setzero_ps();
            }
            for (int v = 0; v < NV; ++v) _mm512_store_ps(kb + k * D + v * 16, kv[v]);
          }
          const __m512i kidx = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(key0 + i0)));
          const __mmask16 in_block = static_cast<__mmask16>(nv >= 16 ? 0xffffu : (1u << nv) - 1u);
          for (int r = 0; r < R; ++r) {
            __m512 sc[16];
            for (int k = 0; k < 16; ++k) {
              __m512 p = _mm512_mul_ps(_mm512_load_ps(qf + r * D), _mm512_load_ps(kb + k * D));
              for (int v = 1; v < NV; ++v)
                p = _mm512_fmadd_ps(_mm512_load_ps(qf + r * D + v * 16), _mm512_load_ps(kb + k * D + v * 16), p);
              sc[k] = p;
            }
            __mmask16 ok = _mm512_mask_cmple_epi32_mask(in_block, kidx,
                                                        _mm512_set1_epi32(static_cast<int>(qpos[r / G])));
            ok = _mm512_mask_cmpge_epi32_mask(ok, kidx, _mm512_set1_epi32(static_cast<int>(qlo[r / G])));
            // Lanes past the block's keys are overwritten by the next block's.
            _mm512_storeu_ps(S + r * spanp + n + i0, _mm512_mask_mov_ps(ninf, ok, reduce16x16(sc)));
          }
        }
        n += nk;
      }
      if (n == 0) continue;
      const __mmask16 tail = static_cast<__mmask16>((n & 15) ? (1u << (n & 15)) - 1u : 0xffffu);
      for (int r = 0; r < R; ++r) {
        float* sr = S + r * spanp;
        __m512 mv = ninf;
        for (int i0 = 0; i0 < n; i0 += 16)
          mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(ninf, n - i0 >= 16 ? 0xffff : tail, sr + i0));
        const float mb = _mm512_reduce_max_ps(mv);
        const float mn = m[r] > mb ? m[r] : mb;
        const float mu = mn == -INFINITY ? 0.f : mn;
        alpha[r] = m[r] == -INFINITY ? 0.f : std::exp(m[r] - mu);
        __m512 sum = _mm512_setzero_ps();
        for (int i0 = 0; i0 < n; i0 += 16) {
          const __mmask16 mk = n - i0 >= 16 ? 0xffff : tail;
          const __m512 x = _mm512_mask_loadu_ps(ninf, mk, sr + i0);
          const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ),
                                               exp16(_mm512_sub_ps(x, _mm512_set1_ps(mu))));
          _mm512_mask_storeu_ps(sr + i0, mk, e);
          sum = _mm512_add_ps(sum, e);
        }
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
        m[r] = mn;
      }
      constexpr int DC = PvCfg<D>::DC, RG = PvCfg<D>::RG;
      for (int r0 = 0; r0 < R; r0 += RG)
        for (int c0 = 0; c0 < D; c0 += DC)
          pv_span<D, VB, VT, DC, RG>(a, vbase, rowb, segs, nseg, S, spanp, r0,
                                     R - r0 < RG ? R - r0 : RG, c0, alpha, acc, tab, gshift);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* pr = part + static_cast<size_t>(r) * (D + 2);
    std::memcpy(pr, acc + r * D, sizeof(float) * D);
    pr[D] = m[r];
    pr[D + 1] = l[r];
  }
}

template <int D>
bool decode_d(const AttnArgs& a, int64_t t0, int64_t t1, int kh, int b0, int b1, float* part) {
  const Fmt& f = a.f;
  using Fn = void (*)(const AttnArgs&, int64_t, int64_t, int, int, int, float*);
  Fn fn = nullptr;
  if (!f.vturbo) {  // the affine schemes: K and V of one width
    if (f.kbits == 8 && f.vbits == 8) fn = &decode_item<D, 8, 8, false>;
    if (f.kbits == 4 && f.vbits == 4) fn = &decode_item<D, 4, 4, false>;
  } else if (f.kbits == 8 || f.kbits == 4) {
    const bool k8 = f.kbits == 8;
    switch (f.vbits) {
      case 2: fn = k8 ? &decode_item<D, 8, 2, true> : &decode_item<D, 4, 2, true>; break;
      case 3: fn = k8 ? &decode_item<D, 8, 3, true> : &decode_item<D, 4, 3, true>; break;
      case 4: fn = k8 ? &decode_item<D, 8, 4, true> : &decode_item<D, 4, 4, true>; break;
      default: break;
    }
  }
  if (fn == nullptr) return false;
  fn(a, t0, t1, kh, b0, b1, part);
  return true;
}

bool fast_decode(const AttnArgs& a, int64_t t0, int64_t t1, int kh, int b0, int b1, float* part) {
  const Fmt& f = a.f;
  // group: a power of two of whole 16-value chunks within the row
  if ((t1 - t0) * (a.Hq / a.Hkv) >= 16 || f.group < 16 || f.group > f.D || (f.group & (f.group - 1)))
    return false;
  switch (f.D) {
    case 64: return decode_d<64>(a, t0, t1, kh, b0, b1, part);
    case 128: return decode_d<128>(a, t0, t1, kh, b0, b1, part);
    case 256: return decode_d<256>(a, t0, t1, kh, b0, b1, part);
    default: return false;
  }
}

}  // namespace

void encode_avx512(const EncodeArgs& a) { Kernels<16>::encode(a); }
void dequant_avx512(const DequantArgs& a) { Kernels<16>::dequant(a); }
void attention_avx512(const AttnArgs& a) { Kernels<16>::attention(a, &fast_decode); }

}  // namespace kvq
}  // namespace mlxfast
