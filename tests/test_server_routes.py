"""Route layer over a scripted engine: fixed model outputs (tool-call markup,
<think> blocks, stops, failures) through the real routes and parsers."""

from __future__ import annotations

import json

import httpx

import pytest

from mlxfast.engine.api import EngineDead, EngineOverloaded

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
A_TOOLS = [{"name": "get_weather", "description": "Weather for a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
HERMES_OUT = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    "{# <tool_call> <think> #}"
)
THINK_OUT = "<think>\nThe user greets me.\n</think>\n\nHello!"
USER = [{"role": "user", "content": "hi"}]


def sse_data(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            out.append(json.loads(block[6:]))
    return out


def sse_named(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in filter(None, text.split("\n\n")):
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        out.append((lines[0][7:], json.loads(lines[1][6:])))
    return out


def test_openai_tool_call_nonstream(fake_client):
    c, eng = fake_client(HERMES_OUT)
    r = c.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS})
    assert r.status_code == 200
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    (call,) = ch["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert "<tool_call>" not in (ch["message"]["content"] or "")
    # the template has no tool support: the fallback tool prompt was injected
    prompt = c.app.state.mlxfast.tokenizer.decode(eng.requests[0].prompt_ids)
    assert "<tools>" in prompt and "get_weather" in prompt


def test_openai_tool_call_stream_deltas(fake_client):
    c, _ = fake_client(HERMES_OUT)
    r = c.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "stream": True})
    chunks = sse_data(r.text)
    content = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert content.strip() == "Checking." and "<" not in content
    deltas = [tcd for ch in chunks for tcd in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "get_weather"
    assert all("id" not in d for d in deltas[1:])
    args = "".join(d["function"].get("arguments", "") for d in deltas)
    assert json.loads(args) == {"city": "Paris"} and {d["index"] for d in deltas} == {0}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert r.text.endswith("data: [DONE]\n\n")


def test_tool_choice_none_leaves_markup_as_text_and_no_tools_in_prompt(fake_client):
    c, eng = fake_client(HERMES_OUT)
    r = c.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "tool_choice": "none"})
    msg = r.json()["choices"][0]["message"]
    assert "tool_calls" not in msg and r.json()["choices"][0]["finish_reason"] == "stop"
    assert "<tools>" not in c.app.state.mlxfast.tokenizer.decode(eng.requests[0].prompt_ids)


def test_tool_choice_required_and_named_set_a_grammar(fake_client):
    c, eng = fake_client(HERMES_OUT)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = c.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "tool_choice": choice})
        assert r.status_code == 200
        matcher = eng.requests[-1].params.grammar()
        assert not matcher.is_error()
        assert matcher.compute_ff_bytes().startswith(b'<tool_call>\n{"name": "get_weather"')
    r = c.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS,
                                             "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_tool_history_is_rendered(fake_client):
    c, eng = fake_client("It is sunny.")
    msgs = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"},
    ]
    r = c.post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS})
    assert r.json()["choices"][0]["message"]["content"] == "It is sunny."
    prompt = c.app.state.mlxfast.tokenizer.decode(eng.requests[0].prompt_ids)
    assert '"city": "Paris"' in prompt and "<tool_response>\nsunny, 24C\n</tool_response>" in prompt


def test_reasoning_content(fake_client):
    c, eng = fake_client(THINK_OUT, chat_template=QWEN_TEMPLATE)
    r = c.post("/v1/chat/completions", json={"messages": USER})
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "The user greets me.\n" and msg["content"] == "Hello!"
    r = c.post("/v1/chat/completions", json={"messages": USER, "stream": True})
    chunks = sse_data(r.text)
    reasoning = "".join(ch["choices"][0]["delta"].get("reasoning_content", "") for ch in chunks)
    content = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
    assert reasoning == "The user greets me.\n" and content == "Hello!"


