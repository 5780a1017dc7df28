"""Black-box: the real server process with the default model, through the
official openai SDK (sync, async, streaming) and raw httpx."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

Q = [{"role": "user", "content": "What is the capital of France?"}]


def chat(client, messages=Q, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="default", messages=messages, **kw)


def test_chat_basic(openai_client):
    r = chat(openai_client)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.system_fingerprint and r.created > 0 and r.model
    ch = r.choices[0]
    assert ch.message.role == "assistant" and ch.message.content
    assert ch.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 10 and 0 < u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    # greedy is deterministic, and the repeat hits the prefix cache
    r2 = chat(openai_client)
    assert r2.choices[0].message.content == ch.message.content
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_stream_with_usage(openai_client):
    whole = chat(openai_client).choices[0].message.content
    chunks = list(chat(openai_client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_content_parts_developer_role_and_max_completion_tokens(openai_client):
    msgs = [{"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                         {"type": "text", "text": " of France?"}]}]
    r = chat(openai_client, msgs, max_tokens=None, max_completion_tokens=3)
    assert r.usage.completion_tokens <= 3 and r.choices[0].finish_reason == "length"


def test_sampling_params_accepted(openai_client):
    r = chat(openai_client, temperature=0.8, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, seed=7,
             logit_bias={"1": -100}, extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    assert r.choices[0].message.content is not None
    a = chat(openai_client, temperature=1.0, seed=123, max_tokens=6).choices[0].message.content
    b = chat(openai_client, temperature=1.0, seed=123, max_tokens=6).choices[0].message.content
    assert a == b  # seeded sampling is reproducible


def test_stop_string(openai_client):
    full = chat(openai_client, max_tokens=8).choices[0].message.content
    word = full.split()[2]
    r = chat(openai_client, max_tokens=8, stop=[word])
    assert r.choices[0].finish_reason == "stop" and word not in r.choices[0].message.content
    assert full.startswith(r.choices[0].message.content)


def test_logprobs_chat(openai_client):
    r = chat(openai_client, logprobs=True, top_logprobs=3, max_tokens=4)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens
    assert "".join(e.token for e in lp) == r.choices[0].message.content
    for e in lp:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert e.top_logprobs[0].token == e.token  # greedy picks the best
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    chunks = list(chat(openai_client, logprobs=True, top_logprobs=2, max_tokens=4, stream=True))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in lp]


def test_completions(openai_client):
    r = openai_client.completions.create(model="m", prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text and r.usage.completion_tokens <= 5
    r2 = openai_client.completions.create(model="m", prompt="The capital of France is", max_tokens=5,
                                          temperature=0, echo=True, logprobs=2)
    ch = r2.choices[0]
    assert ch.text == "The capital of France is" + r.choices[0].text
    assert len(ch.logprobs.tokens) == len(ch.logprobs.token_logprobs) == len(ch.logprobs.text_offset)
    assert ch.logprobs.token_logprobs[0] is None and ch.logprobs.token_logprobs[-1] <= 0
    ids = httpx.post(openai_client.base_url.join("/tokenize").__str__(), json={"prompt": "The capital of France is"},
                     headers={"Authorization": f"Bearer {openai_client.api_key}"}).json()["tokens"]
    r3 = openai_client.completions.create(model="m", prompt=ids, max_tokens=5, temperature=0)
    assert r3.choices[0].text == r.choices[0].text
    text = "".join(c.choices[0].text for c in openai_client.completions.create(
        model="m", prompt="The capital of France is", max_tokens=5, temperature=0, stream=True) if c.choices)
    assert text == r.choices[0].text


def test_models_tokenize_detokenize(server, openai_client):
    models = openai_client.models.list().data
    assert len(models) == 1 and models[0].owned_by == "mlxfast"
    h = server.headers
    t = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, headers=h).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] > 0
    d = httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}, headers=h).json()
    assert d["prompt"] == "Hello world"
    m = httpx.post(server.url + "/tokenize", json={"messages": Q}, headers=h).json()
    assert m["count"] > t["count"]


def test_health_metrics_stats(server, openai_client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    chat(openai_client, max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_count",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "kv_cache_usage_perc"):
        assert f"mlxfast:{name}" in text, name
    gen = [line for line in text.splitlines() if line.startswith("mlxfast:generation_tokens_total")]
    assert float(gen[0].split()[-1]) > 0
    stats = httpx.get(server.url + "/stats", headers=server.headers).json()
    assert stats["metrics"]["generation_tokens_total"] > 0 and stats["max_model_len"] > 0


def test_async_client_and_16_concurrent_streams_match_solo(server):
    prompts = [f"Write one short sentence about the number {i}." for i in range(16)]

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300)

        async def one(p):
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": p}], max_tokens=10, temperature=0, stream=True)
            ids, parts = set(), []
            async for c in stream:
                ids.add(c.id)
                if c.choices and c.choices[0].delta.content:
                    parts.append(c.choices[0].delta.content)
            assert len(ids) == 1
            return "".join(parts)

        together = await asyncio.gather(*(one(p) for p in prompts))
        alone = []
        for p in prompts:
            r = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": p}], max_tokens=10, temperature=0)
            alone.append(r.choices[0].message.content)
        await client.close()
        return together, alone

    together, alone = asyncio.run(run())
    assert all(together)
    assert together == alone


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}}, "required": ["color", "ok"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
]


def _validate(value, schema):
    """The subset of JSON Schema the SCHEMAS use."""
    assert isinstance(value, dict)
    assert set(value) == set(schema["required"])
    for k, sub in schema["properties"].items():
        v = value[k]
        if "enum" in sub:
            assert v in sub["enum"]
        elif sub["type"] == "string":
            assert isinstance(v, str) and len(v) <= sub["maxLength"]
        elif sub["type"] == "integer":
            assert isinstance(v, int) and not isinstance(v, bool)
        elif sub["type"] == "boolean":
            assert isinstance(v, bool)
        elif sub["type"] == "array":
            assert sub["minItems"] <= len(v) <= sub["maxItems"]
            assert all(isinstance(x, str) and len(x) <= 8 for x in v)


def test_response_format_json_schema_concurrent(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300)

        async def one(i, schema, temp):
            r = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"Describe item {i} as JSON."}],
                max_tokens=60, temperature=temp, seed=i,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
            return r.choices[0].message.content, schema

        async def obj():
            r = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Any JSON object about a cat."}],
                max_tokens=60, temperature=0, response_format={"type": "json_object"})
            return r.choices[0].message.content, None

        jobs = [one(i, s, t) for i, s in enumerate(SCHEMAS) for t in (0.0, 1.0)] + [obj()]
        out = await asyncio.gather(*jobs)
        await client.close()
        return out

    for text, schema in asyncio.run(run()):
        value = json.loads(text)
        if schema is None:
            assert isinstance(value, dict)
        else:
            _validate(value, schema)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}]


def test_tool_calls_forced_and_round_trip(openai_client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = chat(openai_client, msgs, tools=TOOLS, tool_choice="required", max_tokens=40)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    (call,) = ch.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert isinstance(args["city"], str)
    # streamed, named
    chunks = list(chat(openai_client, msgs, tools=TOOLS, max_tokens=40, stream=True,
                       tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == args
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # the result goes back in and the model answers in text
    msgs += [ch.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    r2 = chat(openai_client, msgs, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls


@pytest.mark.parametrize("kw,param", [
    ({"n": 0}, "n"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"temperature": 5}, "temperature"),
    ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
])
def test_openai_400s(openai_client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(openai_client, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_context_overflow_and_cap(server, openai_client):
    max_len = httpx.post(server.url + "/tokenize", json={"prompt": "x"}, headers=server.headers).json()["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model="m", prompt=[1] * max_len, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    r = openai_client.completions.create(model="m", prompt=[1] * (max_len - 2), max_tokens=1000, temperature=0)
    assert r.usage.completion_tokens <= 2 and r.choices[0].finish_reason in ("length", "stop")


def test_tokenize_renders_messages_as_chat_completions_does(server, openai_client):
    """/tokenize with messages gives the prompt a chat completion uses:
    continue_final_message and tools included (vLLM's test_tokenize_chat)."""
    h = server.headers
    msgs = [{"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "Sure,"}]
    t = httpx.post(server.url + "/tokenize", headers=h, json={
        "messages": msgs, "continue_final_message": True, "add_generation_prompt": False}).json()
    text = httpx.post(server.url + "/detokenize", headers=h, json={"tokens": t["tokens"]}).json()["prompt"]
    assert text.endswith("Sure,")
    r = openai_client.chat.completions.create(model="m", messages=msgs, max_tokens=1, extra_body={
        "continue_final_message": True, "add_generation_prompt": False})
    assert r.usage.prompt_tokens == t["count"]
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with_tools = httpx.post(server.url + "/tokenize", headers=h, json={"messages": Q, "tools": tools}).json()
    r = openai_client.chat.completions.create(model="m", messages=Q, tools=tools, max_tokens=1)
    assert r.usage.prompt_tokens == with_tools["count"]
    assert with_tools["count"] > httpx.post(server.url + "/tokenize", headers=h, json={"messages": Q}).json()["count"]


def test_tokenize_takes_llama_cpp_fields(server):
    h = server.headers
    got = httpx.post(server.url + "/tokenize", headers=h, json={"content": "Hello world", "with_pieces": True}).json()
    assert "".join(t["piece"] for t in got["tokens"]) == "Hello world"
    ids = [t["id"] for t in got["tokens"]]
    assert ids == httpx.post(server.url + "/tokenize", headers=h, json={"content": "Hello world"}).json()["tokens"]
    both = httpx.post(server.url + "/tokenize", headers=h, json={"content": "a", "prompt": "a"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "content"
