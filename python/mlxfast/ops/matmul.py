"""Projections: dense and affine-quantized matmuls with an optional fused
prologue (RMSNorm or a gated activation) and residual epilogue, and the
quantized embedding lookup (``dequantize_rows``)."""

from __future__ import annotations

import mlx.core as mx

from .. import _ext
from . import dispatch
from .activation import ACTS
from .norm_rope import rms_norm, rms_norm_reference

# ``norm=(weight, eps)`` or ``act=`` (a name in ``ACTS``) transform x before
# the matmul (at most one); ``residual=r`` adds r to the product. On the CPU the
# native primitive does all of it in one node with the same numbers as the
# separate native ops; elsewhere (and where the dtypes would not line up,
# see ``dense_matmul``) the separate ops run.


def _check_fusion(op: str, norm, act) -> None:
    if act is not None and (not isinstance(act, str) or act not in ACTS):
        names = ", ".join(repr(a) for a in ACTS)
        raise ValueError(f"[mlxfast.{op}] act must be one of {names} (or None), got {act!r}.")
    if norm is not None:
        if act is not None:
            raise ValueError(f"[mlxfast.{op}] norm and act cannot both be given.")
        if not (isinstance(norm, tuple) and len(norm) == 2):
            raise ValueError(f"[mlxfast.{op}] norm must be a (weight, eps) pair.")


def _check_residual(op: str, y: mx.array, residual: mx.array) -> None:
    if residual.shape != y.shape or residual.dtype != y.dtype:
        raise ValueError(f"[mlxfast.{op}] residual must have the output's shape {tuple(y.shape)} "
                         f"and dtype {y.dtype}, got {tuple(residual.shape)} {residual.dtype}.")


def _prologue(x: mx.array, norm, act, *, reference: bool, stream=None) -> mx.array:
    """The separate ops a fused prologue stands for (native on the CPU, or the references)."""
    if norm is not None:
        w, eps = norm
        return rms_norm_reference(x, w, eps) if reference else rms_norm(x, w, eps, stream=stream)
    if act is not None:
        native, ref = ACTS[act]
        return ref(x) if reference else native(x, stream=stream)
    return x


def _epilogue(op: str, y: mx.array, residual) -> mx.array:
    if residual is None:
        return y
    _check_residual(op, y, residual)
    return residual + y


def dense_matmul_reference(x: mx.array, w: mx.array, *, norm=None, act=None,
                           residual=None) -> mx.array:
    """Pure-MLX ``x @ w.T``; with fused pieces, the composition of their
    references: ``residual + (prologue(x) @ w.T)``."""
    _check_fusion("dense_matmul", norm, act)
    x = _prologue(x, norm, act, reference=True)
    return _epilogue("dense_matmul", mx.matmul(x, w.T), residual)


def dense_matmul(x: mx.array, w: mx.array, *, norm: tuple | None = None, act: str | None = None,
                 residual: mx.array | None = None, stream=None) -> mx.array:
    """``x @ w.T`` for dense weights w [N, K] (float32/float16/bfloat16).

    The result dtype follows MLX's promotion of x and w, accumulated in
    float32. On the CPU this is one native primitive sharing the quantized
    matmul's GEMV/GEMM kernels (MLX's CPU matmul is a reference BLAS at a
    few GFLOP/s on Linux); elsewhere it is ``x @ w.T``.

    Fused pieces (one primitive on the CPU, bit-identical to the separate ops):

    * ``norm=(weight, eps)``: the matmul consumes ``rms_norm(x, weight, eps)``
      (weight [x.shape[-1]]);
    * ``act="silu_mul_halves"`` or ``act="gelu_mul_halves"``: it consumes
      ``silu_mul_halves(x)`` / ``gelu_mul_halves(x)`` (x [..., 2K], gate half
      then up half);
    * ``residual=r``: the result is ``r + (x @ w.T)``; r has the result's
      shape and dtype (no broadcasting, no promotion).

    At most one of norm/act. Where w's dtype would promote the prologue's
    result (e.g. bf16 x with fp32 w), the separate ops run instead. Bad
    input raises ``ValueError``.
    """
    fused = norm is not None or act is not None
    if dispatch.on_cpu(stream):
        if not fused:
            out_dtype = mx.result_type(x, w)
            if out_dtype != x.dtype:
                x = x.astype(out_dtype)
            return _ext.dense_matmul(x, w, residual=residual, stream=stream)
        _check_fusion("dense_matmul", norm, act)
        t = x.dtype if norm is None else mx.result_type(x, norm[0])
        if mx.result_type(t, w) == t:
            if norm is not None:
                return _ext.dense_matmul(x, w, norm=norm[0], eps=norm[1], residual=residual,
                                         stream=stream)
            return _ext.dense_matmul(x, w, act=act, residual=residual, stream=stream)
        y = dense_matmul(_prologue(x, norm, act, reference=False, stream=stream), w, stream=stream)
        return _epilogue("dense_matmul", y, residual)
    return dense_matmul_reference(x, w, norm=norm, act=act, residual=residual)


