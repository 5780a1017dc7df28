"""Sliding-window layers in the paged engine (a tiny random Gemma 3).

Contexts run well past the window: logits through the engine equal one
plain forward and the pure-MLX reference path, across chunked prefill,
batching, prefix hits past the window, preemption and every KV scheme; the
sliding groups hold about a window of blocks whatever the context."""

from __future__ import annotations

import asyncio
import random

import mlx.core as mx
import numpy as np
import pytest

from engine_utils import ToyTokenizer, greedy, paged_log_probs
from mlxfast.engine.config import EngineConfig
from mlxfast.engine.engine import Engine
from mlxfast.engine.api import Request, TokenEvent
from mlxfast.kv import DenseKVCache
from mlxfast.kv.block_pool import KVPool
from mlxfast.models.loader import load_hf_dir
from tiny_models import make_tiny_model

WINDOW = 24
BS = 4
# Log-probs of this random model span ~20 nats; kernels that sum in another
# order differ by ~1e-4 there (float32).
ATOL = 5e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("gemma") / "m", "gemma3_text", sliding_window=WINDOW,
                           num_hidden_layers=6, sliding_window_pattern=3, head_dim=64)
    model, _ = load_hf_dir(path)
    return model


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 97) for _ in range(n)]


def log_softmax(x):
    x = x.astype(mx.float32)
    return np.array(x - mx.logsumexp(x, axis=-1, keepdims=True))


def one_shot(model, ids):
    return log_softmax(model(mx.array([ids]), DenseKVCache.for_model(model))[0])


def paged(model, ids, kv_quant="off", native=None, chunk=16):
    return paged_log_probs(model, ids, kv_quant=kv_quant, native=native, chunk=chunk, bs=BS)


def engine(model, **kw):
    kw.setdefault("num_blocks", 400)
    kw.setdefault("block_size", BS)
    kw.setdefault("kv_dtype", "float32")
    kw.setdefault("max_num_batched_tokens", 32)
    return Engine(model, ToyTokenizer(), EngineConfig(**kw)).start()


def run(eng, prompts, max_tokens=6, delays=None):
    """Per prompt: (prompt scores [n-1], generated ids, their logprobs), greedy."""
    delays = delays or [0.0] * len(prompts)

    async def one(i, p, d):
        await asyncio.sleep(d)
        params = greedy(max_tokens, ignore_eos=True, prompt_logprobs=0, logprobs=True)
        return [ev async for ev in eng.submit(Request(p, params))]

    async def main():
        return await asyncio.gather(*(one(i, p, d) for i, (p, d) in enumerate(zip(prompts, delays))))

    out = []
    for events in asyncio.run(main()):
        plp = events[0].prompt_logprobs
        toks = [e for e in events if isinstance(e, TokenEvent)]
        out.append((np.array([e.logprob for e in plp[1:]]), [e.token_id for e in toks],
                    np.array([e.logprob for e in toks])))
    return out


def check_against_one_shot(model, p, result):
    scores, tokens, lps = result
    ref = one_shot(model, p + tokens)
    n = len(p)
    np.testing.assert_allclose(scores, ref[np.arange(n - 1), p[1:]], atol=ATOL)
    assert tokens == [int(ref[n - 1 + i].argmax()) for i in range(len(tokens))]
    np.testing.assert_allclose(lps, ref[np.arange(n - 1, n - 1 + len(tokens)), tokens], atol=ATOL)


def test_engine_equals_one_shot_batched_and_chunked(model):
    eng = engine(model)
    try:
        prompts = [prompt(10 + i, n) for i, n in enumerate((130, 97, 61, 7))]
        for p, r in zip(prompts, run(eng, prompts, delays=[0, 0.01, 0.02, 0.03])):
            check_against_one_shot(model, p, r)
        st = eng.stats()
        assert [g["window"] for g in st["kv_groups"]] == [0, WINDOW, WINDOW]
    finally:
        eng.shutdown()


def test_prefix_hit_past_the_window(model):
    eng = engine(model)
    try:
        base = prompt(20, 120)
        first = run(eng, [base + [5, 6, 7]], max_tokens=3)[0]
        check_against_one_shot(model, base + [5, 6, 7], first)
        hits = eng.scheduler.prefix_hits
        again = base + [9, 9, 8, 40]
        # prompt scoring takes no hits: generate without it, compare the tokens
        async def go():
            return [ev async for ev in eng.submit(Request(again, greedy(5, ignore_eos=True, logprobs=True)))]
        events = asyncio.run(go())
        assert eng.scheduler.prefix_hits - hits >= 100  # most of the 120-token prefix was reused
        toks = [e for e in events if isinstance(e, TokenEvent)]
        ref = one_shot(model, again + [e.token_id for e in toks])
        n = len(again)
        assert [e.token_id for e in toks] == [int(ref[n - 1 + i].argmax()) for i in range(5)]
        np.testing.assert_allclose([e.logprob for e in toks],
                                   [ref[n - 1 + i, e.token_id] for i, e in enumerate(toks)], atol=ATOL)
    finally:
        eng.shutdown()


