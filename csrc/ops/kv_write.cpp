#include "ops/kv_write.h"

#include <cstring>
#include <sstream>
#include <stdexcept>

#include "common/dense_input.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace mlxfast {

mx::array kv_write(const mx::array& pool, const mx::array& slots, const mx::array& values,
                   mx::StreamOrDevice s) {
  std::ostringstream msg;
  if (pool.ndim() < 1 || slots.ndim() != 1 || values.ndim() != pool.ndim() ||
      values.shape(0) != slots.shape(0) ||
      !std::equal(pool.shape().begin() + 1, pool.shape().end(), values.shape().begin() + 1)) {
    msg << "[mlxfast.kv_write] need pool [S, ...], slots [T] and values [T, ...] with pool's "
        << "trailing shape; got pool " << pool.shape() << ", slots " << slots.shape()
        << ", values " << values.shape() << ".";
  } else if (slots.dtype() != mx::int32) {
    msg << "[mlxfast.kv_write] slots must be int32.";
  } else if (values.dtype() != pool.dtype()) {
    msg << "[mlxfast.kv_write] values must have the pool's dtype.";
  }
  if (!msg.str().empty()) throw std::invalid_argument(msg.str());
  auto stream = mx::to_stream(s);
  return mx::array(pool.shape(), pool.dtype(), std::make_shared<KvWrite>(stream),
                   {pool, slots, values});
}

void KvWrite::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& pool = inputs[0];
  auto& slots = inputs[1];
  auto& values = inputs[2];
  auto& out = outputs[0];
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(pool);
  enc.set_input_array(slots);
  enc.set_input_array(values);
  enc.set_output_array(out);

  DenseInput src;
  if (pool.is_donatable() && pool.flags().row_contiguous) {
    out.copy_shared_buffer(pool);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    src = dense_input(pool, enc);
  }
  DenseInput sin = dense_input(slots, enc);
  DenseInput vin = dense_input(values, enc);
  const int64_t num_slots = pool.shape(0);
  const int64_t T = slots.size();
  const size_t row = num_slots ? out.nbytes() / num_slots : 0;
  char* dst = out.data<char>();
  const size_t total = out.nbytes();
  enc.dispatch([src, sin, vin, dst, num_slots, T, row, total]() {
    if (src.data) {
      src.pack();
      std::memcpy(dst, src.data, total);
    }
    sin.pack();
    vin.pack();
    const int32_t* sl = sin.as<int32_t>();
    const char* v = static_cast<const char*>(vin.data);
    for (int64_t t = 0; t < T; ++t) {
      int64_t slot = sl[t];
      if (slot < 0 || slot >= num_slots) continue;  // never write outside the pool
      std::memcpy(dst + slot * row, v + t * row, row);
    }
  });
}

void KvWrite::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxfast.kv_write] no GPU kernel; mlxfast.ops uses indexed assignment on GPU.");
}

} // namespace mlxfast
