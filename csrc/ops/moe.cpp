#include "ops/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "common/cpu_eval.h"
#include "common/cpu_features.h"
#include "common/dense_input.h"
#include "common/op_checks.h"
#include "common/scratch.h"
#include "common/thread_pool.h"
#include "cpu/qmm.h"
#include "cpu/silu_mul.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "ops/quantized_matmul.h"
#include "ops/rms_norm.h"

namespace mlxfast {

namespace {

qmm::DType to_qmm(mx::Dtype dt) {
  if (dt == mx::float32) return qmm::F32;
  if (dt == mx::float16) return qmm::F16;
  return qmm::BF16;
}

// Evaluated, dense weights are used as they are; anything else gets a
// Contiguous node (weights are normally loaded arrays: none then).
mx::array dense_weight(const mx::array& a, mx::Stream stream) {
  return (a.is_available() && a.flags().row_contiguous) ? a : mx::contiguous(a, false, stream);
}

// ------------------------------------------------------------------ route

// The k largest of v[0..E) (ties: the lower index first), in descending order.
void top_k(const float* v, int64_t E, int k, int32_t* ids) {
  int n = 0;
  for (int64_t e = 0; e < E; ++e) {
    const float x = v[e];
    if (n == k && !(x > v[ids[k - 1]])) continue;  // NaN never enters a full list
    int j = n < k ? n++ : k - 1;
    while (j > 0 && x > v[ids[j - 1]]) {
      ids[j] = ids[j - 1];
      --j;
    }
    ids[j] = static_cast<int32_t>(e);
  }
}

// --------------------------------------------------------------- experts

constexpr int64_t kLightRows = qmm::kGemvMaxRows;  // more tokens: the whole GEMM
// Int8 activations: 7, where the VNNI kernel over MLX's layout (removed in
// session 35) took its GEMM. The rows16 int8 kernels run one tile at every
// size, so for them it only chooses the fan-out (not re-measured).
constexpr int64_t kInt8LightRows = 7;
constexpr int64_t kInlineFloats = 1 << 16;  // smaller elementwise passes: no fan-out

struct Proj {  // one projection of every expert
  const uint8_t* w = nullptr;
  const uint8_t* scales = nullptr;
  const uint8_t* biases = nullptr;
  int64_t out = 0, in = 0;
  int64_t w_expert_bytes = 0, s_expert_bytes = 0;
};

struct Plan {
  Proj gate, up, down;
  int64_t T = 0, k = 0, E = 0, D = 0, I = 0;
  int group_size = 0, bits = 0;
  qmm::DType s_dtype = qmm::F32, w_dtype = qmm::F32;
  mx::Dtype x_dtype = mx::float32, norm_dtype = mx::float32, scores_dtype = mx::float32;
  bool inds_signed = true;
  bool int8_acts = false;  // the projections' activations quantized to int8 (qmm::Args)
  bool rows16 = false;     // 4-D weights: each expert in the row-interleaved layout (qmm::Args)
  float eps = 0.f;
  DenseInput x, inds, scores, norm, residual;
  bool has_norm = false, has_residual = false;
  void* out = nullptr;
  CpuPath path = CpuPath::Portable;
};

// qmm::Args for rows `off` .. `off + m` of a sorted buffer against expert e's
// projection p; x (fp32, [m][p.in]) and out (fp32, [m][p.out]).
qmm::Args expert_args(const Plan& P, const Proj& p, int64_t e, const float* x, float* out,
                      int64_t m) {
  qmm::Args a;
  a.x = x;
  a.w = p.w + e * p.w_expert_bytes;
  a.scales = p.scales ? p.scales + e * p.s_expert_bytes : nullptr;
  a.biases = p.biases ? p.biases + e * p.s_expert_bytes : nullptr;
  a.out = out;
  a.M = m;
  a.N = p.out;
  a.K = p.in;
  a.group_size = P.bits ? P.group_size : 0;
  a.bits = P.bits;
  a.x_dtype = qmm::F32;
  a.s_dtype = P.s_dtype;
  a.w_dtype = P.w_dtype;
  a.int8_acts = P.int8_acts;
  a.rows16 = P.rows16;
  return a;
}

struct GemvFns {
  void (*prepare)(const qmm::Args&, float*);
  void (*block)(const qmm::Args&, const float*, int64_t, int64_t);
};

// The GEMV pieces of the path's quantized matmul for these bits (int8
// activations: as quantized_matmul picks its int8 kernel).
GemvFns gemv_fns(CpuPath path, int bits, bool int8_acts, bool rows16) {
  if (rows16) {  // as quantized_matmul runs the layout
#if defined(MLXFAST_X86)
    if (int8_acts && int8_vnni_on(path)) {
      return {qmm::gemv_prepare_int8_rows16_avx2, qmm::gemv_block_int8_rows16_avx512vnni};
    }
    if (int8_acts && (path == CpuPath::Avx2 || path == CpuPath::Avx512)) {
      return {qmm::gemv_prepare_int8_rows16_avx2, qmm::gemv_block_int8_rows16_avx2};
    }
    if (path == CpuPath::Avx512) return {qmm::gemv_prepare_avx512, qmm::gemv_block_avx512};
    if (path == CpuPath::Avx2) return {qmm::gemv_prepare_avx2, qmm::gemv_block_avx2};
#endif
    if (int8_acts) return {qmm::gemv_prepare_int8_portable, qmm::gemv_block_int8_portable};
    return {qmm::gemv_prepare_portable, qmm::gemv_block_portable};
  }
  if (int8_acts) return {qmm::gemv_prepare_int8_portable, qmm::gemv_block_int8_portable};
  switch (path) {
#if defined(MLXFAST_X86)
    case CpuPath::Avx512:
      if (bits == 0 || bits == 4 || bits == 8) return {qmm::gemv_prepare_avx512, qmm::gemv_block_avx512};
      break;
    case CpuPath::Avx2:
      if (bits == 0 || bits == 4 || bits == 8) return {qmm::gemv_prepare_avx2, qmm::gemv_block_avx2};
      break;
#endif
#if defined(MLXFAST_ARM64)
    case CpuPath::Neon:
      if (bits == 4 || bits == 8) return {qmm::gemv_prepare_neon, qmm::gemv_block_neon};
      break;
#endif
    default: break;
  }
  return {qmm::gemv_prepare_portable, qmm::gemv_block_portable};
}

void silu_mul_rows(const act::Args& a, int64_t r0, int64_t r1, CpuPath path) {
  switch (path) {
#if defined(MLXFAST_X86)
    case CpuPath::Avx512: act::gated_mul_rows_avx512(a, r0, r1); break;
    case CpuPath::Avx2: act::gated_mul_rows_avx2(a, r0, r1); break;
#endif
    default: act::gated_mul_rows_portable(a, r0, r1); break;
  }
}

// h[r][j] = silu(g[r][j]) * u[r][j] for `rows` rows of `m` values at row
// stride `stride` (fp32, on the calling thread).
void silu_mul_block(const float* g, const float* u, float* h, int64_t rows, int64_t m,
                    int64_t stride, CpuPath path) {
  act::Args a;
  a.m = m;
  a.stride = stride;
  a.dtype = 0;
  a.kind = act::Silu;
  for (int64_t r = 0; r < rows; ++r) {
    a.g = g + r * stride;
    a.u = u + r * stride;
    a.out = h + r * stride;
    silu_mul_rows(a, 0, 1, path);
  }
}

// f(u) for u in [0, units): par_dynamic's contiguous runs of pieces, a
// thread's run covering whole experts where it can.
template <class F>
void par_units(int64_t units, F&& f) {
  par_dynamic(units, std::max<int64_t>(1, units / (8 * num_threads())), [&f](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) f(u);
  });
}

thread_local Scratch tl_buf;   // the step's fp32 buffers (see run_experts)
thread_local Scratch tl_norm;  // normalised x rows (x's dtype)
thread_local Scratch tl_sum;   // a token's weighted sum over its choices

void store_out(mx::Dtype dt, void* out, int64_t i, float v) {
  qmm::store_f32(out, to_qmm(dt), i, v);
}

void run_experts(Plan P) {
  P.x.pack();
  P.inds.pack();
  P.scores.pack();
  P.norm.pack();
  P.residual.pack();
  const int64_t T = P.T, k = P.k, E = P.E, D = P.D, I = P.I, R = T * k;
  const qmm::DType xq = to_qmm(P.x_dtype), sq = to_qmm(P.scores_dtype);

  // Group the (token, choice) rows by expert, each expert's in token order.
  std::vector<int64_t> count(E + 1, 0), start(E + 1, 0);
  std::vector<int64_t> expert_of(R);
  const uint32_t* ids = static_cast<const uint32_t*>(P.inds.data);
  for (int64_t r = 0; r < R; ++r) {
    const uint32_t id = ids[r];
    const int64_t e = id < static_cast<uint64_t>(E) ? static_cast<int64_t>(id) : E;  // E: dropped
    expert_of[r] = e;
    ++count[e];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + count[e];
  const int64_t rows = start[E];  // routed rows
  std::vector<int64_t> pos(R, -1), token_of(rows > 0 ? rows : 1);
  {
    std::vector<int64_t> fill(start.begin(), start.end());
    for (int64_t r = 0; r < R; ++r) {
      const int64_t e = expert_of[r];
      if (e == E) continue;
      pos[r] = fill[e];
      token_of[fill[e]++] = r / k;
    }
  }
  std::vector<int64_t> light, heavy;
  const int64_t light_rows = P.int8_acts ? kInt8LightRows : kLightRows;
  for (int64_t e = 0; e < E; ++e) {
    if (count[e] == 0) continue;
    (count[e] <= light_rows ? light : heavy).push_back(e);
  }
  // Per light expert, the offsets of its prepared activations (gemv layout,
  // multiples of 16 floats: each expert's stays 64-byte aligned).
  std::vector<int64_t> xp_off(light.size() + 1, 0), hp_off(light.size() + 1, 0);
  for (size_t i = 0; i < light.size(); ++i) {
    const int64_t n = count[light[i]];
    xp_off[i + 1] = xp_off[i] + static_cast<int64_t>(qmm::gemv_prep_floats(expert_args(P, P.gate, 0, nullptr, nullptr, n)));
    hp_off[i + 1] = hp_off[i] + static_cast<int64_t>(qmm::gemv_prep_floats(expert_args(P, P.down, 0, nullptr, nullptr, n)));
  }

  // fp32 buffers: Xs [rows][D] (sorted x rows), XP, G, U, H [rows][I], HP, Y [rows][D].
  const int64_t n_xs = rows * D, n_xp = xp_off.back(), n_i = rows * I, n_hp = hp_off.back();
  const auto up16 = [](int64_t n) { return (n + 15) / 16 * 16; };
  float* buf = tl_buf.get(static_cast<size_t>(up16(n_xs) + n_xp + 3 * up16(n_i) + n_hp + rows * D + 16));
  // Each buffer starts 64-byte aligned (the GEMV layouts are read so).
  float* Xs = buf;
  float* XP = Xs + up16(n_xs);
  float* G = XP + n_xp;
  float* U = G + up16(n_i);
  float* H = U + up16(n_i);
  float* HP = H + up16(n_i);
  float* Y = HP + n_hp;

  // x (normalised first when fused) gathered in expert order, as fp32.
  const void* xsrc = P.x.data;
  if (P.has_norm) {
    const size_t bytes = static_cast<size_t>(T * D * qmm::dtype_size(xq));
    void* nb = tl_norm.get((bytes + sizeof(float) - 1) / sizeof(float));
    rms_norm_rows(P.x_dtype, P.x.data, P.norm_dtype, P.norm.data, nb, T, D, P.eps);
    xsrc = nb;
  }
  // Small pieces of work run on the calling thread: a fan-out costs more than
  // they do, and a pool thread descheduled by another process would hold the
  // step up (a decode step's gathers and GEMV layouts are a few thousand values).
  const int64_t grain = std::max<int64_t>(1, kInlineFloats / std::max<int64_t>(D, 1));
  parallel_for(rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = token_of[r];
      float* dst = Xs + r * D;
      if (xq == qmm::F32) {
        std::memcpy(dst, static_cast<const float*>(xsrc) + t * D, sizeof(float) * D);
      } else {
        for (int64_t d = 0; d < D; ++d) dst[d] = qmm::load_f32(xsrc, xq, t * D + d);
      }
    }
  });

