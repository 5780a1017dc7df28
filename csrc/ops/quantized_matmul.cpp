#include "ops/quantized_matmul.h"

#include <cstring>
#include <optional>
#include <vector>
#include <sstream>
#include <stdexcept>

#include "common/op_checks.h"
#include "common/cpu_features.h"
#include "common/dense_input.h"
#include "common/scratch.h"
#include "common/thread_pool.h"
#include "cpu/qmm.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "ops/rms_norm.h"

namespace mlxfast {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[mlxfast.quantized_matmul] " + what);
}

qmm::DType to_qmm(mx::Dtype dt) {
  if (dt == mx::float32) return qmm::F32;
  if (dt == mx::float16) return qmm::F16;
  return qmm::BF16;
}


// The prologue's result (x's dtype), on the thread that runs the task: the
// matmul kernel reads it while this thread takes part in its fan-out.
thread_local Scratch tl_prologue;

// out[i] = r[i] + out[i] in T: for half types MLX's own operator+ (float32
// sum, one rounding), i.e. what mx.add computes on the CPU.
template <typename T>
void add_residual_as(const void* r, void* out, int64_t n) {
  const T* rp = static_cast<const T*>(r);
  T* op = static_cast<T*>(out);
  parallel_for(n, 16384, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) op[i] = rp[i] + op[i];
  });
}

void add_residual(mx::Dtype dt, const void* r, void* out, int64_t n) {
  switch (dt) {
    case mx::float32: add_residual_as<float>(r, out, n); break;
    case mx::float16: add_residual_as<mx::float16_t>(r, out, n); break;
    default: add_residual_as<mx::bfloat16_t>(r, out, n); break;
  }
}

// Runs `a` (all set but a.x) on the encoder's thread with the path chosen
// now (at eval time): x packed if strided, the prologue on its rows into
// scratch (a.x then points there), the matmul, then the residual added to
// the output in place.
void run_dispatched(qmm::Args a, const FusedSpec& spec, const mx::array& x,
                    const mx::array* norm_w, const mx::array* residual,
                    mx::cpu::CommandEncoder& enc) {
  const CpuPath path = cpu_path();
  const DenseInput xin = dense_input(x, enc);
  const DenseInput nin = norm_w ? dense_input(*norm_w, enc) : DenseInput{};
  const DenseInput rin = residual ? dense_input(*residual, enc) : DenseInput{};
  const mx::Dtype xt = x.dtype();
  const mx::Dtype nt = norm_w ? norm_w->dtype() : mx::float32;
  const auto prologue = spec.prologue;
  const GatedAct act = spec.act;
  const float eps = spec.eps;
  const bool has_residual = residual != nullptr;
  enc.dispatch([a, path, xin, nin, rin, xt, nt, prologue, act, eps, has_residual]() mutable {
    xin.pack();
    nin.pack();
    rin.pack();
    const int64_t esize = qmm::dtype_size(a.x_dtype);
    if (a.K == 0) {
      std::memset(a.out, 0, static_cast<size_t>(a.M * a.N * esize));
    } else {
      a.x = xin.data;
      if (prologue != FusedSpec::None) {
        const size_t bytes = static_cast<size_t>(a.M * a.K * esize);
        void* buf = tl_prologue.get((bytes + sizeof(float) - 1) / sizeof(float));
        if (prologue == FusedSpec::Norm) {
          rms_norm_rows(xt, xin.data, nt, nin.data, buf, a.M, a.K, eps);
        } else {
          gated_mul_halves_rows(act, xin.data, buf, a.M, a.K, xt, path);
        }
        a.x = buf;
      }
      run_qmm(a, path);
      tl_prologue.trim(qmm::kKeepScratchFloats);
    }
    if (has_residual) add_residual(xt, rin.data, a.out, a.M * a.N);
  });
}

// The primitive's optional inputs after its weights (see the op functions).
void fused_inputs(const FusedSpec& spec, const std::vector<mx::array>& inputs, size_t first,
                  const mx::array*& norm_w, const mx::array*& residual) {
  size_t i = first;
  norm_w = spec.prologue == FusedSpec::Norm ? &inputs[i++] : nullptr;
  residual = spec.residual ? &inputs[i++] : nullptr;
}

// Validates f for a matmul of x; casts x as the norm's rms_norm would and
// returns the spec, the K the matmul sees, and the primitive's extra inputs
// ([norm_weight]; the residual is checked once the output is known).
struct Prepared {
  mx::array x;
  FusedSpec spec;
  int64_t K;
  std::vector<mx::array> extra;
};

