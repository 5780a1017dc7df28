"""Chat messages -> prompt text -> token ids, for every chat API.

The rendering itself (template, tools, system-message joins, the BOS rule)
is ``text/prompt.py``, shared with the library (``generation.prompt_ids``);
this module adds what is the server's: template variables from request
fields, and 400s in the API's shape for what the template cannot take.
"""

from __future__ import annotations

import json

from ..text.prompt import (  # noqa: F401  (re-exported: the server's names)
    ChatPrompt,
    TemplateError,
    render_chat,
    strip_billing_header,
)
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
    """``render_chat``, its refusals as 400s (no template: one naming
    ``--chat-template``; the template's own error: ``messages``)."""
    require_template(tokenizer)
    try:
        return render_chat(
            tokenizer, messages, tools=tools, use_tools=use_tools, template_kwargs=template_kwargs,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            keep_billing_header=keep_billing_header)
    except TemplateError as e:
        raise bad_request(str(e), param="messages") from None


def tool_message_content(content) -> str:
    """A tool result (string, JSON value or text parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return json.dumps(content, ensure_ascii=False)
