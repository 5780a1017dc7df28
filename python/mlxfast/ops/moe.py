"""Mixture-of-experts ops: the router's top-k and the experts' gated MLP.

``moe_route`` turns router logits into each token's k experts and their
weights; ``moe_experts`` applies the chosen experts' gate/up/down
projections (stacked ``[E, out, in]``, MLX affine-quantized or dense) and
sums them with those weights. Each has a pure-MLX ``*_reference`` (the
oracle and the fallback off the CPU): the experts' one is built on
``mx.gather_qmm`` / ``mx.gather_mm`` as mlx-lm's ``SwitchGLU`` is.
"""

from __future__ import annotations

import mlx.core as mx

from .. import _ext
from . import dispatch
from .matmul import ACTIVATIONS, fake_quantize_activations_int8, symmetric_biases, unpack_rows16
from .norm_rope import rms_norm, rms_norm_reference


# --- the router -------------------------------------------------------------


def moe_route_reference(logits: mx.array, k: int, *, softmax_first: bool = True,
                        normalize: bool = False) -> tuple[mx.array, mx.array]:
    """Pure-MLX routing, as mlx-lm's MoE blocks compute it.

    ``softmax_first`` (Qwen3-MoE): softmax over all experts (in float32, the
    result in the logits' dtype), then the top k, renormalised to sum 1 when
    ``normalize`` (``norm_topk_prob``). Otherwise (Mixtral): the top k
    logits, then a softmax over those k. Returns ``(inds, scores)``, both
    ``[..., k]``: uint32 expert ids (in no particular order) and their
    weights in the logits' dtype.
    """
    if softmax_first:
        gates = mx.softmax(logits, axis=-1, precise=True)
        inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if normalize:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    else:
        inds = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
        scores = mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1, precise=True)
    return inds, scores


def moe_route(logits: mx.array, k: int, *, softmax_first: bool = True, normalize: bool = False,
              stream=None) -> tuple[mx.array, mx.array]:
    """Each token's top-k experts and their weights from router ``logits [..., E]``.

    Same arguments and meaning as :func:`moe_route_reference`. On the CPU,
    one native primitive with two outputs (the reference is five or more):
    ``inds`` uint32 ``[..., k]`` with the experts in descending weight
    (ties: the lower id first), ``scores`` ``[..., k]`` in the logits' dtype,
    computed in float32 and rounded once. The reference picks the same set
    of experts (up to ties) in another order.
    """
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"[mlxfast.moe_route] k must be in [1, {logits.shape[-1]}], got {k}.")
    if dispatch.on_cpu(stream) and hasattr(_ext, "moe_route"):
        inds, scores = _ext.moe_route(logits, k, softmax_first=softmax_first, normalize=normalize,
                                      stream=stream)
        return inds, scores
    return moe_route_reference(logits, k, softmax_first=softmax_first, normalize=normalize)


# --- the experts -------------------------------------------------------------


def _weights(p):
    """(w, scales, biases) of a quantized projection (biases None: symmetric),
    or (w, None, None) dense."""
    if isinstance(p, (tuple, list)):
        if len(p) == 3:
            return tuple(p)
        if len(p) == 1:
            return p[0], None, None
        raise ValueError("[mlxfast.moe_experts] a projection is (w, scales, biases) or a dense w.")
    return p, None, None


def _gather_sort(x: mx.array, inds: mx.array):
    """Rows of x [T, 1, 1, D] repeated per choice and sorted by expert (mlx-lm's
    ``_gather_sort``): returns (rows, sorted expert ids, inverse order)."""
    k = inds.shape[-1]
    flat = inds.flatten()
    order = mx.argsort(flat)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // k], flat[order], inv_order


def _check_activations(activations: str, bits: int) -> None:
    if activations not in ACTIVATIONS:
        raise ValueError(f"[mlxfast.moe_experts] activations must be one of {ACTIVATIONS}, "
                         f"got {activations!r}.")
    if activations == "int8" and bits == 0:
        raise ValueError("[mlxfast.moe_experts] int8 activations need quantized weights.")


