#include "ops/rms_norm.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "common/cpu_eval.h"
#include "common/dense_input.h"
#include "common/op_checks.h"
#include "common/thread_pool.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace mlxfast {

namespace {

template <typename T, typename W>
void rms_norm_rows(const T* x, const W* w, T* out, int64_t rows, int64_t d, float eps) {
  parallel_for(rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)),
               [=](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * d;
      T* orow = out + r * d;
      float ss = 0.f;
      for (int64_t i = 0; i < d; ++i) {
        float v = static_cast<float>(xr[i]);
        ss += v * v;
      }
      float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
      for (int64_t i = 0; i < d; ++i) {
        orow[i] = static_cast<T>(static_cast<float>(xr[i]) * inv * static_cast<float>(w[i]));
      }
    }
  });
}

template <typename T>
void rms_norm_rows_as(const void* x, mx::Dtype wt, const void* w, void* out, int64_t rows,
                      int64_t d, float eps) {
  const T* xt = static_cast<const T*>(x);
  T* ot = static_cast<T*>(out);
  switch (wt) {
    case mx::float32: rms_norm_rows(xt, static_cast<const float*>(w), ot, rows, d, eps); break;
    case mx::float16: rms_norm_rows(xt, static_cast<const mx::float16_t*>(w), ot, rows, d, eps); break;
    default: rms_norm_rows(xt, static_cast<const mx::bfloat16_t*>(w), ot, rows, d, eps); break;
  }
}

} // namespace

void rms_norm_rows(mx::Dtype dt, const void* x, mx::Dtype wt, const void* w, void* out,
                   int64_t rows, int64_t d, float eps) {
  switch (dt) {
    case mx::float32:
      rms_norm_rows_as<float>(x, wt, w, out, rows, d, eps);
      break;
    case mx::float16:
      rms_norm_rows_as<mx::float16_t>(x, wt, w, out, rows, d, eps);
      break;
    default:
      rms_norm_rows_as<mx::bfloat16_t>(x, wt, w, out, rows, d, eps);
      break;
  }
}

mx::array rms_norm_input(const char* op, const char* what, const mx::array& x,
                         const mx::array& weight, float eps, mx::Stream s) {
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1)) {
    std::ostringstream msg;
    msg << what << "weight must be [D] with D = x.shape[-1]; got x " << x.shape() << " and "
        << what << "weight " << weight.shape() << ".";
    fail(op, msg.str());
  }
  if (!is_float(weight.dtype())) {
    fail(op, std::string(what) + "weight must be float32, float16 or bfloat16.");
  }
  if (!(eps >= 0.f)) fail(op, std::string(what) + "eps must be >= 0.");
  const auto t = mx::promote_types(x.dtype(), weight.dtype());
  return x.dtype() == t ? x : mx::astype(x, t, s);
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s) {
  if (!is_float(x.dtype())) fail("rms_norm", "x must be float32, float16 or bfloat16.");
  auto stream = mx::to_stream(s);
  auto xc = rms_norm_input("rms_norm", "", x, weight, eps, stream);
  return mx::array(xc.shape(), xc.dtype(), std::make_shared<RmsNorm>(stream, eps), {xc, weight});
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& x = inputs[0];
  auto& w = inputs[1];
  auto& out = outputs[0];
  auto& enc = begin_eval(stream(), inputs, outputs);
  int64_t d = x.shape(-1);
  int64_t rows = d ? x.size() / d : 0;
  float eps = eps_;
  DenseInput xin = dense_input(x, enc);
  DenseInput win = dense_input(w, enc);
  auto wt = w.dtype();
  auto ot = out.dtype();
  void* o = out.data<void>();
  enc.dispatch([xin, win, wt, ot, o, rows, d, eps]() {
    xin.pack();
    win.pack();
    rms_norm_rows(ot, xin.data, wt, win.data, o, rows, d, eps);
  });
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxfast.rms_norm] no GPU kernel; mlxfast.ops uses mx.fast.rms_norm on GPU.");
}

} // namespace mlxfast
