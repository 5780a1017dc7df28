// The shared pool's parallel_for in the form the per-ISA kernel files
// (csrc/cpu/*_<isa>.cpp) may call: a function pointer and a context, no
// std::function. Those files are compiled with their own ISA flags, and a
// std::function instantiated there could be the copy the linker keeps for
// every caller. Defined in thread_pool.cpp (baseline flags); same pool and
// same split into chunks as the std::function form in thread_pool.h.
#pragma once

#include <cstdint>

namespace mlxfast {

// Threads used by native kernels: MLXFAST_NUM_THREADS if set, else the CPUs
// this process may run on.
int num_threads();

using RangeFn = void (*)(void* ctx, int64_t begin, int64_t end);

// fn(ctx, begin, end) over [0, n), as parallel_for(n, grain, fn) in
// thread_pool.h.
void parallel_for(int64_t n, int64_t grain, RangeFn fn, void* ctx);

} // namespace mlxfast
