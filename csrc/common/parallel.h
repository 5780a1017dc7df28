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

// Header-only and in an unnamed namespace: each per-ISA file keeps its own
// copy (see above).
namespace {

// f(u0, u1) over [0, units) in pieces of `step`. Each pool thread owns a
// contiguous run of pieces and takes them in order; one that runs out takes
// the next piece of another's run. So each thread streams one contiguous
// span of weights (the hardware prefetcher keeps up; pieces handed out
// round-robin interleaved the threads' spans: the default model's 120 layer
// GEMVs from DRAM, a standalone copy, 20-25 GB/s against 26-28), and a
// thread that is descheduled (busy machine) still delays only one piece.
template <class F>
inline void par_dynamic(int64_t units, int64_t step, F&& f) {
  if (units <= 0) return;
  if (step < 1) step = 1;
  const int64_t pieces = (units + step - 1) / step;
  constexpr int64_t kMaxRuns = 64;
  int64_t tasks = pieces < num_threads() ? pieces : num_threads();
  if (tasks > kMaxRuns) tasks = kMaxRuns;
  struct alignas(64) Run {
    int64_t next, end;
  };
  Run runs[kMaxRuns];
  for (int64_t t = 0; t < tasks; ++t) {
    runs[t].next = pieces * t / tasks * step;
    const int64_t end = pieces * (t + 1) / tasks * step;
    runs[t].end = end < units ? end : units;
  }
  auto puller = [&runs, tasks, step, &f](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t k = 0; k < tasks; ++k) {
        Run& r = runs[(t + k) % tasks];
        for (;;) {
          const int64_t u = __atomic_fetch_add(&r.next, step, __ATOMIC_RELAXED);
          if (u >= r.end) break;
          f(u, u + step < r.end ? u + step : r.end);
        }
      }
    }
  };
  parallel_for(tasks, 1, [](void* c, int64_t b, int64_t e) { (*static_cast<decltype(puller)*>(c))(b, e); },
               &puller);
}

}  // namespace

} // namespace mlxfast
