"""Speculative decoding in the engine: drafts change no token.

A tiny random model copies nothing, so most checks draft from an oracle: the
continuation that decoding without speculation gives, corrupted at every
fifth position, so that every step sees accepted runs and rejections. The
n-gram proposer and the draft-length rule have their own unit tests, and the
default model checks the real proposer end to end."""

from __future__ import annotations

import math
import random

import mlx.core as mx
import numpy as np
import pytest

import mlxfast.engine.spec as spec_mod
from engine_utils import ToyTokenizer, greedy, reference_proposer, run_requests, tiny_model
from mlxfast import ops
from mlxfast.engine.api import Request, SamplingParams
from mlxfast.engine.config import EngineConfig
from mlxfast.engine.engine import Engine
from mlxfast.engine.draft import STEADY_GAP
from mlxfast.engine.spec import Acceptance, MatchAcceptance, NgramProposer, StepCost, select

VOCAB = 97
N = 40
PROMPTS = [[(7 * i + 3 * j) % 90 + 5 for j in range(6 + 5 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(0, vocab=VOCAB)


@pytest.fixture(scope="module")
def tok():
    return ToyTokenizer(VOCAB)


def engine(model, tok, spec=True, **kw):
    cfg = dict(num_blocks=256, block_size=4, max_num_batched_tokens=64, spec_kind="ngram" if spec else None)
    cfg.update(kw)
    return Engine(model, tok, EngineConfig(**cfg)).start()


def run(model, tok, requests, spec=True, delays=None, **kw):
    eng = engine(model, tok, spec, **kw)
    try:
        return run_requests(eng, requests, delays), eng.stats()
    finally:
        eng.shutdown()


Oracle = reference_proposer(VOCAB, 5)


@pytest.fixture
def verify_all(monkeypatch):
    """Every proposed draft token is verified (the checks of verification
    must not depend on which drafts the cost model finds worth it)."""
    monkeypatch.setattr(spec_mod, "select", lambda candidates, *a, **k: [len(c) for c in candidates])


@pytest.fixture
def oracle(monkeypatch, verify_all):
    monkeypatch.setattr(spec_mod, "NgramProposer", Oracle)
    Oracle.REFERENCE = {}
    return Oracle


@pytest.fixture(scope="module")
def reference(model, tok):
    """Greedy continuations without speculation, ignoring EOS."""
    res, _ = run(model, tok, [Request(p, greedy(N, ignore_eos=True)) for p in PROMPTS], spec=False)
    return [toks for toks, _, _ in res]


def test_greedy_with_drafts_is_greedy_without(model, tok, reference, oracle):
    oracle.REFERENCE = {tuple(p): r for p, r in zip(PROMPTS, reference)}
    res, stats = run(model, tok, [Request(p, greedy(N, ignore_eos=True)) for p in PROMPTS],
                     delays=[0, 0, 0.01, 0.02, 0.03, 0.05, 0.08, 0.1])
    assert [toks for toks, _, _ in res] == reference
    spec = stats["spec_decode"]
    assert spec["num_accepted_tokens"] > N  # runs of drafts were accepted ...
    assert spec["num_draft_tokens"] > spec["num_accepted_tokens"]  # ... and some rejected
    for _, _, fin in res:
        assert fin.completion_tokens == N
        assert fin.speculation["drafted"] >= fin.speculation["accepted"] > 0


def test_drafts_save_steps(model, tok, reference, oracle):
    oracle.REFERENCE = {tuple(p): r for p, r in zip(PROMPTS, reference)}
    reqs = [Request(p, greedy(N, ignore_eos=True)) for p in PROMPTS]
    _, plain = run(model, tok, reqs, spec=False)
    res, spec = run(model, tok, reqs)
    assert [toks for toks, _, _ in res] == reference
    assert spec["num_steps"] < plain["num_steps"] * 0.7  # accepted drafts came with the next token


def test_max_tokens_ends_inside_an_accepted_run(model, tok, reference, oracle):
    oracle.REFERENCE = {tuple(PROMPTS[3]): reference[3]}
    reqs = [Request(PROMPTS[3], greedy(m, ignore_eos=True)) for m in range(1, 21)]
    res, _ = run(model, tok, reqs)
    for m, (toks, _, fin) in zip(range(1, 21), res):
        assert toks == reference[3][:m] and fin.finish_reason == "length" and fin.completion_tokens == m


def test_a_stop_token_inside_an_accepted_run(model, tok, reference, oracle):
    oracle.REFERENCE = {tuple(p): r for p, r in zip(PROMPTS, reference)}
    stops = []
    for r in reference:  # a token that first appears well into the output
        j = next(j for j in range(8, N) if r[j] not in r[:j])
        stops.append((r[j], j))
    reqs = [Request(p, greedy(N, stop_token_ids={t}, ignore_eos=True)) for p, (t, _) in zip(PROMPTS, stops)]
    plain, _ = run(model, tok, reqs, spec=False)
    spec, _ = run(model, tok, reqs)
    for (t, j), r, (ptoks, _, pfin), (stoks, _, sfin) in zip(stops, reference, plain, spec):
        assert stoks == ptoks == r[:j + 1]  # the stop token is the last
        assert sfin.finish_reason == pfin.finish_reason == "stop" and sfin.stop_token_id == t
        assert sfin.completion_tokens == pfin.completion_tokens


def test_min_tokens_under_speculation_is_min_tokens_without(model, tok, reference, oracle):
    """The stop token is banned by position (drafts verified at their own
    positions): drafts that would stop short of min_tokens are rejected,
    and the output is what decoding without speculation gives."""
    oracle.REFERENCE = {tuple(p): r for p, r in zip(PROMPTS, reference)}
    reqs = []
    for p, r in zip(PROMPTS, reference):
        j = next(j for j in range(4, N) if r[j] not in r[:j])
        reqs.append(Request(p, greedy(N, stop_token_ids={r[j]}, ignore_eos=True, min_tokens=j + 3)))
    plain, _ = run(model, tok, reqs, spec=False)
    spec, stats = run(model, tok, reqs)
    assert stats["spec_decode"]["num_accepted_tokens"] > 0
    for req, (ptoks, _, pfin), (stoks, _, sfin) in zip(reqs, plain, spec):
        (t,) = req.params.stop_token_ids
        assert stoks == ptoks and sfin.finish_reason == pfin.finish_reason
        assert len(stoks) >= req.params.min_tokens and t not in stoks[:req.params.min_tokens]


def test_a_stop_string_inside_an_accepted_run(model, tok, reference, oracle):
    oracle.REFERENCE = {tuple(p): r for p, r in zip(PROMPTS, reference)}
    reqs = []
    for p, r in zip(PROMPTS, reference):
        text = tok.decode(r)
        stop = next(text[i:i + 2] for i in range(10, len(text) - 2) if text[i:i + 2] not in text[:i + 1])
        reqs.append(Request(p, greedy(N, stop=[stop], ignore_eos=True)))
    plain, _ = run(model, tok, reqs, spec=False)
    spec, _ = run(model, tok, reqs)
    for (ptoks, ptext, pfin), (stoks, stext, sfin) in zip(plain, spec):
        assert (stext, sfin.stop_string, sfin.finish_reason) == (ptext, pfin.stop_string, "stop")
        assert sfin.completion_tokens == pfin.completion_tokens  # what came after the stop is dropped


def test_preemption_under_speculation(model, tok, reference, oracle):
    oracle.REFERENCE = {tuple(p): r for p, r in zip(PROMPTS, reference)}
    res, stats = run(model, tok, [Request(p, greedy(N, ignore_eos=True)) for p in PROMPTS], num_blocks=40)
    assert stats["num_preemptions_total"] > 0
    assert [toks for toks, _, _ in res] == reference


def sampled(seed, n=N, **kw):
    return SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True, **kw)


def test_seeded_sampling_with_drafts_is_sampling_without(model, tok, oracle):
    reqs = [Request(p, sampled(100 + i, logprobs=True, top_logprobs=2)) for i, p in enumerate(PROMPTS)]
    plain, _ = run(model, tok, reqs, spec=False)
    oracle.REFERENCE = {tuple(p): toks for p, (toks, _, _) in zip(PROMPTS, plain)}
    spec, stats = run(model, tok, reqs)
    assert stats["spec_decode"]["num_accepted_tokens"] > N
    for (ptoks, _, _), (stoks, _, _) in zip(plain, spec):
        assert stoks == ptoks


def test_logprobs_are_each_positions_own(model, tok, reference, oracle):
    """Logprobs of tokens that came as accepted drafts are those of the
    position they were sampled at: equal to decoding without speculation."""
    import asyncio

    oracle.REFERENCE = {tuple(PROMPTS[2]): reference[2]}

    async def events(eng):
        return [ev async for ev in eng.submit(Request(PROMPTS[2], greedy(N, logprobs=True, top_logprobs=3,
                                                                         ignore_eos=True)))]

    out = []
    for spec in (False, True):
        eng = engine(model, tok, spec)
        try:
            out.append([(e.token_id, e.logprob, e.top_logprobs) for e in asyncio.run(events(eng))
                        if hasattr(e, "token_id")])
        finally:
            eng.shutdown()
    assert [t for t, _, _ in out[0]] == [t for t, _, _ in out[1]]
    for (_, lp0, top0), (_, lp1, top1) in zip(*out):
        assert lp1 == pytest.approx(lp0, abs=1e-4)
        assert [t for t, _ in top1] == [t for t, _ in top0]


def test_rejected_drafts_leave_no_kv_a_prefix_hit_reads(model, tok, reference, oracle):
    """After runs with rejected drafts, a prompt that extends the first
    request's output reads its cached blocks (written by accepted drafts,
    next to rejected ones) and continues exactly as a cold engine does."""
    oracle.REFERENCE = {tuple(PROMPTS[4]): reference[4]}
    longer = PROMPTS[4] + reference[4][:30]
    cold, _ = run(model, tok, [Request(longer, greedy(12, ignore_eos=True))], spec=False,
                  enable_prefix_cache=False)
    eng = engine(model, tok)
    try:
        (first, _, ffin), = run_requests(eng, [Request(PROMPTS[4], greedy(N, ignore_eos=True))])
        (hit, _, fin), = run_requests(eng, [Request(longer, greedy(12, ignore_eos=True))])
    finally:
        eng.shutdown()
    assert first == reference[4] and ffin.speculation["drafted"] > ffin.speculation["accepted"]
    assert fin.cached_tokens > len(PROMPTS[4])  # blocks that accepted drafts filled
    assert hit == cold[0][0]


@pytest.mark.parametrize("kv_quant", ["8", "turbo"])
def test_quantized_kv_under_speculation(model, tok, oracle, kv_quant):
    """Verified rows write quantized K/V and read it back in the same step:
    the tokens are those of decoding one token a step over the same scheme."""
    reqs = [Request(p, greedy(N, ignore_eos=True)) for p in PROMPTS[:4]]
    plain, _ = run(model, tok, reqs, spec=False, kv_quant=kv_quant, kv_group_size=16)
    oracle.REFERENCE = {tuple(p): toks for p, (toks, _, _) in zip(PROMPTS, plain)}
    spec, stats = run(model, tok, reqs, kv_quant=kv_quant, kv_group_size=16)
    assert [t for t, _, _ in spec] == [t for t, _, _ in plain]
    s = stats["spec_decode"]
    assert s["num_draft_tokens"] > s["num_accepted_tokens"] > N


def test_blocks_filled_under_speculation_restore_from_the_ssd_tier(model, tok, reference, oracle, tmp_path):
    """Blocks filled by accepted drafts (rejected ones beside them) go to the
    SSD tier; a fresh engine restores them and continues as a cold one."""
    oracle.REFERENCE = {tuple(PROMPTS[4]): reference[4]}
    longer = PROMPTS[4] + reference[4] + [5, 6, 7]
    eng = engine(model, tok, ssd_cache_dir=str(tmp_path))
    try:
        (first, _, ffin), = run_requests(eng, [Request(PROMPTS[4], greedy(N, ignore_eos=True))])
        assert eng.flush_cache(30)["durable"]
    finally:
        eng.shutdown()
    assert first == reference[4] and ffin.speculation["drafted"] > ffin.speculation["accepted"] > 0
    cold, _ = run(model, tok, [Request(longer, greedy(12, ignore_eos=True))], spec=False,
                  enable_prefix_cache=False)
    eng = engine(model, tok, spec=False, ssd_cache_dir=str(tmp_path))
    try:
        (hit, _, fin), = run_requests(eng, [Request(longer, greedy(12, ignore_eos=True))])
        restored = eng.stats()["ssd"]["restored_blocks"]
    finally:
        eng.shutdown()
    assert hit == cold[0][0]
    full = (len(PROMPTS[4]) + N - 1) // 4  # every full block of the first request (block_size 4)
    assert restored == full and fin.cached_tokens == full * 4


def test_penalties_and_grammars_decode_plainly(model, tok, reference, oracle):
    oracle.REFERENCE = {tuple(p): r for p, r in zip(PROMPTS, reference)}
    reqs = [Request(PROMPTS[0], greedy(N, ignore_eos=True, repetition_penalty=1.3)),
            Request(PROMPTS[1], greedy(N, ignore_eos=True, presence_penalty=0.5))]
    plain, _ = run(model, tok, reqs, spec=False)
    spec, _ = run(model, tok, reqs)
    for (ptoks, _, _), (stoks, _, sfin) in zip(plain, spec):
        assert stoks == ptoks and sfin.speculation == {"drafted": 0, "accepted": 0}


def next_token_probs(model, ids) -> np.ndarray:
    from mlxfast.kv import DenseKVCache

    logits = model(mx.array([ids]), DenseKVCache(len(model.layers)))[0, -1].astype(mx.float32)
    return np.array(mx.softmax(logits))


def test_speculative_sampling_follows_the_target_distribution(model, tok, monkeypatch, verify_all):
    """A deliberately bad draft (always the same token): the first two
    sampled tokens still follow the model's joint distribution (chi-square,
    p > 0.001 over cells with an expected count of 5 or more)."""
    prompt = PROMPTS[1]
    p1 = next_token_probs(model, prompt)
    draft_token = int(np.argmax(p1))  # often right at position 1, so the draft is verified past it

    class Bad:
        match = 1

        def __init__(self, *a):
            pass

        def propose(self, tokens, k):
            return [draft_token] * k

    monkeypatch.setattr(spec_mod, "NgramProposer", Bad)
    n = 600
    reqs = [Request(prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True))
            for s in range(n)]
    res, stats = run(model, tok, reqs, max_num_seqs=16, max_num_batched_tokens=128, max_waiting=1024)
    assert stats["spec_decode"]["num_accepted_tokens"] > 0
    firsts = [toks[0] for toks, _, _ in res]
    pairs = {}
    for toks, _, _ in res:
        pairs[(toks[0], toks[1])] = pairs.get((toks[0], toks[1]), 0) + 1
    # the exact joint p(t1) p(t2 | t1) for the first tokens that occurred
    expected = {}
    for t1 in set(firsts):
        p2 = next_token_probs(model, prompt + [t1])
        for t2 in range(VOCAB):
            expected[(t1, t2)] = n * p1[t1] * p2[t2]
    cells = [c for c, e in expected.items() if e >= 5]
    assert len(cells) >= 5
    rest_e = n - sum(expected[c] for c in cells)
    rest_o = n - sum(pairs.get(c, 0) for c in cells)
    chi2 = sum((pairs.get(c, 0) - expected[c]) ** 2 / expected[c] for c in cells)
    if rest_e >= 5:
        chi2 += (rest_o - rest_e) ** 2 / rest_e
    dof = len(cells) - (0 if rest_e >= 5 else 1)
    # Wilson-Hilferty: the chi-square quantile for p = 0.001
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < crit, (chi2, crit, dof)


# ---------------------------------------------------------------- the proposer


def test_ngram_proposer_finds_the_longest_earlier_match():
    p = NgramProposer(1, 4)
    tokens = [1, 2, 3, 4, 9, 9, 1, 2, 3]
    assert p.propose(tokens, 3) == [4, 9, 9]  # "1 2 3" occurred before: what followed it
    tokens += [5]
    assert p.propose(tokens, 3) == []  # "5" never occurred before
    tokens += [1, 2]
    assert p.propose(tokens, 4) == [3, 5, 1, 2]  # the latest earlier "1 2" wins
    assert p.propose(tokens, 0) == []


def test_ngram_proposer_matches_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(50):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]
        p = NgramProposer(2, 3)
        grown = tokens[:2]
        for t in tokens[2:]:
            grown.append(t)
            got = p.propose(list(grown), 5)
            want = []
            for n in (3, 2):
                if len(grown) > n:
                    ends = [i for i in range(n, len(grown)) if grown[i - n:i] == grown[-n:]]
                    if ends:
                        want = grown[ends[-1]:ends[-1] + 5]
                        break
            assert got == want, (grown, got, want)


