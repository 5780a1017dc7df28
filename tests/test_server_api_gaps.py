"""Fields real clients send that used to be silently dropped or wrongly
refused: legacy function calling, stream_options, model names."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_legacy_functions_produce_a_function_call(openai_client):
    r = openai_client.chat.completions.create(
        model="default", messages=ASK, functions=[WEATHER], function_call={"name": "get_weather"},
        max_tokens=40, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "function_call"
    assert choice.message.function_call.name == "get_weather"
    assert isinstance(json.loads(choice.message.function_call.arguments)["city"], str)
    assert not choice.message.tool_calls


def test_legacy_functions_stream_a_function_call(openai_client):
    name, args, finish = "", "", None
    for c in openai_client.chat.completions.create(
            model="default", messages=ASK, functions=[WEATHER], function_call={"name": "get_weather"},
            max_tokens=40, temperature=0, stream=True):
        d = c.choices[0].delta
        assert not d.tool_calls
        if d.function_call:
            name += d.function_call.name or ""
            args += d.function_call.arguments or ""
        finish = c.choices[0].finish_reason or finish
    assert name == "get_weather" and finish == "function_call"
    assert isinstance(json.loads(args)["city"], str)


def test_legacy_function_call_none_means_no_call(openai_client):
    r = openai_client.chat.completions.create(
        model="default", messages=ASK, functions=[WEATHER], function_call="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.function_call is None and r.choices[0].finish_reason != "function_call"


def test_functions_and_tools_together_are_refused(server):
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60, json={
        "messages": ASK, "functions": [WEATHER], "tools": [{"type": "function", "function": WEATHER}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "functions"


@pytest.mark.parametrize("path, extra", [
    ("/v1/chat/completions", {"messages": ASK}),
    ("/v1/completions", {"prompt": "Hello"}),
])
def test_stream_options_without_stream_is_refused(server, path, extra):
    for stream in (None, False):
        body = dict(extra, max_tokens=2, stream_options={"include_usage": True})
        if stream is not None:
            body["stream"] = stream
        r = httpx.post(server.url + path, headers=server.headers, json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert "stream_options" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "stream_options"


def test_models_retrieve_answers_every_served_name(openai_client, server):
    listed = [m.id for m in openai_client.models.list().data]
    for name in listed + ["default"]:
        assert openai_client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("no-such-model")


def test_unknown_model_names_are_served_and_reported_by_the_served_name(openai_client):
    served = openai_client.models.list().data[0].id
    r = openai_client.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=2)
    assert r.model == served


def test_aliases_and_strict_model_names(server_b):
    h = {"Authorization": f"Bearer {server_b.api_key}"}
    assert [m["id"] for m in httpx.get(server_b.url + "/v1/models", headers=h).json()["data"]] == ["smol"]
    for name in ("smol", "smol-alias", "default"):
        assert httpx.get(server_b.url + f"/v1/models/{name}", headers=h).json()["id"] == name
        r = httpx.post(server_b.url + "/v1/chat/completions", headers=h, timeout=60,
                       json={"model": name, "messages": ASK, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "smol"
    r = httpx.post(server_b.url + "/v1/chat/completions", headers=h, timeout=60,
                   json={"model": "gpt-4o", "messages": ASK, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(server_b.url + "/v1/messages", headers=h, timeout=60,
                   json={"model": "claude-x", "messages": ASK, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# ---------------------------------------------------------------- Anthropic structured output


def test_anthropic_messages_parse_returns_a_parsed_object(anthropic_client):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    m = anthropic_client.messages.parse(
        model="default", max_tokens=40, output_format=City, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Name a big city in France, as JSON."}])
    assert isinstance(m.parsed_output, City)
    assert m.parsed_output.name and m.parsed_output.country


def test_anthropic_output_config_schema_is_enforced_when_streaming(server):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    body = {"model": "default", "max_tokens": 24, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "What is two plus two?"}],
            "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    text = ""
    with httpx.stream("POST", server.url + "/v1/messages", headers=server.headers, json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                if ev["type"] == "content_block_delta":
                    text += ev["delta"]["text"]
    assert isinstance(json.loads(text)["answer"], int)


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
LOOKUP = {"name": "lookup", "description": "Look a city up.", "parameters": CITY}


def _call_or_answer(calls, text):
    """Tools left to the model plus a JSON format: the answer is one call
    with valid arguments, or JSON that follows the format (the union grammar)."""
    if calls:
        name, args = calls[0]
        assert name == "lookup" and set(json.loads(args)) == {"city"}
    else:
        assert set(json.loads(text)) == {"city"}


@pytest.mark.parametrize("question", ["Which city is the capital of France?", "Look up Paris with the tool."])
def test_tools_and_a_json_format_allow_a_call_or_the_answer(openai_client, anthropic_client, question):
    r = openai_client.chat.completions.create(
        model="default", max_tokens=40, temperature=0, messages=[{"role": "user", "content": question}],
        tools=[{"type": "function", "function": LOOKUP}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    m = r.choices[0].message
    _call_or_answer([(c.function.name, c.function.arguments) for c in m.tool_calls or []], m.content)
    a = anthropic_client.messages.create(
        model="default", max_tokens=40, messages=[{"role": "user", "content": question}],
        tools=[{"name": "lookup", "description": LOOKUP["description"], "input_schema": CITY}],
        extra_body={"temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": CITY}}})
    _call_or_answer([(b.name, json.dumps(b.input)) for b in a.content if b.type == "tool_use"],
                    "".join(b.text for b in a.content if b.type == "text"))


@pytest.mark.parametrize("extra", [
    {"output_config": {"format": {"type": "json_schema", "schema": {"$ref": "#"}}}},  # cannot be enforced
    {"output_config": {"format": {"type": "json_schema"}}},  # no schema
    {"output_config": {"format": {"type": "regex", "schema": {}}}},
    {"output_config": {"effort": "extreme"}},
    {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
     "thinking": {"type": "enabled", "budget_tokens": 1024}},
])
def test_anthropic_output_config_that_cannot_be_enforced_is_a_400(server, extra):
    body = {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **extra}
    r = httpx.post(server.url + "/v1/messages", headers=server.headers, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------- agents and the prefix cache


def test_claude_code_billing_line_does_not_defeat_the_prefix_cache(anthropic_client):
    """Two requests that differ only in the per-request billing line: the
    second reads the whole system prompt from the cache."""
    system = ("You are a careful coding agent. Follow the repository's conventions, keep changes small, "
              "and explain what you changed and why. ") * 3

    def ask(cch):
        return anthropic_client.messages.create(
            model="default", max_tokens=2, extra_body={"temperature": 0},
            system=[{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.3; "
                                             f"cc_entrypoint=cli; cch={cch};"},
                    {"type": "text", "text": system}],
            messages=[{"role": "user", "content": f"Say hi {cch}"}])

    ask("0a1b2")  # caches the system prompt
    second = ask("f9e8d")
    n_system = anthropic_client.messages.count_tokens(
        model="default", system=system, messages=[{"role": "user", "content": "x"}]).input_tokens
    assert second.usage.cache_read_input_tokens >= n_system - 16  # all but the last partial block


# ---------------------------------------------------------------- n, batched prompts, best_of, suffix


def _stats(server):
    return httpx.get(server.url + "/stats", headers=server.headers, timeout=30).json()["metrics"]


def test_chat_n_shares_one_prefill_and_seeded_n_is_reproducible(openai_client, server):
    system = "You are a helpful assistant. Answer in a few words, and be kind about it. " * 4
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Name a color."}]
    before = _stats(server)
    r = openai_client.chat.completions.create(model="default", messages=msgs, n=3, max_tokens=6,
                                              temperature=1.0, seed=11)
    after = _stats(server)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content for c in r.choices)
    n_prompt = r.usage.prompt_tokens
    assert 3 <= r.usage.completion_tokens <= 18
    # The prompt was computed once: the other two choices read its full blocks from the prefix cache.
    full_blocks = (n_prompt - 1) // 16
    assert after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] >= 2 * full_blocks * 16 - 32
    again = openai_client.chat.completions.create(model="default", messages=msgs, n=3, max_tokens=6,
                                                  temperature=1.0, seed=11)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    alone = [openai_client.chat.completions.create(model="default", messages=msgs, max_tokens=6,
                                                   temperature=1.0, seed=11 + i).choices[0].message.content
             for i in range(3)]
    assert alone == [c.message.content for c in r.choices]  # choice i is the request seeded seed + i


def test_chat_n_streams_every_choice_with_its_index(openai_client):
    texts, finishes, usage = {}, {}, None
    for c in openai_client.chat.completions.create(
            model="default", messages=ASK, n=3, max_tokens=5, temperature=0.8, seed=3, stream=True,
            stream_options={"include_usage": True}):
        if c.usage:
            usage = c.usage
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert sorted(texts) == [0, 1, 2] and sorted(finishes) == [0, 1, 2]
    assert all(texts.values())
    single = openai_client.chat.completions.create(model="default", messages=ASK, max_tokens=1)
    assert usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    assert 3 <= usage.completion_tokens <= 15


def test_completions_batched_prompts_and_n(openai_client):
    prompts = ["The capital of France is", "One, two, three,", "Water is made of"]
    r = openai_client.completions.create(model="default", prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for p, c in zip(prompts, r.choices):
        alone = openai_client.completions.create(model="default", prompt=p, max_tokens=4, temperature=0)
        assert c.text == alone.choices[0].text
    r2 = openai_client.completions.create(model="default", prompt=prompts[:2], n=2, max_tokens=3,
                                          temperature=0.9, seed=5)
    assert [c.index for c in r2.choices] == [0, 1, 2, 3]
    ids = openai_client.completions.create(model="default", prompt=[[504, 3458], [504]], max_tokens=2)
    assert len(ids.choices) == 2


def test_completions_best_of_returns_the_most_likely(openai_client):
    kw = dict(model="default", prompt="My favourite animal is the", max_tokens=4, temperature=1.0, seed=9)
    best = openai_client.completions.create(best_of=3, n=1, logprobs=0, **kw)
    cands = openai_client.completions.create(n=3, logprobs=0, **kw)
    scores = [sum(c.logprobs.token_logprobs) for c in cands.choices]
    assert len(best.choices) == 1
    assert best.choices[0].text == cands.choices[scores.index(max(scores))].text


def test_legacy_logprobs_carry_the_chosen_token(openai_client):
    """OpenAI's (and vLLM's) legacy logprobs: each position's top_logprobs
    has the n best and the chosen token, so logprobs=0 gives the chosen one
    alone, never null."""
    kw = dict(model="default", prompt="My favourite animal is the", max_tokens=4, temperature=1.0, seed=3)
    for n in (0, 2):
        lp = openai_client.completions.create(logprobs=n, **kw).choices[0].logprobs
        for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[tok] == pytest.approx(value) and n <= len(top) <= n + 1
        if n == 0:
            assert all(len(top) == 1 for top in lp.top_logprobs)


@pytest.mark.parametrize("extra, param", [
    ({"suffix": "return x"}, "suffix"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
])
def test_completions_refusals(server, extra, param):
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                   json={"prompt": "def f(x):", "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_prompt_logprobs_is_refused_not_ignored(server):
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60,
                   json={"messages": ASK, "max_tokens": 2, "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_billing_line_is_cut_only_where_claude_code_puts_it():
    from mlxfast.server.prompts import strip_billing_header

    line = "x-anthropic-billing-header: cc_version=2.1; cch=ab12c;"
    sys_msg = {"role": "system", "content": f"{line}\nYou are helpful."}
    assert strip_billing_header([sys_msg])[0]["content"] == "You are helpful."
    assert strip_billing_header([{"role": "system", "content": line}, {"role": "user", "content": "x"}]) == \
        [{"role": "user", "content": "x"}]
    later = [{"role": "system", "content": f"You are helpful.\n{line}"}]
    assert strip_billing_header(later) == later  # only a leading line is the billing header
    user = [{"role": "user", "content": line}]
    assert strip_billing_header(user) == user


# ------------------------------------------------ vLLM's request fields (supported, not dropped)


def chat(server, **body):
    body.setdefault("messages", ASK)
    return httpx.post(server.url + "/v1/chat/completions", headers=server.headers, json=body, timeout=120)


def test_min_tokens_keeps_eos_and_stop_strings_off_until_it(server):
    hello = [{"role": "user", "content": "Say hello."}]
    plain = chat(server, messages=hello, max_tokens=60, temperature=0).json()
    n = plain["usage"]["completion_tokens"]
    assert plain["choices"][0]["finish_reason"] == "stop" and n < 55  # the answer ends by itself
    longer = chat(server, messages=hello, max_tokens=60, temperature=0, min_tokens=n + 5).json()
    assert longer["usage"]["completion_tokens"] >= n + 5
    assert longer["choices"][0]["message"]["content"].startswith(plain["choices"][0]["message"]["content"])
    text = plain["choices"][0]["message"]["content"]
    stop = text[1:3]  # matches at once without min_tokens
    cut = chat(server, messages=hello, max_tokens=60, temperature=0, stop=[stop]).json()
    assert cut["choices"][0]["message"]["content"] == text[:1]
    late = chat(server, messages=hello, max_tokens=60, temperature=0, stop=[stop], min_tokens=6).json()
    assert late["usage"]["completion_tokens"] >= 6 and len(late["choices"][0]["message"]["content"]) > 1
    r = chat(server, max_tokens=5, min_tokens=6)
    assert r.status_code == 400 and "min_tokens" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "min_tokens"


def test_include_stop_str_in_output(server, openai_client):
    text = chat(server, max_tokens=30, temperature=0).json()["choices"][0]["message"]["content"]
    stop = text.split()[1]
    cut = chat(server, max_tokens=30, temperature=0, stop=[stop]).json()["choices"][0]["message"]["content"]
    kept = chat(server, max_tokens=30, temperature=0, stop=[stop],
                include_stop_str_in_output=True).json()["choices"][0]["message"]["content"]
    assert kept == cut + stop
    r = openai_client.completions.create(model="m", prompt="One, two, three,", max_tokens=20, temperature=0,
                                         stop=[","], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text.endswith(",") and r.choices[0].text.count(",") == 1


@pytest.mark.parametrize("field, value, check", [
    ("guided_choice", ["yes", "no"], lambda t: t in ("yes", "no")),
    ("guided_regex", "[0-9]{3}-[a-z]{2}", lambda t: __import__("re").fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ("guided_json", json.dumps({"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
                                "required": ["n"], "additionalProperties": False}),
     lambda t: set(json.loads(t)) == {"n"} and isinstance(json.loads(t)["n"], int)),
    ("structured_outputs", {"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ("structured_outputs", {"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ("guided_grammar", 'root ::= "yes" | "no"', lambda t: t in ("yes", "no")),
    ("structured_outputs", {"grammar": 'root ::= [0-9]{3} "-" [a-z]{2}'},
     lambda t: __import__("re").fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ("guided_grammar", 'start: "up" | "down"', lambda t: t in ("up", "down")),  # Lark, as vLLM's guidance takes
    # llama.cpp's names
    ("grammar", 'root ::= "a"{5,5}', lambda t: t == "aaaaa"),
    ("json_schema", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                     "additionalProperties": False}, lambda t: isinstance(json.loads(t)["ok"], bool)),
    ("response_format", {"type": "json_object", "schema": {"const": "42"}}, lambda t: json.loads(t) == "42"),
])
def test_structured_output_fields_of_vllm_and_llama_cpp_are_enforced(server, field, value, check):
    r = chat(server, max_tokens=40, temperature=0, **{field: value})
    assert r.status_code == 200, r.text
    assert check(r.json()["choices"][0]["message"]["content"])
    c = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=120,
                   json={"prompt": "Answer:", "max_tokens": 40, "temperature": 0, field: value})
    assert c.status_code == 200
    choice = c.json()["choices"][0]
    if choice["finish_reason"] == "length":  # any JSON object may run past max_tokens: its start
        assert value == {"json_object": True} and choice["text"].startswith("{"), choice
    else:
        assert check(choice["text"]), choice


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"grammar": "  "}, "grammar"),
    ({"response_format": {"type": "json_object", "schema": 123}}, "response_format"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
])
def test_structured_output_that_cannot_be_enforced_is_a_400(server, body, param):
    r = chat(server, max_tokens=4, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_continuous_usage_stats_put_usage_on_every_chunk(server):
    def chunks(path, body):
        with httpx.stream("POST", server.url + path, headers=server.headers, timeout=120, json=dict(
                body, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})) as r:
            return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]

    got = chunks("/v1/chat/completions", {"messages": ASK, "max_tokens": 6, "temperature": 0})
    *choice_chunks, last = got
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    used = [c["usage"]["completion_tokens"] for c in choice_chunks]
    assert used == sorted(used) and used[0] == 0 and used[-1] == 6
    assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in choice_chunks)
    got = chunks("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "n": 2, "temperature": 1, "seed": 1})
    for i in (0, 1):
        used = [c["usage"]["completion_tokens"] for c in got if c["choices"] and c["choices"][0]["index"] == i]
        assert used[-1] == 3 and used == sorted(used)
    assert got[-1]["usage"]["completion_tokens"] == 6
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=server.headers, timeout=120, json={
            "messages": ASK, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}) as r:
        plain = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert [c["usage"]["completion_tokens"] for c in plain if "usage" in c] == [3]  # the last chunk only


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": ASK, "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ("/v1/chat/completions", {"messages": ASK, "functions": [{"name": "f", "parameters": {"type": "array"}}]},
     "functions[0].parameters"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     "tools[0].parameters"),
])
def test_a_tool_whose_arguments_are_not_an_object_is_refused(server, path, body, param):
    r = httpx.post(server.url + path, headers=server.headers, json=dict(body, max_tokens=4) if "messages" in body
                   else dict(body, max_output_tokens=4), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_anthropic_tool_whose_input_is_not_an_object_is_refused(server):
    r = httpx.post(server.url + "/v1/messages", headers=server.headers, timeout=60, json={
        "model": "m", "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"},
        "tools": [{"name": "f", "input_schema": {"type": "string"}}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "tools[0].input_schema" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", lambda n: {"prompt": [1] * n, "max_tokens": 2}, "prompt"),
    ("/v1/responses", lambda n: {"input": "hi " * n, "max_output_tokens": 2}, "input"),
    ("/v1/chat/completions", lambda n: {"messages": [{"role": "user", "content": "hi " * n}], "max_tokens": 2},
     "messages"),
])
def test_a_context_overflow_names_the_prompts_field(server, path, body, param):
    n = httpx.post(server.url + "/tokenize", json={"prompt": "x"}, headers=server.headers).json()["max_model_len"]
    r = httpx.post(server.url + path, headers=server.headers, json=body(n + 10), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == param


def test_anthropic_output_format_beta_name_and_count_tokens_with_a_format(server):
    def post(path, **body):
        return httpx.post(server.url + path, headers=server.headers, timeout=60, json={
            "model": "default", "messages": [{"role": "user", "content": "Name a city, as JSON."}], **body})

    fmt = {"type": "json_schema", "schema": CITY}
    m = post("/v1/messages", max_tokens=30, temperature=0, output_format=fmt)
    assert m.status_code == 200, m.text
    assert set(json.loads(m.json()["content"][0]["text"])) == {"city"}
    both = post("/v1/messages", max_tokens=30, output_format=fmt, output_config={"format": fmt})
    assert both.status_code == 400 and both.json()["type"] == "error"
    usage = m.json()["usage"]
    for extra in ({"output_config": {"format": fmt}}, {"output_format": fmt}, {"output_config": {}}):
        r = post("/v1/messages/count_tokens", **extra)
        assert r.status_code == 200, r.text
        assert r.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]


def test_llama_cpp_n_predict_is_max_tokens(server):
    def post(path, **body):
        return httpx.post(server.url + path, headers=server.headers, timeout=120, json=body).json()

    r = post("/v1/completions", prompt="I believe the meaning of life is", n_predict=3, ignore_eos=True)
    assert r["usage"]["completion_tokens"] == 3
    r = post("/v1/completions", prompt="Hi", n_predict=3, max_tokens=5, ignore_eos=True)  # max_tokens wins
    assert r["usage"]["completion_tokens"] == 5
    r = post("/v1/chat/completions", messages=ASK, n_predict=2, ignore_eos=True)
    assert r["usage"]["completion_tokens"] == 2
    bad = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60,
                     json={"messages": ASK, "n_predict": 0})
    assert bad.status_code == 400 and "n_predict" in bad.json()["error"]["message"]


def test_chat_echo_starts_the_answer_with_the_assistants_last_message(server, openai_client):
    """vLLM's chat ``echo`` with continue_final_message: the answer is the
    message continued, whole; without an assistant message last, nothing is echoed."""
    msgs = [{"role": "user", "content": "Complete the saying."}, {"role": "assistant", "content": "An apple a day"}]
    kw = dict(model="m", messages=msgs, max_tokens=6, temperature=0)
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    plain = openai_client.chat.completions.create(**kw, extra_body=extra).choices[0].message.content
    echoed = openai_client.chat.completions.create(**kw, extra_body=dict(extra, echo=True))
    assert echoed.choices[0].message.content == "An apple a day" + plain
    streamed = "".join(c.choices[0].delta.content or "" for c in openai_client.chat.completions.create(
        **kw, stream=True, extra_body=dict(extra, echo=True)) if c.choices)
    assert streamed == "An apple a day" + plain
    r = openai_client.chat.completions.create(model="m", messages=ASK, max_tokens=3, temperature=0,
                                              extra_body={"echo": True})
    alone = openai_client.chat.completions.create(model="m", messages=ASK, max_tokens=3, temperature=0)
    assert r.choices[0].message.content == alone.choices[0].message.content


def test_thousands_of_choices_compile(server):
    choices = [f"option {i}" for i in range(5000)]
    r = chat(server, max_tokens=8, temperature=0, guided_choice=choices)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["message"]["content"] in choices


def _completion(server, **body):
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                   json={"prompt": "Hello", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_special_tokens_leave_no_text_unless_asked_for(server, openai_client, tokenizer):
    """vLLM's skip_special_tokens (default true; llama.cpp's server prints no
    control token either): a forced <|im_start|> counts as a token but writes
    nothing; false writes it; as a stop string it still stops there."""
    start = tokenizer.token_to_id("<|im_start|>")
    force = {"logit_bias": {str(start): 100}, "max_tokens": 3}
    c = _completion(server, **force)
    assert (c["text"], c["finish_reason"]) == ("", "length")
    assert _completion(server, **force, skip_special_tokens=False)["text"] == "<|im_start|>" * 3
    c = _completion(server, **force, stop=["<|im_start|>"])
    assert (c["text"], c["finish_reason"]) == ("", "stop")
    chunks = list(openai_client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], stream=True, temperature=0, **force))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ""
    r = openai_client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], temperature=0, **force,
        extra_body={"skip_special_tokens": False})
    assert r.choices[0].message.content == "<|im_start|>" * 3
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                   json={"prompt": "Hello", "skip_special_tokens": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special_tokens"


def test_a_character_cut_by_max_tokens_is_dropped(server, tokenizer):
    """The output's last bytes that only begin a character are dropped (as vLLM
    and llama.cpp's server do), not written as U+FFFD; an invalid byte before
    them still is."""
    lead = tokenizer.token_to_id("ð")  # the byte 0xF0, which opens a 4-byte character
    assert tokenizer.token_bytes(lead) == b"\xf0"
    force = {"logit_bias": {str(lead): 100}}
    assert _completion(server, **force, max_tokens=1)["text"] == ""
    assert _completion(server, **force, max_tokens=2)["text"] == "\ufffd"


def test_the_stop_token_has_its_logprob_and_counts_in_every_usage(server, tokenizer):
    """vLLM's contract: one logprob entry per completion token, the EOS that
    ended the answer included (it adds no text); streamed usage reaches the
    final count on the finishing chunk."""
    eos = tokenizer.eos_token_id
    c = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60, json={
        "prompt": "Hello", "max_tokens": 5, "temperature": 0, "logprobs": 2, "logit_bias": {str(eos): 100}}).json()
    lp = c["choices"][0]["logprobs"]
    assert c["choices"][0]["finish_reason"] == "stop" and c["choices"][0]["text"] == ""
    assert c["usage"]["completion_tokens"] == 1 == len(lp["tokens"]) == len(lp["token_logprobs"])
    # the model's own logprob of EOS there (logprobs are of the raw logits, before logit_bias)
    assert -100 < lp["token_logprobs"][0] < 0 and lp["text_offset"] == [0]
    ask = {"messages": [{"role": "user", "content": "Reply with the single word yes."}], "max_tokens": 60,
           "temperature": 0, "logprobs": True}
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60, json=ask).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    assert "".join(e["token"] for e in content[:-1]) == r["choices"][0]["message"]["content"]
    counts, final = [], None
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=server.headers, timeout=60, json={
            **ask, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    counts.append(chunk["usage"]["completion_tokens"])
                else:
                    final = chunk["usage"]["completion_tokens"]
    assert final == r["usage"]["completion_tokens"] == counts[-1]


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, openai_client):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (left
    truncation), -1 as many as the context holds; usage and echo show the
    prompt the model saw."""
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    ids = httpx.post(server.url + "/tokenize", headers=server.headers, json={"prompt": prompt}).json()["tokens"]
    tail = httpx.post(server.url + "/detokenize", headers=server.headers, json={"tokens": ids[-4:]}).json()["prompt"]
    c = _completion(server, prompt=prompt, max_tokens=3, truncate_prompt_tokens=4, echo=True)
    alone = _completion(server, prompt=ids[-4:], max_tokens=3, echo=True)
    assert c["text"] == alone["text"] and c["text"].startswith(tail)
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60, json={
        "prompt": prompt, "max_tokens": 3, "truncate_prompt_tokens": 4})
    assert r.json()["usage"]["prompt_tokens"] == 4
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60, json={
        "prompt": prompt, "max_tokens": 3, "truncate_prompt_tokens": 100})
    assert r.json()["usage"]["prompt_tokens"] == len(ids)  # shorter than k: whole
    long = "word " * 3000  # beyond the context
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60, json={
        "prompt": long, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    chat = openai_client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": long}], max_tokens=3,
        extra_body={"truncate_prompt_tokens": 50})
    assert chat.usage.prompt_tokens == 50
    for k, code in ((0, 400), (-2, 400), (10 ** 7, 400)):
        r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60, json={
            "prompt": prompt, "max_tokens": 3, "truncate_prompt_tokens": k})
        assert r.status_code == code and r.json()["error"]["param"] == "truncate_prompt_tokens"


