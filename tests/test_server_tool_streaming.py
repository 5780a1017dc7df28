"""Tool calls stream as the model writes them, on all three APIs and in
every markup family, on fixed model outputs (the scripted engine of
``fake_client``); and several system / developer messages render in every
template family."""

from __future__ import annotations

import json

import pytest

NOTE = {"title": "Paris", "body": "Paris is the capital of France. " * 6 + "It has a river, the Seine.",
        "tags": ["city", "europe"], "stars": 5}
TOOLS = [{"type": "function", "function": {"name": "write_note", "description": "Save a note.", "parameters": {
    "type": "object", "properties": {"title": {"type": "string"}, "body": {"type": "string"},
                                     "tags": {"type": "array", "items": {"type": "string"}},
                                     "stars": {"type": "integer"}},
    "required": ["title", "body"]}}}]

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% for m in messages if m.role == 'system' %}{{ m.content }}
{% endfor %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
Call a tool with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}{%- for m in messages if m.role != 'system' or not tools %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Mistral's shape: a system message is taken first only, roles must alternate.
MISTRAL_TEMPLATE = """{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}\
{% set loop_messages = messages[1:] %}{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}\
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}\
{%- for m in loop_messages %}\
{%- if m.role == 'system' %}{{ raise_exception('Only the first message may be a system message') }}{% endif %}\
{%- if m.role == 'user' %}[INST]{% if loop.last and system %}{{ system }}\n\n{% endif %}{{ m.content }}[/INST]\
{%- elif m.role == 'assistant' %}{{ m.content }}\
{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}{% endif %}</s>\
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}\
{%- endfor %}"""

LLAMA3_TEMPLATE = """{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>{%- endfor %}\
{%- if tools %}<|start_header_id|>user<|end_header_id|>

Tools: {{ tools | tojson }}. Answer with {"name": name, "parameters": arguments}, after <|python_tag|>.<|eot_id|>{% endif %}\
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

ARGS = json.dumps(NOTE)
FAMILIES = {  # family: (template, model output, text before the call)
    "hermes": (HERMES_TEMPLATE, 'Let me save it.\n<tool_call>\n{"name": "write_note", "arguments": ' + ARGS
               + "}\n</tool_call>", "Let me save it.\n"),
    "mistral": (MISTRAL_TEMPLATE, '[TOOL_CALLS][{"name": "write_note", "arguments": ' + ARGS + "}]", ""),
    "llama3": (LLAMA3_TEMPLATE, '<|python_tag|>{"name": "write_note", "parameters": ' + ARGS + "}", ""),
}
MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '"name"')
USER = [{"role": "user", "content": "Save a note about Paris."}]


def sse_json(lines):
    """The JSON payloads of an SSE body's data lines (``[DONE]`` left out)."""
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


def openai_stream(client, body):
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        chunks = sse_json(r.iter_lines())
    text, calls = "", {}
    for c in chunks:
        for choice in c["choices"]:
            d = choice["delta"]
            text += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"name": None, "pieces": [], "id": None})
                if "id" in tc:
                    assert call["id"] is None, "a call's id comes once, with its start"
                    call["id"], call["name"] = tc["id"], tc["function"]["name"]
                if tc["function"].get("arguments"):
                    call["pieces"].append(tc["function"]["arguments"])
    return text, [calls[i] for i in sorted(calls)]


def anthropic_stream(client, body):
    with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = sse_json(r.iter_lines())
    text, calls, kinds = "", {}, {}
    for e in events:
        if e["type"] == "content_block_start":
            kinds[e["index"]] = e["content_block"]["type"]
            if e["content_block"]["type"] == "tool_use":
                calls[e["index"]] = {"name": e["content_block"]["name"], "pieces": []}
        elif e["type"] == "content_block_delta":
            d = e["delta"]
            if d["type"] == "text_delta":
                text += d["text"]
            elif d["type"] == "input_json_delta":
                assert kinds[e["index"]] == "tool_use"
                calls[e["index"]]["pieces"].append(d["partial_json"])
    return text, [calls[i] for i in sorted(calls)]


