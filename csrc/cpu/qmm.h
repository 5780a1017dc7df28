// Private interface of the quantized-matmul CPU kernels (csrc/cpu/qmm_*.cpp).
//
// y[m, n] = sum_k x[m, k] * (scale[n, g(k)] * q[n, k] + bias[n, g(k)])
// with q packed LSB-first as a bit stream along each row of w (MLX's affine
// format; for bits 4 and 8 that is "little end first within each uint32").
//
// Each ISA file implements run_<isa>(), which picks the GEMV path (few rows,
// memory-bound) or the blocked GEMM path (many rows, compute-bound) itself and
// fans out over the shared thread pool.
//
// ODR note: this header is compiled with different ISA flags in different
// files. Everything defined here lives in an anonymous namespace so that the
// linker can never merge an AVX-512 copy of a helper into the portable path.
// For the same reason the ISA files use no std:: containers (their template
// instantiations would be shared across flags), only raw buffers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/half.h"
#include "common/parallel.h"
#include "common/scratch.h"

namespace mlxfast {
namespace qmm {

enum DType : int { F32 = 0, F16 = 1, BF16 = 2 };

// bits == 0 means dense weights: w is [N, K] in w_dtype (y = x @ w.T) and
// scales, biases and group_size are unused. The same GEMV/GEMM drivers run
// both; only the weight unpacking differs.
struct Args {
  const void* x;        // [M, K] in x_dtype, row-major contiguous
  const void* w;        // [N, K * bits / 32] uint32, or [N, K] in w_dtype
  const void* scales;   // [N, K / group_size] in s_dtype
  const void* biases;   // [N, K / group_size] in s_dtype; nullptr: symmetric (see sym_bias)
  void* out;            // [M, N] in x_dtype
  int64_t M, N, K;
  int group_size, bits;
  DType x_dtype, s_dtype;
  DType w_dtype = F32;  // dense weights only
  // Int8 activations (opt-in, quantized weights only): each row of x is
  // quantized in blocks of kActBlock values, d = max|x| / 127,
  // xq = rint(x * (127 / max|x|)), and the matmul is x_hat @ w_hat.T with
  // x_hat = d * xq, computed as
  //   sum over blocks: scale * d * sum(q * xq) + bias * (d * sum(xq)),
  // the integer sums exact (VNNI's vpdpbusd on x86). See run_int8_*.
  bool int8_acts = false;
  // The row-interleaved layout (bits 4 or 8, N % 16 == 0; see rows16_word):
  // w is [N / 16][K * bits / 32][16] uint32, word (b, j, r) holding values
  // vj .. vj+v-1 of row 16b + r (v = 32 / bits values a word), and scales /
  // biases are [N / 16][G][16]. A 16-row block then reads as one stream
  // whose every 64 bytes hold v values of each of its 16 rows, so the
  // AVX-512 and AVX2 kernels put rows in lanes: no per-group lookup table,
  // no horizontal sums, one cvtdq2ps per 16 (8) values (see qmm_avx512.cpp,
  // qmm_avx2.cpp). A load-time repack of MLX's layout (ops.pack_rows16) on
  // those two paths; fp32 activations.
  bool rows16 = false;
};

// Word j (values vj .. vj+v-1, v = 32 / bits) of row n, value k of row n,
// and the index of row n's parameter of group g, in the row-interleaved
// layout (Args::rows16).
inline uint32_t rows16_word(const Args& a, int64_t n, int64_t j) {
  return static_cast<const uint32_t*>(a.w)[((n >> 4) * (a.K * a.bits / 32) + j) * 16 + (n & 15)];
}
inline uint32_t rows16_code(const Args& a, int64_t n, int64_t k) {
  const int64_t v = 32 / a.bits;
  return (rows16_word(a, n, k / v) >> (a.bits * (k % v))) & ((1u << a.bits) - 1u);
}
inline int64_t rows16_param(const Args& a, int64_t n, int64_t g) {
  return ((n >> 4) * (a.K / a.group_size) + g) * 16 + (n & 15);
}

// Activation values per int8 block (llama.cpp's QK8_1); divides every group
// size (32, 64, 128), so a block never straddles two weight groups.
constexpr int64_t kActBlock = 32;

inline int dtype_size(DType dt) { return dt == F32 ? 4 : 2; }

// Symmetric formats (GGUF's Q4_0, Q5_0, Q8_0 read as MLX groups) have
// bias = -2^(bits-1) * scale in every group, exactly: a kernel given
// biases == nullptr computes them so (same numbers, fewer bytes). The loader
// drops such biases (models/layers.py drop_symmetric_biases).
inline float sym_bias(int bits) { return -static_cast<float>(1 << (bits - 1)); }

// Rows up to which the GEMV (weight-streaming) path is used; above it the
// blocked GEMM path dequantizes weight panels once and reuses them. A GEMV
// of 9-16 rows runs two register blocks over each L1-resident row block.
// The default model's matmul shapes for one step, interleaved runs on this
// machine (AVX-512), GEMV vs GEMM: 12 rows 31 vs 34.5 ms, 16 rows 36-46 vs
// 43-54 ms, 24 rows even, GEMM ahead from 32 rows. Forced AVX2: GEMV equal
// or ahead at 16 rows.
constexpr int64_t kGemvMaxRows = 16;

// 8-bit weights stay on the GEMV path to 64 rows: the default model's 8-bit
// output head (49152 x 576) took 6.4-7.9 ms at 17 rows on GEMV against
// 11.9-14.3 on GEMM, 21-22 against 25-26 at 64, even at 96; forced AVX2
// 15 against 23 ms at 17 rows, 45 against 62-68 at 64 (alternating runs, a
// loaded machine). That is a speculative step's head at one stream with 16
// draft tokens, or eight streams with up to 7 each.
constexpr int64_t kGemvMaxRows8 = 64;
inline int64_t gemv_max_rows(int bits) { return bits == 8 ? kGemvMaxRows8 : kGemvMaxRows; }

// The row-interleaved layout's GEMV runs to 32 rows at 4 bits: its tile
// re-reads a 16-row block from L1 per 4 activation rows, and at 17-32 rows
// the GEMM's panels are mostly padding (default model's projections, 17
// rows: 0.33 ms against 0.49-0.85 for gate_up; 24-32 alike or better; 48-64
// the GEMM's 5-10% better). A speculative step's verify at one stream, or a
// few streams with drafts, stays on the GEMV.
constexpr int64_t kRows16GemvMaxRows4 = 32;
inline int64_t rows16_gemv_max_rows(int bits) {
  return bits == 8 ? kGemvMaxRows8 : kRows16GemvMaxRows4;
}

// AVX-512: above the GEMV, to 128 rows, the layout's GEMM runs in the GEMV's
// arithmetic (qmm_avx512.cpp rows16_gemm; AVX2 runs that arithmetic at every
// size, qmm_avx2.cpp r16_matmul): a row's result is the same in
// any call of up to 128 rows (decode and verify steps: 8 streams with 8
// drafts each are 72). Its per-group fold costs ~9% more FMAs at group size
// 32 than dequantized panels do: at 48-128 rows alike (within 3-6%, the
// default model's and a 1B's shapes), at 512 rows 2-7% slower and the
// default model's 512-token prefill 7% slower, so larger calls (prefill
// chunks) take the dequantized-panel GEMM.
constexpr int64_t kRows16InvariantMaxRows = 128;

// GEMV software-prefetch distance, in weight rows ahead of the row being
// read. The hardware streamers alone left one core latency-bound: the 8-bit
// output head (49152 x 576) ran at ~9 GB/s; prefetching 8 rows ahead took it
// from 4.2 to 2.3 ms (bench on the default model's shapes, quiet machine).
constexpr int kPrefetchRows = 8;

// A GEMV's weight prefetch, into L2 (prefetcht1), not L1: a tile reads R
// rows at once, R interleaved streams that the hardware prefetchers follow
// poorly, and prefetches into L1 held its few miss buffers so that too few
// lines were in flight. On a 2-core Zen 4, Gemma 3's 8-bit head (262144 x
// 640, 178 MB, one row) went from ~10.4 to ~7 ms (DRAM-bound: 17 -> 26
// GB/s; int8 activations 16 -> 29 GB/s); a plain read of 4 interleaved
// 640-byte rows streamed at 20 GB/s with L1 prefetches, 26-35 with L2 ones,
// 43 linear. The distance mattered little (5-20 KB ahead).
inline void prefetch_weights(const void* p) { __builtin_prefetch(p, 0, 2); }

// The rows16 GEMV's weight prefetch, into L1 (prefetchnta): its weights are
// one linear stream per thread, which L1 prefetches keep up with. The
// default model's 120 layer GEMVs from DRAM, 2 threads, a standalone copy
// of the kernel: 23-24 GB/s with prefetcht1, 28-29 with prefetchnta or
// prefetcht0; 8192 x 4096 matrices 24 -> 28.5 GB/s; one thread 12 -> 15.
inline void prefetch_stream(const void* p) { __builtin_prefetch(p, 0, 0); }

void run_portable(const Args& a);
#if defined(MLXFAST_X86)
void run_avx2(const Args& a);
void run_avx512(const Args& a);
#endif

// The int8-activation matmul (a.int8_acts): the portable kernel takes every
// bit width and layout; the SIMD kernels take the row-interleaved layout
// (a.rows16: bits 4 and 8), every M: qmm_int8_rows16_avx2.cpp (AVX2: also
// what a CPU without VNNI runs on the AVX-512 path) and
// qmm_int8_rows16_avx512vnni.cpp (AVX-512 VNNI, only where
// cpu_has_avx512_vnni(), common/cpu_features.h); the same bits.
void run_int8_portable(const Args& a);
#if defined(MLXFAST_X86)
void run_int8_rows16_avx2(const Args& a);
void run_int8_rows16_avx512vnni(const Args& a);
// Rows [m0, m1) of a.x quantized into xp as both rows16 kernels read them.
void prepare_int8_rows16_avx2(const Args& a, float* xp, int64_t m0, int64_t m1);
#endif
#if defined(MLXFAST_ARM64)
void run_neon(const Args& a);
#endif

// The GEMV path in pieces, for callers that fan out over several matrices
// themselves (the MoE experts, csrc/ops/moe.cpp): gemv_prepare_<isa> turns
// a.x's M rows into the layout its blocks read (xp: gemv_prep_floats(a)
// floats, on the calling thread); gemv_block_<isa> then writes out rows
// [0, M), columns [n0, n1) of a.out ([M][N] in a.x_dtype), n1 - n0 <=
// kGemvBlockRows, on the calling thread (no fan-out). run_<isa>'s GEMV is
// these two pieces, so the numbers are the same. Each ISA takes the bits its
// GEMV specializes (AVX2 / AVX-512: 0, 4, 8; NEON: 4, 8) and any M; the
// portable path takes every width and dense weights.
constexpr int64_t kGemvBlockRows = 16;

// The floats gemv_prepare_* writes (a multiple of 16: consecutive buffers
// stay 64-byte aligned when the first is). Int8 activations: the x86 rows16
// kernels' layout (qmm_int8_rows16.h's Prep: rows in groups of 12, int8
// rows, then d, d * sum(xq) and sum(xq) per 32-value block), which the
// portable one ([M][K] int8, then d and d * sum(xq)) also fits in.
inline size_t gemv_prep_floats(const Args& a) {
  auto up = [](int64_t v, int64_t m) { return (v + m - 1) / m * m; };
  if (a.rows16 && !a.int8_acts) {
    return static_cast<size_t>(up(a.M * a.K + a.M * (a.K / a.group_size) + 16, 16));
  }
  if (!a.int8_acts) return static_cast<size_t>(up((a.M + 1) * a.K, 16));
  const int64_t Mg = up(a.M, 12);
  return static_cast<size_t>(up(up(Mg * a.K, 64) / 4 + 3 * Mg * (a.K / kActBlock), 16));
}

void gemv_prepare_portable(const Args& a, float* xp);
void gemv_block_portable(const Args& a, const float* xp, int64_t n0, int64_t n1);
// The int8-activation GEMV in the same two pieces (a.int8_acts; portable:
// bits 2..8, either layout).
void gemv_prepare_int8_portable(const Args& a, float* xp);
void gemv_block_int8_portable(const Args& a, const float* xp, int64_t n0, int64_t n1);
#if defined(MLXFAST_X86)
// a.rows16 (whole 16-row blocks, n0 and n1 multiples of 16): the rows16
// kernels' pieces (one prepare for both; the VNNI block only where
// cpu_has_avx512_vnni()), the MoE experts' GEMV.
void gemv_prepare_int8_rows16_avx2(const Args& a, float* xp);
void gemv_block_int8_rows16_avx2(const Args& a, const float* xp, int64_t n0, int64_t n1);
void gemv_block_int8_rows16_avx512vnni(const Args& a, const float* xp, int64_t n0, int64_t n1);
#endif
#if defined(MLXFAST_X86)
void gemv_prepare_avx2(const Args& a, float* xp);
void gemv_block_avx2(const Args& a, const float* xp, int64_t n0, int64_t n1);
void gemv_prepare_avx512(const Args& a, float* xp);
void gemv_block_avx512(const Args& a, const float* xp, int64_t n0, int64_t n1);
#endif
#if defined(MLXFAST_ARM64)
void gemv_prepare_neon(const Args& a, float* xp);
void gemv_block_neon(const Args& a, const float* xp, int64_t n0, int64_t n1);
#endif

namespace {

inline float load_f32(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case F32: return static_cast<const float*>(p)[i];
    case F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

inline void store_f32(void* p, DType dt, int64_t i, float v) {
  switch (dt) {
    case F32: static_cast<float*>(p)[i] = v; break;
    case F16: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); break;
    default: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
  }
}

// The i-th value of a packed row (bits <= 8, LSB-first bit stream).
inline uint32_t unpack_value(const uint8_t* row, int64_t i, int bits) {
  int64_t bit = i * bits;
  int64_t byte = bit >> 3;
  int sh = static_cast<int>(bit & 7);
  uint32_t v = row[byte] >> sh;
  if (sh + bits > 8) v |= static_cast<uint32_t>(row[byte + 1]) << (8 - sh);
  return v & ((1u << bits) - 1u);
}

// Dense weight rows n0 .. n0+NR-1, k in [kb, ke), as fp32 bp[k - kb][NR]
// (rows >= N are 0): the GEMM panel for bits == 0. tmp holds NR * (ke - kb)
// floats. O(N K) per call against the micro-kernel's O(M N K).
template <int NR>
inline void dense_panel(const Args& a, int64_t n0, int64_t kb, int64_t ke, float* bp,
                        float* tmp) {
  const int64_t kc = ke - kb;
  const int64_t ncols = a.N - n0 < NR ? a.N - n0 : NR;
  for (int64_t j = 0; j < ncols; ++j) {
    const int64_t off = (n0 + j) * a.K + kb;
    float* t = tmp + j * kc;
    switch (a.w_dtype) {
      case F32: std::memcpy(t, static_cast<const float*>(a.w) + off, sizeof(float) * kc); break;
      case F16: {
        const uint16_t* p = static_cast<const uint16_t*>(a.w) + off;
        for (int64_t k = 0; k < kc; ++k) t[k] = f16_to_f32(p[k]);
        break;
      }
      default: {
        const uint16_t* p = static_cast<const uint16_t*>(a.w) + off;
        for (int64_t k = 0; k < kc; ++k) t[k] = bf16_to_f32(p[k]);
        break;
      }
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    float* dst = bp + k * NR;
    for (int64_t j = 0; j < ncols; ++j) dst[j] = tmp[j * kc + k];
    for (int64_t j = ncols; j < NR; ++j) dst[j] = 0.0f;
  }
}

// Quantizes n <= kActBlock values of src (fp32) to int8 dst (the rest of
// the block zero-filled), the one definition every int8 path uses; returns
// d and sets *isum = sum(dst). Scalar: it runs once per block of each
// activation row, O(M K) against the matmul's O(M N K).
inline float quantize_block(const float* src, int64_t n, int8_t* dst, int32_t* isum) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(src[i]));
  int32_t s = 0;
  if (amax > 0.0f) {
    const float id = 127.0f / amax;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(src[i] * id));
      dst[i] = static_cast<int8_t>(v);
      s += v;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = 0;
  }
  for (int64_t i = n; i < kActBlock; ++i) dst[i] = 0;
  *isum = s;
  return amax / 127.0f;
}

// bi[i] = the symmetric bias of scale sc[i] (biases == nullptr).
inline void sym_biases(const float* sc, int64_t n, int bits, float* bi) {
  const float h = sym_bias(bits);
  for (int64_t i = 0; i < n; ++i) bi[i] = h * sc[i];
}

// Prefetch `bytes` from byte offset `off` of p, a cache line at a time.
inline void prefetch_bytes(const void* p, int64_t off, int64_t bytes) {
  const char* c = static_cast<const char*>(p) + off;
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

// The GEMV converts a row block's scales and biases before its rows; those
// are streams apart from the weights, so the next block's are prefetched, a
// line at a time from inside the current block's tiles (step() every few
// groups) rather than in one burst at the block's start. The burst filled
// the load queue; its prefetches and the conversion's misses were ~14% of a
// Llama-1B-shaped Q4_0 decode's samples (the conversion alone ~28% while
// that model's Q4_0 kept biases), and pacing them made that decode ~3% faster (medians of 12
// alternating rounds; the default model's decode did not change).
struct ParamPrefetch {
  const char* s = nullptr;    // next scale line
  const char* b = nullptr;    // next bias line (nullptr: symmetric)
  const char* end = nullptr;  // past the block's scales
  void step() {
    if (s >= end) return;
    __builtin_prefetch(s);
    s += 64;
    if (b) {
      __builtin_prefetch(b);
      b += 64;
    }
  }
};

// The parameters of weight rows [n1, n1 + rows) (none past N or for dense).
inline ParamPrefetch next_params(const Args& a, int64_t n1, int64_t rows, int64_t G) {
  ParamPrefetch p;
  if (a.bits == 0 || n1 >= a.N) return p;
  const int64_t nn = a.N - n1 < rows ? a.N - n1 : rows;
  const int64_t es = dtype_size(a.s_dtype);
  p.s = static_cast<const char*>(a.scales) + n1 * G * es;
  p.end = p.s + nn * G * es;
  if (a.biases) p.b = static_cast<const char*>(a.biases) + n1 * G * es;
  return p;
}

constexpr size_t kKeepScratchFloats = size_t(16) << 20;  // 64 MiB

template <class F>
inline void par(int64_t n, int64_t grain, F& f) {
  parallel_for(n, grain,
               [](void* c, int64_t b, int64_t e) { (*static_cast<F*>(c))(b, e); }, &f);
}

inline int64_t ceil_div(int64_t a, int64_t b);

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

} // namespace
} // namespace qmm
} // namespace mlxfast
