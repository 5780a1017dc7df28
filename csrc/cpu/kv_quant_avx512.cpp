// Quantized-KV kernels compiled for the avx512 path (see kv_quant.h).
//
// Decode items (fewer than 16 query rows per kv head) at head dims
// 64/128/256, on CPUs with AVX-512 VNNI, hold all of a token's kv heads (up
// to kMaxRows rows) and take the dense decode tile's shape
// (paged_attention_avx512.cpp) instead of the generic kernel's per-block
// pass: every 16 keys, the slots' lines are read in address order, each
// head's key codes are transposed into dword columns and scored by int8 dot
// products against its rounded query rows (VNNI, no horizontal sums);
// online softmax runs once per span of kSpan keys (vectorised exp), and P.V
// keeps the rows' accumulators in registers over the values' codes, with
// affine values' scales and biases moved onto the probabilities
// (TurboQuant's w * c[code] stays in the rotated domain). The generic
// kernel decoded K and V into float tiles and ran scalar max/exp/sum and a
// rescale per 16-key block: about 3x the dense f16 kernel's time at 8,000
// keys for half its bytes. Prefill items take the AVX2 prefill tile
// (prefill_item_avx2).
#include "cpu/kv_quant.h"

#include "common/cpu_features.h"
#include "common/scratch.h"
#include "cpu/decode_span_avx512.h"
#include "cpu/transpose_avx512.h"

namespace mlxfast {
namespace kvq {

namespace {

thread_local Scratch tl_decode;

constexpr int kSpan = 256;  // keys per online-softmax step

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

// Chunks c0/16 .. c0/16 + NV - 1 of a TurboQuant value part: w * tab[code]
// (the rotated domain).
template <int VB, int NV>
inline void turbo_chunks(const uint8_t* vp, int vcode, int c0, __m512 tab, __m512* vv) {
  float w;
  std::memcpy(&w, vp + vcode, 4);
  const __m512 wv = _mm512_set1_ps(w);
  for (int v = 0; v < NV; ++v)
    vv[v] = _mm512_mul_ps(_mm512_permutexvar_ps(codes16<VB>(vp, c0 / 16 + v), tab), wv);
}

// ---- keys' scores from int8 dot products (VNNI) -----------------------------
// The query row is rounded to 8 bits per key group (kv_quant.h's
// round_query: q^ = d_g * xq), so q^ . k^ = sum over groups of
// d_g * (scale_g * sum(xq * code) + bias_g * sum(xq)),
// the sums exact in int32. The 16 keys' codes are transposed once into
// dword columns (lane k = 4 codes of key k), which every row of the item
// then scores with one vpdpbusd per 4 codes against its query's dword
// broadcast: the keys' sums land in their lanes, with no horizontal
// reduction per row (a 16x16 reduce per row and 16 keys was half the
// kernel's vector work at 3 rows per kv head). The same numbers as the
// float path up to float rounding order.

// 16 keys' codes as dword columns: T[d] lane k = codes 4d .. 4d + 3 of key k
// (one byte each: 4-bit rows unpacked), keys past nv zero.
template <int D, int KB>
inline void key_columns16(const uint8_t* kp0, int64_t rowb, int nv, __m512i* T) {
  for (int c = 0; c < D / 64; ++c) {
    __m512i v[16];
    for (int k = 0; k < 16; ++k) {
      const uint8_t* kp = kp0 + k * rowb;
      if (k >= nv) {
        v[k] = _mm512_setzero_si512();
      } else if constexpr (KB == 8) {
        v[k] = _mm512_loadu_si512(kp + 64 * c);
      } else {  // byte i holds codes 2i (low nibble) and 2i + 1
        const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + 32 * c)));
        v[k] = _mm512_or_si512(_mm512_and_si512(x, _mm512_set1_epi16(0x0F)),
                               _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0xF0)), 4));
      }
    }
    transpose16x16_epi32(v);
    for (int d = 0; d < 16; ++d) T[16 * c + d] = v[d];
  }
}

// The fp16 scales and biases of an affine part's NG groups for 16 slots
// (sp0: slot 0's scales, which follow its codes; offs: the slots' byte
// offsets; keys outside `valid` get 0), by gathers: bias g is read as the
// high half of the dword that ends it, so no read passes the part's end.
template <int NG>
inline void affine_params16(const uint8_t* sp0, __m512i offs, __mmask16 valid, __m512* sc, __m512* bi) {
  const __m512i z = _mm512_setzero_si512();
  for (int g = 0; g < NG; ++g) {
    const __m512i ws = _mm512_mask_i32gather_epi32(z, valid, offs, sp0 + 2 * g, 1);
    const __m512i wb = NG == 1 ? ws : _mm512_mask_i32gather_epi32(z, valid, offs, sp0 + 2 * NG + 2 * g - 2, 1);
    sc[g] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(ws));
    bi[g] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(wb, 16)));
  }
}

