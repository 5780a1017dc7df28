// Python bindings of the SSD-tier I/O (KVWriter, KVReader, scan, XXH64).
#pragma once

#include <nanobind/nanobind.h>

namespace mlxfast {
void bind_io(nanobind::module_& m);
}
