"""``ops.gelu_mul`` / ``ops.gelu_mul_halves``: ``gelu_approx(gate) * up``
(Gemma's gated MLP), native on every CPU path this machine runs.

Oracles:
* the pure-MLX references, themselves checked bit for bit against mlx's own
  ``nn.gelu_approx(gate) * up`` (what mlx-lm computes), so a reference that
  drifted from mlx-lm fails here too;
* float64 numpy of the same formula: the native kernel computes in float32
  and rounds once, so it is held to a few float32 ulps of the exact value
  (mlx's own float32 formula is not: its ``1 + tanh`` cancels near -1).
"""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxfast import ops

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
# Against the reference (float32 math on the same inputs), measured on the
# error / (1 + |ref|) scale as the silu tests: fp32 a few ulps of the native
# rounding (worst seen 2.3e-7; 1.3e-7 against float64), fp16 / bf16 the one
# rounding of the output (worst seen 4.4e-4 / 3.6e-3).
TOL = {mx.float32: 1e-6, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}
# Odd lengths and lengths around the vector widths (8, 16): the tails.
SHAPES = [(1,), (7,), (15,), (17,), (33,), (7, 13), (3, 31), (2, 3, 1536), (70000,)]
LARGE = [-1e4, -200.0, -88.5, -80.0, -20.0, -10.0, -5.0, -3.0, -1e-3, -0.0, 0.0, 1e-3, 3.0, 5.0,
         10.0, 20.0, 80.0, 88.5, 200.0, 1e4, 0.5, -0.5, 1.0]


def _truth(g: mx.array, u: mx.array) -> np.ndarray:
    """gelu_approx(g) * u in float64 (the inputs as given, widened exactly)."""
    x = np.array(g.astype(mx.float32)).astype(np.float64)
    y = np.array(u.astype(mx.float32)).astype(np.float64)
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))) * y


def _err(got: mx.array, ref) -> float:
    got = np.array(got.astype(mx.float32)).astype(np.float64)
    ref = np.array(ref.astype(mx.float32)).astype(np.float64) if isinstance(ref, mx.array) else ref
    return float(np.max(np.abs(got - ref) / (1 + np.abs(ref)), initial=0.0))


def _inputs(shape, dtype, seed=0):
    mx.random.seed(seed)
    g = (mx.random.normal(shape) * 4).astype(dtype)
    u = mx.random.normal(shape).astype(dtype)
    return g, u


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gelu_mul_matches_reference(path, shape, dtype):
    g, u = _inputs(shape, dtype)
    got = ops.gelu_mul(g, u)
    assert got.dtype == dtype and got.shape == g.shape
    ref = ops.gelu_mul_reference(g.astype(mx.float32), u.astype(mx.float32))
    assert _err(got, ref) <= TOL[dtype]
    assert _err(got, _truth(g, u)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2,), (30,), (34,), (7, 26), (3, 62), (2, 3, 3072)], ids=str)