// One row's scores of the 16 keys (T: their code columns, sc/bi: their
// groups' scales and biases) against xq32 (its codes as dwords [D / 4]),
// J [D / GR] the sums of its codes per group, d [D / GR] its groups' scales.
template <int D, int GR>
inline __m512 column_scores16(const __m512i* T, const int32_t* xq32, const __m512* sc,
                              const __m512* bi, const float* J, const float* d) {
  constexpr int W = GR / 4;  // dwords per group, >= 8: four independent chains
  __m512 score = _mm512_setzero_ps();
  for (int g = 0; g < D / GR; ++g) {
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
    for (int w = 0; w < W; ++w)
      acc[w & 3] = _mm512_dpbusd_epi32(acc[w & 3], T[g * W + w], _mm512_set1_epi32(xq32[g * W + w]));
    const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(acc[0], acc[1]), _mm512_add_epi32(acc[2], acc[3]));
    const __m512 gs = _mm512_fmadd_ps(sc[g], _mm512_cvtepi32_ps(sum), _mm512_mul_ps(bi[g], _mm512_set1_ps(J[g])));
    score = _mm512_fmadd_ps(gs, _mm512_set1_ps(d[g]), score);
  }
  return score;
}

// One load per cache line of [p, p + n), in address order.
inline void touch_lines(const uint8_t* p, int64_t n) {
  uint32_t sink = 0;
  for (int64_t o = 0; o < n; o += 64) sink += p[o];
  asm volatile("" ::"r"(sink));
}

// TurboQuant value parts, decoded in registers (the rotated domain).
template <int VB>
struct TurboValues {
  const uint8_t* vbase;
  int64_t rowb;
  int vcode;
  __m512 tab;
  template <int NV>
  void get(int64_t slot, int c0, __m512* vv) const {
    turbo_chunks<VB, NV>(vbase + slot * rowb, vcode, c0, tab, vv);
  }
};

// Affine value parts as their codes (floats): the scale and bias go on the
// probabilities, sum_i p_i (s_i c_i + b_i) = sum_i (p_i s_i) c_i + sum_i p_i b_i
// (decode_item), so a value row costs a convert per code and no FMA.
template <int VB>
struct ValueCodes {
  const uint8_t* vbase;
  int64_t rowb;
  template <int NV>
  void get(int64_t slot, int c0, __m512* vv) const {
    const uint8_t* vp = vbase + slot * rowb;
    for (int v = 0; v < NV; ++v) vv[v] = _mm512_cvtepi32_ps(codes16<VB>(vp, c0 / 16 + v));
  }
};

// P.V of a span for affine values, group by group: P scaled by the keys'
// value scales (sv [NG][spanp]) into Pg, the codes' products accumulated
// by pv_span, then sum_i p_i b_i (bv) added to the group's columns.
template <int D, int VB, int GR>
void pv_affine(const ValueCodes<VB>& codes, const SpanSeg* segs, int nseg, const float* P,
               int64_t spanp, int R, int n, const float* sv, const float* bv, float* Pg,
               const float* alpha, float* acc) {
  constexpr int NG = D / GR, DC = GR < 64 ? GR : 64, RG = DC == 64 ? 6 : 12;
  const __mmask16 tail = static_cast<__mmask16>((n & 15) ? (1u << (n & 15)) - 1u : 0xffffu);
  for (int g = 0; g < NG; ++g) {
    float beta[16];
    for (int r = 0; r < R; ++r) {
      __m512 bsum = _mm512_setzero_ps();
      for (int i0 = 0; i0 < n; i0 += 16) {
        const __mmask16 mk = n - i0 >= 16 ? 0xffff : tail;
        const __m512 p = _mm512_maskz_loadu_ps(mk, P + r * spanp + i0);
        _mm512_storeu_ps(Pg + r * spanp + i0, _mm512_mul_ps(p, _mm512_maskz_loadu_ps(mk, sv + g * spanp + i0)));
        bsum = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(mk, bv + g * spanp + i0), bsum);
      }
      beta[r] = _mm512_reduce_add_ps(bsum);
    }
    for (int r0 = 0; r0 < R; r0 += RG) {
      const int rg = R - r0 < RG ? R - r0 : RG;
      for (int c0 = g * GR; c0 < (g + 1) * GR; c0 += DC)
        pv_span<D, DC, RG>(codes, segs, nseg, Pg, 1, spanp, r0, rg, c0, alpha, acc);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(beta[r]);
      for (int c = g * GR; c < (g + 1) * GR; c += 16)
        _mm512_store_ps(acc + r * D + c, _mm512_add_ps(_mm512_load_ps(acc + r * D + c), b));
    }
  }
}

