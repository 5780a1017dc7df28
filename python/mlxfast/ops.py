"""Native kernels with their pure-MLX references.

Every op here works on every MLX backend: on the CPU it runs the native
kernel from ``mlxfast._ext``; elsewhere (Metal without a kernel, CUDA) it runs
the pure-MLX reference, which is also the native kernel's test oracle.
The ``*_reference`` functions are public so that tests and other libraries can
compare against them.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

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


def rms_norm_reference(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """Pure-MLX RMSNorm over the last axis: ``mx.fast.rms_norm``."""
    return mx.fast.rms_norm(x, weight, eps)


def rms_norm(x: mx.array, weight: mx.array, eps: float, *, stream=None) -> mx.array:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` as one primitive.

    x [..., D] and weight [D], float32/float16/bfloat16; the result has their
    promoted dtype (as ``mx.fast.rms_norm``). Accumulates in float32.
    """
    if _on_cpu(stream):
        return _ext.rms_norm(x, weight, eps, stream=stream)
    return rms_norm_reference(x, weight, eps)


def rope_reference(x, positions, dims, *, traditional=False, base=10000.0, scale=1.0, freqs=None):
    """Pure-MLX RoPE with one position per token (see ``rope``)."""
    half = dims // 2
    if freqs is not None:
        inv = 1.0 / freqs.astype(mx.float32)
    else:
        inv = base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    angles = (positions.astype(mx.float32) * scale)[..., None, None] * inv  # [..., 1, half]
    cos, sin = mx.cos(angles), mx.sin(angles)
    xf = x.astype(mx.float32)
    if traditional:
        x0, x1 = xf[..., 0:dims:2], xf[..., 1:dims:2]
        rot = mx.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(*x.shape[:-1], dims)
    else:
        x0, x1 = xf[..., :half], xf[..., half:dims]
        rot = mx.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    if dims < x.shape[-1]:
        rot = mx.concatenate([rot, xf[..., dims:]], axis=-1)
    return rot.astype(x.dtype)


def rope(x: mx.array, positions: mx.array, dims: int, *, traditional: bool = False,
         base: float | None = 10000.0, scale: float = 1.0, freqs: mx.array | None = None,
         stream=None) -> mx.array:
    """Rotary position embedding with one position per token, as one primitive.

    x [..., H, D] float32/float16/bfloat16: each leading index is a token whose
    position is ``positions`` (int32, shape ``x.shape[:-2]``); its H heads share
    the angles ``scale * position * f_i`` with ``f_i = base**(-2i/dims)`` (or
    ``1 / freqs[i]`` when ``freqs`` is given and ``base`` is None). Rotates the
    first ``dims`` features in MLX's layout (pairs ``(i, i + dims/2)``) or the
    traditional one (pairs ``(2i, 2i + 1)``); the rest pass through. Same
    numbers as ``mx.fast.rope`` with those offsets.
    """
    if freqs is not None:
        base = None
    if _on_cpu(stream):
        return _ext.rope(x, positions, dims, traditional, base, scale, freqs, stream=stream)
    return rope_reference(x, positions, dims, traditional=traditional, base=base, scale=scale, freqs=freqs)


def silu_mul_halves_reference(gate_up: mx.array) -> mx.array:
    """Pure-MLX ``silu(gate) * up`` for ``gate_up = concat([gate, up], -1)``."""
    gate, up = mx.split(gate_up, 2, axis=-1)
    return silu_mul_reference(gate, up)


def silu_mul_halves(gate_up: mx.array, *, stream=None) -> mx.array:
    """``silu_mul`` of the two halves of the last axis ([..., 2M] -> [..., M]):
    the output of a fused gate/up projection, without splitting it first."""
    if _on_cpu(stream):
        return _ext.silu_mul_halves(gate_up, stream=stream)
    return silu_mul_halves_reference(gate_up)


