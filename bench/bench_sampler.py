"""Sampler step cost: the pure-MLX reference vs the native ``sample_tokens``.

    .venv/bin/python bench/bench_sampler.py [--vocab 49152] [--iters 30]

Times ``engine.sampler.sample`` (one step: processing, the draw, one eval and
the host transfer) for batches of 1/4/8 rows, back to back in one process,
with the reference path patched in for "before".
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from mlxfast import ops
from mlxfast.engine.api import SamplingParams
from mlxfast.engine.sampler import SamplingState, sample

CONFIGS = {
    "greedy": dict(temperature=0.0),
    "temp 0.7": dict(temperature=0.7),
    "temp 0.7 + top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "temp 1 + top_k 40 + top_p 0.95": dict(temperature=1.0, top_k=40, top_p=0.95),
}


def logits(kind: str, R: int, V: int, rng) -> mx.array:
    x = rng.normal(size=(R, V)).astype(np.float32) * 2.0
    if kind == "peaked":  # a few likely tokens well above the rest, like an LM's
        for r in range(R):
            x[r, rng.choice(V, 20, replace=False)] += rng.uniform(4, 12, size=20)
    return mx.array(x)


def bench(fn_name: str, L: mx.array, states, iters: int) -> float:
    native = ops.sample_tokens
    if fn_name == "reference":
        ops.sample_tokens = lambda *a, stream=None, **k: ops.sample_tokens_reference(*a, **k)
    try:
        for _ in range(3):
            sample(L, states)
        t = time.perf_counter()
        for _ in range(iters):
            sample(L, states)
        return (time.perf_counter() - t) / iters * 1e3
    finally:
        ops.sample_tokens = native


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--kinds", default="flat,peaked")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"vocab {a.vocab}, ms per sample step (mean of {a.iters}), MLX threads default, "
          f"native threads {ops.num_threads()}")
    print("| logits | rows | config | reference (before) | native (after) | speedup |")
    print("| --- | --- | --- | --- | --- | --- |")
    for kind in a.kinds.split(","):
        for R in (1, 4, 8):
            L = logits(kind, R, a.vocab, rng)
            mx.eval(L)
            for name, kw in CONFIGS.items():
                states = [SamplingState.create(SamplingParams(**kw, seed=i), [1, 2], 2) for i in range(R)]
                before = bench("reference", L, states, a.iters)
                after = bench("native", L, states, a.iters)
                print(f"| {kind} | {R} | {name} | {before:.2f} | {after:.2f} | {before / after:.1f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