  const GemvFns fns = gemv_fns(P.path, P.bits, P.int8_acts, P.rows16);
  const int64_t nL = static_cast<int64_t>(light.size());
  // Light experts' activations in the GEMV layout (per expert; few rows).
  auto prepare = [&](const Proj& p, const float* src, float* dst, const std::vector<int64_t>& off) {
    const int64_t in = p.in;
    auto one = [&](int64_t i) {
      const int64_t e = light[i];
      fns.prepare(expert_args(P, p, e, src + start[e] * in, nullptr, count[e]), dst + off[i]);
    };
    if (off[nL] <= kInlineFloats) {
      for (int64_t i = 0; i < nL; ++i) one(i);
    } else {
      par_units(nL, one);
    }
  };

  // gate and up, then silu(gate) * up into H.
  prepare(P.gate, Xs, XP, xp_off);
  for (int64_t e : heavy) {
    const int64_t o = start[e], n = count[e];
    run_qmm(expert_args(P, P.gate, e, Xs + o * D, G + o * I, n), P.path);
    run_qmm(expert_args(P, P.up, e, Xs + o * D, U + o * I, n), P.path);
    parallel_for(n, std::max<int64_t>(1, kInlineFloats / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
      silu_mul_block(G + (o + r0) * I, U + (o + r0) * I, H + (o + r0) * I, r1 - r0, I, I, P.path);
    });
  }
  const int64_t bI = (I + qmm::kGemvBlockRows - 1) / qmm::kGemvBlockRows;
  par_units(nL * bI, [&](int64_t u) {
    const int64_t i = u / bI, e = light[i], o = start[e], n = count[e];
    const int64_t n0 = (u % bI) * qmm::kGemvBlockRows, n1 = std::min(I, n0 + qmm::kGemvBlockRows);
    fns.block(expert_args(P, P.gate, e, nullptr, G + o * I, n), XP + xp_off[i], n0, n1);
    fns.block(expert_args(P, P.up, e, nullptr, U + o * I, n), XP + xp_off[i], n0, n1);
    silu_mul_block(G + o * I + n0, U + o * I + n0, H + o * I + n0, n, n1 - n0, I, P.path);
  });

