"""Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens,
mapped onto the same engine requests as the OpenAI routes."""

from __future__ import annotations

import hashlib
from typing import Any

import pydantic_core

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..text.tool_calls import finite, model_json
from . import chat
from . import generation as gen
from .chat import ChatRequest
from .common import new_id, off_loop, ready_body
from .errors import APIError, bad_request
from .events import ContentDelta, ReasoningDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
from .schemas import AnthropicCountRequest, AnthropicRequest
from .sse import named_event, sse_response

router = APIRouter()

_MEDIA = ("image", "document", "audio", "video", "file", "search_result", "container_upload")


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or "type" not in block:
        raise bad_request(f"{where} must be a content block with a 'type'")
    t = block["type"]
    if t == "text":
        if not isinstance(block.get("text"), str):
            raise bad_request(f"{where}: a text block needs a string 'text'")
        return block["text"]
    if t in _MEDIA:
        raise bad_request(f"{where}: '{t}' blocks are not supported: this model is text-only")
    raise bad_request(f"{where}: unexpected block type '{t}'")


def _system_text(system) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system
    return "\n".join(_block_text(b, f"system[{i}]") for i, b in enumerate(system))


def _system_message(m, where: str) -> str:
    """A mid-conversation system message's text (its place in the prompt is
    the template's: templates that take one system message only get them
    joined, see prompts.py)."""
    if m.output_config and any(v is not None for v in m.output_config.values()):
        raise bad_request(f"{where}.output_config: per-message output settings are not supported; "
                          "set output_config on the request")
    if isinstance(m.content, str):
        return m.content
    parts = []
    for j, b in enumerate(m.content):
        if isinstance(b, dict) and b.get("type") in ("tool_addition", "tool_removal"):
            raise bad_request(f"{where}.content[{j}]: '{b['type']}' blocks (tools changed mid-conversation) "
                              "are not supported; send the tools in 'tools'")
        parts.append(_block_text(b, f"{where}.content[{j}]"))
    return "".join(parts)


def to_messages(body) -> list[dict]:
    """Anthropic system + messages -> HF template messages."""
    out: list[dict] = []
    system = _system_text(body.system)
    if system:
        out.append({"role": "system", "content": system})
    if body.messages and all(m.role == "system" for m in body.messages):
        raise bad_request("messages: a conversation needs a user message; role 'system' messages only add "
                          "to one", "messages")
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        if m.role == "system":
            text = _system_message(m, where)
            later_user = any(n.role == "user" for n in body.messages[i + 1:])
            if text and not (m.clear_at == "next_user_message" and later_user):
                out.append({"role": "system", "content": text})
            continue
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        thinking: list[str] = []
        calls: list[dict] = []
        results: list[dict] = []
        for j, b in enumerate(m.content):
            bw = f"{where}.content[{j}]"
            if not isinstance(b, dict) or not isinstance(b.get("type"), str):
                raise bad_request(f"{bw} must be a content block with a 'type'")
            t = b["type"]
            if t == "thinking" and m.role == "assistant" and isinstance(b.get("thinking"), str):
                thinking.append(b["thinking"])  # the template decides where reasoning goes, if anywhere
                continue
            if t in ("thinking", "redacted_thinking"):
                continue  # encrypted (redacted), or not the assistant's: accepted, not fed back
            if t == "tool_use":
                if m.role != "assistant":
                    raise bad_request(f"{bw}: tool_use blocks belong to assistant messages")
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise bad_request(f"{bw}: tool_use needs a 'name' and an 'input' object")
                calls.append({"id": b.get("id") or new_id("toolu_"), "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input", {})}})
            elif t == "tool_result":
                if m.role != "user":
                    raise bad_request(f"{bw}: tool_result blocks belong to user messages")
                c = b.get("content", "")
                if isinstance(c, list):
                    c = "\n".join(_block_text(x, f"{bw}.content[{k}]") for k, x in enumerate(c))
                elif not isinstance(c, str):
                    raise bad_request(f"{bw}: tool_result content must be a string or text blocks")
                if b.get("is_error"):
                    c = f"Error: {c}"
                results.append({"role": "tool", "content": c, "tool_call_id": b.get("tool_use_id")})
            elif t in ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                       "code_execution_tool_result", "mcp_tool_use", "mcp_tool_result"):
                raise bad_request(f"{bw}: '{t}' blocks come from server-side tools, which mlxfast does not run")
            else:
                texts.append(_block_text(b, bw))
        out.extend(results)
        if texts or calls or not results:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if thinking:
                msg["reasoning_content"] = "\n".join(thinking)  # as the OpenAI and Responses paths give it
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tools(body) -> list[dict] | None:
    if not body.tools:
        return None
    tools = []
    for i, t in enumerate(body.tools):
        if t.type not in (None, "custom"):
            raise bad_request(
                f"tools[{i}] is the server-side tool '{t.type}', which mlxfast does not run; "
                "define it as a client tool with an input_schema instead")
        fn = {"name": t.name, "parameters": t.input_schema or {"type": "object", "properties": {}}}
        if t.description:
            fn["description"] = t.description
        tools.append({"type": "function", "function": fn})
    return tools


_TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


def _prefill(body) -> bool:
    """Whether the last message is the assistant's text, which the answer
    continues (Anthropic's prefill); a last assistant tool use is a 400."""
    last = body.messages[-1]
    if last.role != "assistant":
        return False
    blocks = last.content if isinstance(last.content, list) else [{"type": "text", "text": last.content}]
    if any(isinstance(b, dict) and b.get("type") == "tool_use" for b in blocks):
        raise bad_request(f"messages[{len(body.messages) - 1}]: the conversation ends with the assistant's "
                          "tool_use; send its tool_result in a user message", "messages")
    texts = [b.get("text") for b in blocks if isinstance(b, dict) and b.get("type") == "text"]
    if not all(t is None or isinstance(t, str) for t in texts):
        raise bad_request(f"messages[{len(body.messages) - 1}]: a text block's 'text' must be a string", "messages")
    text = "".join(t or "" for t in texts)
    if not text:
        return False  # nothing to continue: a new turn, as without the message
    if body.thinking is not None and body.thinking.type != "disabled":
        raise bad_request("an assistant prefill cannot be combined with thinking (as on Anthropic's API)",
                          "thinking")
    return True


def chat_request(body) -> ChatRequest:
    """A Messages body in the chat layer's neutral form."""
    choice = body.tool_choice
    ctype = choice.type if choice else "auto"
    if ctype == "tool" and not choice.name:
        raise bad_request("tool_choice of type 'tool' needs a 'name'")
    prefill = _prefill(body)
    fmt = body.output_config.format if body.output_config is not None else None
    output_param = "output_config.format.schema"
    if body.output_format is not None:
        if fmt is not None:
            raise bad_request("give output_config.format or output_format (its beta name), not both",
                              "output_format")
        fmt, output_param = body.output_format, "output_format.schema"
    if prefill and fmt is not None:  # the grammar would start over after the prefilled text
        raise bad_request("an assistant prefill cannot be combined with structured output", output_param)
    return ChatRequest(
        messages=to_messages(body), sampling=body, max_tokens=getattr(body, "max_tokens", None),
        stop=getattr(body, "stop_sequences", None), tools=_tools(body), tool_choice=_TOOL_CHOICES[ctype],
        forced_tool=choice.name if ctype == "tool" else None,
        max_tool_calls=1 if choice is not None and choice.disable_parallel_tool_use else None,
        json_output=fmt is not None, output_schema=fmt.schema_ if fmt is not None else None,
        output_param=output_param,
        thinking=None if body.thinking is None else body.thinking.type != "disabled",
        continue_final_message=prefill, add_generation_prompt=not prefill,
        id_prefix="msg_", tool_params_param="tools[{i}].input_schema")


