"""The native MoE kernels (ops.moe_experts, ops.moe_route) against their
pure-MLX references, on every CPU path this machine can run: random
routings, ragged expert loads (an expert no token chose, one every token
chose: more tokens than the GEMV takes), every bit width and group size,
dense weights, half-precision activations, the fused norm and residual."""

import mlx.core as mx
import numpy as np
import pytest

from mlxfast import ops
from mlxfast.ops.moe import moe_experts_reference, moe_route_reference

E, D, I = 8, 256, 128
TOL = {mx.float32: 2e-5, mx.float16: 3e-3, mx.bfloat16: 2e-2}


def experts(bits, group_size, sdtype=mx.float16, wdtype=mx.float32, seed=0):
    """gate, up, down of E experts: (w, scales, biases) each, or dense arrays (bits 0)."""
    mx.random.seed(seed)
    shapes = {"gate": (E, I, D), "up": (E, I, D), "down": (E, D, I)}
    out = {}
    for name, shape in shapes.items():
        w = mx.random.normal(shape) * shape[-1] ** -0.5
        if bits == 0:
            out[name] = w.astype(wdtype)
        else:
            wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
            out[name] = (wq, s.astype(sdtype), b.astype(sdtype))
    mx.eval(out)
    return out


def routing(T, k, seed=0, *, everyone=None, nobody=None):
    """Distinct experts per token (random), scores summing to 1; ``everyone``:
    an expert in every token's first slot; ``nobody``: an expert never chosen."""
    rng = np.random.default_rng(seed)
    pool = [e for e in range(E) if e not in (everyone, nobody)]
    inds = np.stack([rng.permutation(pool)[:k] for _ in range(T)]).astype(np.uint32)
    if everyone is not None:
        inds[:, 0] = everyone
    scores = rng.uniform(0.1, 1.0, size=(T, k)).astype(np.float32)
    scores /= scores.sum(-1, keepdims=True)
    return mx.array(inds), mx.array(scores)


def rel_err(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / (mx.abs(b).max() + 1e-30)).item()


def run_both(x, inds, scores, w, bits, group_size, **kw):
    args = (x, inds, scores, w["gate"], w["up"], w["down"])
    got = ops.moe_experts(*args, group_size=group_size, bits=bits, **kw)
    ref = moe_experts_reference(*args, group_size=group_size, bits=bits, **kw)
    return got, ref


def test_native_kernels_are_built():
    assert hasattr(ops._ext, "moe_experts") and hasattr(ops._ext, "moe_route")


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("T", [1, 7, 40])
def test_matches_reference_every_width(path, bits, group_size, T):
    w = experts(bits, group_size, seed=bits)
    mx.random.seed(T)
    x = mx.random.normal((T, D))
    inds, scores = routing(T, 2, seed=T + bits)
    got, ref = run_both(x, inds, scores, w, bits, group_size)
    assert got.shape == (T, D) and got.dtype == mx.float32
    assert rel_err(got, ref) < TOL[mx.float32]


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64), (3, 128)])
@pytest.mark.parametrize("T,k", [(1, 6), (3, 1), (40, 3), (64, 2)])
def test_ragged_loads(path, bits, group_size, T, k):
    """Expert 2 is in every token's choices (40 or 64 tokens: the GEMM part
    of the kernel), expert 5 in none; the rest random."""
    w = experts(bits, group_size)
    mx.random.seed(1)
    x = mx.random.normal((T, D))
    inds, scores = routing(T, k, seed=k, everyone=2, nobody=5)
    assert (np.array(inds) == 2).any(-1).all() and not (np.array(inds) == 5).any()
    got, ref = run_both(x, inds, scores, w, bits, group_size)
    assert rel_err(got, ref) < TOL[mx.float32]


