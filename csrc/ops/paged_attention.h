// paged_attention: each query token attends over its own sequence's KV, read
// straight from the block pool through block tables (one primitive per layer
// instead of gather + mask + SDPA).
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlxfast {

namespace mx = mlx::core;

// q [..., Hq, D] float32/float16/bfloat16 (T tokens in its leading axes,
// e.g. [T, Hq, D] or [B, L, Hq, D]); k_pool [num_slots, Hkv, D] and
// v_pool [num_slots, Hkv, Dv] (same float dtype, any of the three);
// block_tables [S, B] int32; seq_idx [T] int32; positions [T] int32.
// Token t attends keys 0..positions[t] of sequence seq_idx[t] (window W > 0:
// only keys j with positions[t] - W < j <= positions[t]); key j is slot
// block_tables[s, j / block_size] * block_size + j % block_size. With a
// window, table entries of blocks wholly before a token's window start are
// never read (they may hold any value).
// Returns [..., Hq, Dv] in q's dtype (float32 accumulation, online softmax),
// or [..., Hq * Dv] with merge_heads (the layout the output projection takes).
mx::array paged_attention(const mx::array& q, const mx::array& k_pool,
                          const mx::array& v_pool, const mx::array& block_tables,
                          const mx::array& seq_idx, const mx::array& positions,
                          float scale, int block_size, bool merge_heads = false,
                          int window = 0, mx::StreamOrDevice s = {});

class PagedAttention : public mx::Primitive {
 public:
  PagedAttention(mx::Stream stream, float scale, int block_size, bool merge_heads, int window)
      : mx::Primitive(stream), scale_(scale), block_size_(block_size),
        merge_heads_(merge_heads), window_(window) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastPagedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const PagedAttention&>(other);
    return scale_ == o.scale_ && block_size_ == o.block_size_ &&
           merge_heads_ == o.merge_heads_ && window_ == o.window_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  int block_size_;
  bool merge_heads_;
  int window_;
};

} // namespace mlxfast