def moe_experts_reference(x: mx.array, inds: mx.array, scores: mx.array, gate, up, down, *,
                          group_size: int = 64, bits: int = 4, norm: tuple | None = None,
                          residual: mx.array | None = None,
                          activations: str = "fp32") -> mx.array:
    """Pure-MLX :func:`moe_experts`: mlx-lm's ``SwitchGLU`` (``mx.gather_qmm``,
    or ``mx.gather_mm`` for dense weights; rows sorted by expert from 64
    choices on), then the weighted sum over the k choices in x's dtype.
    ``activations="int8"``: each projection's input rows quantized to int8
    per 32 values first (``fake_quantize_activations_int8``), as
    :func:`ops.quantized_matmul_int8_reference` does."""
    _check_activations(activations, bits if _weights(gate)[1] is not None else 0)
    if norm is not None:
        x = rms_norm_reference(x, *norm)
    lead, D = x.shape[:-1], x.shape[-1]
    k = inds.shape[-1]
    xe = mx.expand_dims(x.reshape(-1, D), (-2, -3))  # [T, 1, 1, D]
    idx = inds.reshape(-1, k)
    do_sort = idx.size >= 64
    inv_order = None
    if do_sort:
        xe, idx, inv_order = _gather_sort(xe, idx)

    def proj(h, p):
        w, s, b = unpack_rows16(*_weights(p), stacked=True)  # 4-D (row-interleaved): MLX's layout
        if activations == "int8":
            h = fake_quantize_activations_int8(h.astype(mx.float32)).astype(h.dtype)
        if s is not None and b is None:
            b = symmetric_biases(s, bits)
        if s is None:
            if w.dtype != mx.float32 and mx.default_device() == mx.cpu:
                # MLX's CPU gather_mm takes float32 only: compute in float32,
                # round to the half type as its matmul would.
                return mx.gather_mm(h.astype(mx.float32), w.astype(mx.float32).swapaxes(-1, -2),
                                    rhs_indices=idx, sorted_indices=do_sort).astype(h.dtype)
            return mx.gather_mm(h, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=do_sort)
        return mx.gather_qmm(h, w, s, b, rhs_indices=idx, transpose=True, group_size=group_size,
                             bits=bits, sorted_indices=do_sort)

    g, u = proj(xe, gate), proj(xe, up)
    h = g * mx.sigmoid(g) * u  # mlx-lm's swiglu: silu(gate) * up
    y = proj(h, down)
    if do_sort:
        y = y[inv_order].reshape(-1, k, 1, y.shape[-1])
    y = y.squeeze(-2)  # [T, k, D]
    out = (y * scores.reshape(-1, k)[..., None]).sum(axis=-2).astype(y.dtype)
    out = out.reshape(*lead, out.shape[-1])
    if residual is not None:
        out = residual + out
    return out


def moe_experts(x: mx.array, inds: mx.array, scores: mx.array, gate, up, down, *,
                group_size: int = 64, bits: int = 4, norm: tuple | None = None,
                residual: mx.array | None = None, activations: str = "fp32",
                stream=None) -> mx.array:
    """The experts of a MoE layer for every token: ``residual + sum_j
    scores[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with
    ``e = inds[t, j]``.

    x [..., D] float32/float16/bfloat16; inds [..., k] integer expert ids;
    scores [..., k] float. ``gate``, ``up``: ``(w, scales, biases)`` with w
    ``[E, I, D * bits / 32]`` uint32 and scales/biases ``[E, I, D /
    group_size]`` (MLX affine quantization; biases None for a symmetric
    format, bias = -2^(bits-1) * scale, as GGUF's Q4_0 and Q8_0), or a dense
    ``[E, I, D]`` array; ``down`` likewise ``[E, D, I ...]``. Returns [..., D] in x's
    dtype. Fused pieces, as the projections take them: ``norm=(weight,
    eps)`` applies ``rms_norm`` to x first (the result then has the promoted
    dtype of x and the weight), ``residual`` (the result's shape and dtype)
    is added last. Expert ids outside ``[0, E)`` add nothing (the reference
    would fail on them).

    On the CPU this is one native primitive (when the extension has it):
    tokens are grouped by expert, each active expert's weights read once for
    all its tokens, SiLU(gate) * up fused, the weighted sum over k in float32
    in choice order. Elsewhere, the reference.

    ``activations="int8"`` (opt-in, quantized weights; K a multiple of 32,
    which the group sizes ensure) quantizes each projection's input rows to
    int8 per 32 values, as ``quantized_matmul(activations="int8")`` does
    (the VNNI kernel on AVX-512 VNNI CPUs, the portable one elsewhere).
    """
    if norm is not None and not (isinstance(norm, tuple) and len(norm) == 2):
        raise ValueError("[mlxfast.moe_experts] norm must be a (weight, eps) pair.")
    _check_activations(activations, bits if _weights(gate)[1] is not None else 0)
    if dispatch.on_cpu(stream) and hasattr(_ext, "moe_experts"):
        gw, gs, gb = _weights(gate)
        uw, us, ub = _weights(up)
        dw, ds, db = _weights(down)
        kw = dict(norm=norm[0], eps=norm[1]) if norm is not None else {}
        return _ext.moe_experts(x, inds, scores, gw, gs, gb, uw, us, ub, dw, ds, db,
                                group_size=group_size, bits=bits if gs is not None else 0,
                                residual=residual, int8=activations == "int8", stream=stream,
                                **kw)
    if norm is not None:
        x = rms_norm(x, *norm, stream=stream)
    return moe_experts_reference(x, inds, scores, gate, up, down, group_size=group_size, bits=bits,
                                 residual=residual, activations=activations)
