// KVReader: restores on their own thread and queue, so a restore never waits
// behind writes. A job reads a run of block files into page-aligned host
// buffers (posix_memalign), one buffer per storage array, each file's slices
// landing straight at their place (one preadv per file, no staging copy);
// the buffers become MLX arrays without a copy (array(void*, shape, dtype,
// deleter)). The header checksum, namespace, layout, key and size are always
// checked; the data checksum when verify is set. A job stops at the first bad
// or missing file: later blocks of a chain are useless without it. Files are
// opened relative to the directory's fd with O_NOFOLLOW | O_NONBLOCK and read
// only when fstat says they are regular files of ours (kv_file.h).
//
// The thread owns its state together with this object (shared_ptr): close()
// waits a bounded time, then detaches a thread stuck in a read (a hung disk),
// which frees the state itself once the read returns. Nothing waits forever.
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

namespace mlxfast::io {

struct ReadSpec {
  std::string dtype;               // MLX dtype name
  std::vector<int> block_shape;    // shape of one block's slice: [rows, ...]
  uint64_t slice_bytes = 0;
};

struct ReadResult {
  uint64_t id = 0;
  int n_total = 0;
  int n_ok = 0;
  std::string fail_name, fail_reason;  // the first bad file, if any
  bool fail_missing = false;           // it did not exist (no quarantine needed)
  double seconds = 0;
  uint64_t bytes = 0;
  std::vector<ReadSpec> specs;
  std::vector<std::shared_ptr<AlignedBuffer>> buffers;  // one per spec
};

class KVReader {
 public:
  explicit KVReader(std::string dir);
  ~KVReader();
  KVReader(const KVReader&) = delete;
  KVReader& operator=(const KVReader&) = delete;

  uint64_t submit(const std::vector<std::string>& names, const std::vector<std::string>& keys,
                  const std::vector<ReadSpec>& specs, uint64_t ns_hash, const std::string& layout,
                  bool verify);
  std::vector<ReadResult> poll();
  // Wait until job `id` (or, with id 0, every job) is done.
  bool wait(uint64_t id, double timeout_s);
  uint64_t pending();
  // Stop the thread; false when it did not finish within timeout_s (detached).
  bool close(double timeout_s = 5.0);

 private:
  struct Job {
    uint64_t id;
    std::vector<std::string> names, keys;
    std::vector<ReadSpec> specs;
    uint64_t ns_hash;
    std::string layout;
    bool verify;
  };
  struct State;
  static void run(std::shared_ptr<State> s);
  static void do_read(State& s, Job& job, ReadResult& r);

  std::shared_ptr<State> s_;
  std::thread thread_;
};

} // namespace mlxfast::io