def _sse(server, path, body) -> list[dict]:
    with httpx.stream("POST", server.url + path, headers=server.headers, timeout=60,
                      json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_return_token_ids_gives_the_ids_the_model_saw_and_wrote(server, tokenizer):
    """vLLM's return_token_ids (RL trainers, agent tracing): the prompt's ids
    and one id per completion token (the EOS that ended it too), streamed as
    each chunk's ids; the prompt's ids fed back as a prompt give the same
    answer, token for token."""
    chat = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12,
            "temperature": 0, "return_token_ids": True}
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60, json=chat).json()
    prompt_ids, out_ids = r["prompt_token_ids"], r["choices"][0]["token_ids"]
    templated = httpx.post(server.url + "/tokenize", headers=server.headers,
                           json={"messages": chat["messages"]}).json()["tokens"]
    assert prompt_ids == templated and len(prompt_ids) == r["usage"]["prompt_tokens"]
    assert len(out_ids) == r["usage"]["completion_tokens"] and out_ids
    assert tokenizer.decode(out_ids, skip_special_tokens=True) == r["choices"][0]["message"]["content"]
    chunks = _sse(server, "/v1/chat/completions", chat)
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == out_ids
    # token in, token out: the ids fed back as a text completion's prompt
    back = _completion(server, prompt=prompt_ids, max_tokens=12, return_token_ids=True)
    assert back["token_ids"] == out_ids and back["prompt_token_ids"] == prompt_ids
    plain = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60,
                       json={**chat, "return_token_ids": False}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_return_token_ids_on_text_completions(server, tokenizer):
    """Each choice has its prompt's ids; with echo its token_ids start with
    them (vLLM's); streamed, a choice's first chunk carries the prompt's ids
    and the chunks' ids add up to the whole answer's, EOS included."""
    eos = tokenizer.eos_token_id
    body = {"prompt": ["The sky is", "One, two,"], "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60, json=body).json()
    for choice, text in zip(r["choices"], body["prompt"]):
        ids = httpx.post(server.url + "/tokenize", headers=server.headers, json={"prompt": text}).json()["tokens"]
        assert choice["prompt_token_ids"] == ids
        assert tokenizer.decode(choice["token_ids"]) == choice["text"] and len(choice["token_ids"]) == 6
    echoed = _completion(server, prompt="The sky is", max_tokens=6, echo=True, return_token_ids=True)
    assert echoed["token_ids"] == r["choices"][0]["prompt_token_ids"] + r["choices"][0]["token_ids"]
    chunks = _sse(server, "/v1/completions", body)
    for i, choice in enumerate(r["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
    # an answer ended by EOS: its id is the last one, streamed or not
    ended = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "logit_bias": {str(eos): 100},
             "return_token_ids": True}
    assert _completion(server, **ended)["token_ids"] == [eos]
    assert [t for c in _sse(server, "/v1/completions", ended) for t in c["choices"][0]["token_ids"]] == [eos]
    # an echo streams the prompt's ids with the prompt's text
    first = _sse(server, "/v1/completions", {**body, "prompt": "The sky is", "echo": True})[0]["choices"][0]
    assert first["text"] == "The sky is" and first["token_ids"] == r["choices"][0]["prompt_token_ids"]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server):
    """vLLM's return_tokens_as_token_ids: logprobs name every token
    "token_id:<id>" (the chosen ones and the alternatives), so bytes that are
    not text stay identifiable."""
    r = _completion(server, max_tokens=5, logprobs=2, return_token_ids=True, return_tokens_as_token_ids=True)
    assert r["logprobs"]["tokens"] == [f"token_id:{t}" for t in r["token_ids"]]
    for top in r["logprobs"]["top_logprobs"]:
        assert top and all(k.startswith("token_id:") and k[9:].isdigit() for k in top)
    c = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0, "logprobs": True,
        "top_logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True}).json()["choices"][0]
    entries = c["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(t["token"].startswith("token_id:") for e in entries for t in e["top_logprobs"])
    assert entries[0]["bytes"] == list(entries[0]["token"].encode())
    plain = _completion(server, max_tokens=5, logprobs=2)
    assert not any(t.startswith("token_id:") for t in plain["logprobs"]["tokens"])


def test_a_schema_object_gets_only_its_named_keys(server, openai_client):
    """Pydantic, instructor, magentic and llm send schemas without
    additionalProperties; the default model given JSON Schema's own reading
    added keys of its own until max_tokens (instructor's create failed).
    Every route that takes a schema closes its objects."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"]}
    ask = [{"role": "user", "content": "Facts about Paris"}]
    r = openai_client.chat.completions.create(
        model="m", messages=ask, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content)) == {"city", "is_capital"}
    tool = {"type": "function", "function": {"name": "facts", "parameters": schema}}
    r = openai_client.chat.completions.create(model="m", messages=ask, max_tokens=60, temperature=0,
                                              tools=[tool], tool_choice="required")
    assert set(json.loads(r.choices[0].message.tool_calls[0].function.arguments)) == {"city", "is_capital"}
    # vLLM's structured_outputs.disable_additional_properties: false gives JSON Schema's reading back
    opened = openai_client.chat.completions.create(
        model="m", messages=ask, max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"json": schema, "disable_additional_properties": False}})
    assert opened.choices[0].message.content.startswith('{"city": "Paris", "is_capital": true, "')
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60, json={
        "messages": ask, "structured_outputs": {"json": schema, "disable_additional_properties": "yes"}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "structured_outputs.disable_additional_properties"


def test_a_tool_without_parameters_is_called_with_none(openai_client):
    """OpenAI: omitting parameters defines a function with an empty
    parameter list; a forced call's arguments were any JSON object."""
    r = openai_client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=40, temperature=0,
        tools=[{"type": "function", "function": {"name": "now", "description": "Current time"}}],
        tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "now" and json.loads(call.function.arguments) == {}


def test_an_assistant_refusal_part_is_history(server, tokenizer):
    """OpenAI's assistant content may hold refusal parts (an earlier answer's
    refusal sent back): the template sees their text; it was a 400."""
    def prompt(content):
        return httpx.post(server.url + "/tokenize", headers=server.headers, json={"messages": [
            {"role": "user", "content": "x"}, {"role": "assistant", "content": content},
            {"role": "user", "content": "ok"}]}).json()["tokens"]
    assert prompt([{"type": "refusal", "refusal": "I can't help with that."}]) == prompt("I can't help with that.")
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60, json={
        "messages": [{"role": "user", "content": "x"},
                     {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                     {"role": "user", "content": "ok"}], "max_tokens": 3})
    assert r.status_code == 200
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}], "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


