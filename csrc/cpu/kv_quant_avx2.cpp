// Quantized-KV kernels compiled for the avx2 path (see kv_quant.h).
//
// Decode items (fewer than 16 query rows: a token's query heads sharing a kv
// head) at head dims 64/128/256 and groups 32/64 take the dense AVX2 decode
// tile's key loop (decode_span_avx2.h's decode_spans) instead of the generic
// kernel's per-block pass: 8 keys' scores at a time from integer dot
// products of the rounded query with the key codes, online softmax once per
// span of kSpan keys, and P.V with the rows' accumulators in registers over
// the value codes (PackedPool::pv). Widths, value kind, group and head dim
// are compile-time. The generic kernel ran scalar max/exp/sum and a rescale
// per 16-key block with run-time widths: 0.5-0.7x the dense f16 kernel's
// speed at 8,000 keys for about half its bytes. Prefill items (16 rows or
// more) take the AVX2 prefill tile's key loop (prefill_tile_avx2.h) over
// keys and values decoded to fp32 per block.
#include "cpu/kv_quant.h"

#include "common/scratch.h"
#include "cpu/decode_span_avx2.h"
#include "cpu/prefill_tile_avx2.h"

namespace mlxfast {
namespace kvq {

namespace {

thread_local Scratch tl_decode;
thread_local Scratch tl_pv;  // PackedPool::pv's (tl_decode holds the tile's rows)
thread_local Scratch tl_prefill;  // a prefill tile's rows (tl_pv holds its block of values)

constexpr int kSpan = 128;  // keys per online-softmax step (as the dense tile)

// A packed pool's value rows in registers: affine, the codes as floats
// (their scale and bias are applied to the probabilities: PackedPool::pv);
// TurboQuant, w * c[code] in the rotated domain (lo/hi: the codebook's
// entries 0-7 and 8-15).
template <int D, int VB, bool VT>
struct CodeValues {
  const uint8_t* vbase;
  int64_t rowb;
  __m256 lo, hi;
  template <int NV>
  void get(int64_t slot, int c0, __m256* vv) const {
    const uint8_t* vp = vbase + slot * rowb;
    float w = 0.f;
    if constexpr (VT) std::memcpy(&w, vp + D * VB / 8, 4);
    for (int v = 0; v < NV; ++v) {
      const __m256i c = codes8(vp, VB, c0 / 8 + v);
      if constexpr (VT) {
        __m256 x = _mm256_permutevar8x32_ps(lo, c);
        if constexpr (VB == 4)
          x = _mm256_blendv_ps(x, _mm256_permutevar8x32_ps(hi, c),
                               _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, _mm256_set1_epi32(7))));
        vv[v] = _mm256_mul_ps(x, _mm256_set1_ps(w));
      } else {
        vv[v] = _mm256_cvtepi32_ps(c);
      }
    }
  }
};

// Kv head kh's packed rows for decode_spans (one head per item: the
// generic kernel orders a chunk's heads together, so they share its lines).
template <int D, int KB, int VB, bool VT, int GR>
struct PackedPool {
  const uint8_t* kbase;  // head kh's part of slot 0
  int64_t rowb, num_slots;
  int bs, row, kbytes;
  __m256 lo, hi;
  bool slot_ok(int64_t blk) const { return blk >= 0 && (blk + 1) * bs <= num_slots; }
  void prefetch(int64_t blk) const {
    pa::prefetch_rows(reinterpret_cast<const char*>(kbase), blk * bs * rowb, bs, rowb, row);
  }
  // Scores from integer dot products: the query row is rounded to 8 bits
  // per key group (round_query: q^ = d_g * xq), so q^ . k^ = sum over groups
  // of d_g * (s_g * sum(xq * code) + b_g * sum(xq)), the sums exact in int32
  // (vpmaddwd on the codes widened to 16 bits, shared by the rows).
  const int16_t* q16;  // [R][D] the rows' xq
  const float* qd;     // [R][D / GR] their groups' d
  const float* qJ;     // [R][D / GR] sum(xq) per group
  // The tile: the codes as int16 [8][D] in kb's first half, then the keys'
  // scales and biases per group as float vectors [NG][8] each.
  void keys8(int64_t slot, int hh, int nv, float* kb) const {
    constexpr int NG = D / GR;
    int16_t* kc = reinterpret_cast<int16_t*>(kb);
    float* s8 = kb + 4 * D;
    float* b8 = s8 + 8 * NG;
    const uint8_t* kp0 = kbase + slot * rowb + static_cast<int64_t>(hh) * row;
    for (int k = 0; k < 8; ++k) {
      const uint8_t* kp = kp0 + k * rowb;
      for (int c = 0; c < D / 16; ++c) {
        __m128i x;
        if constexpr (KB == 8) {
          x = k < nv ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(kp + 16 * c)) : _mm_setzero_si128();
        } else {  // byte i holds codes 2i (low nibble) and 2i + 1
          const __m128i w = k < nv ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(kp + 8 * c)) : _mm_setzero_si128();
          const __m128i m4 = _mm_set1_epi8(15);
          x = _mm_unpacklo_epi8(_mm_and_si128(w, m4), _mm_and_si128(_mm_srli_epi16(w, 4), m4));
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(kc + k * D + 16 * c), _mm256_cvtepu8_epi16(x));
      }
      const uint8_t* sp = kp + D * KB / 8;
      for (int g = 0; g < NG; ++g) {
        uint16_t h;
        std::memcpy(&h, sp + 2 * g, 2);
        s8[8 * g + k] = k < nv ? _cvtsh_ss(h) : 0.f;
        std::memcpy(&h, sp + 2 * NG + 2 * g, 2);
        b8[8 * g + k] = k < nv ? _cvtsh_ss(h) : 0.f;
      }
    }
  }
  __m256 score8(const DecodeRows& t, int r) const {
    constexpr int NG = D / GR;
    const int16_t* kc = reinterpret_cast<const int16_t*>(t.kb);
    const float* s8 = t.kb + 4 * D;
    const float* b8 = s8 + 8 * NG;
    const int16_t* q = q16 + r * D;
    __m256 score = _mm256_setzero_ps();
    for (int g = 0; g < NG; ++g) {
      __m256i acc[8];
      for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_si256();
      for (int c = g * GR / 16; c < (g + 1) * GR / 16; ++c) {
        const __m256i qv = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 16 * c));
        for (int k = 0; k < 8; ++k)
          acc[k] = _mm256_add_epi32(acc[k], _mm256_madd_epi16(
              _mm256_load_si256(reinterpret_cast<const __m256i*>(kc + k * D + 16 * c)), qv));
      }
      __m256 part[8];
      for (int k = 0; k < 8; ++k) part[k] = _mm256_cvtepi32_ps(acc[k]);
      const __m256 gs = _mm256_fmadd_ps(_mm256_load_ps(s8 + 8 * g), reduce8x8(part),
                                        _mm256_mul_ps(_mm256_load_ps(b8 + 8 * g), _mm256_set1_ps(qJ[r * NG + g])));
      score = _mm256_fmadd_ps(gs, _mm256_set1_ps(qd[r * NG + g]), score);
    }
    return score;
  }
  // P.V. Affine values from the codes: per group of GR columns,
  // sum_i p_i (s_i c_i + b_i) = sum_i (p_i s_i) c_i + sum_i p_i b_i, so a
  // value row's scale and bias are applied once per key and row, not per
  // value (6-13% of the 8-bit kernel's time in two measurements, 1 thread,
  // 2,000 keys; for TurboQuant's one weight per row the extra pass over P
  // cost more than it saved).
  void pv(int hh, const SpanSeg* segs, int nseg, const float* P, int64_t sp, int Rh,
          const float* alpha, float* acc) const {
    const uint8_t* vb = kbase + static_cast<int64_t>(hh) * row + kbytes;
    const CodeValues<D, VB, VT> codes{vb, rowb, lo, hi};
    if constexpr (VT) {
      pv_rows<D>(codes, segs, nseg, P, 1, sp, Rh, alpha, acc);
    } else {
      pv_affine(codes, vb, segs, nseg, P, sp, Rh, alpha, acc);
    }
  }

  void pv_affine(const CodeValues<D, VB, VT>& codes, const uint8_t* vb, const SpanSeg* segs,
                 int nseg, const float* P, int64_t sp, int Rh, const float* alpha, float* acc) const {
    constexpr int NG = D / GR;
    const int n = segs[nseg - 1].off + segs[nseg - 1].nk, n8 = (n + 7) & ~7;
    float* sv = tl_pv.get(static_cast<size_t>(2 * NG * n8 + Rh * sp));  // [NG][n8] each
    float* bv = sv + NG * n8;
    float* Pg = bv + NG * n8;  // [Rh][sp]: P scaled for one group
    for (int sg = 0; sg < nseg; ++sg) {
      for (int i = 0; i < segs[sg].nk; ++i) {
        const uint8_t* vp = vb + (segs[sg].slot0 + i) * rowb + D * VB / 8;  // past the codes
        const int k = segs[sg].off + i;
        for (int g = 0; g < NG; ++g) {
          uint16_t h;
          std::memcpy(&h, vp + 2 * g, 2);
          sv[g * n8 + k] = _cvtsh_ss(h);
          std::memcpy(&h, vp + 2 * NG + 2 * g, 2);
          bv[g * n8 + k] = _cvtsh_ss(h);
        }
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int k = n; k < n8; ++k) sv[g * n8 + k] = bv[g * n8 + k] = 0.f;
    for (int g = 0; g < NG; ++g) {
      float beta[16];
      for (int r = 0; r < Rh; ++r) {
        __m256 bsum = _mm256_setzero_ps();
        for (int k0 = 0; k0 < n8; k0 += 8) {
          const __m256 p = _mm256_loadu_ps(P + r * sp + k0);
          _mm256_storeu_ps(Pg + r * sp + k0, _mm256_mul_ps(p, _mm256_loadu_ps(sv + g * n8 + k0)));
          bsum = _mm256_fmadd_ps(p, _mm256_loadu_ps(bv + g * n8 + k0), bsum);
        }
        beta[r] = hsum8(bsum);
      }
      for (int r0 = 0; r0 < Rh; r0 += kPvRows) {
        const int rg = Rh - r0 < kPvRows ? Rh - r0 : kPvRows;
        for (int c0 = g * GR; c0 < (g + 1) * GR; c0 += kPvCols)
          pv_span<D, kPvCols, kPvRows>(codes, segs, nseg, Pg, 1, sp, r0, rg, c0, alpha, acc);
      }
      for (int r = 0; r < Rh; ++r) {
        const __m256 b = _mm256_set1_ps(beta[r]);
        for (int c = g * GR; c < (g + 1) * GR; c += 8)
          _mm256_store_ps(acc + r * D + c, _mm256_add_ps(_mm256_load_ps(acc + r * D + c), b));
      }
    }
  }
};

