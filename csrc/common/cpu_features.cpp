#include "common/cpu_features.h"

#include <cstdlib>
#include <mutex>
#include <stdexcept>

namespace mlxfast {

namespace {

CpuPath best_path() {
#if defined(MLXFAST_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma")) {
    return CpuPath::Avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return CpuPath::Avx2;
  }
  return CpuPath::Portable;
#elif defined(MLXFAST_ARM64)
  return CpuPath::Neon;
#else
  return CpuPath::Portable;
#endif
}

CpuPath parse_path(const std::string& s) {
  if (s == "portable") return CpuPath::Portable;
  if (s == "avx2") return CpuPath::Avx2;
  if (s == "avx512") return CpuPath::Avx512;
  if (s == "neon") return CpuPath::Neon;
  throw std::invalid_argument(
      "[mlxfast] unknown CPU path '" + s +
      "' (expected portable, avx2, avx512 or neon)");
}

std::mutex g_mutex;
bool g_init = false;
CpuPath g_path = CpuPath::Portable;

void set_locked(const std::string& name) {
  if (name.empty()) {
    g_path = best_path();
  } else {
    CpuPath p = parse_path(name);
    if (!cpu_supports(p)) {
      throw std::invalid_argument(
          "[mlxfast] CPU path '" + name + "' is not supported by this CPU");
    }
    g_path = p;
  }
  g_init = true;
}

} // namespace

bool cpu_supports(CpuPath path) {
  CpuPath best = best_path();
  if (path == CpuPath::Portable) return true;
  if (best == CpuPath::Neon) return path == CpuPath::Neon;
  if (path == CpuPath::Neon) return false;
  return static_cast<int>(path) <= static_cast<int>(best);
}

CpuPath cpu_path() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_init) {
    const char* env = std::getenv("MLXFAST_CPU_PATH");
    set_locked(env ? std::string(env) : std::string());
  }
  return g_path;
}

void set_cpu_path(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  set_locked(name);
}

bool cpu_has_avx512_vnni() {
#if defined(MLXFAST_X86)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool cpu_has_avx_vnni() {
#if defined(MLXFAST_X86)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_gfni() {
#if defined(MLXFAST_X86)
  const char* env = std::getenv("MLXFAST_GFNI");
  if (env != nullptr && std::string(env) == "0") return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("gfni");
#else
  return false;
#endif
}

std::string int8_acts_unsupported() {
#if defined(MLXFAST_X86)
  // Over the row-interleaved layout: the VNNI kernel on AVX-512 with VNNI,
  // the AVX2 one on AVX2 (and AVX-512 without VNNI).
  const CpuPath p = cpu_path();
  if (p == CpuPath::Avx512 || p == CpuPath::Avx2) return "";
  if (cpu_supports(CpuPath::Avx2)) {
    return std::string("int8 activations run on the avx2 and avx512 kernel paths; the CPU path in "
                       "use is '") + cpu_path_name(p) + "' (MLXFAST_CPU_PATH).";
  }
  std::string missing;
  auto lacks = [&missing](bool has, const char* f) {
    if (!has) missing += (missing.empty() ? "" : ", ") + std::string(f);
  };
  __builtin_cpu_init();
  lacks(__builtin_cpu_supports("avx2"), "avx2");
  lacks(__builtin_cpu_supports("fma"), "fma");
  lacks(__builtin_cpu_supports("f16c"), "f16c");
  return "int8 activations need AVX2 (avx2, fma and f16c) or AVX-512 VNNI; this CPU lacks " +
         missing + ".";
#elif defined(MLXFAST_ARM64)
  return "int8 activations have no NEON dot-product kernel yet (x86 AVX2 and AVX-512 only).";
#else
  return "int8 activations need an x86 CPU with AVX2 or AVX-512 VNNI.";
#endif
}

std::string int8_acts_layout() {
  return int8_acts_unsupported().empty() ? "rows16" : "";
}

const char* cpu_path_name(CpuPath path) {
  switch (path) {
    case CpuPath::Portable: return "portable";
    case CpuPath::Avx2: return "avx2";
    case CpuPath::Avx512: return "avx512";
    case CpuPath::Neon: return "neon";
  }
  return "?";
}

} // namespace mlxfast
