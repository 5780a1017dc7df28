"""Tool-call parsers: model output text -> content text + structured calls.

Three families of markup are understood:

* ``hermes`` (Hermes, Qwen 2/2.5/3, and mlxfast's fallback prompt):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number,
  anywhere in the output.
* ``llama3``: the whole output is one or more JSON objects
  ``{"name": ..., "parameters": {...}}`` (separated by ``;`` or newlines),
  optionally after ``<|python_tag|>``.
* ``mistral``: ``[TOOL_CALLS]`` followed by a JSON array
  ``[{"name": ..., "arguments": {...}}]`` or by ``name[ARGS]{...}`` pairs.

Every parser is streaming: ``feed(text)`` returns the events that are final so
far, ``finish()`` the rest. Text before a call streams out as it arrives;
anything that could still turn out to be markup is held back, so markup never
leaks into content. A call whose body does not parse is given back as text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Union


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as a string


@dataclass
class Text:
    text: str


Event = Union[Text, ToolCall]

_DECODER = json.JSONDecoder()


def _held_prefix(buf: str, marker: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``marker``."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


def _call_from_obj(obj: Any, arg_keys=("arguments", "parameters")) -> ToolCall | None:
    """A ToolCall from ``{"name": str, "arguments"|"parameters": dict|str}``."""
    if not isinstance(obj, dict):
        return None
    if "function" in obj and isinstance(obj["function"], dict):  # OpenAI-shaped
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args: Any = {}
    for k in arg_keys:
        if k in obj:
            args = obj[k]
            break
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            return None
        args = parsed
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def _merge(events: Iterable[Event]) -> list[Event]:
    """Join adjacent Text events and drop empty ones."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, Text):
            if not e.text:
                continue
            if out and isinstance(out[-1], Text):
                out[-1] = Text(out[-1].text + e.text)
                continue
        out.append(e)
    return out


class ToolCallParser:
    """Base class: a parser that finds no calls (all text)."""

    family = "none"

    def feed(self, text: str) -> list[Event]:
        return [Text(text)] if text else []

    def finish(self) -> list[Event]:
        return []

    def parse(self, text: str) -> list[Event]:
        """The events of a complete output (non-streaming)."""
        return _merge(self.feed(text) + self.finish())


class HermesParser(ToolCallParser):
    family = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self):
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if not self._in_call:
                i = self._buf.find(self.START)
                if i < 0:
                    keep = _held_prefix(self._buf, self.START)
                    emit = self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    out.append(Text(emit))
                    return _merge(out)
                out.append(Text(self._buf[:i]))
                self._buf = self._buf[i + len(self.START):]
                self._in_call = True
            j = self._buf.find(self.END)
            if j < 0:
                return _merge(out)
            body = self._buf[:j]
            self._buf = self._buf[j + len(self.END):]
            self._in_call = False
            out.extend(self._parse_body(body, closed=True))

    def _parse_body(self, body: str, closed: bool) -> list[Event]:
        calls = _parse_json_sequence(body)
        if calls:
            return list(calls)
        raw = self.START + body + (self.END if closed else "")
        return [Text(raw)]

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            return _merge(self._parse_body(buf, closed=False))
        return _merge([Text(buf)])


def _parse_json_sequence(body: str, arg_keys=("arguments", "parameters")) -> list[ToolCall] | None:
    """Calls from one or more JSON values (objects or arrays of objects)
    separated by whitespace, ``;`` or ``,``; None unless the whole body parses."""
    calls: list[ToolCall] = []
    i, n = 0, len(body)
    while True:
        while i < n and body[i] in " \t\r\n;,":
            i += 1
        if i >= n:
            break
        try:
            obj, i = _DECODER.raw_decode(body, i)
        except json.JSONDecodeError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        for item in items:
            call = _call_from_obj(item, arg_keys)
            if call is None:
                return None
            calls.append(call)
    return calls or None


