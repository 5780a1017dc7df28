"""Parity of mlxfast.ops.dense_matmul (x @ w.T, native CPU kernels) with MLX.

Oracle: an fp32 MLX matmul of the same values. Error is measured against
the natural scale of the sum, |x| @ |w|.T, as in test_ops_qmm.py:
  fp32 output: 2e-5, fp16 output: 1e-3, bf16 output: 8e-3.
Every CPU path this machine can run is forced in turn; shapes cover the GEMV
(M <= 8) and GEMM paths, odd N and K (vector tails), and k blocks (K > 256).
"""

import mlx.core as mx
import numpy as np
import pytest

from mlxfast import ops
from mlxfast.models.layers import Embedding, Linear

TOL = {mx.float32: 2e-5, mx.float16: 1e-3, mx.bfloat16: 8e-3}
DTYPES = [mx.float32, mx.float16, mx.bfloat16]



def check(x, w):
    got = ops.dense_matmul(x, w)
    xf, wf = x.astype(mx.float32), w.astype(mx.float32)
    ref = xf @ wf.T
    scale = mx.abs(xf) @ mx.abs(wf).T
    assert got.dtype == mx.result_type(x, w)
    assert got.shape == (*x.shape[:-1], w.shape[0])
    err = mx.abs(got.astype(mx.float32) - ref) / (scale + 1e-30)
    worst = err.max().item()
    assert np.isfinite(worst) and worst <= TOL[got.dtype], (worst, got.dtype)


SHAPES = [  # (M, N, K)
    (1, 1, 1),
    (1, 7, 5),
    (1, 300, 576),
    (2, 45, 100),
    (4, 33, 17),
    (8, 64, 384),
    (9, 31, 160),
    (13, 50, 257),
    (37, 65, 600),
    (100, 40, 33),
]


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shapes_and_dtypes(path, M, N, K, dtype):
    mx.random.seed(M * 1000 + N + K)
    check(mx.random.normal((M, K)).astype(dtype), mx.random.normal((N, K)).astype(dtype))


@pytest.mark.parametrize("xdtype,wdtype", [(mx.float32, mx.bfloat16), (mx.float32, mx.float16),
                                           (mx.float16, mx.float32), (mx.bfloat16, mx.float16)])
@pytest.mark.parametrize("M", [1, 20])
def test_mixed_dtypes_follow_mlx_promotion(path, xdtype, wdtype, M):
    check(mx.random.normal((M, 96)).astype(xdtype), mx.random.normal((24, 96)).astype(wdtype))


def test_batched_strided_and_transposed_inputs(path):
    x = mx.random.normal((2, 3, 5, 64))[:, :, ::2, :]  # strided rows
    w = mx.random.normal((64, 48)).T  # w given transposed: packed before the op
    check(x, w)
    check(mx.random.normal((3, 40, 64)), mx.random.normal((70, 64)))


def test_linear_and_tied_head_use_it():
    lin = Linear(64, 40, bias=True)
    lin.weight = mx.random.normal((40, 64)).astype(mx.bfloat16)
    lin.bias = mx.random.normal((40,)).astype(mx.bfloat16)
    x = mx.random.normal((3, 64)).astype(mx.bfloat16)
    y = lin(x)
    assert "MlxfastDenseMatmul" in _graph_primitives(y)
    ref = x.astype(mx.float32) @ lin.weight.astype(mx.float32).T + lin.bias.astype(mx.float32)
    assert mx.allclose(y.astype(mx.float32), ref, rtol=2e-2, atol=2e-2)
    emb = Embedding(50, 64)
    emb.weight = mx.random.normal((50, 64))
    assert "MlxfastDenseMatmul" in _graph_primitives(emb.as_linear(mx.random.normal((2, 64))))


def _graph_primitives(y) -> str:
    import io

    buf = io.StringIO()
    mx.export_to_dot(buf, y)
    return buf.getvalue()


def test_empty_and_validation():
    assert ops.dense_matmul(mx.zeros((0, 8)), mx.zeros((4, 8))).shape == (0, 4)
    assert mx.array_equal(ops.dense_matmul(mx.ones((2, 0)), mx.ones((3, 0))), mx.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"\[mlxfast.dense_matmul\].*shape mismatch"):
        ops.dense_matmul(mx.zeros((2, 8)), mx.zeros((4, 9)))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ops.dense_matmul(mx.zeros((2, 8), dtype=mx.int32), mx.zeros((4, 8), dtype=mx.int32))
    with pytest.raises(ValueError, match="2-D"):
        ops.dense_matmul(mx.zeros((2, 8)), mx.zeros((1, 4, 8)))

