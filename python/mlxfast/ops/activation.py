"""Gated-MLP activations: ``silu(gate) * up`` and ``gelu_approx(gate) * up``,
on two arrays or on the two halves of a fused gate/up projection's output."""

from __future__ import annotations

import math

import mlx.core as mx

from .. import _ext
from . import dispatch



def silu_mul_reference(gate: mx.array, up: mx.array) -> mx.array:
    """Pure-MLX ``silu(gate) * up``."""
    return (gate * mx.sigmoid(gate.astype(mx.float32)).astype(gate.dtype)) * up


def silu_mul(gate: mx.array, up: mx.array, *, stream=None) -> mx.array:
    """The gated-MLP activation ``silu(gate) * up`` as one primitive.

    gate, up: same shape, float32 / float16 / bfloat16. Returns the same
    shape and dtype. Computed in float32 and rounded once.
    """
    if dispatch.on_cpu(stream):
        return _ext.silu_mul(gate, up, stream=stream)
    return silu_mul_reference(gate, up)


def silu_mul_halves_reference(gate_up: mx.array) -> mx.array:
    """Pure-MLX ``silu(gate) * up`` for ``gate_up = concat([gate, up], -1)``."""
    gate, up = mx.split(gate_up, 2, axis=-1)
    return silu_mul_reference(gate, up)


def silu_mul_halves(gate_up: mx.array, *, stream=None) -> mx.array:
    """``silu_mul`` of the two halves of the last axis ([..., 2M] -> [..., M]):
    the output of a fused gate/up projection, without splitting it first."""
    if dispatch.on_cpu(stream):
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
    if dispatch.on_cpu(stream):
        return _ext.gelu_mul(gate, up, stream=stream)
    return gelu_mul_reference(gate, up)


def gelu_mul_halves_reference(gate_up: mx.array) -> mx.array:
    """Pure-MLX ``gelu_approx(gate) * up`` for ``gate_up = concat([gate, up], -1)``."""
    gate, up = mx.split(gate_up, 2, axis=-1)
    return gelu_mul_reference(gate, up)


def gelu_mul_halves(gate_up: mx.array, *, stream=None) -> mx.array:
    """``gelu_mul`` of the two halves of the last axis ([..., 2M] -> [..., M]),
    as ``silu_mul_halves``."""
    if dispatch.on_cpu(stream):
        return _ext.gelu_mul_halves(gate_up, stream=stream)
    return gelu_mul_halves_reference(gate_up)


# The fused activations: ``act=`` name -> (native op, pure-MLX reference). The
# one list on the Python side (every check and dispatch reads it); the native
# primitives check the same names (``gated_act_from_halves_name`` in
# csrc/ops/silu_mul.cpp), and tests/test_ops_fused_linear.py checks the two agree.
ACTS = {
    "silu_mul_halves": (silu_mul_halves, silu_mul_halves_reference),
    "gelu_mul_halves": (gelu_mul_halves, gelu_mul_halves_reference),
}