_LLAMA_PREFIX = re.compile(r'\s*(\{\s*("(n(a(m(e("\s*)?)?)?)?)?)?)?$')
_LLAMA_START = re.compile(r'\s*\{\s*"name"\s*:')


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x: the output is JSON calls, optionally after ``<|python_tag|>``."""

    family = "llama3"
    TAG = "<|python_tag|>"

    def __init__(self):
        self._buf = ""
        self._mode = "start"  # start -> text | call

    def feed(self, text: str) -> list[Event]:
        if self._mode == "text":
            return [Text(text)] if text else []
        self._buf += text
        if self._mode == "call":
            return []
        stripped = self._buf.lstrip()
        if stripped.startswith(self.TAG) or _LLAMA_START.match(self._buf):
            self._mode = "call"
            return []
        if self.TAG.startswith(stripped) or _LLAMA_PREFIX.match(self._buf):
            return []  # could still become a call
        self._mode = "text"
        buf, self._buf = self._buf, ""
        return [Text(buf)]

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if not buf:
            return []
        body = buf.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):]
        calls = _parse_json_sequence(body)
        if calls:
            return list(calls)
        return [Text(buf)]


class MistralParser(ToolCallParser):
    family = "mistral"
    START = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def __init__(self):
        self._buf = ""
        self._in_calls = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        if self._in_calls:
            return []
        i = self._buf.find(self.START)
        if i >= 0:
            out = self._buf[:i]
            self._buf = self._buf[i:]
            self._in_calls = True
            return [Text(out)] if out else []
        keep = _held_prefix(self._buf, self.START)
        emit = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return [Text(emit)] if emit else []

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if not self._in_calls:
            return [Text(buf)] if buf else []
        calls: list[ToolCall] = []
        segments = [s for s in buf.split(self.START) if s.strip()]
        for seg in segments:
            got = self._parse_segment(seg)
            if got is None:
                return [Text(buf)]
            calls.extend(got)
        return list(calls) if calls else [Text(buf)]

    def _parse_segment(self, seg: str) -> list[ToolCall] | None:
        s = seg.strip()
        if s.startswith("[") or s.startswith("{"):
            return _parse_json_sequence(s)
        # v11+: name[ARGS]{json} (or name{json})
        calls: list[ToolCall] = []
        i = 0
        while i < len(s):
            m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?\s*", s[i:])
            if not m:
                return None
            name = m.group(1)
            i += m.end()
            try:
                args, i = _DECODER.raw_decode(s, i)
            except json.JSONDecodeError:
                return None
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
            while i < len(s) and s[i] in " \t\r\n,;":
                i += 1
        return calls or None


PARSERS = {"hermes": HermesParser, "llama3": Llama3JsonParser, "mistral": MistralParser}


def detect_family(chat_template: str | None) -> str:
    """Which markup a model's chat template uses for tool calls (``hermes``
    when the template shows none: that is the format mlxfast prompts for)."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "parameters" in t and "tools" in t):
        return "llama3"
    return "hermes"


def make_parser(family: str) -> ToolCallParser:
    try:
        return PARSERS[family]()
    except KeyError:
        raise ValueError(f"unknown tool-call format {family!r} (known: {', '.join(PARSERS)})") from None


def markup_tokens(family: str) -> list[str]:
    """Markers a tokenizer may hold as single special tokens (their text may be
    dropped by a detokenizer that skips special tokens)."""
    return {
        "hermes": ["<tool_call>", "</tool_call>"],
        "llama3": ["<|python_tag|>"],
        "mistral": ["[TOOL_CALLS]", "[ARGS]"],
    }.get(family, [])


def render_tool_call(family: str, name: str, arguments: dict | str) -> str:
    """How the model writes one call (used to put past calls back into a prompt
    for templates that cannot render tool calls themselves)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if family == "llama3":
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
    if family == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": arguments}], ensure_ascii=False)
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def fallback_system_prompt(tools: list[dict]) -> str:
    """Tool instructions for a model whose chat template has no tool support
    (Hermes format, which ``HermesParser`` reads back)."""
    lines = [
        "You may call one or more functions to assist with the user query.",
        "You are provided with function signatures within <tools></tools> XML tags:",
        "<tools>",
    ]
    for t in tools:
        lines.append(json.dumps(t, ensure_ascii=False))
    lines += [
        "</tools>",
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:",
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    ]
    return "\n".join(lines)
