#include "ops/silu_mul.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "common/dense_input.h"
#include "common/thread_pool.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace mlxfast {

namespace {

template <typename T>
void silu_mul_impl(const T* g, const T* u, T* out, int64_t n) {
  parallel_for(n, 16384, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float x = static_cast<float>(g[i]);
      float y = static_cast<float>(u[i]);
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
  return mx::array(gate.shape(), dt, std::make_shared<SiluMul>(stream), {gate, up});
}

void SiluMul::eval_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) {
  auto& g = inputs[0];
  auto& u = inputs[1];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(g);
  enc.set_input_array(u);
  enc.set_output_array(out);
  int64_t n = out.size();
  auto dt = out.dtype();
  DenseInput gin = dense_input(g, enc);
  DenseInput uin = dense_input(u, enc);
  void* op = out.data<void>();
  enc.dispatch([=]() {
    gin.pack();
    uin.pack();
    const void* gp = gin.data;
    const void* up = uin.data;
    if (dt == mx::float32) {
      silu_mul_impl(static_cast<const float*>(gp), static_cast<const float*>(up),
                    static_cast<float*>(op), n);
    } else if (dt == mx::float16) {
      silu_mul_impl(static_cast<const mx::float16_t*>(gp),
                    static_cast<const mx::float16_t*>(up),
                    static_cast<mx::float16_t*>(op), n);
    } else {
      silu_mul_impl(static_cast<const mx::bfloat16_t*>(gp),
                    static_cast<const mx::bfloat16_t*>(up),
                    static_cast<mx::bfloat16_t*>(op), n);
    }
  });
}

void SiluMul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[mlxfast.silu_mul] no GPU kernel; mlxfast.ops uses the MLX reference on GPU.");
}

} // namespace mlxfast
