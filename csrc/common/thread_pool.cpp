#include "common/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLXFAST_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define MLXFAST_PAUSE() asm volatile("yield")
#else
#define MLXFAST_PAUSE() ((void)0)
#endif

namespace mlxfast {

namespace {

int detect_threads() {
  if (const char* env = std::getenv("MLXFAST_NUM_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return std::min(n, 256);
  }
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

// Workers spin briefly on the job counter before sleeping: decode steps
// issue many short kernels back to back, and a condition-variable wake-up
// costs more than most of them. The hand-off takes no lock; the mutex is
// only for workers that went to sleep (bench/bench_dispatch.py measures the
// per-op cost; it was within this machine's noise of the locked version).
//
// state_ holds (job number << 32 | next task index), so that a task is
// claimed for one job only. With a separate task counter, a worker
// descheduled between finishing its last task and claiming the next could
// wake after the next job was published with more tasks, run one of them
// before the counter was reset (twice, then: an in-place residual added
// twice) or against a null job; now its compare-exchange fails instead.
//
// A waiting thread (a worker on the job counter, the caller on pending_)
// yields its core every 64th spin. The engine's Python thread builds the
// next step while this one evaluates, so a machine with as many cores as
// pool threads has one more thread runnable than cores; a pure spin then
// held a core while the thread it waited for sat descheduled until the
// next scheduler tick. Default model, in-process decode, 2 cores (bench/
// bench_generate.py, 3 alternating rounds): 84 -> 115 tok/s, 0.93x -> 1.27x
// llama.cpp; bench/bench_dispatch.py's pooled op 4.7 -> 1.9 us. Yielding
// every 32nd to 128th spin measured alike, every spin or every 8th worse.
// With no other thread runnable, the yield (sched_yield) returns at once.
constexpr unsigned kYieldEvery = 64;

inline void relax(unsigned spin) {
  if (spin % kYieldEvery == kYieldEvery - 1) {
    std::this_thread::yield();
  } else {
    MLXFAST_PAUSE();
  }
}

class Pool {
 public:
  explicit Pool(int n) : n_(n) {
    for (int i = 1; i < n_; ++i) {
      workers_.emplace_back([this, i] { worker(i); });
    }
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
      state_.store((job_number(state_.load()) + 1) << 32);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int size() const { return n_; }

  void run(int tasks, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> run_lock(run_mutex_);  // one job at a time
    const uint64_t job = job_number(state_.load()) + 1;
    job_ = &fn;
    tasks_.store(tasks, std::memory_order_relaxed);
    pending_.store(tasks);
    state_.store(job << 32);  // seq_cst: publishes the above; before the sleepers_ load
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lock(mutex_); }
      cv_.notify_all();
    }
    work(job);
    for (unsigned spin = 0; pending_.load(std::memory_order_acquire) != 0; ++spin) relax(spin);
  }

 private:
  static uint64_t job_number(uint64_t state) { return state >> 32; }

  void work(uint64_t job) {
    for (;;) {
      uint64_t v = state_.load();
      uint32_t t;
      do {
        t = static_cast<uint32_t>(v);
        if (job_number(v) != job || t >= static_cast<uint32_t>(tasks_.load(std::memory_order_relaxed))) return;
      } while (!state_.compare_exchange_weak(v, v + 1));
      // The job cannot change before this task's pending_ decrement.
      (*job_)(static_cast<int>(t));
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  void worker(int) {
    uint64_t seen = job_number(state_.load());
    for (;;) {
      bool got = false;
      for (unsigned spin = 0; spin < 20000; ++spin) {
        if (job_number(state_.load(std::memory_order_acquire)) != seen) {
          got = true;
          break;
        }
        relax(spin);
      }
      if (!got) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1);  // seq_cst: before the state_ load below
        cv_.wait(lock, [&] { return job_number(state_.load()) != seen; });
        sleepers_.fetch_sub(1);
      }
      seen = job_number(state_.load());
      if (stop_.load()) return;
      work(seen);
    }
  }

  int n_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<uint64_t> state_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> pending_{0};
  // Written by run() before state_ publishes the job. job_ is read only
  // after a claim; tasks_ also by a stale worker, whose claim then fails.
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<int> tasks_{0};
  std::atomic<bool> stop_{false};
};

Pool& pool() {
  static Pool* p = new Pool(detect_threads());  // never destroyed: exit-safe
  return *p;
}

} // namespace

int num_threads() { return pool().size(); }

void parallel_for(int64_t n, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  int64_t chunks = std::min<int64_t>((n + grain - 1) / grain, num_threads());
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
  int64_t per = (n + chunks - 1) / chunks;
  pool().run(static_cast<int>(chunks), [&](int t) {
    int64_t b = t * per;
    int64_t e = std::min<int64_t>(n, b + per);
    if (b < e) fn(b, e);
  });
}

void parallel_for(int64_t n, int64_t grain, RangeFn fn, void* ctx) {
  parallel_for(n, grain, [fn, ctx](int64_t b, int64_t e) { fn(ctx, b, e); });
}

} // namespace mlxfast
