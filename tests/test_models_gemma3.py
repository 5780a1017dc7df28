"""Gemma 3 end to end on the real 270M GGUF: llama.cpp agreement, sliding
windows past their length through every path, and the blocks they free.

The file (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors; 15 sliding layers
of window 512 and 3 global ones; head dim 256; a 262k vocabulary; no chat
template) comes from a PyPI package, assembled once by ``gemma3_gguf``.
llama-cpp-python is the independent oracle (test-only).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine_utils import paged_log_probs
from mlxfast import ops
from mlxfast.kv import DenseKVCache
from mlxfast.models.loader import load

DATA = Path(__file__).parent / "data"

CODE = '''import heapq
from dataclasses import dataclass, field


@dataclass(order=True)
class Job:
    priority: int
    name: str = field(compare=False)
    retries: int = field(default=0, compare=False)


def run(jobs: list[Job], limit: int = 3) -> list[str]:
    """Pop jobs by priority; a failing job is retried up to ``limit`` times."""
    heap = list(jobs)
    heapq.heapify(heap)
    done = []
    while heap:
        job = heapq.heappop(heap)
        try:
            execute(job)
        except RuntimeError:
            if job.retries < limit:
                job.retries += 1
                heapq.heappush(heap, job)
            continue
        done.append(job.name)
    return done
'''

STORY = (
    "The lighthouse keeper had not spoken to anyone in eleven days when the boat appeared. "
    "It came out of the fog just after dawn, low in the water, its single sail torn along the "
    "seam. Maren watched it from the gallery, one hand on the cold iron rail, and counted the "
    "figures aboard: three, then four, then a small fifth one wrapped in a grey blanket. She went "
    "down the hundred and twelve steps faster than she had in years. By the time she reached the "
    "landing the boat had struck the rocks below the north wall, and a man was shouting something "
    "she could not understand. The tide was coming in. She threw the rope, missed, threw it again. "
    "Later, when they were all inside by the stove and the child had stopped shivering, the man "
    "explained in slow careful English that they had left the mainland four days ago, that the "
    "engine had failed on the second night, and that they had seen her light and steered for it."
)

RECORDS = json.dumps([
    {"id": 1041, "city": "Lisbon", "temperature_c": 17.5, "conditions": "partly cloudy",
     "wind": {"speed_kmh": 14, "direction": "NW"}, "alerts": []},
    {"id": 1042, "city": "Reykjavik", "temperature_c": -3.0, "conditions": "snow",
     "wind": {"speed_kmh": 41, "direction": "N"}, "alerts": ["gale warning", "icy roads"]},
    {"id": 1043, "city": "Nairobi", "temperature_c": 24.1, "conditions": "sunny",
     "wind": {"speed_kmh": 9, "direction": "E"}, "alerts": []},
    {"id": 1044, "city": "Osaka", "temperature_c": 12.8, "conditions": "light rain",
     "wind": {"speed_kmh": 22, "direction": "SW"}, "alerts": ["flood watch"]},
], indent=2)


@pytest.fixture(scope="module")
def gemma(gemma3_gguf):
    return load(gemma3_gguf)


@pytest.fixture(scope="module")
def gemma_int8(gemma3_gguf):
    return load(gemma3_gguf, matmul_activations="int8")


@pytest.fixture(scope="module")
def llama_cpp_model(gemma3_gguf):
    llama_cpp = pytest.importorskip("llama_cpp")
    # logits_all keeps n_ctx x 262k floats: a small context (1 GiB at 1024)
    return llama_cpp.Llama(str(gemma3_gguf), n_ctx=256, logits_all=True, verbose=False,
                           n_threads=2, seed=0)


def _llama_cpp_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def _one_shot(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]), DenseKVCache.for_model(model))[0].astype(mx.float32))


def test_gguf_reads_as_gemma3(gemma):
    model, tok = gemma
    a = model.args
    assert model.model_type == "gemma3_text" and a.head_dim == 256 and a.num_key_value_heads == 1
    windows = [layer.window for layer in model.kv_layers]
    assert windows == [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]
    assert tok.vocab_size == 262144 and a.tie_word_embeddings
    # The 262k x 640 head stays quantized (Q8_0 -> 8-bit groups), not a dense fp16 matrix.
    assert model.model.embed_tokens.bits == 8


@pytest.fixture(scope="module")
def llama_cpp_reference(gemma, llama_cpp_model):
    """Code, a story, JSON records and GPL prose (128-160 tokens each) with
    llama.cpp's logits for them: computed once, for every mode compared."""
    _, tok = gemma
    gpl = (DATA / "gpl-3.0.txt").read_text()[4000:7000]
    out = []
    for text in (CODE, STORY, RECORDS, gpl):
        ids = tok.encode(text, add_special_tokens=True)[:160]
        assert len(ids) >= 128
        out.append((ids, _llama_cpp_logits(llama_cpp_model, ids)))
    return out


