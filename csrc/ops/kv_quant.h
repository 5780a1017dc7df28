// Quantized KV for the block pool: encode K/V rows into packed uint8 rows
// (affine 8/4-bit groups; TurboQuant rotated Lloyd-Max values), dequantize
// them, and fused paged attention over packed rows through block tables.
// Row layout and semantics: python/mlxfast/ops/kvquant.py.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlxfast {

namespace mx = mlx::core;

struct KVQuantParams {
  int head_dim, k_bits, v_bits, group_size;
  bool v_turbo;
  bool operator==(const KVQuantParams& o) const {
    return head_dim == o.head_dim && k_bits == o.k_bits && v_bits == o.v_bits &&
           group_size == o.group_size && v_turbo == o.v_turbo;
  }
  int row_bytes() const;
};

// k, v [..., D] float -> packed [..., row_bytes] uint8. signs float32 [D]
// (rotation, TurboQuant only; any [1] array otherwise); codebook float32
// [2^v_bits] sorted Lloyd-Max centroids (TurboQuant only).
mx::array kv_quant_encode(const mx::array& k, const mx::array& v, const mx::array& signs,
                          const mx::array& codebook, int head_dim, int k_bits, int v_bits,
                          int group_size, bool v_turbo, mx::StreamOrDevice s = {});

// packed [..., row_bytes] -> [k, v], each [..., D] in dtype.
std::vector<mx::array> kv_quant_dequant(const mx::array& packed, const mx::array& signs,
                                        const mx::array& codebook, int head_dim, int k_bits,
                                        int v_bits, int group_size, bool v_turbo,
                                        mx::Dtype dtype, mx::StreamOrDevice s = {});

// q [T, Hq, D]; packed [num_slots, Hkv, row_bytes]; block_tables [S, B],
// seq_idx [T], positions [T] int32, window (0: full causal; W > 0: keys
// positions[t] - W < j <= positions[t], earlier blocks' table entries never
// read) as paged_attention. -> [T, Hq, D] in q's dtype.
mx::array kv_quant_paged_attention(const mx::array& q, const mx::array& packed,
                                   const mx::array& block_tables, const mx::array& seq_idx,
                                   const mx::array& positions, const mx::array& signs,
                                   const mx::array& codebook, float scale, int block_size,
                                   int head_dim, int k_bits, int v_bits, int group_size,
                                   bool v_turbo, int window = 0, mx::StreamOrDevice s = {});

class KVQuantEncode : public mx::Primitive {
 public:
  KVQuantEncode(mx::Stream stream, KVQuantParams p) : mx::Primitive(stream), p_(p) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastKVQuantEncode"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return p_ == static_cast<const KVQuantEncode&>(other).p_;
  }

 private:
  KVQuantParams p_;
};

class KVQuantDequant : public mx::Primitive {
 public:
  KVQuantDequant(mx::Stream stream, KVQuantParams p) : mx::Primitive(stream), p_(p) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastKVQuantDequant"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return p_ == static_cast<const KVQuantDequant&>(other).p_;
  }

 private:
  KVQuantParams p_;
};

class KVQuantAttention : public mx::Primitive {
 public:
  KVQuantAttention(mx::Stream stream, KVQuantParams p, float scale, int block_size, int window)
      : mx::Primitive(stream), p_(p), scale_(scale), block_size_(block_size), window_(window) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxfastKVQuantAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const KVQuantAttention&>(other);
    return p_ == o.p_ && scale_ == o.scale_ && block_size_ == o.block_size_ &&
           window_ == o.window_;
  }

 private:
  KVQuantParams p_;
  float scale_;
  int block_size_;
  int window_;
};

} // namespace mlxfast