  // down into Y.
  prepare(P.down, H, HP, hp_off);
  for (int64_t e : heavy) {
    const int64_t o = start[e];
    run_qmm(expert_args(P, P.down, e, H + o * I, Y + o * D, count[e]), P.path);
  }
  const int64_t bD = (D + qmm::kGemvBlockRows - 1) / qmm::kGemvBlockRows;
  par_units(nL * bD, [&](int64_t u) {
    const int64_t i = u / bD, e = light[i], o = start[e];
    const int64_t n0 = (u % bD) * qmm::kGemvBlockRows, n1 = std::min(D, n0 + qmm::kGemvBlockRows);
    fns.block(expert_args(P, P.down, e, nullptr, Y + o * D, count[e]), HP + hp_off[i], n0, n1);
  });

  // out[t] = (residual[t] +) sum_j scores[t, j] * Y[pos[t, j]], j in order.
  const mx::Dtype odt = P.x_dtype;
  const qmm::DType oq = to_qmm(odt);
  parallel_for(T, std::max<int64_t>(1, kInlineFloats / std::max<int64_t>(k * D, 1)), [&](int64_t t0, int64_t t1) {
    float* sum = tl_sum.get(static_cast<size_t>(D));
    for (int64_t t = t0; t < t1; ++t) {
      // Choice by choice over the row (each sum still adds its terms in j
      // order): the scores' loads leave the inner loop, which vectorizes.
      std::fill(sum, sum + D, 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t p = pos[t * k + j];
        if (p < 0) continue;
        const float s = qmm::load_f32(P.scores.data, sq, t * k + j);
        const float* y = Y + p * D;
        for (int64_t d = 0; d < D; ++d) sum[d] += s * y[d];
      }
      for (int64_t d = 0; d < D; ++d) {
        store_out(odt, P.out, t * D + d, sum[d]);
        if (P.has_residual) {
          // As MLX's add: the rounded product plus the residual, rounded once.
          const float y = qmm::load_f32(P.out, oq, t * D + d);
          store_out(odt, P.out, t * D + d, qmm::load_f32(P.residual.data, oq, t * D + d) + y);
        }
      }
    }
  });
  tl_buf.trim(qmm::kKeepScratchFloats);
  tl_norm.trim(qmm::kKeepScratchFloats);
}

