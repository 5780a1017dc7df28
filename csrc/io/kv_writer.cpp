#include "io/kv_writer.h"
#include "io/io_thread.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/uio.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/syscall.h>
#elif defined(__APPLE__)
#include <pthread/qos.h>
#endif

#include <cerrno>
#include <chrono>
#include <stdexcept>

#include "io/xxhash64.h"

namespace mlxfast::io {

namespace {

int write_all(int fd, std::vector<iovec> iov) {
  size_t i = 0;
  off_t off = 0;
  while (i < iov.size()) {
    int cnt = static_cast<int>(std::min<size_t>(iov.size() - i, 512));
    ssize_t n = ::pwritev(fd, iov.data() + i, cnt, off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;
    off += n;
    size_t left = static_cast<size_t>(n);
    while (i < iov.size() && left >= iov[i].iov_len) left -= iov[i++].iov_len;
    if (left > 0) {
      iov[i].iov_base = static_cast<uint8_t*>(iov[i].iov_base) + left;
      iov[i].iov_len -= left;
    }
  }
  return 0;
}

constexpr int kRenamesPerDirSync = 64;

// The writer is background work: it must not take CPU or disk time from
// decoding. Lowest CPU priority for this thread (per-thread nice on Linux,
// the background QoS class on macOS) and the lowest best-effort I/O priority.
void lower_this_thread_priority() {
#if defined(__linux__)
  pid_t tid = static_cast<pid_t>(::syscall(SYS_gettid));
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), 19);
#ifdef SYS_ioprio_set
  constexpr int kWhoProcess = 1, kClassBestEffort = 2, kClassShift = 13;
  ::syscall(SYS_ioprio_set, kWhoProcess, tid, (kClassBestEffort << kClassShift) | 7);
#endif
#elif defined(__APPLE__)
  pthread_set_qos_class_self_np(QOS_CLASS_BACKGROUND, 0);
#endif
}

} // namespace

struct KVWriter::State {
  int dirfd = -1, dir_errno = 0;
  uint64_t cap;
  std::mutex mu;
  std::condition_variable cv, idle_cv;
  std::deque<Job> queue;
  std::vector<WriteCompletion> done;
  WriterStats st;
  bool paused = false, stop = false, exited = false, in_flight = false, dir_dirty = false;
  int renames_since_sync = 0;
  bool idle_locked() const { return queue.empty() && !in_flight && !dir_dirty; }
  int sync_dir() { return dirfd < 0 ? dir_errno : (::fsync(dirfd) == 0 ? 0 : errno); }
  ~State() {
    if (dirfd >= 0) ::close(dirfd);
  }
};

KVWriter::KVWriter(std::string dir, uint64_t max_pending_bytes, bool paused)
    : s_(std::make_shared<State>()) {
  s_->dirfd = open_dir(dir);
  s_->dir_errno = s_->dirfd < 0 ? errno : 0;
  s_->cap = max_pending_bytes;
  s_->paused = paused;
  thread_ = std::thread(run, s_);
}

KVWriter::~KVWriter() { close(false, 5.0); }

