"""Int8 activations (``ops.quantized_matmul(..., activations="int8")``):
the native kernels against their pure-MLX reference.

Oracle: ``quantized_matmul_int8_reference`` = x quantized to int8 per 32
values (d = max|x| / 127), dequantized (``x_hat = d * xq``), then MLX's
fp32 quantized matmul. The kernels compute the same products as exact
integer sums per block, scaled afterwards, so they differ from the oracle by
float rounding order only: the error, against the natural scale
|x_hat| @ |w_hat|.T, is held to 2e-6 (measured: <= 3e-7). Every CPU path
this machine can execute is forced in turn: over MLX's layout each runs the
portable kernel; over the row-interleaved one (below) the AVX2 kernel and,
on AVX-512 VNNI CPUs, the VNNI kernel.
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxfast import _ext, ops

TOL = 2e-6


def make_weights(N, K, group_size, bits, sdtype=mx.float16, seed=0):
    mx.random.seed(seed)
    w = mx.random.normal((N, K)) * 0.05
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    return wq, s.astype(sdtype), b.astype(sdtype)


def rel_err(got, x, wq, s, b, group_size, bits):
    if b is None:
        b = s * -float(1 << (bits - 1))
    ref = ops.quantized_matmul_int8_reference(x, wq, s, b, group_size=group_size, bits=bits)
    xh = ops.fake_quantize_activations_int8(x)
    wf = mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size,
                       bits=bits)
    scale = mx.abs(xh) @ mx.abs(wf).T
    return (mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)) / (scale + 1e-30)).max().item()


@pytest.mark.parametrize("M", [1, 3, 8, 16, 17, 40, 200])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("with_biases", [True, False], ids=["biases", "symmetric"])
def test_kernel_matches_int8_reference(path, M, bits, group_size, with_biases):
    # Odd N (MLX's layout: the loader cannot interleave it); K = 320 and 576
    # are not multiples of 128.
    for N, K in ((37, 320), (19, 576)):
        wq, s, b = make_weights(N, K, group_size, bits, seed=M)
        x = mx.random.normal((M, K)) * mx.random.uniform(0.1, 4.0, (M, 1))
        bb = b if with_biases else None
        got = _ext.quantized_matmul_direct(x, wq, s, bb, group_size=group_size, bits=bits,
                                           int8=True, path=path)
        err = rel_err(got, x, wq, s, bb, group_size, bits)
        assert np.isfinite(err) and err <= TOL, (N, K, err)


@pytest.mark.parametrize("sdtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("M", [1, 5, 17])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 128), (4, 64)])
@pytest.mark.parametrize("with_biases", [True, False], ids=["biases", "symmetric"])
def test_scale_dtypes(path, sdtype, M, bits, group_size, with_biases):
    # Scales and biases are read in their own dtype; K = 320 is not a
    # multiple of 128.
    K = 384 if group_size == 128 else 320
    wq, s, b = make_weights(21, K, group_size, bits, sdtype, seed=M)
    x = mx.random.normal((M, K))
    bb = b if with_biases else None
    got = _ext.quantized_matmul_direct(x, wq, s, bb, group_size=group_size, bits=bits,
                                       int8=True, path=path)
    err = rel_err(got, x, wq, s, bb, group_size, bits)
    assert np.isfinite(err) and err <= TOL, err


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_other_bit_widths(path, bits):
    wq, s, b = make_weights(21, 256, 64, bits)
    x = mx.random.normal((5, 256))
    got = ops.quantized_matmul(x, wq, s, b, group_size=64, bits=bits, activations="int8")
    assert rel_err(got, x, wq, s, b, 64, bits) <= TOL


@pytest.mark.parametrize("xdtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("M", [1, 6, 24])
def test_op_dtypes_and_batch(path, xdtype, M):
    wq, s, b = make_weights(50, 576, 32, 4)
    x = mx.random.normal((2, M, 576)).astype(xdtype)
    got = ops.quantized_matmul(x, wq, s, b, group_size=32, bits=4, activations="int8")
    assert got.dtype == xdtype and got.shape == (2, M, 50)
    want = ops.quantized_matmul_reference(x, wq, s, b, group_size=32, bits=4, activations="int8")
    tol = {mx.float32: TOL, mx.float16: 1e-3, mx.bfloat16: 8e-3}[xdtype]
    err = rel_err(got.reshape(-1, 50), x.reshape(-1, 576), wq, s, b, 32, 4)
    assert err <= tol
    assert mx.array_equal(want, ops.quantized_matmul_int8_reference(x, wq, s, b, group_size=32,
                                                                    bits=4))


def test_int8_is_not_fp32(path):
    # The opt-in really changes the numbers (no silent fp32), and only by
    # the activation rounding: ~1% of the product's natural scale.
    wq, s, b = make_weights(64, 576, 32, 4)
    x = mx.random.normal((3, 576))
    fp = ops.quantized_matmul(x, wq, s, b, group_size=32, bits=4)
    i8 = ops.quantized_matmul(x, wq, s, b, group_size=32, bits=4, activations="int8")
    scale = mx.abs(x) @ mx.abs(mx.dequantize(wq, s, b, group_size=32, bits=4)).T
    d = (mx.abs(fp - i8) / scale).max().item()
    assert 1e-5 < d < 2e-2


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_do_not_depend_on_their_batch(path, bits):
    # Per-row quantization and a fixed accumulation order per output: a row
    # gives the same bits alone and in any batch.
    wq, s, b = make_weights(45, 576, 32, bits)
    x = mx.random.normal((40, 576))
    kw = dict(group_size=32, bits=bits, activations="int8")
    gemv = ops.quantized_matmul(x[:7], wq, s, b, **kw)
    for m in (0, 3, 6):
        one = ops.quantized_matmul(x[m:m + 1], wq, s, b, **kw)
        assert mx.array_equal(one[0], gemv[m])
    full = ops.quantized_matmul(x, wq, s, b, **kw)
    for n in (8, 9, 16, 24):
        assert mx.array_equal(ops.quantized_matmul(x[:n], wq, s, b, **kw), full[:n])


def test_fused_pieces_match_separate_ops(path):
    # The prologue feeds the int8 kernel its own op's numbers: bit-identical.
    wq, s, b = make_weights(40, 256, 64, 4, mx.float32)
    x = mx.random.normal((7, 256))
    nw = mx.random.uniform(0.5, 1.5, (256,))
    r = mx.random.normal((7, 40))
    kw = dict(group_size=64, bits=4, activations="int8")
    fused = ops.quantized_matmul(x, wq, s, b, norm=(nw, 1e-5), residual=r, **kw)
    sep = r + ops.quantized_matmul(ops.rms_norm(x, nw, 1e-5), wq, s, b, **kw)
    assert mx.array_equal(fused, sep)
    xa = mx.random.normal((7, 512))
    fused = ops.quantized_matmul(xa, wq, s, b, act="silu_mul_halves", **kw)
    sep = ops.quantized_matmul(ops.silu_mul_halves(xa), wq, s, b, **kw)
    assert mx.array_equal(fused, sep)


def test_zero_rows_and_blocks(path):
    # A block of zeros has d = 0 (no division by zero), a zero row gives 0.
    wq, s, b = make_weights(16, 128, 32, 8, mx.float32)
    x = mx.random.normal((3, 128))
    x = mx.concatenate([mx.zeros((1, 128)), x[1:2], mx.concatenate(
        [mx.zeros((1, 64)), x[2:, 64:]], axis=1)])
    got = ops.quantized_matmul(x, wq, s, b, group_size=32, bits=8, activations="int8")
    assert mx.array_equal(got[0], mx.zeros((16,)))
    assert rel_err(got, x, wq, s, b, 32, 8) <= TOL


_GFNI_RUN = r"""
import sys
import mlx.core as mx
import numpy as np
from mlxfast import ops
out = []
for gs, sd in ((32, mx.float16), (64, mx.bfloat16), (128, mx.float32)):
    K = 640 if gs == 128 else 576
    mx.random.seed(gs)
    wq, s, b = mx.quantize(mx.random.normal((48, K)) * 0.05, group_size=gs, bits=4)
    for bb in (b.astype(sd), None):
        pw = ops.pack_rows16(wq, s.astype(sd), bb)
        for M in (1, 7, 13, 20):
            y = ops.quantized_matmul(mx.random.normal((M, K)), *pw, group_size=gs, bits=4,
                                     activations="int8")
            out.append(np.array(y).ravel())
