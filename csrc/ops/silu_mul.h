// The gated MLP activations act(gate) * up as one primitive instead of three
// or more: silu_mul (silu(gate) * up, Llama's MLP) and gelu_mul
// (gelu_approx(gate) * up with the tanh approximation, Gemma's MLP).
#pragma once

#include <optional>
#include <string>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

#include "common/cpu_features.h"

namespace mlxfast {

namespace mx = mlx::core;

enum class GatedAct : int { Silu = 0, GeluTanh = 1 };

mx::array silu_mul(const mx::array& gate, const mx::array& up,
                   mx::StreamOrDevice s = {});

// The same with gate and up as the two halves of one array's last axis (the
// output of a fused gate/up projection): [..., 2M] -> [..., M].
mx::array silu_mul_halves(const mx::array& gate_up, mx::StreamOrDevice s = {});

// gelu_approx(gate) * up, gelu_approx(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x +
// 0.044715 x^3))) (MLX's nn.gelu_approx), computed in float32.
mx::array gelu_mul(const mx::array& gate, const mx::array& up,
                   mx::StreamOrDevice s = {});
mx::array gelu_mul_halves(const mx::array& gate_up, mx::StreamOrDevice s = {});

// The act= names the projections' prologue takes (Fusion::act): the one
// place that maps them to activations. nullopt for any other name.
std::optional<GatedAct> gated_act_from_halves_name(const std::string& name);
// The valid names for messages: "'silu_mul_halves', 'gelu_mul_halves'".
std::string gated_act_halves_names();

// The *_halves kernel on dense rows, for other primitives that fuse it (a
// projection's prologue): gate_up [rows, 2m] -> out [rows, m], both in dt,
// on the given CPU path. Fans out over the thread pool; call it inside a
// dispatched task. Same numbers as the GatedMul primitive (both run the
// same row kernels).
void gated_mul_halves_rows(GatedAct act, const void* gate_up, void* out, int64_t rows,
                           int64_t m, mx::Dtype dt, CpuPath path);

class GatedMul : public mx::Primitive {
 public:
  GatedMul(mx::Stream stream, GatedAct act, bool halves)
      : mx::Primitive(stream), act_(act), halves_(halves) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return act_ == GatedAct::Silu ? "SiluMul" : "GeluMul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const GatedMul&>(other);
    return act_ == o.act_ && halves_ == o.halves_;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    if (halves_) shape.back() /= 2;
    return {shape};
  }

 private:
  GatedAct act_;
  bool halves_;
};

} // namespace mlxfast
