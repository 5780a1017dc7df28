"""Prompt log-probabilities through the real server: ``echo`` + ``logprobs`` on
/v1/completions (OpenAI's legacy semantics, what lm-evaluation-harness's
``local-completions`` scores with), ``max_tokens: 0``, and vLLM's
``prompt_logprobs``, checked against a teacher-forced forward of the default
model loaded in this process."""

import json

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest

import mlxfast
from mlxfast.kv import DenseKVCache
from mlxfast.server.generation import token_text

PROMPT = "The capital of France is Paris, and the capital of Italy is"
# The server computes K/V in float32 and stores them in float16 (the default
# KV dtype of an fp32 model); the reference does the same and runs the same
# kernels, so what is left is summation order.
ATOL = 1e-4


@pytest.fixture(scope="module")
def loaded():
    return mlxfast.load()


class Float16KV(DenseKVCache):
    def attend(self, layer, q, k, v, scale):
        return super().attend(layer, q, k.astype(mx.float16), v.astype(mx.float16), scale)


@pytest.fixture(scope="module")
def reference(loaded):
    """(prompt ids, log-softmax rows of a teacher-forced forward: row i scores token i + 1)."""
    model, tok = loaded
    ids = tok.encode(PROMPT, add_special_tokens=True)
    logits = model(mx.array([ids]), Float16KV(len(model.layers)))[0].astype(mx.float32)
    return ids, np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def test_echo_max_tokens_zero_scores_every_prompt_token(openai_client, loaded, reference):
    _, tok = loaded
    ids, ref = reference
    r = openai_client.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    ch = r.choices[0]
    assert ch.text == PROMPT and ch.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    lp = ch.logprobs
    assert lp.tokens == [token_text(tok, i)[0] for i in ids]
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref[i - 1, ids[i]] for i in range(1, len(ids))]
    np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=ATOL)
    for i in range(1, len(ids)):  # the best token, and the prompt's own where it is another
        best = token_text(tok, int(ref[i - 1].argmax()))[0]
        assert abs(lp.top_logprobs[i][best] - ref[i - 1].max()) < ATOL
        assert abs(lp.top_logprobs[i][lp.tokens[i]] - lp.token_logprobs[i]) < ATOL
        assert len(lp.top_logprobs[i]) == (1 if lp.tokens[i] == best else 2)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    # Same prompt as token ids, with generation: the prompt part is unchanged.
    r2 = openai_client.completions.create(model="m", prompt=ids, echo=True, logprobs=1, max_tokens=3,
                                          temperature=0)
    lp2 = r2.choices[0].logprobs
    n = r2.usage.completion_tokens
    assert n >= 1 and len(lp2.token_logprobs) == len(ids) + n
    np.testing.assert_allclose(lp2.token_logprobs[1:len(ids)], want, atol=ATOL)
    assert all(v is not None for v in lp2.token_logprobs[1:])


def test_echo_logprobs_stream_first_chunk_carries_the_prompt(openai_client, reference):
    ids, ref = reference
    chunks = [c for c in openai_client.completions.create(
        model="m", prompt=PROMPT, echo=True, logprobs=2, max_tokens=2, temperature=0, stream=True) if c.choices]
    first = chunks[0].choices[0]
    assert first.text == PROMPT
    assert len(first.logprobs.token_logprobs) == len(ids) and first.logprobs.token_logprobs[0] is None
    want = [ref[i - 1, ids[i]] for i in range(1, len(ids))]
    np.testing.assert_allclose(first.logprobs.token_logprobs[1:], want, atol=ATOL)
    assert all(len(t) in (2, 3) for t in first.logprobs.top_logprobs[1:])  # the 2 best and the prompt's token
    assert all(first.logprobs.tokens[i] in first.logprobs.top_logprobs[i] for i in range(1, len(ids)))
    generated = [c.choices[0].logprobs for c in chunks[1:] if c.choices[0].logprobs]
    assert generated and all(len(g.token_logprobs) == 1 for g in generated)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_max_tokens_zero_needs_echo(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model="m", prompt=PROMPT, max_tokens=0)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    r = openai_client.completions.create(model="m", prompt=PROMPT, echo=True, max_tokens=0)
    assert r.choices[0].text == PROMPT and r.choices[0].logprobs is None
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 0


def test_vllm_prompt_logprobs(server, loaded, reference):
    _, tok = loaded
    ids, ref = reference
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=120, json={
        "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["logprobs"] is None
    plp = ch["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        row, t = ref[i - 1], ids[i]
        entry = plp[i]
        assert str(t) in entry and 2 <= len(entry) <= 3
        mine = entry[str(t)]
        assert abs(mine["logprob"] - row[t]) < ATOL
        assert mine["decoded_token"] == token_text(tok, t)[0]
        assert abs(mine["rank"] - int((row >= row[t]).sum())) <= 1  # near-ties may swap
        best = int(row.argmax())
        assert entry[str(best)]["rank"] == 1 and abs(entry[str(best)]["logprob"] - row[best]) < ATOL

    bad = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=120, json={
        "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2, "stream": True})
    assert bad.status_code == 400 and json.loads(bad.text)["error"]["param"] == "prompt_logprobs"
    bad = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=120, json={
        "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 21})
    assert bad.status_code == 400
