"""Native rms_norm and rope against MLX's own ops (their references)."""

import mlx.core as mx
import pytest

from mlxfast import ops

TOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(576,), (3, 64), (2, 5, 7, 128), (1, 1, 1536)])
def test_rms_norm_matches_mlx(shape, dtype):
    x = (mx.random.normal(shape) * 3).astype(dtype)
    w = mx.random.normal(shape[-1:]).astype(dtype)
    got, want = ops.rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5)
    assert got.dtype == want.dtype and got.shape == want.shape
    err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    assert err <= TOL[dtype] * max(1.0, mx.abs(want.astype(mx.float32)).max().item())


def test_rms_norm_mixed_dtypes_promote_like_mlx():
    x = mx.random.normal((4, 64)).astype(mx.float16)
    w = mx.random.normal((64,))
    got, want = ops.rms_norm(x, w, 1e-6), mx.fast.rms_norm(x, w, 1e-6)
    assert got.dtype == want.dtype == mx.float32
    assert mx.allclose(got, want, atol=1e-5).item()


def test_rms_norm_strided_input():
    x = mx.random.normal((64, 8)).T  # a transposed view
    w = mx.random.normal((64,))
    assert mx.allclose(ops.rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5), atol=1e-5).item()


def _mlx_rope(x, offsets, dims, **kw):
    # mx.fast.rope takes [B, H, L, D] with one offset per batch row.
    return mx.fast.rope(x.transpose(0, 2, 1, 3), dims, offset=offsets, **kw).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims,D", [(64, 64), (32, 64), (128, 128), (256, 256), (128, 256)])
def test_rope_matches_mlx(dtype, traditional, dims, D):
    B, L, H = 3, 5, 4
    x = mx.random.normal((B, L, H, D)).astype(dtype)
    offsets = mx.array([0, 9, 1000], dtype=mx.int32)
    positions = offsets[:, None] + mx.arange(L, dtype=mx.int32)
    for kw in ({"base": 10000.0, "scale": 1.0}, {"base": 500000.0, "scale": 0.25}):
        got = ops.rope(x, positions, dims, traditional=traditional, **kw)
        want = _mlx_rope(x, offsets, dims, traditional=traditional, **kw)
        ref = ops.rope_reference(x, positions, dims, traditional=traditional, **kw)
        # float32 angles at position ~1000 differ by ~1e-4 rad between
        # implementations; half precisions round the result.
        tol = max(TOL[dtype] * 4, 3e-7 * 1000)
        assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item()
        assert mx.allclose(ref.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item()


def test_rope_with_frequencies_matches_mlx():
    x = mx.random.normal((2, 3, 2, 64))
    freqs = 10000.0 ** (mx.arange(0, 64, 2) / 64) * mx.linspace(1, 8, 32)
    offsets = mx.array([4, 77], dtype=mx.int32)
    positions = offsets[:, None] + mx.arange(3, dtype=mx.int32)
    got = ops.rope(x, positions, 64, freqs=freqs)
    want = _mlx_rope(x, offsets, 64, traditional=False, base=None, scale=1.0, freqs=freqs)
    assert mx.allclose(got, want, atol=1e-4).item()
    assert mx.allclose(ops.rope_reference(x, positions, 64, base=None, freqs=freqs), want, atol=1e-4).item()


def test_rope_per_token_positions_flattened():
    """The engine's layout: T tokens as rows, each with its own position."""
    x = mx.random.normal((6, 1, 3, 64))
    positions = mx.array([[5], [0], [17], [17], [2], [300]], dtype=mx.int32)
    got = ops.rope(x, positions, 64)
    for t in range(6):
        want = _mlx_rope(x[t:t + 1], positions[t], 64, traditional=False, base=10000.0, scale=1.0)
        assert mx.allclose(got[t:t + 1], want, atol=3e-4).item()  # position 300: fp32 angles


def test_rope_rejects_bad_input():
    x = mx.zeros((2, 3, 4, 64))
    with pytest.raises(ValueError, match="positions"):
        ops.rope(x, mx.zeros((2,), mx.int32), 64)
    with pytest.raises(ValueError, match="dims"):
        ops.rope(x, mx.zeros((2, 3), mx.int32), 63)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, mx.zeros((32,)), 1e-5)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("Hq,Hkv,D,dims", [(9, 3, 64, 64), (4, 4, 32, 16), (8, 2, 128, 128),
                                          (4, 1, 256, 256), (8, 4, 256, 128)])
