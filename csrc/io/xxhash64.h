// XXH64 (Yann Collet's xxHash, 64-bit variant), written from its public
// specification: ~10+ GB/s per core with plain 64-bit multiplies, no SIMD or
// CPU-feature dispatch needed, identical on x86 and ARM, and well studied for
// detecting random corruption (bit flips, torn or shifted data). It is not a
// cryptographic hash: the SSD tier guards against damage, not an attacker who
// can write into the cache directory (who could also replace the code).
// Streaming form so a checksum can run over scattered slices in file order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace mlxfast::io {

class XXH64 {
 public:
  explicit XXH64(uint64_t seed = 0) { reset(seed); }

  void reset(uint64_t seed = 0) {
    v_[0] = seed + P1 + P2;
    v_[1] = seed + P2;
    v_[2] = seed;
    v_[3] = seed - P1;
    seed_ = seed;
    total_ = 0;
    mem_size_ = 0;
  }

  void update(const void* data, size_t len) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    const uint8_t* end = p + len;
    total_ += len;
    if (mem_size_ + len < 32) {
      std::memcpy(mem_ + mem_size_, p, len);
      mem_size_ += len;
      return;
    }
    if (mem_size_ > 0) {
      size_t fill = 32 - mem_size_;
      std::memcpy(mem_ + mem_size_, p, fill);
      for (int i = 0; i < 4; ++i) v_[i] = round(v_[i], read64(mem_ + 8 * i));
      p += fill;
      mem_size_ = 0;
    }
    uint64_t v0 = v_[0], v1 = v_[1], v2 = v_[2], v3 = v_[3];
    while (end - p >= 32) {
      v0 = round(v0, read64(p));
      v1 = round(v1, read64(p + 8));
      v2 = round(v2, read64(p + 16));
      v3 = round(v3, read64(p + 24));
      p += 32;
    }
    v_[0] = v0, v_[1] = v1, v_[2] = v2, v_[3] = v3;
    if (p < end) {
      mem_size_ = static_cast<size_t>(end - p);
      std::memcpy(mem_, p, mem_size_);
    }
  }

  uint64_t digest() const {
    uint64_t h;
    if (total_ >= 32) {
      h = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
      for (int i = 0; i < 4; ++i) h = merge(h, v_[i]);
    } else {
      h = seed_ + P5;
    }
    h += total_;
    const uint8_t* p = mem_;
    size_t n = mem_size_;
    while (n >= 8) {
      h ^= round(0, read64(p));
      h = rotl(h, 27) * P1 + P4;
      p += 8, n -= 8;
    }
    if (n >= 4) {
      h ^= static_cast<uint64_t>(read32(p)) * P1;
      h = rotl(h, 23) * P2 + P3;
      p += 4, n -= 4;
    }
    while (n > 0) {
      h ^= (*p) * P5;
      h = rotl(h, 11) * P1;
      ++p, --n;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
  }

  static uint64_t hash(const void* data, size_t len, uint64_t seed = 0) {
    XXH64 s(seed);
    s.update(data, len);
    return s.digest();
  }

 private:
  static constexpr uint64_t P1 = 11400714785074694791ULL;
  static constexpr uint64_t P2 = 14029467366897019727ULL;
  static constexpr uint64_t P3 = 1609587929392839161ULL;
  static constexpr uint64_t P4 = 9650029242287828579ULL;
  static constexpr uint64_t P5 = 2870177450012600261ULL;

  static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
  static uint64_t read64(const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);  // little-endian hosts only (x86_64, arm64)
    return v;
  }
  static uint32_t read32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
  static uint64_t round(uint64_t acc, uint64_t input) {
    acc += input * P2;
    acc = rotl(acc, 31);
    return acc * P1;
  }
  static uint64_t merge(uint64_t acc, uint64_t val) {
    acc ^= round(0, val);
    return acc * P1 + P4;
  }

  uint64_t v_[4];
  uint64_t seed_;
  uint64_t total_;
  uint8_t mem_[32];
  size_t mem_size_;
};

} // namespace mlxfast::io
