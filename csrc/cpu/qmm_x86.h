// The GEMV and GEMM drivers of the x86 quantized-matmul files
// (qmm_avx2.cpp, qmm_avx512.cpp): tiling, fan-out, scratch and the
// activation / scale packing are the same for both; each file supplies its
// kernels as a struct and instantiates Driver<Isa>. Included after qmm.h,
// with the including file's ISA flags, so everything here stays in an
// anonymous namespace (see qmm.h's ODR note).
//
// An Isa struct has:
//   kGemvMaxMM        activation rows per GEMV register block
//   kSymmetricOneRow  its one-row GEMV computes symmetric biases itself
//   kMR, kNR          the GEMM micro-tile, kNR = 2 * kLanes
//   Vec, kLanes       the fp32 vector and its width, with vzero, vload and
//                     vstore (aligned), vstoreu, vbroadcast(const float*),
//                     vfmadd(a, b, c) = a * b + c, and vstore_out(out, dt, i,
//                     v, n): lanes j < n to out[i + j] in dtype dt
//   cvt_row(src, dt, off, n, dst)        n values from src + off to fp32
//   prepare_x(a, xp)                     a.x into the layout its GEMV reads
//   gemv_rows<BITS, MM>(c, m0, n0, n1, sc, bi)
//                                        rows m0 .. m0+MM-1, columns [n0, n1);
//                                        its tiles step c.next every 4 groups
//   dequant_panel<BITS>(a, n0, kb, ke, bp, sb)
//                                        weight rows n0 .. n0+kNR-1 as bp[k][kNR]
#pragma once

#include <immintrin.h>

#include "cpu/qmm.h"

namespace mlxfast {
namespace qmm {
namespace {

thread_local Scratch tl_x;  // calling thread: prepared / packed activations
thread_local Scratch tl_w;  // every thread: scales/biases, weight panel
thread_local Scratch tl_t;  // every thread: small row temporaries
thread_local Scratch tl_c;  // every thread: fp32 partial sums across k blocks

// 8 scales (or biases) of dtype dt from p[i] as fp32.
inline __m256 load8_cvt(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case F32: return _mm256_loadu_ps(static_cast<const float*>(p) + i);
    case F16:
      return _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
    default:
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i))),
          16));
  }
}

constexpr int kGemvRowBlock = 16;  // weight rows per GEMV task unit (L1-resident)
static_assert(kGemvRowBlock == kGemvBlockRows, "gemv_block_<isa> takes a row block");

struct GemvCtx {
  const Args* a;
  const float* xp;  // prepared activations (see the Isa's prepare_x)
  int64_t G, row_bytes;
  ParamPrefetch* next;  // the next row block's parameters (tiles step it)
};

constexpr int64_t kKC = 256;                 // k block of the GEMM panels
constexpr int64_t kABlockBytes = 768 << 10;  // packed activation rows kept in L2
constexpr int64_t kPackRows = 48;            // activation rows packed per task

// In-register transpose of 16 rows of 16 bytes: t[b][j] = r[j][b].
inline void transpose16x16_u8(const __m128i r[16], __m128i t[16]) {
  __m128i a[16], c[16], d[16];
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);      // rows 2i,2i+1; b 0..7
    a[8 + i] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);  // b 8..15
  }
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) {
      c[8 * h + i] = _mm_unpacklo_epi16(a[8 * h + 2 * i], a[8 * h + 2 * i + 1]);
      c[8 * h + 4 + i] = _mm_unpackhi_epi16(a[8 * h + 2 * i], a[8 * h + 2 * i + 1]);
    }
  }
  for (int q = 0; q < 4; ++q) {
    for (int i = 0; i < 2; ++i) {
      d[4 * q + i] = _mm_unpacklo_epi32(c[4 * q + 2 * i], c[4 * q + 2 * i + 1]);
      d[4 * q + 2 + i] = _mm_unpackhi_epi32(c[4 * q + 2 * i], c[4 * q + 2 * i + 1]);
    }
  }
  for (int e = 0; e < 8; ++e) {
    t[2 * e] = _mm_unpacklo_epi64(d[2 * e], d[2 * e + 1]);
    t[2 * e + 1] = _mm_unpackhi_epi64(d[2 * e], d[2 * e + 1]);
  }
}

template <class Isa>
struct Driver {
  static constexpr int kMR = Isa::kMR, kNR = Isa::kNR;

  // ---------------------------------------------------------------- GEMV ----

  // Isa::gemv_rows<BITS, mm> for a run-time mm in 1 .. kGemvMaxMM.
  template <int BITS, int MM = 1>
  static void gemv_rows(const GemvCtx& c, int64_t m0, int mm, int64_t n0, int64_t n1,
                        const float* sc, const float* bi) {
    if constexpr (MM < Isa::kGemvMaxMM) {
      if (mm > MM) return gemv_rows<BITS, MM + 1>(c, m0, mm, n0, n1, sc, bi);
    }
    Isa::template gemv_rows<BITS, MM>(c, m0, n0, n1, sc, bi);
  }

