#include "ops/qkv_rope.h"

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "common/cpu_eval.h"
#include "common/dense_input.h"
#include "common/thread_pool.h"
#include "cpu/rope_rotate.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace mlxfast {

namespace {

// gain[i] = norm_w[i] / rms(x) for one head (the RMSNorm folded into the rotation).
template <typename T>
void head_gain(const T* x, const float* norm_w, int64_t d, float eps, float* gain) {
  float ss = 0.f;
  for (int64_t i = 0; i < d; ++i) {
    float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) gain[i] = inv * norm_w[i];
}

template <typename T>
void run(const QkvRopeParams& p, const T* qkv, const int32_t* pos, const float* inv_freq,
         const float* qn, const float* kn, T* q, T* k, T* v, int64_t tokens) {
  const int64_t D = p.head_dim;
  const int64_t width = (p.n_heads + 2 * p.n_kv_heads) * D;
  const int half = p.dims / 2;
  parallel_for(tokens, std::max<int64_t>(1, 8192 / std::max<int64_t>(width, 1)),
               [=](int64_t b, int64_t e) {
    std::vector<float> cs(half), sn(half), gain(D);
    for (int64_t t = b; t < e; ++t) {
      const T* row = qkv + t * width;
      rope_detail::angles(static_cast<float>(pos[t]) * p.scale, inv_freq, half, cs.data(),
                          sn.data());
      for (int h = 0; h < p.n_heads; ++h) {
        const T* x = row + h * D;
        if (qn) head_gain(x, qn, D, p.eps, gain.data());
        rope_detail::rotate_head(x, q + (t * p.n_heads + h) * D, D, p.dims, p.traditional,
                                 cs.data(), sn.data(), qn ? gain.data() : nullptr);
      }
      for (int h = 0; h < p.n_kv_heads; ++h) {
        const T* x = row + (p.n_heads + h) * D;
        if (kn) head_gain(x, kn, D, p.eps, gain.data());
        rope_detail::rotate_head(x, k + (t * p.n_kv_heads + h) * D, D, p.dims, p.traditional,
                                 cs.data(), sn.data(), kn ? gain.data() : nullptr);
        const T* xv = row + (p.n_heads + p.n_kv_heads + h) * D;
        T* ov = v + (t * p.n_kv_heads + h) * D;
        for (int64_t i = 0; i < D; ++i) ov[i] = xv[i];
      }
    }
  });
}

} // namespace

