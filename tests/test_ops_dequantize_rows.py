"""dequantize_rows (quantized embedding lookup): native kernel against the MLX reference."""

import mlx.core as mx
import numpy as np
import pytest

from mlxfast import ops


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("sdtype", [mx.float32, mx.float16, mx.bfloat16])
def test_matches_reference(bits, group_size, sdtype):
    mx.random.seed(bits * 10 + group_size)
    w = mx.random.normal((37, 256))
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    s, b = s.astype(sdtype), b.astype(sdtype)
    ids = mx.array([[0, 36, 5], [5, 17, 1]], dtype=mx.int32)
    kw = dict(group_size=group_size, bits=bits)
    for dtype in (None, mx.float32, mx.float16):
        got = ops.dequantize_rows(wq, s, b, ids, dtype=dtype, **kw)
        want = ops.dequantize_rows_reference(wq, s, b, ids, dtype=dtype, **kw)
        assert got.shape == (2, 3, 256) and got.dtype == want.dtype
        tol = 0 if got.dtype == mx.float32 else 1e-2
        np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                                   np.array(want.astype(mx.float32)), atol=tol, rtol=tol)
    # and equal to MLX's own full dequantize, in float32
    full = mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), **kw)
    got = ops.dequantize_rows(wq, s, b, ids, dtype=mx.float32, **kw)
    assert mx.array_equal(got, full[ids]).item()


def test_id_dtypes_and_out_of_range():
    wq, s, b = mx.quantize(mx.random.normal((8, 64)), group_size=32, bits=4)
    want = ops.dequantize_rows_reference(wq, s, b, mx.array([3, 1]), group_size=32, bits=4)
    for dt in (mx.int64, mx.uint32, mx.int16):
        got = ops.dequantize_rows(wq, s, b, mx.array([3, 1], dtype=dt), group_size=32, bits=4)
        assert mx.array_equal(got, want).item()
    got = ops.dequantize_rows(wq, s, b, mx.array([-1, 8, 2]), group_size=32, bits=4)
    assert float(mx.abs(got[:2]).max()) == 0.0


def test_rejects_bad_input():
    wq, s, b = mx.quantize(mx.random.normal((8, 64)), group_size=32, bits=4)
    ids = mx.array([0])
    with pytest.raises(ValueError, match="mlxfast.dequantize_rows"):
        ops.dequantize_rows(wq, s[:, :1], b, ids, group_size=32, bits=4)
    with pytest.raises(ValueError, match="mlxfast.dequantize_rows"):
        ops.dequantize_rows(wq, s, b, ids, group_size=32, bits=7)
    with pytest.raises(ValueError, match="mlxfast.dequantize_rows"):
        ops.dequantize_rows(wq, s, b, mx.array([0.5]), group_size=32, bits=4)