void check_proj(const char* op, const char* name, const ExpertWeights& p, int64_t E,
                int64_t out, int64_t in, int group_size, int bits, bool rows16, mx::Dtype& sdt,
                bool first) {
  std::ostringstream msg;
  if (bits > 0) {
    if (!p.scales) {
      msg << name << ": quantized weights need scales (and biases, unless symmetric).";
      fail(op, msg.str());
    }
    if (p.w.dtype() != mx::uint32) {
      msg << name << ": quantized weights must be uint32.";
      fail(op, msg.str());
    }
    const int e = static_cast<int>(E), wc = static_cast<int>(in * bits / 32),
              g = static_cast<int>(in / group_size);
    const mx::Shape ws = rows16 ? mx::Shape{e, static_cast<int>(out / 16), wc, 16}
                                : mx::Shape{e, static_cast<int>(out), wc};
    const mx::Shape ss = rows16 ? mx::Shape{e, static_cast<int>(out / 16), g, 16}
                                : mx::Shape{e, static_cast<int>(out), g};
    if (rows16 && out % 16) {
      msg << name << ": the row-interleaved layout needs rows in multiples of 16, got " << out << ".";
      fail(op, msg.str());
    }
    if (p.w.shape() != ws || p.scales->shape() != ss || (p.biases && p.biases->shape() != ss)) {
      msg << name << ": expected w " << ws << " and scales/biases " << ss << " for " << E
          << " experts, out " << out << ", in " << in << ", bits " << bits << ", group_size "
          << group_size << "; got " << p.w.shape() << ", " << p.scales->shape()
          << (p.biases ? ", " : "") << (p.biases ? p.biases->shape() : mx::Shape{}) << ".";
      fail(op, msg.str());
    }
    if (!is_float(p.scales->dtype()) || (p.biases && p.biases->dtype() != p.scales->dtype())) {
      msg << name << ": scales and biases must share one float dtype.";
      fail(op, msg.str());
    }
    if (!first && p.scales->dtype() != sdt) fail(op, "every projection's scales must share one dtype.");
    sdt = p.scales->dtype();
  } else {
    if (p.scales || p.biases) {
      msg << name << ": dense weights (bits 0) take no scales or biases.";
      fail(op, msg.str());
    }
    const mx::Shape ws = {static_cast<int>(E), static_cast<int>(out), static_cast<int>(in)};
    if (!is_float(p.w.dtype()) || p.w.shape() != ws) {
      msg << name << ": expected float weights " << ws << ", got " << p.w.shape() << " "
          << p.w.dtype() << ".";
      fail(op, msg.str());
    }
    if (!first && p.w.dtype() != sdt) fail(op, "every projection's dense weights must share one dtype.");
    sdt = p.w.dtype();
  }
}

