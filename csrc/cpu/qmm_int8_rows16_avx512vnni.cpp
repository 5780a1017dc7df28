// Int8-activation quantized matmul over the row-interleaved layout
// (Args::rows16 and Args::int8_acts, bits 4 and 8), AVX-512 VNNI. Entered
// on the AVX-512 path where cpu_has_avx512_vnni(), every number of rows.
//
// The layout's 64-byte word vector holds the same word of 16 weight rows,
// one row per 32-bit lane, so vpdpbusd against a broadcast activation word
// adds 4 products into each row's int32 lane: a row's 32-value block sum
// is exact in integers and there is no horizontal sum. Per activation row
// and block that is 8 vpdpbusd for 16 outputs (4 bits: each word's low
// nibbles against its 4 even activations, its high nibbles against the 4
// odd ones; 8 bits: the unsigned codes against the word's 4 activations),
// against the AVX2 kernel's 16 maddubs plus widening adds per 8 outputs.
// The activations, the integer sums and the fp32 chain per output
//   y = fma(float(isum) * d, scale, y);  y = fma(bias, d * sum(xq), y)
// (symmetric formats: the offset taken in integers, no bias term) are the
// AVX2 kernel's (qmm_int8_rows16_avx2.cpp), so are the results, to
// the bit, whichever kernel, pass or call size computes a row.
//
// One kernel for every M: decode GEMVs stream each 16-row block once, from
// DRAM, with a software prefetch ahead; larger calls reuse the block from
// L1 for every pass of up to kPass activation rows. It replaced (session
// 35) a VNNI kernel over MLX's layout, whose GEMM re-laid each 16-row weight
// panel per call (a third of an 8-row decode step there).
#include "common/cpu_features.h"
#include "cpu/qmm_x86.h"
#include "cpu/qmm_avx512.h"
#include "cpu/qmm_int8_rows16.h"