// Query rows of one decode item at most: its kv heads' rows (fewer than 16
// each) together (decode_heads).
constexpr int kMaxRows = 48;

// A decode item over kv heads [kh0, kh1): every 16 keys, each head's codes
// are scored against its rows, so the item reads the slots' rows of all its
// heads together (a slot holds every head's rows; one head's slice read on
// its own streamed at ~60% of the rate and left the other heads' items to
// re-read the lines from L2), then each span's P.V runs head by head over
// the values the scoring brought into cache. Rows: head-major, r = (kh -
// kh0) * Rh + j * G + g, as the partials' layout.
template <int D, int KB, int VB, bool VT, int GR>
void decode_item(const AttnArgs& a, int64_t t0, int64_t t1, int kh0, int kh1, int b0, int b1,
                 float* part) {
  const Fmt& f = a.f;
  const int G = a.Hq / a.Hkv, bs = a.bs, nh = kh1 - kh0;
  const int nq = static_cast<int>(t1 - t0), Rh = nq * G, R = nh * Rh;  // Rh < 16, R <= kMaxRows
  constexpr int ng = D / GR, vng = VT ? 0 : ng;
  const int span_blocks = bs >= kSpan ? 1 : kSpan / bs;
  const int64_t spanp = (static_cast<int64_t>(span_blocks) * bs + 31) / 16 * 16;  // + 16 slack
  // scratch: S [R][spanp]; affine values: Pg [R][spanp], sv and bv
  // [nh][vng][spanp]; acc [R][D]; m, l, alpha [kMaxRows]; segs
  const int64_t pvn = VT ? 0 : R * spanp + 2 * nh * vng * spanp;
  float* S = tl_decode.get(static_cast<size_t>(R * D + R * spanp + pvn + 3 * kMaxRows) +
                           sizeof(SpanSeg) * span_blocks / sizeof(float) + 16);
  float* Pg = S + R * spanp;
  float* sv = Pg + (VT ? 0 : R * spanp);
  float* bv = sv + nh * vng * spanp;
  float* acc = S + R * spanp + pvn;
  float* m = acc + R * D;
  float* l = m + kMaxRows;
  float* alpha = l + kMaxRows;
  SpanSeg* segs = reinterpret_cast<SpanSeg*>(alpha + kMaxRows);
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
  alignas(64) int8_t xq8[kMaxRows * D];
  float qscale[kMaxRows * ng], J[kMaxRows * ng];
  for (int r = 0; r < R; ++r) {
    const int rr = r % Rh, j = rr / G, h = (kh0 + r / Rh) * G + rr % G;
    const float* qr = pa::load_row(static_cast<const char*>(a.q) + ((t0 + j) * a.Hq + h) * D * qes,
                                   a.q_dtype, D, qbuf);
    for (int i = 0; i < D; ++i) qd[i] = qr[i] * a.scale;
    round_query(qd, D, GR, xq8 + r * D, qscale + r * ng);
    for (int u = 0; u < ng; ++u) {
      int sum = 0;
      for (int i = u * GR; i < (u + 1) * GR; ++i) sum += xq8[r * D + i];
      J[r * ng + u] = static_cast<float>(sum);
    }
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  std::memset(acc, 0, sizeof(float) * R * D);
  const int32_t s = a.seq_idx[t0];
  if (s >= 0 && s < a.S && n_keys > 0) {
    const int32_t* table = a.tables + static_cast<int64_t>(s) * a.B;
    const int64_t rowb = static_cast<int64_t>(a.Hkv) * f.row;  // bytes between slots
    const int64_t nblk = (n_keys + bs - 1) / bs;
    const int64_t be = b1 < nblk ? b1 : nblk;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i offs = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(rowb)));
    const int32_t* xq32 = reinterpret_cast<const int32_t*>(xq8);
    for (int64_t s0 = b0; s0 < be; s0 += span_blocks) {
      const int64_t s1 = s0 + span_blocks < be ? s0 + span_blocks : be;
      int nseg = 0, n = 0;  // n: scores in the span so far
      for (int64_t b = s0; b < s1; ++b) {
        const int64_t blk = table[b];
        if (blk < 0 || (blk + 1) * bs > a.num_slots) continue;
        const int64_t key0 = b * bs;
        const int nk = static_cast<int>(n_keys - key0 < bs ? n_keys - key0 : bs);
        segs[nseg++] = SpanSeg{blk * bs, nk, n};
        for (int i0 = 0; i0 < nk; i0 += 16) {
          const int nv = nk - i0 < 16 ? nk - i0 : 16;
          const __mmask16 in_block = static_cast<__mmask16>(nv >= 16 ? 0xffffu : (1u << nv) - 1u);
          const __m512i kidx = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(key0 + i0)));
          __mmask16 ok[16];  // per token of the item
          for (int j = 0; j < nq; ++j) {
            ok[j] = _mm512_mask_cmple_epi32_mask(in_block, kidx, _mm512_set1_epi32(static_cast<int>(qpos[j])));
            ok[j] = _mm512_mask_cmpge_epi32_mask(ok[j], kidx, _mm512_set1_epi32(static_cast<int>(qlo[j])));
          }
          // The 16 slots' lines in address order, every head's rows, before
          // the heads' strided loads: a sequential stream that the hardware
          // prefetchers run ahead of. A software prefetch of the next
          // block's lines instead was bound by the L1's miss buffers (1.7x
          // this kernel's time from DRAM at 8,000 keys, one thread).
          touch_lines(a.packed + (blk * bs + i0) * rowb, nv * rowb);
          for (int hh = 0; hh < nh; ++hh) {
            const uint8_t* kp0 = a.packed + (blk * bs + i0) * rowb + static_cast<int64_t>(kh0 + hh) * f.row;
            __m512i T[D / 4];
            __m512 ksc[ng], kbi[ng];
            key_columns16<D, KB>(kp0, rowb, nv, T);
            affine_params16<ng>(kp0 + D * KB / 8, offs, in_block, ksc, kbi);
            if constexpr (!VT) {
              __m512 vsc[ng], vbi[ng];
              affine_params16<ng>(kp0 + f.kbytes + D * VB / 8, offs, in_block, vsc, vbi);
              for (int g = 0; g < ng; ++g) {
                _mm512_storeu_ps(sv + (hh * ng + g) * spanp + n + i0, vsc[g]);
                _mm512_storeu_ps(bv + (hh * ng + g) * spanp + n + i0, vbi[g]);
              }
            }
            for (int rr = 0; rr < Rh; ++rr) {
              const int r = hh * Rh + rr;
              const __m512 sc = column_scores16<D, GR>(T, xq32 + r * D / 4, ksc, kbi, J + r * ng, qscale + r * ng);
              // Lanes past the block's keys are overwritten by the next block's.
              _mm512_storeu_ps(S + r * spanp + n + i0, _mm512_mask_mov_ps(ninf, ok[rr / G], sc));
            }
          }
        }
        n += nk;
      }
      if (n == 0) continue;
      span_softmax(S, spanp, R, n, m, l, alpha);
      for (int hh = 0; hh < nh; ++hh) {
        const uint8_t* vbase = a.packed + static_cast<int64_t>(kh0 + hh) * f.row + f.kbytes;
        float* Sh = S + hh * Rh * spanp;
        if constexpr (VT)
          pv_rows<D>(TurboValues<VB>{vbase, rowb, f.vcode, tab}, segs, nseg, Sh, 1, spanp, Rh,
                     alpha + hh * Rh, acc + hh * Rh * D);
        else
          pv_affine<D, VB, GR>(ValueCodes<VB>{vbase, rowb}, segs, nseg, Sh, spanp, Rh, n,
                               sv + hh * ng * spanp, bv + hh * ng * spanp, Pg + hh * Rh * spanp,
                               alpha + hh * Rh, acc + hh * Rh * D);
      }
    }
  }
  store_partials(part, R, D, acc, m, l);
}

