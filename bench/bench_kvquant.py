"""Quantized-KV benchmark on the default model: single-stream
decode tok/s at 1,000 / 4,000 / 8,000 tokens of context and the KV bytes per
token of each scheme, prefill tok/s of each context's new tokens, aggregate decode tok/s of ``--streams`` concurrent
streams (8 by default) at the longest context, then perplexity per scheme
over the test document.

    .venv/bin/python bench/bench_kvquant.py [--model PATH] [--contexts 1000,4000,8000]
        [--schemes off,8,4,turbo:k8v4,turbo] [--decode 24] [--streams 8] [--rounds 3]
        [--no-ppl] [--kernel]

Every scheme's engine stays up and the decode runs alternate schemes round by
round (prefill once: later rounds hit the prefix cache); medians and the
per-round ratios are reported.

Targets (8,000 tokens, 1 and 8 streams): ``8`` decodes >= 1.3x faster than
``off``; ``turbo`` (k8v3) at least as fast as ``off``; k8v3 KV >= 2.5x
smaller than fp16 KV.
``--kernel`` adds a per-layer attention micro-benchmark (decode and a
512-token prefill chunk: fused kernel vs dequantize + dense kernel).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlxfast
from mlxfast.engine.api import Request, SamplingParams, TokenEvent
from mlxfast.engine.config import EngineConfig
from mlxfast.engine.engine import Engine
from mlxfast.kv.block_pool import KVPool
from mlxfast.kv.paged import PagedContext, SeqSlice
from mlxfast.kv.schemes import parse_kv_quant

DOC = Path(__file__).resolve().parents[1] / "tests" / "data" / "gpl-3.0.txt"


def decode_rate(engine, prompt, n):
    """(decode tok/s: median inter-token, seconds to the first token)."""
    async def main():
        stamps = [time.perf_counter()]
        req = Request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        async for ev in engine.submit(req):
            if isinstance(ev, TokenEvent):
                stamps.append(time.perf_counter())
        return stamps
    s = asyncio.run(main())
    gaps = np.diff(s[2:])  # skip the first token (prefill)
    return 1.0 / float(np.median(gaps)), s[1] - s[0]


def aggregate_rate(engine, prompts, n):
    """Decode tok/s of len(prompts) concurrent streams: tokens emitted while
    every stream is decoding (after the last one's first token, before the
    first one's last) over that time."""
    async def one(prompt, stamps, n_tokens):
        req = Request(prompt, SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True))
        async for ev in engine.submit(req):
            if isinstance(ev, TokenEvent):
                stamps.append(time.perf_counter())

    async def main(n_tokens):
        stamps = [[] for _ in prompts]
        await asyncio.gather(*(one(p, st, n_tokens) for p, st in zip(prompts, stamps)))
        return stamps
    # Prefill every prompt first (one token each; their blocks stay in the
    # prefix cache), so the measured run starts all streams decoding together.
    asyncio.run(main(1))
    stamps = asyncio.run(main(n))
    t0, t1 = max(st[0] for st in stamps), min(st[-1] for st in stamps)
    k = sum(sum(1 for t in st if t0 < t <= t1) for st in stamps)
    return k / (t1 - t0)


