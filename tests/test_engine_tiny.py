"""The engine end to end on a tiny random-weight model (fast)."""

import asyncio
import random

import mlx.core as mx
import pytest

from engine_utils import ToyTokenizer, collect, dense_greedy, greedy, run_requests, tiny_model
from mlxfast.engine.api import (EngineDead, EngineOverloaded, FinishEvent, PromptTooLong, Request,
                                SamplingParams)
from mlxfast.engine.config import EngineConfig
from mlxfast.engine.engine import Engine


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def engine(model, **kw):
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 8)
    return Engine(model, ToyTokenizer(), EngineConfig(**kw)).start()


def prompt(rng, n):
    return [rng.randrange(1, 97) for _ in range(n)]


def test_batching_changes_nothing(model):
    rng = random.Random(1)
    prompts = [prompt(rng, n) for n in (1, 5, 9, 16, 17, 30, 41, 63)]
    want = [dense_greedy(model, p, 12) for p in prompts]
    eng = engine(model, max_num_batched_tokens=24)  # forces chunked prefill next to decodes
    try:
        reqs = [Request(p, greedy(12, ignore_eos=True)) for p in prompts]
        got = run_requests(eng, reqs, delays=[0.01 * i for i in range(8)])
        alone = [run_requests(eng, [Request(p, greedy(12, ignore_eos=True))])[0] for p in prompts[::3]]
        assert eng.stats()["free_blocks"] == eng.stats()["total_blocks"]
    finally:
        eng.shutdown()
    for (toks, _, fin), w in zip(got, want):
        assert toks == w and fin.finish_reason == "length" and fin.completion_tokens == 12
    assert [a[0] for a in alone] == want[::3]


def test_prefix_cache_hit_gives_same_tokens(model):
    rng = random.Random(2)
    shared = prompt(rng, 37)
    second = shared + prompt(rng, 5)
    eng = engine(model, block_size=8)
    try:
        (t1, _, f1), = run_requests(eng, [Request(shared, greedy(6, ignore_eos=True))])
        (t2, _, f2), = run_requests(eng, [Request(second, greedy(6, ignore_eos=True))])
        (t3, _, f3), = run_requests(eng, [Request(second, greedy(6, ignore_eos=True), cache_salt="x")])
        stats = eng.stats()
    finally:
        eng.shutdown()
    assert f1.cached_tokens == 0 and f2.cached_tokens == 32 and f3.cached_tokens == 0
    assert t2 == t3 == dense_greedy(model, second, 6)
    assert t1 == dense_greedy(model, shared, 6)
    assert stats["prefix_cache_hits_total"] == 32
    assert stats["prefix_cache_queries_total"] == 37 + 42 + 42


