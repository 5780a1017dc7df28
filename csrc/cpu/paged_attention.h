// Private interface of the paged-attention CPU kernels (csrc/cpu/paged_attention_*.cpp).
//
// For each query token t (sequence seq_idx[t], position pos[t]) and each query
// head h: softmax(scale * q[t,h] . K[j]) . V[j] over keys j = 0..pos[t] of its
// sequence (with a sliding window W > 0: pos[t] - W < j <= pos[t]), where key j
// lives in slot tables[seq][j / bs] * bs + j % bs of the pools
// ([num_slots, Hkv, D]). GQA: head h reads kv head h / (Hq / Hkv).
// Window: a tile reads blocks from (min over its queries of key_lo) / bs on;
// table entries of earlier blocks are never read (they may hold anything).
// float32 accumulation, online softmax one block at a time. Work items are
// (token, kv head): the G query heads that share a kv head read each K/V row
// once.
//
// ODR: compiled with different ISA flags per file, so everything defined here
// lives in an anonymous namespace, and no std:: containers are used.
#pragma once

#include "common/half.h"
#include "common/parallel.h"

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
  int window;           // 0: full causal; W > 0: keys pos - W < j <= pos
  float scale;
  DType q_dtype, kv_dtype;
};

void run_portable(const Args& a);
#if defined(MLXFAST_X86)
void run_avx2(const Args& a);
void run_avx512(const Args& a);
#endif