def test_a_draft_models_new_rows_start_from_the_pooled_rate():
    """A draft model predicts a target about as well from one request to the
    next: a new row's prior is the drafter's pooled rate over every row's
    recent drafts (at 1/2 a request's first steps went undrafted), and its
    own drafts soon outweigh it."""
    from types import SimpleNamespace

    from mlxfast.engine.spec import Drafter, RowSpec

    d = Drafter(3, draft_model=SimpleNamespace(accepted=lambda *a: None))
    assert RowSpec(1, 4, pooled=d.pooled).acceptance.alpha == 0.5  # nothing drafted yet
    old = SimpleNamespace(tokens=list(range(20)), data=SimpleNamespace(spec=RowSpec(1, 4, pooled=d.pooled)))
    for _ in range(8):
        d.verified(old, len(old.tokens), [1, 2, 3, 4], 3, 3)
    new = RowSpec(1, 4, pooled=d.pooled).acceptance
    assert new.alpha == pytest.approx(d.pooled.alpha) and new.alpha > 0.9
    for _ in range(6):
        new.observe(3, 0)
    assert new.alpha < 0.4
    assert Acceptance().alpha == 0.5


def test_ngram_proposer_reports_its_context_match():
    p = NgramProposer(1, 4)
    assert p.propose([7, 1, 2, 3, 4, 9, 8, 1, 2, 3], 3) == [4, 9, 8] and p.match == 3  # 7 != 8 before it
    p = NgramProposer(1, 2)
    assert p.propose([5, 1, 2, 3, 4, 9, 5, 1, 2, 3], 2) == [4, 9] and p.match == 4  # past the 2-gram
    block = list(range(100, 140))
    p = NgramProposer(1, 4)
    assert p.propose(block + block[:35], 2) == block[35:37] and p.match == spec_mod.MATCH_CAP
    assert p.propose([1, 2, 3], 4) == [] and p.match == 0