@pytest.mark.parametrize("wdtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("T", [2, 40])
def test_dense_weights(path, wdtype, T):
    w = experts(0, 0, wdtype=wdtype)
    mx.random.seed(2)
    x = mx.random.normal((T, D))
    inds, scores = routing(T, 2, seed=3, everyone=1)
    got, ref = run_both(x, inds, scores, w, 0, 64)
    assert rel_err(got, ref) < TOL[mx.float32]


@pytest.mark.parametrize("dtype,sdtype", [(mx.float16, mx.float16), (mx.bfloat16, mx.bfloat16),
                                          (mx.float32, mx.bfloat16), (mx.float32, mx.float32)])
@pytest.mark.parametrize("T", [5, 33])
def test_activation_and_scale_dtypes(path, dtype, sdtype, T):
    w = experts(4, 64, sdtype=sdtype)
    mx.random.seed(4)
    x = mx.random.normal((T, D)).astype(dtype)
    inds, scores = routing(T, 2, seed=5, everyone=0 if T > 16 else None)
    scores = scores.astype(dtype)
    got, ref = run_both(x, inds, scores, w, 4, 64)
    assert got.dtype == dtype
    # The kernel computes in float32 and rounds once; the reference rounds
    # every intermediate to x's dtype. Oracle: the reference in float32 on
    # the same (exactly representable) inputs, within one rounding.
    exact = moe_experts_reference(x.astype(mx.float32), inds, scores.astype(mx.float32),
                                  w["gate"], w["up"], w["down"], group_size=64, bits=4)
    assert rel_err(got, exact) < {mx.float32: 2e-5, mx.float16: 1e-3, mx.bfloat16: 8e-3}[dtype]
    assert rel_err(got, exact) <= max(rel_err(ref, exact), 2e-5)  # no worse than the reference


def test_leading_axes_int32_ids_and_dropped_ids(path):
    """x [B, L, D] as the models call it; int32 ids; an id outside [0, E)
    (never produced by a router) adds nothing."""
    w = experts(4, 32)
    mx.random.seed(6)
    x = mx.random.normal((2, 3, D))
    inds, scores = routing(6, 2, seed=7)
    bad = np.array(inds).astype(np.int32)
    bad[1, 1], bad[4, 0] = E, -1
    got = ops.moe_experts(x, mx.array(bad).reshape(2, 3, 2), scores.reshape(2, 3, 2),
                          w["gate"], w["up"], w["down"], group_size=32, bits=4)
    ok = np.where((bad >= 0) & (bad < E), bad, 0).astype(np.uint32)
    kept = np.where((bad >= 0) & (bad < E), np.array(scores), 0).astype(np.float32)
    ref = moe_experts_reference(x.reshape(6, D), mx.array(ok), mx.array(kept), w["gate"], w["up"],
                                w["down"], group_size=32, bits=4)
    assert got.shape == (2, 3, D)
    assert rel_err(got.reshape(6, D), ref) < TOL[mx.float32]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("T", [4, 40])
def test_fused_norm_and_residual(path, dtype, T):
    """norm=(w, eps): the experts see rms_norm(x); residual added last, as
    the separate ops (the MoE block's h + moe(norm(h)))."""
    w = experts(4, 32)
    mx.random.seed(8)
    h = (mx.random.normal((T, D)) * 3).astype(dtype)
    nw = (mx.random.uniform(0.5, 1.5, (D,))).astype(dtype)
    inds, scores = routing(T, 2, seed=9, everyone=3 if T > 16 else None)
    got = ops.moe_experts(h, inds, scores, w["gate"], w["up"], w["down"], group_size=32, bits=4,
                          norm=(nw, 1e-5), residual=h)
    xn = ops.rms_norm(h, nw, 1e-5)
    sep = ops.moe_experts(xn, inds, scores, w["gate"], w["up"], w["down"], group_size=32, bits=4)
    assert got.dtype == dtype
    # bit-identical to the separate native ops
    assert mx.array_equal(got, h + sep).item()
    ref = h + moe_experts_reference(ops.rms_norm_reference(h, nw, 1e-5), inds, scores, w["gate"],
                                    w["up"], w["down"], group_size=32, bits=4)
    assert rel_err(got, ref) < 2 * TOL[dtype] + (2e-3 if dtype == mx.float32 else 0)


def test_batch_invariance_of_light_experts(path):
    """A token's output does not depend on the other tokens of the step (as
    long as its experts have at most 16 tokens: the GEMV part)."""
    w = experts(4, 32)
    mx.random.seed(10)
    x = mx.random.normal((12, D))
    inds, scores = routing(12, 2, seed=11)
    batched = ops.moe_experts(x, inds, scores, w["gate"], w["up"], w["down"], group_size=32, bits=4)
    for t in (0, 5, 11):
        alone = ops.moe_experts(x[t:t + 1], inds[t:t + 1], scores[t:t + 1], w["gate"], w["up"],
                                w["down"], group_size=32, bits=4)
        assert mx.array_equal(alone[0], batched[t]).item()


@pytest.mark.parametrize("bits", [4, 8, 5])
@pytest.mark.parametrize("T", [3, 40])
def test_symmetric_weights_without_biases(path, bits, T):
    """A symmetric format (bias = -2^(bits-1) * scale, as GGUF's Q4_0 / Q8_0)
    passed without biases: the same numbers as with them, bit for bit, in
    the GEMV and the GEMM parts; the reference builds the biases itself."""
    w = experts(bits, 32)
    sym = {}
    for name, (wq, s, _) in w.items():
        s = mx.abs(s)
        sym[name] = (wq, s, s * -(2 ** (bits - 1)))
    mx.random.seed(12)
    x = mx.random.normal((T, D))
    inds, scores = routing(T, 2, seed=13, everyone=4)
    full = ops.moe_experts(x, inds, scores, sym["gate"], sym["up"], sym["down"], group_size=32,
                           bits=bits)
    nob = {name: (wq, s, None) for name, (wq, s, _) in sym.items()}
    nob["up"] = sym["up"]  # projections may differ
    got = ops.moe_experts(x, inds, scores, nob["gate"], nob["up"], nob["down"], group_size=32,
                          bits=bits)
    assert mx.array_equal(got, full).item()
    ref = moe_experts_reference(x, inds, scores, nob["gate"], nob["up"], nob["down"],
                                group_size=32, bits=bits)
    assert rel_err(got, ref) < TOL[mx.float32]


# Int8 activations: against the reference that quantizes each projection's
# input rows the same way (fake_quantize_activations_int8). The kernel sums
# in another order, so an intermediate value (silu(gate) * up) lying on an
# int8 rounding boundary can round the other way: one quantization step in
# one of the down projection's inputs, up to ~3e-4 of the output's scale
# here (most cases agree to 1e-6). TOL_INT8 allows that and is still 5x
# below the distance to fp32 activations (~1e-2), which the test asserts.
TOL_INT8 = 2e-3


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64), (4, 128), (3, 64)])
@pytest.mark.parametrize("T,k,everyone", [(1, 2, None), (3, 4, None), (40, 3, 2), (64, 2, None)])
@pytest.mark.parametrize("symmetric", [False, True], ids=["biases", "symmetric"])
def test_int8_activations_match_reference(path, bits, group_size, T, k, everyone, symmetric):
    """Light experts (the int8 GEMV pieces) and, with expert 2 in all 40
    tokens' choices, a heavy one (the int8 GEMM); with and without biases."""
    w = experts(bits, group_size, seed=T)
    if symmetric:
        w = {n: (wq, mx.abs(s), None) for n, (wq, s, _) in w.items()}
    mx.random.seed(T + k)
    x = mx.random.normal((T, D)) * mx.random.uniform(0.2, 3.0, (T, 1))
    inds, scores = routing(T, k, seed=T, everyone=everyone)
    got, ref = run_both(x, inds, scores, w, bits, group_size, activations="int8")
    fp32 = moe_experts_reference(x, inds, scores, w["gate"], w["up"], w["down"],
                                 group_size=group_size, bits=bits)
    err, err_fp32 = rel_err(got, ref), rel_err(got, fp32)
    assert err < TOL_INT8 and err < err_fp32 / 5, (err, err_fp32)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_int8_activations_half_inputs_and_fused_pieces(path, dtype):
    w = experts(4, 32, sdtype=dtype)
    mx.random.seed(7)
    x = mx.random.normal((5, D)).astype(dtype)
    norm = (mx.random.uniform(0.5, 1.5, (D,)).astype(dtype), 1e-5)
    res = mx.random.normal((5, D)).astype(dtype)
    inds, scores = routing(5, 3, seed=7)
    got, ref = run_both(x, inds, scores, w, 4, 32, norm=norm, residual=res, activations="int8")
    # The reference rounds every intermediate to the half type; the kernel
    # keeps them in fp32 (twice the half tolerance, as the fused fp32 test).
    assert got.dtype == dtype and rel_err(got, ref) < 2 * TOL[dtype]


