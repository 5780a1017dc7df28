#include "ops/sample.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "common/cpu_eval.h"
#include "common/dense_input.h"
#include "common/op_checks.h"
#include "common/thread_pool.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/simd/simd.h"
#include "mlx/ops.h"

namespace mlxfast {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Threefry-2x32, 20 rounds (Salmon et al., SC'11; the Random123 / JAX
// generator), reimplemented from the published algorithm: MLX's CPU random
// bits use it and libmlx does not export a per-element entry point.
inline void threefry2x32(uint32_t k0, uint32_t k1, uint32_t& c0, uint32_t& c1) {
  static constexpr uint32_t rot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  c0 += ks[0];
  c1 += ks[1];
  for (uint32_t i = 0; i < 5; ++i) {
    for (uint32_t r : rot[i % 2]) {
      c0 += c1;
      c1 = (c1 << r) | (c1 >> (32 - r));
      c1 ^= c0;
    }
    c0 += ks[(i + 1) % 3];
    c1 += ks[(i + 2) % 3] + i + 1;
  }
}

// Element i of MLX's RandomBits output for one key and V uint32 elements: the
// counters are (j, j + half + odd) for j < half, whose hashes fill elements j
// and j + half + odd; an odd V's middle element hashes (half, 0).
inline uint32_t random_bits_at(uint32_t k0, uint32_t k1, int64_t i, int64_t V) {
  const int64_t half = V / 2;
  const int64_t odd = V % 2;
  uint32_t c0, c1;
  bool first;
  if (i < half) {
    c0 = static_cast<uint32_t>(i);
    c1 = static_cast<uint32_t>(i + half + odd);
    first = true;
  } else if (odd && i == half) {
    c0 = static_cast<uint32_t>(half);
    c1 = 0;
    first = true;
  } else {
    c0 = static_cast<uint32_t>(i - half - odd);
    c1 = static_cast<uint32_t>(i);
    first = false;
  }
  threefry2x32(k0, k1, c0, c1);
  return first ? c0 : c1;
}

// mx.random.uniform's float32 conversion: bits / float(UINT32_MAX), clamped
// below 1 (then * (1 - 0) + 0, exact).
inline float uniform_from_bits(uint32_t b) {
  const float maxval = static_cast<float>(std::numeric_limits<uint32_t>::max());
  return std::min(static_cast<float>(b) / maxval, std::nextafter(1.0f, 0.0f));
}

// -log(-log(u)) as the sampler computes it with MLX (std::log on the CPU).
inline float gumbel_of(float u) { return -std::log(-std::log(u)); }

// MLX's CPU exp (simd::exp, the Cephes polynomial), as in its softmax.
inline float mlx_exp(float x) {
  return mx::simd::exp(mx::simd::Simd<float, 1>(x)).value;
}

// A cheaper exp for the normaliser and the mass histogram (x <= 0): the
// same polynomial without fma, so the loop can vectorise.
inline float fast_exp_neg(float x) {
  if (!(x > -87.0f)) return 0.0f;
  float t = x * 1.442695f;
  float ip = std::floor(t + 0.5f);
  float f = t - ip;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t e = (static_cast<int32_t>(ip) + 127) << 23;
  float s;
  std::memcpy(&s, &e, sizeof(s));
  return s * p;
}

// Histogram of probability mass by distance below the max, 1/4 nat wide.
constexpr int kBucketsPerNat = 4;
constexpr int kBuckets = 32 * kBucketsPerNat + 1;  // the last: 32 nats and below
inline int bucket_of(float d) {
  return d < 32.0f ? static_cast<int>(d * kBucketsPerNat) : kBuckets - 1;
}

// For the Gumbel draw: a token whose noise must exceed delta to win needs
// u >= exp(-exp(-delta)). ut[q] is that bound for delta = kUtLo + q / kUtPerNat,
// rounded down, so looking it up at floor(delta) never skips a winner.
constexpr float kUtLo = -8.0f;
constexpr int kUtPerNat = 32;
constexpr int kUtSize = (17 + 8) * kUtPerNat + 2;
const std::vector<float>& u_thresholds() {
  static const std::vector<float> t = [] {
    std::vector<float> v(kUtSize);
    for (int q = 0; q < kUtSize; ++q) {
      double d = kUtLo + static_cast<double>(q) / kUtPerNat;
      double u = std::exp(-std::exp(-d));
      float f = static_cast<float>(u);
      while (static_cast<double>(f) > u * (1.0 - 1e-7)) f = std::nextafter(f, 0.0f);
      v[q] = f;
    }
    return v;
  }();
  return t;
}

struct RowParams {
  float temp;
  int32_t top_k;
  float top_p;
  float min_p_log;
  uint32_t k0, k1;
};

template <typename T>
uint32_t argmax_row(const T* x, int64_t V) {
  float best = static_cast<float>(x[0]);
  int64_t bi = 0;
  for (int64_t i = 1; i < V; ++i) {
    float v = static_cast<float>(x[i]);
    if (v > best) {
      best = v;
      bi = i;
    }
  }
  return static_cast<uint32_t>(bi);
}

// Scratch reused across a worker's rows.
struct Scratch {
  std::vector<float> y, tmp;
  std::vector<int32_t> cand;
};

template <typename T>
uint32_t sample_row(const T* x, int64_t V, const RowParams& p, Scratch& sc) {
  if (!(p.temp > 0.0f)) return argmax_row(x, V);

  // 1. temperature (a float32 division, as x / t in MLX), the max and its index.
  sc.y.resize(V);
  float* y = sc.y.data();
  const float t = p.temp;
  float m = -kInf;
  int64_t mi = 0;
  for (int64_t i = 0; i < V; ++i) {
    y[i] = static_cast<float>(x[i]) / t;
  }
  for (int64_t i = 0; i < V; ++i) {
    if (y[i] > m) {
      m = y[i];
      mi = i;
    }
  }

  float thr = -kInf;  // keep y >= thr
  // 2. top-k: the k-th largest value (ties at it are all kept).
  const bool use_k = p.top_k > 0 && p.top_k < V;
  const int64_t k = use_k ? p.top_k : V;
  float thr_k = -kInf;
  if (use_k) {
    sc.tmp.assign(y, y + V);
    std::nth_element(sc.tmp.begin(), sc.tmp.begin() + (k - 1), sc.tmp.end(),
                     std::greater<float>());
    thr_k = sc.tmp[k - 1];
    thr = thr_k;
  }

  // 3. top-p over the top-k distribution: softmax of the k largest values,
  // keep the sorted prefix whose exclusive cumulative probability is < top_p.
  // Only the head of the sorted order is needed: a mass histogram picks a
  // cut that holds the nucleus, and only the tokens above it are sorted.
  if (p.top_p > 0.0f && p.top_p < 1.0f && std::isfinite(m)) {
    double hist[kBuckets] = {0};
    double Z = 0.0;
    int64_t n_gt = 0;
    for (int64_t i = 0; i < V; ++i) {
      float v = y[i];
      if (use_k && !(v > thr_k)) continue;
      float d = m - v;
      float e = fast_exp_neg(-d);
      Z += e;
      hist[bucket_of(d)] += e;
      ++n_gt;
    }
    if (use_k && n_gt < k) {  // the reference's k positions include k - n_gt ties
      float d = m - thr_k;
      double e = static_cast<double>(fast_exp_neg(-d)) * static_cast<double>(k - n_gt);
      Z += e;
      hist[bucket_of(d)] += e;
    }
    const float inv_z = 1.0f / static_cast<float>(Z);  // MLX: normalizer = 1 / sum
    const double target = static_cast<double>(p.top_p) * Z * (1.0 + 1e-3);
    int cut = 0;
    for (double acc = 0.0; cut < kBuckets - 1; ++cut) {
      acc += hist[cut];
      if (acc >= target) break;
    }
    float thr_p = -kInf;
    for (;;) {
      auto& cand = sc.cand;
      cand.clear();
      for (int64_t i = 0; i < V; ++i) {
        float v = y[i];
        if (v >= thr_k && bucket_of(m - v) <= cut) cand.push_back(static_cast<int32_t>(i));
      }
      std::sort(cand.begin(), cand.end(), [y](int32_t a, int32_t b) {
        return y[a] > y[b] || (y[a] == y[b] && a < b);
      });
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(cand.size()), k);
      float cum = 0.0f;
      int64_t n_keep = 0;
      bool stopped = false;
      for (int64_t j = 0; j < n; ++j) {
        float pj = mlx_exp(y[cand[j]] - m) * inv_z;
        cum = cum + pj;
        if (cum - pj < p.top_p) {
          n_keep = j + 1;
        } else {
          stopped = true;
          break;
        }
      }
      // Every candidate kept: if the cumulative sum is clearly past top_p,
      // the next token in sorted order (outside the candidates) is cut.
      if (!stopped && n < k && n > 0 && cum - 4e-7f >= p.top_p) stopped = true;
      if (stopped) {
        thr_p = y[cand[n_keep - 1]];
        break;
      }
      // The whole top-k set is inside the nucleus: nothing is cut.
      if (n == k || cut == kBuckets - 1) break;
      // The float cumsum fell short of the estimate: widen the cut.
      cut = std::min(kBuckets - 1, cut + 2 * kBucketsPerNat);
    }
    thr = std::max(thr, thr_p);
  }

  // 4. min-p: relative to the max, which every filter keeps.
  if (p.min_p_log > -kInf) thr = std::max(thr, m + p.min_p_log);

  // 5. Gumbel-max over the kept tokens, in counter pairs (one threefry hash
  // gives the bits of tokens j and j + half + odd). The noise never exceeds
  // g_max (u is clamped below 1), so a token with y + g_max below the best
  // so far cannot win and is skipped unhashed; a hashed one needs its two
  // logs only when u clears the (rounded-down) bound exp(-exp(-(best - y))).
  const auto& ut = u_thresholds();
  const float g_max = gumbel_of(std::nextafter(1.0f, 0.0f)) + 0.01f;
  float best = y[mi] + gumbel_of(uniform_from_bits(random_bits_at(p.k0, p.k1, mi, V)));
  int64_t bi = mi;
  auto consider = [&](int64_t i, uint32_t bits) {
    const float v = y[i];
    const float delta = best - v - 1e-3f;
    if (delta >= kUtLo) {
      if (delta >= g_max) return;
      const float u = uniform_from_bits(bits);
      if (u < ut[static_cast<int>((delta - kUtLo) * kUtPerNat)]) return;
    }
    const float s = v + gumbel_of(uniform_from_bits(bits));
    if (s > best || (s == best && i < bi)) {
      best = s;
      bi = i;
    }
  };
  auto wanted = [&](int64_t i) {
    const float v = y[i];
    return i != mi && v >= thr && !(v + g_max < best);
  };
  const int64_t half = V / 2, odd = V % 2;
  for (int64_t j = 0; j < half; ++j) {
    const int64_t ia = j, ib = j + half + odd;
    const bool wa = wanted(ia), wb = wanted(ib);
    if (!wa && !wb) continue;
    uint32_t c0 = static_cast<uint32_t>(ia), c1 = static_cast<uint32_t>(ib);
    threefry2x32(p.k0, p.k1, c0, c1);
    if (wa) consider(ia, c0);
    if (wb && wanted(ib)) consider(ib, c1);
  }
  if (odd && wanted(half)) consider(half, random_bits_at(p.k0, p.k1, half, V));
  return static_cast<uint32_t>(bi);
}

template <typename T>
void sample_rows(const T* x, const uint32_t* keys, const float* temp, const int32_t* top_k,
                 const float* top_p, const float* min_p_log, uint32_t* out, int64_t R,
                 int64_t V) {
  parallel_for(R, 1, [=](int64_t b, int64_t e) {
    Scratch sc;
    for (int64_t r = b; r < e; ++r) {
      RowParams p{temp[r], top_k[r], top_p[r], min_p_log[r], keys[2 * r], keys[2 * r + 1]};
      out[r] = sample_row(x + r * V, V, p, sc);
    }
  });
}

} // namespace

