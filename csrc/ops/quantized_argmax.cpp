#include "ops/quantized_argmax.h"

#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "common/cpu_eval.h"
#include "common/cpu_features.h"
#include "common/dense_input.h"
#include "common/op_checks.h"
#include "common/scratch.h"
#include "common/parallel.h"
#include "common/thread_pool.h"
#include "cpu/argmax_screen.h"
#include "cpu/qmm.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "ops/quantized_matmul.h"
#include "ops/rms_norm.h"

namespace mlxfast {

namespace {

const char* kOp = "quantized_argmax";
static_assert(argmax_screen::kMaxRows == qmm::kRows16InvariantMaxRows,
              "the screen takes the calls whose rows the fp32 kernel computes alike");

thread_local Scratch tl_normed, tl_logits, tl_small, tl_gathered, tl_xf;

// MLX's argmax of one row: the first NaN, else the first maximum.
uint32_t mlx_argmax(const float* v, int64_t n) {
  uint32_t idx = 0;
  float best = v[0];
  if (std::isnan(best)) return 0;
  for (int64_t j = 1; j < n; ++j) {
    if (std::isnan(v[j])) return static_cast<uint32_t>(j);
    if (v[j] > best) {
      best = v[j];
      idx = static_cast<uint32_t>(j);
    }
  }
  return idx;
}

using GemvPrepare = void (*)(const qmm::Args&, float*);
using GemvBlock = void (*)(const qmm::Args&, const float*, int64_t, int64_t);

// The rows16 fp32 GEMV in pieces (csrc/cpu/qmm.h): the arithmetic the whole
// head runs at up to kRows16InvariantMaxRows rows, one 16-row block at a time.
void gemv_pieces(CpuPath path, GemvPrepare& prepare, GemvBlock& block) {
#if defined(MLXFAST_X86)
  if (path == CpuPath::Avx512) {
    prepare = qmm::gemv_prepare_avx512;
    block = qmm::gemv_block_avx512;
    return;
  }
  prepare = qmm::gemv_prepare_avx2;
  block = qmm::gemv_block_avx2;
#else
  (void)path;
  throw std::logic_error("[mlxfast.quantized_argmax] no rows16 kernels on this CPU");
#endif
}

void screen_bound(CpuPath path, const argmax_screen::Screen& s, int64_t b0, int64_t b1,
                  float* lo) {
#if defined(MLXFAST_X86)
  if (path == CpuPath::Avx512) return argmax_screen::bound_avx512(s, b0, b1, lo);
  return argmax_screen::bound_avx2(s, b0, b1, lo);
#else
  (void)path, (void)s, (void)b0, (void)b1, (void)lo;
  throw std::logic_error("[mlxfast.quantized_argmax] no screening kernel on this CPU");
#endif
}

// The fp32 head for the rows listed in `rows`, in one call as the full head
// computes them (up to kRows16InvariantMaxRows rows a row's result does not
// depend on the call; above, every row of the call is listed), and MLX's
// argmax of each.
void argmax_full(const qmm::Args& a, const int64_t* rows, int64_t count, uint32_t* out,
                 CpuPath path) {
  const int64_t K = a.K, N = a.N, es = qmm::dtype_size(a.x_dtype);
  const char* x = static_cast<const char*>(a.x);
  char* xs = reinterpret_cast<char*>(tl_gathered.get(static_cast<size_t>(count * K)));
  for (int64_t i = 0; i < count; ++i) std::memcpy(xs + i * K * es, x + rows[i] * K * es, K * es);
  float* y = tl_logits.get(static_cast<size_t>(count * N + N));
  float* row = y + count * N;  // a row of y as floats
  qmm::Args f = a;
  f.x = xs;
  f.M = count;
  f.out = y;
  f.int8_acts = false;
  run_qmm(f, path);
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t j = 0; j < N; ++j) row[j] = qmm::load_f32(y, a.x_dtype, i * N + j);
    out[rows[i]] = mlx_argmax(row, N);
  }
}

// Row m's argmax over the 16-row blocks its upper bounds (hi, [N / 16])
// reach thr with, computed in fp32 one block at a time; false where a
// logit is not finite (the caller then takes the whole head).
bool argmax_screened(const qmm::Args& a, int64_t m, const float* hi, float thr, CpuPath path,
                     uint32_t* out) {
  static thread_local Scratch tl_xp, tl_row;
  GemvPrepare prepare;
  GemvBlock block;
  gemv_pieces(path, prepare, block);
  qmm::Args r = a;
  r.M = 1;
  r.x = static_cast<const char*>(a.x) + m * a.K * qmm::dtype_size(a.x_dtype);
  void* y = tl_row.get(static_cast<size_t>(a.N));
  r.out = y;
  float* xp = tl_xp.get(qmm::gemv_prep_floats(r));
  prepare(r, xp);
  float best = -INFINITY;
  int64_t idx = -1;
  for (int64_t blk = 0; blk < a.N / 16; ++blk) {
    if (!(hi[blk] >= thr)) continue;
    block(r, xp, blk * 16, blk * 16 + 16);
    for (int64_t n = blk * 16; n < blk * 16 + 16; ++n) {
      const float v = qmm::load_f32(y, a.x_dtype, n);  // as rounded to the head's dtype
      if (!std::isfinite(v)) return false;
      if (idx < 0 || v > best) {  // in order: the first maximum wins
        best = v;
        idx = n;
      }
    }
  }
  if (idx < 0) return false;
  *out = static_cast<uint32_t>(idx);
  return true;
}