  // Output rows [0, M), columns [n0, n1) (at most kGemvRowBlock of them).
  static void gemv_unit(const Args& a, const float* xp, int64_t n0, int64_t n1) {
    const bool dense = a.bits == 0;
    const int64_t M = a.M, K = a.K, G = dense ? 0 : K / a.group_size;
    ParamPrefetch next = next_params(a, n1, kGemvRowBlock, G);
    GemvCtx c{&a, xp, G, dense ? K * dtype_size(a.w_dtype) : K * a.bits / 8, &next};
    float* sb = tl_w.get(static_cast<size_t>(2 * kGemvRowBlock * G + 1));
    float* sc = sb;
    float* bi = sb + kGemvRowBlock * G;
    if (!dense) {
      Isa::cvt_row(a.scales, a.s_dtype, n0 * G, (n1 - n0) * G, sc);
      if (a.biases) {
        Isa::cvt_row(a.biases, a.s_dtype, n0 * G, (n1 - n0) * G, bi);
      } else if (M > 1 || !Isa::kSymmetricOneRow) {
        sym_biases(sc, (n1 - n0) * G, a.bits, bi);
      }
    }
    for (int64_t m0 = 0; m0 < M; m0 += Isa::kGemvMaxMM) {
      int mm = static_cast<int>(M - m0 < Isa::kGemvMaxMM ? M - m0 : Isa::kGemvMaxMM);
      if (a.bits == 4) {
        gemv_rows<4>(c, m0, mm, n0, n1, sc, bi);
      } else if (a.bits == 8) {
        gemv_rows<8>(c, m0, mm, n0, n1, sc, bi);
      } else {
        gemv_rows<0>(c, m0, mm, n0, n1, sc, bi);
      }
    }
  }

