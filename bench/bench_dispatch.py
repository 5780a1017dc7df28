"""Fixed cost of one native op: MLX's dispatch plus our thread pool's hand-off.

    .venv/bin/python bench/bench_dispatch.py [--ops 215] [--repeats 20]

Evaluates batches of independent tiny ``quantized_matmul`` calls (a 4-bit
32 x 64 weight, one row: no real work) and reports microseconds per op, best
and median over the repeats, once with ``MLXFAST_NUM_THREADS=1`` and once
with the default pool, each in its own process (the pool is sized at start).
The difference is what fanning a job out to the pool costs; a decode step of
the default model is ~215 primitives.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def measure(n_ops: int, repeats: int) -> tuple[float, float]:
    import mlx.core as mx

    from mlxfast import ops

    w = mx.random.normal((32, 64), key=mx.random.key(0))
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    x = mx.random.normal((1, 64), key=mx.random.key(1))
    mx.eval(wq, s, b, x)
    times = []
    for _ in range(repeats):
        outs = [ops.quantized_matmul(x, wq, s, b, group_size=32, bits=4) for _ in range(n_ops)]
        t = time.perf_counter()
        mx.eval(outs)
        times.append((time.perf_counter() - t) / n_ops * 1e6)
    return min(times), statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=215)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        best, med = measure(args.ops, args.repeats)
        print(f"{best:.2f} {med:.2f}")
        return
    print(f"{'threads':>8} {'best us/op':>11} {'median us/op':>13}")
    for threads in ("1", None):
        env = dict(os.environ)
        env.pop("MLXFAST_NUM_THREADS", None)
        if threads:
            env["MLXFAST_NUM_THREADS"] = threads
        out = subprocess.run([sys.executable, __file__, "--child", "--ops", str(args.ops),
                              "--repeats", str(args.repeats)],
                             env=env, capture_output=True, text=True, check=True).stdout.split()
        label = threads or f"pool ({os.cpu_count()})"
        print(f"{label:>8} {float(out[0]):>11.2f} {float(out[1]):>13.2f}")


if __name__ == "__main__":
    main()
