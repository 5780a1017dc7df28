// Rotary position embedding with one position per token.
//
// x [..., H, D]: every leading index is one token, whose position comes from
// positions (int32, shape x.shape[:-2]); all H heads of a token share its
// angles. Rotates the first `dims` features, in MLX's layout ("half":
// (i, i + dims/2) pairs) or the traditional one ((2i, 2i+1) pairs).
// Frequencies: base^(-2i/dims), or 1/freqs[i] when freqs is given; the angle
// is scale * position * frequency. MLX's fast::rope has no CPU kernel and runs
// as ~15 primitives on the CPU; this is one.
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlxfast {

namespace mx = mlx::core;

mx::array rope(const mx::array& x, const mx::array& positions, int dims, bool traditional,
               std::optional<float> base, float scale, const std::optional<mx::array>& freqs,
               mx::StreamOrDevice s = {});

class Rope : public mx::Primitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float base, float scale, bool has_freqs)
      : mx::Primitive(stream), dims_(dims), traditional_(traditional), base_(base),
        scale_(scale), has_freqs_(has_freqs) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ &&
           scale_ == o.scale_ && has_freqs_ == o.has_freqs_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
  bool has_freqs_;
};

} // namespace mlxfast
