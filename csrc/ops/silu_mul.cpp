#include "ops/silu_mul.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include "common/cpu_eval.h"
#include "common/cpu_features.h"
#include "common/dense_input.h"
#include "common/op_checks.h"
#include "common/thread_pool.h"
#include "cpu/silu_mul.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace mlxfast {

namespace {

// Each activation's names: the op (error messages) and the matmuls' act=.
struct ActInfo {
  GatedAct act;
  const char* op;
  const char* halves;
};
constexpr ActInfo kActs[] = {
    {GatedAct::Silu, "silu_mul", "silu_mul_halves"},
    {GatedAct::GeluTanh, "gelu_mul", "gelu_mul_halves"},
};

const ActInfo& info(GatedAct act) { return kActs[static_cast<int>(act)]; }

void check_dtype(const char* op, mx::Dtype dt) {
  if (!is_float(dt)) fail(op, "dtype must be float32, float16 or bfloat16.");
}

mx::array gated_mul(GatedAct act, const mx::array& gate, const mx::array& up,
                    mx::StreamOrDevice s) {
  const char* op = info(act).op;
  if (gate.shape() != up.shape()) {
    std::ostringstream msg;
    msg << "gate and up must have the same shape, got " << gate.shape() << " and "
        << up.shape() << ".";
    fail(op, msg.str());
  }
  if (gate.dtype() != up.dtype()) fail(op, "gate and up must have the same dtype.");
  check_dtype(op, gate.dtype());
  auto stream = mx::to_stream(s);
  return mx::array(gate.shape(), gate.dtype(), std::make_shared<GatedMul>(stream, act, false),
                   {gate, up});
}

mx::array gated_mul_halves(GatedAct act, const mx::array& gate_up, mx::StreamOrDevice s) {
  const char* op = info(act).op;
  if (gate_up.ndim() < 1 || gate_up.shape(-1) % 2) fail(op, "gate_up's last axis must be even.");
  check_dtype(op, gate_up.dtype());
  auto shape = gate_up.shape();
  shape.back() /= 2;
  auto stream = mx::to_stream(s);
  return mx::array(shape, gate_up.dtype(), std::make_shared<GatedMul>(stream, act, true),
                   {gate_up});
}

} // namespace

mx::array silu_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  return gated_mul(GatedAct::Silu, gate, up, s);
}

mx::array silu_mul_halves(const mx::array& gate_up, mx::StreamOrDevice s) {
  return gated_mul_halves(GatedAct::Silu, gate_up, s);
}

mx::array gelu_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  return gated_mul(GatedAct::GeluTanh, gate, up, s);
}

mx::array gelu_mul_halves(const mx::array& gate_up, mx::StreamOrDevice s) {
  return gated_mul_halves(GatedAct::GeluTanh, gate_up, s);
}

std::optional<GatedAct> gated_act_from_halves_name(const std::string& name) {
  for (const auto& a : kActs) {
    if (name == a.halves) return a.act;
  }
  return std::nullopt;
}

std::string gated_act_halves_names() {
  std::string out;
  for (const auto& a : kActs) {
    if (!out.empty()) out += ", ";
    out += std::string("'") + a.halves + "'";
  }
  return out;
}

namespace {

int act_dtype(mx::Dtype dt) { return dt == mx::float32 ? 0 : (dt == mx::float16 ? 1 : 2); }

act::Kind act_kind(GatedAct act) {
  return act == GatedAct::GeluTanh ? act::GeluTanh : act::Silu;
}

// Rows [0, rows) of args over the pool: pieces of ~16K elements, one piece
// per pool thread when small.
void run_rows(const act::Args& args, int64_t rows, CpuPath path) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(args.m, 1));
  parallel_for(rows, grain, [&](int64_t r0, int64_t r1) {
    switch (path) {
#if defined(MLXFAST_X86)
      case CpuPath::Avx512: act::gated_mul_rows_avx512(args, r0, r1); break;
      case CpuPath::Avx2: act::gated_mul_rows_avx2(args, r0, r1); break;
#endif
      default: act::gated_mul_rows_portable(args, r0, r1); break;  // NEON too
    }
  });
}

} // namespace

void gated_mul_halves_rows(GatedAct act, const void* gate_up, void* out, int64_t rows,
                           int64_t m, mx::Dtype dt, CpuPath path) {
  act::Args args;
  args.m = m;
  args.stride = 2 * m;
  args.out = out;
  args.dtype = act_dtype(dt);
  args.kind = act_kind(act);
  args.g = gate_up;
  args.u = static_cast<const char*>(gate_up) + m * (dt == mx::float32 ? 4 : 2);
  run_rows(args, rows, path);
}

void GatedMul::eval_cpu(const std::vector<mx::array>& inputs,
                        std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  auto& enc = begin_eval(stream(), inputs, outputs);
  const int64_t m = out.ndim() ? out.shape(-1) : 1;
  const int64_t rows = m ? out.size() / m : 0;
  const int64_t stride = halves_ ? 2 * m : m;
  const int64_t up_offset = halves_ ? m : 0;
  auto dt = out.dtype();
  DenseInput gin = dense_input(inputs[0], enc);
  DenseInput uin = halves_ ? gin : dense_input(inputs[1], enc);
  const bool halves = halves_;
  act::Args args;
  args.m = m;
  args.stride = stride;
  args.out = out.data<void>();
  args.dtype = act_dtype(dt);
  args.kind = act_kind(act_);
  const int64_t esize = dt == mx::float32 ? 4 : 2;
  const CpuPath path = cpu_path();
  enc.dispatch([=]() mutable {
    gin.pack();
    if (!halves) uin.pack();
    args.g = gin.data;
    args.u = static_cast<const char*>(uin.data) + up_offset * esize;
    run_rows(args, rows, path);
  });
}

void GatedMul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(std::string("[mlxfast.") + info(act_).op +
                           "] no GPU kernel; mlxfast.ops uses the MLX reference on GPU.");
}

} // namespace mlxfast
