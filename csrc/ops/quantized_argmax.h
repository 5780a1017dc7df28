// quantized_argmax(x, w, ...) = argmax over n of quantized_matmul(x, w, ...)
// (the fp32 kernel's logits, first index on ties, MLX's argmax), without
// computing most of them in fp32: the greedy choice of an output head.
//
// The head runs once with int8 activations (4x the multiply rate of fp32
// on VNNI), and `bounds` give, per output row n and 32-value block b of x, a
// rigorous bound c[n][b] on how far that row's int8 logit can be from its
// fp32 one per unit of the block's activation scale d[b] (qmm::Args
// int8_acts: d = max|x| / 127): |fp32 - int8| <= sum_b d[b] * c[n][b]. A
// row whose upper bound is below the best lower bound cannot be the argmax;
// the 16-row blocks holding any row that can are computed again in fp32, by
// the same kernel the full head runs, so their logits are the same bits, and
// the argmax is taken over them. On the default model's head at most a few
// dozen of 3,072 blocks remain (ops.argmax_bounds builds c; see its note).
// A row whose numbers are not finite (NaN or inf in x, overflowing logits)
// gets the whole fp32 head and MLX's argmax rule (the first NaN, else the
// first maximum). Above kRows16InvariantMaxRows rows (where the fp32
// kernel's arithmetic depends on the call) every row does.
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlxfast {

namespace mx = mlx::core;

// x: [..., K] float32, float16 or bfloat16; w: row-interleaved
// [N / 16, K * bits / 32, 16] uint32 (ops.pack_rows16), bits 4 or 8;
// scales, biases as for quantized_matmul (biases absent: symmetric);
// bounds: [N / 16, K / 32, 16] float16; norm_weight [K] (optional: the
// head's final norm, fused as quantized_matmul's, x then in the promoted
// dtype). The logits compared are the head's, rounded to that dtype (a half
// type's ties widen the screen by its ulp). Returns [...] uint32. Needs a
// CPU path with the rows16 int8 kernels (AVX2 or AVX-512):
// ops.quantized_argmax checks.
mx::array quantized_argmax(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const std::optional<mx::array>& biases, const mx::array& bounds,
                           int group_size, int bits, const std::optional<mx::array>& norm_weight,
                           float eps, mx::StreamOrDevice s = {});

class QuantizedArgmax : public mx::Primitive {
 public:
  QuantizedArgmax(mx::Stream stream, int group_size, int bits, bool symmetric, bool norm,
                  float eps)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits), symmetric_(symmetric),
        norm_(norm), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastQuantizedArgmax"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QuantizedArgmax&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && symmetric_ == o.symmetric_ &&
           norm_ == o.norm_ && eps_ == o.eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
  bool symmetric_;  // no biases: the slot holds the scales again
  bool norm_;       // inputs end with the norm's weight
  float eps_;
};

} // namespace mlxfast