def test_gelu_mul_halves_matches_reference(path, shape, dtype):
    x, _ = _inputs(shape, dtype)
    got = ops.gelu_mul_halves(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    ref = ops.gelu_mul_halves_reference(x.astype(mx.float32))
    assert _err(got, ref) <= TOL[dtype]
    gate, up = mx.split(x, 2, axis=-1)
    assert _err(got, _truth(gate, up)) <= TOL[dtype]
    # the halves op is the plain op on the split halves, bit for bit
    assert mx.array_equal(got, ops.gelu_mul(gate, up)).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_mul_large_magnitude_inputs(path, dtype):
    """Saturation on both sides (the vector exp clamps its argument; fp16's
    x**3 overflows in the reference), signed zeros, and an odd length:
    finite everywhere, x * u for large positive x, ~0 for large negative."""
    g = mx.array(LARGE).astype(dtype)
    u = mx.linspace(-2, 2, g.size).astype(dtype)
    got = ops.gelu_mul(g, u)
    assert mx.all(mx.isfinite(got)).item()
    assert _err(got, ops.gelu_mul_reference(g.astype(mx.float32), u.astype(mx.float32))) <= TOL[dtype]
    assert _err(got, _truth(g, u)) <= TOL[dtype]
    gf, uf, out = (np.array(a.astype(mx.float32)) for a in (g, u, got))
    pos, neg = gf >= 20, gf <= -20
    want_pos = np.array(mx.array(gf[pos] * uf[pos]).astype(dtype).astype(mx.float32))
    assert np.array_equal(out[pos], want_pos)
    assert np.all(np.abs(out[neg]) < 1e-30)
    # the references (mlx-lm's numerics in the dtype) stay finite too
    assert mx.all(mx.isfinite(ops.gelu_mul_reference(g, u))).item()
    # and so does the halves op, with the large values in the gate half
    x = mx.concatenate([g, u])
    assert mx.array_equal(ops.gelu_mul_halves(x), got).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_is_mlx_gelu_approx(dtype):
    """The reference is mlx-lm's computation, bit for bit, in every dtype."""
    g, u = _inputs((4097,), dtype, seed=3)
    g = mx.concatenate([g, mx.array(LARGE).astype(dtype)])
    u = mx.concatenate([u, mx.linspace(-2, 2, len(LARGE)).astype(dtype)])
    want = nn.gelu_approx(g) * u
    got = ops.gelu_mul_reference(g, u)
    assert got.dtype == want.dtype == dtype
    assert mx.array_equal(got, want, equal_nan=True).item()
    x = mx.concatenate([g.reshape(1, -1), u.reshape(1, -1)], axis=-1)
    assert mx.array_equal(ops.gelu_mul_halves_reference(x), want.reshape(1, -1)).item()


# The native kernel rounds once; mlx-lm rounds every op in fp16/bf16 (and its
# 1 + tanh cancels), so the two differ by a few of the dtype's ulps. Measured
# worst here: fp32 1.6e-7, fp16 9.4e-4, bf16 6.1e-3.
MLX_TOL = {mx.float32: 1e-6, mx.float16: 4e-3, mx.bfloat16: 3.2e-2}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_close_to_mlx_in_dtype(path, dtype):
    g, u = _inputs((3, 1001), dtype, seed=4)
    assert _err(ops.gelu_mul(g, u), nn.gelu_approx(g) * u) <= MLX_TOL[dtype]


def test_gelu_mul_non_contiguous_input(path):
    g = (mx.random.normal((9, 6)) * 3).T
    u = mx.random.normal((6, 9))
    assert _err(ops.gelu_mul(g, u), ops.gelu_mul_reference(g, u)) <= TOL[mx.float32]
    x = (mx.random.normal((34, 6)) * 3).T  # [6, 34], strided: packed inside the primitive
    assert _err(ops.gelu_mul_halves(x), ops.gelu_mul_halves_reference(x)) <= TOL[mx.float32]


def test_gelu_mul_empty():
    assert ops.gelu_mul(mx.zeros((0, 5)), mx.zeros((0, 5))).shape == (0, 5)
    assert ops.gelu_mul_halves(mx.zeros((3, 0))).shape == (3, 0)
    assert ops.gelu_mul_halves(mx.zeros((0, 8))).shape == (0, 4)


def test_gelu_mul_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[mlxfast\.gelu_mul\] gate and up must have the same shape"):
        ops.gelu_mul(mx.zeros((2, 3)), mx.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"\[mlxfast\.gelu_mul\] gate and up must have the same dtype"):
        ops.gelu_mul(mx.zeros((2,)), mx.zeros((2,), mx.float16))
    with pytest.raises(ValueError, match=r"\[mlxfast\.gelu_mul\] dtype"):
        ops.gelu_mul(mx.zeros((2,), mx.int32), mx.zeros((2,), mx.int32))
    with pytest.raises(ValueError, match=r"\[mlxfast\.gelu_mul\] .*even"):
        ops.gelu_mul_halves(mx.zeros((3, 5)))
    with pytest.raises(ValueError, match=r"\[mlxfast\.gelu_mul\] dtype"):
        ops.gelu_mul_halves(mx.zeros((3, 4), mx.int32))


def test_reference_dispatch_off_cpu(monkeypatch):
    """Off the CPU (forced here) the ops are their references."""
    g, u = _inputs((5, 12), mx.bfloat16, seed=5)
    monkeypatch.setattr(ops.dispatch, "on_cpu", lambda stream=None: False)
    assert mx.array_equal(ops.gelu_mul(g, u), ops.gelu_mul_reference(g, u)).item()
    x = mx.concatenate([g, u], axis=-1)
    assert mx.array_equal(ops.gelu_mul_halves(x), ops.gelu_mul_halves_reference(x)).item()


def test_one_primitive_distinct_from_silu():
    """One node named GeluMul; mx.compile must not merge it with SiluMul on the
    same input (the primitives compare their activation)."""
    import io

    x = mx.random.normal((4, 32)) * 3
    mx.eval(x)
    buf = io.StringIO()
    mx.export_to_dot(buf, ops.gelu_mul_halves(x))
    labels = [l.split('label ="')[1].split('"')[0] for l in buf.getvalue().splitlines()
              if "shape=rectangle" in l]
    assert labels == ["GeluMul"]

    def f(x):
        return ops.silu_mul_halves(x), ops.gelu_mul_halves(x), ops.silu_mul(x, x), ops.gelu_mul(x, x)

    got, want = mx.compile(f)(x), f(x)
    for a, b in zip(got, want):
        assert mx.array_equal(a, b).item()
    assert not mx.array_equal(want[0], want[1]).item()
    assert not mx.array_equal(want[2], want[3]).item()