Prepared prepare(const char* op, const mx::array& x, const Fusion& f, mx::Stream stream) {
  Prepared p{x, {}, x.ndim() ? x.shape(-1) : 0, {}};
  const std::optional<GatedAct> act = gated_act_from_halves_name(f.act);
  if (!f.act.empty() && !act) {
    mlxfast::fail(op, "act must be one of " + gated_act_halves_names() + " (or none), got '" +
                          f.act + "'.");
  }
  if (f.norm_weight && !f.act.empty()) mlxfast::fail(op, "norm and act cannot both be given.");
  if (f.norm_weight) {
    p.x = rms_norm_input(op, "norm ", x, *f.norm_weight, f.eps, stream);
    p.spec.prologue = FusedSpec::Norm;
    p.spec.eps = f.eps;
    p.extra.push_back(*f.norm_weight);
  } else if (act) {
    if (x.ndim() < 1 || x.shape(-1) % 2) {
      std::ostringstream msg;
      msg << "act='" << f.act << "' needs an even last axis of x (gate and up halves), got x "
          << x.shape() << ".";
      mlxfast::fail(op, msg.str());
    }
    p.spec.prologue = FusedSpec::ActHalves;
    p.spec.act = *act;
    p.K = x.shape(-1) / 2;
  }
  return p;
}

void check_residual(const char* op, const Fusion& f, const mx::Shape& out_shape,
                    mx::Dtype out_dtype, Prepared& p) {
  if (!f.residual) return;
  const auto& r = *f.residual;
  if (r.shape() != out_shape || r.dtype() != out_dtype) {
    std::ostringstream msg;
    msg << "residual must have the output's shape " << out_shape << " and dtype " << out_dtype
        << ", got " << r.shape() << " " << r.dtype() << ".";
    mlxfast::fail(op, msg.str());
  }
  p.spec.residual = true;
  p.extra.push_back(r);
}

// Weights are usually loaded (evaluated) and dense: no extra graph node
// then. x is usually lazy; a strided x is packed inside eval_cpu instead of
// adding a Contiguous node to every call (~5 us each on this CPU).
mx::array dense_weight(const mx::array& a, mx::Stream stream) {
  return (a.is_available() && a.flags().row_contiguous) ? a : mx::contiguous(a, false, stream);
}

} // namespace

void run_qmm(const qmm::Args& a, CpuPath path) {
  if (a.rows16) {  // the row-interleaved layout: the x86 paths' kernels, else the portable ones
#if defined(MLXFAST_X86)
    if (a.int8_acts && int8_vnni_on(path)) return qmm::run_int8_rows16_avx512vnni(a);
    if (a.int8_acts && (path == CpuPath::Avx2 || path == CpuPath::Avx512)) {
      return qmm::run_int8_rows16_avx2(a);
    }
    if (path == CpuPath::Avx512) return qmm::run_avx512(a);
    if (path == CpuPath::Avx2) return qmm::run_avx2(a);
#endif
    return a.int8_acts ? qmm::run_int8_portable(a) : qmm::run_portable(a);
  }
  // Int8 activations over MLX's layout (a layer the loader could not
  // interleave: rows not a multiple of 16): the portable kernel.
  if (a.int8_acts) return qmm::run_int8_portable(a);
  switch (path) {
#if defined(MLXFAST_X86)
    case CpuPath::Avx512: qmm::run_avx512(a); break;
    case CpuPath::Avx2: qmm::run_avx2(a); break;
#endif
#if defined(MLXFAST_ARM64)
    case CpuPath::Neon: qmm::run_neon(a); break;
#endif
    default: qmm::run_portable(a); break;
  }
}

