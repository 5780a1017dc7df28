"""The output head's greedy choice (ops.quantized_argmax) against the full
head and its argmax, per number of rows, on a model's own head and hidden
states (the model's final hidden states over text: its README here), in one
process, alternating rounds; each row count checks that both give the same
tokens.

    .venv/bin/python bench/bench_head_choice.py [--model PATH] [--rows 1,2,4,8,16,32,72]
        [--rounds 7] [--cold]

``--cold`` streams a 256 MB buffer between calls, so the head is read from
DRAM as in a real step (a small head otherwise stays in L3 here).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx

import mlxfast
from mlxfast import ops
from mlxfast.kv.dense import DenseKVCache


def hidden_states(model, tok, n: int) -> mx.array:
    text = (Path(__file__).parent.parent / "README.md").read_text()
    ids = tok.encode(text)[:n]
    model.compute_head = False
    try:
        h = model(mx.array([ids]), DenseKVCache.for_model(model))[0]
    finally:
        model.compute_head = True
    mx.eval(h)
    return h


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", default="1,2,4,8,16,32,72")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cold", action="store_true")
    args = ap.parse_args()

    model, tok = mlxfast.load(args.model)
    head, norm = model.output_head, model.model.norm
    w, s, b = head["weight"], head["scales"], head.get("biases")
    kw = dict(group_size=head.group_size, bits=head.bits, norm=(norm["weight"], norm.eps))
    rows = [int(r) for r in args.rows.split(",")]
    h = hidden_states(model, tok, max(rows))
    if not ops.has_native_quantized_argmax(h, w, head.bits):
        raise SystemExit(f"no native quantized_argmax here (cpu path {ops.cpu_path()})")
    bounds = ops.argmax_bounds(w, s, b, group_size=head.group_size, bits=head.bits)
    junk = mx.zeros((64 << 20,)) if args.cold else None
    print(f"head {w.shape[0] * 16} x {w.shape[1] * 32 // head.bits}, {head.bits}-bit; "
          f"cpu path {ops.cpu_path()}; {'from DRAM' if args.cold else 'warm'}; "
          f"medians of {args.rounds} alternating rounds")
    print(f"{'rows':>5} {'full+argmax ms':>15} {'choice ms':>10} {'ratio':>6}")
    for m in rows:
        x = h[:m]
        full = lambda: mx.argmax(ops.quantized_matmul(x, w, s, b, **kw), axis=-1)  # noqa: E731
        choice = lambda: ops.quantized_argmax(x, w, s, b, bounds, **kw)  # noqa: E731
        if full().tolist() != choice().tolist():
            raise SystemExit(f"{m} rows: the tokens differ")
        times = {"full": [], "choice": []}
        for _ in range(args.rounds):
            for name, f in (("full", full), ("choice", choice)):
                total = 0.0
                for _ in range(5):
                    if junk is not None:
                        mx.eval(junk + 1)
                    t = time.perf_counter()
                    mx.eval(f())
                    total += time.perf_counter() - t
                times[name].append(total / 5 * 1e3)
        a, c = statistics.median(times["full"]), statistics.median(times["choice"])
        print(f"{m:>5} {a:>15.3f} {c:>10.3f} {a / c:>6.2f}")


if __name__ == "__main__":
    main()
