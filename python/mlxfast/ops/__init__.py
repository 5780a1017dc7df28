"""Native kernels with their pure-MLX references: the public API.

Every op here works on every MLX backend: on the CPU it runs the native
kernel from ``mlxfast._ext``; elsewhere (Metal without a kernel, CUDA) it runs
the pure-MLX reference, which is also the native kernel's test oracle.
The ``*_reference`` functions are public so that tests and other libraries can
compare against them.

One module per kernel family: ``dispatch`` (where ops run, the CPU path),
``activation``, ``norm_rope``, ``matmul``, ``head`` (a quantized output
head's greedy choice), ``attention``, ``kvquant`` (the
quantized-KV formats and kernels), ``moe`` (mixture-of-experts routing and
experts), ``sampling``.
"""

from __future__ import annotations

from .. import _ext  # noqa: F401  (tests check which native ops this build has)
from .activation import (ACTS, gelu_mul, gelu_mul_halves, gelu_mul_halves_reference,
                         gelu_mul_reference, silu_mul, silu_mul_halves,
                         silu_mul_halves_reference, silu_mul_reference)
from .attention import (has_native_paged_attention, kv_write, kv_write_pair,
                        kv_write_pair_reference, kv_write_reference, paged_attention,
                        paged_attention_reference, paged_gather_reference)
from .dispatch import (cpu_path, cpu_supports, int8_activations_layout,
                       int8_activations_unsupported, num_threads, on_cpu, set_cpu_path)
from .kvquant import (KVQuantFormat, has_native_kv_quant, kv_quant_dequant,
                      kv_quant_dequant_reference, kv_quant_encode, kv_quant_encode_reference,
                      kv_quant_paged_attention, kv_quant_paged_attention_reference)
from .matmul import (can_pack_rows16, dense_matmul, dense_matmul_reference, dequantize_rows,
                     dequantize_rows_reference, fake_quantize_activations_int8, pack_rows16,
                     quantized_matmul, quantized_matmul_int8_reference,
                     quantized_matmul_reference, rows16_flat_index, symmetric_biases,
                     unpack_rows16)
from .head import argmax_bounds, has_native_quantized_argmax, quantized_argmax
from .norm_rope import qkv_rope, qkv_rope_reference, rms_norm, rms_norm_reference, rope, rope_reference
from .moe import moe_experts, moe_experts_reference, moe_route, moe_route_reference
from .sampling import sample_tokens, sample_tokens_reference

__all__ = [
    "ACTS", "KVQuantFormat", "argmax_bounds", "can_pack_rows16", "cpu_path", "cpu_supports", "dense_matmul", "dense_matmul_reference",
    "dequantize_rows", "dequantize_rows_reference", "fake_quantize_activations_int8", "gelu_mul", "gelu_mul_halves",
    "gelu_mul_halves_reference", "gelu_mul_reference", "has_native_kv_quant",
    "has_native_paged_attention", "has_native_quantized_argmax", "int8_activations_layout", "int8_activations_unsupported",
    "kv_quant_dequant", "kv_quant_dequant_reference",
    "kv_quant_encode", "kv_quant_encode_reference", "kv_quant_paged_attention",
    "kv_quant_paged_attention_reference", "kv_write", "kv_write_pair", "kv_write_pair_reference",
    "kv_write_reference", "moe_experts", "moe_experts_reference", "moe_route",
    "moe_route_reference", "num_threads", "on_cpu", "paged_attention", "paged_attention_reference",
    "paged_gather_reference", "qkv_rope", "qkv_rope_reference", "quantized_argmax", "quantized_matmul",
    "quantized_matmul_int8_reference", "quantized_matmul_reference", "rms_norm", "rms_norm_reference", "rope", "rope_reference",
    "pack_rows16", "sample_tokens", "sample_tokens_reference", "set_cpu_path", "silu_mul", "silu_mul_halves",
    "silu_mul_halves_reference", "silu_mul_reference", "symmetric_biases", "unpack_rows16",
    "rows16_flat_index",
]
