#include "ops/paged_attention.h"

#include "common/cpu_eval.h"
#include "common/op_checks.h"
#include "common/dense_input.h"

#include <sstream>
#include <stdexcept>

#include "common/cpu_features.h"
#include "cpu/paged_attention.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace mlxfast {

namespace {

pa::DType to_pa(mx::Dtype dt) {
  if (dt == mx::float32) return pa::F32;
  if (dt == mx::float16) return pa::F16;
  return pa::BF16;
}

std::string shape_str(const mx::array& a) {
  std::ostringstream s;
  s << a.shape();
  return s.str();
}

} // namespace

namespace {

// q [..., Hq, D] -> [..., Hq, Dv] or [..., Hq * Dv].
mx::Shape attention_shape(const mx::array& q, int Dv, bool merge_heads) {
  mx::Shape shape(q.shape().begin(), q.shape().end() - 1);
  if (merge_heads) {
    shape.back() *= Dv;
  } else {
    shape.push_back(Dv);
  }
  return shape;
}

} // namespace

mx::array paged_attention(const mx::array& q, const mx::array& k_pool,
                          const mx::array& v_pool, const mx::array& block_tables,
                          const mx::array& seq_idx, const mx::array& positions,
                          float scale, int block_size, bool merge_heads, int window,
                          mx::StreamOrDevice s) {
  const char* op = "paged_attention";
  if (window < 0)
    fail(op, "window must be >= 0 (0: full causal attention), got " + std::to_string(window) + ".");
  if (q.ndim() < 3) fail(op, "q must be [..., Hq, D] (e.g. [T, Hq, D]), got " + shape_str(q) + ".");
  if (k_pool.ndim() != 3 || v_pool.ndim() != 3)
    fail(op, "k_pool and v_pool must be [num_slots, Hkv, D].");
  if (!is_float(q.dtype()) || !is_float(k_pool.dtype()))
    fail(op, "q and the pools must be float32, float16 or bfloat16.");
  if (k_pool.dtype() != v_pool.dtype()) fail(op, "k_pool and v_pool must share a dtype.");
  int Hq = q.shape(-2), D = q.shape(-1), Hkv = k_pool.shape(1);
  int64_t T = 1;
  for (int i = 0; i + 2 < static_cast<int>(q.ndim()); ++i) T *= q.shape(i);
  if (k_pool.shape(2) != D) fail(op, "q and k_pool head dims differ.");
  if (v_pool.shape(0) != k_pool.shape(0) || v_pool.shape(1) != Hkv)
    fail(op, "v_pool must match k_pool in slots and heads.");
  if (Hkv <= 0 || Hq % Hkv != 0)
    fail(op, "the number of query heads must be a multiple of the kv heads.");
  if (Hq / Hkv > pa::kMaxGroup || D > pa::kMaxHeadDim || v_pool.shape(2) > pa::kMaxHeadDim)
    fail(op, "head_dim or the GQA group is too large.");
  if (block_size <= 0 || block_size > pa::kMaxBlock || k_pool.shape(0) % block_size != 0)
    fail(op, "block_size must be in 1..1024 and divide the pool's slot count.");
  if (block_tables.ndim() != 2 || block_tables.dtype() != mx::int32)
    fail(op, "block_tables must be an int32 [S, B] array.");
  if (seq_idx.ndim() != 1 || positions.ndim() != 1 || seq_idx.shape(0) != T ||
      positions.shape(0) != T || seq_idx.dtype() != mx::int32 || positions.dtype() != mx::int32)
    fail(op, "seq_idx and positions must be int32 [T] arrays (T = the tokens in q).");
  auto stream = mx::to_stream(s);
  // Inputs go in as they are: eval_cpu packs any strided one (DenseInput)
  // instead of adding a Contiguous node per input per call.
  std::vector<mx::array> in = {q, k_pool, v_pool, block_tables, seq_idx, positions};
  return mx::array(attention_shape(q, v_pool.shape(2), merge_heads), q.dtype(),
                   std::make_shared<PagedAttention>(stream, scale, block_size, merge_heads, window),
                   std::move(in));
}

std::vector<mx::Shape> PagedAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {attention_shape(inputs[0], inputs[2].shape(2), merge_heads_)};
}

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  auto& enc = begin_eval(stream(), inputs, outputs);
  std::vector<DenseInput> dense;
  for (auto& x : inputs) dense.push_back(dense_input(x, enc));
  pa::Args a;
  a.q = dense[0].data;
  a.k = dense[1].data;
  a.v = dense[2].data;
  a.out = out.data<void>();
  a.tables = dense[3].as<int32_t>();
  a.seq_idx = dense[4].as<int32_t>();
  a.pos = dense[5].as<int32_t>();
  a.T = inputs[4].shape(0);
  a.S = inputs[3].shape(0);
  a.B = inputs[3].shape(1);
  a.num_slots = inputs[1].shape(0);
  a.Hq = inputs[0].shape(-2);
  a.Hkv = inputs[1].shape(1);
  a.D = inputs[0].shape(-1);
  a.Dv = inputs[2].shape(2);
  a.bs = block_size_;
  a.window = window_;
  a.scale = scale_;
  a.q_dtype = to_pa(inputs[0].dtype());
  a.kv_dtype = to_pa(inputs[1].dtype());
  if (a.T == 0 || a.Hq == 0) return;
  CpuPath path = cpu_path();
  enc.dispatch([a, path, dense = std::move(dense)]() {
    for (auto& d : dense) d.pack();
    switch (path) {
#if defined(MLXFAST_X86)
      case CpuPath::Avx512: pa::run_avx512(a); break;
      case CpuPath::Avx2: pa::run_avx2(a); break;
#endif
      default: pa::run_portable(a); break;
    }
  });
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[mlxfast.paged_attention] no GPU kernel; mlxfast.ops uses the MLX reference on GPU.");
}

} // namespace mlxfast
