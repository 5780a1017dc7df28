// Paged attention compiled with AVX-512 (see paged_attention.h).
#include "cpu/paged_attention.h"

namespace mlxfast {
namespace pa {
void run_avx512(const Args& a) { Kernel<16>::run(a); }
}  // namespace pa
}  // namespace mlxfast