np.save(sys.argv[1], np.concatenate(out))
"""


def cpu_flags() -> set:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= cpu_flags()
needs_vnni = pytest.mark.skipif(not (VNNI and ops.cpu_path() == "avx512"),
                                reason="no AVX-512 VNNI int8 kernel on this CPU")


@needs_vnni
def test_gfni_and_shift_and_mask_agree_bit_for_bit(tmp_path):
    # The VNNI kernel takes each byte's high nibble with one GFNI instruction
    # where the CPU has it, with a shift and a mask otherwise (MLXFAST_GFNI=0,
    # as on CPUs without GFNI): the same integers, so the same bits (13 and
    # 20 rows unpack each block to bytes first).
    import os
    import subprocess
    import sys

    got = {}
    for flag in ("0", "1"):
        env = dict(os.environ, MLXFAST_GFNI=flag)
        f = tmp_path / f"gfni{flag}.npy"
        subprocess.run([sys.executable, "-c", _GFNI_RUN, str(f)], env=env, check=True)
        got[flag] = np.load(f)
    assert got["0"].size == 3 * 2 * (1 + 7 + 13 + 20) * 48  # group sizes x biases x rows x outputs
    assert np.isfinite(got["0"]).all() and np.array_equal(got["0"], got["1"])


def test_validation():
    wq, s, b = make_weights(8, 64, 32, 4)
    x = mx.random.normal((2, 64))
    with pytest.raises(ValueError, match="activations"):
        ops.quantized_matmul(x, wq, s, b, group_size=32, bits=4, activations="int4")
    with pytest.raises(ValueError, match="activations"):
        _ext.quantized_matmul(x, wq, s, b, group_size=32, bits=4, activations="fp8")
    with pytest.raises(ValueError, match="transpose"):
        ops.quantized_matmul(x, wq, s, b, transpose=False, group_size=32, bits=4,
                             activations="int8")


def test_support_query_names_what_the_cpu_lacks():
    flags = cpu_flags()
    msg = ops.int8_activations_unsupported()
    avx2 = {"avx2", "fma", "f16c"} <= flags
    if ops.cpu_path() in ("avx2", "avx512"):
        assert msg == ""
        # The VNNI and the AVX2 kernels both read the rows16 layout.
        assert ops.int8_activations_layout() == "rows16"
    elif flags:
        assert ops.int8_activations_layout() == ""
        assert ("portable" in msg) if avx2 else ("avx2" in msg and "lacks" in msg)


# The row-interleaved layout (ops.pack_rows16): what the loader packs int8
# layers into (ops.int8_activations_layout() == "rows16"). The VNNI kernel,
# the AVX2 one (maddubs) and the portable one read it.
def packed16(N, K, group_size, bits, with_biases, sdtype=mx.float16, seed=0):
    wq, s, b = make_weights(N, K, group_size, bits, sdtype, seed)
    b = b if with_biases else None
    return (wq, s, b), ops.pack_rows16(wq, s, b)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 9, 40, 131])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("with_biases", [True, False], ids=["biases", "symmetric"])
def test_rows16_kernel_matches_int8_reference(path, M, bits, group_size, with_biases):
    K = 384 if group_size == 128 else 320
    (wq, s, b), pw = packed16(48, K, group_size, bits, with_biases, seed=M)
    x = mx.random.normal((M, K)) * mx.random.uniform(0.1, 4.0, (M, 1))
    got = _ext.quantized_matmul_direct(x, pw[0], pw[1], pw[2], group_size=group_size, bits=bits,
                                       int8=True, path=path)
    err = rel_err(got, x, wq, s, b, group_size, bits)
    assert np.isfinite(err) and err <= TOL, err


@needs_vnni
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("with_biases", [True, False], ids=["biases", "symmetric"])
@pytest.mark.parametrize("sdtype", [mx.float16, mx.bfloat16, mx.float32])
def test_rows16_vnni_and_avx2_kernels_agree_bit_for_bit(bits, group_size, with_biases, sdtype):
    # The same integer block sums and the same fp32 chain per output: the
    # VNNI kernel (12 rows a pass; a block unpacked to bytes for more than 12)
    # gives the AVX2 kernel's bits at every number of rows.
    K = 384 if group_size == 128 else 576
    _, pw = packed16(64, K, group_size, bits, with_biases, sdtype=sdtype, seed=bits + group_size)
    for M in (1, 2, 7, 8, 9, 16, 23, 130):
        for xdtype in (mx.float32, mx.float16):
            x = (mx.random.normal((M, K)) * mx.random.uniform(0.1, 4.0, (M, 1))).astype(xdtype)
            got = {}
            for p in ("avx512", "avx2"):
                ops.set_cpu_path(p)
                try:
                    got[p] = ops.quantized_matmul(x, *pw, group_size=group_size, bits=bits,
                                                  activations="int8")
                    mx.eval(got[p])
                finally:
                    ops.set_cpu_path("")
            assert got["avx512"].dtype == xdtype
            assert mx.array_equal(got["avx512"], got["avx2"]).item(), (M, xdtype)


@pytest.mark.parametrize("sdtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("xdtype", [mx.float16, mx.bfloat16])
def test_rows16_dtypes(sdtype, xdtype):
    (wq, s, b), pw = packed16(32, 256, 64, 4, True, sdtype=sdtype)
    x = (mx.random.normal((5, 256)) * 2).astype(xdtype)
    got = ops.quantized_matmul(x, *pw, group_size=64, bits=4, activations="int8")
    assert got.dtype == xdtype
    want = ops.quantized_matmul_int8_reference(x.astype(mx.float32), wq, s, b, group_size=64, bits=4)
    assert mx.allclose(got.astype(mx.float32), want, rtol=1e-2, atol=1e-2).item()


@pytest.mark.parametrize("bits", [4, 8])
def test_rows16_extreme_codes_do_not_saturate(path, bits):
    # The integer sums at their bounds: every code 0 or 2^bits - 1 against
    # activations of one sign at full scale (4 bits: 16 products of 15 * 127
    # in an int16 lane; 8 bits: pairs of 128 * 127 in vpmaddubsw).
    N, K = 16, 256
    for fill in (0, 0xFFFFFFFF):
        wq = mx.full((N, K * bits // 32), fill, dtype=mx.uint32)
        s = mx.ones((N, K // 32), dtype=mx.float16)
        b = mx.full((N, K // 32), -3.0, dtype=mx.float16)
        pw = ops.pack_rows16(wq, s, b)
        for sign in (1.0, -1.0):
            x = mx.full((3, K), sign)
            got = ops.quantized_matmul(x, *pw, group_size=32, bits=bits, activations="int8")
            code = 0 if fill == 0 else (1 << bits) - 1
            want = sign * K * (code - 3.0)
            assert mx.array_equal(got, mx.full((3, N), want)).item(), (fill, sign, got[0, 0].item())


@pytest.mark.parametrize("bits", [4, 8])
def test_rows16_rows_do_not_depend_on_their_call(bits):
    # One chain per output over the blocks, at every number of rows: a row
    # gives the same bits alone, among a few (decode, verify) and in a
    # prefill-sized call, wherever it sits.
    (_, _, _), pw = packed16(64, 576, 32, bits, True)
    x = mx.random.normal((300, 576))
    kw = dict(group_size=32, bits=bits, activations="int8")
    full = ops.quantized_matmul(x, *pw, **kw)
    for n in (1, 2, 3, 4, 5, 8, 13, 64, 299):
        part = ops.quantized_matmul(x[300 - n:], *pw, **kw)
        assert mx.array_equal(part, full[300 - n:]).item(), n