// The primitive's work on the encoder's thread; a.x is the (normed) x in
// a.x_dtype, the head's logits' dtype.
void argmax_task(const qmm::Args& a, const uint16_t* bounds, uint32_t* out, CpuPath path) {
  const int64_t M = a.M, N = a.N, K = a.K, NB = N / 16, nb = K / qmm::kActBlock;
  std::vector<int64_t> full;
  if (M > argmax_screen::kMaxRows) {  // the fp32 kernel's arithmetic depends on the call here
    for (int64_t m = 0; m < M; ++m) full.push_back(m);
    argmax_full(a, full.data(), M, out, path);
    tl_logits.trim(qmm::kKeepScratchFloats);
    tl_gathered.trim(qmm::kKeepScratchFloats);
    return;
  }
  // 1. The int8 logits, and each row's activation scales.
  float* y = tl_logits.get(static_cast<size_t>(M * N));
  const int64_t P = num_threads();
  float* d = tl_small.get(static_cast<size_t>(M * nb + M * NB + P * M));
  float* hi = d + M * nb;
  float* lo_part = hi + M * NB;  // per thread's share of the blocks, per row
  // In float32 (exactly x's values): the int8 logits unrounded.
  const float* x = static_cast<const float*>(a.x);
  if (a.x_dtype != qmm::F32) {
    float* xf = tl_xf.get(static_cast<size_t>(M * K));
    for (int64_t i = 0; i < M * K; ++i) xf[i] = qmm::load_f32(a.x, a.x_dtype, i);
    x = xf;
  }
  qmm::Args i8 = a;
  i8.x = x;
  i8.x_dtype = qmm::F32;
  i8.int8_acts = true;
  i8.out = y;
  run_qmm(i8, path);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0.0f;  // as qmm's quantize_block
      for (int64_t i = 0; i < qmm::kActBlock; ++i) {
        amax = std::fmax(amax, std::fabs(x[m * K + b * qmm::kActBlock + i]));
      }
      d[m * nb + b] = amax / 127.0f;
    }
  }
  // 2. Each row's bounds: per block the best upper one, per row the best
  // lower one (its threshold).
  const argmax_screen::Screen sc{y, bounds, d, hi, M, N, nb};
  parallel_for(P, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      screen_bound(path, sc, NB * t / P, NB * (t + 1) / P, lo_part + t * M);
    }
  });
  // 3. Per row, the blocks that reach its threshold in fp32. Logits rounded
  // to a half type tie with the best where they round to its value: within
  // its ulp (< 2^-7 or 2^-10 of it, at least 2^-24 near 0) below it.
  const float rel = a.x_dtype == qmm::BF16 ? 0x1p-6f : a.x_dtype == qmm::F16 ? 0x1p-9f : 0.0f;
  const float abs_ulp = a.x_dtype == qmm::F32 ? 0.0f : 0x1p-23f;
  std::vector<char> ok(M, 0);
  parallel_for(M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float thr = -INFINITY, best_hi = -INFINITY;
      bool finite = true;
      for (int64_t p = 0; p < P; ++p) thr = std::fmax(thr, lo_part[p * M + m]);
      for (int64_t blk = 0; blk < NB; ++blk) {
        finite &= !std::isnan(hi[m * NB + blk]);
        best_hi = std::fmax(best_hi, hi[m * NB + blk]);
      }
      thr -= rel * std::fmax(std::fabs(thr), std::fabs(best_hi)) + abs_ulp;
      ok[m] = finite && std::isfinite(thr) && argmax_screened(a, m, hi + m * NB, thr, path, out + m);
    }
  });
  for (int64_t m = 0; m < M; ++m) {
    if (!ok[m]) full.push_back(m);
  }
  if (!full.empty()) argmax_full(a, full.data(), static_cast<int64_t>(full.size()), out, path);
  tl_logits.trim(qmm::kKeepScratchFloats);
  tl_gathered.trim(qmm::kKeepScratchFloats);
}

qmm::DType to_qmm(mx::Dtype dt) {
  return dt == mx::float32 ? qmm::F32 : dt == mx::float16 ? qmm::F16 : qmm::BF16;
}

bool rows16_int8_path(CpuPath path) {
  return path == CpuPath::Avx2 || path == CpuPath::Avx512;
}

} // namespace

