"""Structured output: compile ``response_format`` and forced tool calls into
llguidance grammars. A compiled grammar becomes ``SamplingParams.grammar``, a
factory returning a fresh ``LLMatcher`` for the engine to mask logits with."""

from __future__ import annotations

import json
import threading
from typing import Any, Callable

from .common import loads_field
from .errors import bad_request

# Compact JSON: a small model given free whitespace may print newlines forever.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUB_SCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUB_SCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any, every: bool = False) -> Any:
    """``schema`` with ``additionalProperties: false`` wherever an object
    schema lists its ``properties`` and says nothing of others (with
    ``every``, on every ``type: object`` schema too): the keys the schema
    names and no others, as llama.cpp's grammars and vLLM's default backend
    (xgrammar) read such schemas, and as OpenAI's strict mode requires.
    JSON Schema itself allows any other key, and llguidance follows it: a
    small model then keeps writing keys of its own until max_tokens.
    Where keys come from more than one schema, nothing is closed: a schema
    whose ``allOf`` / ``anyOf`` / ``oneOf`` members name properties, those
    members when it names its own too, and every ``allOf`` member (closing
    one would refuse the keys the others name)."""
    def names_keys(x):
        return isinstance(x, dict) and isinstance(x.get("properties"), dict)

    def walk(node, keep_open=False):
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        composed = [x for k in ("allOf", "anyOf", "oneOf") if isinstance(node.get(k), list) for x in node[k]]
        out = {}
        for k, v in node.items():
            if k in _SCHEMA_MAPS and isinstance(v, dict):
                out[k] = {name: walk(sub) for name, sub in v.items()}
            elif k in _SUB_SCHEMAS and isinstance(v, list):
                shared = k == "allOf" or (k in ("anyOf", "oneOf") and names_keys(node))
                out[k] = [walk(x, keep_open=shared) for x in v]
            elif k in _SUB_SCHEMA:
                out[k] = walk(v)
            else:
                out[k] = v
        objectish = names_keys(out) or (every and out.get("type") == "object")
        open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
        if objectish and not keep_open and not any(k in out for k in open_keys) \
                and not any(names_keys(x) for x in composed):
            out["additionalProperties"] = False
        return out

    return walk(schema)


