#include "ops/kv_write.h"

#include <cstring>
#include <sstream>
#include <stdexcept>

#include "common/dense_input.h"
#include "common/half.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace mlxfast {

namespace {

bool is_float(mx::Dtype t) { return t == mx::float32 || t == mx::float16 || t == mx::bfloat16; }

void check(const mx::array& pool, const mx::array& slots, const mx::array& values) {
  std::ostringstream msg;
  const int lead = static_cast<int>(values.ndim()) - static_cast<int>(pool.ndim()) + 1;
  int64_t rows = 1;
  for (int i = 0; i < lead; ++i) rows *= values.shape(i);
  if (pool.ndim() < 1 || slots.ndim() != 1 || lead < 1 || rows != slots.shape(0) ||
      !std::equal(pool.shape().begin() + 1, pool.shape().end(), values.shape().begin() + lead)) {
    msg << "[mlxfast.kv_write] need pool [S, ...], slots [T] and values [..., ...] with T rows "
        << "and pool's trailing shape; got pool " << pool.shape() << ", slots " << slots.shape()
        << ", values " << values.shape() << ".";
  } else if (slots.dtype() != mx::int32) {
    msg << "[mlxfast.kv_write] slots must be int32.";
  } else if (values.dtype() != pool.dtype() &&
             !(is_float(values.dtype()) && is_float(pool.dtype()))) {
    msg << "[mlxfast.kv_write] values must have the pool's dtype, or both be float32, "
        << "float16 or bfloat16.";
  }
  if (!msg.str().empty()) throw std::invalid_argument(msg.str());
}

struct Write {
  DenseInput src;  // the old pool, when it is copied (not donated)
  DenseInput values;
  mx::Dtype from = mx::float32, to = mx::float32;  // the values' and the pool's element types
  char* dst;
  size_t total, row;  // bytes: the pool, one pool row
};

float load_float(const void* p, mx::Dtype t, size_t i) {
  if (t == mx::float32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return t == mx::float16 ? f16_to_f32(h) : bf16_to_f32(h);
}

// One row of `n` values converted to the pool's type, rounding to nearest
// even as astype does (the write then stands for astype + write: one
// primitive instead of three per layer).
void store_row(const Write& w, const void* src, size_t first, size_t n, char* dst) {
  if (w.to == mx::float32) {
    float* d = reinterpret_cast<float*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = load_float(src, w.from, first + i);
  } else {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    const bool f16 = w.to == mx::float16;
    for (size_t i = 0; i < n; ++i) {
      const float f = load_float(src, w.from, first + i);
      d[i] = f16 ? f32_to_f16(f) : f32_to_bf16(f);
    }
  }
}

} // namespace

mx::array kv_write(const mx::array& pool, const mx::array& slots, const mx::array& values,
                   bool inplace, mx::StreamOrDevice s) {
  check(pool, slots, values);
  return mx::array(pool.shape(), pool.dtype(), std::make_shared<KvWrite>(mx::to_stream(s), inplace),
                   {pool, slots, values});
}

std::vector<mx::array> kv_write_pair(const mx::array& k_pool, const mx::array& v_pool,
                                     const mx::array& slots, const mx::array& k,
                                     const mx::array& v, bool inplace, mx::StreamOrDevice s) {
  check(k_pool, slots, k);
  check(v_pool, slots, v);
  if (k_pool.shape(0) != v_pool.shape(0))
    throw std::invalid_argument("[mlxfast.kv_write_pair] k_pool and v_pool differ in slots.");
  return mx::array::make_arrays({k_pool.shape(), v_pool.shape()},
                                {k_pool.dtype(), v_pool.dtype()},
                                std::make_shared<KvWrite>(mx::to_stream(s), inplace),
                                {k_pool, v_pool, slots, k, v});
}

void KvWrite::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const size_t n = outputs.size();
  auto& slots = inputs[n];
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);

  // Each output of a multi-output primitive holds its own copy of the inputs,
  // so with two outputs every pool is referenced twice and never looks
  // donatable. `inputs` is the copy of the output being evaluated; drop the
  // siblings' copies (MLX's detach() clears them right after this eval
  // anyway). Not while tracing: the graph must survive then.
  if (n > 1 && !outputs[0].is_tracer()) {
    for (auto& o : outputs) {
      if (&o.inputs() != &inputs) o.inputs().clear();
    }
  }

  std::vector<Write> writes(n);
  for (size_t i = 0; i < n; ++i) {
    auto& pool = inputs[i];
    auto& out = outputs[i];
    auto& w = writes[i];
    if ((inplace_ || pool.is_donatable()) && pool.flags().row_contiguous) {
      out.copy_shared_buffer(pool);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      w.src = dense_input(pool, enc);
    }
    w.values = dense_input(inputs[n + 1 + i], enc);
    w.from = inputs[n + 1 + i].dtype();
    w.to = pool.dtype();
    w.dst = out.data<char>();
    w.total = out.nbytes();
    w.row = pool.shape(0) ? w.total / pool.shape(0) : 0;
  }
  DenseInput sin = dense_input(slots, enc);
  const int64_t num_slots = inputs[0].shape(0);
  const int64_t T = slots.size();
  enc.dispatch([writes = std::move(writes), sin, num_slots, T]() {
    sin.pack();
    const int32_t* sl = sin.as<int32_t>();
    for (auto& w : writes) {
      if (w.src.data) {
        w.src.pack();
        std::memcpy(w.dst, w.src.data, w.total);
      }
      w.values.pack();
      const char* v = static_cast<const char*>(w.values.data);
      const size_t per_row = w.row / mx::size_of(w.to);  // values per pool row
      for (int64_t t = 0; t < T; ++t) {
        int64_t slot = sl[t];
        if (slot < 0 || slot >= num_slots) continue;  // never write outside the pool
        if (w.from == w.to) {
          std::memcpy(w.dst + slot * w.row, v + t * w.row, w.row);
        } else {
          store_row(w, v, t * per_row, per_row, w.dst + slot * w.row);
        }
      }
    }
  });
}

void KvWrite::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxfast.kv_write] no GPU kernel; mlxfast.ops uses indexed assignment on GPU.");
}

} // namespace mlxfast
