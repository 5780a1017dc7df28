// silu_mul(gate, up) = gate * sigmoid(gate) * up, the gated MLP activation,
// as one primitive instead of three.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

#include "common/cpu_features.h"

namespace mlxfast {

namespace mx = mlx::core;

mx::array silu_mul(const mx::array& gate, const mx::array& up,
                   mx::StreamOrDevice s = {});

// The same with gate and up as the two halves of one array's last axis (the
// output of a fused gate/up projection): [..., 2M] -> [..., M].
mx::array silu_mul_halves(const mx::array& gate_up, mx::StreamOrDevice s = {});

// The silu_mul_halves kernel on dense rows, for other primitives that fuse
// it (a projection's prologue): gate_up [rows, 2m] -> out [rows, m], both in
// dt, on the given CPU path. Fans out over the thread pool; call it inside a
// dispatched task. Same numbers as the SiluMul primitive (both run the
// same row kernels).
void silu_mul_halves_rows(const void* gate_up, void* out, int64_t rows, int64_t m,
                          mx::Dtype dt, CpuPath path);

class SiluMul : public mx::Primitive {
 public:
  SiluMul(mx::Stream stream, bool halves) : mx::Primitive(stream), halves_(halves) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "SiluMul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return halves_ == static_cast<const SiluMul&>(other).halves_;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    if (halves_) shape.back() /= 2;
    return {shape};
  }

 private:
  bool halves_;
};

} // namespace mlxfast