def _top1_agreement(model, reference) -> float:
    """Teacher-forced top-1 agreement with llama.cpp; where they differ it
    must be a near tie for llama.cpp, not another answer."""
    agree, total = 0, 0
    for ids, ref in reference:
        ours = _one_shot(model, ids)
        r, o = ref.argmax(-1), ours.argmax(-1)
        agree += int((r == o).sum())
        total += len(ids)
        gaps = ref[np.arange(len(ids)), r] - ref[np.arange(len(ids)), o]
        assert gaps.max() < 1.5
    assert total >= 4 * 128
    return agree / total


@pytest.mark.slow
def test_teacher_forced_top1_agrees_with_llama_cpp(gemma, llama_cpp_reference):
    model, _ = gemma
    top1 = _top1_agreement(model, llama_cpp_reference)
    print(f"top-1 agreement {top1:.3f}")
    assert top1 >= 0.95, f"top-1 agreement {top1:.3f}"


@pytest.mark.slow
@pytest.mark.skipif(ops.int8_activations_unsupported() != "",
                    reason=f"no int8 kernel on this CPU: {ops.int8_activations_unsupported()}")
def test_int8_activations_agree_with_llama_cpp(gemma_int8, llama_cpp_reference):
    """--matmul-activations int8 (llama.cpp's own activation rounding) keeps
    the same bar on Gemma 3: the mode the Gemma benchmark's figures with
    int8 are taken in (bench/bench_generate.py --matmul-activations int8)."""
    model, _ = gemma_int8
    assert model.matmul_activations == "int8"
    top1 = _top1_agreement(model, llama_cpp_reference)
    print(f"int8 activations: top-1 agreement {top1:.3f}")
    assert top1 >= 0.95, f"top-1 agreement {top1:.3f}"


def _log_softmax(logits: mx.array) -> np.ndarray:
    logits = logits.astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


@pytest.mark.slow
def test_long_context_same_logits_on_every_path(gemma):
    """1,536 tokens, three times the window: the paged engine (chunked
    prefill, sliding blocks released, f16 KV), the one-shot path and the
    pure-MLX reference give the same distribution (checked over the last
    512 positions, all past the window)."""
    import asyncio

    from mlxfast.engine.api import Request, SamplingParams
    from mlxfast.engine.config import EngineConfig
    from mlxfast.engine.engine import Engine

    model, tok = gemma
    ids = tok.encode((DATA / "gpl-3.0.txt").read_text(), add_special_tokens=True)[:1536]
    eng = Engine(model, tok, EngineConfig(num_blocks=1200, max_num_batched_tokens=512)).start()
    try:
        async def score():
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
            return [ev async for ev in eng.submit(Request(ids, params))]

        events = asyncio.run(score())
        groups = eng.stats()["kv_groups"]
    finally:
        eng.shutdown()
    rows = list(range(1023, 1535))  # row r scores token r + 1
    nxt = np.array(ids)[np.array(rows) + 1]
    engine_lp = np.array([events[0].prompt_logprobs[r + 1].logprob for r in rows])
    one = _log_softmax(model(mx.array([ids]), DenseKVCache.for_model(model),
                             logit_rows=mx.array(rows)))
    # the pure-MLX path: gathered K/V and explicit window masks
    ref = paged_log_probs(model, ids, dtype=mx.float16, native=False, chunk=512, bs=16, rows=rows)
    k = np.arange(len(rows))
    # f16 KV (the engine's and the reference's) against the one-shot's f32 KV
    np.testing.assert_allclose(engine_lp, one[k, nxt], atol=0.05)
    np.testing.assert_allclose(engine_lp, ref[k, nxt], atol=0.05)
    assert (ref.argmax(-1) == one.argmax(-1)).mean() > 0.98
    assert [g["window"] for g in groups] == [0] + [512] * 5


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.fixture(scope="module")
def gemma_server(gemma3_gguf, tmp_path_factory):
    from conftest import API_KEY, serve

    template = tmp_path_factory.mktemp("gemma-template") / "gemma.jinja"
    template.write_text(GEMMA_TEMPLATE)
    yield from serve(API_KEY, "--model", str(gemma3_gguf), "--chat-template", str(template),
                     "--kv-cache-gb", "0.25")


