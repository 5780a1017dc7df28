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
held back until it can no longer be one. A call streams too: once its name and
the opening of its arguments have been read it starts (``ToolCallStart``), and
its arguments follow as ``ToolCallArgs`` pieces of the JSON text the model
writes, then ``ToolCallEnd``; ``assemble`` joins them into ``ToolCall``s.
Inside a call, JSON is scanned (strings, escapes, nesting), so markup written
inside an argument string does not end the call. Arguments are the model's own
text: a call that started is a call, even if the output ends inside its
arguments (then ``finish()`` ends it and sets ``parser.unfinished_call``).
Output that ends inside call markup before the call could be recognised
(``<tool_call>{"na``, cut off by max_tokens) gives neither a call nor text:
markup never reaches the content (``unfinished_call`` is set). A start marker
that what follows shows to open no call (``<tool_call> tag``: not JSON, or
JSON that is not a call) is text, given out as soon as that shows, and what
follows it is read as text again.
A call in any other shape (``arguments`` before ``name``, arguments as a JSON
string, OpenAI's ``{"function": ...}``) is read whole and comes out at its
end; one that does not parse as a call is given back as its raw text.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Union

from .markers import held_suffix


@dataclass
class Text:
    text: str


@dataclass
class ToolCallStart:
    index: int  # 0, 1, ... over the output's calls
    name: str


@dataclass
class ToolCallArgs:
    index: int
    text: str  # the next piece of the arguments' JSON text


@dataclass
class ToolCallEnd:
    index: int


@dataclass
class ToolCall:
    """A whole call, as ``assemble`` builds it from the streamed events."""

    name: str
    arguments: str  # a JSON object, as a string


Event = Union[Text, ToolCallStart, ToolCallArgs, ToolCallEnd]

_SEPARATORS = " \t\r\n;,"
_WS = " \t\r\n"
# A call's head ({"name": "...", "arguments": ) is short; past this many
# characters without one, the object is read whole instead (linear time).
_HEAD_LIMIT = 4096


class _JsonScanner:
    """Reads JSON text as it grows in a caller's buffer, tracking strings
    (with escapes) and brace/bracket nesting, to tell where a value ends."""

    def __init__(self, start: int = 0, depth: int = 0):
        self.pos = start  # how far into the caller's buffer it has read
        self.depth = depth
        self.in_string = False
        self.escaped = False

    def _step(self, c: str) -> bool:
        """Take one character; True when it closes a top-level value."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                return self.depth == 0
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]" and self.depth:
            self.depth -= 1
            return self.depth == 0
        return False

    def value_end(self, buf: str, stop_marker: str | None = None) -> int:
        """Read on through ``buf``: the index just past the top-level value
        that closes, or -1 if it is still open. With ``stop_marker``, the
        value also ends where that marker stands outside strings at depth 1
        (the object it closes left unclosed): then the marker's index."""
        while self.pos < len(buf):
            c = buf[self.pos]
            if stop_marker and c == stop_marker[0] and self.depth == 1 and not self.in_string:
                if buf.startswith(stop_marker, self.pos):
                    return self.pos
                if stop_marker.startswith(buf[self.pos:]):
                    return -1
            self.pos += 1
            if self._step(c):
                return self.pos
        return -1


def _text_until(buf: str, marker: str) -> tuple[str, str, bool]:
    """Split ``buf`` at its first ``marker``: (text before, text after, True);
    without one: (text that can go out now, tail that may become the marker, False)."""
    i = buf.find(marker)
    if i >= 0:
        return buf[:i], buf[i + len(marker):], True
    keep = len(buf) - held_suffix(buf, (marker,))
    return buf[:keep], buf[keep:], False


def _skip(buf: str, i: int, chars: str) -> int:
    while i < len(buf) and buf[i] in chars:
        i += 1
    return i


def _read_string(buf: str, i: int):
    """The JSON string opening at ``buf[i]``: (its value, the index past it),
    None while unterminated, False if it is not a valid string."""
    j = i + 1
    while j < len(buf):
        c = buf[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            try:
                return json.loads(buf[i:j + 1]), j + 1
            except json.JSONDecodeError:
                return False
        j += 1
    return None


def _read_head(buf: str, start: int, arg_keys):
    """The head of a call object opening at ``buf[start]``:
    ``{"name": "<name>", "<arg key>": `` then ``{`` or ``"``. Returns
    (name, index of the arguments' value, its first character), None while
    the buffer may still grow into one, False when it is another shape."""
    i, name = start + 1, None
    for want in ("name key", ":", "name", ",", "args key", ":", "value"):
        i = _skip(buf, i, _WS)
        if i >= len(buf):
            return None if len(buf) - start <= _HEAD_LIMIT else False
        c = buf[i]
        if want in (":", ","):
            if c != want:
                return False
            i += 1
            continue
        if want == "value":
            return (name, i, c) if c in '{"' else False
        if c != '"':
            return False
        read = _read_string(buf, i)
        if read is None:
            return None if len(buf) - start <= _HEAD_LIMIT else False
        if read is False:
            return False
        value, i = read
        if want == "name key" and value != "name":
            return False
        if want == "args key" and value not in arg_keys:
            return False
        if want == "name":
            if not isinstance(value, str) or not value:
                return False
            name = value
    return False  # not reached


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
            parsed = model_json(args)
        except ValueError:
            return None
        args = parsed
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


class _CallObject:
    """One call object read from ``start`` (its ``{``) as the caller's buffer
    grows: ``read(buf)`` returns the events it made final; ``end`` is set
    (the index past the object) once it is read, with ``valid`` False when it
    was not a call. With ``name``, the object is the arguments alone
    (Mistral's ``name[ARGS]{...}``). ``end_marker`` (Hermes'
    ``</tool_call>``) may stand in for a brace the model left off after the
    arguments."""

    def __init__(self, start: int, index: int, arg_keys=("arguments", "parameters"),
                 name: str | None = None, end_marker: str | None = None):
        self.start, self.index, self.arg_keys, self.end_marker = start, index, arg_keys, end_marker
        self.end = -1
        self.valid = True
        self.started = False
        self.unfinished = False
        self._name = name
        self._scan: _JsonScanner | None = None
        self._sent = start  # how much of the arguments has gone out
        self._state = "head"
        if name is not None:
            self._open_args(start, alone=True)

    def _open_args(self, at: int, alone: bool = False) -> None:
        self._state = "args_alone" if alone else "args"
        self._scan = _JsonScanner(at)
        self._sent = at

    def read(self, buf: str) -> list[Event]:
        out: list[Event] = []
        if self._state == "head":
            head = _read_head(buf, self.start, self.arg_keys)
            if head is None:
                return out
            if head is False or head[2] == '"':  # another shape, or arguments as a string: read whole
                self._state, self._scan = "whole", _JsonScanner(self.start)
            else:
                self._name = head[0]
                self._open_args(head[1])
        if self._state == "whole":
            end = self._scan.value_end(buf)
            if end >= 0:
                self.end = end
                out += self._whole(buf[self.start:end])
            return out
        if self._state in ("args", "args_alone"):
            if not self.started:
                self.started = True
                out.append(ToolCallStart(self.index, self._name))
            end = self._scan.value_end(buf)
            upto = end if end >= 0 else self._scan.pos
            if upto > self._sent:
                out.append(ToolCallArgs(self.index, buf[self._sent:upto]))
                self._sent = upto
            if end < 0:
                return out
            if self._state == "args_alone":
                self.end = end
                out.append(ToolCallEnd(self.index))
                return out
            self._state, self._scan = "tail", _JsonScanner(end, depth=1)
        if self._state == "tail":  # what follows the arguments, to the object's closing brace
            end = self._scan.value_end(buf, self.end_marker)
            if end >= 0:
                self.end = end
                out.append(ToolCallEnd(self.index))
        return out

    def _whole(self, raw: str) -> list[Event]:
        try:
            call = _call_from_obj(model_json(raw), self.arg_keys)
        except ValueError:
            call = None
        if call is None:
            self.valid = False
            return []
        self.started = True
        return [ToolCallStart(self.index, call.name), ToolCallArgs(self.index, call.arguments),
                ToolCallEnd(self.index)]

    def finish(self) -> list[Event]:
        """The output ended inside the object: a started call ends here
        (``unfinished`` when its arguments were still open)."""
        if not self.started or self.end >= 0:
            return []
        self.unfinished = self._state != "tail"
        return [ToolCallEnd(self.index)]


def _merge(events: Iterable) -> list:
    """Join adjacent Text events (and adjacent pieces of one call's
    arguments); drop empty ones."""
    out: list = []
    for e in events:
        if isinstance(e, Text):
            if not e.text:
                continue
            if out and isinstance(out[-1], Text):
                out[-1] = Text(out[-1].text + e.text)
                continue
        elif isinstance(e, ToolCallArgs):
            if not e.text:
                continue
            if out and isinstance(out[-1], ToolCallArgs) and out[-1].index == e.index:
                out[-1] = ToolCallArgs(e.index, out[-1].text + e.text)
                continue
        out.append(e)
    return out


def assemble(events: Iterable[Event]) -> list:
    """Streamed events -> Text and whole ToolCalls, in order."""
    out: list = []
    calls: dict[int, ToolCall] = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            calls[e.index] = ToolCall(e.name, "")
            out.append(calls[e.index])
        elif isinstance(e, ToolCallArgs):
            calls[e.index].arguments += e.text
        elif not isinstance(e, ToolCallEnd):
            out.append(e)
    return _merge(out)


class ToolCallParser:
    """Base class: a parser that finds no calls (all text)."""

    family = "none"
    # Set by finish() when the output ended inside a call: one whose
    # arguments were still open (it is ended), or one not yet recognisable
    # as a call (dropped: its text is markup).
    unfinished_call = False

    def __init__(self):
        self._n_calls = 0  # the next call's index

    def feed(self, text: str) -> list[Event]:
        return [Text(text)] if text else []

    def finish(self) -> list[Event]:
        return []

    def parse(self, text: str) -> list:
        """Text and whole ToolCalls of a complete output (non-streaming)."""
        return assemble(self.feed(text) + self.finish())

    def _read_call(self, call: _CallObject, buf: str, out: list) -> bool:
        """Read ``call`` on; True once it is over (counted if it was a call)."""
        out += call.read(buf)
        if call.end < 0:
            return False
        if call.valid:
            self._n_calls += 1
        return True

    def _end_call(self, call: _CallObject, out: list) -> bool:
        """At the end of output: end a started call; True if it had started."""
        if not call.started:
            return False
        out += call.finish()
        self._n_calls += 1
        self.unfinished_call = call.unfinished
        return True


class _RegionParser(ToolCallParser):
    """A parser whose calls stand in a region opened by ``START``: text
    streams until it, then the subclass's ``_read_region`` reads the region
    (True once it has ended, the buffer then holding what follows)."""

    START = ""

    def __init__(self):
        super().__init__()
        self._buf = ""  # text not given out yet; in a region, what follows START
        self._region = False
        self._calls_in_region = 0
        self._call: _CallObject | None = None

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if not self._region:
                before, self._buf, self._region = _text_until(self._buf, self.START)
                out.append(Text(before))
                if not self._region:
                    return _merge(out)
                self._calls_in_region = 0
                self._open_region()
            if not self._read_region(out):
                return _merge(out)

    def _open_region(self) -> None:
        raise NotImplementedError

    def _read_region(self, out: list) -> bool:
        raise NotImplementedError

    def _close_region(self, end: int) -> bool:
        self._buf = self._buf[end:]
        self._region = False
        return True

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if not self._region:
            return [Text(buf)] if buf else []
        self._region = False
        call, self._call = self._call, None
        out: list[Event] = []
        if call is not None and self._end_call(call, out):
            return out
        if not self._calls_in_region:
            self.unfinished_call = True
        return []  # what is left is markup (a cut end marker, a call cut before its name)

    def _not_a_region(self, out: list) -> bool:
        """The open region holds no call and what follows the start marker
        shows it can hold none: the marker was text. It goes out as text,
        and what follows is read as text again (it may hold a real region)."""
        out.append(Text(self.START))
        return self._close_region(0)


class HermesParser(_RegionParser):
    """``<tool_call>`` JSON ``</tool_call>``: one or more call objects (or
    arrays of them) between the markers; the end marker counts only outside
    JSON strings and values."""

    family = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self):
        super().__init__()
        self._pos = 0  # how far into the region reading has got
        self._junk = False  # the region holds something that is not a call

    def _open_region(self) -> None:
        self._pos, self._junk = 0, False

    def _read_region(self, out: list) -> bool:
        """Read the region on; True when it has ended (the buffer then holds what follows)."""
        buf = self._buf
        while True:
            if self._call is not None:
                if not self._read_call(self._call, buf, out):
                    return False
                self._pos = self._call.end
                if self._call.valid:
                    self._calls_in_region += 1
                else:
                    self._junk = True
                self._call = None
            if self._junk and not self._calls_in_region:
                return self._not_a_region(out)
            if self._junk:  # after a call: the rest of the region, to its end marker, is dropped
                k = buf.find(self.END, self._pos)
                if k < 0:
                    self._pos = max(self._pos, len(buf) - len(self.END) + 1)
                    return False
                return self._close_region(k + len(self.END))
            i = self._pos = _skip(buf, self._pos, _SEPARATORS + "[]")
            if buf.startswith(self.END, i):
                return self._close_region(i + len(self.END))
            if i >= len(buf) or self.END.startswith(buf[i:]):
                return False
            if buf[i] == "{":
                self._call = _CallObject(i, self._n_calls, end_marker=self.END)
            else:
                self._junk = True


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
    ARG_KEYS = ("parameters", "arguments")

    def __init__(self):
        super().__init__()
        self._buf = ""  # text not given out yet; in a call, from its start
        self._mode = "start"  # start (undecided) -> call -> start ... | text
        self._call: _CallObject | None = None

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
            if not self._read_call(self._call, self._buf, out):
                return _merge(out)
            if self._call.valid:
                self._buf = self._buf[self._call.end:]
                self._mode = "start"
            else:  # not a call: the output is text from its start
                self._mode = "text"
            self._call = None

    def _decide(self) -> None:
        """Leave the start mode once the buffer shows a call or can no longer be one."""
        if self._n_calls:  # separators between calls are not content
            self._buf = self._buf.lstrip(_SEPARATORS)
        m = _LLAMA_START.match(self._buf)
        if m:
            self._mode = "call"
            self._call = _CallObject(m.start(1), self._n_calls, self.ARG_KEYS)
        elif not _could_start_llama_call(self._buf):
            self._mode = "text"

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        mode, self._mode = self._mode, "text"
        call, self._call = self._call, None
        out: list[Event] = []
        if mode == "call":
            if not self._end_call(call, out):
                self.unfinished_call = True
            return out
        return [Text(buf)] if buf else []


# After [TOOL_CALLS]: a JSON array/object, or a name (and [ARGS]) then an object.
_MISTRAL_HEAD = re.compile(r"\s*(?:([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?\s*(?=\{)|(?=[\[{]))")
# What a head cut off before its JSON looks like: a name, then part of [ARGS].
_MISTRAL_HEAD_PREFIX = re.compile(r"\s*(?:[A-Za-z0-9_.\-]+\s*(?:\[(?:A(?:R(?:G(?:S\]?)?)?)?)?\s*)?)?")


class MistralParser(_RegionParser):
    """``[TOOL_CALLS]`` then ``[{...}, ...]``, ``{...}`` or ``name[ARGS]{...}``;
    the region ends where its JSON value closes."""

    family = "mistral"
    START = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def __init__(self):
        super().__init__()
        self._form: str | None = None  # "array" | "one" once the head is read
        self._pos = 0
        self._junk: _JsonScanner | None = None  # reads a non-call value in an array to its end

    def _open_region(self) -> None:
        self._form, self._junk = None, None

    def _read_region(self, out: list) -> bool:
        buf = self._buf
        if self._form is None:
            head = _MISTRAL_HEAD.match(buf)
            if head is None:  # text, unless it may still grow into a head
                return False if _MISTRAL_HEAD_PREFIX.fullmatch(buf) else self._not_a_region(out)
            name, at = head.group(1), head.end()
            if name is not None or buf[at] == "{":
                self._form = "one"
                self._call = _CallObject(at, self._n_calls, name=name)
            else:
                self._form, self._pos = "array", at + 1
        while True:
            if self._call is not None:
                if not self._read_call(self._call, buf, out):
                    return False
                call, self._call = self._call, None
                if self._form == "one":
                    return self._close_region(call.end) if call.valid else self._not_a_region(out)
                self._pos = call.end
                if call.valid:
                    self._calls_in_region += 1
                elif not self._calls_in_region:
                    return self._not_a_region(out)
                else:
                    self._junk = _JsonScanner(call.end, depth=1)
            if self._junk is not None:  # after a call: the rest of the array is dropped
                end = self._junk.value_end(buf)
                if end < 0:
                    return False
                return self._close_region(end)
            i = self._pos = _skip(buf, self._pos, _WS + ",")
            if i >= len(buf):
                return False
            if buf[i] == "]":
                return self._close_region(i + 1)
            if buf[i] == "{":
                self._call = _CallObject(i, self._n_calls)
            elif not self._calls_in_region:
                return self._not_a_region(out)
            else:
                self._junk = _JsonScanner(i, depth=1)


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


def markup() -> tuple[str, ...]:
    """Every parser's markers: a tokenizer may hold them as special tokens,
    whose text must still reach the parsers when special tokens are skipped."""
    return (HermesParser.START, HermesParser.END, _LLAMA_TAG, MistralParser.START, MistralParser.ARGS)


def model_json(text: str) -> Any:
    """JSON the model wrote, as Python values. A number beyond a double
    (1e999) or NaN/Infinity becomes None, as JavaScript's JSON.stringify
    writes them: the API's JSON cannot carry them (a response holding one
    failed to serialise). ValueError when it is not JSON, or is nested
    deeper than the parser goes."""
    try:
        return finite(json.loads(text))
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def finite(value: Any) -> Any:
    """``value`` with every non-finite float in it replaced by None (in place
    where it is a container; iterative, for any depth)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    stack = [value]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in list(items):
            if isinstance(v, float) and not math.isfinite(v):
                node[k] = None
            elif isinstance(v, (dict, list)):
                stack.append(v)
    return value


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
