// KVWriter: one background thread that checksums and writes KV block files
// (see kv_file.h) without the GIL and without blocking the engine thread.
//
// submit() only queues: each job keeps a reference to MLX arrays the engine
// already copied the blocks into, so the writer reads memory nobody else
// writes. The queue is capped by bytes: when a new job would push it over the
// cap, the oldest queued writes are dropped (each stays a future cache miss,
// never a wrong answer). Every write is tmp file -> fdatasync -> rename; the
// directory is fsynced after a run of renames and always before the writer
// reports itself idle, so wait_idle() returning true means durable.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "io/kv_file.h"
#include "mlx/array.h"

namespace mlxfast::io {

namespace mx = mlx::core;

struct WriteCompletion {
  enum Status { Written = 0, Dropped = 1, Failed = 2, Removed = 3 };
  std::string path;
  std::string key;
  int status = Written;
  int err = 0;  // errno for Failed
  uint64_t bytes = 0;  // file bytes
};

struct WriterStats {
  uint64_t pending_jobs = 0, pending_bytes = 0, in_flight = 0;
  uint64_t written = 0, written_bytes = 0, dropped = 0, dropped_bytes = 0;
  uint64_t failed = 0, removed = 0, file_syncs = 0, dir_syncs = 0;
  int last_errno = 0;
  double write_seconds = 0;
};

class KVWriter {
 public:
  KVWriter(std::string dir, uint64_t max_pending_bytes, bool paused = false);
  ~KVWriter();
  KVWriter(const KVWriter&) = delete;
  KVWriter& operator=(const KVWriter&) = delete;

  // Queue one file per block: block i is rows [i*rows, (i+1)*rows) of every
  // array (arrays evaluated, row-contiguous, leading dim n*rows). Names are
  // file names inside dir. Returns the number of jobs dropped to make room.
  uint64_t submit(const std::vector<std::string>& names, const std::vector<std::string>& keys,
                  const std::vector<uint32_t>& tokens, uint64_t ns_hash, const std::string& layout,
                  const std::vector<mx::array>& arrays, int64_t rows);
  // Queue unlinks (cap eviction); never dropped, done in queue order.
  void remove(const std::vector<std::string>& names);
  std::vector<WriteCompletion> poll();
  // Wait until nothing is queued or in flight and the directory is synced.
  bool wait_idle(double timeout_s);
  void set_paused(bool paused);
  void set_max_pending_bytes(uint64_t n);
  WriterStats stats();
  // Stop the thread; drain=false drops what is still queued.
  void close(bool drain, double timeout_s);

 private:
  struct Job {
    bool remove = false;
    std::string name;
    HeaderInfo info;
    std::vector<mx::array> arrays;
    std::vector<const uint8_t*> ptrs;
    std::vector<size_t> sizes;
    uint64_t bytes = 0;
  };
  void run();
  void do_write(Job& job, WriteCompletion& c);
  bool idle_locked() const { return queue_.empty() && !in_flight_ && !dir_dirty_; }

  std::string dir_;
  uint64_t cap_;
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<Job> queue_;
  std::vector<WriteCompletion> done_;
  WriterStats st_;
  bool paused_ = false, stop_ = false, in_flight_ = false, dir_dirty_ = false;
  int renames_since_sync_ = 0;
  std::thread thread_;
};

} // namespace mlxfast::io
