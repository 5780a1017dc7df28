// Mixture-of-experts layer ops (python/mlxfast/ops/moe.py):
//
// moe_route(logits [..., E], k): each token's top-k experts and their weights
// (softmax over all experts then top k, optionally renormalised: Qwen3-MoE;
// or top k logits then their softmax: Mixtral), one primitive, two outputs.
//
// moe_experts(x [..., D], inds [..., k], scores [..., k], gate, up, down):
// sum_j scores[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = inds[t, j],
// over the stacked expert weights ([E, I, D] gate/up, [E, D, I] down; MLX
// affine-quantized or dense), one primitive per MoE layer. On the CPU the
// tokens are grouped by expert inside the kernel and each active expert's
// rows are read once for all of its tokens, straight from the stacked
// arrays (no copies): experts with few tokens run the quantized matmul's
// GEMV pieces (csrc/cpu/qmm.h, gemv_prepare / gemv_block) in one fan-out
// over (expert, row block) per projection, experts with many tokens its
// whole GEMM. Optional fused pieces as the projections take them: an RMSNorm
// of x first, a residual added last.
#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlxfast {

namespace mx = mlx::core;

// Returns {inds uint32 [..., k] (descending weight; ties: the lower id first),
// scores [..., k] in logits' dtype (computed in float32, rounded once)}.
std::vector<mx::array> moe_route(const mx::array& logits, int k, bool softmax_first,
                                 bool normalize, mx::StreamOrDevice s = {});

class MoeRoute : public mx::Primitive {
 public:
  MoeRoute(mx::Stream stream, int k, bool softmax_first, bool normalize)
      : mx::Primitive(stream), k_(k), softmax_first_(softmax_first), normalize_(normalize) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastMoeRoute"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const MoeRoute&>(other);
    return k_ == o.k_ && softmax_first_ == o.softmax_first_ && normalize_ == o.normalize_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int k_;
  bool softmax_first_, normalize_;
};

// One projection of every expert: w [E, out, in * bits / 32] uint32 with
// scales, biases [E, out, in / group_size] (bits > 0; no biases: a symmetric
// format, bias = -2^(bits-1) * scale, as GGUF's Q4_0 / Q8_0: fewer bytes to
// read), or w [E, out, in] float32/float16/bfloat16 (bits == 0, no scales).
struct ExpertWeights {
  mx::array w;
  std::optional<mx::array> scales, biases;
};

// x [..., D] float; inds [..., k] int32/uint32 (ids outside [0, E) add
// nothing); scores [..., k] float. Returns [..., D] in x's dtype (with a
// norm: the promoted dtype of x and the norm weight, as rms_norm), the sum
// over k in float32 in choice order, rounded once, then residual added as
// MLX's add. int8_acts (opt-in, quantized weights only): each projection's
// activations quantized to int8 per 32 values, as quantized_matmul's
// (qmm::Args::int8_acts). Inputs of the primitive: x, inds, scores, gate
// (w[, scales[, biases]]), up (...), down (...)[, norm_weight][, residual].
mx::array moe_experts(const mx::array& x, const mx::array& inds, const mx::array& scores,
                      const ExpertWeights& gate, const ExpertWeights& up,
                      const ExpertWeights& down, int group_size, int bits,
                      const std::optional<mx::array>& norm_weight, float eps,
                      const std::optional<mx::array>& residual, bool int8_acts = false,
                      mx::StreamOrDevice s = {});

class MoeExperts : public mx::Primitive {
 public:
  // sym: bit p set when projection p (gate, up, down) has no biases.
  MoeExperts(mx::Stream stream, int group_size, int bits, int sym, bool norm, float eps,
             bool residual, bool int8_acts)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits), sym_(sym), norm_(norm),
        eps_(eps), residual_(residual), int8_acts_(int8_acts) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastMoeExperts"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const MoeExperts&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && sym_ == o.sym_ && norm_ == o.norm_ &&
           eps_ == o.eps_ && residual_ == o.residual_ && int8_acts_ == o.int8_acts_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int group_size_, bits_, sym_;
  bool norm_;
  float eps_;
  bool residual_, int8_acts_;
};

} // namespace mlxfast