def test_acceptance_follows_recent_drafts_and_recovers_when_idle():
    a = Acceptance()
    assert a.alpha == 0.5  # the prior
    for _ in range(10):
        a.observe(8, 8)
    assert a.alpha > 0.95
    for _ in range(10):
        a.observe(4, 0)
    assert a.alpha < 0.3  # recent rejections weigh most
    low = a.alpha
    for _ in range(30):
        a.idle()
    assert low < a.alpha < 0.55  # steps without drafts pull it back toward the prior


def test_match_acceptance_learns_by_match_length():
    m = MatchAcceptance()
    assert m.rate(3) == 0.5 and m.chances(3, 2) == [0.5, 0.25]  # the prior
    for _ in range(200):
        m.observe(1, [5], [6])  # one-token matches: wrong
        m.observe(3, [5], [6])
        m.observe(8, [1, 2, 3], [1, 2, 3])  # long ones: right, and each token lengthens the match
    assert m.rate(1) < 0.05 and m.rate(3) < 0.05 and m.rate(8) > 0.95 and m.rate(10) > 0.95
    assert m.rate(2) == 0.5  # a band not seen stays at the prior ...
    assert m.rate(32) == m.rate(1000) == m.rate(10)  # ... unless a shorter match does better
    assert m.chances(8, 3) == pytest.approx([m.rate(8), m.rate(8) * m.rate(9), m.rate(8) * m.rate(9) * m.rate(10)])
    before = list(m.trials)
    m.observe(2, [1, 2, 3], [1, 7, 3])  # agrees once, then not: the third token is no trial
    grew = [round(t - b * m.DECAY, 6) for t, b in zip(m.trials, before)]
    assert grew[m.band(2)] == 1 and grew[m.band(3)] == 1 and grew[m.band(4)] == 0