class GrammarCompiler:
    def __init__(self, tokenizer, n_vocab: int):
        self._tokenizer = tokenizer
        self._n_vocab = n_vocab
        self._lltok = None
        self._lock = threading.Lock()

    def lltok(self, param: str = "response_format"):
        """llguidance's view of the tokenizer, made once; a tokenizer it
        cannot read (e.g. a tokenizer.json without a decoder) makes every
        grammar a 400 naming why, not an internal error."""
        with self._lock:
            if self._lltok is None:
                import llguidance

                try:
                    self._lltok = llguidance.LLTokenizer(
                        self._tokenizer.hf_json(), n_vocab=self._n_vocab, eos_token=self._eos_ids(),
                    )
                except Exception as e:  # llguidance raises plain ValueErrors and RuntimeErrors
                    self._lltok = e
            if isinstance(self._lltok, Exception):
                raise bad_request(f"{param} cannot be enforced: the grammar engine cannot read this model's "
                                  f"tokenizer ({_one_line(str(self._lltok))})", param=param)
            return self._lltok

    def _eos_ids(self) -> list[int]:
        """End tokens, the chat turn end first (the token a chat model ends
        its answer with is not always the tokenizer's EOS)."""
        ids = sorted(self._tokenizer.eos_token_ids)
        template = getattr(self._tokenizer, "chat_template", None) or ""

        def key(i):
            try:
                text = self._tokenizer.id_to_token(i)
            except ValueError:
                text = ""
            return (0 if text and text in template else 1, i)

        return sorted(ids, key=key)

    def _factory(self, grammar: str, param: str) -> Callable[[], Any]:
        """A matcher factory for ``grammar``, compiled and probed now (see
        ``_probe``): a grammar that cannot be enforced is a 400 on arrival,
        not an error mid-stream."""
        import llguidance

        lltok = self.lltok(param)
        err = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if err and not err.startswith("WARNING"):
            raise bad_request(f"{param} cannot be enforced: {_one_line(err)}", param=param)
        probe = llguidance.LLMatcher(lltok, grammar, log_level=0)
        _probe(probe, param)
        unused = [probe]  # the probed matcher serves the first request

        def make():
            if unused:
                return unused.pop()
            return llguidance.LLMatcher(lltok, grammar, log_level=0)

        return make

    def json_schema(self, schema: dict | None, param: str = "response_format", *,
                    extra_keys: bool | None = None) -> Callable[[], Any]:
        """Any JSON object (``schema`` None) or one that validates against
        ``schema``, its objects closed to keys it does not name
        (``closed_objects``; ``extra_keys``: vLLM's
        ``disable_additional_properties`` negated: True leaves them open,
        False closes every object)."""
        import llguidance

        if schema is None:
            schema = {"type": "object"}
        elif not isinstance(schema, dict):
            raise bad_request(f"{param} must be an object", param)
        elif extra_keys is not True:
            schema = closed_objects(schema, every=extra_keys is False)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except (ValueError, TypeError, RecursionError) as e:
            raise bad_request(f"{param} is not a JSON schema mlxfast can enforce: {_one_line(str(e))}",
                              param) from None
        return self._factory(grammar, param)

    def guided(self, kind: str, value: Any, param: str, extra_keys: bool | None = None) -> Callable[[], Any]:
        """vLLM's structured output (``guided_spec``): a JSON schema, a
        regular expression the whole output matches, one of the choices, or
        a grammar (GBNF, as llama.cpp and vLLM's xgrammar take it, or Lark)."""
        import llguidance

        if kind == "json":
            return self.json_schema(value, param, extra_keys=extra_keys)
        if kind == "regex":
            if not isinstance(value, str) or not value:
                raise bad_request(f"{param} must be a non-empty string", param)
            try:
                grammar = llguidance.LLMatcher.grammar_from_regex(value)
            except (ValueError, TypeError) as e:
                raise bad_request(f"{param} is not a regular expression mlxfast can enforce: "
                                  f"{_one_line(str(e))}", param) from None
            return self._factory(grammar, param)
        if kind == "grammar":
            lark = _grammar_as_lark(value, param)
        else:
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise bad_request(f"{param} must be a list of non-empty strings", param)
            # one terminal (a lexer alternation): thousands of choices as rules hit llguidance's limits
            lark = "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value) + "\n"
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError) as e:
            raise bad_request(f"{param} cannot be enforced: {_one_line(str(e))}", param) from None
        return self._factory(grammar, param)

    def _marker(self, text: str, param: str) -> str:
        """A Lark literal for ``text``; a single special token is written as its id."""
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self.lltok(param).is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def tool_calls(self, family: str, tools: list[dict], name: str | None, param: str = "tools", *,
                   answer: dict | None = None, answer_param: str = "response_format") -> Callable[[], Any]:
        """Force the model to call a tool (``name``, or any of ``tools``), in
        the markup ``family`` that its tool-call parser reads; with ``answer``
        (a JSON schema), the model may give a JSON answer that follows it
        instead of the call."""
        import llguidance

        chosen = [t for t in tools if name is None or t["name"] == name]
        arg_key = "parameters" if family == "llama3" else "arguments"
        variants, defs = [], {}
        for i, t in enumerate(chosen):
            # no parameters: none (OpenAI's "an empty parameter list")
            params = t.get("parameters") or {"type": "object", "properties": {}}
            if not isinstance(params, dict):
                raise bad_request(f"{param}: the parameters of tool '{t['name']}' must be a JSON schema object",
                                  param)
            for section in ("$defs", "definitions"):
                if section in params and not isinstance(params[section], dict):
                    raise bad_request(f"{param}: the parameters of tool '{t['name']}' are not a JSON schema "
                                      f"mlxfast can enforce: {section} must be an object of schemas", param)
            defs.update(_hoisted_defs(closed_objects(params), f"tool{i}"))
            variants.append({
                "type": "object",
                "properties": {"name": {"const": t["name"]}, arg_key: {"$ref": f"#/$defs/tool{i}"}},
                "required": ["name", arg_key],
                "additionalProperties": False,
            })
        schema: dict = variants[0] if len(variants) == 1 else {"anyOf": variants}
        schema = dict(schema, **{"$defs": defs})
        # Options go into the schema's x-guidance (lark's %json takes no defaults).
        schema_opts = dict(schema, **{"x-guidance": _JSON_OPTIONS})
        body = json.dumps(schema_opts)
        if family == "mistral":
            lark = f'start: {self._marker("[TOOL_CALLS]", param)} "[" call "]"\ncall: %json {body}\n'
        elif family == "llama3":
            lark = f"start: call\ncall: %json {body}\n"
        else:
            lark = (
                f'start: {self._marker("<tool_call>", param)} "\\n" call "\\n" {self._marker("</tool_call>", param)}\n'
                f"call: %json {body}\n"
            )
        if answer is not None:
            if not isinstance(answer, dict):
                raise bad_request(f"{answer_param} must be an object", answer_param)
            lark = lark.replace("start:", "calls:", 1)
            answer = dict(closed_objects(answer), **{'x-guidance': _JSON_OPTIONS})
            lark = f"start: calls | answer\nanswer: %json {json.dumps(answer)}\n" + lark
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError, RecursionError) as e:
            raise bad_request(f"{param}: a tool's parameters (or {answer_param}) are not a JSON schema mlxfast "
                              f"can enforce: {_one_line(str(e))}", param) from None
        return self._factory(grammar, param)


_GUIDED_KINDS = ("json", "regex", "choice", "grammar")
# Options of vLLM's structured_outputs that only tune its own backends.
_GUIDED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "whitespace_pattern")