Proj make_proj(const mx::array& w, const mx::array* sc, const mx::array* bi, int bits,
               int group_size) {
  Proj p;
  p.w = static_cast<const uint8_t*>(w.data<void>());
  const int64_t E = w.shape(0);
  p.out = static_cast<int64_t>(w.shape(1)) * (w.ndim() == 4 ? 16 : 1);  // 4-D: row-interleaved
  p.in = bits > 0 ? static_cast<int64_t>(w.shape(2)) * 32 / bits : w.shape(2);
  p.w_expert_bytes = E > 0 ? static_cast<int64_t>(w.nbytes()) / E : 0;
  if (sc) {
    p.scales = static_cast<const uint8_t*>(sc->data<void>());
    p.biases = bi ? static_cast<const uint8_t*>(bi->data<void>()) : nullptr;
    p.s_expert_bytes = E > 0 ? static_cast<int64_t>(sc->nbytes()) / E : 0;
  }
  (void)group_size;
  return p;
}

} // namespace

// ------------------------------------------------------------------- route

std::vector<mx::array> moe_route(const mx::array& logits, int k, bool softmax_first,
                                 bool normalize, mx::StreamOrDevice s) {
  const char* op = "moe_route";
  if (!is_float(logits.dtype())) fail(op, "logits must be float32, float16 or bfloat16.");
  if (logits.ndim() < 1) fail(op, "logits must have at least one dimension [..., E].");
  const int64_t E = logits.shape(-1);
  if (k < 1 || k > E) {
    fail(op, "k must be in [1, " + std::to_string(E) + "], got " + std::to_string(k) + ".");
  }
  auto shape = logits.shape();
  shape.back() = k;
  auto stream = mx::to_stream(s);
  return mx::array::make_arrays({shape, shape}, {mx::uint32, logits.dtype()},
                                std::make_shared<MoeRoute>(stream, k, softmax_first, normalize),
                                {logits});
}

