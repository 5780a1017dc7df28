#include "io/kv_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>

#include "io/xxhash64.h"

namespace mlxfast::io {

namespace {

void put32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
void put64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint32_t get32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t get64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

bool ends_with(const std::string& s, const char* suffix) {
  size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

std::string verify_data_fd(int fd, const HeaderInfo& info) {
  constexpr size_t chunk = 1 << 20;
  AlignedBuffer buf(chunk);
  XXH64 h;
  uint64_t off = kHeaderSize, left = info.data_size;
  while (left > 0) {
    size_t want = left < chunk ? static_cast<size_t>(left) : chunk;
    ssize_t got = ::pread(fd, buf.data, want, static_cast<off_t>(off));
    if (got <= 0) return "short read";
    h.update(buf.data, static_cast<size_t>(got));
    off += static_cast<uint64_t>(got);
    left -= static_cast<uint64_t>(got);
  }
  return h.digest() == info.data_checksum ? "" : "data checksum mismatch";
}

} // namespace

void encode_header(const HeaderInfo& h, uint8_t* out) {
  std::memset(out, 0, kHeaderSize);
  std::memcpy(out, kMagic, 8);
  put32(out + 8, kVersion);
  put32(out + 12, static_cast<uint32_t>(kHeaderSize));
  put64(out + 16, h.ns_hash);
  put64(out + 24, h.data_size);
  put64(out + 32, h.data_checksum);
  put32(out + 40, h.tokens);
  put32(out + 44, static_cast<uint32_t>(h.key.size()));
  std::memcpy(out + 48, h.key.data(), h.key.size());
  put32(out + 80, static_cast<uint32_t>(h.layout.size()));
  std::memcpy(out + kLayoutOffset, h.layout.data(), h.layout.size());
  put64(out + kChecksumOffset, XXH64::hash(out, kChecksumOffset));
}

std::string decode_header(const uint8_t* buf, HeaderInfo& info) {
  if (std::memcmp(buf, kMagic, 8) != 0) return "bad magic";
  if (get64(buf + kChecksumOffset) != XXH64::hash(buf, kChecksumOffset))
    return "header checksum mismatch";
  if (get32(buf + 8) != kVersion) return "unsupported format version";
  if (get32(buf + 12) != kHeaderSize) return "bad header size";
  uint32_t key_len = get32(buf + 44), layout_len = get32(buf + 80);
  if (key_len > kMaxKey || layout_len > kMaxLayout) return "bad header lengths";
  info.ns_hash = get64(buf + 16);
  info.data_size = get64(buf + 24);
  info.data_checksum = get64(buf + 32);
  info.tokens = get32(buf + 40);
  info.key.assign(reinterpret_cast<const char*>(buf + 48), key_len);
  info.layout.assign(reinterpret_cast<const char*>(buf + kLayoutOffset), layout_len);
  return "";
}

std::string check_header(const uint8_t* buf, uint64_t ns_hash, const std::string& layout,
                         const std::string& expected_key, int64_t file_size, HeaderInfo& info) {
  std::string err = decode_header(buf, info);
  if (!err.empty()) return err;
  if (info.ns_hash != ns_hash) return "foreign namespace";
  if (info.layout != layout) return "tensor layout mismatch";
  if (!expected_key.empty() && info.key != expected_key) return "key does not match the file name";
  if (file_size >= 0 && static_cast<uint64_t>(file_size) != kHeaderSize + info.data_size)
    return "file size does not match the header (truncated?)";
  return "";
}

std::string to_hex(const std::string& bytes) {
  static const char* d = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(d[c >> 4]);
    out.push_back(d[c & 15]);
  }
  return out;
}

bool from_hex(const std::string& hex, std::string& out) {
  if (hex.size() % 2) return false;
  out.clear();
  auto val = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < hex.size(); i += 2) {
    int a = val(hex[i]), b = val(hex[i + 1]);
    if (a < 0 || b < 0) return false;
    out.push_back(static_cast<char>(a * 16 + b));
  }
  return true;
}

AlignedBuffer::AlignedBuffer(size_t n) : size(n) {
  void* p = nullptr;
  if (::posix_memalign(&p, kAlign, n ? n : kAlign) != 0) throw std::bad_alloc();
  data = static_cast<uint8_t*>(p);
}

AlignedBuffer::~AlignedBuffer() { std::free(data); }

int open_dir(const std::string& path) {
  return ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
}