def guided_spec(body) -> tuple[str, Any, str, bool | None] | None:
    """vLLM's structured-output request, ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` / ``guided_grammar`` or ``structured_outputs`` {json,
    regex, choice, grammar, json_object}, or llama.cpp's ``json_schema`` / ``grammar``, as (kind,
    value, the field to name in errors, whether a JSON schema's objects take
    keys it does not name: ``structured_outputs.disable_additional_properties``
    negated, None when not given); None when absent. More than one, or a
    kind mlxfast does not know, is a 400."""
    given = [(k, getattr(body, f"guided_{k}", None), f"guided_{k}") for k in _GUIDED_KINDS]
    given += [("json", getattr(body, "json_schema", None), "json_schema"),  # llama.cpp's
              ("grammar", getattr(body, "grammar", None), "grammar")]
    given = [g for g in given if g[1] is not None]
    so = getattr(body, "structured_outputs", None)
    extra_keys = None
    for key, value in (so or {}).items():
        param = f"structured_outputs.{key}"
        if value is None or key in _GUIDED_OPTIONS:
            continue
        if key == "disable_additional_properties":
            if not isinstance(value, bool):
                raise bad_request(f"{param} must be a boolean", param)
            extra_keys = not value
            continue
        if key in _GUIDED_KINDS:
            given.append((key, value, param))
        elif key == "json_object":
            if value is not True:
                raise bad_request(f"{param} must be true", param)
            given.append(("json", None, param))
        else:
            raise bad_request(f"{param} is not a structured output mlxfast supports "
                              "(json, regex, choice, grammar, json_object)", param)
    if not given:
        return None
    if len(given) > 1:
        raise bad_request("give one structured output: " + ", ".join(g[2] for g in given), given[1][2])
    kind, value, param = given[0]
    if kind == "json" and isinstance(value, str):
        value = loads_field(value, param, param)
    return kind, value, param, extra_keys


def _grammar_as_lark(text: Any, param: str) -> str:
    """A grammar as llguidance's Lark: GBNF converted (llama.cpp's format,
    and vLLM's xgrammar EBNF), else taken as Lark (vLLM's guidance backend)."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if not isinstance(text, str) or not text.strip():
        raise bad_request(f"{param} must be a non-empty grammar", param)
    try:
        return gbnf_to_lark(text)
    except Exception:  # noqa: BLE001  (the converter raises plain Exceptions too): not GBNF; Lark decides
        return text


def _hoisted_defs(params: dict, key: str) -> dict:
    """A tool's parameter schema as definitions of the call schema that wraps
    it: itself as ``key``, its ``$defs`` / ``definitions`` as ``key__<name>``,
    with every local ``$ref`` (``#``, ``#/$defs/x``, ``#/definitions/x``)
    rewritten to match, since in the wrapper ``#`` is the wrapper."""
    def rewrite(v):
        if isinstance(v, dict):
            out = {k: rewrite(x) for k, x in v.items() if k not in ("$defs", "definitions") or v is not params}
            ref = v.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                parts = ref[2:].split("/", 2) if ref != "#" else []
                if not parts or parts == [""]:
                    out["$ref"] = f"#/$defs/{key}"
                elif parts[0] in ("$defs", "definitions") and len(parts) >= 2:
                    out["$ref"] = f"#/$defs/{key}__{parts[1]}" + ("/" + parts[2] if len(parts) > 2 else "")
                else:
                    out["$ref"] = f"#/$defs/{key}/" + ref[2:]
            return out
        if isinstance(v, list):
            return [rewrite(x) for x in v]
        return v

    defs = {key: rewrite(params)}
    for section in ("$defs", "definitions"):
        for name, sub in (params.get(section) or {}).items():
            defs[f"{key}__{name}"] = rewrite(sub)
    return defs


def _one_line(message: str) -> str:
    """A compiler's message on one line: its lines joined, without the
    caret lines that point into a quoted pattern (a regex error's detail
    comes after them)."""
    message = message.split("<backtrace>")[0].split("stack backtrace:")[0]  # a compiler panic's trace
    lines = [ln.strip() for ln in message.strip().splitlines()]
    return " ".join(ln for ln in lines if ln.strip("^~ "))[:300] or "unknown error"


# How far the probe walks a copy of a new matcher: the forced prefix (up to
# this many tokens), then this many steps along the lowest allowed token.
# Self-referencing schemas fail on the forced prefix; regexes beyond the
# lexer's limits fail when their lexeme starts, a few tokens in.
PROBE_TOKENS = 64


def _probe(matcher, param: str) -> None:
    """A 400 unless a copy of ``matcher`` computes its masks along a short
    walk without error (``matcher`` itself stays at its start state)."""
    import numpy as np

    def check(m):
        if m.is_error():
            raise bad_request(f"{param} cannot be enforced: {_one_line(m.get_error())} "
                              "(a schema that refers to itself with no way to end, or one past "
                              "the grammar engine's limits)", param=param)

    check(matcher)
    walk = matcher.deep_copy()
    forced = walk.compute_ff_tokens()[:PROBE_TOKENS]
    check(walk)
    if forced:
        walk.consume_tokens(forced)
    for _ in range(PROBE_TOKENS):
        mask = walk.compute_bitmask()
        check(walk)
        if walk.is_stopped():
            return
        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little"))
        if allowed.size == 0:
            return
        walk.consume_token(int(allowed[0]))
        check(walk)