mx::array quantized_argmax(const mx::array& x_in, const mx::array& w, const mx::array& scales,
                           const std::optional<mx::array>& biases, const mx::array& bounds,
                           int group_size, int bits, const std::optional<mx::array>& norm_weight,
                           float eps, mx::StreamOrDevice s) {
  if (!rows16_int8_path(cpu_path())) {
    fail(kOp, std::string("needs the avx2 or avx512 CPU path, this one is ") +
                  cpu_path_name(cpu_path()) + ".");
  }
  if (!is_float(x_in.dtype()) || x_in.ndim() < 1) {
    fail(kOp, "x must be float32, float16 or bfloat16 [..., K].");
  }
  auto stream = mx::to_stream(s);
  // With a norm, x in the dtype the norm gives (the head's logits' dtype), as quantized_matmul.
  const mx::array x = norm_weight ? rms_norm_input(kOp, "norm ", x_in, *norm_weight, eps, stream) : x_in;
  if (bits != 4 && bits != 8) fail(kOp, "bits must be 4 or 8, got " + std::to_string(bits) + ".");
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    fail(kOp, "group_size must be 32, 64 or 128, got " + std::to_string(group_size) + ".");
  }
  const int64_t K = x.shape(-1);
  if (w.dtype() != mx::uint32 || w.ndim() != 3 || w.shape(2) != 16 ||
      static_cast<int64_t>(w.shape(1)) * 32 != K * bits) {
    std::ostringstream m;
    m << "w must be row-interleaved [N / 16, K * bits / 32, 16] uint32 for x " << x.shape()
      << ", got " << w.shape() << " " << w.dtype() << ".";
    fail(kOp, m.str());
  }
  const mx::Shape sshape{w.shape(0), static_cast<int>(K / group_size), 16};
  if (K % group_size || !is_float(scales.dtype()) || scales.shape() != sshape ||
      (biases && (biases->dtype() != scales.dtype() || biases->shape() != sshape))) {
    fail(kOp, "scales (and biases) must be float [N / 16, K / group_size, 16], one dtype.");
  }
  if (bounds.dtype() != mx::float16 ||
      bounds.shape() != mx::Shape{w.shape(0), static_cast<int>(K / 32), 16}) {
    fail(kOp, "bounds must be float16 [N / 16, K / 32, 16] (ops.argmax_bounds).");
  }
  std::vector<mx::array> inputs = {x, w, scales, biases ? *biases : scales, bounds};
  if (norm_weight) inputs.push_back(*norm_weight);
  mx::Shape out_shape(x.shape().begin(), x.shape().end() - 1);
  return mx::array(std::move(out_shape), mx::uint32,
                   std::make_shared<QuantizedArgmax>(stream, group_size, bits, !biases.has_value(),
                                                     norm_weight.has_value(), eps),
                   std::move(inputs));
}

std::vector<mx::Shape> QuantizedArgmax::output_shapes(const std::vector<mx::array>& inputs) {
  const auto& xs = inputs[0].shape();
  return {mx::Shape(xs.begin(), xs.end() - 1)};
}

void QuantizedArgmax::eval_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  auto& x = inputs[0];
  auto& out = outputs[0];
  auto& enc = begin_eval(stream(), inputs, outputs);
  qmm::Args a;
  a.x = nullptr;  // set in the task (packed, normed)
  a.w = inputs[1].data<uint32_t>();
  a.scales = inputs[2].data<void>();
  a.biases = symmetric_ ? nullptr : inputs[3].data<void>();
  a.out = nullptr;
  a.rows16 = true;
  a.N = 16 * static_cast<int64_t>(inputs[1].shape(0));
  a.K = x.shape(-1);
  a.M = static_cast<int64_t>(out.size());
  a.group_size = group_size_;
  a.bits = bits_;
  a.x_dtype = to_qmm(x.dtype());
  a.s_dtype = to_qmm(inputs[2].dtype());
  if (a.M == 0) return;
  const uint16_t* bounds = inputs[4].data<uint16_t>();
  uint32_t* o = out.data<uint32_t>();
  const DenseInput xin = dense_input(x, enc);
  const DenseInput nin = norm_ ? dense_input(inputs[5], enc) : DenseInput{};
  const bool norm = norm_;
  const float eps = eps_;
  const CpuPath path = cpu_path();
  const mx::Dtype xt = x.dtype(), nt = norm_ ? inputs[5].dtype() : mx::float32;
  enc.dispatch([a, xin, nin, norm, eps, bounds, o, path, xt, nt]() mutable {
    xin.pack();
    nin.pack();
    a.x = xin.data;
    if (norm) {  // the norm's own kernel, as quantized_matmul's prologue
      void* buf = tl_normed.get(static_cast<size_t>(a.M * a.K));
      rms_norm_rows(xt, xin.data, nt, nin.data, buf, a.M, a.K, eps);
      a.x = buf;
    }
    argmax_task(a, bounds, o, path);
  });
}

void QuantizedArgmax::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[mlxfast.quantized_argmax] no GPU kernel; mlxfast.ops uses the MLX reference on GPU.");
}

} // namespace mlxfast
