"""Shared helpers for the engine tests: a tiny random model, a toy tokenizer,
and a runner that drives an Engine from asyncio."""

from __future__ import annotations

import asyncio

import mlx.core as mx

from mlxfast.engine.api import FinishEvent, Request, SamplingParams, TokenEvent
from mlxfast.models.llama import Model, ModelArgs


def tiny_model(seed: int = 0, *, layers: int = 2, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, vocab: int = 97, max_pos: int = 2048) -> Model:
    mx.random.seed(seed)
    args = ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                     intermediate_size=2 * hidden, num_attention_heads=heads, vocab_size=vocab,
                     num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                     tie_word_embeddings=False)
    model = Model(args)
    params = {}
    from mlx.utils import tree_flatten, tree_unflatten
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("norm.weight"):
            params[k] = mx.ones(v.shape)
        else:
            params[k] = mx.random.normal(v.shape) * (1.5 / v.shape[-1] ** 0.5 if v.ndim > 1 else 1)
    params["model.embed_tokens.weight"] = mx.random.normal((vocab, hidden))
    params["lm_head.weight"] = mx.random.normal((vocab, hidden)) * 4 / hidden ** 0.5
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


class ToyDetok:
    def __init__(self, tok):
        self.tok = tok

    def add(self, t: int) -> str:
        return self.tok.piece(t)

    def flush(self) -> str:
        return ""

    def hides(self, t: int) -> bool:
        return False  # no special tokens but EOS, which is never detokenized


class ToyTokenizer:
    """Token i <-> one letter (i % 26); id 0 is EOS."""

    def __init__(self, vocab: int = 97, eos: int = 0):
        self.vocab_size = vocab
        self.eos_token_ids = {eos}
        self.bos_token_id = None

    def piece(self, t: int) -> str:
        return "" if t in self.eos_token_ids else chr(ord("a") + t % 26)

    def decode(self, ids) -> str:
        return "".join(self.piece(t) for t in ids)

    def detokenizer(self, *, skip_special_tokens: bool = False):
        return ToyDetok(self)


def reference_proposer(vocab: int, wrong_every: int):
    """A prompt-lookup stand-in (``engine.spec.NgramProposer``'s interface)
    that drafts what decoding without speculation gives next (``REFERENCE``:
    prompt tuple -> reference tokens), every ``wrong_every``-th position
    wrong, so drafts are both accepted and rejected."""

    class ReferenceProposer:
        REFERENCE: dict[tuple, list[int]] = {}
        match = 1

        def __init__(self, n_min, n_max):
            pass

        def propose(self, tokens, k):
            for prompt, out in self.REFERENCE.items():
                if tuple(tokens[:len(prompt)]) == prompt:
                    draft = (list(prompt) + out)[len(tokens):len(tokens) + k]
                    return [(t + 1) % vocab if (len(tokens) + j) % wrong_every == 0 else t
                            for j, t in enumerate(draft)]
            return []

    return ReferenceProposer


def dense_greedy(model, prompt, n):
    """Greedy tokens from a plain dense-cache forward: the engine's oracle."""
    from mlxfast.kv import DenseKVCache

    cache = DenseKVCache.for_model(model)
    logits = model(mx.array([prompt]), cache)
    cache.advance(len(prompt))
    out = []
    for _ in range(n):
        t = mx.argmax(logits[0, -1]).item()
        out.append(t)
        logits = model(mx.array([[t]]), cache)
        cache.advance(1)
    return out


async def collect(engine, request: Request, delay: float = 0.0):
    if delay:
        await asyncio.sleep(delay)
    stream = engine.submit(request)
    tokens, text, finish = [], "", None
    async for ev in stream:
        if isinstance(ev, TokenEvent):
            tokens.append(ev.token_id)
            text += ev.text
        else:
            finish = ev
            text += ev.text
    return tokens, text, finish


def run_requests(engine, requests, delays=None):
    delays = delays or [0.0] * len(requests)

    async def main():
        return await asyncio.gather(*(collect(engine, r, d) for r, d in zip(requests, delays)))

    return asyncio.run(main())


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


__all__ = ["tiny_model", "dense_greedy", "ToyTokenizer", "run_requests", "collect", "greedy", "FinishEvent"]


def paged_log_probs(model, ids, *, kv_quant="off", dtype=mx.float32, native=None, chunk=16, bs=4,
                    rows=None):
    """Log-probs of a chunked prefill through ``PagedContext`` over a pool with
    the model's KV groups, sliding groups' tables released as the scheduler
    releases them (entries wholly before the window are -1). ``rows``: only
    those positions (the head runs on them alone)."""
    import numpy as np

    from mlxfast.kv.block_pool import KVPool
    from mlxfast.kv.paged import PagedContext, SeqSlice

    n = len(ids)
    nb = -(-n // bs)
    pool = KVPool(model.kv_layers, len(model.kv_layers) * nb, bs, dtype, kv_quant=kv_quant)
    tables = [list(range(g * nb, (g + 1) * nb)) for g in range(len(pool.groups))]
    out = []
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        shown = [[-1 if w and (b + 1) * bs <= start - w + 1 else t for b, t in enumerate(table)]
                 for table, w in zip(tables, pool.groups.windows)]
        ctx = PagedContext(pool, [SeqSlice(shown, start, m)], native=native)
        mine = list(range(m)) if rows is None else [r - start for r in rows if start <= r < start + m]
        if not mine:
            model(mx.array(ids[start:start + m])[:, None], ctx, logit_rows=mx.array([0]))
            continue
        logits = model(mx.array(ids[start:start + m])[:, None], ctx, logit_rows=mx.array(mine))
        logits = logits.reshape(len(mine), -1).astype(mx.float32)
        out.append(np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True)))
    return np.concatenate(out)
