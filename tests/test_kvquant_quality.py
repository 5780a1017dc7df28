"""Quality of quantized KV on real text: perplexity of the default model over
a long document (the GPL-3 text, ~7.6k tokens; verbatim copies are
permitted by its notice) with each KV scheme against ``off``.

The document runs in 512-token chunks through the engine's paged path
(``PagedContext`` over a ``KVPool`` of the scheme, native kernels on the CPU),
so later chunks attend over quantized KV written by earlier ones, exactly as
in serving. Tolerances are what the schemes achieve here, with some margin.
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxfast
from mlxfast.kv.block_pool import KVPool
from mlxfast.kv.paged import PagedContext, SeqSlice

DOC = Path(__file__).parent / "data" / "gpl-3.0.txt"
N_TOKENS = 6144
CHUNK = 512
BS = 16

# Relative perplexity increase over "off" allowed per scheme (measured here, with the
# query rounded to 8 bits per group for the scores: 8 +0.13%, k8v4 +0.79%, k8v3 +2.10%;
# before that rounding 8 -0.00%,
# k8v4 +0.84%, k8v3 +1.67%; the issue allowed 8: 0.5%, k8v4: 1.5%, k8v3: 4%).
TOLERANCE = {"8": 0.002, "turbo:k8v4": 0.012, "turbo": 0.025}  # 4-bit affine: bench only


def perplexity(model, tokens, kv_quant: str) -> float:
    n = len(tokens)
    pool = KVPool(model.kv_layers, -(-n // BS), BS, model.dtype, kv_quant=kv_quant)
    table = list(range(pool.num_blocks))
    nll = 0.0
    for start in range(0, n - 1, CHUNK):
        m = min(CHUNK, n - 1 - start)
        ctx = PagedContext(pool, [SeqSlice([table], start, m)])
        x = mx.array(tokens[start:start + m], dtype=mx.int32).reshape(-1, 1)
        logits = model(x, ctx).reshape(m, -1).astype(mx.float32)
        target = mx.array(tokens[start + 1:start + m + 1])
        lse = mx.logsumexp(logits, axis=-1)
        picked = mx.take_along_axis(logits, target[:, None], axis=-1)[:, 0]
        nll += float((lse - picked).sum())
    return float(np.exp(nll / (n - 1)))


@pytest.mark.slow
def test_perplexity_per_scheme():
    model, tok = mlxfast.load()
    tokens = tok.encode(DOC.read_text())
    assert len(tokens) >= N_TOKENS
    tokens = tokens[:N_TOKENS]
    base = perplexity(model, tokens, "off")
    rows = [("off", base, 0.0)]
    for q in TOLERANCE:
        p = perplexity(model, tokens, q)
        rows.append((q, p, p / base - 1))
    print(f"\nperplexity over {N_TOKENS} tokens of {DOC.name} (default model, {CHUNK}-token chunks)")
    for q, p, d in rows:
        print(f"  {q:>11}: {p:8.4f}  ({d * 100:+.2f}%)")
    assert 1.5 < base < 30, base
    for q, p, d in rows[1:]:
        assert d <= TOLERANCE[q], f"{q}: perplexity {p:.4f} is {d * 100:.2f}% above off ({base:.4f})"
