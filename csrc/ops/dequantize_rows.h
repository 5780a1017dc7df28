// dequantize_rows(w, scales, biases, ids): rows `ids` of
// dequantize(w, scales, biases) -- a quantized embedding lookup as one
// primitive (MLX's dequantize has no CPU kernel for a gathered row: gather x3,
// casts, shifts, broadcasts ... ~38 primitives per lookup).
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlxfast {

namespace mx = mlx::core;

// w [V, D * bits / 32] uint32 (MLX's affine format: codes LSB first, a plain
// bit stream per row for every bits), scales and biases [V, D / group_size]
// (float32/float16/bfloat16; biases absent: symmetric, -2^(bits-1) * scale),
// ids integer of any shape. Returns
// [*ids.shape, D] in `dtype` (default: scales' dtype), computed as
// scale * code + bias in float32 and rounded once. Out-of-range ids give
// zero rows.
mx::array dequantize_rows(const mx::array& w, const mx::array& scales,
                          const std::optional<mx::array>& biases, const mx::array& ids, int group_size, int bits,
                          std::optional<mx::Dtype> dtype = std::nullopt,
                          mx::StreamOrDevice s = {});

class DequantizeRows : public mx::Primitive {
 public:
  DequantizeRows(mx::Stream stream, int group_size, int bits, bool symmetric = false)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits), symmetric_(symmetric) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastDequantizeRows"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const DequantizeRows&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && symmetric_ == o.symmetric_;
  }

 private:
  int group_size_;
  int bits_;
  bool symmetric_;  // no biases: the slot holds the scales again
};

} // namespace mlxfast
