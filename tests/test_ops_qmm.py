"""Parity of mlxfast.ops.quantized_matmul (native CPU kernels) with MLX.

Oracle: dequantize with MLX, then an fp32 matmul. Error is measured against
the natural scale of the sum, |x| @ |W|.T (per output element), so the
tolerance means "relative rounding error of the accumulation":
  fp32 output: 2e-5   (fp32 accumulation over K <= 4096 in a different order)
  fp16 output: 1e-3   (one rounding to fp16, 2^-11, plus the fp32 part)
  bf16 output: 8e-3   (one rounding to bf16, 2^-8)
Every CPU path this machine can run is forced in turn.
"""

import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxfast import ops

ALL_PATHS = ("portable", "avx2", "avx512", "neon")
# Capability, not skip-to-green: only paths this CPU can execute are listed.
PATHS = [p for p in ALL_PATHS if ops.cpu_supports(p)]
TOL = {mx.float32: 2e-5, mx.float16: 1e-3, mx.bfloat16: 8e-3}



def test_portable_path_is_always_available():
    assert "portable" in PATHS
    assert ops.cpu_path() in PATHS


def make_weights(N, K, group_size, bits, sdtype, seed=0):
    mx.random.seed(seed)
    w = mx.random.normal((N, K)) * 0.05
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    return wq, s.astype(sdtype), b.astype(sdtype)


def oracle(x, wq, s, b, group_size, bits):
    wf = mx.dequantize(
        wq, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size, bits=bits
    )
    xf = x.astype(mx.float32)
    ref = xf @ wf.T
    scale = mx.abs(xf) @ mx.abs(wf).T
    return ref, scale


def check(x, wq, s, b, group_size, bits):
    got = ops.quantized_matmul(x, wq, s, b, group_size=group_size, bits=bits)
    ref, scale = oracle(x, wq, s, b, group_size, bits)
    assert got.dtype == x.dtype
    assert got.shape == (*x.shape[:-1], wq.shape[0])
    err = mx.abs(got.astype(mx.float32) - ref) / (scale + 1e-30)
    worst = err.max().item()
    assert np.isfinite(worst) and worst <= TOL[x.dtype], (worst, x.dtype)


SHAPES = [  # (M, N, K)
    (1, 1, 32),
    (1, 7, 64),
    (1, 576, 576),
    (1, 33, 1536),
    (2, 45, 128),
    (3, 17, 256),
    (5, 100, 96),
    (8, 64, 384),
    (9, 31, 160),
    (13, 50, 256),
    (16, 96, 128),
    (37, 65, 320),
    (64, 192, 576),
    (65, 130, 256),  # past the 8-bit GEMV's 64 rows
    (100, 70, 192),
]


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_shapes_fp32(path, M, N, K, bits):
    gs = 32
    wq, s, b = make_weights(N, K, gs, bits, mx.float16, seed=M * 1000 + N)
    x = mx.random.normal((M, K))
    check(x, wq, s, b, gs, bits)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M", [1, 4, 24])
def test_group_sizes(path, group_size, bits, M):
    K = 3 * 128
    wq, s, b = make_weights(37, K, group_size, bits, mx.float32, seed=group_size)
    x = mx.random.normal((M, K)) * 3
    check(x, wq, s, b, group_size, bits)


@pytest.mark.parametrize("xdtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("sdtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 20])
def test_dtypes(path, xdtype, sdtype, M):
    wq, s, b = make_weights(70, 256, 64, 4, sdtype, seed=1)
    x = mx.random.normal((M, 256)).astype(xdtype)
    check(x, wq, s, b, 64, 4)


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_other_bit_widths(path, bits):
    wq, s, b = make_weights(19, 192, 32, bits, mx.float16, seed=bits)
    for M in (1, 17):
        check(mx.random.normal((M, 192)), wq, s, b, 32, bits)


def test_batched_and_non_contiguous(path):
    wq, s, b = make_weights(48, 128, 32, 4, mx.float16)
    x = mx.random.normal((2, 3, 128))
    check(x, wq, s, b, 32, 4)
    xt = mx.random.normal((128, 6)).T  # non-contiguous [6, 128]
    check(xt, wq, s, b, 32, 4)
    xs = mx.random.normal((4, 20, 128))[:, 1::2]  # strided, offset [4, 10, 128]
    check(xs, wq, s, b, 32, 4)
    xb = mx.broadcast_to(mx.random.normal((1, 128)), (5, 128))  # stride 0
    check(xb, wq, s, b, 32, 4)
    xe = mx.random.normal((3, 256))[:, 64:192]  # evaluated view with an offset
    mx.eval(xe)
    check(xe.astype(mx.float16), wq, s, b, 32, 4)
    check(xe, wq, s, b, 32, 4)
    # non-contiguous weights are made dense by the op
    w2 = mx.concatenate([wq, wq], axis=1)[:, : wq.shape[1]]
    check(mx.random.normal((2, 128)), w2, s, b, 32, 4)
    check(mx.random.normal((2, 128)), wq, s.T.T, b[::1], 32, 4)


