"""Prompts -> token ids: the one path of the server and the library.

* Chat messages: ``render_chat`` renders ``tokenizer.chat_template`` (adjacent
  system messages joined; templates that take a system message first only get
  them all joined there; tools written into the system prompt when the
  template cannot render them) and tokenizes the text with ``chat_ids``: the
  special tokens the template wrote, plus BOS in front when the tokenizer adds
  one and the template did not write it.
* Raw text: ``text_ids``, the tokenizer's own special tokens (what
  ``/v1/completions`` and ``chat=False`` feed).

The server's chat layer (``server/prompts.py``) and ``generation.prompt_ids``
(``mlxfast.generate``, ``mlxfast generate``) both call these, so one prompt
gives the same ids everywhere.

Messages arrive in Hugging Face template form: ``{"role", "content": str,
"tool_calls": [{"id", "type", "function": {"name", "arguments": dict}}],
"tool_call_id", "name"}``. A template that cannot render tools gets mlxfast's
Hermes-style tool prompt and past calls/results written out as text, so tool
use works with any chat model.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import reasoning as reasoning_mod
from . import tool_calls as tc
from .chat_template import TemplateBoundsError


@dataclass
class ChatPrompt:
    text: str
    ids: list[int]
    tool_family: str | None  # parser to run on the output (None: no tools)
    reasoning: bool  # split <think> from the answer
    in_reasoning: bool  # the prompt already opened a think block


class NoChatTemplate(ValueError):
    """The tokenizer has no chat template (no format is guessed)."""


class TemplateError(ValueError):
    """The chat template refused the messages (its own message)."""


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a raw prompt: the tokenizer adds its special tokens as the
    model does (BOS where it adds one)."""
    return tokenizer.encode(text, add_special_tokens=True)


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of rendered chat text: the special tokens written in it, and
    BOS first when the tokenizer adds one and the template did not."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if getattr(tokenizer, "add_bos", False) and tokenizer.bos_token_id is not None:
        if not ids or ids[0] != tokenizer.bos_token_id:
            ids = [tokenizer.bos_token_id] + ids
    return ids


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


def render_chat(
    tokenizer,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    use_tools: bool = False,
    template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    keep_billing_header: bool = False,
) -> ChatPrompt:
    """``messages`` rendered with the chat template and tokenized (``chat_ids``).
    ``tools`` are OpenAI-shaped (``{"type": "function", "function": {...}}``).
    Raises ``NoChatTemplate`` without a template and ``TemplateError`` when the
    template refuses the messages."""
    if not keep_billing_header:
        messages = strip_billing_header(messages)
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise NoChatTemplate("this model has no chat template")
    template_kwargs = template_kwargs or {}
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
    except TemplateBoundsError as e:
        raise TemplateError(str(e)) from None
    except ValueError as e:
        # Many templates take a system message first only (Mistral's,
        # Gemma's raise otherwise): then every system message joins the first.
        hoisted = _join_systems(msgs, hoist=True)
        if hoisted == msgs:
            raise TemplateError(str(e)) from None
        try:
            text = render(hoisted)
        except ValueError:
            raise TemplateError(str(e)) from None
    if continue_final_message and msgs and msgs[-1]["role"] == "assistant":
        last = msgs[-1].get("content") or ""
        for cand in (last, last.rstrip()):  # a template may trim the message
            i = text.rfind(cand) if cand else -1
            if i >= 0:
                text = text[: i + len(cand)]
                break
    thinking = reasoning_mod.template_supports_thinking(template)
    return ChatPrompt(
        text=text, ids=chat_ids(tokenizer, text), tool_family=family,
        reasoning=thinking,
        in_reasoning=thinking and reasoning_mod.prompt_opens_reasoning(text),
    )