std::vector<mx::array> qkv_rope(const mx::array& qkv, const mx::array& positions, int n_heads,
                                int n_kv_heads, int head_dim, int dims, bool traditional,
                                std::optional<float> base, float scale,
                                const std::optional<mx::array>& freqs,
                                const std::optional<mx::array>& q_norm,
                                const std::optional<mx::array>& k_norm, float eps,
                                mx::StreamOrDevice s) {
  std::ostringstream msg;
  auto dt = qkv.dtype();
  if (n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 || qkv.ndim() < 1 ||
      qkv.shape(-1) != (n_heads + 2 * n_kv_heads) * head_dim) {
    msg << "[mlxfast.qkv_rope] qkv's last axis must be (n_heads + 2 * n_kv_heads) * head_dim; got "
        << qkv.shape() << " for " << n_heads << ", " << n_kv_heads << ", " << head_dim << ".";
  } else if (dt != mx::float32 && dt != mx::float16 && dt != mx::bfloat16) {
    msg << "[mlxfast.qkv_rope] qkv must be float32, float16 or bfloat16.";
  } else if (dims <= 0 || dims % 2 || dims > head_dim) {
    msg << "[mlxfast.qkv_rope] dims must be even and in (0, head_dim].";
  } else if (positions.dtype() != mx::int32 ||
             mx::Shape(qkv.shape().begin(), qkv.shape().end() - 1) != positions.shape()) {
    msg << "[mlxfast.qkv_rope] positions must be int32 with shape qkv.shape[:-1]; got "
        << positions.shape() << ".";
  } else if (freqs.has_value() == base.has_value()) {
    msg << "[mlxfast.qkv_rope] give exactly one of base and freqs.";
  } else if (freqs && (freqs->ndim() != 1 || freqs->shape(0) != dims / 2)) {
    msg << "[mlxfast.qkv_rope] freqs must have shape [dims / 2].";
  } else if (q_norm.has_value() != k_norm.has_value() ||
             (q_norm && (q_norm->shape() != mx::Shape{head_dim} ||
                         k_norm->shape() != mx::Shape{head_dim}))) {
    msg << "[mlxfast.qkv_rope] q_norm and k_norm go together, each of shape [head_dim].";
  }
  if (!msg.str().empty()) throw std::invalid_argument(msg.str());

  auto stream = mx::to_stream(s);
  auto f32 = [&](const mx::array& a) {
    return a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, stream);
  };
  std::vector<mx::array> inputs = {qkv, positions};
  if (freqs) inputs.push_back(f32(*freqs));
  if (q_norm) {
    inputs.push_back(f32(*q_norm));
    inputs.push_back(f32(*k_norm));
  }
  QkvRopeParams p{n_heads, n_kv_heads, head_dim, dims, traditional, base.value_or(0.f),
                  scale, eps, freqs.has_value(), q_norm.has_value()};
  mx::Shape lead(qkv.shape().begin(), qkv.shape().end() - 1);
  auto shape_of = [&](int heads) {
    mx::Shape sh = lead;
    sh.push_back(heads);
    sh.push_back(head_dim);
    return sh;
  };
  return mx::array::make_arrays({shape_of(n_heads), shape_of(n_kv_heads), shape_of(n_kv_heads)},
                                {dt, dt, dt}, std::make_shared<QkvRope>(stream, p),
                                std::move(inputs));
}

void QkvRope::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = begin_eval(stream(), inputs, outputs);
  std::vector<DenseInput> in;
  for (auto& a : inputs) in.push_back(dense_input(a, enc));
  auto p = p_;
  auto dt = inputs[0].dtype();
  int64_t width = static_cast<int64_t>(p.n_heads + 2 * p.n_kv_heads) * p.head_dim;
  int64_t tokens = inputs[0].size() / width;
  void* q = outputs[0].data<void>();
  void* k = outputs[1].data<void>();
  void* v = outputs[2].data<void>();
  enc.dispatch([in = std::move(in), p, dt, tokens, q, k, v]() {
    for (auto& d : in) d.pack();
    size_t next = 2;
    const float* freqs = p.has_freqs ? in[next++].as<float>() : nullptr;
    const float* qn = p.has_norm ? in[next++].as<float>() : nullptr;
    const float* kn = p.has_norm ? in[next++].as<float>() : nullptr;
    auto inv_freq = rope_detail::inverse_frequencies(p.dims, p.base, freqs);
    const int32_t* pos = in[1].as<int32_t>();
    switch (dt) {
      case mx::float32:
        run(p, in[0].as<float>(), pos, inv_freq.data(), qn, kn, static_cast<float*>(q),
            static_cast<float*>(k), static_cast<float*>(v), tokens);
        break;
      case mx::float16:
        run(p, in[0].as<mx::float16_t>(), pos, inv_freq.data(), qn, kn,
            static_cast<mx::float16_t*>(q), static_cast<mx::float16_t*>(k),
            static_cast<mx::float16_t*>(v), tokens);
        break;
      default:
        run(p, in[0].as<mx::bfloat16_t>(), pos, inv_freq.data(), qn, kn,
            static_cast<mx::bfloat16_t*>(q), static_cast<mx::bfloat16_t*>(k),
            static_cast<mx::bfloat16_t*>(v), tokens);
        break;
    }
  });
}

void QkvRope::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxfast.qkv_rope] no GPU kernel; mlxfast.ops uses its MLX reference on GPU.");
}

} // namespace mlxfast
