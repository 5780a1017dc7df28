// Paged attention compiled with AVX2/FMA/F16C (see paged_attention.h).
#include "cpu/paged_attention.h"

namespace mlxfast {
namespace pa {
void run_avx2(const Args& a) { Kernel<8>::run(a); }
}  // namespace pa
}  // namespace mlxfast
