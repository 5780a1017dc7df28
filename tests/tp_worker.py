"""One rank of the tensor-parallel parity run (tests/test_tp_parity.py), under
``mlx.launch -n N --backend ring -- python tests/tp_worker.py OUT.json MODEL...``.

Per model, rank 0 first computes the one-process references on an unsharded
copy (teacher-forced logits, engine greedy continuations with dense and
8-bit KV), then every rank loads the model, compares fingerprints, shards it
and runs the same through the sharded model: the teacher-forced forward on
every rank, and rank 0's engine with the other ranks as followers. Rank 0
writes what it measured to OUT.json; the test judges it.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import mlx.core as mx
import numpy as np

from mlxfast.engine import distributed as D
from mlxfast.engine.api import Request, SamplingParams, TokenEvent
from mlxfast.engine.config import EngineConfig
from mlxfast.engine.engine import Engine
from mlxfast.kv.dense import DenseKVCache
from mlxfast.models.loader import load
from mlxfast.models.shard import shard_model

N_PROMPTS, N_TOKENS = 6, 48
KV_SCHEMES = ("off", "8")


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 17, 23, 33, 40, 61)]


def teacher_forced(model, ids, prefill: int):
    """Logits [len(ids), V] (rank 0) from a prefill of ``prefill`` tokens, then one token a step."""
    cache = DenseKVCache.for_model(model)
    outs = [model(mx.array([ids[:prefill]]), cache)]
    cache.advance(prefill)
    for t in ids[prefill:]:
        outs.append(model(mx.array([[t]]), cache))
        cache.advance(1)
    mx.eval(outs)
    return np.concatenate([np.array(o[0].astype(mx.float32)) for o in outs])


def paged_logits(model, ids, kv_quant, chunk: int = 16):
    """Teacher-forced logits [len(ids), V] through PagedContext over a pool of
    the engine's scheme (dense: its float16 default; quantized: groups of 32),
    ``chunk`` tokens a call."""
    from mlxfast.kv.block_pool import KVPool, default_kv_dtype
    from mlxfast.kv.paged import PagedContext, SeqSlice
    from mlxfast.kv.schemes import parse_kv_quant

    layers = model.kv_layers
    dtype = default_kv_dtype(model.dtype) if kv_quant == "off" else model.dtype
    spec = parse_kv_quant(kv_quant, head_dim=layers[0].head_dim, dtype=dtype, group_size=32)
    bs, nb = 16, -(-len(ids) // 16)
    pool = KVPool(layers, nb * 8, bs, dtype, kv_quant=spec, release=False)
    table = list(range(nb))
    outs = []
    for start in range(0, len(ids), chunk):
        m = min(chunk, len(ids) - start)
        ctx = PagedContext(pool, [SeqSlice([table], start, m)])
        out = model(mx.array(ids[start:start + m])[:, None], ctx, logit_rows=mx.array(list(range(m))))
        mx.eval(out)
        outs.append(np.array(out.reshape(m, -1).astype(mx.float32)))
    return np.concatenate(outs)


async def _collect(engine, req, delay=0.0):
    await asyncio.sleep(delay)
    toks, fin = [], None
    async for ev in engine.submit(req):
        if isinstance(ev, TokenEvent):
            toks.append(ev.token_id)
        else:
            fin = ev
    return toks, fin


def engine_run(model, tok, kv_quant, channel=None):
    cfg = EngineConfig(num_blocks=256, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                       kv_quant=kv_quant, kv_group_size=32, tp_channel=channel)
    eng = Engine(model, tok, cfg).start()
    ps = prompts(model.args.vocab_size)
    greedy = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        async def main():
            # 6 prompts at once: 4 streams decode together (max_num_seqs), 2 wait
            return await asyncio.gather(*(_collect(eng, Request(p, greedy)) for p in ps))

        t0 = time.perf_counter()
        got = asyncio.run(main())
        seconds = time.perf_counter() - t0
        # a prefix hit: the longest prompt again, with more after it
        again = ps[-1] + [5, 6, 7]
        hit, fin = asyncio.run(_collect(eng, Request(again, SamplingParams(max_tokens=8, temperature=0.0,
                                                                            ignore_eos=True))))
        stats = eng.stats()
    finally:
        eng.shutdown()
    return {"tokens": [t for t, _ in got], "finish": [f.finish_reason for _, f in got],
            "hit_tokens": hit, "hit_cached": fin.cached_tokens, "seconds": seconds,
            "ranks": stats["ranks"], "tensor_parallel_size": stats["tensor_parallel_size"],
            "kv_scheme": stats["kv_scheme"], "error": stats["error"]}


def margin_at(model, prompt, ref, got, kv_quant):
    """Where two continuations first differ: (index, top-1 minus top-2 logit of
    the one-process model there, with the run's KV scheme)."""
    k = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b)
    logits = paged_logits(model, prompt + ref[:k], kv_quant)[-1]
    top = np.sort(logits)[::-1]
    return k, float(top[0] - top[1])


