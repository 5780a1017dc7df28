"""Black-box: third-party client frameworks complete a turn against the real
server (the session ``server`` fixture): LangChain's ChatOpenAI (chat
completions) and ChatAnthropic (Messages), and the OpenAI Agents SDK over
chat completions and over the Responses API.

The default model is tiny, so these assert only what the server guarantees:
the shapes of answers, and the calls and JSON that a grammar forces (a forced
tool call, ``response_format`` json_schema), never answer quality.

Nothing here may reach the network: LangChain token counting (tiktoken
downloads its encodings) is never called, and Agents SDK tracing is off.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from typing import Annotated

import pytest
from pydantic import BaseModel, Field

MAX_TOKENS = 64
ASK_WEATHER = "What is the weather in Paris?"


class WeatherArgs(BaseModel):
    """Arguments of the get_weather tool."""

    city: str = Field(max_length=20, description="The city name")


class CityFacts(BaseModel):
    """Facts about a city."""

    city: str = Field(max_length=20, description="The city name")
    is_capital: bool = Field(description="Whether the city is a national capital")


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Any attempt by a client to resolve or connect to a host other than
    loopback is refused and fails the test (the server runs in its own
    process, unaffected)."""
    attempts = []

    def loopback(host) -> bool:
        if isinstance(host, bytes):
            host = host.decode()
        if host in (None, "localhost"):
            return True
        try:
            return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
        except ValueError:
            return False

    real_getaddrinfo = socket.getaddrinfo
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def getaddrinfo(host, *a, **kw):
        if not loopback(host):
            attempts.append(("getaddrinfo", host))
            raise socket.gaierror(f"test: {host!r} is not loopback")
        return real_getaddrinfo(host, *a, **kw)

    def guard(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not loopback(address[0]):
            attempts.append(("connect", address))
            raise ConnectionRefusedError(f"test: {address!r} is not loopback")

    def connect(sock, address):
        guard(sock, address)
        return real_connect(sock, address)

    def connect_ex(sock, address):
        guard(sock, address)
        return real_connect_ex(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    yield
    assert attempts == [], f"a client tried to reach the network: {attempts}"


@pytest.fixture(scope="module")
def served(openai_client) -> str:
    """The model name the server lists (the one it reports in answers)."""
    return openai_client.models.list().data[0].id


# ------------------------------------------------------------ LangChain ChatOpenAI


@pytest.fixture(scope="module")
def chat_openai(server, served):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=served, base_url=server.url + "/v1", api_key=server.api_key,
                      temperature=0, max_tokens=MAX_TOKENS, max_retries=0, timeout=120,
                      use_responses_api=False)


def weather_tool():
    """A LangChain function tool whose arguments are bounded (a tiny model's
    string could otherwise run past max_tokens)."""
    from langchain_core.tools import StructuredTool

    return StructuredTool.from_function(get_weather, name="get_weather", args_schema=WeatherArgs,
                                        description="Current weather in a city")


def test_langchain_openai_invoke(chat_openai, served):
    from langchain_core.messages import AIMessage

    m = chat_openai.invoke("What is the capital of France?")
    assert isinstance(m, AIMessage)
    assert isinstance(m.content, str) and m.content.strip()
    assert m.tool_calls == []
    assert m.response_metadata["model_name"] == served
    assert m.response_metadata["finish_reason"] in ("stop", "length")
    u = m.usage_metadata  # from the server's usage, not counted locally
    assert u["input_tokens"] > 0 and 0 < u["output_tokens"] <= MAX_TOKENS


def test_langchain_openai_forced_tool_call(chat_openai):
    m = chat_openai.bind_tools([weather_tool()], tool_choice="get_weather").invoke(ASK_WEATHER)
    assert len(m.tool_calls) == 1, (m.content, m.tool_calls, m.invalid_tool_calls)
    (call,) = m.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    WeatherArgs.model_validate(call["args"])
    assert set(call["args"]) == {"city"}
    assert m.invalid_tool_calls == []
    assert m.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_openai_tool_result_round_trip(chat_openai):
    """The forced call goes back with its result (an assistant message with
    tool_calls, then a tool message): the server takes LangChain's history and
    answers in text."""
    from langchain_core.messages import HumanMessage, ToolMessage

    tool = weather_tool()
    first = chat_openai.bind_tools([tool], tool_choice="get_weather").invoke(ASK_WEATHER)
    (call,) = first.tool_calls
    history = [HumanMessage(ASK_WEATHER), first,
               ToolMessage(tool.invoke(call["args"]), tool_call_id=call["id"])]
    m = chat_openai.bind_tools([tool], tool_choice="none").invoke(history)
    assert m.tool_calls == [] and isinstance(m.content, str)
    assert m.response_metadata["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_openai_structured_output(chat_openai, method):
    structured = chat_openai.with_structured_output(CityFacts, method=method, include_raw=True)
    out = structured.invoke("Tell me about Paris.")
    assert out["parsing_error"] is None, (out["parsing_error"], out["raw"])
    assert isinstance(out["parsed"], CityFacts)
    raw = out["raw"]
    if method == "json_schema":  # the answer is the JSON document itself
        CityFacts.model_validate_json(raw.content)
    else:  # a forced call of the schema's tool
        assert [c["name"] for c in raw.tool_calls] == ["CityFacts"]


def test_langchain_openai_stream_forced_tool_call(chat_openai):
    bound = chat_openai.bind_tools([weather_tool()], tool_choice="get_weather")
    chunks = list(bound.stream(ASK_WEATHER))
    assert len(chunks) > 1
    msg = chunks[0]
    for c in chunks[1:]:
        msg = msg + c
    assert len(msg.tool_calls) == 1, (msg.content, msg.tool_call_chunks, msg.invalid_tool_calls)
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    WeatherArgs.model_validate(call["args"])
    # the args arrived as JSON text that parses on its own
    (tcc,) = msg.tool_call_chunks
    assert json.loads(tcc["args"]) == call["args"]
    assert msg.response_metadata.get("finish_reason") == "tool_calls"
    # the same call as without streaming (greedy)
    solo = bound.invoke(ASK_WEATHER)
    assert solo.tool_calls[0]["args"] == call["args"]


# ------------------------------------------------------------ LangChain ChatOpenAI over the Responses API


@pytest.fixture(scope="module")
def chat_responses(server, served):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=served, base_url=server.url + "/v1", api_key=server.api_key,
                      temperature=0, max_tokens=MAX_TOKENS, max_retries=0, timeout=120,
                      use_responses_api=True)


def test_langchain_responses_invoke(chat_responses, served):
    from langchain_core.messages import AIMessage

    m = chat_responses.invoke("What is the capital of France?")
    assert isinstance(m, AIMessage) and m.text.strip()
    assert m.response_metadata["model_name"] == served
    assert m.response_metadata["id"].startswith("resp_")
    assert m.usage_metadata["input_tokens"] > 0


def test_langchain_responses_forced_tool_call_and_result(chat_responses):
    from langchain_core.messages import HumanMessage, ToolMessage

    tool = weather_tool()
    first = chat_responses.bind_tools([tool], tool_choice="get_weather").invoke(ASK_WEATHER)
    assert len(first.tool_calls) == 1, (first.content, first.invalid_tool_calls)
    (call,) = first.tool_calls
    assert call["name"] == "get_weather"
    WeatherArgs.model_validate(call["args"])
    history = [HumanMessage(ASK_WEATHER), first, ToolMessage(tool.invoke(call["args"]), tool_call_id=call["id"])]
    m = chat_responses.bind_tools([tool], tool_choice="none").invoke(history)
    assert m.tool_calls == [] and m.text.strip()


def test_langchain_responses_stream_forced_tool_call(chat_responses):
    bound = chat_responses.bind_tools([weather_tool()], tool_choice="get_weather")
    chunks = list(bound.stream(ASK_WEATHER))
    msg = chunks[0]
    for c in chunks[1:]:
        msg = msg + c
    assert len(msg.tool_calls) == 1, (msg.content, msg.tool_call_chunks, msg.invalid_tool_calls)
    WeatherArgs.model_validate(msg.tool_calls[0]["args"])
    assert msg.tool_calls[0]["args"] == bound.invoke(ASK_WEATHER).tool_calls[0]["args"]


def test_langchain_responses_structured_output(chat_responses):
    out = chat_responses.with_structured_output(CityFacts, method="json_schema", include_raw=True).invoke(
        "Tell me about Paris.")
    assert out["parsing_error"] is None, (out["parsing_error"], out["raw"])
    assert isinstance(out["parsed"], CityFacts)


def test_langchain_responses_previous_response_id(server, served):
    """With use_previous_response_id LangChain sends only the new turn and
    the id of the last response: the server continues from its store."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=served, base_url=server.url + "/v1", api_key=server.api_key, temperature=0,
                     max_tokens=16, max_retries=0, timeout=120, use_responses_api=True,
                     use_previous_response_id=True)
    first = llm.invoke([HumanMessage("My name is Ada.")])
    second = llm.invoke([HumanMessage("My name is Ada."), first, HumanMessage("What is my name?")])
    assert second.response_metadata["id"] != first.response_metadata["id"]
    assert second.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"]
    # The history comes from the store: with the first turn deleted, the second (which can still be
    # read) still continues, with the first turn in its history, as on OpenAI; the first cannot.
    import httpx

    r = httpx.delete(f"{server.url}/v1/responses/{first.response_metadata['id']}", headers=server.headers)
    assert r.status_code == 200
    third = llm.invoke([HumanMessage("My name is Ada."), first, HumanMessage("What is my name?"), second,
                        HumanMessage("Again?")])
    assert third.usage_metadata["input_tokens"] > second.usage_metadata["input_tokens"]
    r = httpx.post(f"{server.url}/v1/responses", headers=server.headers, timeout=60, json={
        "model": served, "input": "Again?", "previous_response_id": first.response_metadata["id"]})
    assert r.status_code == 404


# ------------------------------------------------------------ LangChain ChatAnthropic


@pytest.fixture(scope="module")
def chat_anthropic(server):
    from langchain_anthropic import ChatAnthropic

    # An unknown model name is served by the one model (the Anthropic SDK and
    # LangChain want a model name; what they send is echoed back as served).
    return ChatAnthropic(model="local", base_url=server.url, api_key=server.api_key,
                         temperature=0, max_tokens=MAX_TOKENS, max_retries=0, timeout=120)


def test_langchain_anthropic_invoke(chat_anthropic, served):
    from langchain_core.messages import AIMessage

    m = chat_anthropic.invoke("What is the capital of France?")
    assert isinstance(m, AIMessage)
    assert m.text.strip() and m.tool_calls == []
    assert m.response_metadata["stop_reason"] in ("end_turn", "max_tokens")
    assert m.response_metadata["model"] == served
    u = m.usage_metadata
    assert u["input_tokens"] > 0 and 0 < u["output_tokens"] <= MAX_TOKENS


@pytest.mark.parametrize("choice", ["get_weather", "any"])
def test_langchain_anthropic_forced_tool_call(chat_anthropic, choice):
    m = chat_anthropic.bind_tools([weather_tool()], tool_choice=choice).invoke(ASK_WEATHER)
    assert len(m.tool_calls) == 1, (m.content, m.tool_calls, m.invalid_tool_calls)
    (call,) = m.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("toolu_")
    WeatherArgs.model_validate(call["args"])
    assert m.response_metadata["stop_reason"] == "tool_use"


def test_langchain_anthropic_stream_forced_tool_call(chat_anthropic):
    bound = chat_anthropic.bind_tools([weather_tool()], tool_choice="get_weather")
    chunks = list(bound.stream(ASK_WEATHER))
    msg = chunks[0]
    for c in chunks[1:]:
        msg = msg + c
    assert len(msg.tool_calls) == 1, (msg.content, msg.tool_call_chunks, msg.invalid_tool_calls)
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather"
    WeatherArgs.model_validate(call["args"])
    assert call["args"] == bound.invoke(ASK_WEATHER).tool_calls[0]["args"]


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_anthropic_structured_output(chat_anthropic, method):
    """function_calling (LangChain's default for Anthropic) forces a tool;
    json_schema sends output_config.format. Both are grammar-enforced here."""
    structured = chat_anthropic.with_structured_output(CityFacts, method=method, include_raw=True)
    out = structured.invoke("Tell me about Paris.")
    assert out["parsing_error"] is None, (out["parsing_error"], out["raw"])
    assert isinstance(out["parsed"], CityFacts)


# ------------------------------------------------------------ OpenAI Agents SDK


def run_agent(server, served, model_cls, tool_choice, streamed=False):
    """One Agents SDK run with a forced tool call; stops on the first tool
    call. Returns (result, the arguments the tool function received, the
    stream's events when ``streamed``)."""
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=20)]) -> str:
        """Current weather in a city.

        Args:
            city: The city name.
        """
        calls.append(city)
        return f"sunny in {city}"

    async def go():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)
        try:
            agent = Agent(
                name="weather",
                instructions="You answer questions about the weather using the tool.",
                model=model_cls(model=served, openai_client=client),
                # include_usage: the chat model asks for usage in its stream only against api.openai.com
                model_settings=ModelSettings(tool_choice=tool_choice, temperature=0, max_tokens=MAX_TOKENS,
                                             include_usage=True),
                tools=[get_weather],
                tool_use_behavior="stop_on_first_tool",
            )
            if not streamed:
                return await Runner.run(agent, ASK_WEATHER, max_turns=2), []
            run = Runner.run_streamed(agent, ASK_WEATHER, max_turns=2)
            events = [e async for e in run.stream_events()]
            return run, events
        finally:
            await client.close()

    result, events = asyncio.run(go())
    return result, calls, events