def responses_stream(client, body):
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = sse_json(r.iter_lines())
    text, calls = "", {}
    for e in events:
        if e["type"] == "response.output_text.delta":
            text += e["delta"]
        elif e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call":
            calls[e["item"]["id"]] = {"name": e["item"]["name"], "pieces": [], "at": e["output_index"]}
        elif e["type"] == "response.function_call_arguments.delta":
            calls[e["item_id"]]["pieces"].append(e["delta"])
        elif e["type"] == "response.function_call_arguments.done":
            assert e["arguments"] == "".join(calls[e["item_id"]]["pieces"])
    assert events[-1]["type"] == "response.completed"
    return text, sorted(calls.values(), key=lambda c: c["at"])


def chat_body(tool_choice="auto"):
    return {"model": "fake", "messages": USER, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 400}


def anthropic_body():
    return {"model": "fake", "max_tokens": 400, "messages": USER,
            "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                       "input_schema": t["function"]["parameters"]} for t in TOOLS]}


def responses_body():
    return {"model": "fake", "input": USER[0]["content"], "max_output_tokens": 400,
            "tools": [{"type": "function", **t["function"]} for t in TOOLS]}


STREAMS = {
    "openai": (openai_stream, chat_body),
    "anthropic": (anthropic_stream, anthropic_body),
    "responses": (responses_stream, responses_body),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("api", STREAMS)
def test_tool_call_arguments_stream_in_many_pieces(fake_client, family, api):
    template, output, before = FAMILIES[family]
    client, _ = fake_client(output, chat_template=template)
    read, body = STREAMS[api]
    text, calls = read(client, body())
    assert text == before
    assert not any(m in text for m in MARKUP)
    assert [c["name"] for c in calls] == ["write_note"]
    pieces = calls[0]["pieces"]
    assert len(pieces) > 10, pieces  # one per token of the arguments, not one lump
    assert json.loads("".join(pieces)) == NOTE


def test_several_calls_in_one_turn_get_their_own_indices(fake_client):
    two = ('<tool_call>{"name": "write_note", "arguments": {"title": "a", "body": "one"}}</tool_call>\n'
           '<tool_call>{"name": "write_note", "arguments": {"title": "b", "body": "two"}}</tool_call>')
    client, _ = fake_client(two, chat_template=HERMES_TEMPLATE)
    _, calls = openai_stream(client, chat_body())
    assert [json.loads("".join(c["pieces"]))["title"] for c in calls] == ["a", "b"]
    assert len({c["id"] for c in calls}) == 2
    _, calls = anthropic_stream(client, anthropic_body())
    assert [json.loads("".join(c["pieces"]))["body"] for c in calls] == ["one", "two"]
    _, calls = responses_stream(client, responses_body())
    assert [json.loads("".join(c["pieces"]))["body"] for c in calls] == ["one", "two"]
    # parallel calls off: the first call only, on every API
    _, calls = openai_stream(client, {**chat_body(), "parallel_tool_calls": False})
    assert len(calls) == 1
    _, calls = responses_stream(client, {**responses_body(), "parallel_tool_calls": False})
    assert len(calls) == 1
    body = anthropic_body()
    body["tool_choice"] = {"type": "auto", "disable_parallel_tool_use": True}
    _, calls = anthropic_stream(client, body)
    assert len(calls) == 1
    r = client.post("/v1/chat/completions", json={**chat_body(), "parallel_tool_calls": False})
    assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_calls_equal_the_non_streamed_ones(fake_client, family):
    template, output, before = FAMILIES[family]
    client, _ = fake_client(output, chat_template=template)
    _, calls = openai_stream(client, chat_body())
    message = client.post("/v1/chat/completions", json=chat_body()).json()["choices"][0]["message"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        (c["name"], "".join(c["pieces"])) for c in calls]
    assert (message["content"] or "") == before
    _, calls = responses_stream(client, responses_body())
    out = client.post("/v1/responses", json=responses_body()).json()["output"]
    assert [(o["name"], o["arguments"]) for o in out if o["type"] == "function_call"] == [
        (c["name"], "".join(c["pieces"])) for c in calls]
    _, calls = anthropic_stream(client, anthropic_body())
    blocks = client.post("/v1/messages", json=anthropic_body()).json()["content"]
    assert [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"] == [
        (c["name"], json.loads("".join(c["pieces"]))) for c in calls]


def test_a_call_cut_off_by_max_tokens_ends_with_finish_reason_length(fake_client):
    template, output, _ = FAMILIES["hermes"]
    client, _ = fake_client(output, chat_template=template)
    r = client.post("/v1/chat/completions", json={**chat_body(), "max_tokens": 30}).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "length"
    args = choice["message"]["tool_calls"][0]["function"]["arguments"]
    assert ARGS.startswith(args) and args != ARGS
    resp = client.post("/v1/responses", json={**responses_body(), "max_output_tokens": 30}).json()
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [o["status"] for o in resp["output"] if o["type"] == "function_call"] == ["incomplete"]


# ------------------------------------------------------------ system and developer messages


SYSTEMS = [
    [{"role": "system", "content": "SYS-ONE"}, {"role": "developer", "content": "DEV-TWO"},
     {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "SYS-ONE"}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "system", "content": "DEV-TWO"},
     {"role": "user", "content": "Again"}],
]


@pytest.mark.parametrize("template", [None, HERMES_TEMPLATE, MISTRAL_TEMPLATE, LLAMA3_TEMPLATE],
                         ids=["default", "hermes", "mistral", "llama3"])
@pytest.mark.parametrize("messages", SYSTEMS, ids=["leading", "midway"])
def test_developer_and_several_system_messages_render_in_every_family(fake_client, tokenizer, template,
                                                                      messages):
    client, engine = fake_client("ok", chat_template=template)
    r = client.post("/v1/chat/completions", json={"model": "fake", "messages": messages, "max_tokens": 4})
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(engine.requests[-1].prompt_ids)
    assert "SYS-ONE" in prompt and "DEV-TWO" in prompt
    assert prompt.index("SYS-ONE") < prompt.index("DEV-TWO")
    # The same through the Responses API: instructions and a developer message
    r = client.post("/v1/responses", json={"model": "fake", "instructions": "SYS-ONE", "max_output_tokens": 4,
                                           "input": [{"role": "developer", "content": "DEV-TWO"},
                                                     {"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(engine.requests[-1].prompt_ids)
    assert prompt.index("SYS-ONE") < prompt.index("DEV-TWO") < prompt.index("Hi")


def test_a_template_error_that_is_not_about_system_messages_stays_a_400(fake_client):
    client, _ = fake_client("ok", chat_template=MISTRAL_TEMPLATE.replace(
        "{%- if m.role == 'user' %}", "{%- if m.content == 'boom' %}{{ raise_exception('no boom') }}{% endif %}"
        "{%- if m.role == 'user' %}"))
    r = client.post("/v1/chat/completions", json={"model": "fake", "max_tokens": 4, "messages": [
        {"role": "system", "content": "a"}, {"role": "user", "content": "boom"}]})
    assert r.status_code == 400 and "no boom" in r.json()["error"]["message"]


def test_anthropic_call_arguments_that_stop_being_json_stop_there_streamed_or_not(fake_client):
    """The Anthropic SDK parses every input_json_delta prefix: a model that
    writes Python's True mid-arguments must not break its stream. Pieces go
    out while the text parses; the input is what they hold, streamed or not."""
    import anthropic

    bad = '<tool_call>\n{"name": "write_note", "arguments": {"title": "a", "stars": 5, "body": True}}\n</tool_call>'
    client, _ = fake_client(bad, chat_template=HERMES_TEMPLATE)
    _, calls = anthropic_stream(client, anthropic_body())
    sent = "".join(calls[0]["pieces"])
    assert sent.startswith('{"title": "a", "stars": 5, "body":') and "True" not in sent
    blocks = client.post("/v1/messages", json=anthropic_body()).json()["content"]
    (use,) = [b for b in blocks if b["type"] == "tool_use"]
    assert use["input"] == {"title": "a", "stars": 5}
    sdk = anthropic.Anthropic(base_url=str(client.base_url), api_key="none", http_client=client, max_retries=0)
    with sdk.messages.stream(**anthropic_body()) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [("write_note", use["input"])]
    good, _ = fake_client(FAMILIES["hermes"][1], chat_template=HERMES_TEMPLATE)
    _, calls = anthropic_stream(good, anthropic_body())
    assert len(calls[0]["pieces"]) > 10 and json.loads("".join(calls[0]["pieces"])) == NOTE
