"""Chat templates rendered the way Hugging Face transformers renders them.

Templates come from model files and are untrusted, so they run in jinja2's
immutable sandbox, and a render is bounded: it may run for RENDER_SECONDS and
build strings and lists of MAX_CHARS (the prompt included), and the numbers
it gives filters and methods (widths, counts) are at most MAX_INT_ARG; past
any of these it fails as a template error. Time is checked wherever a
template can spend it: each loop's iterations (every ``for`` iterates
through ``_bounded_iter``), calls, attribute and item lookups, operators and
output. The environment matches transformers': ``trim_blocks`` and
``lstrip_blocks``, the loop-controls extension, a no-op ``{% generation %}``
block, ``raise_exception``, ``strftime_now`` and a ``tojson`` that keeps
non-ASCII text and accepts ``indent``/``separators``/``sort_keys``.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import time
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may arrive under; templates read the first, and
# gpt-oss templates read "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes (no sandbox escapes)."""

    def __init__(*args, **kwargs):  # noqa: N805 - mirrors jinja2's Namespace signature
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not set underscore attributes on a namespace ({name!r})"
            )


RENDER_SECONDS = 10.0
MAX_CHARS = 16 << 20  # characters (or items) of the prompt, and of any string or list a template builds
MAX_INT_ARG = 1 << 20  # a width, count or repeat a template gives a filter, method or format
_deadline: ContextVar[float | None] = ContextVar("chat_template_deadline", default=None)
_FORMAT_SPEC = re.compile(r"%[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


class _Bound(jinja2.exceptions.SecurityError):
    pass


class TemplateBoundsError(ValueError):
    """A render that ran past its bounds (not worth a second try)."""


def _limit(what: str):
    return _Bound(f"chat template exceeds its bounds: {what}")


def _check_time() -> None:
    deadline = _deadline.get()
    if deadline is not None and time.monotonic() > deadline:
        raise _limit(f"it ran longer than {RENDER_SECONDS:g} s")


def _check_ints(values) -> None:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT_ARG:
            raise _limit(f"a width or count of {v} (at most {MAX_INT_ARG})")


def _size(x) -> int:
    return len(x) if isinstance(x, (str, list, tuple)) else 0


def _bounded_iter(seq):
    """What a ``for`` loop iterates: ``seq``, its time checked every 256 items."""
    if _deadline.get() is None or isinstance(seq, jinja2.Undefined):
        return seq

    def items():
        for i, x in enumerate(seq):
            if not i & 255:
                _check_time()
            yield x
    return items()


def _bounded_filter(f):
    """``f``, its arguments after the filtered value checked (the value is
    data: a schema's large ``maximum`` may be printed)."""
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1  # a context first, then the value

    @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marks
    def g(*args, **kwargs):
        _check_time()
        _check_ints(itertools.chain(args[skip:], kwargs.values()))
        return f(*args, **kwargs)
    return g


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, bounded in time and size (see the module's doc)."""

    # Not folded at compile time either: a constant 2 ** 10 ** 9 would stall the compile.
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, operator, left, right):
        _check_time()
        if operator == "**":
            if isinstance(right, (int, float)) and abs(right) > 64:
                raise _limit(f"a power of {right}")
        elif operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_CHARS:
                    raise _limit(f"a repeat to {len(seq) * n} items")
            if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > 4096:
                raise _limit("a product of more than 4096 bits")
        elif operator == "+":
            if _size(left) + _size(right) > MAX_CHARS:
                raise _limit(f"a concatenation of {_size(left) + _size(right)} items")
        elif operator == "%" and isinstance(left, str):
            specs = _FORMAT_SPEC.findall(left)
            if any(w.isdigit() and int(w) > MAX_INT_ARG for spec in specs for w in spec):
                raise _limit("a format width or precision over the bound")
            if any("*" in spec for spec in specs):  # widths taken from the values
                _check_ints(right if isinstance(right, tuple) else (right,))
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
        _check_time()
        _check_ints(itertools.chain(args, kwargs.values()))
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        """``str.format`` (its arguments are checked as a call's): no width
        or precision of seven digits in the format string."""
        fmt = super().wrap_str_format(value)
        if fmt is not None and re.search(r"\d{7,}", value.__self__):
            raise _limit("a format width or precision over the bound")
        return fmt

    def getattr(self, obj, attribute):
        _check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _check_time()
        return super().getitem(obj, argument)

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for node in tree.find_all(jinja2.nodes.For):
            node.iter = jinja2.nodes.Filter(node.iter, "_bounded_iter", [], [], None, None, lineno=node.lineno)
        return tree


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes HTML characters, which would change prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template; a syntax error raises ``ValueError``."""
    if not isinstance(source, str) or not source:
        raise ValueError("chat template must be a non-empty string")
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.filters = {k: _bounded_filter(f) for k, f in env.filters.items()}
    env.filters["_bounded_iter"] = _bounded_iter
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template syntax error (line {e.lineno}): {e.message}") from e


def looks_like_template(text: str) -> bool:
    """Whether ``text`` reads as Jinja template text rather than a path."""
    return "{{" in text or "{%" in text


def load_chat_template(value: str) -> str:
    """The chat template a ``--chat-template`` value names, compiled once to
    check it: vLLM's convention, a path to a Jinja file, or, when no such
    file exists and the value looks like a template (``{{`` or ``{%``), the
    template text itself. Any problem (no such file, unreadable, not UTF-8,
    empty, a Jinja syntax error) raises ``ValueError`` saying what is wrong
    with which path."""
    if not isinstance(value, str) or not value:
        raise ValueError("expected a chat template file or the template text, got an empty value")
    path = Path(value).expanduser()
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except (OSError, ValueError):  # a name too long for a path, a NUL byte
        is_file = is_dir = False
    if is_file:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read {value}: {e.strerror or e}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{value} is not UTF-8 text (byte {e.start})") from None
        if not text.strip():
            raise ValueError(f"{value} is empty")
        where = value
    elif looks_like_template(value):
        text, where = value, "the template text given"
    elif is_dir:
        raise ValueError(f"{value} is a directory, not a chat template file")
    else:
        raise ValueError(f"no such file: {value} (and it is not template text: "
                         "that would contain '{{' or '{%')")
    try:
        compile_template(text)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return text


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of message dicts")
    out = []
    for i, m in enumerate(messages):
        if hasattr(m, "model_dump"):
            m = m.model_dump()
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i} must be a dict, got {type(m).__name__}")
        if "role" not in m:
            raise ValueError(f"message {i} has no 'role'")
        # Keys set to None (OpenAI's content=None, tool_calls=None) are dropped:
        # templates test for presence and would otherwise print "None".
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    /,
    *,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    **template_kwargs: Any,
) -> str:
    """Render ``messages`` with ``template``.

    ``template_kwargs`` become template variables (``bos_token``,
    ``eos_token``, ``enable_thinking``, ``documents``, ...). Any error raised by
    the template, including ``raise_exception(...)``, surfaces as ``ValueError``.
    """
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)
    ):
        raise ValueError("tools must be a list of JSON-schema dicts")
    compiled = compile_template(template)
    token = _deadline.set(time.monotonic() + RENDER_SECONDS)
    try:
        out, n = [], 0
        # one dict, not keywords: any variable name is allowed (jinja's own is `self`)
        variables = {**template_kwargs, "messages": _normalize_messages(messages), "tools": tools,
                     "add_generation_prompt": add_generation_prompt}
        for piece in compiled.generate(variables):
            n += len(piece)
            if n > MAX_CHARS:
                raise _limit(f"a prompt of more than {MAX_CHARS} characters")
            _check_time()
            out.append(piece)
        return "".join(out)
    except _Bound as e:
        raise TemplateBoundsError(str(e)) from None
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template error: {e.message or e}") from e
    except (TypeError, KeyError, AttributeError, IndexError, ValueError, OverflowError,
            RecursionError, MemoryError) as e:
        raise ValueError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e
    finally:
        _deadline.reset(token)
