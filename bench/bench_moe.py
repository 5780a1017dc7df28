"""MoE decode: mlxfast against llama.cpp on one random-weight Q4_0 GGUF with a
Qwen3-30B-A3B-like layout scaled to fit memory (128 experts, top 8, the
same proportions of widths; a tiny vocabulary).

    .venv/bin/python bench/bench_moe.py [--layers 16] [--hidden 1024] [--decode 128]
        [--rounds 3] [--streams 1 8] [--keep FILE.gguf]
        [--matmul-activations int8]   # also mlxfast with int8 activations, same rounds

Reports, for mlxfast at 1 and 8 streams (the engine, every stream's tokens
in one step) and the library's one-sequence path, and llama.cpp
(llama-cpp-python, in-process, one sequence): decode tok/s, sampling at
temperature 1 (a random model's greedy tokens repeat, and identical tokens
would share their experts unrealistically), medians of alternating
rounds, each engine in its own process; the bytes a token
needs (its 8 experts in every layer plus the dense weights) and the bytes
a step actually reads per token (each distinct expert of the step once, the
dense weights once per step: the routing is recorded on the same model
with uniformly random tokens, what it samples), and decode as a share of the bandwidth limit for the bytes read
(numpy's copy bandwidth, read + write bytes per second, as bench_qmm.py).
Targets (issue #21): 1 stream >= 1.0x llama.cpp, >= 50% of the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # tiny_gguf's byte-level vocabulary

# Qwen3-30B-A3B: hidden 2048, 48 layers, 32 q / 4 kv heads of 128, experts
# 128 x 768, top 8. Scaled: widths / 2 (heads / 2), layers as memory allows.
LAYOUT = dict(experts=128, top_k=8, head_dim=128)


def layout(args) -> dict:
    d = args.hidden
    return dict(LAYOUT, hidden=d, layers=args.layers, heads=d // 64, kv_heads=max(1, d // 512),
                moe_ff=d * 3 // 8, ff=d * 3)


def write_gguf(path: Path, L: dict, seed: int = 0) -> None:
    """Random Q4_0 weights (valid blocks, scales ~ 1/sqrt(fan-in)), F32
    norms and router, the tiny chat vocabulary of the tests."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from tiny_gguf import BOS, CHAT_SPECIALS, EOS, PAD, chat_vocab

    rng = np.random.default_rng(seed)
    tokens = chat_vocab()
    D, H, Hkv, hd, E, F = L["hidden"], L["heads"], L["kv_heads"], L["head_dim"], L["experts"], L["moe_ff"]
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(CHAT_SPECIALS) + [1] * (len(tokens) - len(CHAT_SPECIALS)))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_pad_token_id(PAD)
    w.add_add_bos_token(False)
    w.add_block_count(L["layers"])
    w.add_context_length(4096)
    w.add_embedding_length(D)
    w.add_feed_forward_length(L["ff"])
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_expert_count(E)
    w.add_expert_used_count(L["top_k"])
    w.add_expert_feed_forward_length(F)
    w.add_vocab_size(len(tokens))

    def q4_0(*shape):  # random Q4_0 blocks: fp16 d, then 16 bytes of nibbles
        *lead, k = shape
        blocks = np.empty((*lead, k // 32, 18), np.uint8)
        d = (rng.uniform(0.5, 1.5, (*lead, k // 32)) * 0.55 / np.sqrt(k)).astype(np.float16)
        blocks[..., :2] = d.view(np.uint8).reshape(*lead, k // 32, 2)
        # codes 1..15 (weights d * (q - 8), mean 0): codes 0..15 would give every
        # weight a mean of -d/2, every hidden state a shared component, and
        # every token the same experts
        q = rng.integers(1, 16, (*lead, k // 32, 2, 16), dtype=np.uint8)
        blocks[..., 2:] = q[..., 0, :] | (q[..., 1, :] << 4)
        return blocks.reshape(*lead, -1)

    def add(name, arr, raw=False):
        w.add_tensor(name, arr, raw_dtype=Q.Q4_0) if raw else w.add_tensor(name, arr)

    ones = np.ones(D, np.float32)
    add("token_embd.weight", q4_0(len(tokens), D), raw=True)
    add("output_norm.weight", ones)
    add("output.weight", q4_0(len(tokens), D), raw=True)
    for i in range(L["layers"]):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", ones)
        add(p + "attn_q.weight", q4_0(H * hd, D), raw=True)
        add(p + "attn_k.weight", q4_0(Hkv * hd, D), raw=True)
        add(p + "attn_v.weight", q4_0(Hkv * hd, D), raw=True)
        add(p + "attn_output.weight", q4_0(D, H * hd), raw=True)
        add(p + "attn_q_norm.weight", np.ones(hd, np.float32))
        add(p + "attn_k_norm.weight", np.ones(hd, np.float32))
        add(p + "ffn_norm.weight", ones)
        add(p + "ffn_gate_inp.weight", rng.normal(0, 1 / np.sqrt(D), (E, D)).astype(np.float32))
        add(p + "ffn_gate_exps.weight", q4_0(E, F, D), raw=True)
        add(p + "ffn_up_exps.weight", q4_0(E, F, D), raw=True)
        add(p + "ffn_down_exps.weight", q4_0(E, D, F), raw=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def prompts(n: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(8, vocab, size=length).tolist() for _ in range(n)]


# ------------------------------------------------------------------ mlxfast

def bench_mlxfast(path, n_decode: int, streams: list[int], activations: str = "fp32") -> dict:
    import asyncio

    import mlxfast
    from mlxfast.engine.api import Request, SamplingParams, TokenEvent
    from mlxfast.engine.config import EngineConfig
    from mlxfast.engine.engine import Engine
    from mlxfast.generation import stream_generate

    model, tok = mlxfast.load(path, matmul_activations=activations)
    vocab = model.args.vocab_size
    out = {}
    ids = prompts(1, 32, vocab)[0]
    list(stream_generate(model, tok, ids, max_tokens=8, temp=1.0, seed=0))  # warm-up
    first, n = None, 0
    for _ in stream_generate(model, tok, ids, max_tokens=n_decode, temp=1.0, seed=0):
        n += 1
        if first is None:
            first = time.perf_counter()
    out["library_1"] = (n - 1) / (time.perf_counter() - first)

    eng = Engine(model, tok, EngineConfig(max_num_seqs=max(streams), kv_cache_gb=0.5)).start()
    try:
        async def timed(req):
            stamps = []
            async for ev in eng.submit(req):
                if isinstance(ev, TokenEvent):
                    stamps.append(time.perf_counter())
            return stamps

        def run(ps, n_tok):
            async def main():
                reqs = [Request(p, SamplingParams(max_tokens=n_tok, temperature=1.0, seed=i,
                                                  ignore_eos=True)) for i, p in enumerate(ps)]
                return await asyncio.gather(*(timed(r) for r in reqs))
            return asyncio.run(main())

        run(prompts(max(streams), 32, vocab, seed=9), 4)  # warm-up
        for s in streams:
            res = run(prompts(s, 32, vocab, seed=s), n_decode)
            # steady state: every stream has its first token until the first one ends
            start, end = max(r[0] for r in res), min(r[-1] for r in res)
            count = sum(1 for r in res for t in r if start < t <= end)
            out[f"engine_{s}"] = count / (end - start)
    finally:
        eng.shutdown()
    return out


def routing_bytes(path, streams: list[int], steps: int = 16) -> dict:
    """Bytes per token a decode step reads: the dense weights once per step,
    each distinct expert of each layer once (recorded from the routing of
    `steps` decode steps of `s` sequences), against what one token needs."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import mlxfast
    from mlxfast import ops
    from mlxfast.kv import DenseKVCache

    model, _ = mlxfast.load(path)
    a = model.args
    params = dict(tree_flatten(model.parameters()))
    expert = sum(v.nbytes for k, v in params.items() if ".switch_mlp." in k)
    expert //= a.num_experts * sum(1 for k in params if k.endswith("switch_mlp.gate_proj.weight"))
    embed = sum(v.nbytes for k, v in params.items() if k.startswith("model.embed_tokens"))
    dense = sum(v.nbytes for k, v in params.items() if ".switch_mlp." not in k) - embed
    dense += embed // a.vocab_size  # one embedding row per token
    n_moe = sum(1 for k in params if k.endswith("switch_mlp.gate_proj.weight"))
    seen = []
    real = ops.moe_experts

    def spy(x, inds, *rest, **kw):
        seen.append(inds)
        return real(x, inds, *rest, **kw)

    out = {"expert_bytes": expert, "dense_bytes": dense,
           "active_bytes_per_token": dense + n_moe * a.num_experts_per_tok * expert}
    ops.moe_experts = spy
    try:
        for s in streams:
            ps = prompts(s, 32, a.vocab_size, seed=s)
            cache = DenseKVCache.for_model(model)
            logits = model(mx.array(ps), cache)
            cache.advance(32)
            distinct = []
            rng = np.random.default_rng(s)
            for _ in range(steps):  # sampled tokens of a random model: uniform ones
                nxt = mx.array(rng.integers(8, a.vocab_size, size=(s, 1)))
                seen.clear()
                logits = model(nxt, cache)
                mx.eval(logits, *seen)
                cache.advance(1)
                distinct.append(sum(len(np.unique(np.array(i))) for i in seen))
            out[f"read_bytes_per_token_{s}"] = (dense + np.mean(distinct) * expert) / s
            out[f"distinct_experts_per_layer_{s}"] = float(np.mean(distinct)) / n_moe
    finally:
        ops.moe_experts = real
    return out


# ---------------------------------------------------------------- llama.cpp

def bench_llama_cpp(path, n_decode: int, streams: list[int]) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(path), n_ctx=1024, n_threads=os.cpu_count(), n_batch=512,
                verbose=False)
    ids = prompts(1, 32, llm.n_vocab())[0]
    for _ in zip(range(8), llm.generate(ids, temp=1.0, reset=True)):
        pass  # warm-up
    n, t0 = 0, None
    for _ in llm.generate(ids, temp=1.0, reset=True):
        n += 1
        if n == 1:
            t0 = time.perf_counter()
        if n >= n_decode:
            break
    out = {"library_1": (n - 1) / (time.perf_counter() - t0)}
    del llm
    for s in streams:
        out[f"batched_{s}"] = bench_llama_cpp_batched(path, n_decode, s)
    return out


def bench_llama_cpp_batched(path, n_decode: int, streams: int) -> float:
    """llama.cpp decoding `streams` sequences in one batch per step (its own
    batched-decode API, as its server runs them); tokens sampled at
    temperature 1 from its logits in numpy. Aggregate tok/s."""
    import llama_cpp as L

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_seq_max = 4096, 512, streams
    cp.n_threads = cp.n_threads_batch = os.cpu_count()
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(max(512, streams), 0, streams)
    rng = np.random.default_rng(0)

    def decode(items):  # [(token, pos, seq, wants_logits)]
        batch.n_tokens = len(items)
        for i, (t, p, sq, out) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, p, 1
            batch.seq_id[i][0] = sq
            batch.logits[i] = out
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def sample(i):
        z = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,)).astype(np.float64)
        p = np.exp(z - z.max())
        return int(rng.choice(vocab, p=p / p.sum()))

    ps = prompts(streams, 32, vocab, seed=streams)
    items = [(t, j, sq, j == 31) for sq, pr in enumerate(ps) for j, t in enumerate(pr)]
    decode(items)
    last = [sample(32 * sq + 31) for sq in range(streams)]
    t0 = None
    for step in range(n_decode):
        if step == 1:
            t0 = time.perf_counter()
        decode([(last[sq], 32 + step, sq, True) for sq in range(streams)])
        last = [sample(sq) for sq in range(streams)]
    rate = streams * (n_decode - 1) / (time.perf_counter() - t0)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return rate


def copy_gbs(nbytes: int = 256 << 20) -> float:
    """numpy's copy bandwidth, read + write bytes per second (one thread)."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--keep", default=None, help="write (or reuse) the GGUF here")
    ap.add_argument("--matmul-activations", choices=["fp32", "int8"], default="fp32",
                    help="int8: also run mlxfast with int8 activations (alternating rounds)")
    ap.add_argument("--one-round", choices=["mlxfast", "llama.cpp", "bytes"], help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.one_round:  # child: one engine, one round, JSON on the last line
        fn = {"mlxfast": lambda: bench_mlxfast(args.model, args.decode, args.streams,
                                               args.matmul_activations),
              "llama.cpp": lambda: bench_llama_cpp(args.model, args.decode, args.streams),
              "bytes": lambda: routing_bytes(args.model, args.streams)}[args.one_round]
        print(json.dumps(fn()))
        return

    L = layout(args)
    tmp = None
    if args.keep:
        path = Path(args.keep)
    else:
        tmp = tempfile.TemporaryDirectory()
        path = Path(tmp.name) / "moe.gguf"
    if not path.exists():
        t0 = time.perf_counter()
        write_gguf(path, L)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")
    print("layout:", json.dumps(L))

    def child(kind, activations="fp32"):
        cmd = [sys.executable, __file__, "--one-round", kind, "--model", str(path), "--decode",
               str(args.decode), "--streams", *map(str, args.streams),
               "--matmul-activations", activations]
        res = subprocess.run(cmd, check=True, capture_output=True, text=True)
        return json.loads(res.stdout.strip().splitlines()[-1])

    engines = {"mlxfast": ("mlxfast", "fp32"), "llama.cpp": ("llama.cpp", "fp32")}
    if args.matmul_activations == "int8":
        engines["mlxfast int8"] = ("mlxfast", "int8")
    rounds = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, (kind, act) in engines.items():
            r = child(kind, act)
            if r is not None:
                rounds[name].append(r)
    nbytes = child("bytes")
    bw = copy_gbs()

    ours = {name: {k: statistics.median(r[k] for r in rounds[name]) for k in rounds[name][0]}
            for name in engines if name.startswith("mlxfast")}
    print(f"\ncopy bandwidth {bw:.1f} GB/s (numpy, read + write); rounds {args.rounds}, "
          f"{args.decode} tokens each; medians")
    print(f"expert {nbytes['expert_bytes'] / 2**20:.2f} MiB, dense weights "
          f"{nbytes['dense_bytes'] / 2**20:.1f} MiB; a token needs "
          f"{nbytes['active_bytes_per_token'] / 2**20:.1f} MiB")
    print(f"{'':<22}{'tok/s':>9}{'MiB read/tok':>14}{'limit tok/s':>13}{'share':>8}")
    for s in args.streams:
        read = nbytes[f"read_bytes_per_token_{s}"]
        limit = bw * 1e9 / read  # aggregate tok/s if every byte moved at copy speed
        for name, rows in ours.items():
            for key in (f"engine_{s}",) + (("library_1",) if s == 1 else ()):
                tps = rows[key]
                label = f"{name} {key}"
                print(f"{label:<22}{tps:>9.1f}{read / 2**20:>14.1f}{limit:>13.1f}{tps / limit:>8.0%}")
        print(f"{'':<22}(distinct experts per layer and step: "
              f"{nbytes[f'distinct_experts_per_layer_{s}']:.1f} of {L['experts']})")
    if rounds["llama.cpp"]:
        cpp_rows = {k: statistics.median(r[k] for r in rounds["llama.cpp"]) for k in rounds["llama.cpp"][0]}
        for key, cpp in cpp_rows.items():
            s = int(key.rsplit("_", 1)[1])
            read = nbytes[f"read_bytes_per_token_{s}"]
            print(f"{'llama.cpp ' + key:<22}{cpp:>9.1f}{'':>14}{bw * 1e9 / read:>13.1f}"
                  f"{cpp / (bw * 1e9 / read):>8.0%}")
        for name in ours:
            for s in args.streams:
                if s > 1:
                    per = [a[f"engine_{s}"] / b[f"batched_{s}"]
                           for a, b in zip(rounds[name], rounds["llama.cpp"])]
                    print(f"{name}, {s} streams vs llama.cpp batched: {statistics.median(per):.2f}x "
                          f"(rounds {', '.join(f'{v:.2f}' for v in per)})")
            per = [a["library_1"] / b["library_1"] for a, b in zip(rounds[name], rounds["llama.cpp"])]
            per_e = [a["engine_1"] / b["library_1"] for a, b in zip(rounds[name], rounds["llama.cpp"])]
            print(f"{name}, 1 stream vs llama.cpp: library {statistics.median(per):.2f}x "
                  f"(rounds {', '.join(f'{v:.2f}' for v in per)}), engine {statistics.median(per_e):.2f}x")
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