def test_preemption_keeps_the_answers(model):
    # Few blocks: four long requests cannot all stay resident.
    eng = engine(model, num_blocks=3 * 40, max_num_seqs=4)
    try:
        prompts = [prompt(30 + i, 90) for i in range(4)]
        results = run(eng, prompts, max_tokens=12)
        assert eng.scheduler.num_preemptions > 0
        for p, r in zip(prompts, results):
            check_against_one_shot(model, p, r)
    finally:
        eng.shutdown()


def test_sliding_groups_hold_a_window_of_blocks(model):
    eng = engine(model, num_blocks=3 * 1100, max_num_batched_tokens=64, max_model_len=8192)
    try:
        p = prompt(40, 4000)
        seen = []

        async def go():
            stream = eng.submit(Request(p, greedy(100, ignore_eos=True)))
            async for _ in stream:
                seen.append(eng.stats()["kv_groups"])

        asyncio.run(go())
        # snapshots taken while it ran (the full group then holds the whole context)
        most_full = max(s[0]["blocks_in_use"] for s in seen)
        assert most_full >= 4000 // BS
        most_sliding = max(g["blocks_in_use"] for s in seen for g in s[1:])
        # a window (24 tokens = 6 blocks), a partial block and one chunk's blocks, not the context
        assert 0 < most_sliding <= WINDOW // BS + 1 + 64 // BS
    finally:
        eng.shutdown()


def test_model_declares_its_windows(model):
    assert [layer.window for layer in model.kv_layers] == [WINDOW, WINDOW, 0] * 2
    pool = KVPool(model.kv_layers, 8, BS)
    # 4 sliding + 2 full layers: groups of 2, one full group and two sliding ones
    assert pool.groups.windows == (0, WINDOW, WINDOW) and pool.groups.group_size == 2
    assert len(pool.arrays()) == 2 * 2  # K and V of each slot
    assert len(KVPool(model.kv_layers, 8, BS, release=False).arrays()) == 2 * 6


def test_window_changes_the_answer(model):
    ids = prompt(0, 4 * WINDOW)
    full = log_softmax(model(mx.array([ids]), DenseKVCache(len(model.layers)))[0])
    ours = one_shot(model, ids)
    assert np.abs(full[WINDOW:] - ours[WINDOW:]).max() > 1e-2  # the window bites
    assert np.abs(full[:WINDOW] - ours[:WINDOW]).max() < 1e-4  # before it, equal


@pytest.mark.parametrize("native", [True, False])
def test_paged_equals_one_shot(model, native):
    ids = prompt(1, 5 * WINDOW + 3)
    np.testing.assert_allclose(paged(model, ids, native=native), one_shot(model, ids), atol=ATOL)


def close_under_quantized_kv(a, b):
    """Two runs with quantized KV: a float32 difference of 1e-6 in one layer can
    flip a key's 8-bit code in the next, so they agree in distribution, not bits."""
    return (a.argmax(-1) == b.argmax(-1)).mean() >= 0.95 and np.abs(a - b).mean() < 0.05


@pytest.mark.parametrize("kv_quant", ["8", "4", "turbo"])
def test_quantized_native_equals_reference(model, kv_quant):
    ids = prompt(2, 4 * WINDOW)
    a, b = paged(model, ids, kv_quant, native=True), paged(model, ids, kv_quant, native=False)
    assert close_under_quantized_kv(a, b)
    # while ignoring the window is far off (the check can fail)
    nowindow = log_softmax(model(mx.array([ids]), DenseKVCache(len(model.layers)))[0])
    assert np.abs(a - nowindow)[WINDOW:].mean() > 0.5


@pytest.mark.parametrize("kv_quant", ["8", "turbo"])
def test_engine_with_quantized_kv_equals_its_reference(model, kv_quant):
    p = prompt(50, 100)
    eng = engine(model, kv_quant=kv_quant)
    try:
        scores, tokens, _ = run(eng, [p], max_tokens=4)[0]
    finally:
        eng.shutdown()
    ref = paged(model, p, kv_quant, native=False, chunk=32)
    want = ref[np.arange(len(p) - 1), p[1:]]
    # (see close_under_quantized_kv; TurboQuant's value codebook flips too)
    assert np.abs(scores - want).mean() < 0.1 and np.median(np.abs(scores - want)) < 0.05


def test_speculative_decoding_over_sliding_groups(model):
    """N-gram drafts past the window: verified rows grow every group's table,
    rejected drafts roll back, and the tokens are the one-shot greedy ones.
    Every proposal is verified (``draft_select="all"``): whether the cost
    model finds drafts worth it on this tiny model depends on the step times
    of the moment, and verification is what is checked here."""
    base = prompt(70, 30)
    p = base * 4  # repeats: the n-gram proposer finds drafts
    eng = engine(model, spec_kind="ngram", num_draft_tokens=4, draft_select="all")
    try:
        tokens_lps = run(eng, [p], max_tokens=40)[0]
        st = eng.stats()
    finally:
        eng.shutdown()
    check_against_one_shot(model, p, tokens_lps)
    assert st["spec_decode"]["num_draft_tokens"] > 0