def test_reasoning_effort_and_template_kwargs_reach_the_template(fake_client):
    c, eng = fake_client("ok", chat_template=QWEN_TEMPLATE)
    dec = c.app.state.mlxfast.tokenizer.decode
    c.post("/v1/chat/completions", json={"messages": USER, "reasoning_effort": "none"})
    assert dec(eng.requests[-1].prompt_ids).endswith("<think>\n\n</think>\n\n")
    c.post("/v1/chat/completions", json={"messages": USER, "reasoning_effort": "high"})
    assert dec(eng.requests[-1].prompt_ids).endswith("assistant\n")
    c.post("/v1/chat/completions", json={"messages": USER, "chat_template_kwargs": {"enable_thinking": False}})
    assert dec(eng.requests[-1].prompt_ids).endswith("</think>\n\n")
    r = c.post("/v1/chat/completions", json={"messages": USER, "reasoning_effort": "hgih"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


def test_anthropic_thinking_text_and_tool_use_blocks(fake_client):
    c, _ = fake_client("<think>plan</think>" + HERMES_OUT, chat_template=QWEN_TEMPLATE)
    r = c.post("/v1/messages", json={"model": "m", "max_tokens": 200, "messages": USER, "tools": A_TOOLS})
    body = r.json()
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]
    assert body["content"][0]["thinking"] == "plan" and body["content"][0]["signature"]
    tu = body["content"][2]
    assert tu["id"].startswith("toolu_") and tu["input"] == {"city": "Paris"}
    assert body["stop_reason"] == "tool_use"
    assert body["usage"]["cache_read_input_tokens"] == 4

    r = c.post("/v1/messages", json={"model": "m", "max_tokens": 200, "messages": USER, "tools": A_TOOLS,
                                     "stream": True})
    events = sse_named(r.text)
    names = [e for e, _ in events]
    assert names[0] == "message_start" and names[1] == "ping" and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"]["type"] for e, d in events if e == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    kinds = {d["delta"]["type"] for e, d in events if e == "content_block_delta"}
    assert kinds == {"thinking_delta", "signature_delta", "text_delta", "input_json_delta"}
    partial = "".join(d["delta"]["partial_json"] for e, d in events
                      if e == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    # blocks open and close in order, one at a time
    open_ = None
    for e, d in events:
        if e == "content_block_start":
            assert open_ is None
            open_ = d["index"]
        elif e == "content_block_delta":
            assert d["index"] == open_
        elif e == "content_block_stop":
            assert d["index"] == open_
            open_ = None


def test_anthropic_stop_sequence(fake_client):
    c, _ = fake_client("one two STOP three")
    r = c.post("/v1/messages", json={"model": "m", "max_tokens": 50, "messages": USER, "stop_sequences": ["STOP"]})
    body = r.json()
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "STOP"
    assert body["content"] == [{"type": "text", "text": "one two "}]


def test_anthropic_history_blocks(fake_client):
    c, eng = fake_client("done")
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "secret plan", "signature": "x"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "rainy"}], "is_error": True}]},
    ]
    r = c.post("/v1/messages", json={"model": "m", "max_tokens": 20, "system": [{"type": "text", "text": "Be brief."}],
                                     "messages": msgs, "tools": A_TOOLS})
    assert r.status_code == 200
    prompt = c.app.state.mlxfast.tokenizer.decode(eng.requests[0].prompt_ids)
    assert "Be brief." in prompt and '"city": "Oslo"' in prompt and "Error: rainy" in prompt
    assert "secret plan" not in prompt


def test_engine_errors_map_to_statuses(fake_client):
    c, eng = fake_client("x")
    eng.fail_submit = EngineOverloaded("queue full")
    r = c.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 429 and r.headers["retry-after"] and r.json()["error"]["type"] == "rate_limit_error"
    r = c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": USER})
    assert r.status_code == 429 and r.json() == {"type": "error", "error": {
        "type": "rate_limit_error", "message": "queue full"}}
    eng.fail_submit = EngineDead("boom")
    assert c.post("/v1/chat/completions", json={"messages": USER}).status_code == 503
    eng.fail_submit = None
    eng.alive, eng.error = False, "kernel crashed"
    r = c.get("/health")
    assert r.status_code == 503 and "kernel crashed" in r.json()["error"]
    r = c.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 503 and "kernel crashed" in r.json()["error"]["message"]


