// sample_tokens: one token per row of processed logits [R, V] — greedy argmax,
// or temperature, top-k, top-p, min-p and a Gumbel-max draw — as one
// primitive, without sorting the vocabulary.
//
// The noise is MLX's own: row r's uniform numbers are those of
// mx.random.uniform(shape=(V,), key=keys[r]) (threefry2x32, the same counter
// layout and float conversion), generated only for the tokens that can still
// win. The semantics are python/mlxfast/ops/sampling.py's sample_tokens_reference.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlxfast {

namespace mx = mlx::core;

// logits [R, V] float32/float16/bfloat16; keys [R, 2] uint32; temperature,
// top_p, min_p_log [R] float32; top_k [R] int32. Per row: temperature <= 0 is
// greedy (argmax of the logits); top_k outside (0, V) and top_p outside (0, 1)
// are off; min_p_log = log(min_p), -inf when off. Returns [R] uint32.
mx::array sample_tokens(const mx::array& logits, const mx::array& keys,
                        const mx::array& temperature, const mx::array& top_k,
                        const mx::array& top_p, const mx::array& min_p_log,
                        mx::StreamOrDevice s = {});

class SampleTokens : public mx::Primitive {
 public:
  explicit SampleTokens(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "SampleTokens"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0)}};
  }
};

} // namespace mlxfast
