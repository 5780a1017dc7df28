// rms_norm(x, w, eps) = x / sqrt(mean(x^2) + eps) * w over the last axis.
// MLX's fast::rms_norm has no CPU kernel: on the CPU it runs as ~10
// primitives, once per norm, twice per layer. This is one.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlxfast {

namespace mx = mlx::core;

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps,
                   mx::StreamOrDevice s = {});

// The rules of every rms_norm, on its own or fused into another op's
// prologue (projections, MoE experts), decided here only: weight [D] with
// D = x.shape[-1], a float weight, eps >= 0 (else ValueError
// "[mlxfast.<op>] <what>weight ..."; what is "" or "norm "), and the
// normalised x has the promoted dtype of x and the weight, as
// mx.fast.rms_norm's result does. Returns x cast to that dtype.
mx::array rms_norm_input(const char* op, const char* what, const mx::array& x,
                         const mx::array& weight, float eps, mx::Stream s);

// The kernel on dense rows, for other primitives that fuse a norm (the
// projections' prologue): x and out [rows, d] in dt, w [d] in wt. Fans out
// over the thread pool; call it inside a dispatched task. Same numbers as
// the RmsNorm primitive (it runs this).
void rms_norm_rows(mx::Dtype dt, const void* x, mx::Dtype wt, const void* w, void* out,
                   int64_t rows, int64_t d, float eps);

class RmsNorm : public mx::Primitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
};

} // namespace mlxfast
