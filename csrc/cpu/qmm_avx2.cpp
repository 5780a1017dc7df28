#include "cpu/qmm.h"
namespace mlxfast { namespace qmm {
void run_avx2(const Args& a) { run_portable(a); }
}}
