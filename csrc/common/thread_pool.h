// One pool for every native op. The calling thread (MLX's CPU stream thread)
// takes part in each parallel_for, so the pool holds num_threads() - 1
// workers and the CPU is never oversubscribed by our kernels.
#pragma once

#include <cstdint>
#include <functional>

#include "common/parallel.h"  // num_threads(), the function-pointer form

namespace mlxfast {

// Run fn(begin, end) over [0, n) split into contiguous chunks of at least
// `grain` items, one chunk per thread at most. Blocks until all are done.
// fn must not throw.
void parallel_for(int64_t n, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn);

} // namespace mlxfast