# Int8 activations (``activations="int8"``, opt-in): llama.cpp's Q8_1 scheme.
# Each row of x is cut into blocks of ACT_BLOCK values; per block
# d = max|x| / 127 and xq = round(x * (127 / max|x|)) (half to even, int8);
# the product is then, per block,
#     scale * d * sum(q * xq) + bias * (d * sum(xq))
# with the integer sum exact (VNNI vpdpbusd on the CPU). The bias term uses
# d * sum(xq), not the float sum of x (what llama.cpp's Q8_1 stores too): both
# terms then see the same quantized input, so the result is exactly the
# ordinary product of x_hat = d * xq with the dequantized weights. That is
# the reference below (x_hat, then ``mx.quantized_matmul``); the kernels
# differ from it by float rounding order only.
ACT_BLOCK = 32
ACTIVATIONS = ("fp32", "int8")


def quantize_activations_int8(x: mx.array) -> tuple[mx.array, mx.array]:
    """x [..., K] (K a multiple of ACT_BLOCK) as (xq, d): xq [..., K / 32, 32]
    float32 holding integers in [-127, 127], d [..., K / 32, 1] float32."""
    K = x.shape[-1]
    if K % ACT_BLOCK:
        raise ValueError(f"[mlxfast.quantized_matmul] int8 activations need K % {ACT_BLOCK} == 0, "
                         f"got K={K}.")
    b = x.astype(mx.float32).reshape(*x.shape[:-1], K // ACT_BLOCK, ACT_BLOCK)
    amax = mx.max(mx.abs(b), axis=-1, keepdims=True)
    nz = amax > 0
    inv = mx.where(nz, mx.array(127.0, mx.float32) / mx.where(nz, amax, 1.0), 0.0)
    xq = mx.round(b * inv)
    return xq, amax / mx.array(127.0, mx.float32)


def fake_quantize_activations_int8(x: mx.array) -> mx.array:
    """``d * xq`` (float32, x's shape): what the int8-activation matmul multiplies."""
    xq, d = quantize_activations_int8(x)
    return (xq * d).reshape(x.shape)


def symmetric_biases(scales: mx.array, bits: int) -> mx.array:
    """The biases of a symmetric format: ``-2^(bits-1) * scales`` (exact: a
    power of two). Layers of such formats keep no biases (see
    ``models.layers.drop_symmetric_biases``); the references materialize them."""
    return scales * -float(1 << (bits - 1))


# The row-interleaved layout (CPU, AVX-512, 4- or 8-bit): MLX's w [N, C]
# uint32 (C = K * bits / 32) regrouped as [N / 16, C, 16], word (b, j, r)
# holding values vj .. vj+v-1 of row 16b + r (v = 32 / bits), and scales /
# biases [N, G] as [N / 16, G, 16].
# The AVX-512 GEMV then runs 16 rows in the lanes of a vector over one
# contiguous stream (see csrc/cpu/qmm.h, Args::rows16). A load-time repack:
# the same bytes, another order. ``quantized_matmul`` takes it as it takes
# MLX's layout (a 3-D w); ``unpack_rows16`` undoes it.
ROWS16 = 16


def can_pack_rows16(w: mx.array, bits: int) -> bool:
    """Whether an MLX-layout w of this width can be packed: 4- or 8-bit,
    rows a multiple of 16; 2-D (a projection) or 3-D (stacked experts)."""
    return bits in (4, 8) and _rows16_shape(w)


def _rows16_shape(w: mx.array) -> bool:
    return w.ndim in (2, 3) and w.shape[-2] % ROWS16 == 0 and w.shape[-2] > 0


def _interleave(a: mx.array) -> mx.array:
    *lead, n, c = a.shape
    return mx.contiguous(a.reshape(*lead, n // ROWS16, ROWS16, c).swapaxes(-1, -2))


def _deinterleave(a: mx.array) -> mx.array:
    *lead, b, c, _ = a.shape
    return mx.contiguous(a.swapaxes(-1, -2).reshape(*lead, b * ROWS16, c))


def rows16_flat_index(shape: tuple, idx):
    """Where flat index ``idx`` (numpy ints) of an MLX-layout array of
    ``shape`` ([..., N, C]) lies in its row-interleaved copy ([..., N/16, C, 16])."""
    n, c = shape[-2], shape[-1]
    lead, rest = idx // (n * c), idx % (n * c)
    row, col = rest // c, rest % c
    return ((lead * (n // ROWS16) + row // ROWS16) * c + col) * ROWS16 + row % ROWS16


def pack_rows16(w: mx.array, scales: mx.array, biases: mx.array | None):
    """(w, scales, biases) in the row-interleaved layout (biases None stays
    None), 4- or 8-bit alike (w is moved a uint32 word at a time); stacked
    experts [E, N, C] become [E, N / 16, C, 16]."""
    if not _rows16_shape(w) or scales.ndim != w.ndim or scales.shape[:-1] != w.shape[:-1]:
        raise ValueError(f"[mlxfast.pack_rows16] needs a 2-D or 3-D w with rows a multiple of {ROWS16} "
                         f"and matching scales, got w {tuple(w.shape)}, scales {tuple(scales.shape)}.")
    return _interleave(w), _interleave(scales), None if biases is None else _interleave(biases)


def unpack_rows16(w: mx.array, scales: mx.array | None, biases: mx.array | None, *,
                  stacked: bool = False):
    """The inverse of :func:`pack_rows16`: MLX's layout. A projection's w is
    packed when 3-D, stacked experts' (``stacked=True``) when 4-D; arrays
    already in MLX's layout (and dense ones, scales None) pass through."""
    if scales is None or w.ndim != (4 if stacked else 3):
        return w, scales, biases
    return _deinterleave(w), _deinterleave(scales), None if biases is None else _deinterleave(biases)


def quantized_matmul_int8_reference(x: mx.array, w: mx.array, scales: mx.array,
                                    biases: mx.array | None, *, group_size: int = 64,
                                    bits: int = 4) -> mx.array:
    """Pure-MLX int8-activation ``x @ dequantize(w).T`` in x's dtype (the
    oracle of the native int8 kernels and their fallback off the CPU).
    biases None: symmetric (bias = -2^(bits-1) * scale)."""
    if biases is None:
        biases = symmetric_biases(scales, bits)
    xh = fake_quantize_activations_int8(x)
    out = mx.quantized_matmul(xh, w, scales.astype(mx.float32), biases.astype(mx.float32),
                              transpose=True, group_size=group_size, bits=bits)
    return out if out.dtype == x.dtype else out.astype(x.dtype)


def _check_activations(activations: str, transpose: bool) -> None:
    if activations not in ACTIVATIONS:
        raise ValueError(f"[mlxfast.quantized_matmul] activations must be one of {ACTIVATIONS}, "
                         f"got {activations!r}.")
    if activations == "int8" and not transpose:
        raise ValueError("[mlxfast.quantized_matmul] int8 activations need transpose=True.")


def quantized_matmul_reference(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    norm: tuple | None = None,
    act: str | None = None,
    residual: mx.array | None = None,
    activations: str = "fp32",
) -> mx.array:
    """Pure-MLX ``x @ dequantize(w).T`` (MLX affine format): ``mx.quantized_matmul``
    (``activations="int8"``: :func:`quantized_matmul_int8_reference`). biases
    None: symmetric, materialized as ``-2^(bits-1) * scales`` (exact).

    With fused pieces, the composition of their references:
    ``residual + round(prologue(x) @ dequantize(w).T)``, the product rounded
    to the prologue's dtype as :func:`quantized_matmul` does.
    """
    _check_fusion("quantized_matmul", norm, act)
    _check_activations(activations, transpose)
    w, scales, biases = unpack_rows16(w, scales, biases)
    x = _prologue(x, norm, act, reference=True)
    if biases is None:
        biases = symmetric_biases(scales, bits)
    if activations == "int8":
        out = quantized_matmul_int8_reference(x, w, scales, biases, group_size=group_size,
                                              bits=bits)
    else:
        out = mx.quantized_matmul(
            x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits
        )
    if norm is None and act is None and residual is None:
        return out
    if out.dtype != x.dtype:
        out = out.astype(x.dtype)
    return _epilogue("quantized_matmul", out, residual)


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    norm: tuple | None = None,
    act: str | None = None,
    residual: mx.array | None = None,
    activations: str = "fp32",
    stream=None,
) -> mx.array:
    """``x @ dequantize(w, scales, biases).T`` for MLX's affine quantization.

    x: [..., K] float32/float16/bfloat16; w: [N, K * bits / 32] uint32 (values
    packed LSB-first); scales, biases: [N, K / group_size], float32/float16/
    bfloat16 (same dtype as each other, not necessarily x's — GGUF weights
    keep float16 scales with float32 activations); biases None for a
    symmetric format (every bias ``-2^(bits-1) * scale``: GGUF's Q4_0 and
    Q8_0), which the kernels compute instead of reading. bits: 2, 3, 4, 5, 6 or 8
    (SIMD kernels for 4 and 8); group_size: 32, 64 or 128. Returns [..., N]
    in x's dtype (``mx.quantized_matmul`` would promote fp16 x with fp32
    scales to fp32), accumulated in float32.

    Fused pieces, as for :func:`dense_matmul`: ``norm=(weight, eps)`` or
    ``act="silu_mul_halves"`` / ``"gelu_mul_halves"`` (x [..., 2K]) before
    the matmul, ``residual=r`` after it; with a norm the result has the norm's dtype (``rms_norm``
    promotes x with its weight).

    On the CPU this is one native primitive (GEMV path for up to 16 rows,
    blocked GEMM above); elsewhere, and for ``transpose=False``, it is
    ``mx.quantized_matmul`` (and the separate ops for the fused pieces).
    ``activations="int8"`` (opt-in) quantizes x (after the prologue) to int8
    per 32 values, llama.cpp's Q8_1 scheme (see ``ACT_BLOCK`` above); on the
    CPU an AVX-512 VNNI or AVX2 kernel runs (fastest over the row-interleaved
    layout, :func:`pack_rows16`), a portable one elsewhere, and
    :func:`quantized_matmul_int8_reference` off the CPU. The
    default, ``"fp32"``, keeps the activations as they are.

    Bad shapes/dtypes raise ``ValueError``.
    """
    _check_fusion("quantized_matmul", norm, act)
    _check_activations(activations, transpose)
    if transpose and dispatch.on_cpu(stream):
        if norm is not None:
            return _ext.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits,
                                         norm=norm[0], eps=norm[1], act=act, residual=residual,
                                         activations=activations, stream=stream)
        return _ext.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits,
                                     act=act, residual=residual, activations=activations,
                                     stream=stream)
    x = _prologue(x, norm, act, reference=False, stream=stream)
    out = quantized_matmul_reference(
        x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits,
        activations=activations
    )
    out = out.astype(x.dtype) if out.dtype != x.dtype else out
    return _epilogue("quantized_matmul", out, residual)


def dequantize_rows_reference(
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    ids: mx.array,
    *,
    group_size: int = 64,
    bits: int = 4,
    dtype=None,
) -> mx.array:
    """Pure-MLX :func:`dequantize_rows`: gather the packed rows, dequantize in
    float32 (biases None: symmetric, as for :func:`quantized_matmul`)."""
    w, scales, biases = unpack_rows16(w, scales, biases)
    if biases is None:
        biases = symmetric_biases(scales, bits)
    out = mx.dequantize(w[ids], scales[ids].astype(mx.float32), biases[ids].astype(mx.float32),
                        group_size=group_size, bits=bits)
    dtype = scales.dtype if dtype is None else dtype
    return out if dtype == mx.float32 else out.astype(dtype)


def dequantize_rows(
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    ids: mx.array,
    *,
    group_size: int = 64,
    bits: int = 4,
    dtype=None,
    stream=None,
) -> mx.array:
    """Quantized embedding lookup: rows ``ids`` of ``dequantize(w, scales, biases)``.

    w: [V, D * bits / 32] uint32; scales, biases: [V, D / group_size] (biases
    None: symmetric);
    ids: integer array of any shape. Returns [*ids.shape, D] in ``dtype``
    (default: scales' dtype), computed in float32 (fp16 scales would round
    every element) and rounded once. Only the looked-up rows are dequantized:
    one native primitive on the CPU (MLX's graph for it is ~38 primitives),
    the reference elsewhere.
    """
    if dispatch.on_cpu(stream):
        return _ext.dequantize_rows(w, scales, biases, ids, group_size=group_size, bits=bits,
                                    dtype=dtype, stream=stream)
    return dequantize_rows_reference(w, scales, biases, ids, group_size=group_size, bits=bits,
                                     dtype=dtype)