  static void gemv(const Args& a) {
    float* xp = tl_x.get(gemv_prep_floats(a));
    Isa::prepare_x(a, xp);
    const int64_t units = ceil_div(a.N, kGemvRowBlock);
    auto body = [&a, xp](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t n0 = u * kGemvRowBlock;
        gemv_unit(a, xp, n0, n0 + kGemvRowBlock < a.N ? n0 + kGemvRowBlock : a.N);
      }
    };
    par_dynamic(units, units / (8 * num_threads()), body);
  }

  // ---------------------------------------------------------------- GEMM ----

  // Scales and biases of weight rows n0 .. n0+kNR-1 as fp32 [kNR][G] each
  // (0 past N).
  static void load_sb(const Args& a, int64_t n0, float* sb) {
    if (a.rows16) return;  // its panels read their parameters themselves
    const int64_t G = a.K / a.group_size;
    const int64_t ncols = a.N - n0 < kNR ? a.N - n0 : kNR;
    float* scf = sb;
    float* bif = sb + kNR * G;
    Isa::cvt_row(a.scales, a.s_dtype, n0 * G, ncols * G, scf);
    if (a.biases) {
      Isa::cvt_row(a.biases, a.s_dtype, n0 * G, ncols * G, bif);
    } else {
      sym_biases(scf, ncols * G, a.bits, bif);
    }
    if (ncols < kNR) {
      std::memset(scf + ncols * G, 0, sizeof(float) * (kNR - ncols) * G);
      std::memset(bif + ncols * G, 0, sizeof(float) * (kNR - ncols) * G);
    }
  }

  // Pack rows p*kMR .. p*kMR+kMR-1 of x as ap[K][kMR] fp32 (missing rows are 0).
  static void pack_a(const Args& a, int64_t p, float* ap, float* tmp) {
    const int64_t K = a.K;
    for (int r = 0; r < kMR; ++r) {
      int64_t m = p * kMR + r;
      if (m < a.M) {
        Isa::cvt_row(a.x, a.x_dtype, m * K, K, tmp);
        for (int64_t k = 0; k < K; ++k) ap[k * kMR + r] = tmp[k];
      } else {
        for (int64_t k = 0; k < K; ++k) ap[k * kMR + r] = 0.0f;
      }
    }
  }

  // C[kMR][kNR] (+)= ap[kc][kMR]^T . bp[kc][kNR], a row of C in two vectors.
  // Partial sums live in the fp32 strip tile cs[kMR][kNR] between k blocks;
  // the last block writes rows < mr, columns < nc of the output (converted
  // to its dtype).
  static void micro(const float* ap, const float* bp, int64_t kc, float* cs, bool first,
                    bool last, const Args& a, int64_t m0, int64_t n0, int mr, int64_t nc) {
    using V = typename Isa::Vec;
    constexpr int L = Isa::kLanes;
    static_assert(kNR == 2 * L, "two vectors per row of the micro-tile");
    V c0[kMR], c1[kMR];
    if (first) {
#pragma GCC unroll 12
      for (int r = 0; r < kMR; ++r) {
        c0[r] = Isa::vzero();
        c1[r] = Isa::vzero();
      }
    } else {
#pragma GCC unroll 12
      for (int r = 0; r < kMR; ++r) {
        c0[r] = Isa::vload(cs + r * kNR);
        c1[r] = Isa::vload(cs + r * kNR + L);
      }
    }
    for (int64_t k = 0; k < kc; ++k) {
      V b0 = Isa::vload(bp);
      V b1 = Isa::vload(bp + L);
#pragma GCC unroll 12
      for (int r = 0; r < kMR; ++r) {
        V x = Isa::vbroadcast(ap + r);
        c0[r] = Isa::vfmadd(x, b0, c0[r]);
        c1[r] = Isa::vfmadd(x, b1, c1[r]);
      }
      ap += kMR;
      bp += kNR;
    }
    if (!last) {
#pragma GCC unroll 12
      for (int r = 0; r < kMR; ++r) {
        Isa::vstore(cs + r * kNR, c0[r]);
        Isa::vstore(cs + r * kNR + L, c1[r]);
      }
      return;
    }
    const int64_t N = a.N;
    if (a.x_dtype == F32 && mr == kMR && nc == kNR) {
      float* out = static_cast<float*>(a.out) + m0 * N + n0;
#pragma GCC unroll 12
      for (int r = 0; r < kMR; ++r) {
        Isa::vstoreu(out + r * N, c0[r]);
        Isa::vstoreu(out + r * N + L, c1[r]);
      }
      return;
    }
    const int64_t n_lo = nc < L ? nc : L, n_hi = nc > L ? nc - L : 0;
    for (int r = 0; r < mr; ++r) {
      Isa::vstore_out(a.out, a.x_dtype, (m0 + r) * N + n0, c0[r], n_lo);
      Isa::vstore_out(a.out, a.x_dtype, (m0 + r) * N + n0 + L, c1[r], n_hi);
    }
  }

  static void gemm(const Args& a) {
    const int64_t M = a.M, N = a.N, K = a.K;
    const int64_t P = ceil_div(M, kMR);
    float* ap = tl_x.get(static_cast<size_t>(P * K * kMR));
    const Args* pa = &a;
    auto pack = [pa, ap, K](int64_t p0, int64_t p1) {
      float* tmp = tl_t.get(static_cast<size_t>(K));
      for (int64_t p = p0; p < p1; ++p) pack_a(*pa, p, ap + p * K * kMR, tmp);
    };
    par(P, kPackRows / kMR, pack);
    const int64_t NB = ceil_div(N, kNR);
    // k blocks: a [kc][kNR] weight panel stays in L1.
    const bool dense = a.bits == 0;
    const int64_t kc_max = dense ? kKC : (kKC / a.group_size) * a.group_size;
    const int64_t pc = kABlockBytes / (K * kMR * 4) > 1 ? kABlockBytes / (K * kMR * 4) : 1;
    auto body = [pa, ap, K, M, N, P, kc_max, pc, NB, dense](int64_t t0, int64_t t1) {
      const Args& a = *pa;
      const int64_t G = dense ? 0 : K / a.group_size;
      float* bp = tl_w.get(static_cast<size_t>(kc_max * kNR));
      // scales/biases, or the dense panel's row-major staging buffer
      float* sb = tl_t.get(static_cast<size_t>(dense ? kc_max * kNR : 2 * kNR * G));
      float* cs = K > kc_max ? tl_c.get(static_cast<size_t>(P * kMR * kNR)) : nullptr;
      // Task t: weight panel t % NB against activation row block t / NB (pc
      // panels, small enough to stay in L2 while the panels pass over it).
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t pb = (t / NB) * pc;
        const int64_t pe = pb + pc < P ? pb + pc : P;
        const int64_t n0 = (t % NB) * kNR;
        const int64_t nc = N - n0 < kNR ? N - n0 : kNR;
        if (!dense) load_sb(a, n0, sb);
        for (int64_t kb = 0; kb < K; kb += kc_max) {
          const int64_t ke = kb + kc_max < K ? kb + kc_max : K;
          if (dense) {
            dense_panel<kNR>(a, n0, kb, ke, bp, sb);
          } else if (a.bits == 4) {
            Isa::template dequant_panel<4>(a, n0, kb, ke, bp, sb);
          } else {
            Isa::template dequant_panel<8>(a, n0, kb, ke, bp, sb);
          }
          for (int64_t p = pb; p < pe; ++p) {
            int mr = static_cast<int>(M - p * kMR < kMR ? M - p * kMR : kMR);
            micro(ap + p * K * kMR + kb * kMR, bp, ke - kb, cs ? cs + p * kMR * kNR : nullptr,
                  kb == 0, ke == K, a, p * kMR, n0, mr, nc);
          }
        }
      }
    };
    par_dynamic(ceil_div(P, pc) * NB, 1, body);
    tl_x.trim(kKeepScratchFloats);
  }

  // Bits 4 and 8 and dense weights; other widths run the portable kernel.
  static void run(const Args& a) {
    if (a.bits != 0 && a.bits != 4 && a.bits != 8) {
      run_portable(a);
    } else if (a.M <= gemv_max_rows(a.bits)) {
      gemv(a);
    } else {
      gemm(a);
    }
  }
};

} // namespace
} // namespace qmm
} // namespace mlxfast
