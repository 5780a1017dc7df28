"""Engine benchmark: aggregate decode throughput vs concurrency, and TTFT of a
long prompt cold vs prefix-cached, from one run on one engine.

    .venv/bin/python bench/bench_engine.py [--model PATH] [--tokens 128]
        [--prompt-tokens 2000] [--concurrency 1,4,8,16] [--rounds 3] [--block-sizes]
        [--compare-async | --compare-head-choice] [--matmul-activations int8]

Targets: 8 streams >= 4x the single-stream aggregate; a cached-prefix first
token >= 20x sooner than cold. ``--block-sizes`` adds a micro-benchmark of the
native paged attention kernel per block size (decode and prefill shapes).
``--compare-async`` instead runs decode on two engines, async scheduling on
and off, alternating within each round, and reports on / off per level;
``--compare-head-choice`` likewise with the head's greedy choice
(``EngineConfig.head_choice``, ops.quantized_argmax) on and off.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import mlx.core as mx

import mlxfast
from mlxfast.engine.api import Request, SamplingParams, TokenEvent
from mlxfast.engine.config import EngineConfig
from mlxfast.engine.engine import Engine


async def timed(engine, request):
    t0 = time.perf_counter()
    stamps = []
    async for ev in engine.submit(request):
        if isinstance(ev, TokenEvent):
            stamps.append(time.perf_counter())
    return t0, stamps


def decode_throughput(engine, prompts, n_tokens):
    async def main():
        reqs = [Request(p, SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True))
                for p in prompts]
        return await asyncio.gather(*(timed(engine, r) for r in reqs))
    res = asyncio.run(main())
    # Steady state: from the moment every stream has its first token until the
    # first stream finishes; count every token emitted inside that window.
    start = max(s[0] for _, s in res)
    end = min(s[-1] for _, s in res)
    n = sum(1 for _, s in res for t in s if start < t <= end)
    if end <= start or n == 0:
        return float("nan")
    return n / (end - start)


def ttft(engine, prompt, salt):
    async def main():
        return await timed(engine, Request(prompt, SamplingParams(max_tokens=1, temperature=0),
                                           cache_salt=salt))
    t0, stamps = asyncio.run(main())
    return stamps[0] - t0


def compare(model, tok, levels, args, field):
    """Decode tok/s with an EngineConfig switch on and off, alternating engines."""
    engines = {on: Engine(model, tok, EngineConfig(
        max_num_seqs=max(levels), kv_cache_gb=0.5, block_size=args.block_size,
        kv_dtype=args.kv_dtype, **{field: on})).start() for on in (True, False)}
    rng = random.Random(0)
    vocab = model.args.vocab_size
    runs = {(on, c): [] for on in engines for c in levels}
    try:
        for _ in range(args.rounds):
            for c in levels:
                for on, e in engines.items():
                    prompts = [[rng.randrange(100, vocab) for _ in range(16 + i)] for i in range(c)]
                    runs[on, c].append(decode_throughput(e, prompts, args.tokens))
    finally:
        for e in engines.values():
            e.shutdown()
    print(f"{field}")
    print(f"{'streams':>8} {'on':>9} {'off':>7} {'on/off':>7}   (medians of {args.rounds} rounds)")
    for c in levels:
        on, off = runs[True, c], runs[False, c]
        ratio = statistics.median(a / b for a, b in zip(on, off))
        print(f"{c:>8} {statistics.median(on):>9.1f} {statistics.median(off):>7.1f} {ratio:>7.3f}   "
              f"per round on/off: {', '.join(f'{a / b:.2f}' for a, b in zip(on, off))}")


def bench_block_sizes(args_model):
    from mlxfast import ops
    a = args_model
    Hq, Hkv, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    print("\nnative paged attention per layer call (ms), fp32, "
          f"Hq={Hq} Hkv={Hkv} D={D}")
    print(f"{'block':>6} {'decode 8x2000':>14} {'prefill 512@1500':>17}")
    for bs in (8, 16, 32, 64):
        ctx = 2048
        nb = 8 * ctx // bs + 64
        kp = mx.random.normal((nb * bs, Hkv, D))
        vp = mx.random.normal((nb * bs, Hkv, D))
        perm = list(range(nb))
        random.Random(0).shuffle(perm)
        per = ctx // bs
        tables = mx.array([perm[i * per:(i + 1) * per] for i in range(8)], dtype=mx.int32)
        res = []
        for T, seq, pos in ((8, list(range(8)), [2000] * 8),
                            (512, [0] * 512, list(range(1500, 2012)))):
            q = mx.random.normal((T, Hq, D))
            s, p = mx.array(seq, dtype=mx.int32), mx.array(pos, dtype=mx.int32)
            mx.eval(kp, vp, q)
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                mx.eval(ops.paged_attention(q, kp, vp, tables, s, p, scale=D ** -0.5, block_size=bs))
                best = min(best, time.perf_counter() - t)
            res.append(best * 1e3)
        print(f"{bs:>6} {res[0]:>14.2f} {res[1]:>17.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=128)  # 32 was too few for a stable rate
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-sizes", action="store_true")
    ap.add_argument("--compare-async", action="store_true",
                    help="decode with async scheduling on vs off (alternating engines), then exit")
    ap.add_argument("--compare-head-choice", action="store_true",
                    help="decode with the head's greedy choice on vs off (alternating engines), then exit")
    ap.add_argument("--kv-dtype", default=None, help="float32 | float16 | bfloat16 (default: auto, kv.block_pool.default_kv_dtype)")
    ap.add_argument("--matmul-activations", choices=["fp32", "int8"], default="fp32",
                    help="int8: the opt-in int8-activation matmuls (mlxfast.load)")
    args = ap.parse_args()

    model, tok = mlxfast.load(args.model, matmul_activations=args.matmul_activations)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.compare_async or args.compare_head_choice:
        field = "async_scheduling" if args.compare_async else "head_choice"
        return compare(model, tok, levels, args, field)
    engine = Engine(model, tok, EngineConfig(max_num_seqs=max(levels), kv_cache_gb=1.0,
                                             block_size=args.block_size, kv_dtype=args.kv_dtype)).start()
    rng = random.Random(0)
    vocab = model.args.vocab_size
    try:
        print(f"model {model.args.model_type} layers={model.args.num_hidden_layers} "
              f"hidden={model.args.hidden_size}; block_size={engine.block_size}, "
              f"blocks={engine.num_blocks}, cpu path {mlxfast.ops.cpu_path()}, "
              f"matmul activations {args.matmul_activations}")
        # Rounds over all levels, so that a slow minute of this shared machine
        # lands on every level; "x single" is the median over rounds of each
        # round's ratio to that round's single-stream figure.
        runs = {c: [] for c in levels}
        for _ in range(args.rounds):
            for c in levels:
                prompts = [[rng.randrange(100, vocab) for _ in range(16 + i)] for i in range(c)]
                runs[c].append(decode_throughput(engine, prompts, args.tokens))
        base = runs[levels[0]]
        print(f"\n{'streams':>8} {'decode tok/s':>13} {'x single':>9}   (medians of {args.rounds} rounds)")
        for c in levels:
            ratio = statistics.median(t / b for t, b in zip(runs[c], base))
            print(f"{c:>8} {statistics.median(runs[c]):>13.1f} {ratio:>9.2f}   "
                  f"per round: {', '.join(f'{t:.0f}' for t in runs[c])}")

        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
        cold = ttft(engine, prompt, salt="cold")
        warm = ttft(engine, prompt, salt="cold")
        print(f"\nTTFT, {args.prompt_tokens}-token prompt: cold {cold * 1e3:.0f} ms, "
              f"prefix-cached {warm * 1e3:.1f} ms, {cold / warm:.0f}x sooner")
        st = engine.stats()
        print(f"prefix cache: {st['prefix_cache_hits_total']} of "
              f"{st['prefix_cache_queries_total']} prompt tokens hit; "
              f"preemptions {st['num_preemptions_total']}")
    finally:
        engine.shutdown()
    if args.block_sizes:
        bench_block_sizes(model.args)


if __name__ == "__main__":
    main()
