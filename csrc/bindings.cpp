// NB_MODULE(_ext): bindings only; every op lives in csrc/ops/.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "common/cpu_features.h"
#include "common/thread_pool.h"
#include "ops/quantized_argmax.h"
#include "ops/quantized_matmul.h"
#include "ops/silu_mul.h"
#include "ops/rms_norm.h"
#include "ops/rope.h"
#include "ops/dequantize_rows.h"
#include "ops/kv_write.h"
#include "ops/qkv_rope.h"
#include "ops/paged_attention.h"
#include "ops/kv_quant.h"
#include "ops/sample.h"
#include "ops/moe.h"
#include "io/bind_io.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

NB_MODULE(_ext, m) {
  m.doc() = "mlxfast native kernels";

  m.def("cpu_path", [] { return std::string(mlxfast::cpu_path_name(mlxfast::cpu_path())); },
        "The CPU kernel path in use: portable, avx2, avx512 or neon.");
  m.def("set_cpu_path", &mlxfast::set_cpu_path, "name"_a,
        "Force a CPU kernel path ('' = automatic). Raises if unsupported.");
  m.def("cpu_supports", [](const std::string& name) {
        for (auto p : {mlxfast::CpuPath::Portable, mlxfast::CpuPath::Avx2,
                       mlxfast::CpuPath::Avx512, mlxfast::CpuPath::Neon}) {
          if (name == mlxfast::cpu_path_name(p)) return mlxfast::cpu_supports(p);
        }
        return false;
      }, "name"_a);
  m.def("num_threads", &mlxfast::num_threads);

  m.def("rms_norm", &mlxfast::rms_norm, "x"_a, "weight"_a, "eps"_a, nb::kw_only(),
        "stream"_a = nb::none());
  m.def("rope", &mlxfast::rope, "x"_a, "positions"_a, "dims"_a, "traditional"_a, "base"_a.none(),
        "scale"_a, "freqs"_a.none(), nb::kw_only(), "stream"_a = nb::none());
  m.def("kv_write", &mlxfast::kv_write, "pool"_a, "slots"_a, "values"_a, nb::kw_only(),
        "inplace"_a = false, "stream"_a = nb::none());
  m.def("kv_write_pair", &mlxfast::kv_write_pair, "k_pool"_a, "v_pool"_a, "slots"_a, "k"_a,
        "v"_a, nb::kw_only(), "inplace"_a = false, "stream"_a = nb::none());
  m.def("qkv_rope", &mlxfast::qkv_rope, "qkv"_a, "positions"_a, "n_heads"_a, "n_kv_heads"_a,
        "head_dim"_a, "dims"_a, "traditional"_a, "base"_a.none(), "scale"_a, "freqs"_a.none(),
        "q_norm"_a.none(), "k_norm"_a.none(), "eps"_a, nb::kw_only(), "stream"_a = nb::none());
  m.def("silu_mul_halves", &mlxfast::silu_mul_halves, "gate_up"_a, nb::kw_only(),
        "stream"_a = nb::none());
  m.def("silu_mul", &mlxfast::silu_mul, "gate"_a, "up"_a, nb::kw_only(),
        "stream"_a = nb::none());
  m.def("gelu_mul_halves", &mlxfast::gelu_mul_halves, "gate_up"_a, nb::kw_only(),
        "stream"_a = nb::none());
  m.def("gelu_mul", &mlxfast::gelu_mul, "gate"_a, "up"_a, nb::kw_only(),
        "stream"_a = nb::none());
  // Fused pieces (see ops/quantized_matmul.h): norm (weight) + eps, act, residual.
  m.def("dense_matmul",
        [](const mx::array& x, const mx::array& w, std::optional<mx::array> norm, float eps,
           std::optional<std::string> act, std::optional<mx::array> residual,
           mx::StreamOrDevice s) {
          return mlxfast::dense_matmul(x, w, mlxfast::Fusion{norm, eps, act.value_or(""), residual},
                                       s);
        },
        "x"_a, "w"_a, nb::kw_only(), "norm"_a = nb::none(), "eps"_a = 0.f,
        "act"_a = nb::none(), "residual"_a = nb::none(), "stream"_a = nb::none());
  m.def("quantized_matmul",
        [](const mx::array& x, const mx::array& w, const mx::array& scales,
           std::optional<mx::array> biases, int group_size, int bits, std::optional<mx::array> norm,
           float eps, std::optional<std::string> act, std::optional<mx::array> residual,
           const std::string& activations, mx::StreamOrDevice s) {
          if (activations != "fp32" && activations != "int8") {
            throw std::invalid_argument(
                "[mlxfast.quantized_matmul] activations must be 'fp32' or 'int8', got '" +
                activations + "'.");
          }
          return mlxfast::quantized_matmul(x, w, scales, biases, group_size, bits,
                                           mlxfast::Fusion{norm, eps, act.value_or(""), residual},
                                           activations == "int8", s);
        },
        "x"_a, "w"_a, "scales"_a, "biases"_a.none(), nb::kw_only(), "group_size"_a = 64, "bits"_a = 4,
        "norm"_a = nb::none(), "eps"_a = 0.f, "act"_a = nb::none(), "residual"_a = nb::none(),
        "activations"_a = "fp32", "stream"_a = nb::none());
  m.def("quantized_argmax", &mlxfast::quantized_argmax, "x"_a, "w"_a, "scales"_a, "biases"_a.none(),
        "bounds"_a, nb::kw_only(), "group_size"_a, "bits"_a, "norm"_a = nb::none(), "eps"_a = 0.f,
        "stream"_a = nb::none());
  m.def("quantized_matmul_direct", &mlxfast::quantized_matmul_direct, "x"_a, "w"_a, "scales"_a,
        "biases"_a.none(), nb::kw_only(), "group_size"_a, "bits"_a, "int8"_a, "path"_a,
        "Test hook: the kernels on evaluated arrays (biases None: symmetric).");
  m.def("int8_activations_unsupported", &mlxfast::int8_acts_unsupported,
        "'' where this CPU runs the int8-activation matmul natively, else what it lacks.");
  m.def("int8_activations_layout", &mlxfast::int8_acts_layout,
        "The layout ('rows16') the int8-activation kernels in use read; '' where none.");
  m.def("dequantize_rows", &mlxfast::dequantize_rows, "w"_a, "scales"_a, "biases"_a.none(), "ids"_a,
        nb::kw_only(), "group_size"_a, "bits"_a, "dtype"_a = nb::none(), "stream"_a = nb::none());
  m.def("paged_attention", &mlxfast::paged_attention, "q"_a, "k_pool"_a, "v_pool"_a,
        "block_tables"_a, "seq_idx"_a, "positions"_a, "scale"_a, "block_size"_a,
        nb::kw_only(), "merge_heads"_a = false, "window"_a = 0, "stream"_a = nb::none());
  m.def("sample_tokens", &mlxfast::sample_tokens, "logits"_a, "keys"_a, "temperature"_a,
        "top_k"_a, "top_p"_a, "min_p_log"_a, nb::kw_only(), "stream"_a = nb::none());
  // quantized KV (python/mlxfast/ops_kvquant.py)
  m.def("kv_quant_encode", &mlxfast::kv_quant_encode, "k"_a, "v"_a, "signs"_a, "codebook"_a,
        nb::kw_only(), "head_dim"_a, "k_bits"_a, "v_bits"_a, "group_size"_a, "v_turbo"_a,
        "stream"_a = nb::none());
  m.def("kv_quant_dequant", &mlxfast::kv_quant_dequant, "packed"_a, "signs"_a, "codebook"_a,
        nb::kw_only(), "head_dim"_a, "k_bits"_a, "v_bits"_a, "group_size"_a, "v_turbo"_a,
        "dtype"_a, "stream"_a = nb::none());
  m.def("kv_quant_paged_attention", &mlxfast::kv_quant_paged_attention, "q"_a, "packed"_a,
        "block_tables"_a, "seq_idx"_a, "positions"_a, "signs"_a, "codebook"_a, nb::kw_only(),
        "scale"_a, "block_size"_a, "head_dim"_a, "k_bits"_a, "v_bits"_a, "group_size"_a,
        "v_turbo"_a, "window"_a = 0, "stream"_a = nb::none());

  // mixture of experts (python/mlxfast/ops/moe.py)
  m.def("moe_route", &mlxfast::moe_route, "logits"_a, "k"_a, nb::kw_only(), "softmax_first"_a,
        "normalize"_a, "stream"_a = nb::none());
  m.def("moe_experts",
        [](const mx::array& x, const mx::array& inds, const mx::array& scores,
           const mx::array& gw, std::optional<mx::array> gs, std::optional<mx::array> gb,
           const mx::array& uw, std::optional<mx::array> us, std::optional<mx::array> ub,
           const mx::array& dw, std::optional<mx::array> ds, std::optional<mx::array> db,
           int group_size, int bits, std::optional<mx::array> norm, float eps,
           std::optional<mx::array> residual, bool int8, mx::StreamOrDevice s) {
          return mlxfast::moe_experts(x, inds, scores, {gw, gs, gb}, {uw, us, ub}, {dw, ds, db},
                                      group_size, bits, norm, eps, residual, int8, s);
        },
        "x"_a, "inds"_a, "scores"_a, "gate_w"_a, "gate_scales"_a.none(), "gate_biases"_a.none(),
        "up_w"_a, "up_scales"_a.none(), "up_biases"_a.none(), "down_w"_a,
        "down_scales"_a.none(), "down_biases"_a.none(), nb::kw_only(), "group_size"_a = 64,
        "bits"_a = 4, "norm"_a = nb::none(), "eps"_a = 0.f, "residual"_a = nb::none(),
        "int8"_a = false, "stream"_a = nb::none());

  mlxfast::bind_io(m);  // SSD-tier I/O: csrc/io/
}
