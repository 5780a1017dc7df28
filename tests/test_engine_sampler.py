"""Sampler: vectorised per-row processing, seeds, logprobs (no model)."""

import math

import mlx.core as mx
import numpy as np

from mlxfast.engine.api import SamplingParams
from mlxfast.engine.sampler import SamplingState, sample

V = 50


def state(tokens=(1, 2), prompt_len=2, **kw):
    p = SamplingParams(**kw)
    return SamplingState.create(p, list(tokens), prompt_len)


def logits_rows(rows):
    return mx.array(np.array(rows, np.float32))


def base_logits(seed=0):
    return np.random.default_rng(seed).normal(size=V).astype(np.float32) * 3


def test_greedy_and_logit_bias_ban():
    x = base_logits()
    top = int(x.argmax())
    r = sample(logits_rows([x, x]), [state(temperature=0), state(temperature=0, logit_bias={top: -100})])
    assert r[0].token == top
    assert r[1].token != top and r[1].token == int(np.argsort(-x)[1])


def test_top_k_1_top_p_tiny_min_p_1_equal_greedy():
    x = base_logits(1)
    top = int(x.argmax())
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        for seed in range(5):
            r = sample(logits_rows([x]), [state(temperature=1.5, seed=seed, **kw)])
            assert r[0].token == top, kw


def test_top_k_restricts_support():
    x = base_logits(2)
    allowed = set(np.argsort(-x)[:3].tolist())
    got = {sample(logits_rows([x]), [state(temperature=5.0, top_k=3, seed=s)])[0].token for s in range(60)}
    assert got <= allowed and len(got) > 1


def test_repetition_presence_frequency_penalties():
    x = np.zeros(V, np.float32)
    x[3], x[4] = 2.0, 1.5
    # token 3 seen in the prompt: HF repetition penalty 2 -> 1.0 < 1.5
    assert sample(logits_rows([x]), [state(tokens=[3, 9], prompt_len=2, temperature=0,
                                           repetition_penalty=2.0)])[0].token == 4
    # presence/frequency count only the output: 3 in the prompt only -> no effect
    assert sample(logits_rows([x]), [state(tokens=[3, 9], prompt_len=2, temperature=0,
                                           presence_penalty=1.0)])[0].token == 3
    # 3 generated twice: frequency 0.3*2 = 0.6 -> 1.4 < 1.5
    assert sample(logits_rows([x]), [state(tokens=[9, 3, 3], prompt_len=1, temperature=0,
                                           frequency_penalty=0.3)])[0].token == 4
    assert sample(logits_rows([x]), [state(tokens=[9, 3], prompt_len=1, temperature=0,
                                           presence_penalty=0.6)])[0].token == 4
    # negative logits are multiplied by the repetition penalty
    y = np.full(V, -5.0, np.float32)
    y[3], y[4] = -1.0, -1.5
    assert sample(logits_rows([y]), [state(tokens=[3], prompt_len=1, temperature=0,
                                           repetition_penalty=2.0)])[0].token == 4


def test_seed_is_independent_of_batch_composition():
    x = base_logits(3)
    alone = [sample(logits_rows([x]), [state(temperature=4.0, seed=42, tokens=[1] * (2 + i))])[0].token
             for i in range(8)]
    batched = []
    for i in range(8):
        others = [state(temperature=0.7, seed=s, top_p=0.9) for s in range(5)]
        rows = others[:2] + [state(temperature=4.0, seed=42, tokens=[1] * (2 + i))] + others[2:]
        batched.append(sample(logits_rows([base_logits(9)] * 2 + [x] + [base_logits(8)] * 3), rows)[2].token)
    assert alone == batched
    assert len(set(alone)) > 1  # the step index changes the noise


def test_sampling_follows_the_distribution():
    x = np.full(V, -1e9, np.float32)
    x[0], x[1] = math.log(0.7), math.log(0.3)
    toks = [sample(logits_rows([x]), [state(temperature=1.0, seed=s)])[0].token for s in range(400)]
    frac = toks.count(0) / len(toks)
    assert 0.62 < frac < 0.78


def test_logprobs_are_the_models_distribution():
    x = base_logits(4)
    lp = x - np.log(np.exp(x - x.max()).sum()) - x.max()
    r = sample(logits_rows([x, x]), [state(temperature=0, logprobs=True, top_logprobs=3,
                                           logit_bias={int(x.argmax()): -100}),
                                     state(temperature=0)])
    assert abs(r[0].logprob - lp[r[0].token]) < 1e-4
    want = np.argsort(-lp)[:3]
    assert [t for t, _ in r[0].top_logprobs] == want.tolist()
    assert r[1].logprob is None and r[1].top_logprobs is None


class FakeMatcher:
    """Allows only `allowed`; errors when `fail_at` tokens have been consumed."""

    def __init__(self, allowed, fail_at=None):
        self.allowed, self.fail_at, self.n, self.err = set(allowed), fail_at, 0, False

    def is_error(self):
        return self.err

    def get_error(self):
        return "boom" if self.err else ""

    def compute_bitmask(self):
        bits = np.zeros(((V + 31) // 32) * 32, np.uint8)
        bits[list(self.allowed)] = 1
        return np.packbits(bits, bitorder="little").tobytes()

    def consume_token(self, t):
        self.n += 1
        if t not in self.allowed or (self.fail_at is not None and self.n >= self.fail_at):
            self.err = True
            return False
        return True

    def is_stopped(self):
        return False


def test_grammar_mask_and_error_rows():
    x = base_logits(5)
    ok = state(temperature=0, grammar=lambda: FakeMatcher({7, 8}))
    bad = state(temperature=0, grammar=lambda: FakeMatcher({7}, fail_at=1))
    free = state(temperature=0)
    r = sample(logits_rows([x, x, x]), [ok, bad, free])
    assert r[0].token in (7, 8) and r[0].error is None
    assert r[1].error is not None
    assert r[2].token == int(x.argmax()) and r[2].error is None


def test_min_tokens_bans_the_stop_tokens_by_position():
    """Short of min_tokens a row cannot sample its stop tokens (EOS, stop
    ids); the position counts the tokens out plus ``ahead`` (a verified
    draft's position), and a grammar row is left to its grammar."""
    x = base_logits(3)
    order = np.argsort(-x)
    eos, stop, third = int(order[0]), int(order[1]), int(order[2])

    def st(out, **kw):  # ``out`` tokens generated so far
        return SamplingState.create(SamplingParams(**{"temperature": 0, **kw}), [1, 2] + [7] * out, 2,
                                    {eos, stop})

    rows = [st(0, min_tokens=2), st(1, min_tokens=2), st(2, min_tokens=2), st(0), st(0, min_tokens=2)]
    got = [r.token for r in sample(logits_rows([x] * 5), rows, ahead=[0, 0, 0, 0, 2])]
    assert got == [third, third, eos, eos, eos]
    seeded = [st(0, min_tokens=5, temperature=1.0, seed=s) for s in range(40)]
    assert all(r.token not in (eos, stop) for r in sample(logits_rows([x * 0.1] * 40), seeded))
