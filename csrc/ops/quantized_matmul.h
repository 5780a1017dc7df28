// quantized_matmul(x, w, scales, biases) = x @ dequantize(w).T for MLX's
// affine quantization (transpose=True), as one primitive with native CPU
// kernels: a weight-streaming GEMV path for few rows and a blocked GEMM path
// for many, per ISA (portable, AVX2, AVX-512, NEON).
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlxfast {

namespace mx = mlx::core;

// x: [..., K] float32/float16/bfloat16; w: [N, K * bits / 32] uint32;
// scales, biases: [N, K / group_size] float32/float16/bfloat16 (same dtype).
// Returns [..., N] in x's dtype, accumulated in float32.
mx::array quantized_matmul(const mx::array& x, const mx::array& w,
                           const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, mx::StreamOrDevice s = {});

class QuantizedMatmul : public mx::Primitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastQuantizedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QuantizedMatmul&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
};

} // namespace mlxfast