template <int D, int KB, int VB, bool VT, int GR>
struct DecodeKernel {
  static void run(const AttnArgs& a, int64_t t0, int64_t t1, int kh0, int kh1, int b0, int b1,
                  float* part) {
    decode_item<D, KB, VB, VT, GR>(a, t0, t1, kh0, kh1, b0, b1, part);
  }
};

// Prefill items (16 rows or more, one kv head): the AVX2 prefill tile
// (prefill_item_avx2); decode items: this file's, where VNNI scores the keys.
bool take_item(const AttnArgs& a, int64_t t0, int64_t t1, int kh0, int kh1, int b0, int b1,
               float* part) {
  if ((t1 - t0) * (a.Hq / a.Hkv) >= 16) return prefill_item_avx2(a, t0, t1, kh0, kh1, b0, b1, part);
  static const bool vnni = cpu_has_avx512_vnni();
  if (!vnni) return false;
  return fast_item<DecodeKernel>(a, t0, t1, kh0, kh1, b0, b1, part);
}

// Decode items hold as many kv heads as kMaxRows allows (on CPUs without
// VNNI the generic kernel takes them, one head at a time).
int decode_heads(const AttnArgs& a, int rows) {
  static const bool vnni = cpu_has_avx512_vnni();
  return vnni ? kMaxRows / rows : 1;
}

}  // namespace

void encode_avx512(const EncodeArgs& a) { Kernels<16>::encode(a); }
void dequant_avx512(const DequantArgs& a) { Kernels<16>::dequant(a); }
void attention_avx512(const AttnArgs& a) { Kernels<16>::attention(a, &take_item, &decode_heads); }

}  // namespace kvq
}  // namespace mlxfast
