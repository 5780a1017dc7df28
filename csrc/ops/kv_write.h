// kv_write(pool, slots, values): pool with pool[slots[t]] = values[t].
//
// The pool is updated in place when MLX may donate its buffer (no other
// reference to the old pool array), which the KV schemes arrange by
// rebinding their storage to the result; otherwise the pool is copied first.
// One primitive, where MLX's indexed assignment builds ~6 per write.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlxfast {

namespace mx = mlx::core;

mx::array kv_write(const mx::array& pool, const mx::array& slots, const mx::array& values,
                   mx::StreamOrDevice s = {});

class KvWrite : public mx::Primitive {
 public:
  explicit KvWrite(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastKvWrite"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

} // namespace mlxfast
