// Int8-activation quantized matmul over the row-interleaved layout
// (Args::rows16 and Args::int8_acts, bits 4 and 8), AVX2: llama.cpp's
// maddubs arithmetic for CPUs without VNNI. Entered on the AVX2 path (and
// the AVX-512 path of a CPU without VNNI), every number of rows.
//
// Why: the fp32 rows16 tile masks, converts (vcvtdq2ps) and multiplies
// every 4-bit value on its own, and on a Zen 3 that work, not memory, bounds
// the decode GEMV (one core: 12-14 GB/s of weights whether they sit in L3
// or DRAM; a 1B's decode step is 83% that tile). Here the codes stay
// bytes: vpmaddubsw multiplies 32 unsigned codes by 32 int8 activations and
// adds pairs into int16 lanes, so a row's 32-value block sum is exact in
// integers and converted once.
//
// Activations: quantize_block's numbers per 32 values (d = max|x| / 127),
// stored per word in the byte order of the codes: 4 bits, a 32-bit lane
// holds values 8j .. 8j+7 of its row, byte i the pair (2i, 2i+1) in its
// low and high nibble, so a row's 8 activations are stored as the 4 even
// values, then the 4 odd ones; 8 bits, byte t is value 4j + t: in order.
//
// Per 16-row block, half (8 rows in the lanes of a vector) and block of 32
// values, in integers:
//   4 bits: sum of 4 words' vpmaddubsw(low nibbles, evens) and (high, odds)
//           in int16 (|16 products| <= 16 * 15 * 127 < 2^15), then vpmaddwd;
//   8 bits: codes u = w - 128 as int8, vpmaddubsw(|u|, x * sign(u)) (a pair
//           <= 2 * 128 * 127 < 2^15), vpmaddwd per word, + 128 * sum(xq);
// then, per output, one chain over the blocks in order:
//   y = fma(float(isum) * d, scale, y);  y = fma(bias, d * sum(xq), y)
// (the portable int8 kernel's terms; the rounding order is this kernel's,
// held to the pure-MLX reference by tests), and for symmetric formats
// (biases == nullptr, bias = -2^(bits-1) * scale) the offset taken in
// integers, isum' = isum - 2^(bits-1) * sum(xq):
//   y = fma(float(isum') * d, scale, y)
// (the same value in exact arithmetic, one FMA fewer per block and output;
// no speed difference measured at 512 rows on a Zen 4). The chain does not
// depend on how many rows a call has or which pass computes a row: rows
// give the same bits alone, as verify rows or in a prefill chunk.
#include "cpu/qmm_x86.h"
#include "cpu/qmm_int8_rows16.h"

namespace mlxfast {
namespace qmm {

namespace {

constexpr int kMM = 2;  // activation rows per pass over both halves of a block (registers)
constexpr int kAhead = 64;  // words of software prefetch ahead (into L1)

// One 32-value block of row m from value k0, quantize_block's numbers
// vectorized (the same operations: amax of |x|, x * (127 / amax) rounded to
// nearest even), into dst in the word byte order; returns d, and sum(xq) in
// *isum.
template <int BITS>
inline float quantize32(const Args& a, int64_t off, int8_t* dst, int32_t* isum) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8_cvt(a.x, a.x_dtype, off + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  if (!(amax > 0.0f)) {
    std::memset(dst, 0, kActBlock);
    *isum = 0;
    return 0.0f;
  }
  const __m256 id = _mm256_set1_ps(127.0f / amax);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));  // nearest even
  __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(1, 0, 3, 2)));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(2, 3, 0, 1)));
  *isum = _mm_cvtsi128_si32(t4);
  // |q| <= 127: the saturating packs are exact; they interleave 128-bit
  // lanes, the permute puts the 32 bytes back in order.
  const __m256i b16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  __m256i bytes = _mm256_permutevar8x32_epi32(b16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (BITS == 4) {  // per 8 values: the 4 even ones, then the 4 odd ones
    const __m256i eo = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15, 0, 2, 4,
                                        6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    bytes = _mm256_shuffle_epi8(bytes, eo);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bytes);
  return amax / 127.0f;
}

