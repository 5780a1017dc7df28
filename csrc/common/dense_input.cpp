#include "common/dense_input.h"

#include <cstring>

namespace mlxfast {

namespace mx = mlx::core;

void pack_strided(const char* src, const std::vector<int64_t>& shape,
                  const std::vector<int64_t>& strides, size_t es, char* dst) {
  const int nd = static_cast<int>(shape.size());
  int64_t total = 1;
  for (auto d : shape) total *= d;
  if (total == 0) return;
  if (nd == 0) {
    std::memcpy(dst, src, es);
    return;
  }
  const int64_t inner = shape[nd - 1];
  const int64_t istride = strides[nd - 1] * static_cast<int64_t>(es);
  std::vector<int64_t> idx(nd, 0);
  for (int64_t row = 0; row < total / inner; ++row) {
    int64_t off = 0;
    for (int d = 0; d < nd - 1; ++d) off += idx[d] * strides[d];
    const char* p = src + off * static_cast<int64_t>(es);
    for (int64_t i = 0; i < inner; ++i) std::memcpy(dst + es * i, p + i * istride, es);
    dst += inner * static_cast<int64_t>(es);
    for (int d = nd - 2; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

void DenseInput::pack() const {
  if (src) pack_strided(src, shape, strides, itemsize, dst);
}

DenseInput dense_input(const mx::array& a, mx::cpu::CommandEncoder& enc) {
  DenseInput in;
  if (a.flags().row_contiguous) {
    in.data = a.data<void>();
    return in;
  }
  mx::array tmp(a.shape(), a.dtype(), nullptr, {});
  tmp.set_data(mx::allocator::malloc(a.nbytes()));
  enc.add_temporary(tmp);
  in.src = a.data<char>();
  in.dst = tmp.data<char>();
  in.data = in.dst;
  in.shape.assign(a.shape().begin(), a.shape().end());
  in.strides.assign(a.strides().begin(), a.strides().end());
  in.itemsize = a.itemsize();
  return in;
}

} // namespace mlxfast
