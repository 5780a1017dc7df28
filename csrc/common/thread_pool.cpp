#include "common/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif
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

// Workers spin briefly on a generation counter before sleeping: decode steps
// issue many short kernels back to back, and a condition-variable wake-up
// costs more than most of them.
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
      stop_ = true;
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int size() const { return n_; }

  void run(int tasks, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> run_lock(run_mutex_);  // one job at a time
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &fn;
      tasks_ = tasks;
      next_.store(0);
      pending_.store(tasks);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    work();
    while (pending_.load(std::memory_order_acquire) != 0) MLXFAST_PAUSE();
    job_ = nullptr;
  }

 private:
  void work() {
    for (;;) {
      int t = next_.fetch_add(1);
      if (t >= tasks_) return;
      (*job_)(t);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  void worker(int) {
    uint64_t seen = generation_.load();
    for (;;) {
      bool got = false;
      for (int spin = 0; spin < 20000; ++spin) {
        if (generation_.load(std::memory_order_acquire) != seen) {
          got = true;
          break;
        }
        MLXFAST_PAUSE();
      }
      if (!got) {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return generation_.load() != seen; });
      }
      std::unique_lock<std::mutex> lock(mutex_);
      seen = generation_.load();
      if (stop_) return;
      if (job_ == nullptr) continue;
      lock.unlock();
      work();
    }
  }

  int n_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> next_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int)>* job_ = nullptr;
  int tasks_ = 0;
  bool stop_ = false;
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

} // namespace mlxfast
