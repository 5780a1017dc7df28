#include "ops/dequantize_rows.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "common/cpu_eval.h"
#include "common/dense_input.h"
#include "common/op_checks.h"
#include "common/thread_pool.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace mlxfast {

namespace {

template <typename T>
float to_f32(const void* p, int64_t i) {
  return static_cast<float>(static_cast<const T*>(p)[i]);
}

float load(mx::Dtype dt, const void* p, int64_t i) {
  if (dt == mx::float32) return to_f32<float>(p, i);
  if (dt == mx::float16) return to_f32<mx::float16_t>(p, i);
  return to_f32<mx::bfloat16_t>(p, i);
}

// Code j of a row: bits [j*bits, (j+1)*bits) of its little-endian bit stream.
inline uint32_t code(const uint8_t* row, int64_t j, int bits) {
  if (bits == 8) return row[j];
  if (bits == 4) return (row[j >> 1] >> ((j & 1) * 4)) & 0xfu;
  const int64_t pos = j * bits;
  const int64_t byte = pos >> 3;
  const int shift = static_cast<int>(pos & 7);
  uint32_t v = row[byte] >> shift;
  if (shift + bits > 8) v |= static_cast<uint32_t>(row[byte + 1]) << (8 - shift);
  return v & ((1u << bits) - 1u);
}

// rows16: the row-interleaved layout (qmm::Args::rows16, ops.pack_rows16;
// bits 4 or 8): w [V / 16][D * bits / 32][16] uint32, scales and biases
// [V / 16][G][16].
template <typename O>
void run(const uint8_t* w, const void* sc, const void* bi, mx::Dtype sdt, const int32_t* ids,
         O* out, int64_t n, int64_t V, int64_t D, int64_t row_bytes, int group_size, int bits,
         bool rows16) {
  const int64_t groups = D / group_size;
  parallel_for(n, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [=](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      O* o = out + r * D;
      const int64_t id = ids[r];
      if (id < 0 || id >= V) {
        for (int64_t j = 0; j < D; ++j) o[j] = static_cast<O>(0.f);
        continue;
      }
      const uint8_t* row = rows16 ? nullptr : w + id * row_bytes;
      const uint32_t* block =
          rows16 ? reinterpret_cast<const uint32_t*>(w) + (id >> 4) * (D * bits / 32) * 16 + (id & 15) : nullptr;
      const int vpw = 32 / bits;  // values a rows16 word holds
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t p = rows16 ? ((id >> 4) * groups + g) * 16 + (id & 15) : id * groups + g;
        const float s = load(sdt, sc, p);
        const float z = bi ? load(sdt, bi, p) : s * -static_cast<float>(1 << (bits - 1));
        for (int64_t j = g * group_size; j < (g + 1) * group_size; ++j) {
          const uint32_t q = rows16 ? (block[(j / vpw) * 16] >> (bits * (j % vpw))) & ((1u << bits) - 1u)
                                    : code(row, j, bits);
          o[j] = static_cast<O>(s * static_cast<float>(q) + z);
        }
      }
    }
  });
}

} // namespace

mx::array dequantize_rows(const mx::array& w, const mx::array& scales,
                          const std::optional<mx::array>& biases_in, const mx::array& ids,
                          int group_size, int bits, std::optional<mx::Dtype> dtype,
                          mx::StreamOrDevice s) {
  const char* op = "dequantize_rows";
  const bool symmetric = !biases_in.has_value();
  const mx::array& biases = symmetric ? scales : *biases_in;
  if (bits < 2 || bits > 8 || bits == 7) fail(op, "bits must be 2, 3, 4, 5, 6 or 8.");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    fail(op, "group_size must be 32, 64 or 128.");
  const bool rows16 = w.ndim() == 3;  // the row-interleaved layout (ops.pack_rows16)
  if (rows16 && ((bits != 4 && bits != 8) || w.shape(2) != 16)) {
    fail(op, "a 3-D w is the row-interleaved layout: 4- or 8-bit, [V / 16, D * bits / 32, 16].");
  }
  if ((w.ndim() != 2 && !rows16) || w.dtype() != mx::uint32) {
    fail(op, "w must be a uint32 [V, D * bits / 32] array (or [V / 16, D * bits / 32, 16], row-interleaved).");
  }
  const int64_t D = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  if (D % group_size != 0) fail(op, "the row length must be a multiple of group_size.");
  const mx::Shape sshape = rows16 ? mx::Shape{w.shape(0), static_cast<int>(D / group_size), 16}
                                  : mx::Shape{w.shape(0), static_cast<int>(D / group_size)};
  if (scales.shape() != sshape || biases.shape() != scales.shape())
    fail(op, rows16 ? "scales and biases must be [V / 16, D / group_size, 16]."
                    : "scales and biases must be [V, D / group_size].");
  if (!is_float(scales.dtype()) || biases.dtype() != scales.dtype())
    fail(op, "scales and biases must share a float32, float16 or bfloat16 dtype.");
  if (!mx::issubdtype(ids.dtype(), mx::integer)) fail(op, "ids must be integers.");
  mx::Dtype out_dt = dtype.value_or(scales.dtype());
  if (!is_float(out_dt)) fail(op, "dtype must be float32, float16 or bfloat16.");
  auto stream = mx::to_stream(s);
  mx::array idx = ids.dtype() == mx::int32 ? ids : mx::astype(ids, mx::int32, stream);
  mx::Shape shape = ids.shape();
  shape.push_back(static_cast<int>(D));
  return mx::array(shape, out_dt, std::make_shared<DequantizeRows>(stream, group_size, bits, symmetric),
                   {w, scales, biases, idx});
}

void DequantizeRows::eval_cpu(const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  auto& enc = begin_eval(stream(), inputs, outputs);
  DenseInput w = dense_input(inputs[0], enc), sc = dense_input(inputs[1], enc),
             bi = dense_input(inputs[2], enc), ids = dense_input(inputs[3], enc);
  const bool rows16 = inputs[0].ndim() == 3;
  const int64_t V = inputs[0].shape(0) * (rows16 ? 16 : 1);
  const int64_t row_bytes = static_cast<int64_t>(inputs[0].shape(1)) * 4;
  const int64_t D = row_bytes * 8 / bits_;
  const int64_t n = inputs[3].size();
  const mx::Dtype sdt = inputs[1].dtype(), odt = out.dtype();
  const int gs = group_size_, bits = bits_;
  const bool symmetric = symmetric_;
  void* o = out.data<void>();
  enc.dispatch([=]() {
    w.pack();
    sc.pack();
    bi.pack();
    ids.pack();
    auto go = [&](auto* typed) {
      run(static_cast<const uint8_t*>(w.data), sc.data, symmetric ? nullptr : bi.data, sdt,
          ids.as<int32_t>(), typed,
          n, V, D, row_bytes, gs, bits, rows16);
    };
    if (odt == mx::float32) {
      go(static_cast<float*>(o));
    } else if (odt == mx::float16) {
      go(static_cast<mx::float16_t*>(o));
    } else {
      go(static_cast<mx::bfloat16_t*>(o));
    }
  });
}

void DequantizeRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[mlxfast.dequantize_rows] no GPU kernel; mlxfast.ops uses the MLX reference on GPU.");
}

} // namespace mlxfast