def test_step_cost_learns_a_curve_not_a_line():
    c = StepCost(base=5e-3, per_token=5e-4)
    assert c.seconds(4) == pytest.approx(7e-3)  # the prior, before any step
    curve = {t: 6e-3 + 8e-4 * (t - 1) + (4e-3 if t > 16 else 0.0) for t in range(1, 25)}  # a path switch at 17
    for _ in range(30):
        for t, v in curve.items():
            c.observe(t, v)
    for t in (1, 9, 16, 17, 24):
        assert c.seconds(t) == pytest.approx(curve[t], rel=1e-3)
    c.observe(9, 10 * curve[9])  # one stall moves a count's average by a fifth of 2x at most (1.2x) ...
    assert curve[9] < c.seconds(9) < curve[9] * 1.2 and c.seconds(9) == pytest.approx(c.seconds(10))  # pooled
    assert c.seconds(8) == pytest.approx(curve[8], rel=1e-3)
    for _ in range(40):
        c.observe(9, curve[9])
    c.observe(600, 0.2)
    assert c.seconds(312) == pytest.approx(curve[24] + (0.2 - curve[24]) * (312 - 24) / (576 - 24))  # between counts
    slope = (0.2 - curve[24]) / (576 - 24)
    assert c.seconds(700) == pytest.approx(0.2 + slope * (700 - 576))  # past the end: the last two's slope
    one = StepCost()
    one.observe(1, 6e-3)
    assert one.seconds(3) == pytest.approx(6e-3 * (1 + 2 * StepCost.FIRST_SLOPE))  # one count seen: optimistic
    for _ in range(30):
        c.observe(20, 1e-3)  # a noisy fast step never makes more tokens look cheaper than fewer
    assert c.seconds(20) == pytest.approx(c.seconds(19))


def test_a_stalled_shorter_count_does_not_make_drafts_free():
    """Eight rows decode plainly at 42 ms a step, a ninth token costs 10 ms
    more; one stalled 6-token step (60 ms) must not make 8 and 9 tokens cost
    the same (a running maximum did: every draft then looked free)."""
    c = StepCost()
    for _ in range(40):
        c.observe(8, 42e-3)
    for _ in range(5):
        c.observe(9, 52e-3)
    c.observe(6, 60e-3)
    assert c.seconds(9) - c.seconds(8) > 8e-3
    assert select([[0.17]] * 8, 8, 8, c) == [0] * 8  # prose's 1-token matches at eight streams
    assert select([[0.99, 0.98, 0.97]], 1, 1, one_row_cost()) == [3]  # one row's copy still drafts


def test_drafting_pays_the_host_work_of_the_step_it_keeps_from_being_built_ahead(model, tok, reference, oracle):
    """Undrafted prompt-lookup steps are built ahead; a drafting step's
    successor cannot be, so a draft that pays by the step's own time alone
    (eight rows, a 95% token) does not once that host work is counted; the
    engine measures it on steps nothing overlapped."""
    from mlxfast.engine.spec import Drafter

    c = StepCost()
    for _ in range(20):
        c.observe(8, 28e-3)
        c.observe(9, 31e-3)
    assert select([[0.95]] + [[]] * 7, 8, 8, c) == [1] + [0] * 7
    assert select([[0.95]] + [[]] * 7, 8, 8, c, surcharge=2.2e-3) == [0] * 8
    d = Drafter(8)
    d.host_done(2e-3)
    d.host_done(4e-3)
    assert d.host == pytest.approx(2e-3 + Drafter.HOST_SMOOTH * 2e-3) and d._surcharge() == d.host
    for other in (Drafter(8, draft_model=object()), Drafter(8, ahead=False)):
        other.host_done(2e-3)  # a draft model's steps are never built ahead, nor any without async scheduling
        assert other.host == 2e-3 and other._surcharge() == 0.0
    oracle.REFERENCE = {tuple(PROMPTS[2]): reference[2]}
    eng = engine(model, tok)
    try:
        run_requests(eng, [Request(PROMPTS[2], greedy(N, ignore_eos=True))])
        assert eng.drafter.host > 0  # its drafting steps were not built ahead
    finally:
        eng.shutdown()


def one_row_cost():
    c = StepCost()
    for t in range(1, 10):
        for _ in range(3):
            c.observe(t, 7.5e-3 + 2.7e-3 * (t - 1))  # the default model, one stream, 2 cores
    return c


def test_a_count_priced_by_a_stall_is_forgotten_and_read_again():
    """A count is read only when a step takes it: one read during a stall
    priced every draft out (as every longer count's floor) for good. Not
    read again within EXPIRE readings, it is forgotten, and drafting is
    tried (and the count measured) again."""
    c = StepCost()
    c.observe(1, 6e-3)
    c.observe(2, 60e-3)  # the first draft's step met a stall
    likely = [[0.9, 0.81, 0.73]]
    assert select(likely, 1, 1, c) == [0] and c.seconds(3) >= 60e-3
    for n in range(1, StepCost.EXPIRE + 1):
        c.observe(1, 6e-3)  # plain steps only
        if select(likely, 1, 1, c) != [0]:
            break
    assert n == StepCost.EXPIRE  # frozen until then, not after
    assert c.seconds(2) < 7e-3 and select(likely, 1, 1, c) == [3]


def test_proposals_not_drafted_are_still_scored():
    """Where no draft pays at first (a prior below the step's threshold, as
    at eight streams), the proposals are still scored against the tokens the
    step produces, so the drafter learns that the row copies and drafts."""
    from types import SimpleNamespace

    from mlxfast.engine.spec import Drafter, RowSpec

    drafter = Drafter(8)
    for t in range(1, 80):
        drafter.cost.observe(t, 6e-3 + 1.2e-3 * (t - 1))  # dear drafts: a 0.5 chance never pays at 8 rows
    text = list(range(10, 300))
    seqs = [SimpleNamespace(tokens=text + text[:5 + i], data=SimpleNamespace(spec=RowSpec(1, 4))) for i in range(8)]
    taken = []
    for _ in range(12):
        drafts = drafter.draft([(s, 8) for s in seqs], 8, 8)
        taken.append(sum(map(len, drafts)))
        for s, d in zip(seqs, drafts):
            at = len(s.tokens) - len(text)
            produced = text[at:at + len(d) + 1]  # the row copies: its drafts are right
            drafter.verified(s, len(s.tokens), produced, len(d), len(d))
            s.tokens += produced
    assert taken[0] == 0 and taken[-1] >= 8, taken