def test_group_boundary_extremes(path):
    # Every value 0 or 2^bits - 1, alternating per group: exercises unpacking
    # of the top nibble/byte and the scale/bias switch at each group edge.
    N, K, gs = 9, 256, 32
    for bits in (4, 8):
        top = (1 << bits) - 1
        q = np.zeros((N, K), np.uint32)
        q[:, ::3] = top
        q[:, (np.arange(K) // gs) % 2 == 1] ^= top
        per = 32 // bits
        packed = np.zeros((N, K // per), np.uint32)
        for j in range(per):
            packed |= q[:, j::per] << (bits * j)
        wq = mx.array(packed)
        rng = np.random.default_rng(bits)
        s = mx.array(rng.uniform(0.01, 0.1, (N, K // gs)).astype(np.float16))
        b = mx.array(rng.uniform(-1, 1, (N, K // gs)).astype(np.float16))
        ref_w = mx.dequantize(
            wq, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=bits
        )
        assert np.allclose(
            np.array(ref_w),
            np.array(s, np.float32).repeat(gs, 1) * q + np.array(b, np.float32).repeat(gs, 1),
            atol=1e-5,
        )
        for M in (1, 3, 30):
            check(mx.random.normal((M, K)), wq, s, b, gs, bits)


@pytest.mark.parametrize("M", [1, 6, 40])
def test_matches_mx_quantized_matmul(path, M):
    # The model's case: fp32 activations, fp16 scales/biases, bits 4, group 32.
    wq, s, b = make_weights(192, 576, 32, 4, mx.float16, seed=3)
    x = mx.random.normal((M, 576))
    got = ops.quantized_matmul(x, wq, s, b, group_size=32, bits=4)
    want = mx.quantized_matmul(x, wq, s, b, group_size=32, bits=4)
    scale = mx.abs(x) @ mx.abs(mx.dequantize(wq, s, b, group_size=32, bits=4)).T
    assert (mx.abs(got - want) / scale).max().item() <= 2e-5


def test_empty_and_reference_fallbacks():
    wq, s, b = make_weights(8, 64, 32, 4, mx.float32)
    out = ops.quantized_matmul(mx.zeros((0, 64)), wq, s, b, group_size=32, bits=4)
    assert out.shape == (0, 8)
    # transpose=False is not a native case: it runs MLX's op.
    wq2, s2, b2 = make_weights(64, 64, 32, 4, mx.float32)
    x = mx.random.normal((2, 64))
    got = ops.quantized_matmul(x, wq2, s2, b2, transpose=False, group_size=32, bits=4)
    want = mx.quantized_matmul(x, wq2, s2, b2, transpose=False, group_size=32, bits=4)
    assert mx.allclose(got, want)


def test_validation_errors():
    wq, s, b = make_weights(8, 64, 32, 4, mx.float16)
    x = mx.zeros((2, 64))
    qm = ops.quantized_matmul
    with pytest.raises(ValueError, match=r"\[mlxfast.quantized_matmul\].*shape mismatch"):
        qm(mx.zeros((2, 96)), wq, s, b, group_size=32, bits=4)
    with pytest.raises(ValueError, match="multiple of group_size"):
        qm(mx.zeros((2, 48)), wq, s, b, group_size=32, bits=4)
    with pytest.raises(ValueError, match="bits"):
        qm(x, wq, s, b, group_size=32, bits=7)
    with pytest.raises(ValueError, match="group_size"):
        qm(x, wq, s, b, group_size=16, bits=4)
    with pytest.raises(ValueError, match="shape mismatch"):
        qm(x, wq, s, b, group_size=64, bits=4)  # scales have 2 groups per row
    with pytest.raises(ValueError, match="shape mismatch"):
        qm(x, wq, s[:4], b[:4], group_size=32, bits=4)
    with pytest.raises(ValueError, match="x must be"):
        qm(x.astype(mx.int32), wq, s, b, group_size=32, bits=4)
    with pytest.raises(ValueError, match="w must be uint32"):
        qm(x, wq.astype(mx.int32), s, b, group_size=32, bits=4)
    with pytest.raises(ValueError, match="same dtype as scales"):
        qm(x, wq, s, b.astype(mx.float32), group_size=32, bits=4)
    with pytest.raises(ValueError, match="biases"):
        qm(x, wq, s, b[:4], group_size=32, bits=4)


@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 128), (8, 32), (8, 64)], ids=str)
@pytest.mark.parametrize("M", [1, 5, 12, 70])
def test_symmetric_weights_without_biases(path, bits, gs, M):
    """biases None (a symmetric format: every bias -2^(bits-1) * scale, as the
    loader keeps GGUF's Q4_0 / Q8_0): bit-identical to passing those biases,
    on the GEMV and GEMM paths, and the reference materializes the same."""
    N, K = 37, 256
    mx.random.seed(3)
    wq = mx.random.randint(0, 2**31, (N, K * bits // 32)).astype(mx.uint32)
    s = (mx.random.uniform(shape=(N, K // gs)) * 0.02 + 0.001).astype(mx.float16)
    b = ops.symmetric_biases(s, bits)
    assert mx.array_equal(b, s * -(2 ** (bits - 1)))
    x = mx.random.normal((M, K))
    got = ops.quantized_matmul(x, wq, s, None, group_size=gs, bits=bits)
    want = ops.quantized_matmul(x, wq, s, b, group_size=gs, bits=bits)
    assert mx.array_equal(got, want)
    check(x, wq, s, b, gs, bits)
    if M <= 16:  # GEMV rows: alone (the one-row symmetric tile) as in the batch
        for i in {0, M - 1}:
            alone = ops.quantized_matmul(x[i:i + 1], wq, s, None, group_size=gs, bits=bits)
            assert mx.array_equal(alone[0], got[i])
    ref = ops.quantized_matmul_reference(x, wq, s, None, group_size=gs, bits=bits)
    assert mx.array_equal(ref, ops.quantized_matmul_reference(x, wq, s, b, group_size=gs, bits=bits))
    ids = mx.array([[0, 36], [5, 5]])
    rows = ops.dequantize_rows(wq, s, None, ids, group_size=gs, bits=bits)
    assert mx.array_equal(rows, ops.dequantize_rows(wq, s, b, ids, group_size=gs, bits=bits))
    assert mx.array_equal(rows, ops.dequantize_rows_reference(wq, s, None, ids, group_size=gs,
                                                              bits=bits))


def test_dequantize_rows():
    wq, s, b = make_weights(100, 128, 32, 4, mx.float16)
    ids = mx.array([[3, 99, 0], [7, 7, 42]])
    got = ops.dequantize_rows(wq, s, b, ids, group_size=32, bits=4)
    want = ops.dequantize_rows_reference(wq, s, b, ids, group_size=32, bits=4)
    assert got.shape == (2, 3, 128) and got.dtype == mx.float16
    assert mx.array_equal(got, want)


def test_inside_compile_and_graph():
    wq, s, b = make_weights(64, 128, 32, 4, mx.float16)

    @mx.compile
    def f(x):
        return ops.quantized_matmul(x * 2, wq, s, b, group_size=32, bits=4) + 1

    x = mx.random.normal((3, 128))
    ref, _ = oracle(x * 2, wq, s, b, 32, 4)
    assert mx.allclose(f(x), ref + 1, atol=1e-4)


# The NEON kernel cannot run on x86 hosts; where an aarch64 cross compiler and
# qemu-user exist (Debian: g++-aarch64-linux-gnu, qemu-user) it is built and
# checked against the portable kernel under emulation.
NEON_HARNESS = r"""
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cmath>
#include <random>
#include "cpu/qmm.h"
namespace mlxfast {
int num_threads() { return 3; }
void parallel_for(int64_t n, int64_t, RangeFn fn, void* ctx) {
  // split into 3 chunks to exercise ranges
  int64_t per = (n + 2) / 3;
  for (int64_t b = 0; b < n; b += per) fn(ctx, b, b + per < n ? b + per : n);
}
}
using namespace mlxfast;
using namespace mlxfast::qmm;
int main() {
  std::mt19937 rng(1);
  int fails = 0;
  for (int bits : {4, 8, 3}) for (int gs : {32, 64, 128}) for (int M : {1, 3, 9}) for (int xdt : {0, 1, 2}) {
    int64_t N = 37, K = gs * 3;
    std::vector<uint32_t> w(N * K * bits / 32);
    for (auto& v : w) v = rng();
    int64_t G = K / gs;
    std::vector<uint16_t> s(N * G), b(N * G);
    std::uniform_real_distribution<float> U(-1, 1);
    for (auto& v : s) v = f32_to_f16(U(rng) * 0.1f);
    for (auto& v : b) v = f32_to_f16(U(rng));
    std::vector<float> xf(M * K); for (auto& v : xf) v = U(rng);
    std::vector<uint16_t> xh(M * K);
    for (int64_t i = 0; i < M * K; ++i) xh[i] = xdt == 1 ? f32_to_f16(xf[i]) : f32_to_bf16(xf[i]);
    std::vector<float> o1(M * N), o2(M * N);
    Args a{};
    a.x = xdt == 0 ? (const void*)xf.data() : (const void*)xh.data();
    a.w = w.data(); a.scales = s.data(); a.biases = b.data();
    a.M = M; a.N = N; a.K = K; a.group_size = gs; a.bits = bits;
    a.x_dtype = (DType)xdt; a.s_dtype = F16;
    std::vector<uint16_t> h1(M * N), h2(M * N);
    a.out = xdt == 0 ? (void*)o1.data() : (void*)h1.data(); run_neon(a);
    a.out = xdt == 0 ? (void*)o2.data() : (void*)h2.data(); run_portable(a);
    double worst = 0;
    for (int64_t i = 0; i < M * N; ++i) {
      float u = xdt == 0 ? o1[i] : load_f32(h1.data(), (DType)xdt, i);
      float v = xdt == 0 ? o2[i] : load_f32(h2.data(), (DType)xdt, i);
      worst = std::fmax(worst, std::fabs(u - v) / (1 + std::fabs(v)));
    }
    double tol = xdt == 0 ? 1e-4 : (xdt == 1 ? 2e-3 : 2e-2);
    if (!(worst <= tol)) { printf("FAIL bits=%d gs=%d M=%d xdt=%d worst=%g\n", bits, gs, M, xdt, worst); ++fails; }
  }
  printf("%s (%d failures)\n", fails ? "FAILED" : "all NEON cases match portable", fails);
  return fails != 0;
}
"""


@pytest.mark.skipif(
    not (shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64")),
    reason="needs aarch64-linux-gnu-g++ and qemu-aarch64 (cross-check of the NEON kernel)",
)
def test_neon_kernel_matches_portable_under_qemu(tmp_path):
    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "harness.cpp"
    src.write_text(NEON_HARNESS)
    exe = tmp_path / "harness"
    subprocess.run(
        ["aarch64-linux-gnu-g++", "-std=c++17", "-O2", "-static", "-DMLXFAST_ARM64=1",
         f"-I{root / 'csrc'}", str(src), str(root / "csrc/cpu/qmm_neon.cpp"),
         str(root / "csrc/cpu/qmm_portable.cpp"), "-o", str(exe)],
        check=True, capture_output=True, timeout=300,
    )
    out = subprocess.run(["qemu-aarch64", str(exe)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_env_var_forces_path():
    import os
    import sys

    code = (
        "import mlx.core as mx; from mlxfast import ops; "
        "w = mx.random.normal((40, 64)); wq, s, b = mx.quantize(w, group_size=32, bits=4); "
        "x = mx.random.normal((3, 64)); "
        "y = ops.quantized_matmul(x, wq, s, b, group_size=32, bits=4); "
        "r = mx.quantized_matmul(x, wq, s, b, group_size=32, bits=4); "
        "print(ops.cpu_path(), mx.abs(y - r).max().item())"
    )
    for name in PATHS:
        env = dict(os.environ, MLXFAST_CPU_PATH=name)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        got_path, err = out.stdout.split()
        assert got_path == name and float(err) < 1e-4


@pytest.mark.parametrize("kind", [(4, 32), (4, 128), (8, 64), (0, 0)], ids=str)
def test_gemv_rows_do_not_depend_on_their_batch(path, kind):
    """A row's output is bit-identical alone and among up to kGemvMaxRows
    others (the engine's "batching changes nothing" rests on it): every GEMV
    tile shape accumulates and reduces each (weight row, activation row) pair
    in the same order. N = 37 leaves odd tails of weight rows."""
    bits, gs = kind
    N, K = 37, 256
    x = mx.random.normal((16, K), key=mx.random.key(7))
    if bits:
        wq, s, b = make_weights(N, K, gs, bits, mx.float16)
        run = lambda v: ops.quantized_matmul(v, wq, s, b, group_size=gs, bits=bits)  # noqa: E731
    else:
        w = mx.random.normal((N, K), key=mx.random.key(8))
        run = lambda v: ops.dense_matmul(v, w)  # noqa: E731
    alone = [run(x[i:i + 1]) for i in range(16)]
    for M in range(2, 17):
        got = run(x[:M])
        for i in range(M):
            assert mx.array_equal(got[i:i + 1], alone[i]).item(), (M, i)
