"""OpenAI's Responses API (POST /v1/responses, GET / DELETE
/v1/responses/{id}, /input_items) against the real server, black box: the
official SDK with strict response validation (every Response and stream
event must match the SDK's models), and raw HTTP for the wire format and the
error shape."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

# ---------------------------------------------------------------- fixtures and helpers

YES = "Say only the word yes."  # the model answers "Yes." and stops
HI = "Say hi."
LONG = "Write a long story about a cat."

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
ASK_WEATHER = "What is the weather in Paris?"

SAVE_PARAMS = {"type": "object",
               "properties": {"text": {"type": "string", "maxLength": 60}, "count": {"type": "integer"}},
               "required": ["text", "count"], "additionalProperties": False}
SAVE = {"type": "function", "name": "save", "description": "Save a note", "parameters": SAVE_PARAMS,
        "strict": True}
ASK_SAVE = "Write a long story about a cat and save it."


class SaveArgs(BaseModel):
    """SAVE_PARAMS as a validator."""
    model_config = ConfigDict(extra="forbid", strict=True)
    text: str = Field(max_length=60)
    count: int


class Cat(BaseModel):
    name: str
    age: int


CAT_SCHEMA = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}


class CatStrict(BaseModel):
    """CAT_SCHEMA as a validator."""
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(max_length=12)
    age: int


@pytest.fixture(scope="module")
def client(server):
    """The SDK, validating every object it receives against its models."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120,
                      _strict_response_validation=True)
    yield c
    c.close()