@pytest.mark.slow
def test_served_completion_and_chat(gemma_server, gemma):
    import openai

    from mlxfast.generation import generate

    model, tok = gemma
    client = openai.OpenAI(base_url=gemma_server.url + "/v1", api_key=gemma_server.api_key, max_retries=0)
    r = client.completions.create(model="gemma", prompt="The capital of France is", max_tokens=12,
                                  temperature=0)
    assert "capital" in r.choices[0].text and r.usage.completion_tokens == 12
    # the library's one-shot path, the same greedy tokens
    assert r.choices[0].text == generate(model, tok, "The capital of France is", max_tokens=12,
                                         temp=0.0, chat=False)

    # multi-turn through the template: the base model answers in kind
    shots = [{"role": "user", "content": "What is the capital of Italy?"},
             {"role": "assistant", "content": "Rome"},
             {"role": "user", "content": "What is the capital of France?"}]
    c = client.chat.completions.create(model="gemma", messages=shots, max_tokens=4, temperature=0)
    assert c.choices[0].message.content.startswith("Paris")
    # <end_of_turn> ends the answer and never reaches the text (the base model
    # seldom writes it unprompted: a bias makes it the second token)
    end = tok.encode("<end_of_turn>", add_special_tokens=False)
    assert len(end) == 1
    s = client.chat.completions.create(model="gemma", messages=shots, max_tokens=16, temperature=0,
                                       logit_bias={str(end[0]): 30})
    assert s.choices[0].finish_reason == "stop"
    assert "<end_of_turn>" not in s.choices[0].message.content and s.usage.completion_tokens <= 16

    # seeded sampling: the library draws the server's tokens (chat and raw text)
    kw = dict(temperature=1.0, top_p=0.9, seed=5, max_tokens=16, extra_body={"top_k": 64, "min_p": 0.01})
    c = client.chat.completions.create(model="gemma", messages=shots, **kw)
    r = client.completions.create(model="gemma", prompt="Once upon a time", **kw)
    lib = dict(temp=1.0, top_p=0.9, top_k=64, min_p=0.01, seed=5, max_tokens=16)
    own = tok.chat_template
    tok.chat_template = GEMMA_TEMPLATE  # as the server's (its turn end a stop too)
    try:
        assert c.choices[0].message.content == generate(model, tok, shots, **lib)
        assert r.choices[0].text == generate(model, tok, "Once upon a time", chat=False, **lib)
        assert r.choices[0].text != generate(model, tok, "Once upon a time", chat=False, **{**lib, "seed": 6})
    finally:
        tok.chat_template = own


def test_gguf_config_reads_a_per_layer_sliding_pattern():
    """Newer llama.cpp files store gemma3.attention.sliding_window_pattern as one
    bool per layer (numpy array in the metadata); older ones not at all."""
    from mlxfast.models.gguf import gguf_config

    base = {"general.architecture": "gemma3", "gemma3.block_count": 4, "gemma3.embedding_length": 64,
            "gemma3.feed_forward_length": 128, "gemma3.attention.head_count": 4,
            "gemma3.attention.key_length": 16, "gemma3.vocab_size": 100}
    cfg = gguf_config(dict(base, **{"gemma3.attention.sliding_window_pattern": np.array([1, 0, 1, 1], bool)}))
    assert cfg["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    assert gguf_config(dict(base))["layer_types"] == ["sliding_attention"] * 4  # every 6th is global
    with pytest.raises(ValueError, match="3 entries for 4 layers"):
        gguf_config(dict(base, **{"gemma3.attention.sliding_window_pattern": np.array([1, 0, 1], bool)}))
