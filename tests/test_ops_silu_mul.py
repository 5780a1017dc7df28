import mlx.core as mx
import pytest

from mlxfast import ops

TOL = {mx.float32: 1e-6, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}
# Capability, not skip-to-green: every path this CPU can execute, forced in turn.



@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (7, 13), (2, 3, 1536), (70000,)])
def test_silu_mul_matches_reference(path, shape, dtype):
    mx.random.seed(0)
    g = (mx.random.normal(shape) * 4).astype(dtype)
    u = mx.random.normal(shape).astype(dtype)
    got = ops.silu_mul(g, u)
    ref = ops.silu_mul_reference(g.astype(mx.float32), u.astype(mx.float32))
    assert got.dtype == dtype and got.shape == g.shape
    err = mx.abs(got.astype(mx.float32) - ref) / (1 + mx.abs(ref))
    assert err.max().item() <= TOL[dtype]


def test_silu_mul_non_contiguous_input():
    g = mx.random.normal((8, 6)).T
    u = mx.random.normal((6, 8))
    assert mx.allclose(ops.silu_mul(g, u), ops.silu_mul_reference(g, u), atol=1e-6)


def test_silu_mul_rejects_bad_input():
    with pytest.raises(ValueError, match="same shape"):
        ops.silu_mul(mx.zeros((2, 3)), mx.zeros((3, 2)))
    with pytest.raises(ValueError, match="dtype"):
        ops.silu_mul(mx.zeros((2,), mx.int32), mx.zeros((2,), mx.int32))


def test_cpu_path_reported_and_forcible():
    assert ops.cpu_path() in ("portable", "avx2", "avx512", "neon")
    assert ops.cpu_supports("portable")
    before = ops.cpu_path()
    ops.set_cpu_path("portable")
    try:
        assert ops.cpu_path() == "portable"
    finally:
        ops.set_cpu_path("")
    assert ops.cpu_path() == before
    with pytest.raises(ValueError):
        ops.set_cpu_path("sse9")


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(2,), (7, 26), (2, 3, 3072)])
def test_silu_mul_halves_matches_reference(path, shape, dtype):
    x = (mx.random.normal(shape) * 4).astype(dtype)
    got = ops.silu_mul_halves(x)
    ref = ops.silu_mul_halves_reference(x.astype(mx.float32))
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    err = mx.abs(got.astype(mx.float32) - ref) / (1 + mx.abs(ref))
    assert err.max().item() <= TOL[dtype]
    with pytest.raises(ValueError, match="even"):
        ops.silu_mul_halves(mx.zeros((3, 5)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_silu_mul_extreme_inputs(path, dtype):
    """Saturation on both sides (the vector exp clamps its argument), zeros
    and odd lengths (vector tails) on every path."""
    g = mx.array([-1e4, -200.0, -88.5, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 87.0, 88.5, 200.0,
                  1e4, 3.0, -3.0, 0.5, -0.5]).astype(dtype)
    u = mx.linspace(-2, 2, g.size).astype(dtype)
    got = ops.silu_mul(g, u).astype(mx.float32)
    ref = ops.silu_mul_reference(g.astype(mx.float32), u.astype(mx.float32))
    assert mx.all(mx.isfinite(got)).item()
    err = mx.abs(got - ref) / (1 + mx.abs(ref))
    assert err.max().item() <= TOL[dtype]
