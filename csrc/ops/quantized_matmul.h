// quantized_matmul(x, w, scales, biases) = x @ dequantize(w).T for MLX's
// affine quantization (transpose=True), and dense_matmul(x, w) = x @ w.T,
// as primitives with native CPU kernels: a weight-streaming GEMV path for
// few rows and a blocked GEMM path for many, per ISA (portable, AVX2,
// AVX-512, NEON). Both share one driver (csrc/cpu/qmm_*.cpp); dense weights
// are "bits 0" there.
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

// x: [..., K], w: [N, K], both float32/float16/bfloat16 (any mix).
// Returns [..., N] in x's dtype, accumulated in float32. MLX's CPU matmul
// is a reference BLAS at ~3-4 GFLOP/s on Linux; this is the path for
// unquantized models.
mx::array dense_matmul(const mx::array& x, const mx::array& w, mx::StreamOrDevice s = {});

class DenseMatmul : public mx::Primitive {
 public:
  explicit DenseMatmul(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastDenseMatmul"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;
};

} // namespace mlxfast
