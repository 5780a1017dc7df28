"""kv_write: rows written in place when the pool can be donated, copied otherwise."""

import mlx.core as mx
import numpy as np
import pytest

from mlxfast import ops


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.uint8])
def test_matches_indexed_assignment(dtype):
    pool = (mx.random.normal((32, 3, 8)) * 10).astype(dtype)
    slots = mx.array([5, 0, 31, 7], dtype=mx.int32)
    values = (mx.random.normal((4, 3, 8)) * 10).astype(dtype)
    want = ops.kv_write_reference(mx.array(pool), slots, values)
    got = ops.kv_write(pool, slots, values)
    assert mx.array_equal(got, want).item()


def test_in_place_when_donated_and_memory_stays_flat():
    pool = mx.zeros((4096, 4, 64))
    mx.eval(pool)
    base = mx.get_active_memory()
    for i in range(8):
        pool = ops.kv_write(pool, mx.array([i], dtype=mx.int32), mx.full((1, 4, 64), i + 1.0))
        mx.eval(pool)
    assert mx.get_active_memory() - base < pool.nbytes // 2
    assert np.array(pool[:9, 0, 0]).tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 0]


def test_copies_when_another_reference_exists():
    pool = mx.zeros((16, 2))
    mx.eval(pool)
    held = pool
    new = ops.kv_write(pool, mx.array([3], dtype=mx.int32), mx.ones((1, 2)))
    mx.eval(new)
    assert float(new.sum()) == 2.0 and float(held.sum()) == 0.0


def test_out_of_range_slots_never_write_outside():
    pool = mx.zeros((8, 2))
    got = ops.kv_write(pool, mx.array([-1, 8, 1000, 2], dtype=mx.int32), mx.ones((4, 2)))
    assert np.array(got).sum() == 2.0 and float(got[2].sum()) == 2.0


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="trailing shape"):
        ops.kv_write(mx.zeros((8, 2)), mx.array([0], dtype=mx.int32), mx.zeros((1, 3)))
    with pytest.raises(ValueError, match="int32"):
        ops.kv_write(mx.zeros((8, 2)), mx.array([0], dtype=mx.int64), mx.zeros((1, 2)))
    with pytest.raises(ValueError, match="dtype"):  # a float pool takes only float values
        ops.kv_write(mx.zeros((8, 2)), mx.array([0], dtype=mx.int32), mx.zeros((1, 2), mx.int32))
    with pytest.raises(ValueError, match="dtype"):  # a packed (uint8) pool only its own type
        ops.kv_write(mx.zeros((8, 2), mx.uint8), mx.array([0], dtype=mx.int32), mx.zeros((1, 2)))


FLOATS = [mx.float32, mx.float16, mx.bfloat16]


def _hard_values(shape, dtype):
    """Normal values across many scales, with the cases a conversion gets
    wrong: ties, float16's subnormals and overflow, infinities, NaN."""
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    x *= np.float32(2.0) ** np.random.default_rng(1).integers(-30, 20, size=shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[:8] = [65520.0, 65519.99, 1e-8, -6e-8, np.inf, -np.inf, 1.0 + 2.0 ** -11, 3e-5]
    return mx.array(x).astype(dtype)


@pytest.mark.parametrize("pool_dtype", FLOATS)
@pytest.mark.parametrize("value_dtype", FLOATS)
def test_converts_values_as_astype(pool_dtype, value_dtype):
    """Values of another float type are written as ``astype`` to the pool's
    would give them, bit for bit (the write stands for astype + write)."""
    pool = mx.zeros((64, 3, 16), pool_dtype)
    slots = mx.array([9, 0, 63, 17, 40], dtype=mx.int32)
    values = _hard_values((5, 3, 16), value_dtype)
    want = ops.kv_write_reference(mx.array(pool), slots, values.astype(pool_dtype))
    got = ops.kv_write(pool, slots, values)
    assert got.dtype == pool_dtype
    assert np.array_equal(np.array(got.view(mx.uint16 if pool_dtype != mx.float32 else mx.uint32)),
                          np.array(want.view(mx.uint16 if pool_dtype != mx.float32 else mx.uint32)))
    nan_pool = ops.kv_write(mx.zeros((4, 2), pool_dtype), mx.array([1], dtype=mx.int32),
                            mx.array([[float("nan"), 1.0]]).astype(value_dtype))
    assert np.isnan(np.array(nan_pool[1, 0].astype(mx.float32))) and float(nan_pool[1, 1]) == 1.0


def test_pair_converts_values():
    kp, vp = mx.zeros((32, 3, 8), mx.float16), mx.zeros((32, 3, 8), mx.bfloat16)
    slots = mx.array([5, 0, 31, 7], dtype=mx.int32)
    k, v = mx.random.normal((4, 1, 3, 8)) * 100, mx.random.normal((4, 1, 3, 8)) * 1e-3
    want = ops.kv_write_pair_reference(mx.array(kp), mx.array(vp), slots, k, v)
    got = ops.kv_write_pair(kp, vp, slots, k, v)
    assert [g.dtype for g in got] == [mx.float16, mx.bfloat16]
    assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))


