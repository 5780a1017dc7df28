"""Single-stream decode and prefill: mlxfast against mlx-lm, same weights, one run.

    .venv/bin/python bench/bench_generate.py [--decode 256] [--prefill 512 2048] [--rounds 3]
        [--model FILE.gguf --no-mlx-lm]   # another GGUF, e.g. Gemma 3 270M
        [--shape 1b|8b --qtype q4_0|q8_0 --no-mlx-lm]   # a random-weight file of that shape
        [--matmul-activations int8]   # also mlxfast with int8 activations, same rounds

``--shape`` writes (once, into ~/.cache/mlxfast-bench) a random-weight llama
GGUF with the shapes of Llama-3.2-1B or Llama-3.1-8B (bench/sized_gguf.py) and
also reports decode as a share of this machine's limit: the weight bytes a
decode step reads (per engine, in its own format) times tokens/s, over the
copy bandwidth measured in the same run (2 threads, read + write bytes, as
STREAM counts them).

mlx-lm loads the default model converted by ``mlxfast convert``; both run on
the same process and machine, and the ratio is what to read (these machines
are shared and noisy). llama.cpp (llama-cpp-python) is measured too when it is
installed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import mlx.core as mx


def _prompt_ids(tok, n: int) -> list[int]:
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(n))
    ids = tok.encode(text, add_special_tokens=False)[:n]
    assert len(ids) == n
    return ids


def copy_bandwidth_gbs(nbytes: int = 1 << 30, threads: int = 2, repeats: int = 5) -> float:
    """Best of ``repeats``: read + write bytes per second of a parallel numpy copy."""
    import threading

    import numpy as np

    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    parts = np.array_split(np.arange(src.size), threads)
    bounds = [(p[0], p[-1] + 1) for p in parts]
    best = 0.0
    for _ in range(repeats):
        ts = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b])) for a, b in bounds]
        t0 = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        best = max(best, 2 * nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def mlxfast_bytes_per_token(model) -> int:
    """Weight bytes a decode step reads in mlxfast's format: every parameter,
    but only one row of an untied embedding."""
    from mlx.utils import tree_flatten

    total = 0
    params = dict(tree_flatten(model.parameters()))
    tied = not any(k.startswith("lm_head.") for k in params)
    for name, p in params.items():
        if name.startswith("model.embed_tokens.") and not tied:
            total += p.nbytes // p.shape[0]
        else:
            total += p.nbytes
    return total


def bench_mlxfast(path, n_decode: int, prefills: list[int], activations: str = "fp32"):
    """Load once; return a function that measures one round."""
    import mlxfast
    from mlxfast.generation import stream_generate
    from mlxfast.kv import DenseKVCache

    model, tok = mlxfast.load(path, matmul_activations=activations)
    list(stream_generate(model, tok, _prompt_ids(tok, 32), max_tokens=8))  # warm-up
    nbytes = mlxfast_bytes_per_token(model)

    def run() -> dict:
        out = {"bytes_per_token": nbytes}
        ids = _prompt_ids(tok, 32)
        first = None
        n = 0
        for c in stream_generate(model, tok, ids, max_tokens=n_decode, temp=0.0):
            n += 1
            if first is None:
                first = time.perf_counter()
        # Decode rate excludes the prefill and the first token; EOS is ignored by
        # the oracle's count too, so compare tokens/second only.
        out["decode_tok_s"] = (n - 1) / (time.perf_counter() - first)
        for p in prefills:
            ids = _prompt_ids(tok, p)
            cache = DenseKVCache.for_model(model)
            t0 = time.perf_counter()
            pos = 0
            while pos < p:
                chunk = ids[pos:pos + 512]
                logits = model(mx.array([chunk]), cache, logit_rows=mx.array([len(chunk) - 1]))
                cache.advance(len(chunk))
                mx.eval(logits, cache.state_arrays())
                pos += len(chunk)
            out[f"prefill_{p}_tok_s"] = p / (time.perf_counter() - t0)
        return out

    return run


def bench_mlx_lm(path, n_decode: int, prefills: list[int], max_prefill_oracle: int) -> dict:
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    model, tok = mlx_lm.load(str(path))
    out = {}
    ids = _prompt_ids(tok, 32)
    greedy = make_sampler(temp=0.0)
    for _ in generate_step(mx.array(ids), model, max_tokens=4, sampler=greedy):
        pass
    first = None
    n = 0
    for _ in generate_step(mx.array(ids), model, max_tokens=n_decode, sampler=greedy):
        n += 1
        if first is None:
            first = time.perf_counter()
    out["decode_tok_s"] = (n - 1) / (time.perf_counter() - first)
    for p in prefills:
        if p > max_prefill_oracle:
            continue
        x = mx.array([_prompt_ids(tok, p)])
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        mx.eval(model(x, cache=cache))
        out[f"prefill_{p}_tok_s"] = p / (time.perf_counter() - t0)
    return out


def bench_llama_cpp(gguf, n_decode: int, prefills: list[int]):
    """Load once; return a function that measures one round (None without llama-cpp-python)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    import os

    llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=os.cpu_count(), verbose=False, n_batch=512)

    def run() -> dict:
        out = {}
        ids = llm.tokenize(b"Item 0: the quick brown fox", add_bos=False)
        llm.reset()
        llm.eval(ids)
        t0 = time.perf_counter()
        n = 0
        for tok in llm.generate(ids, temp=0.0, reset=True):
            n += 1
            if n == 1:
                t0 = time.perf_counter()
            if n >= n_decode:
                break
        out["decode_tok_s"] = (n - 1) / (time.perf_counter() - t0)
        for p in prefills:
            text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(p))
            pids = llm.tokenize(text.encode(), add_bos=False)[:p]
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(pids)
            out[f"prefill_{p}_tok_s"] = p / (time.perf_counter() - t0)
        return out

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--prefill", type=int, nargs="*", default=[512, 2048])
    ap.add_argument("--oracle-max-prefill", type=int, default=512,
                    help="skip mlx-lm prefill above this length (it takes minutes)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating rounds of mlxfast and llama.cpp (medians are reported)")
    ap.add_argument("--one-round", choices=["mlxfast", "mlxfast-int8", "llama.cpp"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--matmul-activations", choices=["fp32", "int8"], default="fp32",
                    help="int8: also run mlxfast with int8 activations (mlxfast-int8), in the same "
                         "alternating rounds")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the built-in model)")
    ap.add_argument("--no-mlx-lm", action="store_true",
                    help="only mlxfast and llama.cpp (mlx-lm takes minutes on Linux CPU)")
    ap.add_argument("--shape", choices=["1b", "8b"], default=None,
                    help="a random-weight llama GGUF of this model shape (bench/sized_gguf.py)")
    ap.add_argument("--qtype", choices=["q4_0", "q8_0"], default="q4_0")
    args = ap.parse_args()

    from mlxfast.convert import convert_gguf
    from mlxfast.models.loader import default_model_path

    gguf = args.model or default_model_path()
    if args.shape and not args.one_round:
        import sized_gguf

        gguf = sized_gguf.cached(args.shape, args.qtype)
    keys = ["decode_tok_s"] + [f"prefill_{p}_tok_s" for p in args.prefill]
    if args.one_round:  # child: one engine, one round, JSON on the last line
        if args.one_round == "llama.cpp":
            run = bench_llama_cpp(gguf, args.decode, args.prefill)
        else:
            run = bench_mlxfast(gguf, args.decode, args.prefill,
                                "int8" if args.one_round == "mlxfast-int8" else "fp32")
        print(json.dumps(run() if run else None))
        return
    # Each round runs each engine in its own process (no thread pool of one
    # spinning while the other runs), alternating, so that a slow minute of
    # this shared machine lands on both; the ratio reported is the median of
    # the per-round ratios.
    rounds = {"mlxfast": [], "llama.cpp": []}
    if args.matmul_activations == "int8":
        rounds = {"mlxfast": [], "mlxfast-int8": [], "llama.cpp": []}
    bandwidth = copy_bandwidth_gbs()
    for _ in range(args.rounds):
        for name in rounds:
            cmd = [sys.executable, __file__, "--one-round", name, "--decode", str(args.decode),
                   "--prefill", *map(str, args.prefill), "--model", str(gguf)]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True)
                             .stdout.strip().splitlines()[-1])
            if res is not None:
                rounds[name].append(res)
    rounds = {name: rs for name, rs in rounds.items() if rs}
    bandwidth = max(bandwidth, copy_bandwidth_gbs())  # the machine's best in this run
    rows = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in rounds.items()}
    if not args.no_mlx_lm:
        with tempfile.TemporaryDirectory() as d:
            convert_gguf(gguf, d)
            rows["mlx-lm"] = bench_mlx_lm(d, args.decode, args.prefill, args.oracle_max_prefill)

    print(f"{'engine':<12}" + "".join(f"{k:>20}" for k in keys) + f"   (median of {args.rounds} rounds)")
    for name, r in rows.items():
        print(f"{name:<12}" + "".join(f"{r.get(k, float('nan')):>20.1f}" for k in keys))
    if "mlx-lm" in rows:
        ratio = "".join(f"{rows['mlxfast'][k] / rows['mlx-lm'][k]:>20.2f}" if k in rows["mlx-lm"]
                        else f"{'-':>20}" for k in keys)
        print(f"{'/ mlx-lm':<12}" + ratio)
    def ratios(num: str, den: str, label: str) -> None:
        per = {k: [a[k] / b[k] for a, b in zip(rounds[num], rounds[den])] for k in keys}
        print(f"{label:<12}" + "".join(f"{statistics.median(per[k]):>20.2f}" for k in keys)
              + f"   ({num} / {den}, median of per-round ratios)")
        print(f"  per-round decode ratio {num} / {den}: "
              + ", ".join(f"{v:.2f}" for v in per["decode_tok_s"]))

    if "llama.cpp" in rounds:
        ratios("mlxfast", "llama.cpp", "/ llama.cpp")
        if "mlxfast-int8" in rounds:
            ratios("mlxfast-int8", "llama.cpp", "int8/llama")
    if "mlxfast-int8" in rounds:
        ratios("mlxfast-int8", "mlxfast", "int8/fp32")
    if args.shape:
        import sized_gguf

        per_token = {"mlxfast": rounds["mlxfast"][0]["bytes_per_token"],
                     "llama.cpp": sized_gguf.bytes_read_per_token(args.shape, args.qtype)}
        if "mlxfast-int8" in rounds:
            per_token["mlxfast-int8"] = rounds["mlxfast-int8"][0]["bytes_per_token"]
        print(f"copy bandwidth (2 threads, read + write): {bandwidth:.1f} GB/s")
        for name in rounds:
            need = per_token[name] / 1e9
            got = rows[name]["decode_tok_s"] * need
            print(f"{name:<12} reads {need:.3f} GB/token: {got:.1f} GB/s = {got / bandwidth:.0%} of the "
                  f"copy bandwidth (limit {bandwidth / need:.1f} tok/s)")

if __name__ == "__main__":
    main()