template <int D, int KB, int VB, bool VT, int GR>
void decode_item(const AttnArgs& a, int64_t t0, int64_t t1, int kh, int b0, int b1, float* part) {
  const Fmt& f = a.f;
  const int G = a.Hq / a.Hkv, bs = a.bs;
  const int nq = static_cast<int>(t1 - t0);
  DecodeRows t(tl_decode, D, 1, nq * G, G, bs, kSpan);  // nq * G < 16
  int64_t n_keys = 0, lo_min = INT64_MAX;
  for (int j = 0; j < nq; ++j) {
    int64_t p = a.pos[t0 + j];
    t.qlo[j] = pa::key_lo(a.window, p);
    lo_min = t.qlo[j] < lo_min ? t.qlo[j] : lo_min;
    if (p > a.B * bs - 1) p = a.B * bs - 1;
    t.qpos[j] = p;
    n_keys = p + 1 > n_keys ? p + 1 : n_keys;
  }
  const size_t qes = pa::elem_size(a.q_dtype);
  constexpr int NG = D / GR;
  float qbuf[pa::kMaxHeadDim];
  int8_t q8[D];
  alignas(32) int16_t q16[16 * D];
  float qd[16 * NG], qJ[16 * NG];
  for (int r = 0; r < t.R; ++r) {
    const int j = r / G, h = kh * G + r % G;
    const float* qr = pa::load_row(static_cast<const char*>(a.q) + ((t0 + j) * a.Hq + h) * D * qes,
                                   a.q_dtype, D, qbuf);
    float* dst = t.qf + r * D;
    for (int i = 0; i < D; ++i) dst[i] = qr[i] * a.scale;
    round_query(dst, D, GR, q8, qd + r * NG);
    for (int g = 0; g < NG; ++g) {
      int sum = 0;
      for (int i = g * GR; i < (g + 1) * GR; ++i) {
        q16[r * D + i] = q8[i];
        sum += q8[i];
      }
      qJ[r * NG + g] = static_cast<float>(sum);
    }
  }
  const int32_t s = a.seq_idx[t0];
  if (s >= 0 && s < a.S && n_keys > 0) {
    float cbp[16] = {0};
    if (VT) std::memcpy(cbp, a.codebook, sizeof(float) * (1 << f.vbits));
    const int64_t rowb = static_cast<int64_t>(a.Hkv) * f.row;  // bytes between slots
    const PackedPool<D, KB, VB, VT, GR> pool{a.packed + static_cast<int64_t>(kh) * f.row,
                                             rowb, a.num_slots, bs, f.row, f.kbytes,
                                             _mm256_loadu_ps(cbp), _mm256_loadu_ps(cbp + 8),
                                             q16, qd, qJ};
    const int64_t nblk = (n_keys + bs - 1) / bs;
    const int64_t be = b1 < nblk ? b1 : nblk;
    const int64_t bb = b0 > lo_min / bs ? b0 : lo_min / bs;
    decode_spans<D>(pool, a.tables + static_cast<int64_t>(s) * a.B, bs, bb, be, n_keys, t);
  }
  store_partials(part, t.R, D, t.acc, t.m, t.l);
}