def _prepare(state, body):
    return chat.prepare(state, chat_request(body))


def _signature(text: str) -> str:
    return "mlxfast-" + hashlib.sha256(text.encode()).hexdigest()


def _stop_reason(ev, n_calls: int) -> tuple[str, str | None]:
    if ev.finish_reason == "length":
        return "max_tokens", None
    if ev.stop_string is not None:
        return "stop_sequence", ev.stop_string
    if n_calls:
        return "tool_use", None
    return "end_turn", None


def _usage(ev) -> dict:
    return {
        "input_tokens": ev.prompt_tokens - ev.cached_tokens,
        "output_tokens": ev.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": ev.cached_tokens,
    }


class _Args:
    """A call's arguments as input_json_delta pieces, kept while the text
    so far parses as (the start of) JSON: the SDK parses every prefix it is
    sent and fails on the first character that is no JSON (a model writing
    Python's True, say), so a call's pieces stop there, streamed or not."""

    def __init__(self):
        self.text, self.ok = "", True
        self._in_string = self._escape = False

    def _lex(self, piece: str) -> bool:
        """Carry the string state over ``piece``; whether it stayed inside
        one open string with only characters a JSON string may hold (then
        it cannot make the text invalid and the text is not parsed again: a
        long file written as an argument would cost quadratic time)."""
        clean = self._in_string
        for c in piece:
            if self._escape:
                clean = clean and c in '"\\/bfnrt'  # \u (and a bad escape) is left to the parser
                self._escape = False
            elif self._in_string:
                if c == "\\":
                    self._escape = True
                elif c == '"' or c < " ":
                    clean = False
                    self._in_string = c != '"'
            else:
                clean = False
                self._in_string = c == '"'
        return clean

    def add(self, piece: str) -> bool:
        """Whether ``piece`` is kept (and goes out)."""
        if self.ok and not self._lex(piece):
            try:
                pydantic_core.from_json(self.text + piece, allow_partial=True)
            except ValueError:
                self.ok = False
        if self.ok:
            self.text += piece
        return self.ok

    def input(self) -> dict:
        """The input object: the whole JSON, or what the kept start of it
        holds (cut off, or cut where it stopped being JSON)."""
        try:
            v = model_json(self.text)
        except ValueError:
            try:
                v = finite(pydantic_core.from_json(self.text, allow_partial=True))
            except ValueError:
                v = {}
        return v if isinstance(v, dict) else {}


@router.post("/v1/messages")
async def messages(request: Request):
    state, body = await ready_body(request, AnthropicRequest)
    model = state.resolve_model(body.model)
    prepared = await off_loop(_prepare, state, body)
    ereq, parser = prepared.request, prepared.parser()
    if body.stream:
        steps = await gen.run(state, ereq, parser, heartbeat_s=state.settings.heartbeat_s)
        return sse_response(_stream(ereq, steps, model, len(ereq.prompt_ids)))
    steps = await gen.run(state, ereq, parser, http_request=request, heartbeat_s=state.settings.disconnect_poll_s)
    blocks: list[dict] = []
    args: dict[int, tuple[dict, _Args]] = {}  # a call's index -> its block, its arguments
    finish = None
    async for step in steps:
        for p in step.pieces:
            if isinstance(p, ToolCallStart):
                blocks.append({"type": "tool_use", "id": new_id("toolu_"), "name": p.name, "input": {}})
                args[p.index] = (blocks[-1], _Args())
            elif isinstance(p, ToolCallArgs):
                args[p.index][1].add(p.text)
            elif isinstance(p, (ContentDelta, ReasoningDelta)):
                btype = "thinking" if isinstance(p, ReasoningDelta) else "text"
                if blocks and blocks[-1]["type"] == btype:
                    blocks[-1][btype] += p.text
                else:
                    blocks.append({"type": btype, btype: p.text})
        if step.finish is not None:
            finish = step.finish
    if finish is None:
        return JSONResponse({}, status_code=499)
    if finish.finish_reason == "error":
        raise APIError(500, f"generation failed: {finish.error or 'engine error'}", "server_error")
    for block, a in args.values():
        block["input"] = a.input()
    for b in blocks:
        if b["type"] == "thinking":
            b["signature"] = _signature(b["thinking"])
    stop_reason, stop_seq = _stop_reason(finish, len(args))
    return {
        "id": ereq.request_id, "type": "message", "role": "assistant", "model": model,
        "content": blocks, "stop_reason": stop_reason, "stop_sequence": stop_seq,
        "usage": _usage(finish),
    }


