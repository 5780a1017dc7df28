#include "cpu/qmm.h"
namespace mlxfast { namespace qmm {
void run_avx512(const Args& a) { run_portable(a); }
}}