def test_peek_decides_on_the_known_tokens_as_draft_would():
    """A step built ahead gives way to a drafting one exactly where ``draft``
    would draft on the same tokens: a row that copies (a long match) does,
    one whose context recurs nowhere does not; the proposal is kept to be
    scored against the token the next step produces. A draft model's steps
    are never built ahead."""
    from types import SimpleNamespace

    from mlxfast.engine.spec import Drafter, RowSpec

    def row(tokens):
        return SimpleNamespace(tokens=list(tokens), data=SimpleNamespace(spec=RowSpec(1, 4)))

    text = list(range(10, 300))
    copying, novel = row(text + text[:40]), row(range(1000, 1300))
    d = Drafter(8)
    for t in range(1, 80):
        d.cost.observe(t, 6e-3 + 8e-4 * (t - 1))
    for _ in range(40):  # long matches have been right
        d.lookup.observe(32, [1] * 8, [1] * 9)
    assert d.may_build_ahead() and not Drafter(8, draft_model=object()).may_build_ahead()
    toks = copying.tokens + [text[40]]  # the token just sampled: the copy goes on
    assert d.peek([(copying, toks, 8)], 1, 1)
    assert copying.data.spec.proposal == text[41:49] and copying.data.spec.proposed_at == len(toks)
    assert not d.peek([(novel, novel.tokens + [1300], 8)], 1, 1)
    assert not d.peek([(copying, toks, 0)], 1, 1)  # no room for a draft
    copying.tokens.append(text[40])  # the step dropped, the token appended: draft drafts what peek saw
    assert d.draft([(copying, 8)], 1, 1) == [text[41:49]]


def test_select_takes_the_draft_tokens_that_give_the_most_tokens_per_second():
    c = StepCost()
    for t in range(1, 80):
        for _ in range(3):
            c.observe(t, 6e-3 + 8e-4 * (t - 1))  # a draft token: 0.8 ms
    # one stream, 6 ms a step: a likely run pays; a token right one time in twenty does not
    assert select([[0.9, 0.81, 0.73]], 1, 1, c) == [3]
    assert select([[0.05, 0.0025]], 1, 1, c) == [0]
    # eight streams (11.6 ms for 8 tokens): a token must be right ~55% of the time to pay
    assert select([[0.5]] + [[]] * 7, 8, 8, c) == [0] + [0] * 7
    assert select([[0.6]] + [[]] * 7, 8, 8, c) == [1] + [0] * 7
    assert select([[0.97 ** j for j in range(1, 9)], [0.5, 0.25]], 8, 8, c) == [8, 0]
    assert select([], 8, 8, c) == []
    # a path switch past 16 tokens costs more than any further tokens bring: stop before it
    cliff = StepCost()
    for t in range(1, 40):
        cliff.observe(t, 6e-3 + 3e-4 * (t - 1) + (0.03 if t > 16 else 0.0))
    assert select([[0.99 ** j for j in range(1, 21)]], 1, 1, cliff) == [15]
    # and a step past a dearer first token takes it where the ones after it pay for it
    step = StepCost()
    for t in range(1, 12):
        step.observe(t, 6e-3 if t == 1 else 9e-3 + 1e-4 * t)
    assert select([[0.4, 0.36, 0.33, 0.3, 0.27, 0.25, 0.22, 0.2]], 1, 1, step) == [8]


def test_draft_select_all_verifies_every_proposal(model, tok, monkeypatch):
    """A proposer that is always wrong: ``draft_select="all"`` verifies every
    one of its drafts (where the adaptive choice weighs them by their chance
    and cost: test_select_*), and the tokens are the plain ones either way."""

    class Wrong:
        match = 4

        def __init__(self, *a):
            pass

        def propose(self, tokens, k):
            return [(tokens[-1] + 1) % VOCAB] * k if tokens[-1] != 0 else [1] * k

    monkeypatch.setattr(spec_mod, "NgramProposer", Wrong)
    reqs = [Request(PROMPTS[0], greedy(40, ignore_eos=True))]
    plain, _ = run(model, tok, reqs, spec=False)
    adaptive, _ = run(model, tok, reqs)
    every, s_all = run(model, tok, reqs, draft_select="all", num_draft_tokens=4)
    assert [r[0] for r in adaptive] == [r[0] for r in every] == [r[0] for r in plain]
    drafted_all = s_all["spec_decode"]["num_draft_tokens"]
    # every step but the last ones (room for fewer) verifies 4 tokens, nearly all of them rejected
    assert drafted_all >= 4 * 30 and s_all["spec_decode"]["num_accepted_tokens"] <= drafted_all // 4


@pytest.mark.parametrize("cfg", [dict(spec_kind="eagle"), dict(spec_kind="ngram", num_draft_tokens=0),
                                 dict(spec_kind="ngram", num_draft_tokens=33),
                                 dict(spec_kind="ngram", ngram_min=3, ngram_max=2),
                                 dict(spec_kind="ngram", draft_select="every")])
def test_bad_speculation_settings_are_refused(model, tok, cfg):
    with pytest.raises(ValueError):
        Engine(model, tok, EngineConfig(num_blocks=16, **cfg))


# ---------------------------------------------------------------- the default model, the real proposer


CODE = '''def mean(values):
    """The arithmetic mean of a list of numbers."""
    total = 0
    for v in values:
        total += v
    return total / len(values)
'''
ASKS = ["Copy this code exactly:\n\n" + CODE, "Repeat this text twice: the quick brown fox jumps over the lazy dog.",
        "Copy this code, then explain it in one line:\n\n" + CODE, "Count from 1 to 20, separated by commas.",
        "Write the alphabet in capitals, with spaces.", "Say 'hello world' three times.",
        "Copy this list: apples, pears, plums, cherries, grapes, lemons.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def default_model():
    import mlxfast

    return mlxfast.load()


@pytest.mark.slow
@pytest.mark.parametrize("stop", [None, ["total"]])
def test_default_model_prompt_lookup_changes_no_token(default_model, stop, verify_all):
    model, tok = default_model

    def ids(q):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
                          add_special_tokens=False)

    reqs = [Request(ids(q), SamplingParams(max_tokens=80, temperature=0, stop=stop or [])) for q in ASKS]
    delays = [0.0, 0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5]
    cfg = dict(num_blocks=512, max_num_batched_tokens=256, enable_prefix_cache=False)
    plain, _ = run(model, tok, reqs, spec=False, **cfg)
    spec, stats = run(model, tok, reqs, delays=delays, **cfg)
    alone, _ = run(model, tok, reqs[:1], **cfg)
    for (ptoks, ptext, pfin), (stoks, stext, sfin) in zip(plain, spec):
        assert (stoks, stext, sfin.finish_reason, sfin.completion_tokens) == (
            ptoks, ptext, pfin.finish_reason, pfin.completion_tokens)
    assert alone[0][0] == plain[0][0]
    assert alone[0][2].speculation["accepted"] > 0  # the copy was drafted and taken