// Kv head kh's packed rows for prefill_blocks: a block's keys and values
// decoded to fp32 rows, as the generic kernel does (a prefill tile's 16 or
// more query rows share each decode), scored against the rounded query in
// float. TurboQuant values stay in the rotated domain (Kernels::merge_range
// rotates the rows back).
template <int D, int KB, int VB, bool VT, int GR>
struct PackedPrefillPool {
  const uint8_t* kbase;  // head kh's part of slot 0
  int64_t rowb, num_slots;
  int bs;
  const Fmt* f;
  const float* cbp;  // the codebook padded to 16 entries
  float* vb;         // [bs][D]: the block's values
  bool slot_ok(int64_t blk) const { return blk >= 0 && (blk + 1) * bs <= num_slots; }
  void keys4(int64_t slot, int nv, float* kb) const {
    for (int j = 0; j < 4; ++j) {
      if (j < nv)
        decode_affine(kbase + (slot + j) * rowb, D, KB, GR, kb + j * D, nullptr);
      else
        std::memset(kb + j * D, 0, sizeof(float) * D);
    }
  }
  // Flattened: GCC left pv_span out of line here with its accumulators
  // spilled to the stack every key (1.5x the dense tile's time).
  [[gnu::flatten]] void pv_block(int64_t blk, int nk, const float* S, int64_t Rp, int R,
                                 const float* alpha, float* acc) const {
    for (int i = 0; i < nk; ++i) {
      const uint8_t* vp = kbase + (blk * bs + i) * rowb + f->kbytes;
      if constexpr (VT)
        decode_turbo_rot(vp, *f, cbp, vb + i * D, nullptr);
      else
        decode_affine(vp, D, VB, GR, vb + i * D, nullptr);
    }
    const SpanSeg seg{0, nk, 0};
    pv_rows<D>(FloatValues<D>{vb}, &seg, 1, S, Rp, 1, R, alpha, acc);
  }
};

