"""RMSNorm, rotary position embeddings, and the attention block's input side
(split of a fused qkv projection + per-head norm + RoPE) as one primitive."""

from __future__ import annotations

import mlx.core as mx

from .. import _ext
from . import dispatch



def rms_norm_reference(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """Pure-MLX RMSNorm over the last axis: ``mx.fast.rms_norm``."""
    return mx.fast.rms_norm(x, weight, eps)


def rms_norm(x: mx.array, weight: mx.array, eps: float, *, stream=None) -> mx.array:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` as one primitive.

    x [..., D] and weight [D], float32/float16/bfloat16; the result has their
    promoted dtype (as ``mx.fast.rms_norm``). Accumulates in float32.
    """
    if dispatch.on_cpu(stream):
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
    if dispatch.on_cpu(stream):
        return _ext.rope(x, positions, dims, traditional, base, scale, freqs, stream=stream)
    return rope_reference(x, positions, dims, traditional=traditional, base=base, scale=scale, freqs=freqs)



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
    if dispatch.on_cpu(stream):
        return tuple(_ext.qkv_rope(qkv, positions, n_heads, n_kv_heads, head_dim, dims, traditional,
                                   base, scale, freqs, q_norm, k_norm, eps, stream=stream))
    return qkv_rope_reference(qkv, positions, n_heads, n_kv_heads, head_dim, dims,
                              traditional=traditional, base=base, scale=scale, freqs=freqs,
                              q_norm=q_norm, k_norm=k_norm, eps=eps)