mx::array quantized_matmul(const mx::array& x_in, const mx::array& w,
                           const mx::array& scales, const std::optional<mx::array>& biases_in,
                           int group_size, int bits, const Fusion& f, bool int8_acts,
                           mx::StreamOrDevice s) {
  const bool symmetric = !biases_in.has_value();
  const mx::array& biases = symmetric ? scales : *biases_in;
  const char* op = "quantized_matmul";
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    fail("bits must be one of 2, 3, 4, 5, 6, 8, got " + std::to_string(bits) + ".");
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    fail("group_size must be 32, 64 or 128, got " + std::to_string(group_size) + ".");
  }
  if (!is_float(x_in.dtype())) fail("x must be float32, float16 or bfloat16.");
  if (w.dtype() != mx::uint32) fail("w must be uint32 (packed quantized weights).");
  if (!is_float(scales.dtype())) fail("scales must be float32, float16 or bfloat16.");
  if (biases.dtype() != scales.dtype()) fail("biases must have the same dtype as scales.");
  if (x_in.ndim() < 1) fail("x must have at least one dimension.");
  // 3-D: the row-interleaved layout of ops.pack_rows16 (qmm::Args::rows16).
  const bool rows16 = w.ndim() == 3;
  if (rows16) {
    if (bits != 4 && bits != 8) {
      fail("the row-interleaved layout (3-D w) is 4- or 8-bit only, got bits=" + std::to_string(bits) + ".");
    }
    if (w.shape(2) != 16 || scales.ndim() != 3 || biases.ndim() != 3) {
      std::ostringstream m;
      m << "a row-interleaved w must be [N / 16, K * bits / 32, 16] with scales and biases [N / 16, "
           "K / group_size, 16], got w " << w.shape() << ", scales " << scales.shape() << ".";
      fail(m.str());
    }
  } else if (w.ndim() != 2 || scales.ndim() != 2 || biases.ndim() != 2) {
    fail("w, scales and biases must be 2-D (or 3-D, row-interleaved).");
  }
  auto stream = mx::to_stream(s);
  Prepared p = prepare(op, x_in, f, stream);
  const auto& x = p.x;
  int64_t K = p.K;
  int64_t N = rows16 ? 16 * static_cast<int64_t>(w.shape(0)) : w.shape(0);
  std::ostringstream msg;
  if (K % group_size != 0) {
    msg << "the last dimension of x (" << K << ") must be a multiple of group_size ("
        << group_size << ")" << (p.spec.prologue == FusedSpec::ActHalves ? " after act." : ".");
    fail(msg.str());
  }
  if (static_cast<int64_t>(w.shape(1)) * 32 != K * bits) {
    msg << "shape mismatch: x has K=" << K << " but w " << w.shape() << " holds "
        << static_cast<int64_t>(w.shape(1)) * 32 / bits << " values per row at bits="
        << bits << ".";
    fail(msg.str());
  }
  mx::Shape sshape = rows16 ? mx::Shape{w.shape(0), static_cast<int>(K / group_size), 16}
                            : mx::Shape{static_cast<int>(N), static_cast<int>(K / group_size)};
  if (scales.shape() != sshape || biases.shape() != sshape) {
    msg << "shape mismatch: scales and biases must be " << sshape << " for w "
        << w.shape() << " and group_size=" << group_size << ", got " << scales.shape()
        << " and " << biases.shape() << ".";
    fail(msg.str());
  }
  mx::Shape out_shape = x.shape();
  out_shape.back() = static_cast<int>(N);
  check_residual(op, f, out_shape, x.dtype(), p);
  mx::array sc = dense_weight(scales, stream);
  std::vector<mx::array> inputs = {x, dense_weight(w, stream), sc,
                                   symmetric ? sc : dense_weight(biases, stream)};
  inputs.insert(inputs.end(), p.extra.begin(), p.extra.end());
  return mx::array(std::move(out_shape), x.dtype(),
                   std::make_shared<QuantizedMatmul>(stream, group_size, bits, p.spec, int8_acts,
                                                     symmetric),
                   std::move(inputs));
}

mx::array quantized_matmul_direct(const mx::array& x_in, const mx::array& w_in,
                                  const mx::array& s_in, const std::optional<mx::array>& b_in,
                                  int group_size, int bits, bool int8_acts,
                                  const std::string& path_name) {
  if (x_in.ndim() != 2 || x_in.dtype() != mx::float32) fail("direct: x must be 2-D float32.");
  if (w_in.ndim() == 3 && ((bits != 4 && bits != 8) || w_in.shape(2) != 16 || s_in.ndim() != 3)) {
    fail("direct: a 3-D (row-interleaved) w is 4- or 8-bit, with 3-D scales.");
  }
  mx::array x = mx::contiguous(x_in), w = mx::contiguous(w_in), sc = mx::contiguous(s_in);
  std::vector<mx::array> ev = {x, w, sc};
  std::optional<mx::array> bi;
  if (b_in) {
    bi = mx::contiguous(*b_in);
    ev.push_back(*bi);
  }
  mx::eval(ev);
  CpuPath path = CpuPath::Portable;
  for (auto p : {CpuPath::Portable, CpuPath::Avx2, CpuPath::Avx512, CpuPath::Neon}) {
    if (path_name == cpu_path_name(p)) path = p;
  }
  if (!cpu_supports(path)) fail("direct: path '" + path_name + "' is not supported here.");
  const bool rows16 = w.ndim() == 3;
  const int n = w.shape(0) * (rows16 ? 16 : 1);
  mx::array out(mx::allocator::malloc(sizeof(float) * x.shape(0) * n), {x.shape(0), n},
                mx::float32);
  qmm::Args a;
  a.x = x.data<float>();
  a.w = w.data<uint32_t>();
  a.scales = sc.data<void>();
  a.biases = bi ? bi->data<void>() : nullptr;
  a.out = out.data<float>();
  a.M = x.shape(0);
  a.N = n;
  a.rows16 = rows16;
  a.K = x.shape(1);
  a.group_size = group_size;
  a.bits = bits;
  a.x_dtype = qmm::F32;
  a.s_dtype = to_qmm(sc.dtype());
  a.int8_acts = int8_acts;
  if (a.M && a.N && a.K) run_qmm(a, path);
  return out;
}