def test_values_with_leading_axes():
    pool = mx.zeros((16, 2, 4))
    slots = mx.array([3, 9, 0, 15, 7, 1], dtype=mx.int32)
    values = mx.random.normal((2, 3, 2, 4))  # [B, L, H, D]: 6 rows
    want = ops.kv_write_reference(mx.array(pool), slots, values)
    assert mx.array_equal(ops.kv_write(pool, slots, values), want).item()
    with pytest.raises(ValueError, match="rows"):
        ops.kv_write(pool, slots, mx.zeros((2, 2, 2, 4)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_pair_matches_reference(dtype):
    kp, vp = (mx.random.normal((32, 3, 8)).astype(dtype) for _ in range(2))
    slots = mx.array([5, 0, 31, 7], dtype=mx.int32)
    k, v = (mx.random.normal((4, 1, 3, 8)).astype(dtype) for _ in range(2))
    want = ops.kv_write_pair_reference(mx.array(kp), mx.array(vp), slots, k, v)
    got = ops.kv_write_pair(kp, vp, slots, k, v)
    assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))


def test_pair_in_place_when_donated_and_memory_stays_flat():
    kp, vp = mx.zeros((4096, 4, 64)), mx.zeros((4096, 4, 64))
    mx.eval(kp, vp)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    for i in range(8):
        slot = mx.array([i], dtype=mx.int32)
        kp, vp = ops.kv_write_pair(kp, vp, slot, mx.full((1, 4, 64), i + 1.0),
                                   mx.full((1, 4, 64), -i - 1.0))
        mx.eval(kp, vp)
    assert mx.get_active_memory() - base < kp.nbytes // 2
    assert mx.get_peak_memory() - base < kp.nbytes // 2  # never a copy of either pool
    assert np.array(kp[:9, 0, 0]).tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 0]
    assert np.array(vp[:9, 0, 0]).tolist() == [-1, -2, -3, -4, -5, -6, -7, -8, 0]


def test_pair_copies_when_another_reference_exists():
    kp, vp = mx.zeros((16, 2)), mx.zeros((16, 2))
    mx.eval(kp, vp)
    held = vp
    nk, nv = ops.kv_write_pair(kp, vp, mx.array([3], dtype=mx.int32), mx.ones((1, 2)),
                               mx.ones((1, 2)))
    mx.eval(nk, nv)
    assert float(nk.sum()) == 2.0 and float(nv.sum()) == 2.0 and float(held.sum()) == 0.0


def test_pair_falls_back_to_the_reference_off_the_cpu(monkeypatch):
    """Where no native kernel runs (Metal, CUDA), the pair is the reference's."""
    monkeypatch.setattr(ops.dispatch, "on_cpu", lambda stream=None: False)
    kp, vp = mx.zeros((8, 2, 4)), mx.zeros((8, 2, 4))
    slots = mx.array([5, 1], dtype=mx.int32)
    k, v = mx.ones((2, 2, 4)), mx.full((2, 2, 4), 2.0)
    got = ops.kv_write_pair(kp, vp, slots, k, v)
    assert got is not None
    assert mx.array_equal(got[0][5], k[0]).item() and mx.array_equal(got[1][1], v[1]).item()
    assert mx.array_equal(got[0][0], mx.zeros((2, 4))).item()