namespace mlxfast {
namespace qmm {

namespace {

// Activation rows per pass over a block: an int32 and an fp32 accumulator
// each, the word (and its nibbles) and the scales; the activations are
// broadcast from memory inside vpdpbusd (dpbusd_bcast). Against 8 rows a
// pass, a 1B's layer shapes at 12 rows (a verify step's) took 5.9 instead
// of 8.0 ms, at 8, 64 and 512 rows alike (one thread, alternating runs).
constexpr int kPass = 12;
static_assert(kRowGroup % kPass == 0, "a pass's rows share a row group");

// Software prefetch, first pass over a block only: the codes 8 KB ahead into
// L2 (prefetch_weights), the scales and biases 16 groups ahead. A 1B's
// layer shapes from DRAM, one activation row, alternating with the (former)
// VNNI kernel over MLX's layout: 0.78x of it without these, 0.86x with the
// layout's usual L1 prefetch 4 KB ahead (prefetch_stream, right for the
// heavier fp32 tile), 1.02-1.06x with this one (16 KB ahead: 0.99x).
constexpr int64_t kCodesAhead = 128;  // 64-byte words
constexpr int64_t kParamsAhead = 16;

// acc += vpdpbusd(w, the 4 bytes at p broadcast): the broadcast folded into
// the instruction's memory operand ({1to16}), which the compiler does not
// do for _mm512_set1_epi32 of a load.
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// Outputs 16 * blk .. +16 of activation rows m0 .. m0+MM-1. w: the block's
// codes, as the layout has them (NIB: 4-bit words) or as bytes (4 bits:
// unpack_block's order; 8 bits: the layout's).
template <int BITS, bool NIB, int MM, bool PF, bool GF, DType SD, bool SYM>
void tile(const Args& a, const Prep& p, const uint8_t* w, int64_t blk, int64_t m0) {
  constexpr int WPB = NIB ? 4 : 8;  // vectors per 32-value block
  const int64_t G = a.K / a.group_size, bpg = a.group_size / kActBlock;
  const int8_t* xq = p.word(m0, 0);  // row m0 + m's word t: xq[(t * kRowGroup + m) * 4]
  const float* d = p.d + p.blk(m0, 0);  // row m0 + m's block b: d[b * kRowGroup + m]
  const float* sxd = p.sxd + p.blk(m0, 0);
  const int32_t* xs = p.xs + p.blk(m0, 0);
  const __m512i nib = _mm512_set1_epi8(0x0f);
  const __m512i matrix = _mm512_set1_epi64(0x1020408000000000ll);
  __m512 y[MM];
#pragma GCC unroll 12
  for (int m = 0; m < MM; ++m) y[m] = _mm512_setzero_ps();
  int64_t b = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t i = (blk * G + g) * 16;
    if (PF) {
      constexpr int64_t es = SD == F32 ? 4 : 2;
      prefetch_stream(static_cast<const char*>(a.scales) + (i + 16 * kParamsAhead) * es);
      if (a.biases) prefetch_stream(static_cast<const char*>(a.biases) + (i + 16 * kParamsAhead) * es);
    }
    const __m512 s = load_cvt(a.scales, SD, i, 0xffff);
    const __m512 bias = SYM ? s : load_cvt(a.biases, SD, i, 0xffff);
    for (int64_t e = 0; e < bpg; ++e, ++b, w += WPB * 64) {
      // sum(q * xq), or symmetric sum((q - 2^(bits-1)) * xq): the offset
      // as the sums' start.
      __m512i acc[MM];
#pragma GCC unroll 12
      for (int m = 0; m < MM; ++m) {
        acc[m] = SYM ? _mm512_set1_epi32(-(1 << (BITS - 1)) * xs[b * kRowGroup + m])
                     : _mm512_setzero_si512();
      }
#pragma GCC unroll 12
      for (int j = 0; j < WPB; ++j) {
        if (PF) prefetch_weights(w + 64 * (j + kCodesAhead));
        const __m512i v = _mm512_loadu_si512(w + 64 * j);
        if constexpr (NIB) {
          const __m512i lo = _mm512_and_si512(v, nib);
          const __m512i hi = high_nibbles<GF>(v, nib, matrix);
#pragma GCC unroll 12
          for (int m = 0; m < MM; ++m) {
            const int8_t* xw = xq + ((b * 8 + 2 * j) * kRowGroup + m) * 4;
            acc[m] = dpbusd_bcast(acc[m], lo, xw);
            acc[m] = dpbusd_bcast(acc[m], hi, xw + 4 * kRowGroup);
          }
        } else {
#pragma GCC unroll 12
          for (int m = 0; m < MM; ++m) {
            acc[m] = dpbusd_bcast(acc[m], v, xq + ((b * 8 + j) * kRowGroup + m) * 4);
          }
        }
      }
#pragma GCC unroll 12
      for (int m = 0; m < MM; ++m) {
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_set1_ps(d[b * kRowGroup + m]));
        y[m] = _mm512_fmadd_ps(t, s, y[m]);
        if (!SYM) y[m] = _mm512_fmadd_ps(bias, _mm512_set1_ps(sxd[b * kRowGroup + m]), y[m]);
      }
    }
  }
  for (int m = 0; m < MM; ++m) store_cvt(a.out, a.x_dtype, (m0 + m) * a.N + blk * 16, y[m], 0xffff);
}

template <int BITS, bool NIB, bool PF, bool GF, DType SD, int MM = 1>
void pass(const Args& a, const Prep& p, const uint8_t* w, int64_t blk, int64_t m0, int mm) {
  if constexpr (MM < kPass) {
    if (mm > MM) return pass<BITS, NIB, PF, GF, SD, MM + 1>(a, p, w, blk, m0, mm);
  }
  if (a.biases) return tile<BITS, NIB, MM, PF, GF, SD, false>(a, p, w, blk, m0);
  tile<BITS, NIB, MM, PF, GF, SD, true>(a, p, w, blk, m0);
}

// A 4-bit block's codes as bytes, each word's low nibbles then its high
// ones (the order of its activations: the 4 even values, then the 4 odd).
template <bool GF>
void unpack_block(const uint8_t* w, int64_t words, uint8_t* ub) {
  const __m512i nib = _mm512_set1_epi8(0x0f);
  const __m512i matrix = _mm512_set1_epi64(0x1020408000000000ll);
  for (int64_t j = 0; j < words; ++j) {
    const __m512i v = _mm512_loadu_si512(w + 64 * j);
    _mm512_store_si512(ub + 128 * j, _mm512_and_si512(v, nib));
    _mm512_store_si512(ub + 128 * j + 64, high_nibbles<GF>(v, nib, matrix));
  }
}

// Blocks [b0, b1) against activation rows [m_begin, m_end): the first pass
// over a block prefetches ahead, the others find it in L1/L2. A 4-bit block
// that several passes read is unpacked to bytes once.
template <int BITS, bool GF, DType SD>
void blocks(const Args& a, const Prep& p, int64_t b0, int64_t b1, int64_t m_begin, int64_t m_end) {
  const int64_t words = a.K * BITS / 32;
  const bool unpack = BITS == 4 && m_end - m_begin > kPass;
  uint8_t* ub = unpack ? reinterpret_cast<uint8_t*>(tl_w.get(static_cast<size_t>(words * 32))) : nullptr;
  for (int64_t blk = b0; blk < b1; ++blk) {
    const uint8_t* w = static_cast<const uint8_t*>(a.w) + blk * words * 64;
    if (unpack) {
      unpack_block<GF>(w, words, ub);
      for (int64_t m0 = m_begin; m0 < m_end; m0 += kPass) {
        const int mm = static_cast<int>(m_end - m0 < kPass ? m_end - m0 : kPass);
        pass<BITS, false, false, false, SD>(a, p, ub, blk, m0, mm);
      }
      continue;
    }
    for (int64_t m0 = m_begin; m0 < m_end; m0 += kPass) {
      const int mm = static_cast<int>(m_end - m0 < kPass ? m_end - m0 : kPass);
      if (m0 == m_begin) {
        pass<BITS, BITS == 4, true, GF, SD>(a, p, w, blk, m0, mm);
      } else {
        pass<BITS, BITS == 4, false, GF, SD>(a, p, w, blk, m0, mm);
      }
    }
  }
}

template <DType SD>
void blocks_sd(const Args& a, const Prep& p, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  static const bool gf = cpu_has_gfni();
  if (a.bits == 8) return blocks<8, false, SD>(a, p, b0, b1, m0, m1);
  gf ? blocks<4, true, SD>(a, p, b0, b1, m0, m1) : blocks<4, false, SD>(a, p, b0, b1, m0, m1);
}

void blocks_any(const Args& a, const Prep& p, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  switch (a.s_dtype) {
    case F32: blocks_sd<F32>(a, p, b0, b1, m0, m1); break;
    case F16: blocks_sd<F16>(a, p, b0, b1, m0, m1); break;
    default: blocks_sd<BF16>(a, p, b0, b1, m0, m1); break;
  }
}

} // namespace

void gemv_block_int8_rows16_avx512vnni(const Args& a, const float* xp, int64_t n0, int64_t n1) {
  blocks_any(a, prep_at(a, const_cast<float*>(xp)), n0 / 16, n1 / 16, 0, a.M);
}

void run_int8_rows16_avx512vnni(const Args& a) {
  const Args* pa = &a;
  run_int8_rows16(a, kPass, [pa](const Prep& p, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
    blocks_any(*pa, p, b0, b1, m0, m1);
  });
}

} // namespace qmm
} // namespace mlxfast
