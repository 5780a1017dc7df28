"""A mixture-of-experts model in the engine: batching (every token of a step
in one [T, 1] batch through the experts), chunked prefill, prefix sharing,
every KV scheme and speculative decoding give the one-shot greedy tokens."""

import random

import mlx.core as mx
import pytest

from engine_utils import ToyTokenizer, dense_greedy, greedy, reference_proposer, run_requests
from mlxfast.engine.api import Request
from mlxfast.engine.config import EngineConfig
from mlxfast.engine.engine import Engine
from mlxfast.models.loader import build_model, read_hf_config
from tiny_moe import make_tiny_moe

VOCAB = 256


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def model(request, tmp_path_factory):
    # head dim 64 (TurboQuant's rotation needs a power of two; mlx-lm's
    # mixtral derives it from the hidden size), 4-bit experts
    dims = dict(head_dim=64) if request.param == "qwen3_moe" else dict(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    path = make_tiny_moe(tmp_path_factory.mktemp("moe") / "m", request.param, per_expert=False,
                         quantize={"group_size": 32, "bits": 4}, seed=7, **dims)
    config = read_hf_config(path)
    return build_model(config, mx.load(str(path / "model.safetensors")), config["quantization"])


def _engine(model, **kw):
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 8)
    return Engine(model, ToyTokenizer(VOCAB), EngineConfig(**kw)).start()


def _prompts(seed, lengths):
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(n)] for n in lengths]


def test_batched_chunked_and_prefix_hits_give_one_shot_tokens(model):
    prompts = _prompts(1, (1, 5, 9, 17, 30, 41))
    want = [dense_greedy(model, p, 10) for p in prompts]
    eng = _engine(model, max_num_batched_tokens=24)  # chunked prefill next to decodes
    try:
        got = run_requests(eng, [Request(p, greedy(10, ignore_eos=True)) for p in prompts],
                           delays=[0.01 * i for i in range(len(prompts))])
        (hit, _, fin), = run_requests(eng, [Request(prompts[4] + [3, 4], greedy(10, ignore_eos=True))])
        stats = eng.stats()
    finally:
        eng.shutdown()
    assert [g[0] for g in got] == want
    assert fin.cached_tokens == 24 and hit == dense_greedy(model, prompts[4] + [3, 4], 10)
    assert stats["free_blocks"] == stats["total_blocks"]


@pytest.mark.parametrize("quant", ["8", "4", "turbo"])
def test_kv_schemes_batched_equal_solo(model, quant):
    prompts = _prompts(2, (3, 17, 30, 9))
    eng = _engine(model, kv_quant=quant, max_num_batched_tokens=24)
    try:
        solo = [run_requests(eng, [Request(p, greedy(8, ignore_eos=True), cache_salt="solo")])[0][0]
                for p in prompts]
        batched = run_requests(eng, [Request(p, greedy(8, ignore_eos=True)) for p in prompts])
        (hit, _, fin), = run_requests(eng, [Request(prompts[2], greedy(8, ignore_eos=True))])
    finally:
        eng.shutdown()
    assert [b[0] for b in batched] == solo
    assert fin.cached_tokens == 24 and hit == solo[2]


_Oracle = reference_proposer(VOCAB, 4)


def test_speculative_decoding_changes_no_token(model, monkeypatch):
    """Draft runs verified in one step (several tokens of a row through the
    experts at once), accepted and rejected: the tokens of plain decoding."""
    import mlxfast.engine.spec as spec_mod

    prompts = _prompts(3, (12, 7, 20))
    want = [dense_greedy(model, p, 16) for p in prompts]
    monkeypatch.setattr(spec_mod, "NgramProposer", _Oracle)
    monkeypatch.setattr(spec_mod, "select", lambda candidates, *a, **k: [len(c) for c in candidates])
    _Oracle.REFERENCE = {tuple(p): w for p, w in zip(prompts, want)}
    eng = _engine(model, spec_kind="ngram", max_num_batched_tokens=64)
    try:
        got = run_requests(eng, [Request(p, greedy(16, ignore_eos=True)) for p in prompts])
        spec = eng.stats()["spec_decode"]
    finally:
        eng.shutdown()
    assert [g[0] for g in got] == want
    assert spec["num_draft_tokens"] > spec["num_accepted_tokens"] > 16
