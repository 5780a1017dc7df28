"""Async scheduling (Scheduler.plan_ahead): each plain decode step is built
while the one before it evaluates, on its still-lazy tokens. It must change
no token, no logprob and no cache entry, and a row that stops on a token the
step ahead already computed past must leave nothing behind."""

import asyncio
import random

import pytest

from engine_utils import ToyTokenizer, dense_greedy, greedy, run_requests, tiny_model
from mlxfast.engine import sampler as sampler_mod
from mlxfast.engine.api import Request, SamplingParams
from mlxfast.engine.config import EngineConfig
from mlxfast.engine.engine import Engine


@pytest.fixture(scope="module")
def model():
    return tiny_model(3)


def engine(model, **kw):
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 8)
    # float32 KV: float16 rounding turns the last-bit differences of rows
    # batched differently (arrivals vary run to run) into logprob changes
    # of ~1e-3 (measured), which would hide what async scheduling changes.
    kw.setdefault("kv_dtype", "float32")
    return Engine(model, ToyTokenizer(), EngineConfig(**kw)).start()


def mixed_requests(rng, stop_text):
    """Greedy and sampled rows, with every kind of end inside a decode run:
    max_tokens, a stop id, EOS, a stop string; penalties, logit_bias, logprobs."""
    def p(n):
        return [rng.randrange(1, 97) for _ in range(n)]
    return [
        Request(p(5), greedy(17, ignore_eos=True)),
        Request(p(9), greedy(30)),  # EOS (id 0) ends it where the model says
        Request(p(12), greedy(25, ignore_eos=True, stop=[stop_text])),
        Request(p(3), greedy(20, ignore_eos=True, stop_token_ids={7, 11, 13})),
        Request(p(20), SamplingParams(max_tokens=23, temperature=0.9, top_p=0.9, seed=5,
                                      repetition_penalty=1.2, frequency_penalty=0.3, ignore_eos=True)),
        Request(p(7), SamplingParams(max_tokens=19, temperature=1.1, seed=9, logprobs=True,
                                     top_logprobs=3, logit_bias={5: 3.0}, ignore_eos=True)),
        Request(p(16), greedy(2, ignore_eos=True)),
        Request(p(30), greedy(1, ignore_eos=True)),
    ]


def events(eng, requests, delays):
    async def one(r, d):
        await asyncio.sleep(d)
        return [e async for e in eng.submit(r)]

    async def main():
        return await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays)))
    return asyncio.run(main())


def summary(evs):
    """(what must be equal, the logprobs): the float tiny model's rows are
    not bitwise batch-invariant, and arrivals batch rows differently run to run."""
    out, lps = [], []
    for e in evs:
        if hasattr(e, "token_id"):
            out.append((e.token_id, e.text, [t for t, _ in e.top_logprobs or []]))
            lps += [e.logprob] + [v for _, v in e.top_logprobs or []] if e.logprob is not None else []
        else:
            out.append((e.finish_reason, e.text, e.stop_string, e.stop_token_id, e.completion_tokens))
    return out, lps


def same(a, b):
    assert [x[0] for x in a] == [x[0] for x in b]
    for (_, la), (_, lb) in zip(a, b):
        assert la == pytest.approx(lb, abs=1e-4)


def test_async_scheduling_changes_no_token(model):
    rng = random.Random(0)
    stop_text = ToyTokenizer().decode(dense_greedy(model, [4, 5, 6], 12))[6:8]
    got = {}
    for on in (False, True):
        rng = random.Random(0)
        reqs = mixed_requests(rng, stop_text)
        eng = engine(model, async_scheduling=on)
        try:
            together = events(eng, reqs, [0.0] * len(reqs))
            staggered = events(eng, mixed_requests(random.Random(0), stop_text),
                               [0.003 * i for i in range(len(reqs))])
            stats = eng.stats()
        finally:
            eng.shutdown()
        assert stats["free_blocks"] == stats["total_blocks"]
        got[on] = ([summary(e) for e in together], [summary(e) for e in staggered],
                   stats["num_steps_ahead"])
    same(got[True][0], got[False][0])
    same(got[True][1], got[False][1])
    assert any(lp for _, lp in got[True][0])
    assert got[False][2] == 0 and got[True][2] > 20  # the path under test was taken
    finishes = {e[0][-1][0] for e in got[True][0]}
    assert {"length", "stop"} <= finishes