std::vector<mx::Shape> MoeRoute::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = k_;
  return {shape, shape};
}

void MoeRoute::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& inds = outputs[0];
  auto& scores = outputs[1];
  auto& enc = begin_eval(stream(), inputs, outputs);
  const DenseInput lin = dense_input(inputs[0], enc);
  const int64_t E = inputs[0].shape(-1);
  const int64_t rows = E > 0 ? static_cast<int64_t>(inputs[0].size()) / E : 0;
  const int k = k_;
  const bool sf = softmax_first_, norm = normalize_;
  const qmm::DType lt = to_qmm(inputs[0].dtype());
  uint32_t* ip = inds.data<uint32_t>();
  void* sp = scores.data<void>();
  enc.dispatch([lin, E, rows, k, sf, norm, lt, ip, sp]() {
    lin.pack();
    parallel_for(rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(E, 1)), [&](int64_t r0, int64_t r1) {
      std::vector<float> v(E);
      std::vector<int32_t> top(k);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t e = 0; e < E; ++e) v[e] = qmm::load_f32(lin.data, lt, r * E + e);
        top_k(v.data(), E, k, top.data());
        float w[256];
        float* wk = k <= 256 ? w : nullptr;
        std::vector<float> big;
        if (!wk) {
          big.resize(k);
          wk = big.data();
        }
        const float mx_ = v[top[0]];
        if (sf) {  // softmax over all experts, then the top k (renormalised)
          float sum = 0.f;
          for (int64_t e = 0; e < E; ++e) sum += std::exp(v[e] - mx_);
          float ksum = 0.f;
          for (int j = 0; j < k; ++j) ksum += (wk[j] = std::exp(v[top[j]] - mx_) / sum);
          if (norm) for (int j = 0; j < k; ++j) wk[j] /= ksum;
        } else {  // the top k logits, then their softmax
          float sum = 0.f;
          for (int j = 0; j < k; ++j) sum += (wk[j] = std::exp(v[top[j]] - mx_));
          for (int j = 0; j < k; ++j) wk[j] /= sum;
        }
        for (int j = 0; j < k; ++j) {
          ip[r * k + j] = static_cast<uint32_t>(top[j]);
          qmm::store_f32(sp, lt, r * k + j, wk[j]);
        }
      }
    });
  });
}

