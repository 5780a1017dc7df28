// The unit the decode kernels' P.V runs over (decode_span_<isa>.h): one
// block's keys inside a span of several blocks. ISA-neutral; compiled per
// ISA, so it lives in an anonymous namespace (see csrc/cpu/qmm.h, ODR).
#pragma once

#include <cstdint>

namespace mlxfast {
namespace {

// A block's keys: their first slot, how many, and where their scores sit in
// the span's score rows.
struct SpanSeg {
  int64_t slot0;
  int nk, off;
};

}  // namespace
}  // namespace mlxfast