// Prefill items (16 query rows or more): prefill_blocks over the packed
// pool; the generic kernel ran its scores in scalar loops per block (about
// 5x slower than dequantizing the blocks and running the dense kernel).
template <int D, int KB, int VB, bool VT, int GR>
void prefill_item(const AttnArgs& a, int64_t t0, int64_t t1, int kh, int b0, int b1, float* part) {
  const int G = a.Hq / a.Hkv, bs = a.bs;
  const int R = static_cast<int>(t1 - t0) * G;
  PrefillRows t(tl_prefill, D, bs, R, G, t0, a.pos, a.window, a.B * bs - 1);
  float* vb = tl_pv.get(static_cast<size_t>(bs) * D);
  const size_t qes = pa::elem_size(a.q_dtype);
  float qbuf[pa::kMaxHeadDim];
  alignas(32) float q[D];
  for (int r = 0; r < R; ++r) {
    const int j = r / G, h = kh * G + r % G;
    const float* qr = pa::load_row(static_cast<const char*>(a.q) + ((t0 + j) * a.Hq + h) * D * qes,
                                   a.q_dtype, D, qbuf);
    for (int i = 0; i < D; ++i) q[i] = qr[i] * a.scale;
    round_query(q, D, GR, nullptr, nullptr);
    t.set_query(r, q, D);
  }
  const int32_t s = a.seq_idx[t0];
  if (s >= 0 && s < a.S && t.n_keys > 0) {
    float cbp[16] = {0};
    if (VT) std::memcpy(cbp, a.codebook, sizeof(float) * (1 << a.f.vbits));
    const PackedPrefillPool<D, KB, VB, VT, GR> pool{
        a.packed + static_cast<int64_t>(kh) * a.f.row, static_cast<int64_t>(a.Hkv) * a.f.row,
        a.num_slots, bs, &a.f, cbp, vb};
    const int64_t nblk = (t.n_keys + bs - 1) / bs;
    const int64_t be = b1 < nblk ? b1 : nblk;
    const int64_t bb = b0 > t.lo_min / bs ? b0 : t.lo_min / bs;
    prefill_blocks<D>(pool, a.tables + static_cast<int64_t>(s) * a.B, bs, bb, be, t);
  }
  store_partials(part, R, D, t.acc, t.m, t.l);
}

