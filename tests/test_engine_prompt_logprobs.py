"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``): every prompt
position scored under the model's raw distribution, equal to a teacher-forced
forward over the whole prompt, whatever the chunking, the prefix cache or the
other rows of the batch."""

import asyncio
import random

import mlx.core as mx
import numpy as np
import pytest

from engine_utils import ToyTokenizer, dense_greedy, greedy, tiny_model
from mlxfast.engine.api import FinishEvent, Request, TokenEvent
from mlxfast.engine.config import EngineConfig
from mlxfast.engine.engine import Engine
from mlxfast.engine.scheduler import Scheduler, Seq
from mlxfast.kv import DenseKVCache
from mlxfast.kv.allocator import BlockAllocator

ATOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def teacher_forced(model, prompt) -> np.ndarray:
    """Log-softmax of one plain forward over the whole prompt: row i scores token i + 1."""
    logits = model(mx.array([prompt]), DenseKVCache(len(model.layers)))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def check(plp, prompt, ref, k):
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        e, row, t = plp[i], ref[i - 1], prompt[i]
        assert abs(e.logprob - row[t]) < ATOL, i
        assert int((row > row[t] + ATOL).sum()) + 1 <= e.rank <= int((row >= row[t] - ATOL).sum())
        best = np.argsort(-row, kind="stable")[:k]
        assert len(e.top_logprobs) == k
        assert [tid for tid, _ in e.top_logprobs] == best.tolist()
        np.testing.assert_allclose([v for _, v in e.top_logprobs], row[best], atol=ATOL)


def engine(model, **kw):
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 8)
    kw.setdefault("kv_dtype", "float32")  # the teacher-forced forward keeps fp32 K/V
    return Engine(model, ToyTokenizer(), EngineConfig(**kw)).start()


def scoring(max_tokens, k, **kw):
    return greedy(max_tokens, ignore_eos=True, prompt_logprobs=k, **kw)


async def _events(eng, request, delay):
    if delay:
        await asyncio.sleep(delay)
    return [ev async for ev in eng.submit(request)]


def run(eng, requests, delays=None):
    delays = delays or [0.0] * len(requests)

    async def main():
        return await asyncio.gather(*(_events(eng, r, d) for r, d in zip(requests, delays)))

    return asyncio.run(main())


def split(events):
    """(generated token ids, FinishEvent); the prompt's scores ride on the first event only."""
    assert all(e.prompt_logprobs is None for e in events[1:])
    assert isinstance(events[-1], FinishEvent)
    return [e.token_id for e in events if isinstance(e, TokenEvent)], events[-1]


def rand_prompt(rng, n):
    return [rng.randrange(1, 97) for _ in range(n)]


def test_prompt_logprobs_equal_teacher_forced(model):
    rng = random.Random(3)
    prompts = [rand_prompt(rng, n) for n in (2, 9, 30)]
    eng = engine(model)
    try:
        results = run(eng, [Request(p, scoring(4, 3)) for p in prompts])
    finally:
        eng.shutdown()
    for p, evs in zip(prompts, results):
        toks, fin = split(evs)
        assert isinstance(evs[0], TokenEvent)
        check(evs[0].prompt_logprobs, p, teacher_forced(model, p), 3)
        assert toks == dense_greedy(model, p, 4) and fin.finish_reason == "length"


def test_chunked_prefill_and_max_tokens_zero(model):
    rng = random.Random(4)
    p = rand_prompt(rng, 70)
    eng = engine(model, max_num_batched_tokens=16)  # five prefill chunks
    try:
        (evs,), = [run(eng, [Request(p, scoring(0, 2))])]
        (gen,) = run(eng, [Request(p, scoring(3, 0))])
        (one,) = run(eng, [Request([5], scoring(0, 2))])
        assert eng.stats()["free_blocks"] == eng.stats()["total_blocks"]
    finally:
        eng.shutdown()
    assert len(evs) == 1  # nothing generated: the FinishEvent carries the scores
    fin = evs[0]
    assert fin.finish_reason == "length" and fin.completion_tokens == 0 and fin.prompt_tokens == 70
    ref = teacher_forced(model, p)
    check(fin.prompt_logprobs, p, ref, 2)
    toks, _ = split(gen)
    check(gen[0].prompt_logprobs, p, ref, 0)
    assert toks == dense_greedy(model, p, 3)
    assert len(one) == 1 and one[0].prompt_logprobs == [None] and one[0].finish_reason == "length"


def test_prefix_cache_hit_is_not_taken(model):
    rng = random.Random(5)
    p = rand_prompt(rng, 41)
    eng = engine(model)
    try:
        run(eng, [Request(p, greedy(2, ignore_eos=True))])  # warms the cache with p's blocks
        (scored,) = run(eng, [Request(p, scoring(2, 1))])
        (again,) = run(eng, [Request(p, greedy(2, ignore_eos=True))])
    finally:
        eng.shutdown()
    toks, fin = split(scored)
    assert fin.cached_tokens == 0
    check(scored[0].prompt_logprobs, p, teacher_forced(model, p), 1)
    assert toks == dense_greedy(model, p, 2)
    assert split(again)[1].cached_tokens == 40  # the cache still serves the others