def test_prompt_too_long_and_max_tokens_capped(fake_client):
    c, eng = fake_client("x" * 10)
    eng.max_model_len = 60
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 100}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "a " * 100}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 100000})
    assert r.status_code == 200
    assert eng.requests[-1].params.max_tokens == 60 - len(eng.requests[-1].prompt_ids)


def test_engine_failure_midstream(fake_client):
    c, eng = fake_client("one two three four five")
    eng.fail_midway = "out of memory"
    r = c.post("/v1/chat/completions", json={"messages": USER, "stream": True})
    assert r.status_code == 200
    errs = [d for d in sse_data(r.text) if "error" in d]
    assert errs and "out of memory" in errs[0]["error"]["message"] and r.text.endswith("data: [DONE]\n\n")
    r = c.post("/v1/messages", json={"model": "m", "max_tokens": 50, "messages": USER, "stream": True})
    events = sse_named(r.text)
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"
    r = c.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


def test_stream_abandoned_aborts_request(fake_client):
    c, eng = fake_client("word " * 200)
    with c.stream("POST", "/v1/chat/completions", json={"messages": USER, "stream": True, "max_tokens": 150}) as r:
        for line in r.iter_lines():
            if '"content":"word"' in line.replace(" ", ""):
                break
    import time

    deadline = time.time() + 5
    while not eng.aborted and time.time() < deadline:
        time.sleep(0.05)
    assert eng.aborted == [eng.requests[0].request_id]