def gelu_mul_reference(gate: mx.array, up: mx.array) -> mx.array:
    """Pure-MLX ``gelu_approx(gate) * up`` as mlx-lm's Gemma MLP computes it:
    ``nn.gelu_approx``'s formula, op for op, in gate's dtype (bit-identical
    to ``nn.gelu_approx(gate) * up``)."""
    g = 0.5 * gate * (1 + mx.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
    return g * up


def gelu_mul(gate: mx.array, up: mx.array, *, stream=None) -> mx.array:
    """The gated-MLP activation ``gelu_approx(gate) * up`` (Gemma) as one primitive.

    ``gelu_approx(x) = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``
    (MLX's ``nn.gelu_approx``, the tanh approximation). gate, up: same shape,
    float32 / float16 / bfloat16. Returns the same shape and dtype, computed
    in float32 and rounded once (as ``x * sigmoid(2 * sqrt(2/pi) * (x +
    0.044715 * x**3))``, the same function without tanh's cancellation near
    -1); large inputs saturate, never NaN/inf.
    """
    if _on_cpu(stream):
        return _ext.gelu_mul(gate, up, stream=stream)
    return gelu_mul_reference(gate, up)


def gelu_mul_halves_reference(gate_up: mx.array) -> mx.array:
    """Pure-MLX ``gelu_approx(gate) * up`` for ``gate_up = concat([gate, up], -1)``."""
    gate, up = mx.split(gate_up, 2, axis=-1)
    return gelu_mul_reference(gate, up)


def gelu_mul_halves(gate_up: mx.array, *, stream=None) -> mx.array:
    """``gelu_mul`` of the two halves of the last axis ([..., 2M] -> [..., M]),
    as ``silu_mul_halves``."""
    if _on_cpu(stream):
        return _ext.gelu_mul_halves(gate_up, stream=stream)
    return gelu_mul_halves_reference(gate_up)


def qkv_rope_reference(qkv, positions, n_heads, n_kv_heads, head_dim, dims, *, traditional=False,
                       base=10000.0, scale=1.0, freqs=None, q_norm=None, k_norm=None, eps=1e-6):
    """Pure-MLX ``qkv_rope``: split, optional per-head RMSNorm, RoPE."""
    lead = qkv.shape[:-1]
    x = qkv.reshape(*lead, n_heads + 2 * n_kv_heads, head_dim)
    q, k, v = x[..., :n_heads, :], x[..., n_heads:n_heads + n_kv_heads, :], x[..., n_heads + n_kv_heads:, :]
    if q_norm is not None:
        q = mx.fast.rms_norm(q.astype(mx.float32), q_norm.astype(mx.float32), eps)
        k = mx.fast.rms_norm(k.astype(mx.float32), k_norm.astype(mx.float32), eps)
    kw = dict(traditional=traditional, base=base, scale=scale, freqs=freqs)
    return (rope_reference(q, positions, dims, **kw).astype(qkv.dtype),
            rope_reference(k, positions, dims, **kw).astype(qkv.dtype), v)


def qkv_rope(qkv: mx.array, positions: mx.array, n_heads: int, n_kv_heads: int, head_dim: int,
             dims: int, *, traditional: bool = False, base: float | None = 10000.0,
             scale: float = 1.0, freqs: mx.array | None = None, q_norm: mx.array | None = None,
             k_norm: mx.array | None = None, eps: float = 1e-6, stream=None):
    """The attention block's input side as one primitive: ``(q, k, v)``.

    qkv [..., (n_heads + 2*n_kv_heads) * head_dim] is a fused projection's
    output (q heads, k heads, v heads); positions int32 [...] (one per token).
    Returns q [..., n_heads, head_dim] and k [..., n_kv_heads, head_dim] after
    the optional per-head RMSNorm (``q_norm``/``k_norm`` [head_dim], qwen3) and
    RoPE (as ``rope``), and v [..., n_kv_heads, head_dim] as it is.
    """
    if freqs is not None:
        base = None
    if _on_cpu(stream):
        return tuple(_ext.qkv_rope(qkv, positions, n_heads, n_kv_heads, head_dim, dims, traditional,
                                   base, scale, freqs, q_norm, k_norm, eps, stream=stream))
    return qkv_rope_reference(qkv, positions, n_heads, n_kv_heads, head_dim, dims,
                              traditional=traditional, base=base, scale=scale, freqs=freqs,
                              q_norm=q_norm, k_norm=k_norm, eps=eps)


def kv_write_reference(pool: mx.array, slots: mx.array, values: mx.array) -> mx.array:
    """Pure-MLX ``pool[slots] = values`` (returns the updated pool)."""
    pool[slots] = values.reshape(slots.shape[0], *pool.shape[1:])
    return pool


def kv_write(pool: mx.array, slots: mx.array, values: mx.array, *, inplace: bool = False,
             stream=None) -> mx.array:
    """``pool`` with rows ``slots`` replaced by ``values``, as one primitive.

    pool [S, ...], slots [T] int32, values with pool's dtype and trailing
    shape and T rows in its leading axes (``[T, H, D]`` or ``[B, L, H, D]``
    for a ``[S, H, D]`` pool). Rebind the pool to the result and keep no
    other reference to the old one: then the write happens in place (MLX
    donates the buffer); otherwise the pool is copied. Out-of-range slots are
    ignored. ``inplace`` writes in place even when the old pool is still
    referenced: for a pool several layers write within one graph (see
    csrc/ops/kv_write.h for when that is safe: every pending reader of the old
    version must run before the write, on the CPU stream).
    """
    if _on_cpu(stream):
        return _ext.kv_write(pool, slots, values, inplace=inplace, stream=stream)
    return kv_write_reference(pool, slots, values)


def kv_write_pair_reference(k_pool, v_pool, slots, k, v):
    """Pure-MLX :func:`kv_write_pair`: two indexed assignments."""
    return kv_write_reference(k_pool, slots, k), kv_write_reference(v_pool, slots, v)


def kv_write_pair(k_pool: mx.array, v_pool: mx.array, slots: mx.array, k: mx.array,
                  v: mx.array, *, inplace: bool = False, stream=None) -> tuple[mx.array, mx.array]:
    """``(kv_write(k_pool, slots, k), kv_write(v_pool, slots, v))`` as one
    primitive with two outputs; both pools are written in place under the same
    rule as ``kv_write`` (rebind both, keep no other reference; or ``inplace``)."""
    if _on_cpu(stream):
        k_pool, v_pool = _ext.kv_write_pair(k_pool, v_pool, slots, k, v, inplace=inplace, stream=stream)
        return k_pool, v_pool
    return kv_write_pair_reference(k_pool, v_pool, slots, k, v)


# --- projections, with optional fused prologue / epilogue -------------------
#
# ``norm=(weight, eps)`` or ``act=`` (a name in ``_ACTS``) transform x before
# the matmul (at most one); ``residual=r`` adds r to the product. On the CPU the
# native primitive does all of it in one node with the same numbers as the
# separate native ops; elsewhere (and where the dtypes would not line up,
# see ``dense_matmul``) the separate ops run.

# The fused activations: ``act=`` name -> (native op, pure-MLX reference). The
# one list on the Python side (every check and dispatch reads it); the native
# primitives check the same names (``gated_act_from_halves_name`` in
# csrc/ops/silu_mul.cpp), and tests/test_ops_fused_linear.py checks the two agree.
_ACTS = {
    "silu_mul_halves": (silu_mul_halves, silu_mul_halves_reference),
    "gelu_mul_halves": (gelu_mul_halves, gelu_mul_halves_reference),
}


def _check_fusion(op: str, norm, act) -> None:
    if act is not None and (not isinstance(act, str) or act not in _ACTS):
        names = ", ".join(repr(a) for a in _ACTS)
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
        native, ref = _ACTS[act]
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
    if _on_cpu(stream):
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
) -> mx.array:
    """Pure-MLX ``x @ dequantize(w).T`` (MLX affine format): ``mx.quantized_matmul``.

    With fused pieces, the composition of their references:
    ``residual + round(prologue(x) @ dequantize(w).T)``, the product rounded
    to the prologue's dtype as :func:`quantized_matmul` does.
    """
    _check_fusion("quantized_matmul", norm, act)
    x = _prologue(x, norm, act, reference=True)
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

    Fused pieces, as for :func:`dense_matmul`: ``norm=(weight, eps)`` or
    ``act="silu_mul_halves"`` / ``"gelu_mul_halves"`` (x [..., 2K]) before
    the matmul, ``residual=r`` after it; with a norm the result has the norm's dtype (``rms_norm``
    promotes x with its weight).

    On the CPU this is one native primitive (GEMV path for up to 16 rows,
    blocked GEMM above); elsewhere, and for ``transpose=False``, it is
    ``mx.quantized_matmul`` (and the separate ops for the fused pieces).
    Bad shapes/dtypes raise ``ValueError``.
    """
    if biases is None:
        raise ValueError("[mlxfast.quantized_matmul] biases are required (affine quantization).")
    _check_fusion("quantized_matmul", norm, act)
    if transpose and _on_cpu(stream):
        if norm is not None:
            return _ext.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits,
                                         norm=norm[0], eps=norm[1], act=act, residual=residual,
                                         stream=stream)
        return _ext.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits,
                                     act=act, residual=residual, stream=stream)
    x = _prologue(x, norm, act, reference=False, stream=stream)
    out = quantized_matmul_reference(
        x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits
    )
    out = out.astype(x.dtype) if out.dtype != x.dtype else out
    return _epilogue("quantized_matmul", out, residual)


def dequantize_rows_reference(
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    ids: mx.array,
    *,
    group_size: int = 64,
    bits: int = 4,
    dtype=None,
) -> mx.array:
    """Pure-MLX :func:`dequantize_rows`: gather the packed rows, dequantize in float32."""
    out = mx.dequantize(w[ids], scales[ids].astype(mx.float32), biases[ids].astype(mx.float32),
                        group_size=group_size, bits=bits)
    dtype = scales.dtype if dtype is None else dtype
    return out if dtype == mx.float32 else out.astype(dtype)


def dequantize_rows(
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    ids: mx.array,
    *,
    group_size: int = 64,
    bits: int = 4,
    dtype=None,
    stream=None,
) -> mx.array:
    """Quantized embedding lookup: rows ``ids`` of ``dequantize(w, scales, biases)``.

    w: [V, D * bits / 32] uint32; scales, biases: [V, D / group_size];
    ids: integer array of any shape. Returns [*ids.shape, D] in ``dtype``
    (default: scales' dtype), computed in float32 (fp16 scales would round
    every element) and rounded once. Only the looked-up rows are dequantized:
    one native primitive on the CPU (MLX's graph for it is ~38 primitives),
    the reference elsewhere.
    """
    if _on_cpu(stream):
        return _ext.dequantize_rows(w, scales, biases, ids, group_size=group_size, bits=bits,
                                    dtype=dtype, stream=stream)
    return dequantize_rows_reference(w, scales, biases, ids, group_size=group_size, bits=bits,
                                     dtype=dtype)


# --- paged attention (engine KV) -------------------------------------------


def has_native_paged_attention(stream=None) -> bool:
    """Whether ``paged_attention`` runs a native kernel on this stream/device."""
    return _on_cpu(stream) and hasattr(_ext, "paged_attention")


def paged_gather_reference(pool: mx.array, block_tables: mx.array, block_size: int) -> mx.array:
    """Pure-MLX gather of whole blocks: pool [num_blocks*bs, Hkv, D], block_tables
    [S, B] int32 -> [S, B*bs, Hkv, D] (each sequence's KV, contiguous)."""
    nb = pool.shape[0] // block_size
    blocks = pool.reshape(nb, block_size, *pool.shape[1:])[block_tables]
    S, B = block_tables.shape
    return blocks.reshape(S, B * block_size, *pool.shape[1:])


def paged_gather(pool: mx.array, block_tables: mx.array, block_size: int, *, stream=None) -> mx.array:
    """Each sequence's K or V as one contiguous array: pool [num_blocks*bs, Hkv, D]
    (any float dtype), block_tables [S, B] int32 -> [S, B*bs, Hkv, D]."""
    if _on_cpu(stream) and hasattr(_ext, "paged_gather"):
        return _ext.paged_gather(pool, block_tables, block_size, stream=stream)
    return paged_gather_reference(pool, block_tables, block_size)


def paged_attention_reference(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    seq_idx: mx.array,
    positions: mx.array,
    *,
    scale: float,
    block_size: int,
    merge_heads: bool = False,
    window: int = 0,
) -> mx.array:
    """Pure-MLX paged attention (the native kernel's oracle; memory ~T x context).

    q [..., Hq, D] (T tokens in its leading axes: [T, Hq, D], [B, L, Hq, D]);
    k_pool/v_pool [num_blocks*block_size, Hkv, D] (Hq % Hkv == 0, any float
    dtype); block_tables [S, B] int32 (block ids per sequence); seq_idx [T]
    int32 (the sequence of each query); positions [T] int32 (each query's
    position: it attends keys 0..position of its sequence).
    ``window`` 0 is full causal attention; ``window = W > 0`` is a sliding
    window: a query at position p attends keys k with ``p - W < k <= p`` (W
    keys including itself, as mlx-lm's ``create_causal_mask(window_size=W)``).
    Table entries of blocks wholly before a query's window start (block index
    < (p - W + 1) // block_size) are never read: they may hold any value.
    Returns [..., Hq, Dv] in q's dtype, or [..., Hq * Dv] with ``merge_heads``
    (the layout an output projection takes). Softmax in float32.
    """
    if window < 0:
        raise ValueError(f"[mlxfast.paged_attention] window must be >= 0 (0: full causal "
                         f"attention), got {window}.")
    lead, (Hq, D) = q.shape[:-2], q.shape[-2:]
    T = seq_idx.shape[0]
    Hkv = k_pool.shape[1]
    if window:
        # Entries of blocks before every window of their sequence point at
        # block 0 (masked below): their values are never used.
        S, B = block_tables.shape
        first = (mx.maximum(positions - (window - 1), 0) // block_size).astype(mx.int32)  # [T]
        seq_first = mx.full((S,), B, mx.int32).at[seq_idx].minimum(first)
        block_tables = mx.where(mx.arange(B)[None, :] >= seq_first[:, None], block_tables, 0)
    kg = paged_gather_reference(k_pool, block_tables, block_size)[seq_idx]  # [T, L, Hkv, D]
    vg = paged_gather_reference(v_pool, block_tables, block_size)[seq_idx]
    L = kg.shape[1]
    qf = q.astype(mx.float32).reshape(T, Hkv, Hq // Hkv, D)
    s = mx.einsum("tkgd,tlkd->tkgl", qf, kg.astype(mx.float32)) * scale
    keys = mx.arange(L)[None, :]
    allowed = keys <= positions[:, None]  # [T, L]
    if window:
        allowed = allowed & (keys > positions[:, None] - window)
    s = mx.where(allowed[:, None, None, :], s, -mx.inf)
    p = mx.softmax(s, axis=-1)
    out = mx.einsum("tkgl,tlkd->tkgd", p, vg.astype(mx.float32))
    shape = (*lead, -1) if merge_heads else (*lead, Hq, -1)
    return out.reshape(shape).astype(q.dtype)


def paged_attention(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    seq_idx: mx.array,
    positions: mx.array,
    *,
    scale: float,
    block_size: int,
    merge_heads: bool = False,
    window: int = 0,
    stream=None,
) -> mx.array:
    """Attention of each query token over its own sequence's paged KV.

    Same arguments and result as ``paged_attention_reference`` (``window``:
    0 full causal, W > 0 a sliding window of W keys; blocks wholly before a
    query's window are not read): one primitive on the CPU (online softmax,
    float32 accumulation, GQA, parallel over (token, kv head)); the reference
    elsewhere.
    """
    if has_native_paged_attention(stream):
        return _ext.paged_attention(q, k_pool, v_pool, block_tables, seq_idx, positions,
                                    scale, block_size, merge_heads=merge_heads, window=window,
                                    stream=stream)
    return paged_attention_reference(q, k_pool, v_pool, block_tables, seq_idx, positions,
                                     scale=scale, block_size=block_size, merge_heads=merge_heads,
                                     window=window)


# --- quantized KV (affine q8/q4, TurboQuant): see ops_kvquant.py ------------

def _sample_params(R: int, V: int, temperature, top_k, top_p, min_p):
    """Per-row sampling parameters as float32/int32 numpy arrays; off = neutral."""
    temps = np.broadcast_to(np.asarray(temperature, np.float32), (R,))
    ks = np.broadcast_to(np.asarray(top_k, np.int64), (R,))
    ks = np.where((ks > 0) & (ks < V), ks, V).astype(np.int32)
    tps = np.broadcast_to(np.asarray(top_p, np.float32), (R,))
    tps = np.where((tps > 0) & (tps < 1), tps, 1.0).astype(np.float32)
    mps = np.broadcast_to(np.asarray(min_p, np.float32), (R,))
    logmin = np.where(mps > 0, np.log(np.maximum(mps, 1e-30)), -np.inf).astype(np.float32)
    return temps, ks, tps, logmin


def sample_tokens_reference(logits: mx.array, keys: mx.array, temperature, top_k=0, top_p=1.0,
                            min_p=0.0) -> mx.array:
    """Pure-MLX ``sample_tokens``: sorts the vocabulary for top-k/top-p."""
    R, V = logits.shape
    temps, ks, tps, logmin = _sample_params(R, V, temperature, top_k, top_p, min_p)
    x = logits.astype(mx.float32)
    greedy = temps <= 0
    if greedy.all():
        return mx.argmax(x, axis=-1)
    y = x / mx.array(np.where(greedy, 1.0, temps)[:, None])
    if (ks < V).any() or (tps < 1).any():
        s = -mx.sort(-y, axis=-1)  # descending
        thr = mx.take_along_axis(s, mx.array(ks - 1)[:, None], axis=-1)  # k-th largest
        if (tps < 1).any():
            s = mx.where(mx.arange(V)[None, :] < mx.array(ks)[:, None], s, -mx.inf)
            probs = mx.softmax(s, axis=-1)
            keep = (mx.cumsum(probs, axis=-1) - probs) < mx.array(tps)[:, None]
            n_keep = mx.maximum(keep.sum(axis=-1, keepdims=True), 1)
            thr = mx.maximum(thr, mx.take_along_axis(s, (n_keep - 1).astype(mx.int32), axis=-1))
        y = mx.where(y >= thr, y, -mx.inf)
    if (logmin > -np.inf).any():
        thr = y.max(axis=-1, keepdims=True) + mx.array(logmin)[:, None]
        y = mx.where(y >= thr, y, -mx.inf)
    u = mx.vmap(lambda k: mx.random.uniform(shape=(V,), key=k))(keys)
    y = y + -mx.log(-mx.log(u))  # Gumbel noise: row r from keys[r] only
    return mx.argmax(mx.where(mx.array(greedy[:, None]), x, y), axis=-1)


def sample_tokens(logits: mx.array, keys: mx.array, temperature, top_k=0, top_p=1.0, min_p=0.0,
                  *, stream=None) -> mx.array:
    """One token per row of ``logits [R, V]`` (the engine's sampling step).

    Per row (the parameters are host-side scalars or length-R sequences):
    ``temperature <= 0`` takes the argmax; otherwise the logits are divided by
    the temperature, truncated by top-k (``0`` = off; ties with the k-th value
    are kept), then top-p on the top-k renormalised distribution (``1`` =
    off), then min-p (``0`` = off), and a token is drawn by Gumbel-max with
    the noise ``-log(-log(u))``, ``u = mx.random.uniform(shape=(V,),
    key=keys[r])`` — so a row's draw depends on its own key only. ``keys`` is
    ``[R, 2]`` uint32. Returns ``[R]`` uint32.

    The native kernel sorts only the head of the distribution and draws the
    noise (MLX's threefry, bit for bit) only for tokens that can still win.
    It picks the reference's token except where top-p's cut falls within
    float rounding of a token boundary: the softmax normaliser is summed in
    another order (the reference sums the whole sorted row in float32).
    """
    if not _on_cpu(stream):
        return sample_tokens_reference(logits, keys, temperature, top_k, top_p, min_p)
    R, V = logits.shape[0] if logits.ndim else 0, logits.shape[-1] if logits.ndim else 1
    temps, ks, tps, logmin = _sample_params(R, V, temperature, top_k, top_p, min_p)
    return _ext.sample_tokens(logits, keys, mx.array(temps), mx.array(ks), mx.array(tps),
                              mx.array(logmin), stream=stream)


from .ops_kvquant import (  # noqa: E402,F401
    KVQuantFormat,
    has_native_kv_quant,
    kv_quant_dequant,
    kv_quant_dequant_reference,
    kv_quant_encode,
    kv_quant_encode_reference,
    kv_quant_paged_attention,
    kv_quant_paged_attention_reference,
)