def post(server, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", headers=server.headers, json=body, timeout=120, **kw)


def get(server, path: str) -> httpx.Response:
    return httpx.get(server.url + path, headers=server.headers, timeout=60)


def check_openai_error(r: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    """An error in OpenAI's shape; ``param``'s field (before any '.' or '[')
    and each of ``words`` in the message."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["type"] == "invalid_request_error", err
    if param is None:
        assert err["param"] is None, err
    else:
        assert isinstance(err["param"], str), err
        assert re.split(r"[.\[]", err["param"])[0] == param, err
    for w in words:
        assert w.lower() in err["message"].lower(), (w, err)
    return err


def check_finished(r, max_output_tokens: int) -> None:
    """A response that ended normally: completed, or cut at max_output_tokens."""
    assert r.status in ("completed", "incomplete"), r.status
    assert r.error is None
    if r.status == "incomplete":
        assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == max_output_tokens
    else:
        assert r.incomplete_details is None
    check_usage(r, max_output_tokens)


def check_usage(r, max_output_tokens: int) -> None:
    u = r.usage
    assert u is not None
    assert u.input_tokens > 0 and u.output_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens <= max_output_tokens
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens
    assert u.output_tokens_details.reasoning_tokens == 0  # this model does not think


def messages_of(r) -> list:
    return [o for o in r.output if o.type == "message"]


def calls_of(r) -> list:
    return [o for o in r.output if o.type == "function_call"]


def text_of(r) -> str:
    (msg,) = messages_of(r)
    assert msg.role == "assistant"
    assert [p.type for p in msg.content] == ["output_text"]
    return msg.content[0].text


# ---------------------------------------------------------------- 1. create


def test_create_string_input(client, server):
    served = client.models.list().data[0].id
    r = client.responses.create(model="anything", input=YES, max_output_tokens=16, temperature=0)
    assert r.id.startswith("resp_") and len(r.id) > len("resp_")
    assert r.object == "response"
    assert r.model == served
    assert r.status == "completed", r
    check_finished(r, 16)
    text = text_of(r)
    assert text.strip() and r.output_text == text
    (msg,) = messages_of(r)
    assert msg.status == "completed" and msg.id.startswith("msg_")
    assert r.max_output_tokens == 16 and r.temperature == 0
    assert r.tools == [] and r.tool_choice == "auto"
    # the same through raw HTTP: the JSON itself
    raw = post(server, {"input": YES, "max_output_tokens": 16, "temperature": 0})
    assert raw.status_code == 200, raw.text
    body = raw.json()
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["id"] != r.id
    assert body["status"] == "completed"
    assert body["output"][0]["content"][0]["text"] == text  # greedy: the same answer


def test_create_cut_at_max_output_tokens(client):
    r = client.responses.create(model="m", input=LONG, max_output_tokens=5, temperature=0)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5
    check_usage(r, 5)
    (msg,) = messages_of(r)
    assert msg.status == "incomplete"
    assert text_of(r)


# ---------------------------------------------------------------- 2. stream == create


def test_stream_text_equals_create(client):
    kw = dict(model="m", input=HI, max_output_tokens=16, temperature=0)
    plain = client.responses.create(**kw)
    deltas, types = [], []
    with client.responses.stream(**kw) as s:
        for ev in s:
            types.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
        final = s.get_final_response() if plain.status == "completed" else None
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == ("response.completed" if plain.status == "completed" else "response.incomplete")
    assert "".join(deltas) == text_of(plain)
    if final is not None:
        assert final.id != plain.id and final.id.startswith("resp_")
        assert text_of(final) == text_of(plain)
        assert final.usage.input_tokens == plain.usage.input_tokens
        assert final.usage.output_tokens == plain.usage.output_tokens


def test_stream_text_equals_create_when_cut(client):
    """The terminal event of a stream cut at max_output_tokens carries the same output."""
    kw = dict(model="m", input=LONG, max_output_tokens=12, temperature=0)
    plain = client.responses.create(**kw)
    assert plain.status == "incomplete"
    with client.responses.stream(**kw) as s:
        events = list(s)
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert text_of(last.response) == text_of(plain)
    assert last.response.usage.output_tokens == 12


def test_stream_forced_function_call_equals_create(client):
    kw = dict(model="m", input=ASK_SAVE, tools=[SAVE], tool_choice={"type": "function", "name": "save"},
              max_output_tokens=100, temperature=0)
    plain = client.responses.create(**kw)
    assert plain.status == "completed", plain
    (call,) = calls_of(plain)
    assert call.name == "save" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert not messages_of(plain)
    args = SaveArgs.model_validate(json.loads(call.arguments))
    assert len(args.text) > 10  # long-ish, so its arguments stream in several pieces

    deltas, done_args = [], []
    with client.responses.stream(**kw) as s:
        for ev in s:
            if ev.type == "response.function_call_arguments.delta":
                deltas.append(ev.delta)
            elif ev.type == "response.function_call_arguments.done":
                done_args.append(ev.arguments)
        final = s.get_final_response()
    assert len(deltas) > 1
    joined = "".join(deltas)
    SaveArgs.model_validate(json.loads(joined))
    assert done_args == [joined]
    (fcall,) = calls_of(final)
    assert fcall.arguments == joined == call.arguments
    assert fcall.name == "save" and fcall.status == "completed"
    # a strict tool: the SDK parsed the arguments itself
    assert fcall.parsed_arguments == json.loads(call.arguments)


# ---------------------------------------------------------------- 3. instructions


def test_instructions_and_developer_message(client, server):
    instructions = "Answer in one word."
    dev = "Be polite."
    r = client.responses.create(
        model="m", instructions=instructions,
        input=[{"role": "developer", "content": dev}, {"role": "user", "content": YES}],
        max_output_tokens=16, temperature=0)
    check_finished(r, 16)
    assert r.status == "completed"
    assert r.instructions == instructions
    assert text_of(r).strip()
    # both reached the prompt: the same prompt as chat completions' with two system messages
    chat = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60, json={
        "messages": [{"role": "system", "content": instructions}, {"role": "system", "content": dev},
                     {"role": "user", "content": YES}], "max_tokens": 16, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert r.usage.input_tokens == chat.json()["usage"]["prompt_tokens"]
    assert text_of(r) == chat.json()["choices"][0]["message"]["content"]
    # and without the instructions the prompt is a different one
    r2 = client.responses.create(model="m", input=[{"role": "developer", "content": dev},
                                                   {"role": "user", "content": YES}],
                                 max_output_tokens=16, temperature=0)
    assert r2.instructions is None
    assert r2.usage.input_tokens != r.usage.input_tokens


# ---------------------------------------------------------------- 4. tool round trips and the store


def _forced_weather(client, **kw):
    r = client.responses.create(model="m", input=ASK_WEATHER, tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=40, temperature=0, **kw)
    assert r.status == "completed", r
    (call,) = calls_of(r)
    assert call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    return r, call


def test_function_call_round_trip_previous_response_id_and_stateless(client):
    r1, call = _forced_weather(client)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}
    r2 = client.responses.create(model="m", previous_response_id=r1.id, input=[result], tools=[WEATHER],
                                 max_output_tokens=12, temperature=0)
    check_finished(r2, 12)
    assert r2.previous_response_id == r1.id
    assert r2.output
    # the call and the question are in its prompt, not only the result
    assert r2.usage.input_tokens > r1.usage.input_tokens + 5

    # statelessly: the call item and its result in input, nothing stored
    r3 = client.responses.create(
        model="m", store=False, tools=[WEATHER], max_output_tokens=12, temperature=0,
        input=[{"role": "user", "content": ASK_WEATHER}, call.model_dump(exclude_none=True), result])
    check_finished(r3, 12)
    assert r3.previous_response_id is None
    # the same conversation, so the same prompt and (greedy) the same answer
    assert r3.usage.input_tokens == r2.usage.input_tokens
    assert [o.type for o in r3.output] == [o.type for o in r2.output]
    if messages_of(r2):
        assert text_of(r3) == text_of(r2)


def test_unknown_previous_response_id_is_404(server):
    r = post(server, {"input": "hi", "previous_response_id": "resp_doesnotexist", "max_output_tokens": 2})
    assert r.status_code == 404, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == "previous_response_id"
    assert "resp_doesnotexist" in body["error"]["message"]


def test_unknown_previous_response_id_through_sdk(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="m", input="hi", previous_response_id="resp_nope", max_output_tokens=2)
    assert e.value.status_code == 404


def test_store_false_is_not_retrievable_nor_continuable(client, server):
    r = client.responses.create(model="m", input=HI, store=False, max_output_tokens=4, temperature=0)
    assert r.status in ("completed", "incomplete")
    assert get(server, f"/v1/responses/{r.id}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    cont = post(server, {"input": "and?", "previous_response_id": r.id, "max_output_tokens": 2})
    assert cont.status_code == 404 and cont.json()["error"]["param"] == "previous_response_id"


def test_stored_response_retrieve_input_items_delete(client, server):
    r = client.responses.create(model="m", input=HI, max_output_tokens=6, temperature=0,
                                metadata={"case": "store"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id
    assert got.status == r.status
    assert [o.model_dump() for o in got.output] == [o.model_dump() for o in r.output]
    assert got.usage == r.usage and got.metadata == {"case": "store"}
    raw = get(server, f"/v1/responses/{r.id}")
    assert raw.status_code == 200 and raw.json()["id"] == r.id

    items = client.responses.input_items.list(r.id)
    assert len(items.data) == 1
    (item,) = items.data
    assert item.type == "message" and item.role == "user"
    assert [(p.type, p.text) for p in item.content] == [("input_text", HI)]
    assert items.has_more is False

    client.responses.delete(r.id)
    assert get(server, f"/v1/responses/{r.id}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    gone = httpx.delete(server.url + f"/v1/responses/{r.id}", headers=server.headers, timeout=60)
    check_openai_error(gone, 404, None, r.id)
    assert get(server, f"/v1/responses/{r.id}/input_items").status_code == 404


def test_a_child_of_a_deleted_response_can_still_be_continued(client, server):
    """Deleting A hides it (no GET, no continuing from it), but B, which
    continues A and can still be read, can still be continued: A's turn is
    kept for it (OpenAI's behaviour)."""
    a = client.responses.create(model="m", input="My name is Ada.", max_output_tokens=3, temperature=0)
    b = client.responses.create(model="m", input="And yours?", previous_response_id=a.id,
                                max_output_tokens=3, temperature=0)
    client.responses.delete(a.id)
    assert get(server, f"/v1/responses/{a.id}").status_code == 404
    assert get(server, f"/v1/responses/{b.id}").status_code == 200
    c = client.responses.create(model="m", input="What is my name?", previous_response_id=b.id,
                                max_output_tokens=3, temperature=0)
    # the whole conversation is the prompt: A's turn is still in it
    assert c.usage.input_tokens > b.usage.input_tokens > a.usage.input_tokens
    cont = post(server, {"input": "x", "previous_response_id": a.id, "max_output_tokens": 2})
    assert cont.status_code == 404 and cont.json()["error"]["param"] == "previous_response_id"
    assert httpx.delete(server.url + f"/v1/responses/{a.id}", headers=server.headers, timeout=60).status_code == 404


def test_response_store_keeps_a_deleted_turn_only_while_it_is_continued():
    from mlxfast.server.response_store import ResponseStore, StoredResponse

    def entry(rid, prev):
        return StoredResponse({"id": rid}, [{"role": "user", "content": rid}], [], prev)

    store = ResponseStore(capacity=3)
    for rid, prev in (("a", None), ("b", "a"), ("c", "b")):
        store.put(entry(rid, prev))
    assert store.delete("b") and not store.delete("b")
    assert store.get("b") is None and store.history("b") is None
    assert [m["content"] for m in store.history("c")] == ["a", "b", "c"]
    assert store.delete("c")  # nothing continues b any more: b and c go, a stays
    assert len(store) == 1 and store.get("a") is not None
    store.put(entry("d", "a"))
    assert store.delete("a") and len(store) == 2  # a kept, hidden, for d
    store.put(entry("e", None))
    store.put(entry("f", None))  # evicts a (the oldest), then d is the oldest
    assert store.history("d") is None and store.get("d") is not None
    store.put(entry("g", None))  # d evicted
    assert store.get("d") is None and len(store) == 3


def test_input_items_lists_every_item_in_order(client, server):
    inp = [{"type": "message", "role": "developer", "content": "Be brief."},
           {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "one"}]},
           {"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "two", "annotations": []}]},
           {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "three"}]}]
    r = client.responses.create(model="m", input=inp, max_output_tokens=2, temperature=0)
    asc = get(server, f"/v1/responses/{r.id}/input_items?order=asc").json()
    assert [d["role"] for d in asc["data"]] == ["developer", "user", "assistant", "user"]
    assert all(isinstance(d["id"], str) and d["id"] for d in asc["data"])
    assert len({d["id"] for d in asc["data"]}) == 4
    desc = get(server, f"/v1/responses/{r.id}/input_items").json()  # the default order: newest first
    assert [d["id"] for d in desc["data"]] == [d["id"] for d in reversed(asc["data"])]
    page = get(server, f"/v1/responses/{r.id}/input_items?order=asc&limit=2").json()
    assert [d["id"] for d in page["data"]] == [d["id"] for d in asc["data"][:2]] and page["has_more"] is True
    rest = get(server, f"/v1/responses/{r.id}/input_items?order=asc&after={page['last_id']}").json()
    assert [d["id"] for d in rest["data"]] == [d["id"] for d in asc["data"][2:]] and rest["has_more"] is False


