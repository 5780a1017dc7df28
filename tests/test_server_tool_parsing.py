"""Forced tool calls through the real server: a call whose arguments contain
tool-call markup inside a JSON string still comes back as a tool call.

With the default model, this request makes it write code containing
``</tool_call>`` inside the ``code`` string; the call completes in under 64
tokens (max_tokens is passed because the server fixture defaults to 16)."""

from __future__ import annotations

import json

TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]
MESSAGES = [{"role": "system", "content": "You are a coding assistant."},
            {"role": "user", "content": "Write an example"}]
REQUEST = dict(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required",
               temperature=0, max_tokens=64)


def assert_python_call(name: str, arguments: str) -> None:
    assert name == "python"
    args = json.loads(arguments)
    assert isinstance(args, dict) and isinstance(args.get("code"), str)


def test_forced_call_with_markup_in_arguments(openai_client):
    r = openai_client.chat.completions.create(**REQUEST)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert_python_call(call.function.name, call.function.arguments)
    assert "<tool_call>" not in (choice.message.content or "")


def test_forced_call_with_markup_in_arguments_streamed(openai_client):
    content, names, args, finish = [], {}, {}, None
    for chunk in openai_client.chat.completions.create(**REQUEST, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        for d in choice.delta.tool_calls or []:
            if d.function and d.function.name:
                names[d.index] = d.function.name
            args[d.index] = args.get(d.index, "") + ((d.function and d.function.arguments) or "")
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert list(names) == [0] and list(args) == [0]
    assert_python_call(names[0], args[0])
    assert "<tool_call>" not in "".join(content)


def test_tool_markup_that_is_no_call_comes_back_as_text(openai_client):
    """The model writes the start marker as prose and stops without an end
    marker: the whole text is the answer (it was dropped from the marker on,
    with finish "stop"), streamed or not."""
    text = "Use the <tool_call> tag to call tools."
    req = dict(model="default", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
               max_tokens=50, temperature=0, extra_body={"guided_regex": r"Use the <tool_call> tag to call tools\."})
    r = openai_client.chat.completions.create(**req)
    assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       openai_client.chat.completions.create(**req, stream=True) if c.choices)
    assert streamed == text