def test_neighbours_in_the_batch_are_unaffected(model):
    rng = random.Random(6)
    plain = [rand_prompt(rng, n) for n in (3, 17, 33, 50)]
    scored = [rand_prompt(rng, n) for n in (29, 45)]
    reqs = [Request(p, greedy(10, ignore_eos=True)) for p in plain]
    reqs += [Request(p, scoring(6, 2)) for p in scored]
    eng = engine(model, max_num_batched_tokens=24)  # chunked prefill next to decodes
    try:
        results = run(eng, reqs, delays=[0.0, 0.01, 0.02, 0.03, 0.005, 0.015])
        assert eng.stats()["num_steps"] < sum(len(p) for p in plain + scored)  # rows shared steps
    finally:
        eng.shutdown()
    for p, evs in zip(plain, results[:4]):
        assert evs[0].prompt_logprobs is None
        assert split(evs)[0] == dense_greedy(model, p, 10)
    for p, evs in zip(scored, results[4:]):
        check(evs[0].prompt_logprobs, p, teacher_forced(model, p), 2)
        assert split(evs)[0] == dense_greedy(model, p, 6)


def test_preempted_while_scoring_rescores_from_the_start(model):
    rng = random.Random(7)
    long_decode = rand_prompt(rng, 40)
    p = rand_prompt(rng, 60)
    # 12 blocks of 8 cannot hold both; the scored prompt is the newest and is preempted.
    eng = engine(model, num_blocks=12, max_num_batched_tokens=16)
    starts = []
    score = eng._score_prompt

    def spy(row, logits):
        starts.append(row.start)
        score(row, logits)
    eng._score_prompt = spy
    try:
        results = run(eng, [Request(long_decode, greedy(50, ignore_eos=True)), Request(p, scoring(2, 1))])
        assert eng.stats()["num_preemptions_total"] > 0
    finally:
        eng.shutdown()
    assert starts.count(0) > 1 and starts.index(0, 1) > 1  # scored some chunks, then again from 0
    assert split(results[0])[0] == dense_greedy(model, long_decode, 50)
    check(results[1][0].prompt_logprobs, p, teacher_forced(model, p), 1)
    assert split(results[1])[0] == dense_greedy(model, p, 2)


def test_bad_prompt_logprobs_ends_only_that_request(model):
    eng = engine(model)
    try:
        bad, good = run(eng, [Request([1, 2, 3], scoring(2, 21)), Request([1, 2, 3], scoring(2, 1))])
    finally:
        eng.shutdown()
    assert bad[-1].finish_reason == "error" and "prompt_logprobs" in bad[-1].error
    assert split(good)[1].finish_reason == "length"


@pytest.mark.slow
def test_default_model_chunked_prefill():
    import mlxfast

    model, tok = mlxfast.load()
    text = "The capital of France is Paris, and the capital of Italy is Rome. " * 5
    p = tok.encode(text, add_special_tokens=True)
    eng = Engine(model, tok, EngineConfig(num_blocks=64, kv_dtype="float32", max_num_batched_tokens=32)).start()
    try:
        (evs,) = run(eng, [Request(p, scoring(0, 2))])
    finally:
        eng.shutdown()
    assert len(p) > 64 and len(evs) == 1
    check(evs[0].prompt_logprobs, p, teacher_forced(model, p), 2)


# ---------------------------------------------------------------- scheduler (pure)


def test_scheduler_scoring_seq_takes_no_prefix_hit_and_max_tokens_zero_samples_nothing():
    alloc = BlockAllocator(32, 4)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    warm = Seq("warm", list(range(1, 11)), max_tokens=1)
    sched.add(warm)
    plan = sched.schedule()
    sched.update(plan, [0] * len(plan.sample_rows))
    plan = sched.schedule()
    sched.update(plan, [0] * len(plan.sample_rows))
    assert warm.status == "finished"

    seq = Seq("s", list(range(1, 11)), max_tokens=0, score_prompt=True)
    sched.add(seq)
    plan = sched.schedule()
    assert [(r.start, r.n, r.sample) for r in plan.rows] == [(0, 8, False)]
    assert sched.update(plan, []) == []
    plan = sched.schedule()
    assert [(r.start, r.n, r.sample) for r in plan.rows] == [(8, 2, False)]
    (u,) = sched.update(plan, [])
    assert u.seq is seq and u.token is None and u.finish_reason == "length"
    assert seq.status == "finished" and seq.num_output == 0 and not sched.has_work()
    assert seq.cached_tokens == 0
