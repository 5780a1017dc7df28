"""The engine on the default model: batching and prefix caching change no token."""

import pytest

import mlxfast
from engine_utils import run_requests
from mlxfast.engine.api import Request, SamplingParams
from mlxfast.engine.config import EngineConfig
from mlxfast.engine.engine import Engine
from mlxfast.generation import stream_generate

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Hi", "What is two plus two?", "Name one nice color, please.", "Write a haiku about the sea and the wind at night.",
    "Why is the sky blue? Answer in one sentence.", "List three fruits.",
    "Translate 'good morning' into French, Spanish and German, one per line please.",
    "Tell me a short fact about the Moon, the Sun, and Mars, in that order, briefly.",
]
N = 6


@pytest.fixture(scope="module")
def loaded():
    return mlxfast.load()  # installed by `make test`; missing must fail, not skip


def ids_for(tok, q):
    text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def oracle(model, tok, ids):
    return [c.token for c in stream_generate(model, tok, ids, max_tokens=N, temp=0.0)
            if c.token is not None and c.token not in tok.eos_token_ids]


def test_eight_staggered_greedy_requests_match_alone(loaded):
    model, tok = loaded
    prompts = [ids_for(tok, q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == len(prompts)
    want = [oracle(model, tok, p) for p in prompts]
    eng = Engine(model, tok, EngineConfig(num_blocks=64, max_num_batched_tokens=64)).start()
    try:
        got = run_requests(eng, [Request(p, SamplingParams(max_tokens=N, temperature=0)) for p in prompts],
                           delays=[0.0, 0.0, 0.3, 0.6, 0.9, 1.2, 1.5, 1.8])
        alone = run_requests(eng, [Request(prompts[5], SamplingParams(max_tokens=N, temperature=0))])
        assert eng.stats()["num_steps"] < sum(len(p) for p in prompts)  # rows really shared steps
    finally:
        eng.shutdown()
    for (toks, text, fin), w in zip(got, want):
        assert toks == w
        assert fin.finish_reason in ("length", "stop")
    assert alone[0][0] == want[5]


def test_cached_prefix_same_tokens_and_reports_cached_blocks(loaded):
    model, tok = loaded
    system = "You are a helpful assistant who answers briefly and precisely. " * 2
    a = tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                            {"role": "user", "content": "Name a fruit."}]),
                   add_special_tokens=False)
    b = tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                            {"role": "user", "content": "Name a planet."}]),
                   add_special_tokens=False)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    cold = Engine(model, tok, EngineConfig(num_blocks=64, enable_prefix_cache=False)).start()
    try:
        (want, _, fcold), = run_requests(cold, [Request(b, SamplingParams(max_tokens=N, temperature=0))])
    finally:
        cold.shutdown()
    eng = Engine(model, tok, EngineConfig(num_blocks=64)).start()
    try:
        run_requests(eng, [Request(a, SamplingParams(max_tokens=2, temperature=0))])
        (got, _, fin), = run_requests(eng, [Request(b, SamplingParams(max_tokens=N, temperature=0))])
    finally:
        eng.shutdown()
    bs = eng.block_size
    assert fcold.cached_tokens == 0
    assert fin.cached_tokens == (common // bs) * bs > 0
    assert got == want
