// Paged attention, baseline ISA (see paged_attention.h).
#include "cpu/paged_attention.h"

namespace mlxfast {
namespace pa {
void run_portable(const Args& a) { Kernel<4>::run(a); }
}  // namespace pa
}  // namespace mlxfast