@pytest.mark.slow
def test_default_model_logits_do_not_depend_on_the_step(default_model):
    """A position's logits are bit-identical whether its step computes it
    alone (a decode step; past 512 keys the attention splits the keys across
    threads), as one of the k + 1 rows of a verify step, beside another
    sequence's prefill rows, or among 8 streams' verify rows (on AVX2 also
    beside a 200-token prefill chunk). Greedy speculation reproduces plain
    decoding on near-ties only if this holds."""
    from mlxfast.kv.block_pool import KVPool
    from mlxfast.kv.paged import PagedContext, SeqSlice

    model, tok = default_model
    text = " ".join(f"line {i}: the {w} sat by the river." for i, w in enumerate(ASKS * 8))
    ids = tok.encode(text, add_special_tokens=False)
    n, k, bs = 700, 12, 16
    assert len(ids) > n + k + 40
    nb = -(-(n + k + 64) // bs)
    pool = KVPool(model.kv_layers, 2 * nb, bs, mx.float16)
    tables = [[list(range(nb))], [list(range(nb, 2 * nb))]]

    def step(parts, rows):
        """One forward over (sequence, first position, n tokens) parts; the logits at rows."""
        toks = [t for s, p0, m in parts for t in ids[p0:p0 + m]]
        ctx = PagedContext(pool, [SeqSlice(tables[s], p0, m) for s, p0, m in parts])
        out = model(mx.array(toks)[:, None], ctx, logit_rows=mx.array(rows))
        mx.eval(out)
        return out.reshape(len(rows), -1)

    for p0 in range(0, n, 256):
        step([(0, p0, min(256, n - p0))], [0])
    step([(1, 0, 40)], [0])
    alone = [step([(0, n + i, 1)], [0])[0] for i in range(k + 1)]
    verify = step([(0, n, k + 1)], list(range(k + 1)))
    beside = step([(1, 40, 30), (0, n + k, 1)], [30])[0]
    # 8 streams' verify rows: 76 rows, past the GEMVs' (the rows16 GEMM's range)
    batch = step([(1, 70 + 9 * i, 9) for i in range(7)] + [(0, n, k + 1)], list(range(63 + k + 1)))
    for i in range(k + 1):
        assert mx.array_equal(verify[i], alone[i]).item(), f"verify row {i}"
        assert mx.array_equal(batch[63 + i], alone[i]).item(), f"batched verify row {i}"
    assert mx.array_equal(beside, alone[k]).item()
    if ops.cpu_path() == "avx2":  # its linear layers: one arithmetic at every size
        big = step([(1, 40, 200), (0, n, k + 1)], list(range(200, 200 + k + 1)))  # 213 rows
        for i in range(k + 1):
            assert mx.array_equal(big[i], alone[i]).item(), f"row {i} beside a 200-token chunk"


# ---------------------------------------------------------------- a draft model


def half_copy(model):
    """The model's weights in float16: a smaller draft that agrees with it almost always."""
    from mlx.utils import tree_map

    draft = tiny_model(0, vocab=VOCAB)
    draft.update(tree_map(lambda p: p.astype(mx.float16), model.parameters()))
    mx.eval(draft.parameters())
    return draft


@pytest.mark.parametrize("which", ["close", "bad"])
def test_draft_model_drafts_change_no_token(model, tok, reference, verify_all, which):
    draft = half_copy(model) if which == "close" else tiny_model(5, vocab=VOCAB, layers=1)
    kw = dict(spec_kind="model", draft_model=draft, num_draft_tokens=4)
    reqs = [Request(p, greedy(N, ignore_eos=True)) for p in PROMPTS]
    res, stats = run(model, tok, reqs, delays=[0, 0, 0.01, 0.02, 0.03, 0.05, 0.08, 0.1], **kw)
    assert [toks for toks, _, _ in res] == reference
    spec = stats["spec_decode"]
    if which == "close":
        assert spec["num_accepted_tokens"] > 0.8 * spec["num_draft_tokens"] > 0
    else:
        assert spec["num_draft_tokens"] > spec["num_accepted_tokens"]
    sreqs = [Request(p, sampled(100 + i)) for i, p in enumerate(PROMPTS)]
    plain, _ = run(model, tok, sreqs, spec=False)
    spec_res, _ = run(model, tok, sreqs, **kw)
    assert [t for t, _, _ in spec_res] == [t for t, _, _ in plain]


def test_draft_model_with_preemption_and_max_tokens(model, tok, reference, verify_all):
    kw = dict(spec_kind="model", draft_model=half_copy(model), num_draft_tokens=6)
    res, stats = run(model, tok, [Request(p, greedy(N, ignore_eos=True)) for p in PROMPTS], num_blocks=40, **kw)
    assert stats["num_preemptions_total"] > 0
    assert [toks for toks, _, _ in res] == reference
    eng = engine(model, tok, **kw)
    try:
        res = run_requests(eng, [Request(PROMPTS[3], greedy(m, ignore_eos=True)) for m in range(1, 13)])
        pool = eng.drafter.draft_model.alloc
        assert pool.num_free == pool.num_blocks  # finished rows gave their draft blocks back
    finally:
        eng.shutdown()
    assert [toks for toks, _, _ in res] == [reference[3][:m] for m in range(1, 13)]


def test_a_draft_model_catches_up_on_a_long_prompt_over_several_steps(model, tok, verify_all):
    long = [(5 * j) % 90 + 5 for j in range(150)]
    kw = dict(spec_kind="model", draft_model=half_copy(model), num_draft_tokens=4,
              max_num_batched_tokens=32, num_blocks=256)
    plain, _ = run(model, tok, [Request(long, greedy(30, ignore_eos=True))], spec=False, **{
        k: v for k, v in kw.items() if k in ("max_num_batched_tokens", "num_blocks")})
    eng = engine(model, tok, **kw)
    try:
        seen = []
        real = eng.drafter.draft_model.runner.run

        def spy(plan, **kw):
            seen.append(plan.num_tokens)
            return real(plan, **kw)

        eng.drafter.draft_model.runner.run = spy
        (toks, _, fin), = run_requests(eng, [Request(long, greedy(30, ignore_eos=True))])
    finally:
        eng.shutdown()
    assert toks == plain[0][0]
    assert max(seen) <= 32 + 4  # a chunk of the step budget (plus a row's drafts), never the whole prompt
    assert fin.speculation["accepted"] > 0


def test_a_prompts_catch_up_is_not_priced_as_drafting(model, tok, verify_all):
    """A draft model first reads a request's whole prompt (every token, with
    no prefix cache, even where the target's cache held it), in the step it
    first drafts in: once per request, so that forward is no price of
    drafting (read as one, it priced every draft out for good, as in
    bench_spec.py --draft, whose rounds repeat a cached prompt). Every
    draft forward's time is kept out of the target's step price; only
    steady ones price the draft model."""
    long = [(5 * j) % 90 + 5 for j in range(60)]
    eng = engine(model, tok, spec_kind="model", draft_model=half_copy(model), num_draft_tokens=4)
    try:
        drafter = eng.drafter
        target, draft, steps = [], [], []
        real_target, real_draft, real_done = drafter.cost.observe, drafter.draft_cost.observe, drafter.step_done
        drafter.cost.observe = lambda t, s: target.append((t, s)) or real_target(t, s)
        drafter.draft_cost.observe = lambda t, s: draft.append(t) or real_draft(t, s)

        def step_done(tokens, seconds):
            steps.append((tokens, seconds, list(drafter.draft_model.forwards)))
            real_done(tokens, seconds)

        drafter.step_done = step_done
        for _ in range(2):  # the second time, the target's prefix cache holds the prompt
            (toks, _, fin), = run_requests(eng, [Request(long, greedy(20, ignore_eos=True))])
            assert fin.speculation["drafted"] > 0
    finally:
        eng.shutdown()
    forwards = [f for _, _, fs in steps for f in fs]
    catch_ups = [fed for fed, _, steady in forwards if not steady]
    assert len(catch_ups) >= 2 and min(catch_ups) > STEADY_GAP  # one row: a steady forward feeds 1 or 2
    assert draft == [fed for fed, _, steady in forwards if steady] and max(draft) <= STEADY_GAP
    assert len(target) == len(steps)  # every step prices the target, without its draft forwards
    for (tokens, seconds, fs), (t, s) in zip(steps, target):
        assert t == tokens and s == pytest.approx(max(seconds - sum(took for _, took, _ in fs), 1e-6))


def test_select_prices_a_draft_models_forwards():
    """A draft model's j-th token of a row costs its j-th forward, shared by
    the rows drafting that far: at one row of a float32 target (a step
    streams the weights) eight drafts pay; at eight rows (a step is
    compute, a verified token costs about a plain one) none does, though
    the target's curve alone says one per row would."""
    target = StepCost()
    for t in range(1, 80):
        target.observe(t, 25e-3 + 3.2e-3 * max(0, t - 4))
    fwd = StepCost()
    for t in range(1, 40):
        fwd.observe(t, 5e-3 + 0.6e-3 * (t - 1))
    sure = [0.99 ** j for j in range(1, 9)]
    assert select([sure], 1, 1, target, fwd, [2]) == [8]
    assert select([sure[:1]] * 8, 8, 8, target) == [1] * 8  # the forwards unpriced: a loss
    assert select([sure[:1]] * 8, 8, 8, target, fwd, [2] * 8) == [0] * 8
    # free rows (a grammar's forced tokens) cost no forward
    assert select([[1.0, 1.0]] + [sure[:1]] * 7, 8, 8, target, fwd, [0] + [2] * 7) == [2] + [0] * 7


@pytest.mark.parametrize("make,words", [
    (lambda m: tiny_model(5, vocab=VOCAB + 3, layers=1), "vocabulary"),
    (lambda m: tiny_model(5, vocab=VOCAB), "not smaller"),
])
def test_an_unfit_draft_model_is_refused(model, tok, make, words):
    with pytest.raises(ValueError, match=words):
        Engine(model, tok, EngineConfig(num_blocks=16, spec_kind="model", draft_model=make(model)))
    with pytest.raises(ValueError, match="draft model"):
        Engine(model, tok, EngineConfig(num_blocks=16, spec_kind="model"))


@pytest.mark.slow
def test_structured_output_drafts_the_tokens_its_grammar_forces(default_model, verify_all):
    """A JSON schema's keys and punctuation are forced: they come as
    accepted drafts, and the answer is the one decoding without
    speculation gives (greedy and sampled), and it validates."""
    import json

    from mlxfast.server.grammar import GrammarCompiler

    model, tok = default_model
    compiler = GrammarCompiler(tok, model.args.vocab_size)
    schema = {"type": "object", "properties": {"first_name": {"type": "string", "maxLength": 12},
                                               "favourite_number": {"type": "integer"},
                                               "likes_programming": {"type": "boolean"}},
              "required": ["first_name", "favourite_number", "likes_programming"], "additionalProperties": False}
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}],
                                             add_generation_prompt=True), add_special_tokens=False)

    def reqs():
        return [Request(ids, SamplingParams(max_tokens=60, temperature=0, logprobs=True,
                                            grammar=compiler.json_schema(schema))),
                Request(ids, SamplingParams(max_tokens=60, temperature=0.8, seed=3,
                                            grammar=compiler.json_schema(schema)))]

    plain, _ = run(model, tok, reqs(), spec=False, enable_prefix_cache=False)
    spec, stats = run(model, tok, reqs(), enable_prefix_cache=False)
    for (ptoks, ptext, pfin), (stoks, stext, sfin) in zip(plain, spec):
        assert (stoks, stext, sfin.finish_reason) == (ptoks, ptext, pfin.finish_reason)
        assert set(json.loads(stext)) == set(schema["properties"])
        assert sfin.speculation["accepted"] == sfin.speculation["drafted"] > 5  # forced: always taken


