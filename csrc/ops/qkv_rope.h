// qkv_rope: the attention block's input side as one primitive.
//
// From the fused projection qkv [..., (Hq + 2*Hkv) * D] (q heads, then k
// heads, then v heads) and one int32 position per token (qkv.shape[:-1]):
//   q = rope(rms_norm(q_heads, q_norm)) [..., Hq, D]
//   k = rope(rms_norm(k_heads, k_norm)) [..., Hkv, D]
//   v = v_heads                          [..., Hkv, D]
// The per-head RMSNorm (qwen3) is applied only when its weights are given.
// Replaces three projections' reshapes, two norms and two ropes (7+ ops).
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlxfast {

namespace mx = mlx::core;

struct QkvRopeParams {
  int n_heads, n_kv_heads, head_dim;
  int dims;  // rotated features per head
  bool traditional;
  float base, scale, eps;
  bool has_freqs, has_norm;
  bool operator==(const QkvRopeParams& o) const {
    return n_heads == o.n_heads && n_kv_heads == o.n_kv_heads && head_dim == o.head_dim &&
           dims == o.dims && traditional == o.traditional && base == o.base &&
           scale == o.scale && eps == o.eps && has_freqs == o.has_freqs && has_norm == o.has_norm;
  }
};

std::vector<mx::array> qkv_rope(const mx::array& qkv, const mx::array& positions, int n_heads,
                                int n_kv_heads, int head_dim, int dims, bool traditional,
                                std::optional<float> base, float scale,
                                const std::optional<mx::array>& freqs,
                                const std::optional<mx::array>& q_norm,
                                const std::optional<mx::array>& k_norm, float eps,
                                mx::StreamOrDevice s = {});

class QkvRope : public mx::Primitive {
 public:
  QkvRope(mx::Stream stream, QkvRopeParams p) : mx::Primitive(stream), p_(p) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastQkvRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return p_ == static_cast<const QkvRope&>(other).p_;
  }

 private:
  QkvRopeParams p_;
};

} // namespace mlxfast
