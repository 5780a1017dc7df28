#include "io/kv_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <stdexcept>

#include "io/xxhash64.h"

namespace mlxfast::io {

KVReader::KVReader(std::string dir) : dir_(std::move(dir)) {
  thread_ = std::thread([this] { run(); });
}

KVReader::~KVReader() { close(); }

void KVReader::close() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  done_cv_.notify_all();
}

uint64_t KVReader::submit(const std::vector<std::string>& names, const std::vector<std::string>& keys,
                          const std::vector<ReadSpec>& specs, uint64_t ns_hash,
                          const std::string& layout, bool verify) {
  if (names.size() != keys.size())
    throw std::invalid_argument("[mlxfast.KVReader] names and keys differ in length");
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_) throw std::runtime_error("[mlxfast.KVReader] closed");
  uint64_t id = next_id_++;
  queue_.push_back({id, names, keys, specs, ns_hash, layout, verify});
  cv_.notify_all();
  return id;
}

std::vector<ReadResult> KVReader::poll() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<ReadResult> out;
  out.swap(done_);
  return out;
}

uint64_t KVReader::pending() {
  std::lock_guard<std::mutex> lk(mu_);
  return queue_.size() + active_;
}

bool KVReader::wait(uint64_t id, double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  auto ready = [&] {
    if (id == 0) return queue_.empty() && active_ == 0;
    return std::find(finished_.begin(), finished_.end(), id) != finished_.end();
  };
  return done_cv_.wait_until(lk, deadline, [&] { return ready() || stop_; }) && ready();
}

void KVReader::do_read(Job& job, ReadResult& r) {
  size_t n = job.names.size();
  r.id = job.id;
  r.n_total = static_cast<int>(n);
  r.specs = job.specs;
  uint64_t data_size = 0;
  for (const auto& s : job.specs) {
    r.buffers.push_back(std::make_shared<AlignedBuffer>(std::max<uint64_t>(s.slice_bytes * n, 1)));
    data_size += s.slice_bytes;
  }
  AlignedBuffer hdr(kHeaderSize);
  std::vector<iovec> iov(job.specs.size() + 1);
  for (size_t i = 0; i < n; ++i) {
    std::string path = dir_ + "/" + job.names[i];
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    std::string reason;
    if (fd < 0) {
      r.fail_missing = errno == ENOENT;
      reason = r.fail_missing ? "missing" : "cannot open";
    } else {
      struct stat st;
      int64_t size = ::fstat(fd, &st) == 0 ? static_cast<int64_t>(st.st_size) : -2;
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

void KVReader::run() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      active_ = 1;
    }
    ReadResult r;
    auto t0 = std::chrono::steady_clock::now();
    try {
      do_read(job, r);
    } catch (const std::exception& e) {
      r.fail_reason = e.what();
      r.n_ok = 0;
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> lk(mu_);
      active_ = 0;
      finished_.push_back(r.id);
      if (finished_.size() > 1024) finished_.erase(finished_.begin(), finished_.begin() + 512);
      done_.push_back(std::move(r));
    }
    done_cv_.notify_all();
  }
}

} // namespace mlxfast::io