async def _stream(ereq, steps, model, n_prompt):
    index = -1
    open_type: str | None = None
    thinking_text: list[str] = []
    n_calls = 0
    args: dict[int, _Args] = {}

    def start(block: dict) -> bytes:
        return named_event("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})

    def delta(d: dict) -> bytes:
        return named_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})

    def close() -> list[bytes]:
        nonlocal open_type
        out = []
        if open_type == "thinking":
            out.append(delta({"type": "signature_delta", "signature": _signature("".join(thinking_text))}))
        if open_type is not None:
            out.append(named_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        open_type = None
        return out

    def message_start(step) -> bytes:
        """The message's opening, with the prompt's cache reads as the
        request's first event tells them (none known when a silence comes
        first: a long queue or prefill)."""
        ev = step.token or step.finish
        cached = (ev.cached_tokens or 0) if ev is not None else 0
        return named_event("message_start", {"type": "message_start", "message": {
            "id": ereq.request_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": n_prompt - cached, "output_tokens": 0,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached},
        }})

    started = False
    try:
        async for step in steps:
            if not started:
                started = True
                yield message_start(step)
                yield named_event("ping", {"type": "ping"})
                if step.heartbeat:
                    continue
            if step.heartbeat:
                yield named_event("ping", {"type": "ping"})
                continue
            for p in step.pieces:
                if isinstance(p, ToolCallStart):
                    for b in close():
                        yield b
                    index += 1
                    n_calls += 1
                    open_type = "tool_use"
                    yield start({"type": "tool_use", "id": new_id("toolu_"), "name": p.name, "input": {}})
                elif isinstance(p, ToolCallArgs):
                    if args.setdefault(p.index, _Args()).add(p.text):
                        yield delta({"type": "input_json_delta", "partial_json": p.text})
                elif isinstance(p, ToolCallEnd):
                    for b in close():
                        yield b
                elif isinstance(p, (ContentDelta, ReasoningDelta)):
                    btype = "thinking" if isinstance(p, ReasoningDelta) else "text"
                    if open_type != btype:
                        for b in close():
                            yield b
                        index += 1
                        open_type = btype
                        thinking_text = []
                        yield start({"type": "thinking", "thinking": "", "signature": ""} if btype == "thinking"
                                    else {"type": "text", "text": ""})
                    if btype == "thinking":
                        thinking_text.append(p.text)
                        yield delta({"type": "thinking_delta", "thinking": p.text})
                    else:
                        yield delta({"type": "text_delta", "text": p.text})
            ev = step.finish
            if ev is None:
                continue
            if ev.finish_reason == "error":
                yield named_event("error", {"type": "error", "error": {
                    "type": "api_error", "message": f"generation failed: {ev.error or 'engine error'}"}})
                return
            for b in close():
                yield b
            stop_reason, stop_seq = _stop_reason(ev, n_calls)
            yield named_event("message_delta", {
                "type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_seq},
                "usage": _usage(ev)})
            yield named_event("message_stop", {"type": "message_stop"})
            return
    finally:
        await steps.aclose()


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    state, body = await ready_body(request, AnthropicCountRequest)
    state.resolve_model(body.model)
    return {"input_tokens": await off_loop(lambda: chat.count(state, chat_request(body)))}
