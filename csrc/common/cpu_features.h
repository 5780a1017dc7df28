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
// Force a path from code (tests); "" restores automatic selection.
void set_cpu_path(const std::string& name);

} // namespace mlxfast
