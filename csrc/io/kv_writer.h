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
//
// The directory may be shared (kv_file.h): everything is done relative to
// its fd; the tmp file is created O_CREAT | O_EXCL | O_NOFOLLOW under a random
// name (a planted file or symlink is never written through), mode 0600; the
// rename replaces whatever sits at the final name, never following a link.
// As in KVReader, the thread shares its state with this object, so close()
// is bounded: a thread stuck on a hung disk is detached, not waited for.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
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
  // Stop the thread within timeout_s (drain=true first waits for the queue,
  // drain=false drops it); false when the thread had to be detached.
  bool close(bool drain, double timeout_s);

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
  struct State;
  static void run(std::shared_ptr<State> s);
  static void do_write(State& s, Job& job, WriteCompletion& c);

  std::shared_ptr<State> s_;
  std::thread thread_;
};

} // namespace mlxfast::io