@pytest.mark.slow
@pytest.mark.parametrize("schema", [{"type": "object", "properties": {"is_ok": {"type": "boolean"}},
                                     "required": ["is_ok"], "additionalProperties": False},
                                    {"enum": ["alpha", "beta"]}])
def test_a_grammar_that_ends_in_its_forced_tokens_ends_there(default_model, schema, verify_all):
    """The forced run closes the answer (``}``, the rest of an enum value):
    no token is sampled after it, as without speculation, even with
    ignore_eos (an end-of-turn token would break the JSON)."""
    import json

    from mlxfast.server.grammar import GrammarCompiler

    model, tok = default_model
    compiler = GrammarCompiler(tok, model.args.vocab_size)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Answer in JSON."}],
                                             add_generation_prompt=True), add_special_tokens=False)
    for ignore_eos in (False, True):
        def req():
            return [Request(ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=ignore_eos,
                                                grammar=compiler.json_schema(schema)))]

        (ptoks, ptext, pfin), = run(model, tok, req(), spec=False, enable_prefix_cache=False)[0]
        (stoks, stext, sfin), = run(model, tok, req(), enable_prefix_cache=False)[0]
        assert (stoks, stext, sfin.finish_reason, sfin.stop_token_id, sfin.completion_tokens) == (
            ptoks, ptext, pfin.finish_reason, pfin.stop_token_id, pfin.completion_tokens)
        json.loads(stext)
        assert sfin.speculation["drafted"] > 0


