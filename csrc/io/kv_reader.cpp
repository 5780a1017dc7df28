#include "io/kv_reader.h"
#include "io/io_thread.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "io/xxhash64.h"

namespace mlxfast::io {

struct KVReader::State {
  int dirfd = -1, dir_errno = 0;
  std::mutex mu;
  std::condition_variable cv, done_cv;
  std::deque<Job> queue;
  std::vector<ReadResult> done;
  uint64_t next_id = 1, active = 0;
  std::vector<uint64_t> finished;
  bool stop = false, exited = false;
  ~State() {
    if (dirfd >= 0) ::close(dirfd);
  }
};

KVReader::KVReader(std::string dir) : s_(std::make_shared<State>()) {
  s_->dirfd = open_dir(dir);
  s_->dir_errno = s_->dirfd < 0 ? errno : 0;
  thread_ = std::thread(run, s_);
}

KVReader::~KVReader() { close(); }

bool KVReader::close(double timeout_s) {
  std::unique_lock<std::mutex> lk(s_->mu);
  s_->stop = true;
  s_->cv.notify_all();
  s_->done_cv.notify_all();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  return join_or_detach(thread_, lk, s_->done_cv, deadline, [this] { return s_->exited; });
}

uint64_t KVReader::submit(const std::vector<std::string>& names, const std::vector<std::string>& keys,
                          const std::vector<ReadSpec>& specs, uint64_t ns_hash,
                          const std::string& layout, bool verify) {
  if (names.size() != keys.size())
    throw std::invalid_argument("[mlxfast.KVReader] names and keys differ in length");
  std::lock_guard<std::mutex> lk(s_->mu);
  if (s_->stop) throw std::runtime_error("[mlxfast.KVReader] closed");
  uint64_t id = s_->next_id++;
  s_->queue.push_back({id, names, keys, specs, ns_hash, layout, verify});
  s_->cv.notify_all();
  return id;
}

std::vector<ReadResult> KVReader::poll() {
  std::lock_guard<std::mutex> lk(s_->mu);
  std::vector<ReadResult> out;
  out.swap(s_->done);
  return out;
}

uint64_t KVReader::pending() {
  std::lock_guard<std::mutex> lk(s_->mu);
  return s_->queue.size() + s_->active;
}

bool KVReader::wait(uint64_t id, double timeout_s) {
  State& s = *s_;
  std::unique_lock<std::mutex> lk(s.mu);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  auto ready = [&] {
    if (id == 0) return s.queue.empty() && s.active == 0;
    return std::find(s.finished.begin(), s.finished.end(), id) != s.finished.end();
  };
  return s.done_cv.wait_until(lk, deadline, [&] { return ready() || s.stop; }) && ready();
}

void KVReader::do_read(State& s, Job& job, ReadResult& r) {
  size_t n = job.names.size();
  r.id = job.id;
  r.n_total = static_cast<int>(n);
  r.specs = job.specs;
  uint64_t data_size = 0;
  for (const auto& spec : job.specs) {
    r.buffers.push_back(std::make_shared<AlignedBuffer>(std::max<uint64_t>(spec.slice_bytes * n, 1)));
    data_size += spec.slice_bytes;
  }
  AlignedBuffer hdr(kHeaderSize);
  std::vector<iovec> iov(job.specs.size() + 1);
  for (size_t i = 0; i < n; ++i) {
    int fd = -1;
    struct stat st;
    std::string reason;
    if (s.dirfd < 0) {
      reason = std::string("cannot open the directory: ") + std::strerror(s.dir_errno);
    } else {
      reason = open_block_file(s.dirfd, job.names[i], fd, st, r.fail_missing);
    }
    if (fd >= 0) {
      int64_t size = static_cast<int64_t>(st.st_size);
      iov[0] = {hdr.data, kHeaderSize};
      for (size_t j = 0; j < job.specs.size(); ++j)
        iov[j + 1] = {r.buffers[j]->data + i * job.specs[j].slice_bytes, job.specs[j].slice_bytes};
      uint64_t want = kHeaderSize + data_size, got = 0;
      // preadv, continuing after a short read (rare on regular files).
      size_t k = 0;
      while (k < iov.size()) {
        ssize_t m = ::preadv(fd, iov.data() + k, static_cast<int>(std::min<size_t>(iov.size() - k, 512)),
                             static_cast<off_t>(got));
        if (m < 0 && errno == EINTR) continue;
        if (m <= 0) break;
        got += static_cast<uint64_t>(m);
        size_t left = static_cast<size_t>(m);
        while (k < iov.size() && left >= iov[k].iov_len) left -= iov[k++].iov_len;
        if (left > 0) {
          iov[k].iov_base = static_cast<uint8_t*>(iov[k].iov_base) + left;
          iov[k].iov_len -= left;
        }
      }
      HeaderInfo info;
      if (got < kHeaderSize) {
        reason = "short header (truncated?)";
      } else {
        reason = check_header(hdr.data, job.ns_hash, job.layout, job.keys[i], size, info);
        if (reason.empty() && info.data_size != data_size) reason = "data size mismatch";
        if (reason.empty() && got != want) reason = "short read (truncated?)";
        if (reason.empty() && job.verify) {
          XXH64 h;
          for (size_t j = 0; j < job.specs.size(); ++j)
            h.update(r.buffers[j]->data + i * job.specs[j].slice_bytes, job.specs[j].slice_bytes);
          if (h.digest() != info.data_checksum) reason = "data checksum mismatch";
        }
      }
      if (reason.empty()) ::futimens(fd, nullptr);  // mtime = last use, for LRU after restart
      ::close(fd);
    }
    if (!reason.empty()) {
      r.fail_name = job.names[i];
      r.fail_reason = reason;
      return;
    }
    r.n_ok += 1;
    r.bytes += kHeaderSize + data_size;
  }
}

void KVReader::run(std::shared_ptr<State> sp) {
  State& s = *sp;
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lk(s.mu);
      s.cv.wait(lk, [&] { return s.stop || !s.queue.empty(); });
      if (s.stop) break;
      job = std::move(s.queue.front());
      s.queue.pop_front();
      s.active = 1;
    }
    ReadResult r;
    auto t0 = std::chrono::steady_clock::now();
    try {
      do_read(s, job, r);
    } catch (const std::exception& e) {
      r.fail_reason = e.what();
      r.n_ok = 0;
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> lk(s.mu);
      s.active = 0;
      s.finished.push_back(r.id);
      if (s.finished.size() > 1024) s.finished.erase(s.finished.begin(), s.finished.begin() + 512);
      s.done.push_back(std::move(r));
    }
    s.done_cv.notify_all();
  }
  std::lock_guard<std::mutex> lk(s.mu);
  s.exited = true;
  s.done_cv.notify_all();
}

} // namespace mlxfast::io
