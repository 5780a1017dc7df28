#include "io/kv_writer.h"

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

KVWriter::KVWriter(std::string dir, uint64_t max_pending_bytes, bool paused)
    : dir_(std::move(dir)), cap_(max_pending_bytes), paused_(paused) {
  thread_ = std::thread([this] { run(); });
}

KVWriter::~KVWriter() { close(false, 30.0); }

uint64_t KVWriter::submit(const std::vector<std::string>& names, const std::vector<std::string>& keys,
                          const std::vector<uint32_t>& tokens, uint64_t ns_hash,
                          const std::string& layout, const std::vector<mx::array>& arrays,
                          int64_t rows) {
  size_t n = names.size();
  if (keys.size() != n || tokens.size() != n)
    throw std::invalid_argument("[mlxfast.KVWriter] names, keys and tokens differ in length");
  if (layout.size() > kMaxLayout) throw std::invalid_argument("[mlxfast.KVWriter] layout too long");
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
  uint64_t dropped = 0;
  std::vector<Job> evicted;  // destroyed outside the lock
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& job : jobs) {
      // Over the cap: drop the oldest queued writes (never removals).
      while (st_.pending_bytes + job.bytes > cap_) {
        auto it = queue_.begin();
        while (it != queue_.end() && it->remove) ++it;
        if (it == queue_.end()) break;
        st_.pending_bytes -= it->bytes;
        st_.pending_jobs -= 1;
        st_.dropped += 1;
        st_.dropped_bytes += it->bytes;
        done_.push_back({it->name, it->info.key, WriteCompletion::Dropped, 0, it->bytes});
        evicted.push_back(std::move(*it));
        queue_.erase(it);
        ++dropped;
      }
      st_.pending_bytes += job.bytes;
      st_.pending_jobs += 1;
      queue_.push_back(std::move(job));
    }
  }
  cv_.notify_all();
  return dropped;
}

void KVWriter::remove(const std::vector<std::string>& names) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& n : names) {
      Job job;
      job.remove = true;
      job.name = n;
      queue_.push_back(std::move(job));
    }
  }
  cv_.notify_all();
}

std::vector<WriteCompletion> KVWriter::poll() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<WriteCompletion> out;
  out.swap(done_);
  return out;
}

bool KVWriter::wait_idle(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  return idle_cv_.wait_until(lk, deadline, [this] { return idle_locked() || stop_; }) &&
         idle_locked();
}

void KVWriter::set_paused(bool paused) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    paused_ = paused;
  }
  cv_.notify_all();
}

void KVWriter::set_max_pending_bytes(uint64_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  cap_ = n;
}

WriterStats KVWriter::stats() {
  std::lock_guard<std::mutex> lk(mu_);
  WriterStats s = st_;
  s.in_flight = in_flight_ ? 1 : 0;
  return s;
}

void KVWriter::close(bool drain, double timeout_s) {
  if (drain) wait_idle(timeout_s);
  std::deque<Job> rest;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    paused_ = false;
    rest.swap(queue_);
    for (auto& j : rest) {
      if (!j.remove) {
        st_.dropped += 1;
        st_.dropped_bytes += j.bytes;
        done_.push_back({j.name, j.info.key, WriteCompletion::Dropped, 0, j.bytes});
      }
    }
    st_.pending_jobs = 0;
    st_.pending_bytes = 0;
  }
  cv_.notify_all();
  idle_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void KVWriter::do_write(Job& job, WriteCompletion& c) {
  std::string final_path = dir_ + "/" + job.name;
  std::string tmp = final_path + "." + std::to_string(::getpid()) + ".tmp";
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
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  int err = fd < 0 ? errno : 0;
  if (!err) err = write_all(fd, iov);
  if (!err) {
    err = ::fdatasync(fd) == 0 ? 0 : errno;
    std::lock_guard<std::mutex> lk(mu_);
    st_.file_syncs += 1;
  }
  if (fd >= 0 && ::close(fd) != 0 && !err) err = errno;
  if (!err && ::rename(tmp.c_str(), final_path.c_str()) != 0) err = errno;
  if (err) {
    ::unlink(tmp.c_str());
    c.status = WriteCompletion::Failed;
    c.err = err;
  } else {
    c.status = WriteCompletion::Written;
  }
}

void KVWriter::run() {
  lower_this_thread_priority();
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [this] { return stop_ || (!paused_ && !queue_.empty()) ||
                                   (!paused_ && queue_.empty() && dir_dirty_); });
      if (stop_ && queue_.empty()) {
        if (dir_dirty_) {
          lk.unlock();
          fsync_dir(dir_);
          lk.lock();
          dir_dirty_ = false;
          st_.dir_syncs += 1;
        }
        idle_cv_.notify_all();
        return;
      }
      if (queue_.empty()) {  // renames waiting for their directory sync
        lk.unlock();
        int e = fsync_dir(dir_);
        lk.lock();
        if (e) st_.last_errno = e;
        st_.dir_syncs += 1;
        dir_dirty_ = false;
        renames_since_sync_ = 0;
        idle_cv_.notify_all();
        continue;
      }
      job = std::move(queue_.front());
      queue_.pop_front();
      if (!job.remove) {
        st_.pending_bytes -= job.bytes;
        st_.pending_jobs -= 1;
      }
      in_flight_ = true;
    }
    WriteCompletion c;
    auto t0 = std::chrono::steady_clock::now();
    bool sync_now = false;
    if (job.remove) {
      c.path = job.name;
      c.status = WriteCompletion::Removed;
      if (::unlink((dir_ + "/" + job.name).c_str()) != 0 && errno != ENOENT) c.err = errno;
    } else {
      do_write(job, c);
    }
    job = Job();  // release the block data before taking the lock
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> lk(mu_);
      in_flight_ = false;
      st_.write_seconds += dt;
      if (c.status == WriteCompletion::Written) {
        st_.written += 1;
        st_.written_bytes += c.bytes;
        dir_dirty_ = true;
        sync_now = ++renames_since_sync_ >= kRenamesPerDirSync;
      } else if (c.status == WriteCompletion::Failed) {
        st_.failed += 1;
        st_.last_errno = c.err;
      } else if (c.status == WriteCompletion::Removed) {
        st_.removed += 1;
        dir_dirty_ = true;
      }
      done_.push_back(std::move(c));
      if (idle_locked()) idle_cv_.notify_all();  // e.g. after a failed write
    }
    if (sync_now) {
      int e = fsync_dir(dir_);
      std::lock_guard<std::mutex> lk(mu_);
      if (e) st_.last_errno = e;
      st_.dir_syncs += 1;
      renames_since_sync_ = 0;
      // still dirty only if more renames happened meanwhile (none: one thread)
      dir_dirty_ = false;
      if (idle_locked()) idle_cv_.notify_all();
    }
  }
}

} // namespace mlxfast::io
