#include "ops/rope.h"

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

template <typename T>
void rope_tokens(const T* x, const int32_t* pos, const float* inv_freq, T* out, int64_t tokens,
                 int64_t heads, int64_t d, int dims, bool traditional, float scale) {
  const int half = dims / 2;
  parallel_for(tokens, std::max<int64_t>(1, 4096 / std::max<int64_t>(heads * d, 1)),
               [=](int64_t b, int64_t e) {
    std::vector<float> cs(half), sn(half);
    for (int64_t t = b; t < e; ++t) {
      rope_detail::angles(static_cast<float>(pos[t]) * scale, inv_freq, half, cs.data(), sn.data());
      for (int64_t h = 0; h < heads; ++h) {
        rope_detail::rotate_head(x + (t * heads + h) * d, out + (t * heads + h) * d, d, dims,
                                 traditional, cs.data(), sn.data(), nullptr);
      }
    }
  });
}

} // namespace

mx::array rope(const mx::array& x, const mx::array& positions, int dims, bool traditional,
               std::optional<float> base, float scale, const std::optional<mx::array>& freqs,
               mx::StreamOrDevice s) {
  std::ostringstream msg;
  if (x.ndim() < 2) {
    msg << "[mlxfast.rope] x must be [..., H, D], got " << x.shape() << ".";
  } else if (dims <= 0 || dims % 2 || dims > x.shape(-1)) {
    msg << "[mlxfast.rope] dims must be even and in (0, " << x.shape(-1) << "], got " << dims << ".";
  } else if (x.dtype() != mx::float32 && x.dtype() != mx::float16 && x.dtype() != mx::bfloat16) {
    msg << "[mlxfast.rope] x must be float32, float16 or bfloat16.";
  } else if (positions.dtype() != mx::int32 ||
             mx::Shape(x.shape().begin(), x.shape().end() - 2) != positions.shape()) {
    msg << "[mlxfast.rope] positions must be int32 with shape x.shape[:-2]; got "
        << positions.shape() << " for x " << x.shape() << ".";
  } else if (freqs.has_value() == base.has_value()) {
    msg << "[mlxfast.rope] give exactly one of base and freqs.";
  } else if (freqs && (freqs->ndim() != 1 || freqs->shape(0) != dims / 2)) {
    msg << "[mlxfast.rope] freqs must have shape [dims / 2].";
  }
  if (!msg.str().empty()) throw std::invalid_argument(msg.str());

  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {x, positions};
  if (freqs) inputs.push_back(freqs->dtype() == mx::float32 ? *freqs : mx::astype(*freqs, mx::float32, stream));
  return mx::array(x.shape(), x.dtype(),
                   std::make_shared<Rope>(stream, dims, traditional, base.value_or(0.f), scale,
                                          freqs.has_value()),
                   std::move(inputs));
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& x = inputs[0];
  auto& pos = inputs[1];
  auto& out = outputs[0];
  auto& enc = begin_eval(stream(), inputs, outputs);

  DenseInput xin = dense_input(x, enc);
  DenseInput pin = dense_input(pos, enc);
  DenseInput fin;
  if (has_freqs_) fin = dense_input(inputs[2], enc);
  int64_t d = x.shape(-1);
  int64_t heads = x.shape(-2);
  int64_t tokens = heads * d ? x.size() / (heads * d) : 0;
  int dims = dims_;
  bool traditional = traditional_;
  float scale = scale_;
  bool has_freqs = has_freqs_;
  auto dt = x.dtype();
  void* o = out.data<void>();
  float base = base_;
  enc.dispatch([xin, pin, fin, has_freqs, o, dt, base, tokens, heads, d, dims, traditional,
                scale]() {
    xin.pack();
    pin.pack();
    fin.pack();
    auto inv_freq = rope_detail::inverse_frequencies(dims, base, has_freqs ? fin.as<float>() : nullptr);
    const int32_t* p = pin.as<int32_t>();
    switch (dt) {
      case mx::float32:
        rope_tokens(xin.as<float>(), p, inv_freq.data(), static_cast<float*>(o), tokens, heads, d,
                    dims, traditional, scale);
        break;
      case mx::float16:
        rope_tokens(xin.as<mx::float16_t>(), p, inv_freq.data(), static_cast<mx::float16_t*>(o),
                    tokens, heads, d, dims, traditional, scale);
        break;
      default:
        rope_tokens(xin.as<mx::bfloat16_t>(), p, inv_freq.data(), static_cast<mx::bfloat16_t*>(o),
                    tokens, heads, d, dims, traditional, scale);
        break;
    }
  });
}

void Rope::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxfast.rope] no GPU kernel; mlxfast.ops uses mx.fast.rope on GPU.");
}

} // namespace mlxfast
