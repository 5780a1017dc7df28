"""Tensor parallelism on one machine: tp=1 with T threads vs tp=2 with T/2
threads per rank (ring backend on loopback), decode and prefill through the
engine, and what a step communicates.

    .venv/bin/python bench/bench_tp.py [--threads 2] [--rounds 3] [--model DIR]

The default model cannot be split over 2 ranks (9 query heads), so the
benchmark writes a random-weight model of its size and layout once (SmolLM2-
135M's 30 layers, hidden 576, MLP 1536, vocabulary 49152, tied head; 8 query
heads and 4 KV heads of 64; MLX 4-bit, groups of 32 as Q4_1's) to
/tmp/mlxfast-bench-tp (mlx-lm writes it, as the tests' tiny models).

Runs (each a fresh process or launch):

* ``tp1``: the whole model, one process, ``--threads`` threads;
* ``tp2``: ``mlx.launch -n 2 --backend ring``, ``--threads / 2`` per rank,
  rank 0's engine with rank 1 following; plus, on both ranks, the per-step
  communication measured alone: an all_sum of a decode step's [rows, 576]
  and of a prefill chunk's [512, 576] (chunked, as the model does), the
  step channel's message, and the output head's two layouts (replicated on
  rank 0 vs vocabulary-sharded + all_gather of the logits);
* ``shard``: rank 0's shard alone (a one-rank group: all_sum is the
  identity), ``--threads`` threads: what one rank computes per step, for the
  two-machine estimate (each machine has its own cores).

Printed: tok/s per run, step times, the all_sum count and latency per step,
and the estimate for two machines: shard step + all_sums x a network latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = Path(tempfile.gettempdir()) / "mlxfast-bench-tp"
CONFIG = {"hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True,
          "max_position_embeddings": 4096}
PREFILL, DECODE = 512, 64


def make_model(out: Path) -> Path:
    if (out / "config.json").is_file():
        return out
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models

    tiny_models.VOCAB = CONFIG["vocab_size"]  # a word-level tokenizer of the whole vocabulary
    return tiny_models.make_tiny_model(out, "llama", quantize={"group_size": 32, "bits": 4}, **CONFIG)


# ------------------------------------------------------------------ worker


def _engine_numbers(engine, vocab: int, rounds: int) -> dict:
    import random

    from mlxfast.engine.api import Request, SamplingParams, TokenEvent

    rng = random.Random(0)

    async def timed(req):
        t0, stamps = time.perf_counter(), []
        async for ev in engine.submit(req):
            if isinstance(ev, TokenEvent):
                stamps.append(time.perf_counter())
        return t0, stamps

    def decode(streams: int) -> float:
        prompts = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(streams)]

        async def main():
            return await asyncio.gather(*(timed(Request(p, SamplingParams(
                max_tokens=DECODE, temperature=0, ignore_eos=True))) for p in prompts))
        res = asyncio.run(main())
        start, end = max(s[0] for _, s in res), min(s[-1] for _, s in res)
        n = sum(1 for _, s in res for t in s if start < t <= end)
        return n / (end - start)

    def prefill() -> float:
        p = [rng.randrange(3, vocab) for _ in range(PREFILL)]

        async def main():
            return await timed(Request(p, SamplingParams(max_tokens=1, temperature=0), cache_salt=str(rng.random())))
        t0, stamps = asyncio.run(main())
        return PREFILL / (stamps[0] - t0)

    decode(1), prefill()  # warm-up
    out = {"decode_1": [], "decode_8": [], "prefill": []}
    for _ in range(rounds):
        out["decode_1"].append(decode(1))
        out["decode_8"].append(decode(8))
        out["prefill"].append(prefill())
    return {k: statistics.median(v) for k, v in out.items()}


def _comm_numbers(group, model) -> dict:
    """Rank-synchronous micro-benchmarks (every rank runs this)."""
    import mlx.core as mx

    from mlxfast.engine.distributed import STEP, StepChannel
    from mlxfast.models.shard import all_sum

    def timeit(fn, n):
        """The median call (this machine's other jobs preempt the ranks: the mean is theirs)."""
        for _ in range(5):
            fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    H, V = CONFIG["hidden_size"], CONFIG["vocab_size"]
    out = {}
    for rows in (1, 8):
        a = mx.ones((rows, 1, H))
        out[f"all_sum_{rows}x{H}_us"] = 1e6 * timeit(lambda: mx.eval(all_sum(a, group)), 200)
    a = mx.ones((PREFILL, 1, H))
    out[f"all_sum_{PREFILL}x{H}_us"] = 1e6 * timeit(lambda: mx.eval(all_sum(a, group)), 20)
    a = mx.ones((PREFILL, 1, H))
    out[f"all_sum_{PREFILL}x{H}_unchunked_us"] = 1e6 * timeit(
        lambda: mx.eval(mx.distributed.all_sum(a, group=group, stream=mx.cpu)), 5)
    # a chain of 60 all_sums in one graph: what a decode step's 2 x 30 cost
    b = mx.ones((8, 1, H))

    def chain():
        x = b
        for _ in range(2 * CONFIG["num_hidden_layers"]):
            x = all_sum(x * 0.5, group)
        mx.eval(x)
    out["chain_60_all_sums_8_rows_us"] = 1e6 * timeit(chain, 20)
    ch = StepChannel(group)
    import numpy as np

    msg = np.arange(8 * 70, dtype=np.int32)
    out["channel_message_us"] = 1e6 * timeit(
        (lambda: ch.send(STEP, msg)) if group.rank() == 0 else (lambda: ch.recv()), 200)
    # The head: replicated (rank 0 computes [rows, V]) vs vocabulary-sharded
    # (each rank [rows, V/2], then an all_gather of the logits).
    embed = model.model.embed_tokens
    for rows in (1, 8):
        h = mx.random.normal((rows, H))
        full = timeit(lambda: mx.eval(embed.as_linear(h)), 50)
        half_w = {k: embed[k][: V // 2] for k in ("weight", "scales", "biases")}
        mx.eval(half_w)
        from mlxfast import ops

        def sharded():
            y = ops.quantized_matmul(h, half_w["weight"], half_w["scales"], half_w["biases"],
                                     group_size=embed.group_size, bits=embed.bits)
            mx.eval(mx.distributed.all_gather(y, group=group, stream=mx.cpu))
        out[f"head_replicated_{rows}_rows_us"] = 1e6 * full
        out[f"head_sharded_gather_{rows}_rows_us"] = 1e6 * timeit(sharded, 50)
    return out


def worker(mode: str, model_dir: str, rounds: int) -> dict:
    import mlx.core as mx

    from mlxfast.engine import distributed as D
    from mlxfast.engine.config import EngineConfig
    from mlxfast.engine.engine import Engine
    from mlxfast.models.loader import load
    from mlxfast.models.shard import shard_model

    model, tok = load(model_dir)
    cfg = dict(num_blocks=1024, max_num_seqs=8, max_num_batched_tokens=PREFILL)
    if mode == "tp1":
        eng = Engine(model, tok, EngineConfig(**cfg)).start()
    elif mode == "shard":
        group = mx.distributed.init()  # one rank: all_sum is the identity
        shard_model(model, group, rank=0, size=2)
        eng = Engine(model, tok, EngineConfig(**cfg)).start()
    else:
        group = D.init_group(120)
        D.check_same_model(group, model)
        shard_model(model, group)
        comm = _comm_numbers(group, model)
        if group.rank() != 0:
            D.Follower(model, D.StepChannel(group)).run()
            return {}
        ch = D.StepChannel(group)
        eng = Engine(model, tok, EngineConfig(**cfg, tp_channel=ch)).start()
    try:
        res = _engine_numbers(eng, CONFIG["vocab_size"], rounds)
        res["num_steps"] = eng.num_steps
        if mode == "tp2":
            res["comm"] = comm
            res["channel"] = ch.stats()
        res["ranks"] = eng.stats()["ranks"]
    finally:
        eng.shutdown()
    return res


# ------------------------------------------------------------------ driver


def run(mode: str, threads: int, model: Path, rounds: int) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    cmd = [sys.executable, __file__, "--worker", mode, "--model", str(model), "--rounds", str(rounds),
           "--out", str(out)]
    env = dict(os.environ, MLXFAST_NUM_THREADS=str(threads), MLX_NUM_THREADS=str(threads))
    if mode == "tp2":
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [str(Path(sys.executable).parent / "mlx.launch"), "-n", "2", "--backend", "ring",
               "--starting-port", str(port), "--", *cmd]
    subprocess.run(cmd, env=env, check=True, cwd=ROOT)
    data = json.loads(out.read_text())
    out.unlink()
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="threads of the tp=1 process (tp=2: half per rank)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None, help="a model directory (default: the generated SmolLM2-sized one)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--latency-us", type=float, default=50.0,
                    help="network all_sum latency assumed for the two-machine estimate (10 GbE TCP)")
    ap.add_argument("--gbps", type=float, default=10.0, help="network bandwidth assumed for the estimate")
    args = ap.parse_args()
    if args.worker:
        res = worker(args.worker, args.model, args.rounds)
        if res and args.out and os.environ.get("MLX_RANK", "0") == "0":
            Path(args.out).write_text(json.dumps(res))
        return 0
    model = Path(args.model) if args.model else make_model(MODEL_DIR)
    half = max(1, args.threads // 2)
    res = {"tp1": run("tp1", args.threads, model, args.rounds),
           "tp2": run("tp2", half, model, args.rounds),
           "shard": run("shard", args.threads, model, args.rounds)}
    print(f"\nmodel {model}: 30 layers, 2 all_sums per layer per step\n")
    print(f"{'run':<34} {'decode 1 (tok/s)':>17} {'decode 8 (tok/s)':>17} {'prefill 512 (tok/s)':>20}")
    for name, label in (("tp1", f"tp=1, {args.threads} threads"), ("tp2", f"tp=2, {half} thread(s) per rank"),
                        ("shard", f"rank 0's shard alone, {args.threads} thr")):
        r = res[name]
        print(f"{label:<34} {r['decode_1']:>17.1f} {r['decode_8']:>17.1f} {r['prefill']:>20.1f}")
    comm = res["tp2"]["comm"]
    print("\nper-step communication (tp=2, loopback ring, measured alone):")
    for k, v in comm.items():
        print(f"  {k:<40} {v:>10.0f} us")
    n = 2 * CONFIG["num_hidden_layers"]
    lat1 = comm["chain_60_all_sums_8_rows_us"] / n
    print(f"\n  all_sums per step: {n} (+1 channel message); in a 60-long chain {lat1:.0f} us each "
          f"= {comm['chain_60_all_sums_8_rows_us'] / 1e3:.1f} ms per decode step")
    s = res["shard"]
    bw = args.gbps * 1e9 / 8
    tp1 = {k: (PREFILL if k == "prefill" else int(k[-1])) / res["tp1"][k] for k in ("decode_1", "decode_8", "prefill")}
    for lat_us, what in ((lat1, "each all_sum as in the loopback chain"),
                         (args.latency_us, f"{args.latency_us:.0f} us per all_sum (assumed network)")):
        print(f"\ntwo machines, {args.threads} threads each: one rank's shard step alone + {what}, "
              f"{args.gbps:.0f} Gbit/s:")
        for label, key, rows in (("decode, 1 stream", "decode_1", 1), ("decode, 8 streams", "decode_8", 8)):
            step_shard = rows / s[key]
            est = step_shard + (n + 1) * lat_us * 1e-6
            print(f"  {label}: {step_shard * 1e3:.2f} ms + {n + 1} x {lat_us:.0f} us = {est * 1e3:.2f} ms/step"
                  f" -> {rows / est:.1f} tok/s, {tp1[key] / est:.2f}x tp=1 ({rows / tp1[key]:.1f} tok/s)")
        step_shard = PREFILL / s["prefill"]
        nbytes = PREFILL * CONFIG["hidden_size"] * 4
        est = step_shard + n * (lat_us * 1e-6 + nbytes / bw)
        print(f"  prefill, 512 tokens: {step_shard * 1e3:.0f} ms + {n} x ({lat_us:.0f} us + {nbytes / 1e6:.2f} MB at "
              f"{args.gbps:.0f} Gbit/s) = {est * 1e3:.0f} ms -> {PREFILL / est:.0f} tok/s, "
              f"{tp1['prefill'] / est:.2f}x tp=1 ({PREFILL / tp1['prefill']:.0f} tok/s)")
    print("\nraw:", json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