// A work item by its rows: decode (fewer than 16) or prefill.
template <int D, int KB, int VB, bool VT, int GR>
struct ItemKernel {
  static void run(const AttnArgs& a, int64_t t0, int64_t t1, int kh0, int kh1, int b0, int b1,
                  float* part) {
    const bool prefill = (t1 - t0) * (a.Hq / a.Hkv) >= 16;
    each_head(a, t0, t1, kh0, kh1, part, [&](int kh, float* p) {
      if (prefill)
        prefill_item<D, KB, VB, VT, GR>(a, t0, t1, kh, b0, b1, p);
      else
        decode_item<D, KB, VB, VT, GR>(a, t0, t1, kh, b0, b1, p);
    });
  }
};

bool take_item(const AttnArgs& a, int64_t t0, int64_t t1, int kh0, int kh1, int b0, int b1,
               float* part) {
  return fast_item<ItemKernel>(a, t0, t1, kh0, kh1, b0, b1, part);
}

template <int D, int KB, int VB, bool VT, int GR>
struct PrefillKernel {
  static void run(const AttnArgs& a, int64_t t0, int64_t t1, int kh0, int kh1, int b0, int b1,
                  float* part) {
    each_head(a, t0, t1, kh0, kh1, part,
              [&](int kh, float* p) { prefill_item<D, KB, VB, VT, GR>(a, t0, t1, kh, b0, b1, p); });
  }
};

}  // namespace

bool prefill_item_avx2(const AttnArgs& a, int64_t t0, int64_t t1, int kh0, int kh1, int b0, int b1,
                       float* part) {
  if ((t1 - t0) * (a.Hq / a.Hkv) < 16) return false;
  return fast_item<PrefillKernel>(a, t0, t1, kh0, kh1, b0, b1, part);
}

void encode_avx2(const EncodeArgs& a) { Kernels<8>::encode(a); }
void dequant_avx2(const DequantArgs& a) { Kernels<8>::dequant(a); }
void attention_avx2(const AttnArgs& a) { Kernels<8>::attention(a, &take_item); }

}  // namespace kvq
}  // namespace mlxfast