std::string open_block_file(int dirfd, const std::string& name, int& fd, struct stat& st,
                            bool& missing) {
  missing = false;
  fd = ::openat(dirfd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    missing = e == ENOENT;
    if (missing) return "missing";
    if (e == ELOOP) return "a symbolic link";
    return std::string("cannot open: ") + std::strerror(e);
  }
  std::string reason;
  if (::fstat(fd, &st) != 0)
    reason = "cannot stat";
  else if (!S_ISREG(st.st_mode))
    reason = "not a regular file";
  else if (st.st_uid != ::geteuid())
    reason = "owned by another user";
  if (!reason.empty()) {
    ::close(fd);
    fd = -1;
  }
  return reason;
}

std::string random_tmp_name(const std::string& name) {
  static thread_local std::random_device rd;
  uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(r));
  return name + "." + hex + ".tmp";
}

bool quarantine_at(int dirfd, const std::string& name, const std::string& qdir) {
  ::mkdir(qdir.c_str(), 0700);
  int qfd = open_dir(qdir);
  struct stat st;
  if (qfd >= 0 && (::fstat(qfd, &st) != 0 || st.st_uid != ::geteuid())) {
    ::close(qfd);
    qfd = -1;
  }
  if (qfd >= 0) {
    std::string dest = name;
    for (int i = 1; ::fstatat(qfd, dest.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && i < 1000; ++i)
      dest = name + "." + std::to_string(i);
    // rename never follows a symlink at dest: it replaces the link itself
    bool moved = ::renameat(dirfd, name.c_str(), qfd, dest.c_str()) == 0;
    ::close(qfd);
    if (moved) return true;
  }
  return ::unlinkat(dirfd, name.c_str(), 0) == 0;  // never leave a bad file where it is read
}

bool quarantine_file(const std::string& path, const std::string& qdir) {
  size_t slash = path.rfind('/');
  std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  int dirfd = open_dir(dir);
  if (dirfd < 0) return false;
  bool ok = quarantine_at(dirfd, name, qdir);
  ::close(dirfd);
  return ok;
}

ScanResult scan_dir(const std::string& dir, const std::string& qdir, uint64_t ns_hash,
                    const std::string& layout, bool verify_data) {
  ScanResult res;
  int dirfd = open_dir(dir);
  if (dirfd < 0) return res;
  int listfd = ::dup(dirfd);
  DIR* d = listfd >= 0 ? ::fdopendir(listfd) : nullptr;
  if (!d) {
    if (listfd >= 0) ::close(listfd);
    ::close(dirfd);
    return res;
  }
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  AlignedBuffer hdr(kHeaderSize);
  bool changed = false;
  for (const auto& name : names) {
    struct stat st;
    if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (S_ISDIR(st.st_mode)) continue;  // quarantine/ and anything else
    if (ends_with(name, ".tmp")) {
      if (::unlinkat(dirfd, name.c_str(), 0) == 0) ++res.tmp_removed, changed = true;
      continue;
    }
    std::string reason;
    std::string key;
    HeaderInfo info;
    if (!ends_with(name, ".kv") || !from_hex(name.substr(0, name.size() - 3), key) ||
        key.empty() || key.size() > kMaxKey) {
      reason = "not a block file name";
    } else {
      int fd;
      bool missing;
      reason = open_block_file(dirfd, name, fd, st, missing);
      if (missing) continue;  // gone since the listing
      if (reason.empty()) {
        ssize_t got = ::pread(fd, hdr.data, kHeaderSize, 0);
        if (got != static_cast<ssize_t>(kHeaderSize)) {
          reason = "short header (truncated?)";
        } else {
          reason = check_header(hdr.data, ns_hash, layout, key, st.st_size, info);
          if (reason.empty() && verify_data) reason = verify_data_fd(fd, info);
        }
        ::close(fd);
      }
    }
    if (!reason.empty()) {
      if (quarantine_at(dirfd, name, qdir)) ++res.quarantined, changed = true;
      res.quarantine_reasons.push_back(name + ": " + reason);
      continue;
    }
    double mtime = st.st_mtim.tv_sec + st.st_mtim.tv_nsec * 1e-9;
    res.entries.push_back({name.substr(0, name.size() - 3), static_cast<uint64_t>(st.st_size),
                           mtime, info.tokens});
  }
  if (changed) ::fsync(dirfd);
  ::close(dirfd);
  return res;
}

} // namespace mlxfast::io