def test_input_item_ids_are_strings_or_made(client, server):
    inp = [{"type": "message", "role": "user", "content": "one", "id": None},
           {"type": "message", "role": "user", "content": "two", "id": "msg_mine"}]
    r = client.responses.create(model="m", input=inp, max_output_tokens=2, temperature=0)
    ids = [d["id"] for d in get(server, f"/v1/responses/{r.id}/input_items?order=asc").json()["data"]]
    assert ids[0].startswith("msg_") and ids[0] != "msg_mine" and ids[1] == "msg_mine"
    for bad in (123, {"x": 1}, ["a"]):
        r = post(server, {"model": "m", "input": [{"type": "message", "role": "user", "content": "x", "id": bad}]})
        assert r.status_code == 400 and "input[0]: 'id' must be a string" in r.json()["error"]["message"], r.text


def _weather_in(namespace: str) -> dict:
    inner = {k: v for k, v in WEATHER.items()}
    return {"type": "namespace", "name": namespace, "description": "Weather tools.", "tools": [inner]}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_namespace_tools_functions_are_called_with_their_namespace(client, stream):
    # Codex CLI groups tools in namespaces (its multi-agent tools): the model
    # sees the functions, the call comes back with its namespace.
    kw = dict(model="m", input=ASK_WEATHER, tools=[_weather_in("wx")],
              tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40, temperature=0)
    if stream:
        with client.responses.stream(**kw) as s:
            added = [e.item for e in s if e.type == "response.output_item.added"]
            r = s.get_final_response()
        assert [(i.name, i.namespace) for i in added] == [("get_weather", "wx")]
    else:
        r = client.responses.create(**kw)
    (call,) = calls_of(r)
    assert (call.name, call.namespace) == ("get_weather", "wx")
    assert isinstance(json.loads(call.arguments)["city"], str)
    # the same prompt as the function offered plainly: flattening adds only the namespace's description
    plain = client.responses.create(**{**kw, "tools": [dict(WEATHER, description="Weather tools. " +
                                                            WEATHER["description"])]})
    assert plain.usage.input_tokens == r.usage.input_tokens
    assert calls_of(plain)[0].arguments == call.arguments
    # sent back (with its namespace) and answered, statelessly
    r2 = client.responses.create(model="m", store=False, tools=[_weather_in("wx")], max_output_tokens=4,
                                 input=[{"role": "user", "content": ASK_WEATHER}, call.model_dump(exclude_none=True),
                                        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert r2.status in ("completed", "incomplete")


def test_functions_sharing_a_name_are_told_apart_by_namespace(client):
    from mlxfast.server.responses import ToolNames

    names = ToolNames([(None, "get_weather"), ("wx", "get_weather"), ("wx", "alerts")])
    assert names.shown(None, "get_weather") == "get_weather" and names.shown("wx", "get_weather") == "wx.get_weather"
    assert names.shown("wx", "alerts") == "alerts" and names.origin("wx.get_weather") == ("wx", "get_weather")
    assert names.chosen("alerts") == "alerts" and names.chosen("get_weather") == "get_weather"
    small = {"type": "function", "name": "get_weather",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    for choice, namespace in (("get_weather", None), ("wx.get_weather", "wx")):
        r = client.responses.create(model="m", input=ASK_WEATHER, max_output_tokens=24, temperature=0,
                                    tools=[small, {"type": "namespace", "name": "wx", "description": "",
                                                   "tools": [small]}],
                                    tool_choice={"type": "function", "name": choice})
        (call,) = calls_of(r)
        assert (call.name, call.namespace) == ("get_weather", namespace)


def test_an_output_without_call_id_names_its_tool(client):
    # Codex CLI's goals: an output the client made, named, with no call before it.
    r = client.responses.create(model="m", max_output_tokens=4, tools=[_weather_in("agent")], input=[
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "function_call_output", "name": "get_weather", "namespace": "agent", "output": "goal: x"}])
    assert r.status in ("completed", "incomplete")
    bare = client.responses.create(model="m", max_output_tokens=4, input=[{"type": "message", "role": "user",
                                                                           "content": "hi"}])
    assert r.usage.input_tokens > bare.usage.input_tokens + 3  # the output reached the prompt


def test_hosted_web_search_is_accepted_and_never_called(client, server):
    # Codex CLI offers it by default; nothing here can search, so the model is not shown it.
    kw = dict(model="m", input=YES, max_output_tokens=8, temperature=0)
    r = client.responses.create(tools=[{"type": "web_search", "external_web_access": False}], **kw)
    bare = client.responses.create(**kw)
    assert r.status == bare.status and text_of(r) == text_of(bare)
    assert r.usage.input_tokens == bare.usage.input_tokens and not calls_of(r)
    assert [t.type for t in r.tools] == ["web_search"]  # echoed as given


# ---------------------------------------------------------------- 5. continuation carries the history


def test_previous_response_id_carries_the_history(client):
    first = client.responses.create(model="m", input="My name is Bob.", max_output_tokens=16, temperature=0)
    check_finished(first, 16)
    second = client.responses.create(model="m", previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=16, temperature=0)
    check_finished(second, 16)
    alone = client.responses.create(model="m", input="What is my name?", max_output_tokens=16, temperature=0,
                                    store=False)
    # the first turn (its question and its answer) is in the second's prompt
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > alone.usage.input_tokens
    # the same history sent explicitly: the same prompt, and (greedy) the same answer
    explicit = client.responses.create(
        model="m", store=False, max_output_tokens=16, temperature=0,
        input=[{"role": "user", "content": "My name is Bob."},
               *[o.model_dump(exclude_none=True) for o in first.output],
               {"role": "user", "content": "What is my name?"}])
    assert explicit.usage.input_tokens == second.usage.input_tokens
    assert text_of(explicit) == text_of(second)
    # a chain of three: the third sees both earlier turns
    third = client.responses.create(model="m", previous_response_id=second.id, input="Thanks.",
                                    max_output_tokens=4, temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


# ---------------------------------------------------------------- 6. structured output


def test_parse_text_format_pydantic(client):
    r = client.responses.parse(model="m", input="Describe a cat as JSON.", text_format=Cat,
                               max_output_tokens=60, temperature=0)
    assert r.status == "completed", r
    assert isinstance(r.output_parsed, Cat)
    assert Cat.model_validate_json(r.output_text) == r.output_parsed
    assert r.text.format.type == "json_schema" and r.text.format.name == "Cat"


def test_json_schema_raw(client, server):
    fmt = {"type": "json_schema", "name": "cat", "schema": CAT_SCHEMA, "strict": True}
    r = client.responses.create(model="m", input="Describe a cat as JSON.", text={"format": fmt},
                                max_output_tokens=60, temperature=0)
    assert r.status == "completed", r
    CatStrict.model_validate(json.loads(text_of(r)))
    assert r.text.format.type == "json_schema" and r.text.format.name == "cat"
    assert r.text.format.schema_ == CAT_SCHEMA
    # streamed, through raw HTTP: the concatenated deltas validate too
    events = sse_events(post_stream(server, {"input": "Describe a dog as JSON.", "text": {"format": fmt},
                                              "max_output_tokens": 60, "temperature": 0}))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[-1]["type"] == "response.completed"
    CatStrict.model_validate(json.loads(text))


def test_json_object(client):
    r = client.responses.create(model="m", input="Any JSON object about a cat.",
                                text={"format": {"type": "json_object"}}, max_output_tokens=60, temperature=0)
    assert r.status == "completed", r
    assert isinstance(json.loads(text_of(r)), dict)
    assert r.text.format.type == "json_object"


# ---------------------------------------------------------------- 7. bad inputs

_MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("unknown item type", {"input": [{"type": "bogus_item", "x": 1}]}, "input", ["bogus_item"]),
    ("unknown role", {"input": [{"type": "message", "role": "wizard", "content": "hi"}]}, "input", ["wizard"]),
    ("input_image", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}]}, "input", ["input_image"]),
    ("arguments not JSON", {"input": _MSG + [
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{not json"},
        {"type": "function_call_output", "call_id": "call_1", "output": "x"}]}, "input", ["arguments", "JSON"]),
    ("web_search forced", {"input": "hi", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
     "tool_choice", ["web_search"]),
    ("function_call_output without call_id or name", {"input": _MSG + [
        {"type": "function_call_output", "output": "x"}]}, "input", ["call_id", "name"]),
    ("custom tool in a namespace", {"input": "hi", "tools": [{"type": "namespace", "name": "ns", "description": "d",
                                                              "tools": [{"type": "custom", "name": "patch"}]}]},
     "tools", ["tools[0].tools[0]", "custom"]),
    ("namespace without a name", {"input": "hi", "tools": [{"type": "namespace", "description": "d", "tools": []}]},
     "tools", ["namespace", "name"]),
    ("file_search", {"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]},
     "tools", ["file_search"]),
    ("computer_use_preview", {"input": "hi", "tools": [{"type": "computer_use_preview", "display_width": 800,
                                                        "display_height": 600, "environment": "linux"}]},
     "tools", ["computer_use_preview"]),
    ("mcp", {"input": "hi", "tools": [{"type": "mcp", "server_label": "x", "server_url": "http://x.invalid"}]},
     "tools", ["mcp"]),
    ("unknown tool type", {"input": "hi", "tools": [{"type": "frobnicator"}]}, "tools", ["frobnicator"]),
    ("tool_choice not in tools", {"input": "hi", "tools": [WEATHER],
                                  "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", ["nope"]),
    ("tool_choice required without tools", {"input": "hi", "tool_choice": "required"}, "tool_choice", ["tools"]),
    ("temperature too high", {"input": "hi", "temperature": 2.5}, "temperature", ["temperature"]),
    ("temperature negative", {"input": "hi", "temperature": -0.1}, "temperature", ["temperature"]),
    ("top_p zero", {"input": "hi", "top_p": 0}, "top_p", ["top_p"]),
    ("top_p above one", {"input": "hi", "top_p": 1.5}, "top_p", ["top_p"]),
    ("max_output_tokens zero", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens", ["max_output_tokens"]),
    ("top_logprobs 21", {"input": "hi", "top_logprobs": 21}, "top_logprobs", ["top_logprobs"]),
    ("input a number", {"input": 5}, "input", ["input"]),
    ("tools not a list", {"input": "hi", "tools": {"type": "function", "name": "f"}}, "tools", ["tools"]),
    ("temperature a string", {"input": "hi", "temperature": "0.5"}, "temperature", ["temperature"]),
    ("reasoning effort unknown", {"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning",
     ["reasoning.effort", "extreme"]),
    ("include unknown", {"input": "hi", "include": ["bogus.include"]}, "include", ["bogus.include"]),
    ("background", {"input": "hi", "background": True}, "background", ["background"]),
    ("truncation auto", {"input": "hi", "truncation": "auto"}, "truncation", ["truncation"]),
    ("json_schema without schema", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text", ["schema"]),
    ("metadata 17 keys", {"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata",
     ["metadata", "16"]),
    ("input missing", {"model": "m"}, "input", ["input"]),
    ("empty input list", {"input": []}, "input", ["input"]),
]


@pytest.mark.parametrize("body, param, words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_bad_input_is_a_400(server, body, param, words, stream):
    body = dict(body, max_output_tokens=body.get("max_output_tokens", 2))
    if stream:
        body["stream"] = True
    check_openai_error(post(server, body), 400, param, *words)


def test_bad_input_through_sdk(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="hi", tools=[{"type": "file_search", "vector_store_ids": ["v"]}],
                                max_output_tokens=2)
    assert e.value.status_code == 400 and "file_search" in e.value.message
    assert e.value.body["param"].startswith("tools")


def test_server_still_answers_after_bad_inputs(client):
    r = client.responses.create(model="m", input=YES, max_output_tokens=16, temperature=0)
    assert r.status == "completed"
    assert text_of(r).strip()


# ---------------------------------------------------------------- 8. concurrent streams


def test_eight_concurrent_streams_match_greedy_answers(server):
    prompts = [f"Write one short sentence about the number {i}." for i in range(8)]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0,
                                     timeout=300, _strict_response_validation=True)

        async def one(p):
            deltas, terminal, ids = [], None, set()
            async with aclient.responses.stream(model="m", input=p, max_output_tokens=10,
                                                temperature=0) as s:
                async for ev in s:
                    if ev.type == "response.output_text.delta":
                        deltas.append(ev.delta)
                    elif ev.type in ("response.created", "response.in_progress"):
                        ids.add(ev.response.id)
                    elif ev.type in ("response.completed", "response.incomplete", "response.failed"):
                        terminal = ev
                        ids.add(ev.response.id)
            assert terminal is not None and terminal.type in ("response.completed", "response.incomplete")
            assert len(ids) == 1
            assert "".join(deltas) == text_of(terminal.response)
            return text_of(terminal.response), next(iter(ids))

        together = await asyncio.gather(*(one(p) for p in prompts))
        alone = []
        for p in prompts:
            r = await aclient.responses.create(model="m", input=p, max_output_tokens=10, temperature=0)
            alone.append(text_of(r))
        await aclient.close()
        return together, alone

    together, alone = asyncio.run(run())
    assert len({rid for _, rid in together}) == 8
    assert all(t for t, _ in together)
    assert [t for t, _ in together] == alone


# ---------------------------------------------------------------- 9. raw SSE


def post_stream(server, body: dict) -> bytes:
    with httpx.stream("POST", server.url + "/v1/responses", headers=server.headers,
                      json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return r.read()


def sse_events(raw: bytes) -> list[dict]:
    """The events of a Responses stream, checking the framing on the way."""
    text = raw.decode("utf-8")
    assert "[DONE]" not in text
    assert text.endswith("\n\n")
    assert "\r" not in text
    events = []
    for frame in text[:-2].split("\n\n"):
        lines = frame.split("\n")
        if all(line.startswith(":") for line in lines):  # a comment (keep-alive)
            continue
        assert len(lines) == 2, frame
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        name, data = lines[0][len("event: "):], json.loads(lines[1][len("data: "):])
        assert isinstance(data, dict)
        assert data["type"] == name, frame
        assert "error" not in data or data["error"] is None  # the SDK would raise on a top-level error
        events.append(data)
    return events


def check_stream(events: list[dict]) -> dict:
    """The event order and bookkeeping of a Responses stream; its final response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    terminal = ("response.completed", "response.incomplete")
    assert events[-1]["type"] in terminal
    assert sum(e["type"] in terminal + ("response.failed",) for e in events) == 1
    rid = events[0]["response"]["id"]
    assert rid.startswith("resp_")
    for e in (events[0], events[1], events[-1]):
        assert e["response"]["id"] == rid
    assert events[0]["response"]["status"] == events[1]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    final = events[-1]["response"]
    assert final["status"] == events[-1]["type"].split(".")[1]

    added: dict[int, dict] = {}
    done: dict[int, dict] = {}
    parts: dict[int, list] = {}
    text_deltas: dict[int, list[str]] = {}
    text_done: dict[int, str] = {}
    arg_deltas: dict[int, list[str]] = {}
    arg_done: dict[int, str] = {}
    for e in events[2:-1]:
        t, i = e["type"], e.get("output_index")
        if t == "response.output_item.added":
            assert i not in added and i == len(added)  # indexes 0, 1, ... each once
            added[i] = e["item"]
            if e["item"]["type"] == "function_call":
                assert e["item"]["arguments"] == ""
        elif t == "response.output_item.done":
            assert i in added and i not in done
            done[i] = e["item"]
            assert (e["item"]["type"], e["item"].get("id")) == (added[i]["type"], added[i].get("id"))
        else:
            assert i in added and i not in done, e  # every item event sits between its added and done
            if t == "response.content_part.added":
                assert e["content_index"] == len(parts.setdefault(i, []))
                assert e["part"]["type"] == "output_text" and e["part"]["text"] == ""
                parts[i].append(e["part"])
            elif t == "response.output_text.delta":
                assert parts.get(i), "a text delta before its content part"
                assert e["item_id"] == added[i]["id"] and e["content_index"] == 0
                assert isinstance(e["logprobs"], list)
                text_deltas.setdefault(i, []).append(e["delta"])
            elif t == "response.output_text.done":
                text_done[i] = e["text"]
            elif t == "response.function_call_arguments.delta":
                assert e["item_id"] == added[i]["id"]
                arg_deltas.setdefault(i, []).append(e["delta"])
            elif t == "response.function_call_arguments.done":
                arg_done[i] = e["arguments"]
    assert set(done) == set(added)
    for i, item in added.items():
        if item["type"] == "message":
            assert "".join(text_deltas.get(i, [])) == text_done[i] == done[i]["content"][0]["text"]
        elif item["type"] == "function_call":
            assert "".join(arg_deltas.get(i, [])) == arg_done[i] == done[i]["arguments"]
            assert done[i]["call_id"] == item["call_id"]
    assert final["output"] == [done[i] for i in range(len(done))]
    return final


def test_raw_sse_text(server):
    final = check_stream(sse_events(post_stream(server, {"input": HI, "max_output_tokens": 16,
                                                         "temperature": 0})))
    assert [o["type"] for o in final["output"]] == ["message"]
    plain = post(server, {"input": HI, "max_output_tokens": 16, "temperature": 0}).json()
    assert final["output"][0]["content"][0]["text"] == plain["output"][0]["content"][0]["text"]
    for k in ("input_tokens", "output_tokens", "total_tokens"):
        assert final["usage"][k] == plain["usage"][k]


def test_raw_sse_cut_at_max_output_tokens(server):
    events = sse_events(post_stream(server, {"input": LONG, "max_output_tokens": 6, "temperature": 0}))
    final = check_stream(events)
    assert events[-1]["type"] == "response.incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 6


def test_raw_sse_function_call(server):
    events = sse_events(post_stream(server, {
        "input": ASK_WEATHER, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 40, "temperature": 0}))
    final = check_stream(events)
    assert events[-1]["type"] == "response.completed"
    (item,) = final["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["status"] == "completed"
    assert isinstance(json.loads(item["arguments"])["city"], str)


def test_raw_sse_instructions_echoed(server):
    events = sse_events(post_stream(server, {"input": YES, "instructions": "Answer in one word.",
                                             "max_output_tokens": 16, "temperature": 0}))
    check_stream(events)
    assert events[0]["response"]["instructions"] == events[-1]["response"]["instructions"] == "Answer in one word."


# ---------------------------------------------------------------- 10. reasoning effort


def test_reasoning_effort_low_on_a_model_without_thinking(client):
    r = client.responses.create(model="m", input=YES, reasoning={"effort": "low"}, max_output_tokens=16,
                                temperature=0)
    assert r.status == "completed", r
    check_finished(r, 16)
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert [o.type for o in r.output] == ["message"]  # no reasoning item
    assert r.reasoning.effort == "low"
    plain = client.responses.create(model="m", input=YES, max_output_tokens=16, temperature=0)
    assert text_of(r) == text_of(plain)


# ---------------------------------------------------------------- 11. logprobs


def test_top_logprobs(client):
    r = client.responses.create(model="m", input=HI, max_output_tokens=4, temperature=0, top_logprobs=2)
    check_finished(r, 4)
    part = messages_of(r)[0].content[0]
    lps = part.logprobs
    assert len(lps) == r.usage.output_tokens
    assert "".join(lp.token for lp in lps) == part.text
    for lp in lps:
        assert lp.logprob <= 0
        assert len(lp.top_logprobs) == 2
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
        # greedy: the chosen token is the most likely one
        assert lp.top_logprobs[0].token == lp.token and lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)
    # streamed: the deltas carry the same entries
    with client.responses.stream(model="m", input=HI, max_output_tokens=4, temperature=0, top_logprobs=2) as s:
        streamed = [lp for ev in s if ev.type == "response.output_text.delta" for lp in ev.logprobs]
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in lps]


def test_include_output_text_logprobs(client):
    r = client.responses.create(model="m", input=HI, max_output_tokens=4, temperature=0,
                                include=["message.output_text.logprobs"])
    lps = messages_of(r)[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens
    assert all(isinstance(lp.token, str) and lp.logprob <= 0 for lp in lps)
    assert all(lp.top_logprobs is not None for lp in lps)
    plain = client.responses.create(model="m", input=HI, max_output_tokens=4, temperature=0)
    assert not messages_of(plain)[0].content[0].logprobs


# ---------------------------------------------------------------- a call cut short


def test_function_call_cut_at_max_output_tokens_is_not_completed(client):
    """A forced call whose arguments max_output_tokens cut off is an
    incomplete item (its arguments are not JSON), not a completed one."""
    kw = dict(model="m", input=ASK_SAVE, tools=[SAVE], tool_choice={"type": "function", "name": "save"},
              max_output_tokens=20, temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "incomplete"
    (call,) = calls_of(r)
    with pytest.raises(ValueError):
        json.loads(call.arguments)
    assert call.status == "incomplete", call
    with client.responses.stream(**kw) as s:
        events = list(s)
    assert events[-1].type == "response.incomplete"
    (scall,) = calls_of(events[-1].response)
    assert scall.status == "incomplete", scall


def test_forced_call_cut_before_its_name_leaks_no_markup(client):
    """Cut inside the tool-call markup, the model's raw markup is not the answer text."""
    r = client.responses.create(model="m", input=ASK_SAVE, tools=[SAVE],
                                tool_choice={"type": "function", "name": "save"}, max_output_tokens=8,
                                temperature=0)
    assert r.status == "incomplete"
    for m in messages_of(r):
        for p in m.content:
            assert "<tool_call>" not in p.text, r.output


def test_input_items_of_every_kind_pass_the_sdk(client):
    """/input_items lists items the SDK's models accept: a message given with
    string content, an assistant message, a replayed call and its result
    (each as a client sends it, without a status)."""
    r1, call = _forced_weather(client)
    inp = [{"role": "developer", "content": "Be brief."},
           {"role": "user", "content": ASK_WEATHER},
           {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
           {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
           {"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}]},
           {"role": "user", "content": "Thanks."}]
    r = client.responses.create(model="m", input=inp, max_output_tokens=2, temperature=0)
    items = client.responses.input_items.list(r.id, order="asc")
    assert [i.type for i in items.data] == ["message", "message", "function_call", "function_call_output",
                                            "message", "message"]
    assert items.data[0].content[0].text == "Be brief."
    assert items.data[2].call_id == items.data[3].call_id == call.call_id


def test_stored_responses_are_not_streamed_back_nor_cancelled(client, server):
    r = client.responses.create(model="m", input=HI, max_output_tokens=2, temperature=0)
    got = get(server, f"/v1/responses/{r.id}?stream=true")
    assert got.status_code == 400 and got.json()["error"]["param"] == "stream"
    assert get(server, f"/v1/responses/{r.id}?stream=false").status_code == 200
    c = httpx.post(server.url + f"/v1/responses/{r.id}/cancel", headers=server.headers, timeout=60)
    assert c.status_code == 400 and "background" in c.json()["error"]["message"]
    c = httpx.post(server.url + "/v1/responses/resp_nope/cancel", headers=server.headers, timeout=60)
    assert c.status_code == 404
