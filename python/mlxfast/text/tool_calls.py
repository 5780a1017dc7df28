"""Tool-call parsers: model output text -> content text + structured calls.

Three families of markup are understood:

* ``hermes`` (Hermes, Qwen 2/2.5/3, and mlxfast's fallback prompt):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number,
  anywhere in the output.
* ``llama3``: the output is one or more JSON objects
  ``{"name": ..., "parameters": {...}}`` (separated by ``;`` or whitespace),
  optionally after ``<|python_tag|>``; text may follow the calls.
* ``mistral``: ``[TOOL_CALLS]`` followed by a JSON array
  ``[{"name": ..., "arguments": {...}}]`` or by ``name[ARGS]{...}``.

Every parser is streaming: ``feed(text)`` returns the events that are final so
far, ``finish()`` the rest; text may arrive in pieces of any size. Text before
a call streams out as it arrives; a tail that could still become a marker is
held back until it can no longer be one. Inside a call, JSON is scanned
(strings, escapes, nesting), so markup written inside an argument string does
not end the call. A call whose JSON does not parse is given back as its raw
text; when that happens because the output ended inside the call (cut off by
max_tokens, say), ``finish()`` also sets ``parser.unfinished_call``.
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
_SEPARATORS = " \t\r\n;,"


class _JsonScanner:
    """Reads JSON text as it grows in a caller's buffer, tracking strings
    (with escapes) and brace/bracket nesting, to tell where a value ends and
    whether a marker stands outside any JSON value."""

    def __init__(self, start: int = 0):
        self.pos = start  # how far into the caller's buffer it has read
        self.depth = 0
        self.in_string = False
        self.escaped = False

    @property
    def outside(self) -> bool:
        return self.depth == 0 and not self.in_string

    def _step(self, c: str) -> bool:
        """Take one character; True when it closes a top-level value."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]" and self.depth:
            self.depth -= 1
            return self.depth == 0
        return False

    def value_end(self, buf: str) -> int:
        """Read on through ``buf``: the index just past the top-level value
        that closes, or -1 if it is still open."""
        while self.pos < len(buf):
            self.pos += 1
            if self._step(buf[self.pos - 1]):
                return self.pos
        return -1

    def find_outside(self, buf: str, marker: str) -> int:
        """Read on through ``buf`` to ``marker`` outside JSON values: its index,
        or -1 (then ``pos`` stops before a tail that may still become it)."""
        while self.pos < len(buf):
            if self.outside and buf[self.pos] == marker[0]:
                if buf.startswith(marker, self.pos):
                    return self.pos
                if marker.startswith(buf[self.pos:]):
                    return -1
            self._step(buf[self.pos])
            self.pos += 1
        return -1


def _held_prefix(buf: str, marker: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``marker``."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


def _text_until(buf: str, marker: str) -> tuple[str, str, bool]:
    """Split ``buf`` at its first ``marker``: (text before, text after, True);
    without one: (text that can go out now, tail that may become the marker, False)."""
    i = buf.find(marker)
    if i >= 0:
        return buf[:i], buf[i + len(marker):], True
    keep = len(buf) - _held_prefix(buf, marker)
    return buf[:keep], buf[keep:], False


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


def _parse_json_sequence(body: str, arg_keys=("arguments", "parameters")) -> list[ToolCall] | None:
    """Calls from one or more JSON values (objects or arrays of objects)
    separated by whitespace, ``;`` or ``,``; None unless the whole body parses."""
    calls: list[ToolCall] = []
    i, n = 0, len(body)
    while True:
        while i < n and body[i] in _SEPARATORS:
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
    # Set by finish() when the output ended inside a call that never became
    # valid (cut off, say) and its raw text was given back as a Text event.
    unfinished_call = False

    def feed(self, text: str) -> list[Event]:
        return [Text(text)] if text else []

    def finish(self) -> list[Event]:
        return []

    def parse(self, text: str) -> list[Event]:
        """The events of a complete output (non-streaming)."""
        return _merge(self.feed(text) + self.finish())


class HermesParser(ToolCallParser):
    """``<tool_call>`` JSON ``</tool_call>``; the end marker counts only
    outside JSON strings and values."""

    family = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self):
        self._buf = ""  # text not given out yet; in a call, what follows START
        self._call: _JsonScanner | None = None  # reads the body while in a call

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._call is None:
                before, self._buf, opened = _text_until(self._buf, self.START)
                out.append(Text(before))
                if not opened:
                    return _merge(out)
                self._call = _JsonScanner()
            end = self._call.find_outside(self._buf, self.END)
            if end < 0:
                return _merge(out)
            body, self._buf = self._buf[:end], self._buf[end + len(self.END):]
            self._call = None
            out += _parse_json_sequence(body) or [Text(self.START + body + self.END)]

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if self._call is None:
            return _merge([Text(buf)])
        # A complete body stands as a call even without its end marker (or
        # with the end marker cut short, which the scanner stopped before).
        calls = _parse_json_sequence(buf[:self._call.pos])
        self._call = None
        if calls:
            return list(calls)
        self.unfinished_call = True
        return [Text(self.START + buf)]


