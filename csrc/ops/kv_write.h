// kv_write(pool, slots, values): pool with pool[slots[t]] = values[t].
// kv_write_pair(k_pool, v_pool, slots, k, v): both pools of a layer at once.
//
// A pool is updated in place when MLX may donate its buffer (no other
// reference to the old pool array), which the KV caches arrange by rebinding
// their storage to the result; otherwise the pool is copied first, unless
// `inplace`: then it is written in place whatever else references it. That is
// for a pool several layers write within one graph (a KV pool's storage slot
// shared by KV groups): the earlier layers' readers of the old version run
// before the write on the same CPU stream (the write's values depend on
// them), so no reader sees the new rows; the caller guarantees no other
// reader of the old version is pending.
// One primitive, where MLX's indexed assignment builds ~6 per write.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlxfast {

namespace mx = mlx::core;

// pool [S, ...]; slots [T] int32; values [..., <pool's trailing shape>] with
// T rows in its leading axes (e.g. [B, L, H, D] for a [S, H, D] pool), in
// pool's dtype or, for a float pool, another float type (float32, float16,
// bfloat16): converted as astype would, in the write. Out-of-range slots are
// skipped.
mx::array kv_write(const mx::array& pool, const mx::array& slots, const mx::array& values,
                   bool inplace = false, mx::StreamOrDevice s = {});

// The same for two pools sharing the slots: one primitive, two outputs.
std::vector<mx::array> kv_write_pair(const mx::array& k_pool, const mx::array& v_pool,
                                     const mx::array& slots, const mx::array& k,
                                     const mx::array& v, bool inplace = false,
                                     mx::StreamOrDevice s = {});

// Inputs: n pools, the slots, n value arrays; outputs: the n updated pools.
class KvWrite : public mx::Primitive {
 public:
  KvWrite(mx::Stream stream, bool inplace) : mx::Primitive(stream), inplace_(inplace) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastKvWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return inplace_ == static_cast<const KvWrite&>(other).inplace_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> out;
    for (size_t i = 0; i < (inputs.size() - 1) / 2; ++i) out.push_back(inputs[i].shape());
    return out;
  }

 private:
  bool inplace_;
};

} // namespace mlxfast