@pytest.mark.slow
def test_forced_tokens_carry_their_own_logprobs(default_model, verify_all):
    import asyncio

    from mlxfast.server.grammar import GrammarCompiler

    model, tok = default_model
    compiler = GrammarCompiler(tok, model.args.vocab_size)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "A JSON object, please."}],
                                             add_generation_prompt=True), add_special_tokens=False)
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}},
              "required": ["colour"], "additionalProperties": False}

    async def events(eng):
        req = Request(ids, SamplingParams(max_tokens=30, temperature=0, logprobs=True, top_logprobs=2,
                                          grammar=compiler.json_schema(schema)))
        return [(e.token_id, e.logprob, [t for t, _ in e.top_logprobs]) async for e in eng.submit(req)
                if hasattr(e, "token_id")]

    out = []
    for spec in (False, True):
        eng = engine(model, tok, spec, enable_prefix_cache=False)
        try:
            out.append(asyncio.run(events(eng)))
            drafted = eng.stats()["spec_decode"]["num_accepted_tokens"]
        finally:
            eng.shutdown()
    assert drafted > 0
    assert [t for t, _, _ in out[1]] == [t for t, _, _ in out[0]]
    for (_, lp0, top0), (_, lp1, top1) in zip(*out):
        assert lp1 == pytest.approx(lp0, abs=2e-3) and top1 == top0


@pytest.mark.slow
def test_the_gguf_drafts_for_its_float32_copy(default_model, tmp_path):
    """The issue's draft pairing: target = the default model dequantized to
    float32 (``mlxfast convert --dequantize``), draft = the Q4_1 GGUF. The
    copy computes what the GGUF does, and its drafts are nearly all taken
    without changing a token."""
    import mlxfast
    from mlxfast.convert import convert_gguf
    from mlxfast.kv import DenseKVCache
    from mlxfast.models.loader import default_model_path

    draft, tok = default_model
    target, ttok = mlxfast.load(str(convert_gguf(default_model_path(), tmp_path / "fp32", dequantize=True)))
    assert ttok.vocab_size == tok.vocab_size
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": ASKS[1]}], add_generation_prompt=True),
                     add_special_tokens=False)
    a = target(mx.array([ids]), DenseKVCache(len(target.layers)))[0].astype(mx.float32)
    b = draft(mx.array([ids]), DenseKVCache(len(draft.layers)))[0].astype(mx.float32)
    assert mx.abs(a - b).max().item() < 0.05 * mx.abs(b).max().item()
    reqs = [Request(ids_for, SamplingParams(max_tokens=40, temperature=0)) for ids_for in (
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
                   add_special_tokens=False) for q in ASKS[:4])]
    cfg = dict(num_blocks=512, max_num_batched_tokens=256, enable_prefix_cache=False)
    plain, _ = run(target, tok, reqs, spec=False, **cfg)
    spec, stats = run(target, tok, reqs, spec_kind="model", draft_model=draft, num_draft_tokens=3, **cfg)
    assert [t for t, _, _ in spec] == [t for t, _, _ in plain]
    s = stats["spec_decode"]
    assert s["num_accepted_tokens"] > 0.8 * s["num_draft_tokens"] > 0


def test_steps_that_draft_nothing_are_built_ahead(model, tok, reference, monkeypatch):
    """While no draft pays (prose), every decode step is built ahead (async
    scheduling); once the tokens show drafts that pay, the step built ahead
    is dropped unevaluated for one that drafts. The tokens are those of
    decoding without speculation."""
    monkeypatch.setattr(spec_mod, "NgramProposer", Oracle)
    Oracle.REFERENCE = {tuple(p): r for p, r in zip(PROMPTS, reference)}
    calls = {"n": 0}

    def select(candidates, *a, **k):  # nothing pays for the first ten rounds, then everything
        calls["n"] += 1
        return [0 if calls["n"] <= 10 else len(c) for c in candidates]

    monkeypatch.setattr(spec_mod, "select", select)
    res, stats = run(model, tok, [Request(p, greedy(N, ignore_eos=True)) for p in PROMPTS[:3]])
    assert [toks for toks, _, _ in res] == reference[:3]
    assert stats["num_steps_ahead"] >= 6  # rounds 2-10 each built the next step ahead
    assert stats["num_steps_dropped"] >= 1  # the first round that paid dropped its step
    assert stats["spec_decode"]["num_accepted_tokens"] > 0  # drafting resumed
    # with drafting off for good, every step but the prompt's and the one after it is built ahead
    monkeypatch.setattr(spec_mod, "select", lambda candidates, *a, **k: [0] * len(candidates))
    res, stats = run(model, tok, [Request(PROMPTS[1], greedy(N, ignore_eos=True))])
    assert res[0][0] == reference[1]
    assert stats["num_steps_ahead"] == stats["num_steps"] - 2 and stats["num_steps_dropped"] == 0
    assert stats["spec_decode"]["num_draft_tokens"] == 0


def test_dropped_steps_change_no_sampled_token(model, tok, monkeypatch):
    """Steps built ahead and dropped for drafting steps, again and again,
    under seeded sampling with logprobs: every token and logprob is that of
    decoding without speculation (a dropped step drew nothing)."""
    reqs = [Request(p, sampled(200 + i, logprobs=True, top_logprobs=2)) for i, p in enumerate(PROMPTS[:4])]
    plain, _ = run(model, tok, reqs, spec=False)
    monkeypatch.setattr(spec_mod, "NgramProposer", Oracle)
    Oracle.REFERENCE = {tuple(p): toks for p, (toks, _, _) in zip(PROMPTS, plain)}
    calls = {"n": 0}

    def select(candidates, *a, **k):  # drafts pay on two calls in four (a peek, then its step's draft)
        calls["n"] += 1
        return [len(c) if calls["n"] % 4 in (0, 1) else 0 for c in candidates]

    monkeypatch.setattr(spec_mod, "select", select)
    spec, stats = run(model, tok, reqs)
    assert [t for t, _, _ in spec] == [t for t, _, _ in plain]
    assert stats["num_steps_dropped"] >= 5 and stats["num_steps_ahead"] >= 5
    assert stats["spec_decode"]["num_accepted_tokens"] > 0

