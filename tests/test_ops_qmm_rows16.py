"""The row-interleaved layout (ops.pack_rows16, 4- and 8-bit): the layout
of the AVX-512 and AVX2 paths' kernels, a load-time repack of MLX's. Oracle
and tolerances as in test_ops_qmm.py (dequantize with MLX, fp32 matmul,
error against |x| @ |W|.T); every CPU path this machine runs is forced in
turn (AVX-512 and AVX2 run their own kernels on it, the others the portable
one)."""

import mlx.core as mx
import numpy as np
import pytest

import mlxfast
from mlxfast import ops
from mlxfast.kv.dense import DenseKVCache
from mlxfast.kv.ssd import weights_fingerprint
from mlxfast.models.layers import (ROWS16_PATHS, QuantizedEmbedding, QuantizedLinear, pack_rows16,
                                   set_matmul_activations, unpack_rows16)

from test_ops_qmm import TOL, make_weights, oracle


BITS = [4, 8]
# Rows to which the layout's GEMV runs (qmm.h rows16_gemv_max_rows), then its
# GEMM in the GEMV's arithmetic to INVARIANT_MAX rows (kRows16InvariantMaxRows),
# then the dequantized-panel GEMM.
ROWS16_GEMV_MAX = {4: 32, 8: 64}
INVARIANT_MAX = 128


def packed(N, K, gs, sdtype, symmetric=False, seed=0, bits=4):
    wq, s, b = make_weights(N, K, gs, bits, sdtype, seed)
    b = None if symmetric else b
    return (wq, s, b), ops.pack_rows16(wq, s, b)


def check_close(got, x, wq, s, b, gs, bits=4):
    ref, scale = oracle(x, wq, s, ops.symmetric_biases(s, bits) if b is None else b, gs, bits)
    assert got.dtype == x.dtype and got.shape == ref.shape
    worst = (mx.abs(got.astype(mx.float32) - ref) / (scale + 1e-30)).max().item()
    assert np.isfinite(worst) and worst <= TOL[x.dtype], worst


@pytest.mark.parametrize("bits", BITS)
def test_pack_is_a_reordering_and_unpack_undoes_it(bits):
    (wq, s, b), (pw, ps, pb) = packed(48, 256, 64, mx.float16, bits=bits)
    assert pw.shape == (3, 256 * bits // 32, 16) and ps.shape == (3, 4, 16) and pb.shape == (3, 4, 16)
    # word (blk, j, r) is word j of row 16 * blk + r
    assert pw[1, 5, 7].item() == wq[16 + 7, 5].item()
    assert ps[2, 3, 15].item() == s[47, 3].item()
    for a, c in zip(ops.unpack_rows16(pw, ps, pb), (wq, s, b)):
        assert mx.array_equal(a, c).item()
    assert ops.unpack_rows16(wq, s, None) == (wq, s, None)  # MLX's layout passes through


SHAPES = [(N, K, gs) for N, K in [(16, 32), (48, 576), (96, 1536), (32, 4096)]
          for gs in (32, 64, 128) if K % gs == 0]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("N,K,gs", SHAPES)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 16, 17, 40, 97, 130])
def test_matches_the_oracle(path, N, K, gs, M, bits):
    (wq, s, b), p = packed(N, K, gs, mx.float16, seed=M, bits=bits)
    x = mx.random.normal((M, K), key=mx.random.key(M))
    check_close(ops.quantized_matmul(x, *p, group_size=gs, bits=bits), x, wq, s, b, gs, bits)