uint64_t KVWriter::submit(const std::vector<std::string>& names, const std::vector<std::string>& keys,
                          const std::vector<uint32_t>& tokens, uint64_t ns_hash,
                          const std::string& layout, const std::vector<mx::array>& arrays,
                          int64_t rows) {
  size_t n = names.size();
  if (keys.size() != n || tokens.size() != n)
    throw std::invalid_argument("[mlxfast.KVWriter] names, keys and tokens differ in length");
  if (layout.size() > kMaxLayout) throw std::invalid_argument("[mlxfast.KVWriter] layout too long");
  for (const auto& name : names)
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      throw std::invalid_argument("[mlxfast.KVWriter] a name must be a plain file name");
  if (n == 0) return 0;
  std::vector<size_t> slice(arrays.size());
  for (size_t j = 0; j < arrays.size(); ++j) {
    const auto& a = arrays[j];
    if (a.ndim() < 1 || a.shape(0) != static_cast<int64_t>(n) * rows)
      throw std::invalid_argument("[mlxfast.KVWriter] each array needs n_blocks * rows rows");
    if (!a.flags().row_contiguous)
      throw std::invalid_argument("[mlxfast.KVWriter] arrays must be row-contiguous");
    slice[j] = a.nbytes() / n;
  }
  std::vector<Job> jobs(n);
  for (size_t i = 0; i < n; ++i) {
    Job& job = jobs[i];
    if (keys[i].size() > kMaxKey) throw std::invalid_argument("[mlxfast.KVWriter] key too long");
    job.name = names[i];
    job.info.key = keys[i];
    job.info.tokens = tokens[i];
    job.info.ns_hash = ns_hash;
    job.info.layout = layout;
    job.arrays = arrays;  // shared references: the data stays alive while queued
    for (size_t j = 0; j < arrays.size(); ++j) {
      job.ptrs.push_back(arrays[j].data<uint8_t>() + i * slice[j]);
      job.sizes.push_back(slice[j]);
      job.info.data_size += slice[j];
    }
    job.bytes = kHeaderSize + job.info.data_size;
  }
  State& s = *s_;
  uint64_t dropped = 0;
  std::vector<Job> evicted;  // destroyed outside the lock
  {
    std::lock_guard<std::mutex> lk(s.mu);
    for (auto& job : jobs) {
      // Over the cap: drop the oldest queued writes (never removals).
      while (s.st.pending_bytes + job.bytes > s.cap) {
        auto it = s.queue.begin();
        while (it != s.queue.end() && it->remove) ++it;
        if (it == s.queue.end()) break;
        s.st.pending_bytes -= it->bytes;
        s.st.pending_jobs -= 1;
        s.st.dropped += 1;
        s.st.dropped_bytes += it->bytes;
        s.done.push_back({it->name, it->info.key, WriteCompletion::Dropped, 0, it->bytes});
        evicted.push_back(std::move(*it));
        s.queue.erase(it);
        ++dropped;
      }
      s.st.pending_bytes += job.bytes;
      s.st.pending_jobs += 1;
      s.queue.push_back(std::move(job));
    }
  }
  s.cv.notify_all();
  return dropped;
}

void KVWriter::remove(const std::vector<std::string>& names) {
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    for (const auto& n : names) {
      Job job;
      job.remove = true;
      job.name = n;
      s_->queue.push_back(std::move(job));
    }
  }
  s_->cv.notify_all();
}

std::vector<WriteCompletion> KVWriter::poll() {
  std::lock_guard<std::mutex> lk(s_->mu);
  std::vector<WriteCompletion> out;
  out.swap(s_->done);
  return out;
}

bool KVWriter::wait_idle(double timeout_s) {
  State& s = *s_;
  std::unique_lock<std::mutex> lk(s.mu);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  return s.idle_cv.wait_until(lk, deadline, [&] { return s.idle_locked() || s.stop; }) &&
         s.idle_locked();
}

void KVWriter::set_paused(bool paused) {
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    s_->paused = paused;
  }
  s_->cv.notify_all();
}

void KVWriter::set_max_pending_bytes(uint64_t n) {
  std::lock_guard<std::mutex> lk(s_->mu);
  s_->cap = n;
}

WriterStats KVWriter::stats() {
  std::lock_guard<std::mutex> lk(s_->mu);
  WriterStats st = s_->st;
  st.in_flight = s_->in_flight ? 1 : 0;
  return st;
}

bool KVWriter::close(bool drain, double timeout_s) {
  State& s = *s_;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  if (drain && thread_.joinable()) wait_idle(timeout_s);
  std::deque<Job> rest;  // destroyed outside the lock
  std::unique_lock<std::mutex> lk(s.mu);
  s.stop = true;
  s.paused = false;
  rest.swap(s.queue);
  for (auto& j : rest) {
    if (!j.remove) {
      s.st.dropped += 1;
      s.st.dropped_bytes += j.bytes;
      s.done.push_back({j.name, j.info.key, WriteCompletion::Dropped, 0, j.bytes});
    }
  }
  s.st.pending_jobs = 0;
  s.st.pending_bytes = 0;
  s.cv.notify_all();
  s.idle_cv.notify_all();
  return join_or_detach(thread_, lk, s.idle_cv, deadline, [&] { return s.exited; });
}