void MoeRoute::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxfast.moe_route] no GPU kernel; mlxfast.ops uses the MLX reference on GPU.");
}

// ----------------------------------------------------------------- experts

mx::array moe_experts(const mx::array& x_in, const mx::array& inds, const mx::array& scores,
                      const ExpertWeights& gate, const ExpertWeights& up,
                      const ExpertWeights& down, int group_size, int bits,
                      const std::optional<mx::array>& norm_weight, float eps,
                      const std::optional<mx::array>& residual, bool int8_acts,
                      mx::StreamOrDevice s) {
  const char* op = "moe_experts";
  if (bits != 0 && bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    fail(op, "bits must be 0 (dense weights) or one of 2, 3, 4, 5, 6, 8, got " +
                 std::to_string(bits) + ".");
  }
  if (int8_acts && bits == 0) fail(op, "int8 activations need quantized weights (bits > 0).");
  if (bits > 0 && group_size != 32 && group_size != 64 && group_size != 128) {
    fail(op, "group_size must be 32, 64 or 128, got " + std::to_string(group_size) + ".");
  }
  if (!is_float(x_in.dtype()) || x_in.ndim() < 1) fail(op, "x must be a float array [..., D].");
  if (inds.dtype() != mx::int32 && inds.dtype() != mx::uint32) {
    fail(op, "inds must be int32 or uint32 expert ids.");
  }
  if (!is_float(scores.dtype())) fail(op, "scores must be float32, float16 or bfloat16.");
  std::ostringstream msg;
  if (inds.ndim() != x_in.ndim() || scores.shape() != inds.shape() ||
      !std::equal(x_in.shape().begin(), x_in.shape().end() - 1, inds.shape().begin())) {
    msg << "inds and scores must be [..., k] with x's leading axes; got x " << x_in.shape()
        << ", inds " << inds.shape() << ", scores " << scores.shape() << ".";
    fail(op, msg.str());
  }
  // 4-D: every expert in the row-interleaved layout (ops.pack_rows16; 4- or 8-bit).
  const bool rows16 = gate.w.ndim() == 4;
  if (rows16) {
    if (up.w.ndim() != 4 || down.w.ndim() != 4) {
      fail(op, "the three projections must share a layout (all 3-D, or all 4-D row-interleaved).");
    }
    if (bits != 4 && bits != 8) fail(op, "row-interleaved (4-D) expert weights are 4- or 8-bit.");
  } else if (gate.w.ndim() != 3 || up.w.ndim() != 3 || down.w.ndim() != 3) {
    fail(op, "expert weights must be 3-D [E, out, in] (stacked), or 4-D row-interleaved.");
  }
  const int64_t D = x_in.shape(-1), E = gate.w.shape(0),
                I = static_cast<int64_t>(gate.w.shape(1)) * (rows16 ? 16 : 1);
  if (bits > 0 && (D % group_size || I % group_size)) {
    msg << "the hidden size " << D << " and the expert size " << I
        << " must be multiples of group_size " << group_size << ".";
    fail(op, msg.str());
  }
  mx::Dtype wdt = mx::float32;
  check_proj(op, "gate", gate, E, I, D, group_size, bits, rows16, wdt, true);
  check_proj(op, "up", up, E, I, D, group_size, bits, rows16, wdt, false);
  check_proj(op, "down", down, E, D, I, group_size, bits, rows16, wdt, false);

  auto stream = mx::to_stream(s);
  mx::array x = x_in;
  if (norm_weight) x = rms_norm_input(op, "norm ", x, *norm_weight, eps, stream);
  if (residual && (residual->shape() != x.shape() || residual->dtype() != x.dtype())) {
    msg << "residual must have the output's shape " << x.shape() << " and dtype " << x.dtype()
        << ", got " << residual->shape() << " " << residual->dtype() << ".";
    fail(op, msg.str());
  }
  std::vector<mx::array> inputs = {x, inds, scores};
  int sym = 0, bit = 1;
  for (const ExpertWeights* p : {&gate, &up, &down}) {
    inputs.push_back(dense_weight(p->w, stream));
    if (bits > 0) {
      inputs.push_back(dense_weight(*p->scales, stream));
      if (p->biases) {
        inputs.push_back(dense_weight(*p->biases, stream));
      } else {
        sym |= bit;
      }
    }
    bit <<= 1;
  }
  if (norm_weight) inputs.push_back(*norm_weight);
  if (residual) inputs.push_back(*residual);
  return mx::array(x.shape(), x.dtype(),
                   std::make_shared<MoeExperts>(stream, group_size, bits, sym,
                                                norm_weight.has_value(), eps, residual.has_value(),
                                                int8_acts),
                   std::move(inputs));
}

