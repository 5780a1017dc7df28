// Run-time CPU feature detection and the kernel-path override.
#pragma once

#include <string>

namespace mlxfast {

enum class CpuPath { Portable = 0, Avx2 = 1, Avx512 = 2, Neon = 3 };

// The best path this CPU supports, lowered by MLXFAST_CPU_PATH
// (portable|avx2|avx512|neon) when that names a path the CPU can run.
// Asking for a path the CPU cannot run raises at first use.
CpuPath cpu_path();
bool cpu_supports(CpuPath path);
const char* cpu_path_name(CpuPath path);
// The int8-activation matmul's instruction sets (independent of cpu_path()):
// AVX-512 F/BW/VL/DQ + AVX512_VNNI (vpdpbusd on zmm), AVX-VNNI (on ymm).
bool cpu_has_avx512_vnni();
// Whether the int8-activation matmul runs its VNNI kernel on this path (the
// avx512 path on an AVX-512 VNNI CPU); the AVX2 one on the avx2 and avx512
// paths otherwise.
inline bool int8_vnni_on(CpuPath path) {
  return path == CpuPath::Avx512 && cpu_has_avx512_vnni();
}
bool cpu_has_avx_vnni();
// GFNI (gf2p8affineqb), which the int8 GEMV uses to take a byte's high
// nibble in one instruction; false where MLXFAST_GFNI=0 (tests compare the
// two ways).
bool cpu_has_gfni();
// "" where this CPU runs the int8-activation matmul natively (and the
// avx512 path is in use); otherwise a sentence naming what it lacks (the
// start-up error of --matmul-activations int8).
std::string int8_acts_unsupported();
// The weight layout the int8-activation kernels of the CPU path in use
// read fastest: "rows16" (AVX-512 VNNI, AVX2); "" where
// int8_acts_unsupported() says why none runs.
std::string int8_acts_layout();
// Force a path from code (tests); "" restores automatic selection.
void set_cpu_path(const std::string& name);

} // namespace mlxfast