std::vector<mx::Shape> QuantizedMatmul::output_shapes(
    const std::vector<mx::array>& inputs) {
  mx::Shape out = inputs[0].shape();
  out.back() = inputs[1].shape(0) * (inputs[1].ndim() == 3 ? 16 : 1);
  return {out};
}

void QuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  auto& x = inputs[0];
  auto& w = inputs[1];
  auto& sc = inputs[2];
  auto& bi = inputs[3];
  const mx::array *norm_w, *residual;
  fused_inputs(spec_, inputs, 4, norm_w, residual);
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(out);

  qmm::Args a;
  a.x = nullptr;  // set in the task (packed / prologue)
  a.w = w.data<uint32_t>();
  a.scales = sc.data<void>();
  a.biases = symmetric_ ? nullptr : bi.data<void>();
  a.out = out.data<void>();
  a.rows16 = w.ndim() == 3;
  a.N = w.shape(0) * (a.rows16 ? 16 : 1);
  a.K = spec_.prologue == FusedSpec::ActHalves ? x.shape(-1) / 2 : x.shape(-1);
  a.M = a.N > 0 ? static_cast<int64_t>(out.size()) / a.N : 0;  // also right for K == 0
  a.group_size = group_size_;
  a.bits = bits_;
  a.x_dtype = to_qmm(x.dtype());
  a.s_dtype = to_qmm(sc.dtype());
  a.int8_acts = int8_acts_;
  if (a.M == 0 || a.N == 0) return;
  run_dispatched(a, spec_, x, norm_w, residual, enc);
}

mx::array dense_matmul(const mx::array& x_in, const mx::array& w, const Fusion& f,
                       mx::StreamOrDevice s) {
  const char* op = "dense_matmul";
  if (!is_float(x_in.dtype()) || !is_float(w.dtype())) {
    fail(op, "x and w must be float32, float16 or bfloat16.");
  }
  if (x_in.ndim() < 1) fail(op, "x must have at least one dimension.");
  if (w.ndim() != 2) fail(op, "w must be 2-D [N, K].");
  auto stream = mx::to_stream(s);
  Prepared p = prepare(op, x_in, f, stream);
  const auto& x = p.x;
  if (p.K != w.shape(1)) {
    std::ostringstream msg;
    msg << "shape mismatch: x has K=" << p.K
        << (p.spec.prologue == FusedSpec::ActHalves ? " after act" : "") << " but w is "
        << w.shape() << ".";
    fail(op, msg.str());
  }
  mx::Shape out_shape = x.shape();
  out_shape.back() = w.shape(0);
  check_residual(op, f, out_shape, x.dtype(), p);
  std::vector<mx::array> inputs = {x, dense_weight(w, stream)};
  inputs.insert(inputs.end(), p.extra.begin(), p.extra.end());
  return mx::array(std::move(out_shape), x.dtype(), std::make_shared<DenseMatmul>(stream, p.spec),
                   std::move(inputs));
}

std::vector<mx::Shape> DenseMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape out = inputs[0].shape();
  out.back() = inputs[1].shape(0);
  return {out};
}

void DenseMatmul::eval_cpu(const std::vector<mx::array>& inputs,
                           std::vector<mx::array>& outputs) {
  auto& x = inputs[0];
  auto& w = inputs[1];
  const mx::array *norm_w, *residual;
  fused_inputs(spec_, inputs, 2, norm_w, residual);
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(out);
  qmm::Args a;
  a.x = nullptr;  // set in the task (packed / prologue)
  a.w = w.data<void>();
  a.scales = a.biases = nullptr;
  a.out = out.data<void>();
  a.N = w.shape(0);
  a.K = w.shape(1);
  a.M = a.N > 0 ? static_cast<int64_t>(out.size()) / a.N : 0;  // also right for K == 0
  a.group_size = 0;
  a.bits = 0;
  a.x_dtype = to_qmm(x.dtype());
  a.s_dtype = qmm::F32;
  a.w_dtype = to_qmm(w.dtype());
  if (a.M == 0 || a.N == 0) return;
  run_dispatched(a, spec_, x, norm_w, residual, enc);
}

void DenseMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[mlxfast.dense_matmul] no GPU kernel; mlxfast.ops uses the MLX reference on GPU.");
}

void QuantizedMatmul::eval_gpu(const std::vector<mx::array>&,
                               std::vector<mx::array>&) {
  throw std::runtime_error(
      "[mlxfast.quantized_matmul] no GPU kernel; mlxfast.ops uses the MLX "
      "reference on GPU.");
}

} // namespace mlxfast