# ---------------------------------------------------------------- stop strings and forced calls

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.mark.parametrize("stop", [["\n"], [","], ["add"]])
def test_stop_strings_do_not_cut_a_forced_call(openai_client, stop):
    # The stop matched inside the call's markup and the answer was empty
    # (finish_reason stop, no call). A forced call is the whole answer.
    kw = dict(model="m", messages=[{"role": "user", "content": "Add 2 and 3."}], temperature=0, max_tokens=60,
              tools=[ADD], tool_choice="required")
    want = openai_client.chat.completions.create(**kw).choices[0]
    got = openai_client.chat.completions.create(stop=stop, **kw).choices[0]
    assert want.finish_reason == got.finish_reason == "tool_calls"
    assert [c.function.arguments for c in got.message.tool_calls] == \
        [c.function.arguments for c in want.message.tool_calls]
    # where text is the answer, the stop string still cuts it
    text = openai_client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count: 1, 2, 3,"}],
                                                 temperature=0, max_tokens=30, stop=[","])
    assert "," not in (text.choices[0].message.content or "") and text.choices[0].finish_reason in ("stop", "length")


def test_stop_sequences_do_not_cut_a_forced_tool_use(anthropic_client):
    tool = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                                    "required": ["city"]}}
    r = anthropic_client.messages.create(model="m", max_tokens=60, stop_sequences=["the", "\n"],
                                         messages=[{"role": "user", "content": "What's the weather in Rome?"}],
                                         tools=[tool], tool_choice={"type": "any"}, extra_body={"temperature": 0})
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"], r
    assert isinstance(r.content[0].input["city"], str)
