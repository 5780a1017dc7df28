"""Native kernels with their pure-MLX references.

Every op here works on every MLX backend: on the CPU it runs the native
kernel from ``mlxfast._ext``; elsewhere (Metal without a kernel, CUDA) it runs
the pure-MLX reference, which is also the native kernel's test oracle.
The ``*_reference`` functions are public so that tests and other libraries can
compare against them.
"""

from __future__ import annotations

import mlx.core as mx

from . import _ext


def _on_cpu(stream=None) -> bool:
    if stream is None:
        return mx.default_device() == mx.cpu
    if isinstance(stream, mx.Device):
        return stream == mx.cpu
    return stream.device == mx.cpu


def cpu_path() -> str:
    """The native CPU kernel path in use: ``portable``, ``avx2``, ``avx512`` or ``neon``.

    ``MLXFAST_CPU_PATH`` in the environment lowers it (e.g. to test the
    portable path on an AVX-512 machine).
    """
    return _ext.cpu_path()


def set_cpu_path(name: str = "") -> None:
    """Force a CPU kernel path for the process; ``""`` restores the automatic choice."""
    _ext.set_cpu_path(name)


def cpu_supports(name: str) -> bool:
    """Whether this CPU can run the named kernel path."""
    return _ext.cpu_supports(name)


def num_threads() -> int:
    """Threads the native kernels use (``MLXFAST_NUM_THREADS`` overrides)."""
    return _ext.num_threads()


def silu_mul_reference(gate: mx.array, up: mx.array) -> mx.array:
    """Pure-MLX ``silu(gate) * up``."""
    return (gate * mx.sigmoid(gate.astype(mx.float32)).astype(gate.dtype)) * up


def silu_mul(gate: mx.array, up: mx.array, *, stream=None) -> mx.array:
    """The gated-MLP activation ``silu(gate) * up`` as one primitive.

    gate, up: same shape, float32 / float16 / bfloat16. Returns the same
    shape and dtype. Computed in float32 and rounded once.
    """
    if _on_cpu(stream):
        return _ext.silu_mul(gate, up, stream=stream)
    return silu_mul_reference(gate, up)


def quantized_matmul_reference(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
) -> mx.array:
    """Pure-MLX ``x @ dequantize(w).T`` (MLX affine format): ``mx.quantized_matmul``."""
    return mx.quantized_matmul(
        x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits
    )


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    stream=None,
) -> mx.array:
    """``x @ dequantize(w, scales, biases).T`` for MLX's affine quantization.

    x: [..., K] float32/float16/bfloat16; w: [N, K * bits / 32] uint32 (values
    packed LSB-first); scales, biases: [N, K / group_size], float32/float16/
    bfloat16 (same dtype as each other, not necessarily x's — GGUF weights
    keep float16 scales with float32 activations). bits: 2, 3, 4, 5, 6 or 8
    (SIMD kernels for 4 and 8); group_size: 32, 64 or 128. Returns [..., N]
    in x's dtype (``mx.quantized_matmul`` would promote fp16 x with fp32
    scales to fp32), accumulated in float32.

    On the CPU this is one native primitive (GEMV path for up to 8 rows,
    blocked GEMM above); elsewhere, and for ``transpose=False``, it is
    ``mx.quantized_matmul``. Bad shapes/dtypes raise ``ValueError``.
    """
    if biases is None:
        raise ValueError("[mlxfast.quantized_matmul] biases are required (affine quantization).")
    if transpose and _on_cpu(stream):
        return _ext.quantized_matmul(
            x, w, scales, biases, group_size=group_size, bits=bits, stream=stream
        )
    out = quantized_matmul_reference(
        x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits
    )
    return out.astype(x.dtype) if out.dtype != x.dtype else out


def dequantize_rows_reference(
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    ids: mx.array,
    *,
    group_size: int = 64,
    bits: int = 4,
) -> mx.array:
    """Pure-MLX oracle for :func:`dequantize_rows`: dequantize all of ``w``, then gather."""
    full = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
    return full[ids]


def dequantize_rows(
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    ids: mx.array,
    *,
    group_size: int = 64,
    bits: int = 4,
) -> mx.array:
    """Quantized embedding lookup: rows ``ids`` of ``dequantize(w, scales, biases)``.

    w: [V, D * bits / 32] uint32; scales, biases: [V, D / group_size];
    ids: integer array of any shape. Returns [*ids.shape, D] in scales' dtype.
    Gathers the packed rows first, so only the looked-up rows are dequantized
    (a plain MLX graph: a gather and a dequantize, on every backend).
    """
    return mx.dequantize(
        w[ids], scales[ids], biases[ids], group_size=group_size, bits=bits
    )