def check_agent_run(result, calls):
    from agents.items import ToolCallItem, ToolCallOutputItem

    assert len(calls) == 1, calls  # the tool function really ran, once
    WeatherArgs(city=calls[0])
    assert result.final_output == f"sunny in {calls[0]}"  # stop_on_first_tool: the tool's output
    kinds = [type(i) for i in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem], kinds
    assert len(result.raw_responses) == 1
    usage = result.raw_responses[0].usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= MAX_TOKENS


def check_streamed(events):
    """The run's stream: raw model events, then the tool call and its output."""
    types = [e.type for e in events]
    assert "raw_response_event" in types
    items = [e.name for e in events if e.type == "run_item_stream_event"]
    assert items == ["tool_called", "tool_output"], items


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
@pytest.mark.parametrize("tool_choice", ["required", "get_weather"])
@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_agents_sdk_forced_tool(server, served, api, tool_choice, streamed):
    """The Agents SDK's chat-completions model and its default model (POST /v1/responses)."""
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel

    model_cls = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    result, calls, events = run_agent(server, served, model_cls, tool_choice, streamed)
    check_agent_run(result, calls)
    if streamed:
        check_streamed(events)
    if streamed and api == "responses":
        deltas = [e.data for e in events if e.type == "raw_response_event"
                  and e.data.type == "response.function_call_arguments.delta"]
        assert json.loads("".join(d.delta for d in deltas)) == {"city": calls[0]}
    (item,) = [i for i in result.new_items if i.type == "tool_call_item"]
    assert item.raw_item.name == "get_weather"
    if api == "responses":
        assert item.raw_item.type == "function_call" and item.raw_item.call_id
    assert json.loads(item.raw_item.arguments) == {"city": calls[0]}