// Rows [m0, m1) of a.x quantized into p.
template <int BITS>
void prepare_rows(const Args& a, const Prep& p, int64_t m0, int64_t m1) {
  const int64_t K = a.K, B = p.B;
  alignas(32) int8_t blk[kActBlock];
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t b = 0; b < B; ++b) {
      int32_t is;
      const float d = quantize32<BITS>(a, m * K + b * kActBlock, blk, &is);
      for (int t = 0; t < kActBlock / 4; ++t) {
        std::memcpy(const_cast<int8_t*>(p.word(m, b * (kActBlock / 4) + t)), blk + 4 * t, 4);
      }
      const int64_t i = p.blk(m, b);
      p.d[i] = d;
      p.sxd[i] = d * static_cast<float>(is);
      p.xs[i] = is;
    }
  }
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Outputs 16 * blk .. +16 (both halves of each word) of activation rows
// m0 .. m0+MM-1.
template <int BITS, int MM, bool PF>
void tile(const Args& a, const Prep& p, int64_t blk, int64_t m0) {
  constexpr int WPB = BITS == 4 ? 4 : 8;  // words per 32-value block
  const int64_t K = a.K, G = K / a.group_size, B = p.B, bpg = a.group_size / kActBlock;
  const uint8_t* w = static_cast<const uint8_t*>(a.w) + blk * (K * BITS / 32) * 64;
  const int8_t* xq = p.word(m0, 0);  // row m0 + m's word t: xq[(t * kRowGroup + m) * 4]
  const float* d = p.d + p.blk(m0, 0);  // row m0 + m's block b: d[b * kRowGroup + m]
  const float* sxd = p.sxd + p.blk(m0, 0);
  const int32_t* xs = p.xs + p.blk(m0, 0);
  const __m256i nib = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 y[MM][2];
  for (int m = 0; m < MM; ++m) y[m][0] = y[m][1] = _mm256_setzero_ps();
  const bool sym = a.biases == nullptr;
  __m256 s[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, bias[2] = {s[0], s[1]};
  for (int64_t b = 0; b < B; ++b, w += WPB * 64) {
    if (b % bpg == 0) {
      for (int h = 0; h < 2; ++h) {
        const int64_t i = (blk * G + b / bpg) * 16 + 8 * h;
        s[h] = load8_cvt(a.scales, a.s_dtype, i);
        if (!sym) bias[h] = load8_cvt(a.biases, a.s_dtype, i);
      }
    }
    __m256i acc[MM][2];
    for (int m = 0; m < MM; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    for (int j = 0; j < WPB; ++j) {
      if (PF) prefetch_stream(w + 64 * (j + kAhead));
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j + 32 * h));
        if constexpr (BITS == 4) {
          const __m256i lo = _mm256_and_si256(v, nib);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
          for (int m = 0; m < MM; ++m) {
            const int8_t* xw = xq + ((b * 8 + 2 * j) * kRowGroup + m) * 4;
            const __m256i e = _mm256_maddubs_epi16(lo, bcast4(xw));
            const __m256i o = _mm256_maddubs_epi16(hi, bcast4(xw + 4 * kRowGroup));
            acc[m][h] = _mm256_add_epi16(acc[m][h], _mm256_add_epi16(e, o));
          }
        } else {
          const __m256i u = _mm256_xor_si256(v, flip);
          const __m256i au = _mm256_abs_epi8(u);
          for (int m = 0; m < MM; ++m) {
            const __m256i xu = _mm256_sign_epi8(bcast4(xq + ((b * 8 + j) * kRowGroup + m) * 4), u);
            acc[m][h] = _mm256_add_epi32(acc[m][h], _mm256_madd_epi16(_mm256_maddubs_epi16(au, xu), ones));
          }
        }
      }
    }
    for (int m = 0; m < MM; ++m) {
      const __m256 dm = _mm256_set1_ps(d[b * kRowGroup + m]), sm = _mm256_set1_ps(sxd[b * kRowGroup + m]);
      for (int h = 0; h < 2; ++h) {
        // sum(q * xq), or symmetric sum((q - 2^(bits-1)) * xq).
        __m256i isum;
        if constexpr (BITS == 4) {
          isum = _mm256_madd_epi16(acc[m][h], ones);
          if (sym) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * xs[b * kRowGroup + m]));
        } else {
          isum = sym ? acc[m][h]
                     : _mm256_add_epi32(acc[m][h], _mm256_set1_epi32(128 * xs[b * kRowGroup + m]));
        }
        const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), dm);
        y[m][h] = _mm256_fmadd_ps(t, s[h], y[m][h]);
        if (!sym) y[m][h] = _mm256_fmadd_ps(bias[h], sm, y[m][h]);
      }
    }
  }
  for (int m = 0; m < MM; ++m) {
    for (int h = 0; h < 2; ++h) {
      const int64_t o = (m0 + m) * a.N + blk * 16 + 8 * h;
      if (a.x_dtype == F32) {
        _mm256_storeu_ps(static_cast<float*>(a.out) + o, y[m][h]);
      } else {
        alignas(32) float t[8];
        _mm256_store_ps(t, y[m][h]);
        for (int i = 0; i < 8; ++i) store_f32(a.out, a.x_dtype, o + i, t[i]);
      }
    }
  }
}

// Blocks [b0, b1) against activation rows [m_begin, m_end): the first pass
// over a block prefetches ahead, the others find it in L1/L2.
template <int BITS>
void blocks(const Args& a, const Prep& p, int64_t b0, int64_t b1, int64_t m_begin, int64_t m_end) {
  for (int64_t blk = b0; blk < b1; ++blk) {
    for (int64_t m0 = m_begin; m0 < m_end; m0 += kMM) {
      const bool pf = m0 == m_begin;
      if (m_end - m0 >= 2) {
        pf ? tile<BITS, 2, true>(a, p, blk, m0) : tile<BITS, 2, false>(a, p, blk, m0);
      } else {
        pf ? tile<BITS, 1, true>(a, p, blk, m0) : tile<BITS, 1, false>(a, p, blk, m0);
      }
    }
  }
}

} // namespace

void prepare_int8_rows16_avx2(const Args& a, float* xp, int64_t m0, int64_t m1) {
  const Prep p = prep_at(a, xp);
  a.bits == 8 ? prepare_rows<8>(a, p, m0, m1) : prepare_rows<4>(a, p, m0, m1);
}

void gemv_prepare_int8_rows16_avx2(const Args& a, float* xp) {
  prepare_int8_rows16_avx2(a, xp, 0, a.M);
}

void gemv_block_int8_rows16_avx2(const Args& a, const float* xp, int64_t n0, int64_t n1) {
  const Prep p = prep_at(a, const_cast<float*>(xp));
  a.bits == 8 ? blocks<8>(a, p, n0 / 16, n1 / 16, 0, a.M) : blocks<4>(a, p, n0 / 16, n1 / 16, 0, a.M);
}

void run_int8_rows16_avx2(const Args& a) {
  const Args* pa = &a;
  run_int8_rows16(a, kMM, [pa](const Prep& p, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
    pa->bits == 8 ? blocks<8>(*pa, p, b0, b1, m0, m1) : blocks<4>(*pa, p, b0, b1, m0, m1);
  });
}

} // namespace qmm
} // namespace mlxfast
