#include "ops/quantized_matmul.h"

#include <cstring>
#include <vector>
#include <sstream>
#include <stdexcept>

#include "common/op_checks.h"
#include "common/cpu_features.h"
#include "common/dense_input.h"
#include "common/thread_pool.h"
#include "cpu/qmm.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace mlxfast {

namespace qmm {
void parallel(int64_t n, int64_t grain, void (*fn)(void*, int64_t, int64_t),
              void* ctx) {
  parallel_for(n, grain, [fn, ctx](int64_t b, int64_t e) { fn(ctx, b, e); });
}
int pool_size() { return num_threads(); }
} // namespace qmm

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[mlxfast.quantized_matmul] " + what);
}

qmm::DType to_qmm(mx::Dtype dt) {
  if (dt == mx::float32) return qmm::F32;
  if (dt == mx::float16) return qmm::F16;
  return qmm::BF16;
}

// Runs `a` on the encoder's thread with the path chosen now (at eval time).
// a.x is replaced by x's data, packed there first when x is strided.
void run_dispatched(qmm::Args a, const mx::array& x, mx::cpu::CommandEncoder& enc) {
  CpuPath path = cpu_path();
  DenseInput xin = dense_input(x, enc);
  a.x = xin.data;
  enc.dispatch([a, path, xin]() {
    xin.pack();
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
  });
}

// Weights are usually loaded (evaluated) and dense: no extra graph node
// then. x is usually lazy; a strided x is packed inside eval_cpu instead of
// adding a Contiguous node to every call (~5 us each on this CPU).
mx::array dense_weight(const mx::array& a, mx::Stream stream) {
  return (a.is_available() && a.flags().row_contiguous) ? a : mx::contiguous(a, false, stream);
}

} // namespace

mx::array quantized_matmul(const mx::array& x, const mx::array& w,
                           const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, mx::StreamOrDevice s) {
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    fail("bits must be one of 2, 3, 4, 5, 6, 8, got " + std::to_string(bits) + ".");
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    fail("group_size must be 32, 64 or 128, got " + std::to_string(group_size) + ".");
  }
  if (!is_float(x.dtype())) fail("x must be float32, float16 or bfloat16.");
  if (w.dtype() != mx::uint32) fail("w must be uint32 (packed quantized weights).");
  if (!is_float(scales.dtype())) fail("scales must be float32, float16 or bfloat16.");
  if (biases.dtype() != scales.dtype()) fail("biases must have the same dtype as scales.");
  if (x.ndim() < 1) fail("x must have at least one dimension.");
  if (w.ndim() != 2 || scales.ndim() != 2 || biases.ndim() != 2) {
    fail("w, scales and biases must be 2-D.");
  }
  int64_t K = x.shape(-1);
  int64_t N = w.shape(0);
  std::ostringstream msg;
  if (K % group_size != 0) {
    msg << "the last dimension of x (" << K << ") must be a multiple of group_size ("
        << group_size << ").";
    fail(msg.str());
  }
  if (static_cast<int64_t>(w.shape(1)) * 32 != K * bits) {
    msg << "shape mismatch: x has K=" << K << " but w " << w.shape() << " holds "
        << static_cast<int64_t>(w.shape(1)) * 32 / bits << " values per row at bits="
        << bits << ".";
    fail(msg.str());
  }
  mx::Shape sshape = {static_cast<int>(N), static_cast<int>(K / group_size)};
  if (scales.shape() != sshape || biases.shape() != sshape) {
    msg << "shape mismatch: scales and biases must be " << sshape << " for w "
        << w.shape() << " and group_size=" << group_size << ", got " << scales.shape()
        << " and " << biases.shape() << ".";
    fail(msg.str());
  }
  auto stream = mx::to_stream(s);
  const auto& xc = x;
  auto wc = dense_weight(w, stream);
  auto sc = dense_weight(scales, stream);
  auto bc = dense_weight(biases, stream);
  mx::Shape out_shape = x.shape();
  out_shape.back() = static_cast<int>(N);
  return mx::array(std::move(out_shape), x.dtype(),
                   std::make_shared<QuantizedMatmul>(stream, group_size, bits),
                   {xc, wc, sc, bc});
}

std::vector<mx::Shape> QuantizedMatmul::output_shapes(
    const std::vector<mx::array>& inputs) {
  mx::Shape out = inputs[0].shape();
  out.back() = inputs[1].shape(0);
  return {out};
}

void QuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  auto& x = inputs[0];
  auto& w = inputs[1];
  auto& sc = inputs[2];
  auto& bi = inputs[3];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(x);
  enc.set_input_array(w);
  enc.set_input_array(sc);
  enc.set_input_array(bi);
  enc.set_output_array(out);

  qmm::Args a;
  a.x = x.data<void>();
  a.w = w.data<uint32_t>();
  a.scales = sc.data<void>();
  a.biases = bi.data<void>();
  a.out = out.data<void>();
  a.K = x.shape(-1);
  a.N = w.shape(0);
  a.M = a.N > 0 ? static_cast<int64_t>(out.size()) / a.N : 0;  // also right for K == 0
  a.group_size = group_size_;
  a.bits = bits_;
  a.x_dtype = to_qmm(x.dtype());
  a.s_dtype = to_qmm(sc.dtype());
  if (a.M == 0 || a.N == 0) return;
  if (a.K == 0) {
    std::memset(out.data<void>(), 0, out.nbytes());
    return;
  }
  run_dispatched(a, x, enc);
}

mx::array dense_matmul(const mx::array& x, const mx::array& w, mx::StreamOrDevice s) {
  const char* op = "dense_matmul";
  if (!is_float(x.dtype()) || !is_float(w.dtype())) {
    fail(op, "x and w must be float32, float16 or bfloat16.");
  }
  if (x.ndim() < 1) fail(op, "x must have at least one dimension.");
  if (w.ndim() != 2) fail(op, "w must be 2-D [N, K].");
  if (x.shape(-1) != w.shape(1)) {
    std::ostringstream msg;
    msg << "shape mismatch: x has K=" << x.shape(-1) << " but w is " << w.shape() << ".";
    fail(op, msg.str());
  }
  auto stream = mx::to_stream(s);
  mx::Shape out_shape = x.shape();
  out_shape.back() = w.shape(0);
  return mx::array(std::move(out_shape), x.dtype(), std::make_shared<DenseMatmul>(stream),
                   {x, dense_weight(w, stream)});
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
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(x);
  enc.set_input_array(w);
  enc.set_output_array(out);
  qmm::Args a;
  a.x = x.data<void>();
  a.w = w.data<void>();
  a.scales = a.biases = nullptr;
  a.out = out.data<void>();
  a.K = x.shape(-1);
  a.N = w.shape(0);
  a.M = a.N > 0 ? static_cast<int64_t>(out.size()) / a.N : 0;  // also right for K == 0
  a.group_size = 0;
  a.bits = 0;
  a.x_dtype = to_qmm(x.dtype());
  a.s_dtype = qmm::F32;
  a.w_dtype = to_qmm(w.dtype());
  if (a.M == 0 || a.N == 0) return;
  if (a.K == 0) {
    std::memset(out.data<void>(), 0, out.nbytes());
    return;
  }
  run_dispatched(a, x, enc);
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