void MoeExperts::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  auto& enc = begin_eval(stream(), inputs, outputs);

  const bool q = bits_ > 0;
  size_t i = 3;
  const mx::array* w[3];
  const mx::array* sc[3] = {nullptr, nullptr, nullptr};
  const mx::array* bi[3] = {nullptr, nullptr, nullptr};
  for (int p = 0; p < 3; ++p) {
    w[p] = &inputs[i++];
    if (q) {
      sc[p] = &inputs[i++];
      if (!(sym_ & (1 << p))) bi[p] = &inputs[i++];
    }
  }
  const mx::array* nw = norm_ ? &inputs[i++] : nullptr;
  const mx::array* res = residual_ ? &inputs[i++] : nullptr;

  Plan P;
  const auto& x = inputs[0];
  P.D = x.shape(-1);
  P.T = P.D > 0 ? static_cast<int64_t>(x.size()) / P.D : 0;
  P.k = inputs[1].shape(-1);
  P.E = w[0]->shape(0);
  P.rows16 = w[0]->ndim() == 4;
  P.I = static_cast<int64_t>(w[0]->shape(1)) * (P.rows16 ? 16 : 1);
  P.group_size = group_size_;
  P.bits = bits_;
  P.gate = make_proj(*w[0], sc[0], bi[0], bits_, group_size_);
  P.up = make_proj(*w[1], sc[1], bi[1], bits_, group_size_);
  P.down = make_proj(*w[2], sc[2], bi[2], bits_, group_size_);
  P.s_dtype = q ? to_qmm(sc[0]->dtype()) : qmm::F32;
  P.w_dtype = q ? qmm::F32 : to_qmm(w[0]->dtype());
  P.x_dtype = x.dtype();
  P.scores_dtype = inputs[2].dtype();
  P.eps = eps_;
  P.int8_acts = int8_acts_;
  P.out = out.data<void>();
  if (P.T == 0 || P.D == 0) return;
  P.x = dense_input(x, enc);
  P.inds = dense_input(inputs[1], enc);
  P.scores = dense_input(inputs[2], enc);
  if (nw) {
    P.has_norm = true;
    P.norm = dense_input(*nw, enc);
    P.norm_dtype = nw->dtype();
  }
  if (res) {
    P.has_residual = true;
    P.residual = dense_input(*res, enc);
  }
  P.path = cpu_path();
  if (P.k == 0 || P.I == 0 || P.E == 0) {
    // Nothing routed: the output is the residual (or 0).
    std::memset(P.out, 0, out.nbytes());
    if (res) {
      DenseInput r = P.residual;
      void* o = P.out;
      size_t n = out.nbytes();
      enc.dispatch([r, o, n]() {
        r.pack();
        std::memcpy(o, r.data, n);
      });
    }
    return;
  }
  enc.dispatch([P]() { run_experts(P); });
}

void MoeExperts::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[mlxfast.moe_experts] no GPU kernel; mlxfast.ops uses the MLX reference on GPU.");
}

} // namespace mlxfast
