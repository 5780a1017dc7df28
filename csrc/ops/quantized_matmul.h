// quantized_matmul(x, w, scales, biases) = x @ dequantize(w).T for MLX's
// affine quantization (transpose=True), and dense_matmul(x, w) = x @ w.T,
// as primitives with native CPU kernels: a weight-streaming GEMV path for
// few rows and a blocked GEMM path for many, per ISA (portable, AVX2,
// AVX-512, NEON). Both share one driver (csrc/cpu/qmm_*.cpp); dense weights
// are "bits 0" there.
//
// Both take optional fused pieces (struct Fusion): a prologue on x (rms_norm,
// silu_mul_halves or gelu_mul_halves) and a residual-add epilogue, so that
// the small ops around a layer's projections cost no primitive of their own.
// Each piece gives bit-identical numbers to the separate op: the prologue
// runs the separate op's own kernel into a per-thread scratch in x's dtype,
// then the unchanged matmul kernel reads it; the epilogue adds as MLX's add
// does.
#pragma once

#include <optional>
#include <string>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

#include "ops/silu_mul.h"

namespace mlxfast {

namespace mx = mlx::core;

namespace qmm {
struct Args;
}
enum class CpuPath;

// The whole matmul a (with its fan-out) on the given CPU path: the int8
// kernel where a.int8_acts (VNNI on AVX-512 VNNI CPUs, else the portable
// one), else the path's. The MoE experts' large ones run through it too.
void run_qmm(const qmm::Args& a, CpuPath path);

// Optional pieces fused into a projection primitive.
struct Fusion {
  // Prologue, at most one. norm_weight [D] (D = x.shape[-1]): the matmul
  // consumes rms_norm(x, norm_weight, eps) (x is first cast to the promoted
  // dtype of x and the weight, as rms_norm does). act == "silu_mul_halves"
  // or "gelu_mul_halves" (see gated_act_from_halves_name): it consumes that
  // op of x (x = [..., 2K], gate then up).
  std::optional<mx::array> norm_weight;
  float eps = 0.f;
  std::string act;
  // Epilogue: the output is residual + (x @ W.T), residual with the output's
  // shape and dtype, added in float32 and rounded once (MLX's add).
  std::optional<mx::array> residual;
};

// The fused pieces as a primitive stores and compares them.
struct FusedSpec {
  enum Prologue : int { None = 0, Norm = 1, ActHalves = 2 };
  Prologue prologue = None;
  GatedAct act = GatedAct::Silu;  // with ActHalves
  float eps = 0.f;
  bool residual = false;
  bool operator==(const FusedSpec& o) const {
    return prologue == o.prologue && act == o.act && eps == o.eps && residual == o.residual;
  }
};

// x: [..., K] float32/float16/bfloat16; w: [N, K * bits / 32] uint32;
// scales, biases: [N, K / group_size] float32/float16/bfloat16 (same dtype);
// biases absent for a symmetric format (every bias -2^(bits-1) * scale, GGUF's
// Q4_0 / Q8_0): the kernels compute them, and the matmul reads no bias stream.
// Returns [..., N] in x's dtype, accumulated in float32. With f.act, x is
// [..., 2K]; with f.norm_weight, the output has the norm's promoted dtype.
// Inputs of the primitive: x, w, scales, biases[, norm_weight][, residual]
// (symmetric: scales in the biases slot, unread).
// int8_acts: the matmul quantizes x to int8 per 32 values (qmm::Args::int8_acts;
// VNNI kernel where cpu_has_avx512_vnni(), the portable one elsewhere) —
// the prologue and residual are unchanged.
mx::array quantized_matmul(const mx::array& x, const mx::array& w,
                           const mx::array& scales, const std::optional<mx::array>& biases,
                           int group_size, int bits, const Fusion& f = {},
                           bool int8_acts = false, mx::StreamOrDevice s = {});

// Test hook: the kernels on evaluated arrays, on the calling thread's pool,
// with biases == nullptr when `biases` is absent (symmetric formats) and the
// CPU path given by name. x [M, K]
// float32; returns [M, N] float32.
mx::array quantized_matmul_direct(const mx::array& x, const mx::array& w,
                                  const mx::array& scales, const std::optional<mx::array>& biases,
                                  int group_size, int bits, bool int8_acts,
                                  const std::string& path);

class QuantizedMatmul : public mx::Primitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits, FusedSpec spec = {},
                  bool int8_acts = false, bool symmetric = false)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits), spec_(spec),
        int8_acts_(int8_acts), symmetric_(symmetric) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastQuantizedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QuantizedMatmul&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && spec_ == o.spec_ &&
           int8_acts_ == o.int8_acts_ && symmetric_ == o.symmetric_;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
  FusedSpec spec_;
  bool int8_acts_;
  bool symmetric_;  // no biases: the slot holds the scales again
};

// x: [..., K], w: [N, K], both float32/float16/bfloat16 (any mix).
// Returns [..., N] in x's dtype, accumulated in float32. MLX's CPU matmul
// is a reference BLAS at ~3-4 GFLOP/s on Linux; this is the path for
// unquantized models. Fusion as for quantized_matmul; inputs of the
// primitive: x, w[, norm_weight][, residual].
mx::array dense_matmul(const mx::array& x, const mx::array& w, const Fusion& f = {},
                       mx::StreamOrDevice s = {});

class DenseMatmul : public mx::Primitive {
 public:
  explicit DenseMatmul(mx::Stream stream, FusedSpec spec = {})
      : mx::Primitive(stream), spec_(spec) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastDenseMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return spec_ == static_cast<const DenseMatmul&>(other).spec_;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  FusedSpec spec_;
};

} // namespace mlxfast