@pytest.mark.parametrize("xdtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("sdtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("symmetric", [False, True], ids=["affine", "symmetric"])
@pytest.mark.parametrize("M", [1, 7, 24, 70])
@pytest.mark.parametrize("bits", BITS)
def test_dtypes_and_symmetric(path, xdtype, sdtype, symmetric, M, bits):
    (wq, s, b), p = packed(64, 320, 32, sdtype, symmetric, bits=bits)
    x = mx.random.normal((M, 320), key=mx.random.key(3)).astype(xdtype)
    check_close(ops.quantized_matmul(x, *p, group_size=32, bits=bits), x, wq, s, b, 32, bits)


@pytest.mark.skipif(not ops.cpu_supports("avx512"), reason="the AVX-512 GEMM's property")
@pytest.mark.parametrize("M", [INVARIANT_MAX + 1, 200])
def test_large_gemm_is_the_mlx_layout_gemm_bit_for_bit(M):
    """Past INVARIANT_MAX rows both layouts dequantize panels to the same
    values (s * q + b, one rounding) and share the AVX-512 micro-kernel
    (other paths run the layout in the portable kernel)."""
    ops.set_cpu_path("avx512")
    try:
        for bits in BITS:
            for symmetric in (False, True):
                (wq, s, b), p = packed(96, 576, 32, mx.float16, symmetric, bits=bits)
                x = mx.random.normal((M, 576), key=mx.random.key(M))
                got = ops.quantized_matmul(x, *p, group_size=32, bits=bits)
                want = ops.quantized_matmul(x, wq, s, b, group_size=32, bits=bits)
                assert mx.array_equal(got, want).item(), (bits, symmetric)
    finally:
        ops.set_cpu_path("")


@pytest.mark.parametrize("gs", [32, 128])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("symmetric", [False, True], ids=["affine", "symmetric"])
def test_rows_do_not_depend_on_their_batch(path, gs, bits, symmetric):
    """A row's output is bit-identical alone and among others, to
    INVARIANT_MAX rows: the GEMV (its 4-row passes) and above it the GEMM
    in the same arithmetic (a speculative step's verify rows, several
    streams' decode rows); 80 output rows: a panel of two row blocks and
    one of one."""
    top = INVARIANT_MAX
    (_, _, _), p = packed(80, 512, gs, mx.float16, symmetric, bits=bits)
    x = mx.random.normal((top, 512), key=mx.random.key(9))
    alone = [ops.quantized_matmul(x[i:i + 1], *p, group_size=gs, bits=bits) for i in range(top)]
    gemv = ROWS16_GEMV_MAX[bits]
    for M in [*range(2, 18), 24, gemv - 1, gemv, gemv + 1, gemv + 3, 97, top - 1, top]:
        got = ops.quantized_matmul(x[:M], *p, group_size=gs, bits=bits)
        for i in range(M):
            assert mx.array_equal(got[i:i + 1], alone[i]).item(), (M, i)
    shifted = ops.quantized_matmul(x[5:5 + 90], *p, group_size=gs, bits=bits)  # rows at other offsets
    for i in range(90):
        assert mx.array_equal(shifted[i:i + 1], alone[5 + i]).item(), i


@pytest.mark.skipif(not ops.cpu_supports("avx2"), reason="the AVX2 kernel's property")
@pytest.mark.parametrize("bits", BITS)
def test_avx2_rows_do_not_depend_on_their_call_at_any_size(bits):
    """On AVX2 the layout runs in one arithmetic at every number of rows
    (the tile, then from 32 rows a GEMM over converted codes; both beat the
    dequantized-panel GEMM there): a row's result is the same alone and in
    calls of any size. K = 4,096: the GEMM's bands are 96 rows (32
    micro-tiles of 3), so 300 rows span 4 of them, the last one partial."""
    ops.set_cpu_path("avx2")
    try:
        (_, _, _), p = packed(48, 4096, 64, mx.float16, bits=bits)
        x = mx.random.normal((300, 4096), key=mx.random.key(11))
        full = ops.quantized_matmul(x, *p, group_size=64, bits=bits)
        for i in (0, 1, 15, 16, 17, 150, 299):
            assert mx.array_equal(ops.quantized_matmul(x[i:i + 1], *p, group_size=64, bits=bits),
                                  full[i:i + 1]).item(), i
        for m0, n in ((3, 129), (16, 200), (0, 257)):
            part = ops.quantized_matmul(x[m0:m0 + n], *p, group_size=64, bits=bits)
            assert mx.array_equal(part, full[m0:m0 + n]).item(), (m0, n)
    finally:
        ops.set_cpu_path("")


def test_fused_pieces_and_reference():
    """norm / act / residual wrap the matmul as with MLX's layout; the
    reference takes either layout."""
    (wq, s, b), p = packed(64, 256, 32, mx.float16)
    x = mx.random.normal((3, 256), key=mx.random.key(1))
    nw = mx.random.normal((256,), key=mx.random.key(2))
    r = mx.random.normal((3, 64), key=mx.random.key(3))
    for kw in (dict(norm=(nw, 1e-5)), dict(residual=r), dict(norm=(nw, 1e-5), residual=r)):
        got = ops.quantized_matmul(x, *p, group_size=32, bits=4, **kw)
        want = ops.quantized_matmul(x, wq, s, b, group_size=32, bits=4, **kw)
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()
        ref = ops.quantized_matmul_reference(x, *p, group_size=32, bits=4, **kw)
        assert mx.allclose(got, ref, rtol=1e-4, atol=1e-4).item()
    x2 = mx.random.normal((2, 512), key=mx.random.key(4))
    got = ops.quantized_matmul(x2, *p, group_size=32, bits=4, act="silu_mul_halves")
    want = ops.quantized_matmul(x2, wq, s, b, group_size=32, bits=4, act="silu_mul_halves")
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()


def test_bad_input():
    (wq, s, b), (pw, ps, pb) = packed(32, 128, 32, mx.float16)
    x = mx.ones((1, 128))
    with pytest.raises(ValueError, match="4- or 8-bit only"):
        ops.quantized_matmul(x, pw, ps, pb, group_size=32, bits=6)
    with pytest.raises(ValueError, match="shape mismatch"):  # 4-bit words read as 8-bit
        ops.quantized_matmul(x, pw, ps, pb, group_size=32, bits=8)
    with pytest.raises(ValueError, match="scales and biases must be"):
        ops.quantized_matmul(x, pw, ps, pb, group_size=64, bits=4)
    with pytest.raises(ValueError, match="row-interleaved w must be"):
        ops.quantized_matmul(x, pw, s, b, group_size=32, bits=4)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.pack_rows16(wq[:24], s[:24], b[:24])
    assert ops.can_pack_rows16(wq, 8) and not ops.can_pack_rows16(wq, 6)
    assert not ops.can_pack_rows16(wq[:8], 4)


@pytest.fixture(scope="module")
def default_model():
    return mlxfast.load()[0]


def _quantized(model):
    return [(n, l) for n, l in model.named_modules() if isinstance(l, (QuantizedLinear, QuantizedEmbedding))]


@pytest.mark.skipif(ops.cpu_path() not in ROWS16_PATHS,
                    reason="the layout is packed only on the AVX-512 and AVX2 paths")
def test_the_default_model_loads_packed_and_computes_the_same(default_model):
    """The loader packs every 4- and 8-bit projection on AVX-512 and AVX2 (the
    default model's head is 8-bit, its blocks 4-bit); the logits match
    the same model in MLX's layout (a different fp32 sum order: close, not
    equal), and unpack / pack round-trips the weights exactly."""
    m = default_model
    layers = _quantized(m)
    packed_layers = [n for n, l in layers if l["weight"].ndim == 3]
    assert packed_layers and len(packed_layers) == sum(l.bits in (4, 8) for _, l in layers)
    assert {l.bits for _, l in layers if l["weight"].ndim == 3} == {4, 8}
    before = {n: l["weight"] for n, l in layers}
    fingerprint = weights_fingerprint(m)
    tokens = mx.array([[1, 504, 3457, 28, 253, 1789, 30, 9, 1234, 17]])
    try:
        got = m(tokens, DenseKVCache(len(m.layers)))
        assert unpack_rows16(m) == len(packed_layers)
        # the SSD namespace and the tensor-parallel check see one model whatever the layout
        assert weights_fingerprint(m) == fingerprint
        want = m(tokens, DenseKVCache(len(m.layers)))
    finally:
        assert pack_rows16(m) == len(packed_layers)
    for n, l in layers:
        assert mx.array_equal(l["weight"], before[n]).item()
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-3).item()
    assert mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1)).item()