def test_fake_logprobs_shapes(fake_client):
    c, _ = fake_client("Hello world")
    r = c.post("/v1/chat/completions", json={"messages": USER, "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == "Hello world"
    assert all(len(e["top_logprobs"]) == 2 and bytes(e["bytes"]).decode() == e["token"] for e in content)
    r = c.post("/v1/completions", json={"prompt": "Say", "logprobs": 2, "echo": True})
    ch = r.json()["choices"][0]
    assert ch["text"] == "SayHello world"
    lp = ch["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["tokens"][-2:] == ["Hello", " world"]
    assert lp["text_offset"] == sorted(lp["text_offset"]) and len(lp["top_logprobs"][-1]) == 2


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_metrics_follow_requests(fake_client, path):
    c, _ = fake_client("a b c")
    body = {"messages": USER} if "chat" in path else {"model": "m", "max_tokens": 9, "messages": USER}
    assert c.post(path, json=body).status_code == 200
    text = c.get("/metrics").text
    assert 'mlxfast:generation_tokens_total{model_name="fake"} 3.0' in text
    assert 'mlxfast:time_to_first_token_seconds_count{model_name="fake"} 1.0' in text
    assert 'mlxfast:inter_token_latency_seconds_count{model_name="fake"} 2.0' in text
    assert 'mlxfast:kv_cache_usage_perc{model_name="fake"} 0.25' in text
    assert 'mlxfast:request_success_total{finished_reason="stop",model_name="fake"} 1.0' in text


def test_constrained_output_turns_thinking_off(fake_client):
    c, eng = fake_client('{"a": 1}', chat_template=QWEN_TEMPLATE)
    dec = c.app.state.mlxfast.tokenizer.decode
    r = c.post("/v1/chat/completions", json={"messages": USER, "response_format": {"type": "json_object"}})
    assert r.json()["choices"][0]["message"]["content"] == '{"a": 1}'
    assert dec(eng.requests[-1].prompt_ids).endswith("<think>\n\n</think>\n\n")
    r = c.post("/v1/messages", json={"model": "m", "max_tokens": 20, "messages": USER, "tools": A_TOOLS,
                                     "tool_choice": {"type": "any"}})
    assert dec(eng.requests[-1].prompt_ids).endswith("<think>\n\n</think>\n\n")


def test_anthropic_pings_while_waiting_and_openai_nonstream_survives_silence(fake_client):
    c, eng = fake_client("slow answer", heartbeat_s=0.05, disconnect_poll_s=0.05)
    eng.delay = 0.2
    r = c.post("/v1/messages", json={"model": "m", "max_tokens": 9, "messages": USER, "stream": True})
    names = [e for e, _ in sse_named(r.text)]
    assert names.count("ping") >= 3  # the first one, then during each 0.2 s silence
    text = "".join(d["delta"]["text"] for e, d in sse_named(r.text)
                   if e == "content_block_delta" and d["delta"]["type"] == "text_delta")
    assert text == "slow answer" and names[-1] == "message_stop"
    r = c.post("/v1/chat/completions", json={"messages": USER})
    assert r.json()["choices"][0]["message"]["content"] == "slow answer"


def test_openai_routes_answer_without_v1_too(server):
    """As llama.cpp's server: a client given the server's root as its base
    URL asks for /chat/completions; the key is required there as well."""
    import openai as openai_sdk

    client = openai_sdk.OpenAI(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=60)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1
    assert client.completions.create(model="m", prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    assert [m.id for m in client.models.list().data] == [m.id for m in openai_sdk.OpenAI(
        base_url=server.url + "/v1", api_key=server.api_key).models.list().data]
    assert client.responses.create(model="m", input="Hi", max_output_tokens=2).id.startswith("resp_")
    for path in ("/chat/completions", "/completions", "/responses"):
        r = httpx.post(server.url + path, json={}, timeout=30)  # no key
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
    assert httpx.get(server.url + "/models", timeout=30).status_code == 401
    assert httpx.post(server.url + "/messages", headers=server.headers, json={}, timeout=30).status_code == 404


REASONING_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}<think>"
                      "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}{% endfor %}<assistant>")


def test_anthropic_thinking_history_reaches_the_template(fake_client):
    """An assistant turn's thinking blocks are its reasoning, as OpenAI's
    reasoning_content is (templates such as Qwen3's render it in a tool
    loop); redacted thinking is opaque and stays out."""
    c, eng = fake_client("ok", chat_template=REASONING_TEMPLATE)
    dec = c.app.state.mlxfast.tokenizer.decode
    blocks = [{"type": "thinking", "thinking": "Check the weather.", "signature": "x"},
              {"type": "redacted_thinking", "data": "opaque"},
              {"type": "thinking", "thinking": "Then answer.", "signature": "y"},
              {"type": "text", "text": "Let me look."}]
    msgs = USER + [{"role": "assistant", "content": blocks}, {"role": "user", "content": "and?"}]
    r = c.post("/v1/messages", json={"model": "m", "max_tokens": 20, "messages": msgs})
    assert r.status_code == 200, r.text
    anthropic = dec(eng.requests[-1].prompt_ids)
    assert "<assistant><think>Check the weather.\nThen answer.</think>Let me look.<user>and?" in anthropic
    assert "opaque" not in anthropic
    c.post("/v1/chat/completions", json={"messages": USER + [
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "Check the weather.\nThen answer."},
        {"role": "user", "content": "and?"}]})
    assert dec(eng.requests[-1].prompt_ids) == anthropic
    counted = c.post("/v1/messages/count_tokens", json={"model": "m", "messages": msgs}).json()["input_tokens"]
    msgs[1]["content"] = blocks[3:]
    assert c.post("/v1/messages/count_tokens", json={"model": "m", "messages": msgs}).json()["input_tokens"] < counted


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_continue_final_message_with_a_generation_prompt_is_refused(fake_client, path):
    """vLLM's and llama.cpp's rule; the default add_generation_prompt gives way."""
    c, _ = fake_client("ok")
    msgs = USER + [{"role": "assistant", "content": "Hel"}]
    r = c.post(path, json={"messages": msgs, "continue_final_message": True, "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    assert c.post(path, json={"messages": msgs, "continue_final_message": True}).status_code == 200
    assert c.post(path, json={"messages": msgs, "continue_final_message": True,
                              "add_generation_prompt": False}).status_code == 200


def test_llama_cpp_names_of_health_and_detokenize(fake_client):
    c, _ = fake_client("ok", api_key="k")
    assert c.get("/v1/health").status_code == 200 and c.get("/v1/health").json() == c.get("/health").json()
    assert c.get("/v1/models").status_code == 401  # only the health alias is public
    ids = c.post("/tokenize", json={"prompt": "Hello there"}, headers={"x-api-key": "k"}).json()["tokens"]
    body = c.post("/detokenize", json={"tokens": ids}, headers={"x-api-key": "k"}).json()
    assert body == {"prompt": "Hello there", "content": "Hello there"}


def test_an_unexpected_error_is_a_500_and_the_connection_lives(fake_client):
    """An exception no handler takes is a 500 in each API's shape, and the
    keep-alive connection it came on serves the next request: Starlette's
    handler answered, then re-raised to uvicorn, which dropped the
    connection unannounced, so a client's next request on it failed."""
    import threading
    import time

    import uvicorn
    from conftest import free_port

    c, eng = fake_client("hello there")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(c.app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            def local_port(r):
                return r.extensions["network_stream"].get_extra_info("client_addr")[1]

            eng.fail_submit = RuntimeError("boom")
            r = http.post("/v1/chat/completions", json={"messages": USER})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert "boom" in r.json()["error"]["message"]
            first = local_port(r)
            r = http.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": USER})
            assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
            eng.fail_submit = None
            r = http.post("/v1/chat/completions", json={"messages": USER})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello there"
            assert local_port(r) == first  # one connection throughout
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("timeout", ["inf", "1e400", "1e10", "nan", "-1", "soon"])
def test_cache_flush_timeout_must_be_a_sane_number_of_seconds(fake_client, timeout):
    """A wait past the clock's range was a 500 (and NaN was taken)."""
    c, _ = fake_client("x")
    r = c.post(f"/admin/cache/flush?timeout={timeout}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout"
    assert c.post("/admin/cache/flush?timeout=5").status_code == 200


@pytest.mark.parametrize("settings,want", [({}, None), ({"default_max_tokens": 100}, 100)])
def test_a_request_without_max_tokens_gets_the_servers_default(fake_client, settings, want):
    # No --max-tokens: as many as the context leaves (OpenAI's, vLLM's and
    # llama.cpp's default; Codex CLI sends none and fails on a cut answer).
    c, eng = fake_client("Hi", **settings)
    for path, body in (("/v1/chat/completions", {"messages": USER}),
                       ("/v1/responses", {"input": "hi"}),
                       ("/v1/completions", {"prompt": "hi"})):
        assert c.post(path, json=body).status_code == 200
        req = eng.requests[-1]
        room = eng.max_model_len - len(req.prompt_ids)
        assert req.params.max_tokens == (room if want is None else want), path
    c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 7})
    assert eng.requests[-1].params.max_tokens == 7


@pytest.mark.parametrize("number", ["1e999", "-1e999", "NaN", "Infinity"])
def test_a_call_whose_numbers_json_cannot_carry_is_answered(fake_client, number):
    # The model's arguments held a number beyond a double: the response
    # failed to serialise (a 500). Such numbers become null, as JSON.stringify writes them.
    out = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, %s]}}\n</tool_call>' % number
    c, _ = fake_client(out)
    r = c.post("/v1/messages", json={"model": "m", "max_tokens": 200, "messages": USER, "tools": A_TOOLS})
    assert r.status_code == 200, r.text
    (block,) = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert block["input"] == {"city": "Paris", "n": [1, None]}
    for path, body in (("/v1/chat/completions", {"messages": USER, "tools": TOOLS}),
                       ("/v1/responses", {"input": "hi", "tools": [dict(type="function", **TOOLS[0]["function"])]})):
        r = c.post(path, json=body)
        assert r.status_code == 200, r.text
        json.loads(r.text)  # strict JSON: no Infinity or NaN literals
