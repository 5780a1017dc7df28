"""Black-box: the real server through the official anthropic SDK."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import pytest

Q = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}


SAMPLING = ("temperature", "top_p", "top_k")


def sampling(kw: dict) -> dict:
    """temperature/top_p/top_k go in extra_body: this SDK version has no such arguments."""
    extra = {"temperature": 0}
    extra.update({k: kw.pop(k) for k in SAMPLING if k in kw})
    kw["extra_body"] = extra
    return kw


def create(client, messages=Q, **kw):
    kw.setdefault("max_tokens", 8)
    return client.messages.create(model="local", messages=messages, **sampling(kw))


def test_create(anthropic_client):
    m = create(anthropic_client, system="Answer briefly.", metadata={"user_id": "u1"}, top_k=5, top_p=0.9)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == "SmolLM2-135M-Instruct"  # unknown names are served by the one model, reported by its name
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    u = m.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 8
    assert u.cache_read_input_tokens is not None and u.cache_creation_input_tokens == 0
    m2 = create(anthropic_client, system=[{"type": "text", "text": "Answer briefly."}])
    assert m2.content[0].text == m.content[0].text  # string and block system prompts agree
    assert m2.usage.cache_read_input_tokens > 0


def test_max_tokens_and_stop_sequence(anthropic_client):
    m = create(anthropic_client, max_tokens=3)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    full = create(anthropic_client, max_tokens=8).content[0].text
    word = full.split()[2]
    m = create(anthropic_client, max_tokens=8, stop_sequences=[word])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert word not in m.content[0].text and full.startswith(m.content[0].text)
    with pytest.raises(anthropic.BadRequestError, match="stop sequences must not be empty"):
        create(anthropic_client, stop_sequences=[word, ""])  # as OpenAI's stop [""]: refused, not ignored


def test_stream_accumulates_to_final_message(anthropic_client):
    solo = create(anthropic_client)
    with anthropic_client.messages.stream(model="local", max_tokens=8, messages=Q, **sampling({})) as s:
        pieces = [t for t in s.text_stream]
        final = s.get_final_message()
    assert "".join(pieces) == final.content[0].text == solo.content[0].text
    assert final.stop_reason == solo.stop_reason and final.usage.output_tokens == solo.usage.output_tokens


def test_stream_start_and_end_split_the_prompt_alike(anthropic_client):
    """message_start's usage says the cache reads too (clients read the
    prompt's split there): the same as message_delta's at the end. It said
    every prompt token was read fresh."""
    msgs = [{"role": "user", "content": "Name three colours of the rainbow, one per line."}]
    create(anthropic_client, msgs)  # its prefix is cached now
    events = list(anthropic_client.messages.create(model="local", max_tokens=4, messages=msgs, stream=True,
                                                   extra_body={"temperature": 0}))
    start, delta = events[0], [e for e in events if e.type == "message_delta"][0]
    assert start.type == "message_start"
    first, last = start.message.usage, delta.usage
    assert first.cache_read_input_tokens > 0
    assert (first.input_tokens, first.cache_read_input_tokens) == (last.input_tokens, last.cache_read_input_tokens)


def test_count_tokens(anthropic_client):
    n = anthropic_client.messages.count_tokens(model="local", messages=Q).input_tokens
    n_sys = anthropic_client.messages.count_tokens(model="local", messages=Q, system="Be brief.").input_tokens
    n_tools = anthropic_client.messages.count_tokens(model="local", messages=Q, tools=[WEATHER]).input_tokens
    assert 0 < n < n_tools and n_sys > 0
    m = create(anthropic_client, max_tokens=1)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n


def test_tool_loop(anthropic_client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = create(anthropic_client, msgs, tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=40)
    assert m.stop_reason == "tool_use"
    (tu,) = [b for b in m.content if b.type == "tool_use"]
    assert tu.id.startswith("toolu_") and tu.name == "get_weather" and isinstance(tu.input["city"], str)
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id, "content": "sunny, 24 C"}]}]
    # streamed, forced to the named tool
    with anthropic_client.messages.stream(model="local", max_tokens=40, messages=msgs[:1], tools=[WEATHER],
                                          tool_choice={"type": "tool", "name": "get_weather"}, **sampling({})) as s:
        final = s.get_final_message()
    (tu2,) = [b for b in final.content if b.type == "tool_use"]
    assert tu2.input == tu.input and final.stop_reason == "tool_use"
    # the result goes back; the model answers in text
    m2 = create(anthropic_client, msgs, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=8)
    assert m2.content and m2.content[0].type == "text" and m2.stop_reason in ("end_turn", "max_tokens")


def test_eight_concurrent_streams_match_solo(server):
    prompts = [f"Name a fruit that starts with the letter {c}." for c in "ABCDEFGH"]

    async def run():
        client = anthropic.AsyncAnthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=300)

        async def streamed(p):
            async with client.messages.stream(model="local", max_tokens=10, **sampling({}),
                                              messages=[{"role": "user", "content": p}]) as s:
                text = "".join([t async for t in s.text_stream])
                final = await s.get_final_message()
            assert final.content[0].text == text
            return text

        together = await asyncio.gather(*(streamed(p) for p in prompts))
        alone = []
        for p in prompts:
            m = await client.messages.create(model="local", max_tokens=10, **sampling({}),
                                             messages=[{"role": "user", "content": p}])
            alone.append(m.content[0].text)
        await client.close()
        return together, alone

    together, alone = asyncio.run(run())
    assert all(together) and together == alone


@pytest.mark.parametrize("body,needle", [
    ({"model": "m", "messages": Q}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"model": "m", "max_tokens": 5, "temperature": 3, "messages": Q}, "temperature"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "text-only"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}, "text-only"),
    ({"model": "m", "max_tokens": 5, "messages": Q,
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server-side"),
    ({"model": "m", "max_tokens": 5, "messages": Q, "tool_choice": {"type": "tool", "name": "x"},
      "tools": [WEATHER]}, "not in tools"),
])
def test_anthropic_400s(server, body, needle):
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=30,
                   headers={"x-api-key": server.api_key, "anthropic-version": "2023-06-01",
                            "anthropic-beta": "tools-2024-04-04"})
    assert r.status_code == 400, r.text
    j = r.json()
    assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error"
    assert needle in j["error"]["message"]


def _count(server, messages, beta="mid-conversation-tool-changes-2026-07-01") -> httpx.Response:
    return httpx.post(server.url + "/v1/messages/count_tokens", timeout=30, json={"model": "m", "messages": messages},
                      headers={"x-api-key": server.api_key, "anthropic-version": "2023-06-01", "anthropic-beta": beta})


def test_a_system_message_in_the_conversation_reaches_the_prompt(server, anthropic_client):
    # Claude Code's first request puts its environment in a trailing
    # role "system" message (the mid-conversation betas): it was a 400.
    env = [{"type": "text", "text": "# Environment\nWorking directory: /tmp", "cache_control": {"type": "ephemeral"}}]
    plain = _count(server, Q).json()["input_tokens"]
    with_env = _count(server, Q + [{"role": "system", "content": env}])
    assert with_env.status_code == 200, with_env.text
    assert with_env.json()["input_tokens"] > plain + 5
    r = anthropic_client.messages.create(model="local", max_tokens=4, messages=Q + [{"role": "system", "content": env}],
                                         extra_body={"temperature": 0})
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == with_env.json()["input_tokens"]
    # clear_at next_user_message: shown only for the user turn it follows
    two = Q + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"}]
    base = _count(server, two).json()["input_tokens"]
    cleared = [*two[:1], {"role": "system", "content": env, "clear_at": "next_user_message"}, *two[1:]]
    kept = [*two[:1], {"role": "system", "content": env, "clear_at": "never"}, *two[1:]]
    assert _count(server, cleared).json()["input_tokens"] == base
    assert _count(server, kept).json()["input_tokens"] > base + 5
    last = two + [{"role": "system", "content": "Be brief.", "clear_at": "next_user_message", "output_config": {}}]
    assert _count(server, last).json()["input_tokens"] > base


@pytest.mark.parametrize("message,needle", [
    ({"role": "system", "content": [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "x"}}]},
     "tool_addition"),
    ({"role": "system", "content": "x", "output_config": {"effort": "low"}}, "output_config"),
    ({"role": "user", "content": "x", "clear_at": "never"}, "clear_at"),
    ({"role": "system", "content": "x", "clear_at": "later"}, "clear_at"),
])
def test_what_a_system_message_cannot_carry_is_a_400(server, message, needle):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(server.url + path, timeout=30, json={"model": "m", "max_tokens": 4, "messages": Q + [message]},
                       headers={"x-api-key": server.api_key, "anthropic-version": "2023-06-01"})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_sdk_errors(anthropic_client, server):
    with pytest.raises(anthropic.BadRequestError):
        create(anthropic_client, messages=[{"role": "user", "content": "x " * 400}])  # > context
    bad = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        create(bad)
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.count_tokens(model="local", messages=[])


def test_an_assistant_prefill_is_continued(server, anthropic_client):
    """Anthropic's prefill: a last assistant message is the start of the
    answer, which continues it (as chat completions' continue_final_message)."""
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    m = anthropic_client.messages.create(model="local", max_tokens=8, messages=msgs, extra_body={"temperature": 0})
    chat = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60, json={
        "messages": msgs, "max_tokens": 8, "temperature": 0, "continue_final_message": True,
        "add_generation_prompt": False}).json()
    assert m.content[0].text == chat["choices"][0]["message"]["content"]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    with anthropic_client.messages.stream(model="local", max_tokens=8, messages=msgs,
                                          extra_body={"temperature": 0}) as s:
        assert s.get_final_message().content[0].text == m.content[0].text
    n = anthropic_client.messages.count_tokens(model="local", messages=msgs).input_tokens
    assert n == chat["usage"]["prompt_tokens"]
    ended = msgs + [{"role": "user", "content": "Thanks."},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}]
    r = httpx.post(server.url + "/v1/messages", headers=server.headers, timeout=60,
                   json={"model": "local", "max_tokens": 4, "messages": ended})
    assert r.status_code == 400 and "tool_result" in r.json()["error"]["message"]


@pytest.mark.parametrize("extra, last, status", [
    ({}, "", 200),  # nothing to continue: a new turn
    ({}, [{"type": "thinking", "thinking": "hm", "signature": "x"}], 200),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "{", 400),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "The", 400),
])
def test_prefill_edge_cases(server, extra, last, status):
    r = httpx.post(server.url + "/v1/messages", headers=server.headers, timeout=60, json={
        "model": "local", "max_tokens": 3, "messages": [*Q, {"role": "assistant", "content": last}], **extra})
    assert r.status_code == status, r.text
    if status == 200:  # the prompt ends with a generation prompt, as chat renders an empty last reply
        want = httpx.post(server.url + "/tokenize", headers=server.headers, timeout=60, json={
            "messages": [*Q, {"role": "assistant", "content": ""}], "add_generation_prompt": True}).json()["count"]
        assert r.json()["usage"]["input_tokens"] + r.json()["usage"]["cache_read_input_tokens"] == want
