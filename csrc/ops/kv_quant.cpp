#include "ops/kv_quant.h"

#include <sstream>
#include <stdexcept>

#include "common/cpu_eval.h"
#include "common/op_checks.h"
#include "common/cpu_features.h"
#include "common/thread_pool.h"
#include "cpu/kv_quant.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace mlxfast {

namespace kvq {
int threads_for_kernels() { return num_threads(); }
} // namespace kvq

namespace {

pa::DType to_pa(mx::Dtype dt) {
  if (dt == mx::float32) return pa::F32;
  if (dt == mx::float16) return pa::F16;
  return pa::BF16;
}

KVQuantParams check_params(const char* op, int D, int kb, int vb, int g, bool turbo) {
  if (kb != 4 && kb != 8) fail(op, "k_bits must be 4 or 8.");
  if (turbo ? (vb < 2 || vb > 4) : (vb != 4 && vb != 8))
    fail(op, "v_bits must be 2, 3 or 4 (TurboQuant) or 4 or 8 (affine).");
  if (D <= 0 || D % 8 != 0 || D > pa::kMaxHeadDim)
    fail(op, "head_dim must be a positive multiple of 8, at most 512.");
  if (g <= 0 || g % 8 != 0 || D % g != 0) fail(op, "group_size must divide head_dim (multiple of 8).");
  if (turbo && (D & (D - 1)) != 0) fail(op, "TurboQuant needs a power-of-two head_dim.");
  return KVQuantParams{D, kb, vb, g, turbo};
}

void check_tables(const char* op, const mx::array& signs, const mx::array& codebook,
                  const KVQuantParams& p) {
  if (signs.dtype() != mx::float32 || codebook.dtype() != mx::float32)
    fail(op, "signs and codebook must be float32.");
  if (p.v_turbo && (signs.size() != static_cast<size_t>(p.head_dim) ||
                    codebook.size() != (1u << p.v_bits)))
    fail(op, "TurboQuant needs signs [head_dim] and a codebook [2^v_bits].");
}

kvq::Fmt fmt_of(const KVQuantParams& p) {
  return kvq::make_fmt(p.head_dim, p.k_bits, p.v_bits, p.group_size, p.v_turbo);
}

std::string shape_str(const mx::array& a) {
  std::ostringstream s;
  s << a.shape();
  return s.str();
}

} // namespace

int KVQuantParams::row_bytes() const { return fmt_of(*this).row; }

mx::array kv_quant_encode(const mx::array& k, const mx::array& v, const mx::array& signs,
                          const mx::array& codebook, int head_dim, int k_bits, int v_bits,
                          int group_size, bool v_turbo, mx::StreamOrDevice s) {
  const char* op = "kv_quant_encode";
  auto p = check_params(op, head_dim, k_bits, v_bits, group_size, v_turbo);
  check_tables(op, signs, codebook, p);
  if (k.ndim() < 1 || k.shape() != v.shape() || k.shape(-1) != head_dim)
    fail(op, "k and v must share a shape [..., head_dim], got " + shape_str(k) + " and " +
                 shape_str(v) + ".");
  if (!is_float(k.dtype())) fail(op, "k and v must be float32, float16 or bfloat16.");
  auto stream = mx::to_stream(s);
  const mx::array vv = v.dtype() == k.dtype() ? v : mx::astype(v, k.dtype(), stream);
  std::vector<mx::array> in;
  for (auto* a : {&k, &vv, &signs, &codebook}) in.push_back(mx::contiguous(*a, false, stream));
  mx::Shape shape = k.shape();
  shape.back() = p.row_bytes();
  return mx::array(shape, mx::uint8, std::make_shared<KVQuantEncode>(stream, p), std::move(in));
}

