"""Chat messages -> prompt text -> token ids, for both APIs.

Messages arrive here already normalised to Hugging Face template form:
``{"role", "content": str, "tool_calls": [{"id", "type", "function": {"name",
"arguments": dict}}], "tool_call_id", "name"}``. A template that cannot
render tools gets mlxfast's Hermes-style tool prompt and past calls/results
written out as text, so tool use works with any chat model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..text import reasoning as reasoning_mod
from ..text import tool_calls as tc
from .errors import bad_request

# reasoning_effort -> template variables
REASONING_EFFORTS = {
    "none": {"enable_thinking": False},
    "minimal": {"enable_thinking": False},
    "low": {"enable_thinking": True},
    "medium": {"enable_thinking": True},
    "high": {"enable_thinking": True},
    "xhigh": {"enable_thinking": True},
}


@dataclass
class ChatPrompt:
    text: str
    ids: list[int]
    tool_family: str | None  # parser to run on the output (None: no tools)
    reasoning: bool  # split <think> from the answer
    in_reasoning: bool  # the prompt already opened a think block


# Template variables a request cannot set through chat_template_kwargs: the
# server sets them from the request's own fields (or they are the template's
# helper functions).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "add_generation_prompt", "continue_final_message",
    "raise_exception", "strftime_now", "namespace",
})


def template_kwargs_for(reasoning_effort: str | None, extra: dict | None,
                        effort_param: str = "reasoning_effort") -> dict:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(extra or {}))
    if reserved:
        raise bad_request(
            f"chat_template_kwargs.{reserved[0]} is set by the server from the request itself "
            f"(reserved: {', '.join(sorted(RESERVED_TEMPLATE_KWARGS))}); use the request field instead",
            param=f"chat_template_kwargs.{reserved[0]}")
    kwargs: dict = {}
    if reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORTS:
            raise bad_request(
                f"unknown {effort_param} {reasoning_effort!r}; expected one of "
                + ", ".join(REASONING_EFFORTS),
                param=effort_param,
            )
        kwargs.update(REASONING_EFFORTS[reasoning_effort])
        kwargs["reasoning_effort"] = reasoning_effort
    if extra:
        kwargs.update(extra)
    return kwargs


def _text_only(messages: list[dict], family: str) -> list[dict]:
    """Past tool calls and results as plain text (for templates without tools)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = "\n".join(
                tc.render_tool_call(family, c["function"]["name"], c["function"]["arguments"])
                for c in m.pop("tool_calls")
            )
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + calls
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
        out.append(m)
    # Consecutive tool results become one user turn.
    merged: list[dict] = []
    for m in out:
        if (merged and m["role"] == "user" and merged[-1]["role"] == "user"
                and m["content"].startswith("<tool_response>")
                and merged[-1]["content"].startswith("<tool_response>")):
            merged[-1] = {"role": "user", "content": merged[-1]["content"] + "\n" + m["content"]}
        else:
            merged.append(m)
    return merged


def _with_system(messages: list[dict], extra: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = (first.get("content") or "") + "\n\n" + extra
        return [first] + messages[1:]
    return [{"role": "system", "content": extra}] + messages


# Claude Code puts a per-request attribution line first in its system prompt
# (``x-anthropic-billing-header: cc_version=...; cch=<hex>;``). Kept, it
# changes the first block of every prompt, so no turn reuses the cached system
# prompt; it carries nothing for the model.
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"


def strip_billing_header(messages: list[dict]) -> list[dict]:
    """``messages`` without the billing line leading the first system message."""
    if not messages or messages[0].get("role") != "system":
        return messages
    text = messages[0].get("content") or ""
    if not isinstance(text, str) or not text.lstrip().startswith(BILLING_HEADER_PREFIX):
        return messages
    rest = text.lstrip().partition("\n")[2].lstrip("\n")
    return ([{**messages[0], "content": rest}] if rest else []) + messages[1:]


def _join_systems(messages: list[dict], hoist: bool) -> list[dict]:
    """Adjacent system messages as one (their texts a blank line apart);
    with ``hoist``, every system message joins one at the start."""
    systems = [m for m in messages if m["role"] == "system"]
    if hoist:
        if len(systems) < 2 and (not systems or messages[0] is systems[0]):
            return messages
        first = {**systems[0], "content": "\n\n".join(m.get("content") or "" for m in systems)}
        return [first] + [m for m in messages if m["role"] != "system"]
    out: list[dict] = []
    for m in messages:
        if m["role"] == "system" and out and out[-1]["role"] == "system":
            out[-1] = {**out[-1], "content": (out[-1].get("content") or "") + "\n\n" + (m.get("content") or "")}
        else:
            out.append(m)
    return out


# A model without a chat template gets no guessed format: its chat turns
# would be wrong, silently.
NO_TEMPLATE_MESSAGE = (
    "this model has no chat template, so chat messages cannot be formatted for it; start the "
    "server with --chat-template FILE (a Jinja chat template, or the template text itself), "
    "or send a raw prompt to /v1/completions")


def require_template(tokenizer) -> str:
    """The chat template, or a 400 naming ``--chat-template``."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise bad_request(NO_TEMPLATE_MESSAGE, code="no_chat_template")
    return template


def build_chat_prompt(
    tokenizer,
    messages: list[dict],
    *,
    tools: list[dict] | None,
    use_tools: bool,
    template_kwargs: dict,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    keep_billing_header: bool = False,
) -> ChatPrompt:
    """``tools`` are OpenAI-shaped (``{"type": "function", "function": {...}}``)."""
    if not keep_billing_header:
        messages = strip_billing_header(messages)
    template = require_template(tokenizer)
    family = tc.detect_family(template) if tools and use_tools else None
    native_tools = "tools" in template
    msgs = messages
    if tools and not native_tools:
        msgs = _text_only(msgs, family or "hermes")
        if use_tools:
            msgs = _with_system(msgs, tc.fallback_system_prompt([t["function"] for t in tools]))
    elif not native_tools:
        msgs = _text_only(msgs, "hermes")
    if continue_final_message:
        add_generation_prompt = False
    msgs = _join_systems(msgs, hoist=False)

    def render(m):
        return tokenizer.apply_chat_template(
            m, add_generation_prompt=add_generation_prompt,
            tools=tools if (tools and use_tools and native_tools) else None,
            **template_kwargs,
        )

    try:
        text = render(msgs)
    except ValueError as e:
        # Many templates take a system message first only (Mistral's,
        # Gemma's raise otherwise): then every system message joins the first.
        hoisted = _join_systems(msgs, hoist=True)
        if hoisted == msgs:
            raise bad_request(str(e), param="messages") from None
        try:
            text = render(hoisted)
        except ValueError:
            raise bad_request(str(e), param="messages") from None
    if continue_final_message and msgs and msgs[-1]["role"] == "assistant":
        last = msgs[-1].get("content") or ""
        i = text.rfind(last) if last else -1
        if i >= 0:
            text = text[: i + len(last)]
    ids = tokenizer.encode(text, add_special_tokens=False)
    if getattr(tokenizer, "add_bos", False) and tokenizer.bos_token_id is not None:
        if not ids or ids[0] != tokenizer.bos_token_id:
            ids = [tokenizer.bos_token_id] + ids
    thinking = reasoning_mod.template_supports_thinking(template)
    return ChatPrompt(
        text=text, ids=ids, tool_family=family,
        reasoning=thinking,
        in_reasoning=thinking and reasoning_mod.prompt_opens_reasoning(text),
    )


def tool_message_content(content) -> str:
    """A tool result (string, JSON value or text parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return json.dumps(content, ensure_ascii=False)