def test_qkv_rope_matches_reference(dtype, norm, Hq, Hkv, D, dims):
    qkv = mx.random.normal((2, 3, (Hq + 2 * Hkv) * D)).astype(dtype)
    positions = mx.array([[0, 1, 2], [40, 41, 900]], dtype=mx.int32)
    kw = {}
    if norm:
        kw = dict(q_norm=mx.random.normal((D,)).astype(dtype), k_norm=mx.random.normal((D,)).astype(dtype), eps=1e-6)
    got = ops.qkv_rope(qkv, positions, Hq, Hkv, D, dims, **kw)
    want = ops.qkv_rope_reference(qkv, positions, Hq, Hkv, D, dims, **kw)
    tol = max(TOL[dtype] * 8, 3e-4)
    for g, w, h in zip(got, want, (Hq, Hkv, Hkv)):
        assert g.shape == (2, 3, h, D) and g.dtype == dtype
        assert mx.allclose(g.astype(mx.float32), w.astype(mx.float32), atol=tol, rtol=tol).item()
    # Without norms, the split-and-rotate equals rope on the separate heads.
    if not norm:
        q_heads = qkv.reshape(2, 3, Hq + 2 * Hkv, D)[:, :, :Hq]
        assert mx.allclose(got[0].astype(mx.float32), ops.rope(q_heads, positions, dims).astype(mx.float32),
                           atol=tol, rtol=tol).item()


def test_qkv_rope_rejects_bad_input():
    with pytest.raises(ValueError, match="last axis"):
        ops.qkv_rope(mx.zeros((2, 100)), mx.zeros((2,), mx.int32), 4, 2, 16, 16)
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        ops.qkv_rope(mx.zeros((2, 128)), mx.zeros((2,), mx.int32), 4, 2, 16, 16, q_norm=mx.ones((16,)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_qkv_rope_head_dim_256_gemma3(dtype):
    """Gemma 3's shapes: head dim 256, 4 query heads on 1 kv head, per-head q/k
    RMSNorm, base 10k (sliding layers) and 1M with linear scaling 1/8 (full
    layers), long positions; against the reference and against mx.fast.rope."""
    Hq, Hkv, D = 4, 1, 256
    qkv = mx.random.normal((5, (Hq + 2 * Hkv) * D)).astype(dtype)
    positions = mx.array([0, 1, 511, 4095, 30000], dtype=mx.int32)
    norms = dict(q_norm=(mx.random.normal((D,)) + 1).astype(dtype),
                 k_norm=(mx.random.normal((D,)) + 1).astype(dtype), eps=1e-6)
    tol = max(TOL[dtype] * 8, 3e-7 * 30000)
    for kw in ({"base": 10000.0, "scale": 1.0}, {"base": 1000000.0, "scale": 0.125}):
        got = ops.qkv_rope(qkv, positions, Hq, Hkv, D, D, **kw, **norms)
        want = ops.qkv_rope_reference(qkv, positions, Hq, Hkv, D, D, **kw, **norms)
        for g, w in zip(got, want):
            assert mx.allclose(g.astype(mx.float32), w.astype(mx.float32), atol=tol, rtol=tol).item()
        plain = ops.qkv_rope(qkv, positions, Hq, Hkv, D, D, **kw)
        heads = qkv.reshape(5, Hq + 2 * Hkv, D)
        for t in range(5):
            mlx_q = _mlx_rope(heads[None, t:t + 1, :Hq], positions[t], D, traditional=False, **kw)
            assert mx.allclose(plain[0][t].astype(mx.float32), mlx_q[0, 0].astype(mx.float32),
                               atol=tol, rtol=tol).item()
        assert mx.array_equal(plain[2], heads[:, Hq + Hkv:]).item()  # v passes through
