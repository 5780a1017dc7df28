"""The greedy choice of a quantized output head: ``quantized_argmax`` is
``mx.argmax(quantized_matmul(x, w, ...), axis=-1)``, the same tokens, with
most of the vocabulary's logits never computed in fp32.

On the CPU's AVX2 and AVX-512 paths one native primitive
(csrc/ops/quantized_argmax.h) runs the head with int8 activations (2.5x
faster than fp32 at 8 rows on the default model's head), drops every row
whose int8 logit plus a rigorous error bound (``argmax_bounds``) is below
the best int8 logit minus its bound, and computes the 16-row blocks left
(a few dozen of the default model's 3,072) with the fp32 kernel the full
head runs: their logits are the same bits, so the argmax is the one of the
full head, ties and all (a float16 or bfloat16 head's logits rounded as
it rounds them: the screen is widened by their ulp). Elsewhere it is that
argmax of the full head.
"""

from __future__ import annotations

import mlx.core as mx

from .. import _ext
from . import dispatch
from .matmul import ACT_BLOCK, pack_rows16, quantized_matmul, unpack_rows16

_F32_EPS = 2.0 ** -24


def _gamma(n: int) -> float:
    """Higham's bound on the relative error of an n-term fp32 sum of products."""
    return n * _F32_EPS / (1 - n * _F32_EPS)


def argmax_bounds(w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int,
                  bits: int, rows_per_chunk: int = 8192) -> mx.array:
    """``c`` float16 for ``quantized_argmax``: per output row n and
    32-value block b of x, with d_b the block's int8 activation scale
    (max|x_b| / 127), |fp32 logit - int8 logit| <= sum_b d_b * c[n, b].

    Why: x_b is quantized to d_b * xq with |x - d_b * xq| <= d_b / 2 per
    value (plus its rounding, 2^-12 d_b here), so the int8 logit (exact
    integer sums) is within d_b / 2 * sum_b |w| of the one of x, and each
    path's fp32 rounding is at most gamma(n) times the sum of its terms'
    magnitudes (Higham), n the roundings a term passes through: in the fp32
    rows16 kernels' form (per group: two FMA chains over its values,
    ``scale * sum(q x) + bias * sum(x)`` added to the output, one group
    after another) at most group size + groups + 8, in the int8 kernels'
    (two FMAs a 32-value block, one block after another) 2 K / 32 + 8; in
    both the terms' magnitudes are at most 127 d_b * (|scale| sum(q) +
    32 |bias|) per block. Rounded up to float16 (a tiny absolute floor for
    values below its normal range). ``biases`` None: symmetric. w in either
    layout; c is row-interleaved as ``pack_rows16`` lays scales out,
    ``[N / 16, K / 32, 16]`` (a 16-row block's bounds are one vector)."""
    w, scales, biases = unpack_rows16(w, scales, biases)
    N, G = scales.shape
    K = G * group_size
    if K % ACT_BLOCK:
        raise ValueError(f"[mlxfast.argmax_bounds] K={K} is not a multiple of {ACT_BLOCK}.")
    kappa = 2 * 127 * (_gamma(group_size + G + 8) + _gamma(2 * K // ACT_BLOCK + 8))
    chunks = []
    for n0 in range(0, N, rows_per_chunk):
        n1 = min(N, n0 + rows_per_chunk)
        sc = scales[n0:n1].astype(mx.float32)
        bi = (mx.array(-(2.0 ** (bits - 1))) * sc if biases is None
              else biases[n0:n1].astype(mx.float32))
        q = mx.dequantize(w[n0:n1], mx.ones_like(sc), mx.zeros_like(sc), group_size=group_size,
                          bits=bits)  # the codes
        per_group = group_size // ACT_BLOCK
        q = q.reshape(n1 - n0, G, per_group, ACT_BLOCK)
        s4, b4 = sc[:, :, None, None], bi[:, :, None, None]
        abs_w = mx.abs(s4 * q + b4).sum(-1)
        terms = mx.abs(sc)[:, :, None] * q.sum(-1) + ACT_BLOCK * mx.abs(bi)[:, :, None]
        c = (0.5 + 2.0 ** -12) * abs_w + kappa * terms
        c = (c * (1 + 2.0 ** -9) + 2.0 ** -24).reshape(n1 - n0, K // ACT_BLOCK)
        chunks.append(c.astype(mx.float16))
        mx.eval(chunks[-1])
    c = mx.concatenate(chunks, axis=0) if len(chunks) > 1 else chunks[0]
    return pack_rows16(c, c, None)[0] if N % 16 == 0 else c


def has_native_quantized_argmax(x: mx.array, w: mx.array, bits: int, norm=None,
                                stream=None) -> bool:
    """Whether ``quantized_argmax`` runs its native primitive for these
    arguments: the CPU's AVX2 or AVX-512 path, a row-interleaved
    (``pack_rows16``) 4- or 8-bit w (x float32, float16 or bfloat16)."""
    return (dispatch.on_cpu(stream) and dispatch.cpu_path() in ("avx2", "avx512")
            and w.ndim == 3 and bits in (4, 8))


def quantized_argmax(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None,
                     bounds: mx.array | None, *, group_size: int, bits: int,
                     norm: tuple | None = None, stream=None) -> mx.array:
    """``mx.argmax(quantized_matmul(x, w, scales, biases, norm=norm), axis=-1)``
    (uint32 ``[...]``): natively where ``has_native_quantized_argmax`` and
    ``bounds`` (``argmax_bounds`` of these weights) are given, else just that."""
    if bounds is not None and has_native_quantized_argmax(x, w, bits, norm, stream):
        if norm is not None:
            return _ext.quantized_argmax(x, w, scales, biases, bounds, group_size=group_size,
                                         bits=bits, norm=norm[0], eps=norm[1], stream=stream)
        return _ext.quantized_argmax(x, w, scales, biases, bounds, group_size=group_size,
                                     bits=bits, stream=stream)
    return mx.argmax(quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits,
                                      norm=norm, stream=stream), axis=-1)