void KVQuantEncode::eval_cpu(const std::vector<mx::array>& inputs,
                             std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  auto& enc = begin_eval(stream(), inputs, outputs);
  kvq::EncodeArgs a;
  a.k = inputs[0].data<void>();
  a.v = inputs[1].data<void>();
  a.signs = inputs[2].data<float>();
  a.codebook = inputs[3].data<float>();
  a.out = out.data<uint8_t>();
  a.f = fmt_of(p_);
  a.n = inputs[0].size() / p_.head_dim;
  a.dtype = to_pa(inputs[0].dtype());
  if (a.n == 0) return;
  CpuPath path = cpu_path();
  enc.dispatch([a, path]() {
    switch (path) {
#if defined(MLXFAST_X86)
      case CpuPath::Avx512: kvq::encode_avx512(a); break;
      case CpuPath::Avx2: kvq::encode_avx2(a); break;
#endif
#if defined(MLXFAST_ARM64)
      case CpuPath::Neon: kvq::encode_neon(a); break;
#endif
      default: kvq::encode_portable(a); break;
    }
  });
}

void KVQuantEncode::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxfast.kv_quant_encode] no GPU kernel; mlxfast.ops uses the MLX reference.");
}

std::vector<mx::array> kv_quant_dequant(const mx::array& packed, const mx::array& signs,
                                        const mx::array& codebook, int head_dim, int k_bits,
                                        int v_bits, int group_size, bool v_turbo,
                                        mx::Dtype dtype, mx::StreamOrDevice s) {
  const char* op = "kv_quant_dequant";
  auto p = check_params(op, head_dim, k_bits, v_bits, group_size, v_turbo);
  check_tables(op, signs, codebook, p);
  if (packed.dtype() != mx::uint8 || packed.ndim() < 1 || packed.shape(-1) != p.row_bytes())
    fail(op, "packed must be uint8 [..., row_bytes], got " + shape_str(packed) + ".");
  if (!is_float(dtype)) fail(op, "dtype must be float32, float16 or bfloat16.");
  auto stream = mx::to_stream(s);
  std::vector<mx::array> in;
  for (auto* a : {&packed, &signs, &codebook}) in.push_back(mx::contiguous(*a, false, stream));
  mx::Shape shape = packed.shape();
  shape.back() = head_dim;
  return mx::array::make_arrays({shape, shape}, {dtype, dtype},
                                std::make_shared<KVQuantDequant>(stream, p), std::move(in));
}

void KVQuantDequant::eval_cpu(const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs) {
  auto& enc = begin_eval(stream(), inputs, outputs);
  kvq::DequantArgs a;
  a.packed = inputs[0].data<uint8_t>();
  a.signs = inputs[1].data<float>();
  a.codebook = inputs[2].data<float>();
  a.k = outputs[0].data<void>();
  a.v = outputs[1].data<void>();
  a.f = fmt_of(p_);
  a.n = outputs[0].size() / p_.head_dim;
  a.dtype = to_pa(outputs[0].dtype());
  if (a.n == 0) return;
  CpuPath path = cpu_path();
  enc.dispatch([a, path]() {
    switch (path) {
#if defined(MLXFAST_X86)
      case CpuPath::Avx512: kvq::dequant_avx512(a); break;
      case CpuPath::Avx2: kvq::dequant_avx2(a); break;
#endif
#if defined(MLXFAST_ARM64)
      case CpuPath::Neon: kvq::dequant_neon(a); break;
#endif
      default: kvq::dequant_portable(a); break;
    }
  });
}

void KVQuantDequant::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxfast.kv_quant_dequant] no GPU kernel; mlxfast.ops uses the MLX reference.");
}