def test_int8_activations_need_quantized_weights():
    w = experts(0, 0)
    x = mx.random.normal((2, D))
    inds, scores = routing(2, 2)
    for fn in (ops.moe_experts, moe_experts_reference):
        with pytest.raises(ValueError, match="moe_experts.*int8 activations need quantized"):
            fn(x, inds, scores, w["gate"], w["up"], w["down"], group_size=64, bits=0,
               activations="int8")
    w = experts(4, 32)
    with pytest.raises(ValueError, match="moe_experts.*activations must be"):
        ops.moe_experts(x, inds, scores, w["gate"], w["up"], w["down"], group_size=32, bits=4,
                        activations="int4")


def test_empty_and_bad_inputs():
    w = experts(4, 32)
    got = ops.moe_experts(mx.zeros((0, D)), mx.zeros((0, 2), mx.uint32), mx.zeros((0, 2)),
                          w["gate"], w["up"], w["down"], group_size=32, bits=4)
    assert got.shape == (0, D)
    x = mx.random.normal((3, D))
    inds, scores = routing(3, 2)
    with pytest.raises(ValueError, match="moe_experts.*leading axes"):
        ops.moe_experts(x, inds[:2], scores[:2], w["gate"], w["up"], w["down"], group_size=32, bits=4)
    with pytest.raises(ValueError, match="moe_experts.*down"):
        ops.moe_experts(x, inds, scores, w["gate"], w["up"], w["gate"], group_size=32, bits=4)
    with pytest.raises(ValueError, match="moe_experts.*group_size"):
        ops.moe_experts(x, inds, scores, w["gate"], w["up"], w["down"], group_size=48, bits=4)
    with pytest.raises(ValueError, match="moe_experts.*residual"):
        ops.moe_experts(x, inds, scores, w["gate"], w["up"], w["down"], group_size=32, bits=4,
                        residual=x[:2])