void KVWriter::do_write(State& s, Job& job, WriteCompletion& c) {
  c.path = job.name;
  c.key = job.info.key;
  c.bytes = job.bytes;
  XXH64 h;
  for (size_t j = 0; j < job.ptrs.size(); ++j) h.update(job.ptrs[j], job.sizes[j]);
  job.info.data_checksum = h.digest();
  AlignedBuffer hdr(kHeaderSize);
  encode_header(job.info, hdr.data);
  std::vector<iovec> iov;
  iov.push_back({hdr.data, kHeaderSize});
  for (size_t j = 0; j < job.ptrs.size(); ++j)
    iov.push_back({const_cast<uint8_t*>(job.ptrs[j]), job.sizes[j]});
  std::string tmp;
  int fd = -1, err = s.dirfd < 0 ? s.dir_errno : 0;
  for (int attempt = 0; !err && fd < 0 && attempt < 8; ++attempt) {
    tmp = random_tmp_name(job.name);
    fd = ::openat(s.dirfd, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) err = errno;
  }
  if (!err && fd < 0) err = EEXIST;
  if (!err) err = write_all(fd, iov);
  if (!err) {
    err = ::fdatasync(fd) == 0 ? 0 : errno;
    std::lock_guard<std::mutex> lk(s.mu);
    s.st.file_syncs += 1;
  }
  if (fd >= 0 && ::close(fd) != 0 && !err) err = errno;
  if (!err && ::renameat(s.dirfd, tmp.c_str(), s.dirfd, job.name.c_str()) != 0) err = errno;
  if (err) {
    if (fd >= 0) ::unlinkat(s.dirfd, tmp.c_str(), 0);  // ours: created with O_EXCL
    c.status = WriteCompletion::Failed;
    c.err = err;
  } else {
    c.status = WriteCompletion::Written;
  }
}

void KVWriter::run(std::shared_ptr<State> sp) {
  State& s = *sp;
  lower_this_thread_priority();
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lk(s.mu);
      s.cv.wait(lk, [&] { return s.stop || (!s.paused && !s.queue.empty()) ||
                                 (!s.paused && s.queue.empty() && s.dir_dirty); });
      if (s.stop && s.queue.empty()) {
        if (s.dir_dirty) {
          lk.unlock();
          s.sync_dir();
          lk.lock();
          s.dir_dirty = false;
          s.st.dir_syncs += 1;
        }
        s.exited = true;
        s.idle_cv.notify_all();
        return;
      }
      if (s.queue.empty()) {  // renames waiting for their directory sync
        lk.unlock();
        int e = s.sync_dir();
        lk.lock();
        if (e) s.st.last_errno = e;
        s.st.dir_syncs += 1;
        s.dir_dirty = false;
        s.renames_since_sync = 0;
        s.idle_cv.notify_all();
        continue;
      }
      job = std::move(s.queue.front());
      s.queue.pop_front();
      if (!job.remove) {
        s.st.pending_bytes -= job.bytes;
        s.st.pending_jobs -= 1;
      }
      s.in_flight = true;
    }
    WriteCompletion c;
    auto t0 = std::chrono::steady_clock::now();
    bool sync_now = false;
    if (job.remove) {
      c.path = job.name;
      c.status = WriteCompletion::Removed;
      if (s.dirfd >= 0 && ::unlinkat(s.dirfd, job.name.c_str(), 0) != 0 && errno != ENOENT) c.err = errno;
    } else {
      do_write(s, job, c);
    }
    job = Job();  // release the block data before taking the lock
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> lk(s.mu);
      s.in_flight = false;
      s.st.write_seconds += dt;
      if (c.status == WriteCompletion::Written) {
        s.st.written += 1;
        s.st.written_bytes += c.bytes;
        s.dir_dirty = true;
        sync_now = ++s.renames_since_sync >= kRenamesPerDirSync;
      } else if (c.status == WriteCompletion::Failed) {
        s.st.failed += 1;
        s.st.last_errno = c.err;
      } else if (c.status == WriteCompletion::Removed) {
        s.st.removed += 1;
        s.dir_dirty = true;
      }
      s.done.push_back(std::move(c));
      if (s.idle_locked()) s.idle_cv.notify_all();  // e.g. after a failed write
    }
    if (sync_now) {
      int e = s.sync_dir();
      std::lock_guard<std::mutex> lk(s.mu);
      if (e) s.st.last_errno = e;
      s.st.dir_syncs += 1;
      s.renames_since_sync = 0;
      // still dirty only if more renames happened meanwhile (none: one thread)
      s.dir_dirty = false;
      if (s.idle_locked()) s.idle_cv.notify_all();
    }
  }
}

} // namespace mlxfast::io
