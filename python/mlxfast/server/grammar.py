"""Structured output: compile ``response_format`` and forced tool calls into
llguidance grammars. A compiled grammar becomes ``SamplingParams.grammar``, a
factory returning a fresh ``LLMatcher`` for the engine to mask logits with."""

from __future__ import annotations

import json
import threading
from typing import Any, Callable

from .errors import bad_request

# Compact JSON: a small model given free whitespace may print newlines forever.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    def __init__(self, tokenizer, n_vocab: int):
        self._tokenizer = tokenizer
        self._n_vocab = n_vocab
        self._lltok = None
        self._lock = threading.Lock()

    @property
    def lltok(self):
        with self._lock:
            if self._lltok is None:
                import llguidance

                self._lltok = llguidance.LLTokenizer(
                    self._tokenizer.hf_json(), n_vocab=self._n_vocab, eos_token=self._eos_ids(),
                )
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

    def _factory(self, grammar: str) -> Callable[[], Any]:
        import llguidance

        lltok = self.lltok
        err = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if err and not err.startswith("WARNING"):
            raise bad_request(f"could not compile the grammar: {err}", param="response_format")

        def make():
            return llguidance.LLMatcher(lltok, grammar, log_level=0)

        return make

    def json_schema(self, schema: dict | None) -> Callable[[], Any]:
        """Any JSON object (``schema`` None) or one that validates against ``schema``."""
        import llguidance

        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be an object", "response_format")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise bad_request(f"invalid JSON schema: {e}", "response_format") from None
        return self._factory(grammar)

    def _marker(self, text: str) -> str:
        """A Lark literal for ``text``; a single special token is written as its id."""
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self.lltok.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def tool_calls(self, family: str, tools: list[dict], name: str | None) -> Callable[[], Any]:
        """Force the model to call a tool (``name``, or any of ``tools``), in
        the markup ``family`` that its tool-call parser reads."""
        import llguidance

        chosen = [t for t in tools if name is None or t["name"] == name]
        arg_key = "parameters" if family == "llama3" else "arguments"
        variants = []
        for t in chosen:
            params = t.get("parameters") or {"type": "object"}
            variants.append({
                "type": "object",
                "properties": {"name": {"const": t["name"]}, arg_key: params},
                "required": ["name", arg_key],
                "additionalProperties": False,
            })
        schema: dict = variants[0] if len(variants) == 1 else {"anyOf": variants}
        # Options go into the schema's x-guidance (lark's %json takes no defaults).
        schema_opts = dict(schema, **{"x-guidance": _JSON_OPTIONS})
        body = json.dumps(schema_opts)
        if family == "mistral":
            lark = f'start: {self._marker("[TOOL_CALLS]")} "[" call "]"\ncall: %json {body}\n'
        elif family == "llama3":
            lark = f"start: call\ncall: %json {body}\n"
        else:
            lark = (
                f'start: {self._marker("<tool_call>")} "\\n" call "\\n" {self._marker("</tool_call>")}\n'
                f"call: %json {body}\n"
            )
        return self._factory(llguidance.LLMatcher.grammar_from_lark(lark))