_LLAMA_TAG = "<|python_tag|>"
_LLAMA_START = re.compile(r'\s*(?:<\|python_tag\|>\s*)?(\{)\s*"name"\s*:')
_LLAMA_PREFIX = re.compile(r'\s*(?:<\|python_tag\|>\s*)?(?:\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?)?')


def _could_start_llama_call(buf: str) -> bool:
    """Whether ``buf`` may still grow into the start of a llama3 call."""
    return bool(_LLAMA_PREFIX.fullmatch(buf)) or _LLAMA_TAG.startswith(buf.lstrip())


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x: the output is JSON calls, optionally after ``<|python_tag|>``;
    output that does not open like ``{"name":`` is text."""

    family = "llama3"
    TAG = _LLAMA_TAG

    def __init__(self):
        self._buf = ""  # text not given out yet; in a call, from its start
        self._mode = "start"  # start (undecided) -> call -> start ... | text
        self._call: _JsonScanner | None = None  # reads the call's JSON
        self._value_start = 0  # where the call's JSON opens in the buffer
        self._made_calls = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._mode == "start":
                self._decide()
            if self._mode == "text":
                out.append(Text(self._buf))
                self._buf = ""
            if self._mode != "call":
                return _merge(out)
            end = self._call.value_end(self._buf)
            if end < 0:
                return _merge(out)
            raw, self._buf = self._buf[:end], self._buf[end:]
            calls = _parse_json_sequence(raw[self._value_start:])
            if calls:
                out += calls
                self._made_calls = True
                self._mode = "start"
            else:
                out.append(Text(raw))
                self._mode = "text"

    def _decide(self) -> None:
        """Leave the start mode once the buffer shows a call or can no longer be one."""
        if self._made_calls:  # separators between calls are not content
            self._buf = self._buf.lstrip(_SEPARATORS)
        m = _LLAMA_START.match(self._buf)
        if m:
            self._mode = "call"
            self._value_start = m.start(1)
            self._call = _JsonScanner(self._value_start)
        elif not _could_start_llama_call(self._buf):
            self._mode = "text"

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if self._mode == "call":
            self.unfinished_call = True
        self._mode = "text"
        return [Text(buf)] if buf else []


# After [TOOL_CALLS]: a JSON array/object, or a name (and [ARGS]) then an object.
_MISTRAL_HEAD = re.compile(r"\s*(?:([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?\s*(?=\{)|(?=[\[{]))")


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS]`` then ``[{...}, ...]`` or ``name[ARGS]{...}``; the call
    ends where its JSON value closes."""

    family = "mistral"
    START = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def __init__(self):
        self._buf = ""  # text not given out yet; in a call, what follows START
        self._in_call = False
        self._name: str | None = None  # the name before [ARGS], if any
        self._value_start = 0  # where the call's JSON opens in the buffer
        self._call: _JsonScanner | None = None  # reads the JSON once it opens

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if not self._in_call:
                before, self._buf, self._in_call = _text_until(self._buf, self.START)
                out.append(Text(before))
                if not self._in_call:
                    return _merge(out)
                self._call = None
            end = self._value_end()
            if end < 0:
                return _merge(out)
            raw, self._buf = self._buf[:end], self._buf[end:]
            self._in_call = False
            out += self._calls(raw[self._value_start:]) or [Text(self.START + raw)]

    def _value_end(self) -> int:
        """Where the call's JSON value ends in the buffer, or -1."""
        if self._call is None:
            head = _MISTRAL_HEAD.match(self._buf)
            if head is None:
                return -1
            self._name, self._value_start = head.group(1), head.end()
            self._call = _JsonScanner(self._value_start)
        return self._call.value_end(self._buf)

    def _calls(self, value: str) -> list[ToolCall] | None:
        if self._name is None:
            return _parse_json_sequence(value)
        try:
            args = json.loads(value)
        except json.JSONDecodeError:
            return None
        call = _call_from_obj({"name": self._name, "arguments": args})
        return [call] if call else None

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if not self._in_call:
            return [Text(buf)] if buf else []
        self._in_call = False
        self.unfinished_call = True
        return [Text(self.START + buf)]


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