@pytest.mark.skipif(ops.cpu_path() not in ROWS16_PATHS,
                    reason="the layout is packed only on the AVX-512 and AVX2 paths")
def test_int8_activations_pack_as_their_kernel_reads(default_model):
    """int8 activations put the block projections in the layout their kernel
    reads (VNNI: MLX's; AVX2: the row-interleaved one) and leave the fp32
    ones packed; fp32 again repacks all."""
    m = default_model
    heads = [l for n, l in _quantized(m) if l.activations == "fp32" and l.bits in (4, 8)]
    int8_rows16 = ops.int8_activations_layout() == "rows16"
    try:
        assert set_matmul_activations(m, "int8") > 0
        for _, l in _quantized(m):
            assert (l["weight"].ndim == 3) == (l.bits in (4, 8) and (l.activations == "fp32" or int8_rows16))
    finally:
        set_matmul_activations(m, "fp32")
    assert all(l["weight"].ndim == 3 for l in heads)


@pytest.mark.parametrize("symmetric", [False, True], ids=["affine", "symmetric"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("bits", BITS)
def test_embedding_lookup_reads_the_layout(symmetric, dtype, bits):
    """dequantize_rows (a tied head's embedding lookup) gives the same rows
    bit for bit from either layout; ids outside [0, V) give zeros."""
    (wq, s, b), p = packed(64, 256, 32, mx.float16, symmetric, bits=bits)
    ids = mx.array([[0, 17, 63], [31, -1, 64]])
    got = ops.dequantize_rows(*p, ids, group_size=32, bits=bits, dtype=dtype)
    want = ops.dequantize_rows(wq, s, b, ids, group_size=32, bits=bits, dtype=dtype)
    assert got.shape == (2, 3, 256) and mx.array_equal(got, want).item()
    assert not mx.any(got[1, 1]).item() and not mx.any(got[1, 2]).item()
    ref = ops.dequantize_rows_reference(*p, mx.array([0, 17, 63]), group_size=32, bits=bits, dtype=dtype)
    assert mx.array_equal(ref, want[0]).item()
    with pytest.raises(ValueError, match=r"scales and biases must be \[V / 16"):
        ops.dequantize_rows(p[0], s, b, ids, group_size=32, bits=bits)
    with pytest.raises(ValueError, match="row-interleaved layout: 4- or 8-bit"):
        ops.dequantize_rows(p[0], *p[1:], ids, group_size=32, bits=6)
