"""Benchmarks for mlxfast.ops.quantized_matmul (native CPU kernels).

Every number is reported next to a reference measured in the same run:
  Contenders are timed in alternating short batches (min per call), so a
  change in machine load hits both alike.
  GEMV (decode, M <= 8): effective GB/s (bytes of weights + scales + biases +
      x + out per call / time) vs numpy's copy bandwidth (read + write bytes
      of a large np.copyto / time, one thread) on a matrix larger than the
      L3 cache; the model's shapes are listed too (those fit in L3).
  GEMM (prefill, M >= 16): GFLOP/s (2*M*N*K / time) vs numpy fp32 matmul of
      the same shape (x @ W.T with W already dequantized) and vs
      mx.quantized_matmul.
  Dense (ops.dense_matmul, fp32/bf16 weights): GFLOP/s and weight GB/s vs
      numpy's fp32 matmul of the same values and vs MLX's matmul.

Run:  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/bench_qmm.py
      (options: --quick, --path avx512|avx2|portable)
      --cpu-time: one thread each (ours and OpenBLAS), process CPU seconds per
      call instead of wall time: per-core efficiency that stays comparable
      while other jobs share the machine (a busy machine distorts wall time).
or with pytest-benchmark:  .venv/bin/python -m pytest bench/bench_qmm.py
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

if "--cpu-time" in sys.argv:  # must precede numpy / mlxfast imports
    os.environ["MLXFAST_NUM_THREADS"] = "1"
    os.environ["OPENBLAS_NUM_THREADS"] = "1"

import mlx.core as mx
import numpy as np

from mlxfast import ops

# SmolLM2-135M (Q4_1 GGUF -> affine bits 4, group 32, fp16 scales, fp32 x).
MODEL_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]  # (N, K)
BIG_GEMV = (16384, 8192)  # 64 MiB of 4-bit weights + 16 MiB scales/biases: > L3


def make(N, K, bits=4, group_size=32, sdtype=mx.float16, seed=0):
    mx.random.seed(seed)
    w = mx.random.normal((N, K)) * 0.05
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    s, b = s.astype(sdtype), b.astype(sdtype)
    mx.eval(wq, s, b)
    return wq, s, b


def timeit(fn, rounds=5):
    return paired([fn], rounds=rounds)[0]


CLOCK = time.perf_counter


def cpu_clock():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def paired(fns, rounds=7, batch_time=0.05):
    """Min time per call of each fn, measured in alternating short batches so
    that a change in machine load hits every contender alike."""
    for f in fns:
        f()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, f in enumerate(fns):
            n = 0
            t0 = CLOCK()
            while True:
                f()
                n += 1
                el = CLOCK() - t0
                if el >= batch_time:
                    break
            best[i] = min(best[i], el / n)
    return best


def copy_fn(nbytes=256 << 20):
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    return lambda: np.copyto(b, a), 2 * nbytes


def numpy_copy_gbs(nbytes=256 << 20):
    f, moved = copy_fn(nbytes)
    return moved / timeit(f) / 1e9


def numpy_gemm_gflops(M, N, K):
    x = np.random.standard_normal((M, K)).astype(np.float32)
    w = np.random.standard_normal((N, K)).astype(np.float32)
    t = timeit(lambda: x @ w.T)
    return 2 * M * N * K / t / 1e9


def qmm_time(x, wq, s, b, bits=4, group_size=32, native=True):
    f = ops.quantized_matmul if native else mx.quantized_matmul

    def run():
        mx.eval(f(x, wq, s, b, group_size=group_size, bits=bits))

    return timeit(run)


def gemv_bytes(M, N, K, bits, wq, s, b):
    return wq.nbytes + s.nbytes + b.nbytes + 4 * M * K + 4 * M * N


def report(quick=False):
    print(f"cpu path: {ops.cpu_path()}, threads: {ops.num_threads()}")
    copy = numpy_copy_gbs()
    print(f"numpy copy bandwidth: {copy:.1f} GB/s (read+write, 1 thread; re-measured per row)")
    print("\nGEMV (bits 4, group 32, fp16 scales, fp32 x)")
    print(f"{'M':>3} {'N':>6} {'K':>5} {'us':>9} {'GB/s':>7} {'vs copy':>8} {'vs mx':>7}")
    shapes = [BIG_GEMV] + MODEL_SHAPES
    cfn, cbytes = copy_fn()
    for N, K in shapes:
        wq, s, b = make(N, K)
        for M in (1, 4, 8) if (N, K) == BIG_GEMV else (1,):
            x = mx.random.normal((M, K))
            mx.eval(x)
            t, tc = paired([lambda: mx.eval(ops.quantized_matmul(x, wq, s, b, group_size=32,
                                                                 bits=4)), cfn])
            copy_now = cbytes / tc / 1e9
            tm = qmm_time(x, wq, s, b, native=False) if not quick or M == 1 else float("nan")
            gbs = gemv_bytes(M, N, K, 4, wq, s, b) / t / 1e9
            print(f"{M:>3} {N:>6} {K:>5} {t * 1e6:>9.1f} {gbs:>7.1f} {gbs / copy_now:>7.0%} "
                  f"{tm / t:>6.1f}x   (copy {copy_now:.1f} GB/s)")
    print("\nGEMM (bits 4, group 32, fp16 scales, fp32 x)")
    print(f"{'M':>5} {'N':>6} {'K':>5} {'ms':>8} {'GFLOP/s':>8} {'numpy':>7} {'vs np':>6} {'vs mx':>7}")
    Ms = (512,) if quick else (16, 64, 512, 2048)
    gemm_shapes = MODEL_SHAPES[:4] if quick else MODEL_SHAPES
    for N, K in gemm_shapes:
        wq, s, b = make(N, K)
        for M in Ms:
            if N * M > 49152 * 512:
                continue
            x = mx.random.normal((M, K))
            mx.eval(x)
            xn = np.array(x)
            wn = np.random.standard_normal((N, K)).astype(np.float32)
            t, tn = paired([lambda: mx.eval(ops.quantized_matmul(x, wq, s, b, group_size=32,
                                                                 bits=4)), lambda: xn @ wn.T])
            gf = 2 * M * N * K / t / 1e9
            npf = 2 * M * N * K / tn / 1e9
            tm = qmm_time(x, wq, s, b, native=False) if M <= 512 else float("nan")
            print(f"{M:>5} {N:>6} {K:>5} {t * 1e3:>8.2f} {gf:>8.1f} {npf:>7.1f} "
                  f"{gf / npf:>5.0%} {tm / t:>6.1f}x")

    print("\nDense weights (ops.dense_matmul; MLX's CPU matmul is its reference BLAS)")
    print(f"{'M':>5} {'N':>6} {'K':>5} {'dtype':>9} {'ms':>8} {'GFLOP/s':>8} {'GB/s':>6} "
          f"{'numpy':>7} {'vs np':>6} {'vs mx':>7}")
    for M, N, K in ((1, 4096, 4096), (8, 4096, 4096), (512, 1536, 576)):
        for dt in (mx.float32, mx.bfloat16):
            w = (mx.random.normal((N, K)) * 0.05).astype(dt)
            x = mx.random.normal((M, K))
            mx.eval(w, x)
            xn = np.array(x)
            wn = np.array(w.astype(mx.float32))
            t, tn = paired([lambda: mx.eval(ops.dense_matmul(x, w)), lambda: xn @ wn.T])
            tm = timeit(lambda: mx.eval(ops.dense_matmul_reference(x, w)), rounds=1)
            flops = 2 * M * N * K
            print(f"{M:>5} {N:>6} {K:>5} {str(dt).split('.')[-1]:>9} {t * 1e3:>8.2f} "
                  f"{flops / t / 1e9:>8.1f} {w.nbytes / t / 1e9:>6.1f} {flops / tn / 1e9:>7.1f} "
                  f"{tn / t:>5.0%} {tm / t:>6.1f}x")


# ------------------------------------------------------- pytest-benchmark --

def _bench(benchmark, M, N, K):
    wq, s, b = make(N, K)
    x = mx.random.normal((M, K))
    mx.eval(x)
    benchmark(lambda: mx.eval(ops.quantized_matmul(x, wq, s, b, group_size=32, bits=4)))


def test_bench_gemv_big(benchmark):
    _bench(benchmark, 1, *BIG_GEMV)


def test_bench_gemv_head(benchmark):
    _bench(benchmark, 1, 49152, 576)


def test_bench_gemm_mlp(benchmark):
    _bench(benchmark, 512, 1536, 576)


def test_bench_dense_gemv_bf16(benchmark):
    w = (mx.random.normal((4096, 4096)) * 0.05).astype(mx.bfloat16)
    x = mx.random.normal((1, 4096))
    mx.eval(w, x)
    benchmark(lambda: mx.eval(ops.dense_matmul(x, w)))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--path", default="")
    ap.add_argument("--cpu-time", action="store_true")
    args = ap.parse_args()
    if args.cpu_time:
        CLOCK = cpu_clock
        print("single thread, process CPU time per call")
    if args.path:
        ops.set_cpu_path(args.path)
    report(quick=args.quick)
