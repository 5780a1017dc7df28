#include "io/bind_io.h"

#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "io/kv_file.h"
#include "io/kv_reader.h"
#include "io/kv_writer.h"
#include "io/xxhash64.h"
#include "mlx/array.h"
#include "mlx/transforms.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

namespace mlxfast {

namespace {

mx::Dtype dtype_from_name(const std::string& s) {
  static const std::pair<const char*, mx::Dtype> table[] = {
      {"bool", mx::bool_},       {"uint8", mx::uint8},     {"uint16", mx::uint16},
      {"uint32", mx::uint32},    {"uint64", mx::uint64},   {"int8", mx::int8},
      {"int16", mx::int16},      {"int32", mx::int32},     {"int64", mx::int64},
      {"float16", mx::float16},  {"bfloat16", mx::bfloat16}, {"float32", mx::float32},
  };
  for (auto& [name, dt] : table)
    if (s == name) return dt;
  throw std::invalid_argument("[mlxfast.KVReader] unsupported dtype '" + s + "'");
}

std::vector<std::string> bytes_list(const std::vector<nb::bytes>& v) {
  std::vector<std::string> out;
  out.reserve(v.size());
  for (const auto& b : v) out.emplace_back(b.c_str(), b.size());
  return out;
}

nb::dict writer_stats(io::KVWriter& w) {
  auto s = w.stats();
  nb::dict d;
  d["pending_jobs"] = s.pending_jobs;
  d["pending_bytes"] = s.pending_bytes;
  d["in_flight"] = s.in_flight;
  d["written"] = s.written;
  d["written_bytes"] = s.written_bytes;
  d["dropped"] = s.dropped;
  d["dropped_bytes"] = s.dropped_bytes;
  d["failed"] = s.failed;
  d["removed"] = s.removed;
  d["file_syncs"] = s.file_syncs;
  d["dir_syncs"] = s.dir_syncs;
  d["last_errno"] = s.last_errno;
  d["write_seconds"] = s.write_seconds;
  return d;
}

// (id, n_total, n_ok, fail_name, fail_reason, fail_missing, seconds, bytes, arrays)
nb::tuple result_tuple(io::ReadResult& r) {
  std::vector<mx::array> arrays;
  if (r.n_ok > 0) {
    for (size_t j = 0; j < r.specs.size(); ++j) {
      const auto& s = r.specs[j];
      mx::Shape shape(s.block_shape.begin(), s.block_shape.end());
      shape[0] *= r.n_ok;
      auto buf = r.buffers[j];
      // No copy: the array owns a reference to the page-aligned buffer.
      arrays.emplace_back(static_cast<void*>(buf->data), shape, dtype_from_name(s.dtype),
                          [buf](void*) mutable { buf.reset(); });
    }
  }
  return nb::make_tuple(r.id, r.n_total, r.n_ok, r.fail_name, r.fail_reason, r.fail_missing,
                        r.seconds, r.bytes, arrays);
}

} // namespace

void bind_io(nb::module_& m) {
  m.def("xxh64", [](nb::bytes data, uint64_t seed) { return io::XXH64::hash(data.c_str(), data.size(), seed); },
        "data"_a, "seed"_a = 0, "XXH64 of a bytes object (the SSD tier's checksum).");
  m.def("kv_header_size", [] { return io::kHeaderSize; });

  m.def("kv_scan",
        [](const std::string& dir, const std::string& qdir, uint64_t ns_hash, const std::string& layout,
           bool verify_data) {
          io::ScanResult r;
          {
            nb::gil_scoped_release nogil;
            r = io::scan_dir(dir, qdir, ns_hash, layout, verify_data);
          }
          std::vector<std::tuple<std::string, uint64_t, double, uint32_t>> entries;
          for (auto& e : r.entries) entries.emplace_back(e.key_hex, e.size, e.mtime, e.tokens);
          return nb::make_tuple(entries, r.tmp_removed, r.quarantined, r.quarantine_reasons);
        },
        "dir"_a, "quarantine_dir"_a, "ns_hash"_a, "layout"_a, "verify_data"_a = false,
        "Scan a namespace directory: (entries [(key_hex, size, mtime, tokens)], tmp_removed, "
        "quarantined, reasons). Removes *.tmp, quarantines bad or foreign files.");

  m.def("kv_quarantine", &io::quarantine_file, "path"_a, "quarantine_dir"_a,
        nb::call_guard<nb::gil_scoped_release>());

  nb::class_<io::KVWriter>(m, "KVWriter")
      .def(nb::init<std::string, uint64_t, bool>(), "dir"_a, "max_pending_bytes"_a,
           "paused"_a = false)
      .def("submit",
           [](io::KVWriter& w, const std::vector<std::string>& names, const std::vector<nb::bytes>& keys,
              const std::vector<uint32_t>& tokens, uint64_t ns_hash, const std::string& layout,
              std::vector<mx::array> arrays, int64_t rows) {
             auto k = bytes_list(keys);
             nb::gil_scoped_release nogil;
             mx::eval(arrays);
             return w.submit(names, k, tokens, ns_hash, layout, arrays, rows);
           },
           "names"_a, "keys"_a, "tokens"_a, "ns_hash"_a, "layout"_a, "arrays"_a, "rows"_a)
      .def("remove", &io::KVWriter::remove, "names"_a)
      .def("poll",
           [](io::KVWriter& w) {
             std::vector<std::tuple<std::string, nb::bytes, int, int, uint64_t>> out;
             for (auto& c : w.poll())
               out.emplace_back(c.path, nb::bytes(c.key.data(), c.key.size()), c.status, c.err, c.bytes);
             return out;
           },
           "[(name, key, status 0 written|1 dropped|2 failed|3 removed, errno, bytes)]")
      .def("wait_idle", &io::KVWriter::wait_idle, "timeout"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("set_paused", &io::KVWriter::set_paused, "paused"_a)
      .def("set_max_pending_bytes", &io::KVWriter::set_max_pending_bytes, "n"_a)
      .def("stats", &writer_stats)
      .def("close", &io::KVWriter::close, "drain"_a = true, "timeout"_a = 30.0,
           nb::call_guard<nb::gil_scoped_release>(),
           "Stop the thread within timeout seconds; False: it was stuck and is detached.");

  nb::class_<io::KVReader>(m, "KVReader")
      .def(nb::init<std::string>(), "dir"_a)
      .def("submit",
           [](io::KVReader& r, const std::vector<std::string>& names, const std::vector<nb::bytes>& keys,
              const std::vector<std::tuple<std::string, std::vector<int>, uint64_t>>& specs,
              uint64_t ns_hash, const std::string& layout, bool verify) {
             std::vector<io::ReadSpec> s;
             for (auto& [dt, shape, nbytes] : specs) {
               dtype_from_name(dt);
               s.push_back({dt, shape, nbytes});
             }
             return r.submit(names, bytes_list(keys), s, ns_hash, layout, verify);
           },
           "names"_a, "keys"_a, "specs"_a, "ns_hash"_a, "layout"_a, "verify"_a = false,
           "specs: [(dtype, block_shape, slice_bytes)] per storage array. Returns a job id.")
      .def("poll",
           [](io::KVReader& r) {
             nb::list out;
             for (auto& res : r.poll()) out.append(result_tuple(res));
             return out;
           },
           "[(id, n_total, n_ok, fail_name, fail_reason, fail_missing, seconds, bytes, arrays)]")
      .def("wait", &io::KVReader::wait, "id"_a, "timeout"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("pending", &io::KVReader::pending)
      .def("close", &io::KVReader::close, "timeout"_a = 5.0, nb::call_guard<nb::gil_scoped_release>(),
           "Stop the thread within timeout seconds; False: it was stuck and is detached.");
}

} // namespace mlxfast