namespace {

inline float h2f(uint16_t h) { return f16_to_f32(h); }
inline uint16_t f2h(float f) { return f32_to_f16(f); }
inline float b2f(uint16_t b) { return bf16_to_f32(b); }
inline uint16_t f2b(float f) { return f32_to_bf16(f); }

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

// First key a query at position p attends: 0 without a window, else
// max(0, p - window + 1). (Its last key is min(p, B * bs - 1).)
inline int64_t key_lo(int window, int64_t p) {
  if (window <= 0) return 0;
  const int64_t lo = p - window + 1;
  return lo > 0 ? lo : 0;
}

// The key ranges of tokens t0 .. t0+nq-1 of a tile: token j attends keys
// qlo[j] .. qpos[j] (its position, clamped to the table). Returns the tile's
// key count (the largest qpos + 1) and its earliest first key.
struct TileKeys {
  int64_t n_keys, lo_min;
};
inline TileKeys tile_keys(const Args& a, int64_t t0, int nq, int64_t* qpos, int64_t* qlo) {
  TileKeys k{0, INT64_MAX};
  for (int j = 0; j < nq; ++j) {
    int64_t p = static_cast<int64_t>(a.pos[t0 + j]);
    qlo[j] = key_lo(a.window, p);
    k.lo_min = qlo[j] < k.lo_min ? qlo[j] : k.lo_min;
    if (p > a.B * a.bs - 1) p = a.B * a.bs - 1;
    qpos[j] = p;
    if (p + 1 > k.n_keys) k.n_keys = p + 1;
  }
  return k;
}

// out[t0 + r / G][kh * G + r % G] = acc[r] / l[r] for the tile's rows r
// (a row that saw no key gets zeros), in the output dtype.
inline void write_rows(const Args& a, int64_t t0, int kh, int rows, const float* acc,
                       const float* l) {
  const int G = a.Hq / a.Hkv, Dv = a.Dv;
  for (int r = 0; r < rows; ++r) {
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    const float* ag = acc + static_cast<size_t>(r) * Dv;
    const int64_t o = ((t0 + r / G) * a.Hq + kh * G + r % G) * Dv;
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

// Query tile: consecutive tokens of one sequence processed together, so
// each K/V row is read once per tile instead of once per token.
constexpr int kTile = 16;

inline void prefetch_rows(const char* base, int64_t first_row_bytes_off, int rows,
                          int64_t row_stride, int row_bytes) {
  for (int r = 0; r < rows; ++r)
    for (int o = 0; o < row_bytes; o += 64)
      __builtin_prefetch(base + first_row_bytes_off + r * row_stride + o);
}

// Loads one byte of every 64-byte line of the rows, in address order: a
// prefetch that is a real load (it waits for a free miss buffer instead of
// being dropped, and the out-of-order core overlaps the misses).
inline void touch_rows(const char* base, int64_t first_row_bytes_off, int rows,
                       int64_t row_stride, int row_bytes) {
  unsigned sum = 0;
  for (int r = 0; r < rows; ++r)
    for (int o = 0; o < row_bytes; o += 64)
      sum += static_cast<unsigned char>(base[first_row_bytes_off + r * row_stride + o]);
  __asm__ volatile("" ::"r"(sum));  // the loads are the point: keep them
}

// Tiles: runs of up to kTile consecutive tokens with the same sequence, as
// token offsets tiles[0 .. n] (tiles has room for T + 1); returns n.
inline int64_t make_tiles(const Args& a, int64_t* tiles) {
  int64_t nt = 0;
  for (int64_t t = 0; t < a.T; ++t) {
    if (t == 0 || a.seq_idx[t] != a.seq_idx[t - 1] || t - tiles[nt - 1] >= kTile) tiles[nt++] = t;
  }
  tiles[nt] = a.T;
  return nt;
}

// Position i of a run over n tiles, alternating light and heavy tiles (later
// tiles of a sequence see more keys), so that contiguous ranges balance.
inline int64_t interleaved_tile(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

template <int W>
struct Kernel {
  struct Ctx {
    const Args* a;
    const int64_t* tiles;  // [n_tiles + 1] token offsets
    int64_t n_tiles;
  };

  static void run_range(void* vctx, int64_t begin, int64_t end) {
    const Ctx& c = *static_cast<const Ctx*>(vctx);
    const Args& a = *c.a;
    const int G = a.Hq / a.Hkv, D = a.D, Dv = a.Dv, bs = a.bs;
    const int R = kTile * G;  // query rows per item
    const size_t qes = elem_size(a.q_dtype), kes = elem_size(a.kv_dtype);
    size_t n = static_cast<size_t>(R) * (D + Dv + bs + 2) + D + Dv + 64;
    float* scratch = static_cast<float*>(std::malloc(n * sizeof(float)));
    float* qf = scratch;
    float* acc = qf + static_cast<size_t>(R) * D;
    float* sc = acc + static_cast<size_t>(R) * Dv;
    float* m = sc + static_cast<size_t>(R) * bs;
    float* l = m + R;
    float* kbuf = l + R;
    float* vbuf = kbuf + D;
    int64_t qpos[kTile], qlo[kTile];
    const int64_t krow = static_cast<int64_t>(a.Hkv) * D * kes;   // bytes between K rows
    const int64_t vrow = static_cast<int64_t>(a.Hkv) * Dv * kes;
    const int64_t NT = c.n_tiles;
    for (int64_t it = begin; it < end; ++it) {
      // Alternate light and heavy tiles across the range (later tiles see more keys).
      const int64_t ti = interleaved_tile(it / a.Hkv, NT);
      const int kh = static_cast<int>(it % a.Hkv);
      const int64_t t0 = c.tiles[ti], t1 = c.tiles[ti + 1];
      const int nq = static_cast<int>(t1 - t0);
      const int32_t s = a.seq_idx[t0];
      const bool valid = s >= 0 && s < a.S;
      const auto [n_keys, lo_min] = tile_keys(a, t0, nq, qpos, qlo);
      const int rows = nq * G;
      for (int j = 0; j < nq; ++j)
        for (int g = 0; g < G; ++g) {
          const int r = j * G + g, h = kh * G + g;
          const char* qp = static_cast<const char*>(a.q) + (((t0 + j) * a.Hq + h) * D) * qes;
          float* dst = qf + static_cast<size_t>(r) * D;
          const float* qr = load_row(qp, a.q_dtype, D, dst);
          for (int d = 0; d < D; ++d) dst[d] = qr[d] * a.scale;
          m[r] = -INFINITY;
          l[r] = 0.f;
        }
      std::memset(acc, 0, sizeof(float) * rows * Dv);
      if (valid && n_keys > 0) {
        const int32_t* table = a.tables + static_cast<int64_t>(s) * a.B;
        const int64_t nblk = (n_keys + bs - 1) / bs;
        const char* kbase = static_cast<const char*>(a.k) + static_cast<int64_t>(kh) * D * kes;
        const char* vbase = static_cast<const char*>(a.v) + static_cast<int64_t>(kh) * Dv * kes;
        for (int64_t b = lo_min / bs; b < nblk; ++b) {  // blocks before every window: unread
          const int64_t blk = table[b];
          if (blk < 0 || (blk + 1) * bs > a.num_slots) continue;
          if (b + 1 < nblk) {
            const int64_t nxt = table[b + 1];
            if (nxt >= 0 && (nxt + 1) * bs <= a.num_slots) {
              prefetch_rows(kbase, nxt * bs * krow, bs, krow, static_cast<int>(D * kes));
              prefetch_rows(vbase, nxt * bs * vrow, bs, vrow, static_cast<int>(Dv * kes));
            }
          }
          const int64_t key0 = b * bs;
          const int nk = static_cast<int>(n_keys - key0 < bs ? n_keys - key0 : bs);
          for (int i = 0; i < nk; ++i) {
            const float* kr = load_row(kbase + (blk * bs + i) * krow, a.kv_dtype, D, kbuf);
            for (int j = 0; j < nq; ++j) {
              const bool ok = (key0 + i <= qpos[j]) & (key0 + i >= qlo[j]);
              for (int g = 0; g < G; ++g) {
                const int r = j * G + g;
                sc[r * bs + i] = ok ? dot<W>(qf + static_cast<size_t>(r) * D, kr, D) : -INFINITY;
              }
            }
          }
          for (int r = 0; r < rows; ++r) {
            float* sg = sc + r * bs;
            float mb = -INFINITY;
            for (int i = 0; i < nk; ++i) mb = sg[i] > mb ? sg[i] : mb;
            if (mb == -INFINITY) {  // every key of this block is outside this query's range
              for (int i = 0; i < nk; ++i) sg[i] = 0.f;
              continue;
            }
            const float mn = m[r] > mb ? m[r] : mb;
            if (m[r] != mn) {
              const float alpha = std::exp(m[r] - mn);
              l[r] *= alpha;
              scal(acc + static_cast<size_t>(r) * Dv, alpha, Dv);
              m[r] = mn;
            }
            float sum = 0.f;
            for (int i = 0; i < nk; ++i) {
              const float e = std::exp(sg[i] - mn);
              sg[i] = e;
              sum += e;
            }
            l[r] += sum;
          }
          for (int i = 0; i < nk; ++i) {
            const float* vr = load_row(vbase + (blk * bs + i) * vrow, a.kv_dtype, Dv, vbuf);
            for (int r = 0; r < rows; ++r) {
              const float p = sc[r * bs + i];
              if (p != 0.f) axpy(acc + static_cast<size_t>(r) * Dv, p, vr, Dv);
            }
          }
        }
      }
      write_rows(a, t0, kh, rows, acc, l);
    }
    std::free(scratch);
  }

  static void run(const Args& a) {
    int64_t* tiles = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * (a.T + 1)));
    const int64_t nt = make_tiles(a, tiles);
    Ctx c{&a, tiles, nt};
    parallel_for(nt * a.Hkv, 1, &Kernel::run_range, &c);
    std::free(tiles);
  }
};

}  // namespace
}  // namespace pa
}  // namespace mlxfast
