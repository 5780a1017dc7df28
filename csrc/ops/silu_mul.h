// silu_mul(gate, up) = gate * sigmoid(gate) * up, the gated MLP activation,
// as one primitive instead of three.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlxfast {

namespace mx = mlx::core;

mx::array silu_mul(const mx::array& gate, const mx::array& up,
                   mx::StreamOrDevice s = {});

class SiluMul : public mx::Primitive {
 public:
  explicit SiluMul(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "SiluMul"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

} // namespace mlxfast