def test_stop_inside_a_pipelined_run_leaves_no_wrong_kv(model):
    """A row stopped by a token the step ahead already computed past: its
    wasted position is dropped, never hashed, so a later prompt extending the
    answer hits only real blocks and decodes as a plain forward does."""
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12, 13]  # 13 tokens: blocks of 8 fill while decoding
    ref = dense_greedy(model, prompt, 24)
    # The 11th output token stops it: it sits at position 23, the last of the
    # third block, whose KV the step ahead writes but which is never hashed.
    stop_at = 10
    eng = engine(model)
    try:
        (toks, _, fin), = run_requests(eng, [Request(prompt, greedy(24, ignore_eos=True,
                                                                     stop_token_ids={ref[stop_at]}))])
        assert eng.stats()["num_steps_ahead"] > 5
        longer = prompt + toks + [3, 1, 4, 1, 5]  # toks end in the stop token
        (t2, _, f2), = run_requests(eng, [Request(longer, greedy(8, ignore_eos=True))])
        stats = eng.stats()
    finally:
        eng.shutdown()
    assert toks == ref[:stop_at + 1] and fin.finish_reason == "stop" and fin.stop_token_id == ref[stop_at]
    assert f2.cached_tokens == 16 and t2 == dense_greedy(model, longer, 8)
    assert stats["free_blocks"] == stats["total_blocks"]


def test_a_failed_draw_drops_the_step_built_on_it(model, monkeypatch):
    """When the batched draw fails at evaluation, the step built on its
    tokens is dropped (the pools as they were) and the rows are sampled one
    by one: the same tokens, the engine alive."""
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 97) for _ in range(n)] for n in (4, 11, 6)]
    want = [dense_greedy(model, p, 14) for p in prompts]
    real = sampler_mod.PendingSample.collect
    calls = {"n": 0}

    def flaky(self):  # batched draws 4 and 9 fail (not the one-row retries)
        if len(self.states) > 1:
            calls["n"] += 1
            if calls["n"] in (4, 9):
                raise RuntimeError("injected: the draw failed")
        return real(self)

    monkeypatch.setattr(sampler_mod.PendingSample, "collect", flaky)
    eng = engine(model)
    try:
        got = run_requests(eng, [Request(p, greedy(14, ignore_eos=True)) for p in prompts])
        stats = eng.stats()
    finally:
        eng.shutdown()
    assert calls["n"] > 10 and stats["alive"] and stats["num_steps_ahead"] > 5
    assert [g[0] for g in got] == want
    assert stats["free_blocks"] == stats["total_blocks"]


def test_abort_while_a_step_ahead_is_built(model):
    """Aborting a request whose next step is already built: the others keep
    their tokens, every block comes back."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 97) for _ in range(n)] for n in (6, 9, 12)]
    want = [dense_greedy(model, p, 40) for p in prompts]
    eng = engine(model)

    async def main():
        streams = [eng.submit(Request(p, greedy(40, ignore_eos=True))) for p in prompts]

        async def read(i, s):
            toks = []
            async for ev in s:
                if hasattr(ev, "token_id"):
                    toks.append(ev.token_id)
                    if i == 1 and len(toks) == 7:
                        await s.aclose()
                        break
            return toks
        return await asyncio.gather(*(read(i, s) for i, s in enumerate(streams)))
    try:
        got = asyncio.run(main())
        for _ in range(100):
            if eng.stats()["free_blocks"] == eng.stats()["total_blocks"]:
                break
            asyncio.run(asyncio.sleep(0.02))
        stats = eng.stats()
    finally:
        eng.shutdown()
    assert got[0] == want[0] and got[2] == want[2] and got[1] == want[1][:7]
    assert stats["free_blocks"] == stats["total_blocks"] and stats["num_steps_ahead"] > 10
