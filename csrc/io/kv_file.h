// The SSD tier's block file: one KV block per file, named by its chained
// block hash, written atomically (tmp + fdatasync + rename + directory fsync).
//
//   offset  size  field
//   0       8     magic "MLXFKVB\0"
//   8       4     format version (1)
//   12      4     header size (4096: data starts page-aligned)
//   16      8     namespace hash (model weights + KV scheme + tokenizer + block size)
//   24      8     data size in bytes
//   32      8     data checksum: XXH64 of the data
//   40      4     token count (tokens in the block)
//   44      4     key length (<= 32)
//   48      32    key: the chained block hash (the file name is its hex)
//   80      4     layout length
//   84      ..    layout: text naming the KV scheme and each array slice's
//                 dtype and shape, e.g. "dense-float16;float16:16x3x64;..."
//   4088    8     header checksum: XXH64 of bytes [0, 4088)
//   4096    ..    data: each storage array's rows of this block, in order
//
// All integers little-endian. A file is valid only if every header field
// checks out, its size is header + data, and (when asked) the data checksum
// matches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <sys/stat.h>

namespace mlxfast::io {

constexpr char kMagic[8] = {'M', 'L', 'X', 'F', 'K', 'V', 'B', '\0'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderSize = 4096;
constexpr size_t kMaxKey = 32;
constexpr size_t kLayoutOffset = 84;
constexpr size_t kChecksumOffset = kHeaderSize - 8;
constexpr size_t kMaxLayout = kChecksumOffset - kLayoutOffset;
constexpr size_t kAlign = 4096;

struct HeaderInfo {
  uint64_t ns_hash = 0;
  uint64_t data_size = 0;
  uint64_t data_checksum = 0;
  uint32_t tokens = 0;
  std::string key;     // raw bytes
  std::string layout;  // text
};

// Fill a kHeaderSize buffer (zeroed padding, header checksum last).
void encode_header(const HeaderInfo& h, uint8_t* out);

// Parse and check magic, version, sizes and the header checksum. Returns ""
// when the header is sound (info filled), else the reason.
std::string decode_header(const uint8_t* buf, HeaderInfo& info);

// decode_header + the checks against what this server expects. Empty
// expected_key skips the key check; file_size < 0 skips the size check.
std::string check_header(const uint8_t* buf, uint64_t ns_hash, const std::string& layout,
                         const std::string& expected_key, int64_t file_size, HeaderInfo& info);

std::string to_hex(const std::string& bytes);
bool from_hex(const std::string& hex, std::string& out);

// Page-aligned host memory (posix_memalign), freed on destruction.
struct AlignedBuffer {
  explicit AlignedBuffer(size_t n);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint8_t* data = nullptr;
  size_t size = 0;
};

// The cache directory may be shared with others (see docs/architecture.md,
// "SSD tier"): every file in it is opened relative to a directory fd, never
// through a symlink, and only regular files we own are read.

// open(path, O_DIRECTORY | O_NOFOLLOW): the last component must be a real
// directory. Returns the fd, or -1 with errno set.
int open_dir(const std::string& path);

// Open `name` in dirfd for reading: O_NOFOLLOW (a symlink is refused) and
// O_NONBLOCK (a FIFO or device never blocks the open), then fstat: only a
// regular file owned by this user passes. Returns "" (fd and st filled) or
// the reason (fd closed); missing is set when the file does not exist.
std::string open_block_file(int dirfd, const std::string& name, int& fd, struct stat& st,
                            bool& missing);

// A temp name no one can predict: "<name>.<16 random hex digits>.tmp".
std::string random_tmp_name(const std::string& name);

struct ScanEntry {
  std::string key_hex;
  uint64_t size;
  double mtime;
  uint32_t tokens;
};

struct ScanResult {
  std::vector<ScanEntry> entries;
  int64_t tmp_removed = 0;
  int64_t quarantined = 0;
  std::vector<std::string> quarantine_reasons;  // "name: reason"
};

// Start-up scan of one namespace directory: removes *.tmp leftovers, moves
// every file that is not a sound block of this namespace/layout into
// quarantine_dir (created on demand), and lists the good ones. verify_data
// also reads each file's data and checks its checksum.
ScanResult scan_dir(const std::string& dir, const std::string& quarantine_dir, uint64_t ns_hash,
                    const std::string& layout, bool verify_data);

// Move one file into quarantine_dir (created 0700 on demand; keeps its name,
// adds a suffix on clash). When quarantine_dir is not a directory of ours
// (e.g. a planted symlink) the file is unlinked instead: a bad file never
// stays where it is read, and nothing is moved outside the cache.
bool quarantine_file(const std::string& path, const std::string& quarantine_dir);
bool quarantine_at(int dirfd, const std::string& name, const std::string& quarantine_dir);

} // namespace mlxfast::io