mx::array sample_tokens(const mx::array& logits, const mx::array& keys,
                        const mx::array& temperature, const mx::array& top_k,
                        const mx::array& top_p, const mx::array& min_p_log,
                        mx::StreamOrDevice s) {
  const char* op = "sample_tokens";
  if (logits.ndim() != 2 || logits.shape(1) < 1) {
    std::ostringstream msg;
    msg << "logits must be [R, V] with V >= 1, got " << logits.shape() << ".";
    fail(op, msg.str());
  }
  if (!is_float(logits.dtype())) fail(op, "logits must be float32, float16 or bfloat16.");
  if (logits.shape(1) > std::numeric_limits<int32_t>::max()) fail(op, "V is too large.");
  const int R = logits.shape(0);
  if (keys.shape() != mx::Shape{R, 2} || keys.dtype() != mx::uint32) {
    std::ostringstream msg;
    msg << "keys must be [R, 2] uint32 (R = " << R << "), got " << keys.shape() << " "
        << keys.dtype() << ".";
    fail(op, msg.str());
  }
  auto check_row = [&](const mx::array& a, const char* name, mx::Dtype dt) {
    if (a.shape() != mx::Shape{R} || a.dtype() != dt) {
      std::ostringstream msg;
      msg << name << " must be [R] " << dt << " (R = " << R << "), got " << a.shape() << " "
          << a.dtype() << ".";
      fail(op, msg.str());
    }
  };
  check_row(temperature, "temperature", mx::float32);
  check_row(top_k, "top_k", mx::int32);
  check_row(top_p, "top_p", mx::float32);
  check_row(min_p_log, "min_p_log", mx::float32);
  auto stream = mx::to_stream(s);
  return mx::array({R}, mx::uint32, std::make_shared<SampleTokens>(stream),
                   {logits, keys, temperature, top_k, top_p, min_p_log});
}

void SampleTokens::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  auto& enc = begin_eval(stream(), inputs, outputs);
  const int64_t R = inputs[0].shape(0);
  const int64_t V = inputs[0].shape(1);
  auto dt = inputs[0].dtype();
  std::vector<DenseInput> in;
  for (auto& a : inputs) in.push_back(dense_input(a, enc));
  uint32_t* op = out.data<uint32_t>();
  enc.dispatch([=]() {
    for (auto& d : in) d.pack();
    auto run = [&](auto* x) {
      sample_rows(x, in[1].as<uint32_t>(), in[2].as<float>(), in[3].as<int32_t>(),
                  in[4].as<float>(), in[5].as<float>(), op, R, V);
    };
    if (dt == mx::float32) {
      run(in[0].as<float>());
    } else if (dt == mx::float16) {
      run(in[0].as<mx::float16_t>());
    } else {
      run(in[0].as<mx::bfloat16_t>());
    }
  });
}

void SampleTokens::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[mlxfast.sample_tokens] no GPU kernel; mlxfast.ops uses the MLX reference on GPU.");
}

} // namespace mlxfast