def perplexity(model, tokens, kv_quant, chunk=512, bs=16):
    a = model.args
    n = len(tokens)
    pool = KVPool(model.kv_layers, -(-n // bs), bs, model.dtype, kv_quant=kv_quant, release=False)
    table = list(range(pool.num_blocks))
    nll = 0.0
    for start in range(0, n - 1, chunk):
        m = min(chunk, n - 1 - start)
        ctx = PagedContext(pool, [SeqSlice([table], start, m)])
        logits = model(mx.array(tokens[start:start + m], dtype=mx.int32).reshape(-1, 1), ctx)
        logits = logits.reshape(m, -1).astype(mx.float32)
        tgt = mx.array(tokens[start + 1:start + m + 1])
        nll += float((mx.logsumexp(logits, -1) - mx.take_along_axis(logits, tgt[:, None], -1)[:, 0]).sum())
    return float(np.exp(nll / (n - 1)))


def kernel_bench(args_model):
    from mlxfast import ops
    a = args_model
    Hq, Hkv, D, bs = a.num_attention_heads, a.num_key_value_heads, a.head_dim, 16
    print(f"\nper-layer attention (ms), Hq={Hq} Hkv={Hkv} D={D} bs={bs}, cpu path {ops.cpu_path()}")
    print(f"{'scheme':>11} {'decode@8000':>12} {'prefill512@4000 fused':>22} {'dequant+dense':>14}")
    ctx = 8000
    nb = ctx // bs + 40
    kp, vp = mx.random.normal((nb * bs, Hkv, D)), mx.random.normal((nb * bs, Hkv, D))
    tables = mx.array([list(range(nb))], dtype=mx.int32)

    def best(f, n=7):
        t = float("inf")
        for _ in range(n):
            t0 = time.perf_counter()
            mx.eval(f())
            t = min(t, time.perf_counter() - t0)
        return t * 1e3

    q1, s1, p1 = mx.random.normal((1, Hq, D)), mx.zeros((1,), mx.int32), mx.array([ctx - 1], mx.int32)
    qp = mx.random.normal((512, Hq, D))
    sp, pp = mx.zeros((512,), mx.int32), mx.arange(3584, 4096, dtype=mx.int32)
    for q in ("off", "8", "4", "turbo:k8v4", "turbo"):
        spec = parse_kv_quant(q, head_dim=D)
        if spec.kind == "dense":
            # the default dense KV dtype for GGUF weights on the CPU
            kh, vh = kp.astype(mx.float16), vp.astype(mx.float16)
            f1 = lambda: ops.paged_attention(q1, kh, vh, tables, s1, p1, scale=D ** -0.5, block_size=bs)
            f2 = lambda: ops.paged_attention(qp, kh, vh, tables, sp, pp, scale=D ** -0.5, block_size=bs)
            print(f"{q:>11} {best(f1):>12.3f} {best(f2):>22.3f} {'':>14}")
            continue
        sg = mx.array(np.where(np.arange(D) % 3, 1.0, -1.0).astype(np.float32))
        packed = ops.kv_quant_encode(kp, vp, spec.fmt, sg)
        mx.eval(packed)
        kw = dict(scale=D ** -0.5, block_size=bs, fmt=spec.fmt, signs=sg)
        f1 = lambda: ops.kv_quant_paged_attention(q1, packed, tables, s1, p1, **kw)
        f2 = lambda: ops.kv_quant_paged_attention(qp, packed, tables, sp, pp, **kw)
        nb4 = 4096 // bs
        t4 = tables[:, :nb4]

        def f3():
            rows = packed[: nb4 * bs]
            k, v = ops.kv_quant_dequant(rows, spec.fmt, sg)
            return ops.paged_attention(qp, k, v, t4, sp, pp, scale=D ** -0.5, block_size=bs)
        print(f"{q:>11} {best(f1):>12.3f} {best(f2):>22.3f} {best(f3):>14.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--contexts", default="1000,4000,8000")
    ap.add_argument("--schemes", default="off,8,4,turbo:k8v4,turbo")
    ap.add_argument("--decode", type=int, default=24)
    ap.add_argument("--streams", type=int, default=8, help="0: skip the concurrent run")
    ap.add_argument("--ppl-tokens", type=int, default=6144)
    ap.add_argument("--no-ppl", action="store_true")
    ap.add_argument("--kernel", action="store_true")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating rounds of every scheme's decode runs (medians reported)")
    args = ap.parse_args()

    model, tok = mlxfast.load(args.model)
    a = model.args
    contexts = [int(c) for c in args.contexts.split(",")]
    schemes = args.schemes.split(",")
    rng = random.Random(0)
    longest = [rng.randrange(100, a.vocab_size) for _ in range(max(contexts))]
    fp16 = parse_kv_quant("off", head_dim=a.head_dim, dtype=mx.float16).bytes_per_token(
        model.kv_layers)
    print(f"default model: layers={a.num_hidden_layers} kv_heads={a.num_key_value_heads} "
          f"head_dim={a.head_dim} dtype={model.dtype}; cpu path {mlxfast.ops.cpu_path()}, "
          f"{mlxfast.ops.num_threads()} threads")
    results, multi, prefill = {}, {}, {}
    # the concurrent streams: distinct prompts (no shared prefix blocks)
    many = [[rng.randrange(100, a.vocab_size) for _ in range(max(contexts))]
            for _ in range(args.streams)]
    streams_decode = 4 * args.decode
    need_gb = (args.streams + 1) * (max(contexts) + streams_decode + 16) * fp16 / 1e9
    # One engine per scheme, all alive: rounds alternate schemes (the machine's
    # noise moves a lone run by 10-25%); after the first round every prompt is
    # a prefix-cache hit, so a round costs only its decode.
    engines = {}
    rates = {q: [] for q in schemes}  # per round: [tok/s per context]
    multis = {q: [] for q in schemes}
    try:
        for q in schemes:
            engines[q] = Engine(model, tok, EngineConfig(
                kv_quant=q, max_num_seqs=max(4, args.streams), kv_cache_gb=max(1.5, 1.2 * need_gb),
                max_model_len=max(contexts) + streams_decode + 8)).start()
        for rnd in range(args.rounds):
            for q, eng in engines.items():
                # prompts are prefixes of one another: each longer one reuses the
                # shorter one's cached blocks, so only the new part is prefilled
                runs = [decode_rate(eng, longest[:c], args.decode) for c in contexts]
                rates[q].append([r for r, _ in runs])
                if rnd == 0:
                    prefill[q] = [t for _, t in runs]
                if args.streams:
                    multis[q].append(aggregate_rate(eng, many, streams_decode))
                print(f"  round {rnd + 1} {q}: " + " ".join(f"{r:.1f}" for r in rates[q][-1]) +
                      (f"; {args.streams} streams {multis[q][-1]:.1f}" if args.streams else ""),
                      flush=True)
        for q, eng in engines.items():
            results[q] = (eng.stats()["kv_scheme"], eng.kv_bytes_per_token,
                          [float(np.median(c)) for c in zip(*rates[q])])
            if args.streams:
                multi[q] = float(np.median(multis[q]))
    finally:
        for eng in engines.values():
            eng.shutdown()
    off = results.get("off")
    print(f"\nsingle-stream decode tok/s (median inter-token; median of {args.rounds} alternating rounds)")
    head = "".join(f"{'@' + str(c):>9}" for c in contexts)
    print(f"{'scheme':>11} {'id':>15} {'B/token':>8} {'vs fp16':>8}{head}" +
          ("".join(f"{'x off@' + str(c):>11}" for c in contexts) if off else ""))
    for q, (sid, bpt, med) in results.items():
        line = f"{q:>11} {sid:>15} {bpt:>8} {fp16 / bpt:>7.2f}x" + "".join(f"{r:>9.1f}" for r in med)
        if off:
            line += "".join(f"{r / o:>11.2f}" for r, o in zip(med, off[2]))
        print(line)
    if off and args.rounds > 1:
        print(f"per-round x off@{contexts[-1]}: " + "; ".join(
            f"{q} " + " ".join(f"{r[-1] / o[-1]:.2f}" for r, o in zip(rates[q], rates["off"]))
            for q in schemes if q != "off"))

    # each context's prompt extends the previous one (its blocks are cached):
    # its prefill covers the new tokens only, at the keys before them
    new = [c - p for c, p in zip(contexts, [0] + contexts[:-1])]
    span = "".join(f"{f'{p}-{c}':>11}" for c, p in zip(contexts, [0] + contexts[:-1]))
    print(f"\nprefill tok/s of each context's new tokens (first-token time), one run")
    print(f"{'scheme':>11}{span}" + (f"{'x off':>8}" * len(contexts) if off else ""))
    for q, ts in prefill.items():
        line = f"{q:>11}" + "".join(f"{n / t:>11.1f}" for n, t in zip(new, ts))
        if off:
            line += "".join(f"{to / t:>8.2f}" for t, to in zip(ts, prefill["off"]))
        print(line)

    if multi:
        print(f"\n{args.streams} concurrent streams at {max(contexts)} tokens of context: "
              f"aggregate decode tok/s, median of {args.rounds} alternating rounds")
        for q, r in multi.items():
            print(f"{q:>11} {r:9.1f}" + (f"  {r / multi['off']:.2f}x off; per round " + " ".join(
                f"{x / y:.2f}" for x, y in zip(multis[q], multis["off"])) if "off" in multi else ""))

    if args.kernel:
        kernel_bench(a)
    if not args.no_ppl:
        toks = tok.encode(DOC.read_text())[:args.ppl_tokens]
        print(f"\nperplexity, {len(toks)} tokens of {DOC.name}, 512-token chunks")
        base = None
        for q in schemes:
            t0 = time.perf_counter()
            p = perplexity(model, toks, q)
            base = base or p
            print(f"{q:>11} {p:9.4f} {100 * (p / base - 1):+7.2f}%  ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