mx::array kv_quant_paged_attention(const mx::array& q, const mx::array& packed,
                                   const mx::array& block_tables, const mx::array& seq_idx,
                                   const mx::array& positions, const mx::array& signs,
                                   const mx::array& codebook, float scale, int block_size,
                                   int head_dim, int k_bits, int v_bits, int group_size,
                                   bool v_turbo, int window, mx::StreamOrDevice s) {
  const char* op = "kv_quant_paged_attention";
  auto p = check_params(op, head_dim, k_bits, v_bits, group_size, v_turbo);
  if (window < 0)
    fail(op, "window must be >= 0 (0: full causal attention), got " + std::to_string(window) + ".");
  check_tables(op, signs, codebook, p);
  if (q.ndim() != 3 || q.shape(2) != head_dim)
    fail(op, "q must be [T, Hq, head_dim], got " + shape_str(q) + ".");
  if (!is_float(q.dtype())) fail(op, "q must be float32, float16 or bfloat16.");
  if (packed.ndim() != 3 || packed.dtype() != mx::uint8 || packed.shape(2) != p.row_bytes())
    fail(op, "packed must be uint8 [num_slots, Hkv, row_bytes], got " + shape_str(packed) + ".");
  int Hq = q.shape(1), Hkv = packed.shape(1);
  if (Hkv <= 0 || Hq % Hkv != 0) fail(op, "the number of query heads must be a multiple of the kv heads.");
  if (Hq / Hkv > pa::kMaxGroup) fail(op, "the GQA group is too large.");
  if (block_size <= 0 || block_size > pa::kMaxBlock || packed.shape(0) % block_size != 0)
    fail(op, "block_size must be in 1..1024 and divide the pool's slot count.");
  if (block_tables.ndim() != 2 || block_tables.dtype() != mx::int32)
    fail(op, "block_tables must be an int32 [S, B] array.");
  int64_t T = q.shape(0);
  if (seq_idx.ndim() != 1 || positions.ndim() != 1 || seq_idx.shape(0) != T ||
      positions.shape(0) != T || seq_idx.dtype() != mx::int32 || positions.dtype() != mx::int32)
    fail(op, "seq_idx and positions must be int32 [T] arrays.");
  auto stream = mx::to_stream(s);
  std::vector<mx::array> in;
  for (auto* a : {&q, &packed, &block_tables, &seq_idx, &positions, &signs, &codebook})
    in.push_back(mx::contiguous(*a, false, stream));
  return mx::array(q.shape(), q.dtype(),
                   std::make_shared<KVQuantAttention>(stream, p, scale, block_size, window),
                   std::move(in));
}

void KVQuantAttention::eval_cpu(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  auto& enc = begin_eval(stream(), inputs, outputs);
  kvq::AttnArgs a;
  a.q = inputs[0].data<void>();
  a.packed = inputs[1].data<uint8_t>();
  a.tables = inputs[2].data<int32_t>();
  a.seq_idx = inputs[3].data<int32_t>();
  a.pos = inputs[4].data<int32_t>();
  a.signs = inputs[5].data<float>();
  a.codebook = inputs[6].data<float>();
  a.out = out.data<void>();
  a.T = inputs[0].shape(0);
  a.Hq = inputs[0].shape(1);
  a.S = inputs[2].shape(0);
  a.B = inputs[2].shape(1);
  a.num_slots = inputs[1].shape(0);
  a.Hkv = inputs[1].shape(1);
  a.bs = block_size_;
  a.window = window_;
  a.scale = scale_;
  a.q_dtype = to_pa(inputs[0].dtype());
  a.f = fmt_of(p_);
  if (a.T == 0 || a.Hq == 0) return;
  CpuPath path = cpu_path();
  enc.dispatch([a, path]() {
    switch (path) {
#if defined(MLXFAST_X86)
      case CpuPath::Avx512: kvq::attention_avx512(a); break;
      case CpuPath::Avx2: kvq::attention_avx2(a); break;
#endif
#if defined(MLXFAST_ARM64)
      case CpuPath::Neon: kvq::attention_neon(a); break;
#endif
      default: kvq::attention_portable(a); break;
    }
  });
}

void KVQuantAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[mlxfast.kv_quant_paged_attention] no GPU kernel; mlxfast.ops uses the MLX reference.");
}

} // namespace mlxfast
