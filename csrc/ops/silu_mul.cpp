#include "ops/silu_mul.h"

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <type_traits>

#include "common/dense_input.h"
#include "common/thread_pool.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace mlxfast {

namespace {

// rows x m outputs; gate and up rows are `stride` elements apart (m for two
// inputs, 2m when both halves live in one row).
template <typename T>
void silu_mul_impl(const T* g, const T* u, T* out, int64_t rows, int64_t m, int64_t stride) {
  parallel_for(rows * m, 16384, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      int64_t src = (i / m) * stride + i % m;
      float x = static_cast<float>(g[src]);
      float y = static_cast<float>(u[src]);
      out[i] = static_cast<T>(x / (1.0f + std::exp(-x)) * y);
    }
  });
}

} // namespace

mx::array silu_mul(const mx::array& gate, const mx::array& up,
                   mx::StreamOrDevice s) {
  if (gate.shape() != up.shape()) {
    std::ostringstream msg;
    msg << "[mlxfast.silu_mul] gate and up must have the same shape, got "
        << gate.shape() << " and " << up.shape() << ".";
    throw std::invalid_argument(msg.str());
  }
  if (gate.dtype() != up.dtype()) {
    throw std::invalid_argument(
        "[mlxfast.silu_mul] gate and up must have the same dtype.");
  }
  auto dt = gate.dtype();
  if (dt != mx::float32 && dt != mx::float16 && dt != mx::bfloat16) {
    throw std::invalid_argument(
        "[mlxfast.silu_mul] dtype must be float32, float16 or bfloat16.");
  }
  auto stream = mx::to_stream(s);
  return mx::array(gate.shape(), dt, std::make_shared<SiluMul>(stream, false), {gate, up});
}

mx::array silu_mul_halves(const mx::array& gate_up, mx::StreamOrDevice s) {
  auto dt = gate_up.dtype();
  if (gate_up.ndim() < 1 || gate_up.shape(-1) % 2) {
    throw std::invalid_argument("[mlxfast.silu_mul] gate_up's last axis must be even.");
  }
  if (dt != mx::float32 && dt != mx::float16 && dt != mx::bfloat16) {
    throw std::invalid_argument(
        "[mlxfast.silu_mul] dtype must be float32, float16 or bfloat16.");
  }
  auto shape = gate_up.shape();
  shape.back() /= 2;
  auto stream = mx::to_stream(s);
  return mx::array(shape, dt, std::make_shared<SiluMul>(stream, true), {gate_up});
}

void SiluMul::eval_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  const int64_t m = out.ndim() ? out.shape(-1) : 1;
  const int64_t rows = m ? out.size() / m : 0;
  const int64_t stride = halves_ ? 2 * m : m;
  const int64_t up_offset = halves_ ? m : 0;
  auto dt = out.dtype();
  DenseInput gin = dense_input(inputs[0], enc);
  DenseInput uin = halves_ ? gin : dense_input(inputs[1], enc);
  const bool halves = halves_;
  void* op = out.data<void>();
  enc.dispatch([=]() {
    gin.pack();
    if (!halves) uin.pack();
    auto run = [&](auto* typed_out) {
      using T = std::remove_pointer_t<decltype(typed_out)>;
      const T* g = static_cast<const T*>(gin.data);
      const T* u = static_cast<const T*>(uin.data) + up_offset;
      silu_mul_impl(g, u, typed_out, rows, m, stride);
    };
    if (dt == mx::float32) {
      run(static_cast<float*>(op));
    } else if (dt == mx::float16) {
      run(static_cast<mx::float16_t*>(op));
    } else {
      run(static_cast<mx::bfloat16_t*>(op));
    }
  });
}

void SiluMul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[mlxfast.silu_mul] no GPU kernel; mlxfast.ops uses the MLX reference on GPU.");
}

} // namespace mlxfast