# ------------------------------------------------------------------ routing

@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("softmax_first,normalize", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("n_experts,k", [(8, 2), (128, 8), (16, 16)])
def test_route_matches_reference(dtype, softmax_first, normalize, n_experts, k):
    mx.random.seed(n_experts + k)
    logits = (mx.random.normal((2, 9, n_experts)) * 2).astype(dtype)
    inds, scores = ops.moe_route(logits, k, softmax_first=softmax_first, normalize=normalize)
    ri, rs = moe_route_reference(logits.astype(mx.float32), k, softmax_first=softmax_first,
                                 normalize=normalize)
    assert inds.dtype == mx.uint32 and inds.shape == (2, 9, k) and scores.dtype == dtype
    i, s = np.array(inds).reshape(-1, k), np.array(scores.astype(mx.float32)).reshape(-1, k)
    ri, rs = np.array(ri).reshape(-1, k), np.array(rs).reshape(-1, k)
    lf = np.array(logits.astype(mx.float32)).reshape(-1, n_experts)
    for r in range(i.shape[0]):
        # distinct experts in descending weight; the same logits as the
        # reference's choice (which keeps no order; half-precision logits
        # tie, and then either id is right)
        assert len(set(i[r])) == k and (np.diff(s[r]) <= 0).all()
        np.testing.assert_array_equal(np.sort(lf[r][i[r]]), np.sort(lf[r][ri[r]]))
        np.testing.assert_allclose(np.sort(s[r]), np.sort(rs[r]), rtol=TOL[dtype] * 2, atol=1e-6)
        # the chosen logits are the k largest
        assert lf[r][i[r]].min() >= np.sort(lf[r])[-k]


def test_route_ties_take_the_lower_id():
    logits = mx.array([[0.0, 1.0, 1.0, 1.0, 0.5]])
    inds, scores = ops.moe_route(logits, 2, softmax_first=True, normalize=True)
    assert np.array(inds).tolist() == [[1, 2]]
    np.testing.assert_allclose(np.array(scores), [[0.5, 0.5]], rtol=1e-6)


def test_route_validates_k():
    with pytest.raises(ValueError, match="moe_route.*k"):
        ops.moe_route(mx.zeros((2, 4)), 5)


def _packed(w, symmetric=False):
    return {n: ops.pack_rows16(p[0], p[1], None if symmetric else p[2]) for n, p in w.items()}


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("symmetric", [False, True], ids=["affine", "symmetric"])
@pytest.mark.parametrize("T,k,everyone", [(1, 6, None), (7, 2, None), (40, 3, 2), (64, 2, 2)])
@pytest.mark.parametrize("bits", [4, 8])
def test_row_interleaved_experts(path, group_size, symmetric, T, k, everyone, bits):
    """Experts packed as ops.pack_rows16 does ([E, N/16, K * bits/32, 16],
    what the loader does on AVX-512) give the reference's result: light
    experts (the GEMV pieces) and an expert every token chose (the GEMM, or
    for 8 bits the GEMV to 64 rows), symmetric weights, and the same result
    as the MLX layout within fp32 rounding."""
    w = experts(bits, group_size, seed=T)
    if symmetric:
        w = {n: (p[0], p[1], None) for n, p in w.items()}
    pw = _packed(w, symmetric)
    assert pw["gate"][0].shape == (E, I // 16, D * bits // 32, 16)
    mx.random.seed(T)
    x = mx.random.normal((T, D))
    inds, scores = routing(T, k, seed=T, everyone=everyone, nobody=5)
    args = (x, inds, scores)
    got = ops.moe_experts(*args, pw["gate"], pw["up"], pw["down"], group_size=group_size, bits=bits)
    ref = moe_experts_reference(*args, pw["gate"], pw["up"], pw["down"], group_size=group_size, bits=bits)
    std = ops.moe_experts(*args, w["gate"], w["up"], w["down"], group_size=group_size, bits=bits)
    assert mx.array_equal(ref, moe_experts_reference(*args, w["gate"], w["up"], w["down"],
                                                     group_size=group_size, bits=bits)).item()
    assert rel_err(got, ref) < TOL[mx.float32] and rel_err(got, std) < TOL[mx.float32]


def test_row_interleaved_experts_light_rows_are_batch_invariant():
    w = _packed(experts(4, 32, seed=3))
    x = mx.random.normal((12, D), key=mx.random.key(4))
    inds, scores = routing(12, 2, seed=4)
    run = lambda a, b: ops.moe_experts(x[a:b], inds[a:b], scores[a:b], w["gate"], w["up"],  # noqa: E731
                                       w["down"], group_size=32, bits=4)
    whole = run(0, 12)
    for t in range(12):
        assert mx.array_equal(run(t, t + 1), whole[t:t + 1]).item(), t


def test_row_interleaved_experts_bad_input():
    w = experts(4, 32)
    pw = _packed(w)
    x = mx.random.normal((3, D))
    inds, scores = routing(3, 2)
    with pytest.raises(ValueError, match="share a layout"):
        ops.moe_experts(x, inds, scores, pw["gate"], w["up"], pw["down"], group_size=32, bits=4)
    with pytest.raises(ValueError, match="4- or 8-bit"):
        ops.moe_experts(x, inds, scores, pw["gate"], pw["up"], pw["down"], group_size=32, bits=2)


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64), (4, 128)])
@pytest.mark.parametrize("T,k,everyone", [(1, 2, None), (3, 4, None), (40, 3, 2)])
@pytest.mark.parametrize("symmetric", [False, True], ids=["biases", "symmetric"])
def test_row_interleaved_experts_int8(path, bits, group_size, T, k, everyone, symmetric):
    """Int8 activations over row-interleaved experts (what the loader packs
    on AVX2): the light experts' GEMV pieces and a heavy expert's matmul
    against the reference on MLX's layout, as test_int8_activations_match_reference."""
    w = experts(bits, group_size, seed=T)
    if symmetric:
        w = {n: (wq, mx.abs(s), None) for n, (wq, s, _) in w.items()}
    pw = _packed(w, symmetric)
    mx.random.seed(T + k)
    x = mx.random.normal((T, D)) * mx.random.uniform(0.2, 3.0, (T, 1))
    inds, scores = routing(T, k, seed=T, everyone=everyone)
    got = ops.moe_experts(x, inds, scores, pw["gate"], pw["up"], pw["down"], group_size=group_size,
                          bits=bits, activations="int8")
    ref = moe_experts_reference(x, inds, scores, w["gate"], w["up"], w["down"],
                                group_size=group_size, bits=bits, activations="int8")
    fp32 = moe_experts_reference(x, inds, scores, w["gate"], w["up"], w["down"],
                                 group_size=group_size, bits=bits)
    err, err_fp32 = rel_err(got, ref), rel_err(got, fp32)
    assert err < TOL_INT8 and err < err_fp32 / 5, (err, err_fp32)


def test_row_interleaved_experts_int8_rows_are_batch_invariant():
    w = _packed(experts(4, 32, seed=5))
    x = mx.random.normal((12, D), key=mx.random.key(6))
    inds, scores = routing(12, 2, seed=6)
    run = lambda a, b: ops.moe_experts(x[a:b], inds[a:b], scores[a:b], w["gate"], w["up"],  # noqa: E731
                                       w["down"], group_size=32, bits=4, activations="int8")
    whole = run(0, 12)
    for t in range(12):
        assert mx.array_equal(run(t, t + 1), whole[t:t + 1]).item(), t