def run_model(path: str, group) -> dict | None:
    rank = group.rank()
    out = {}
    if rank == 0:
        full, tok = load(path)
        ids = prompts(full.args.vocab_size)[5][:48]
        out["ref_logits"] = teacher_forced(full, ids, 32)
        out["ref_paged"] = {k: paged_logits(full, ids, k) for k in KV_SCHEMES}
        out["ref"] = {k: engine_run(full, tok, k) for k in KV_SCHEMES}
    model, tok = load(path)
    D.check_same_model(group, model)
    info = shard_model(model, group)
    ids = prompts(info.full_args.vocab_size)[5][:48]
    tp_logits = teacher_forced(model, ids, 32)
    tp_paged = {k: paged_logits(model, ids, k) for k in KV_SCHEMES}
    if rank != 0:
        for _ in KV_SCHEMES:
            D.Follower(model, D.StepChannel(group)).run()
        return None
    out["tp"] = {k: engine_run(model, tok, k, D.StepChannel(group)) for k in KV_SCHEMES}
    ref_logits = out.pop("ref_logits")
    diff = np.abs(tp_logits - ref_logits)
    out["logits"] = {"max_abs_diff": float(diff.max()), "max_abs_logit": float(np.abs(ref_logits).max()),
                     "max_rel_diff": float((diff / (np.abs(ref_logits) + 1.0)).max()),
                     "argmax_equal": int((tp_logits.argmax(-1) == ref_logits.argmax(-1)).sum()),
                     "positions": len(ids)}
    ref_paged = out.pop("ref_paged")
    # what tensor parallelism moves a logit by, with each KV scheme (teacher-forced, paged)
    out["scheme_logit_diff"] = {k: float(np.abs(tp_paged[k] - ref_paged[k]).max()) for k in KV_SCHEMES}
    out["differences"] = {}
    for k in KV_SCHEMES:
        for i, (a, b) in enumerate(zip(out["ref"][k]["tokens"], out["tp"][k]["tokens"])):
            if a != b:
                out["differences"].setdefault(k, []).append([i, *margin_at(full, prompts(full.args.vocab_size)[i],
                                                                             a, b, k)])
    out["full_param_bytes"] = info.full_param_bytes
    return out


def logits_only(path: str | None, group) -> dict | None:
    """Teacher-forced logits only (``--logits-only``; path None: the default model)."""
    rank = group.rank()
    ref = None
    if rank == 0:
        full, _ = load(path)
        ids = prompts(full.args.vocab_size)[5][:48]
        ref = teacher_forced(full, ids, 40)
    model, _ = load(path)
    D.check_same_model(group, model)
    info = shard_model(model, group)
    ids = prompts(info.full_args.vocab_size)[5][:48]
    tp_logits = teacher_forced(model, ids, 40)
    if rank != 0:
        return None
    diff = np.abs(tp_logits - ref)
    return {"logits": {"max_abs_diff": float(diff.max()), "max_abs_logit": float(np.abs(ref).max()),
                       "max_rel_diff": float((diff / (np.abs(ref) + 1.0)).max()),
                       "argmax_equal": int((tp_logits.argmax(-1) == ref.argmax(-1)).sum()),
                       "positions": len(ids)},
            "size": info.size, "param_bytes": info.param_bytes, "full_param_bytes": info.full_param_bytes}


def main() -> int:
    out_path, paths = sys.argv[1], sys.argv[2:]
    group = D.init_group(120)
    if paths and paths[0] == "--logits-only":
        results = {p: logits_only(None if p == "default" else p, group) for p in paths[1:]}
    else:
        results = {p: run_model(p, group) for p in paths}
    if group.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