def test_seeded_sampling_alone_and_in_batch(model):
    rng = random.Random(3)
    p = prompt(rng, 11)
    params = dict(max_tokens=10, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    eng = engine(model)
    try:
        (alone, _, _), = run_requests(eng, [Request(p, SamplingParams(**params))])
        others = [Request(prompt(rng, rng.randint(1, 40)),
                          SamplingParams(max_tokens=rng.randint(3, 15), temperature=0.8, seed=i,
                                         ignore_eos=True)) for i in range(7)]
        res = run_requests(eng, others[:3] + [Request(p, SamplingParams(**params))] + others[3:],
                           delays=[0, 0, 0.005, 0.01, 0, 0.02, 0, 0])
    finally:
        eng.shutdown()
    assert res[3][0] == alone


def test_stop_string_logprobs_and_penalties(model):
    rng = random.Random(4)
    p = prompt(rng, 9)
    eng = engine(model)
    try:
        (toks, text, fin), = run_requests(eng, [Request(p, greedy(12, ignore_eos=True))])
        stop = text[4:6]
        first = text.find(stop)
        (t2, text2, fin2), = run_requests(eng, [Request(p, greedy(12, ignore_eos=True, stop=[stop]))])
        (t3, _, fin3), = run_requests(eng, [Request(p, greedy(12, ignore_eos=True,
                                                                stop_token_ids={toks[2]}))])
        (t4, _, _), = run_requests(eng, [Request(p, greedy(12, ignore_eos=True,
                                                             logit_bias={toks[0]: -100}))])

        async def lp():
            s = eng.submit(Request(p, greedy(3, ignore_eos=True, logprobs=True, top_logprobs=4)))
            return [e async for e in s]
        evs = asyncio.run(lp())
    finally:
        eng.shutdown()
    assert text2 == text[:first] and fin2.stop_string == stop and fin2.finish_reason == "stop"
    assert t3 == toks[:3] and fin3.stop_token_id == toks[2] and fin3.completion_tokens == 3  # the stop token is one
    assert t4[0] != toks[0]
    for e in evs[:-1]:
        assert e.top_logprobs[0][0] == e.token_id and abs(e.top_logprobs[0][1] - e.logprob) < 1e-5
        assert len(e.top_logprobs) == 4


def test_errors_overload_and_too_long(model):
    eng = engine(model, max_waiting=0, num_blocks=8, block_size=8)
    try:
        async def main():
            with pytest.raises(EngineOverloaded):
                eng.submit(Request([1, 2], greedy(2)))
        asyncio.run(main())
    finally:
        eng.shutdown()
    eng = engine(model, num_blocks=8, block_size=8)
    try:
        assert eng.max_model_len == 64

        async def main():
            with pytest.raises(PromptTooLong):
                eng.submit(Request([1] * 64, greedy(2)))

            def bad_grammar():
                raise ValueError("bad schema")
            bad = collect(eng, Request([1, 2, 3], greedy(4, grammar=bad_grammar)))
            good = collect(eng, Request([1, 2, 3], greedy(4, ignore_eos=True)))
            return await asyncio.gather(bad, good)
        (_, _, fb), (tg, _, fg) = asyncio.run(main())
        assert fb.finish_reason == "error" and "bad schema" in fb.error
        assert fg.finish_reason == "length" and len(tg) == 4
        # max_tokens is capped by the context
        (t, _, f), = run_requests(eng, [Request([1] * 60, greedy(100, ignore_eos=True))])
        assert len(t) == 4 and f.finish_reason == "length"
    finally:
        eng.shutdown()


def test_engine_death_fails_requests_and_submits(model):
    eng = engine(model)

    def boom(plan, **kw):
        raise RuntimeError("kernel exploded")
    eng.runner.run = boom

    async def main():
        res = await collect(eng, Request([1, 2, 3], greedy(4)))
        with pytest.raises(EngineDead):
            eng.submit(Request([1], greedy(1)))
        return res
    _, _, fin = asyncio.run(main())
    assert fin.finish_reason == "error" and "kernel exploded" in fin.error
    assert not eng.alive and "kernel exploded" in eng.error
    eng.shutdown()


def test_abort_and_shutdown(model):
    eng = engine(model)

    async def main():
        s = eng.submit(Request([1, 2, 3], greedy(10_000, ignore_eos=True)))
        n = 0
        async for ev in s:
            n += 1
            if n == 3:
                eng.abort(s.request_id)
            if isinstance(ev, FinishEvent):
                return ev
    fin = asyncio.run(main())
    assert fin.finish_reason == "abort" and fin.completion_tokens >= 3

    async def main2():
        s = eng.submit(Request([1, 2, 3], greedy(10_000, ignore_eos=True)))
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        return [e async for e in s][-1]
    fin = asyncio.run(main2())
    assert fin.finish_reason == "abort" and not eng.alive
    assert eng.allocator.num_free == eng.allocator.num_blocks


def test_thousand_random_requests_no_leaks(model):
    small = tiny_model(5, layers=1, hidden=32, heads=2, kv_heads=1, vocab=53)
    rng = random.Random(5)
    eng = Engine(small, ToyTokenizer(53), EngineConfig(num_blocks=24, block_size=4, max_num_seqs=8,
                                                     max_num_batched_tokens=32, max_waiting=2000))
    eng.start()
    start_free = eng.allocator.num_free

    async def one(i):
        await asyncio.sleep(rng.random() * 2.0)
        n = rng.randint(1, 40)
        p = [rng.randrange(1, 6) for _ in range(n)]  # low entropy: prefix hits
        params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0, 0.8]),
                                seed=rng.randrange(100), top_k=rng.choice([0, 5]),
                                stop=rng.choice([[], ["ab"]]))
        s = eng.submit(Request(p, params))
        abort_after = rng.choice([None, None, None, 0, 2, 5])
        events = []
        async for ev in s:
            events.append(ev)
            if abort_after is not None and len(events) > abort_after:
                eng.abort(s.request_id)
                abort_after = None
        assert isinstance(events[-1], FinishEvent)
        assert sum(isinstance(e, FinishEvent) for e in events) == 1
        return events[-1]

    async def main():
        return await asyncio.gather(*(one(i) for i in range(1000)))
    try:
        fins = asyncio.run(main())
        stats = eng.stats()
    finally:
        eng.shutdown()
    reasons = {f.finish_reason for f in fins}
    assert "error" not in reasons and "abort" in reasons
    assert stats["num_preemptions_total"] > 0, "the pool was meant to force preemption"
    assert stats["prefix_cache_hits_total"] > 0
    assert eng.allocator.num_free == start_free == eng.allocator.num_blocks
    assert all(r == 0 for r in eng.allocator.refcount)
    eng.allocator.check()
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0


def test_kv_cache_dtype_flag(model):
    """``--kv-cache-dtype`` (vLLM's name) sets the dense pool's dtype; auto keeps the
    model's, but a float32 model gets float16 KV (llama.cpp's default f16 cache)."""
    from mlxfast.kv.block_pool import default_kv_dtype
    from mlxfast.serve import _engine_config, build_parser

    assert default_kv_dtype(mx.float32) == mx.float16
    assert default_kv_dtype(mx.bfloat16) == mx.bfloat16
    assert default_kv_dtype(mx.float16) == mx.float16
    for name, want in ((None, default_kv_dtype(model.dtype)), ("float32", mx.float32)):
        eng = engine(model, kv_dtype=name)
        try:
            assert {a.dtype for a in eng.pool.arrays()} == {want}, name
        finally:
            eng.shutdown()

    assert _engine_config(build_parser().parse_args([])).kv_dtype is None
    cfg = _engine_config(build_parser().parse_args(["--kv-cache-dtype", "float16"]))
    assert cfg.kv_dtype == "float16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-cache-dtype", "int3"])
    eng = engine(model, kv_dtype=cfg.kv_dtype)
    try:
        assert {a.dtype for a in eng.pool.arrays()} == {mx.float16}
        toks, _, fin = run_requests(eng, [Request([5, 6, 7], greedy(6, ignore_eos=True))])[0]
        assert len(toks) == 6 and fin.finish_reason == "length"
    finally:
        eng.shutdown()


def test_engine_and_the_route_tests_fake_implement_the_server_contract():
    """The server depends on engine.api.EngineLike only; both engines have it all."""
    from conftest import FakeEngine

    from mlxfast.engine.api import EngineLike

    eng = Engine(tiny_model(0), ToyTokenizer(), EngineConfig(num_blocks=16, block_size=8))
    assert isinstance(eng, EngineLike)
    assert isinstance(FakeEngine(ToyTokenizer(), lambda r: ""), EngineLike)
    assert not isinstance(object(), EngineLike)
