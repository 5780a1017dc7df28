"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..engine.api import Request as EngineRequest
from ..text import tool_calls as tc
from . import generation as gen
from .common import new_id, parse_body
from .errors import APIError, bad_request
from .prompts import build_chat_prompt, template_kwargs_for, tool_message_content
from .schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from .sse import DONE, data_event, sse_response

router = APIRouter()


def _state(request: Request):
    return request.app.state.mlxfast


# ------------------------------------------------------------ messages


def _content_text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type in ("text", "input_text"):
            if part.text is None:
                raise bad_request(f"{where}.content[{i}] is a text part without 'text'", "messages")
            texts.append(part.text)
        elif part.type in ("image_url", "input_image", "image", "input_audio", "file", "video_url"):
            raise bad_request(
                f"{where}.content[{i}] is a '{part.type}' part, but this model is text-only "
                "(it accepts text content parts only)", "messages")
        else:
            raise bad_request(f"{where}.content[{i}] has unknown part type '{part.type}'", "messages")
    return "".join(texts)


def normalize_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> HF template messages."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        d: dict[str, Any] = {"role": role, "content": _content_text(m.content, where)}
        if m.role in ("user", "system", "developer") and m.content is None:
            raise bad_request(f"{where}: a {m.role} message needs content", "messages")
        if m.name is not None:
            d["name"] = m.name
        if role == "tool":
            d["content"] = tool_message_content(d["content"])
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if role != "assistant":
                raise bad_request(f"{where}: only assistant messages carry tool_calls", "messages")
            calls = []
            for c in m.tool_calls:
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        raise bad_request(f"{where}: tool call arguments are not valid JSON", "messages") from None
                calls.append({"id": c.id or new_id("call_"), "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        reasoning = m.reasoning_content or m.reasoning
        if reasoning and role == "assistant":
            d["reasoning_content"] = reasoning
        out.append(d)
    return out


# ------------------------------------------------------------ logprobs


def _lp_entry(tok, token_id: int, logprob: float | None) -> dict:
    text, b = gen.token_text(tok, token_id)
    return {"token": text, "logprob": logprob, "bytes": b}


def chat_logprobs(tok, ev, top_n: int) -> dict:
    entry = _lp_entry(tok, ev.token_id, ev.logprob)
    entry["top_logprobs"] = [_lp_entry(tok, i, lp) for i, lp in (ev.top_logprobs or [])[:top_n]]
    return entry


# ------------------------------------------------------------ chat


def _prepare_chat(state, body: ChatCompletionRequest):
    tok = state.tokenizer
    if body.n not in (None, 1):
        raise bad_request("n > 1 is not supported; send separate requests", "n")
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    messages = normalize_messages(body.messages)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if choice is not None and choice != "none" and not tools:
        if choice != "auto":
            raise bad_request("tool_choice requires tools", "tool_choice")
    forced_name = None
    if not isinstance(choice, str) and choice is not None:
        forced_name = choice.function.name
        if not any(t["function"]["name"] == forced_name for t in tools or []):
            raise bad_request(f"tool_choice names '{forced_name}', which is not in tools", "tool_choice")
    use_tools = bool(tools) and choice != "none"
    kwargs = template_kwargs_for(body.reasoning_effort, body.chat_template_kwargs)
    constrained = (use_tools and (choice == "required" or forced_name is not None)) or (
        body.response_format is not None and body.response_format.type != "text")
    if constrained:
        # A grammar leaves no room for a <think> block: ask the template not to open one.
        kwargs.setdefault("enable_thinking", False)
    prompt = build_chat_prompt(
        tok, messages, tools=tools, use_tools=use_tools, template_kwargs=kwargs,
        add_generation_prompt=body.add_generation_prompt is not False,
        continue_final_message=bool(body.continue_final_message),
    )
    grammar = None
    if use_tools and (choice == "required" or forced_name):
        grammar = state.grammar.tool_calls(
            prompt.tool_family or "hermes", [t["function"] for t in tools], forced_name)
    elif body.response_format is not None and body.response_format.type != "text":
        rf = body.response_format
        if rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
            grammar = state.grammar.json_schema(rf.json_schema.schema_)
        else:
            grammar = state.grammar.json_schema(None)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = gen.cap_max_tokens(state, len(prompt.ids), requested)
    params = gen.sampling_params(
        state, body, max_tokens, stop=body.stop, logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0, grammar=grammar)
    rid = new_id("chatcmpl-")
    ereq = EngineRequest(prompt_ids=prompt.ids, params=params, request_id=rid,
                         cache_salt=body.cache_salt or "")
    parser = gen.OutputParser(tok, reasoning=prompt.reasoning and grammar is None,
                              in_reasoning=prompt.in_reasoning and grammar is None,
                              tool_family=prompt.tool_family if use_tools else None)
    return ereq, parser


def _finish_reason(ev, n_calls: int) -> str:
    if ev.finish_reason == "stop" and n_calls:
        return "tool_calls"
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(ev.finish_reason, ev.finish_reason)


def _usage(ev) -> dict:
    return {
        "prompt_tokens": ev.prompt_tokens,
        "completion_tokens": ev.completion_tokens,
        "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": ev.cached_tokens},
    }


def _engine_error(ev) -> APIError:
    return APIError(500, f"generation failed: {ev.error or 'engine error'}", "server_error")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = _state(request)
    state.require_ready()
    body = await parse_body(request, ChatCompletionRequest)
    ereq, parser = _prepare_chat(state, body)
    model = body.model or state.settings.model_name
    if body.stream:
        steps = await gen.run(state, ereq, parser)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_chat_stream(state, ereq, steps, model, include_usage, body.top_logprobs or 0))
    steps = await gen.run(state, ereq, parser, http_request=request, heartbeat_s=state.settings.disconnect_poll_s)
    content, reasoning, calls, lps = [], [], [], []
    finish = None
    async for step in steps:
        if step.token is not None and body.logprobs:
            lps.append(chat_logprobs(state.tokenizer, step.token, body.top_logprobs or 0))
        for p in step.pieces:
            if isinstance(p, tc.ToolCall):
                calls.append({"id": new_id("call_"), "type": "function",
                              "function": {"name": p.name, "arguments": p.arguments}})
            elif p[0] == "reasoning":
                reasoning.append(p[1])
            else:
                content.append(p[1])
        if step.finish is not None:
            finish = step.finish
    if finish is None:  # client went away
        return JSONResponse({}, status_code=499)
    if finish.finish_reason == "error":
        raise _engine_error(finish)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) if (content or not calls) else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return {
        "id": ereq.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": state.system_fingerprint,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": {"content": lps} if body.logprobs else None,
            "finish_reason": _finish_reason(finish, len(calls)),
        }],
        "usage": _usage(finish),
    }


async def _chat_stream(state, ereq, steps, model, include_usage, top_n):
    created = int(time.time())
    tok = state.tokenizer

    def chunk(delta, finish_reason=None, logprobs=None):
        return data_event({
            "id": ereq.request_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "system_fingerprint": state.system_fingerprint,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        })

    n_calls = 0
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for step in steps:
            lp = None
            if step.token is not None and ereq.params.logprobs:
                lp = {"content": [chat_logprobs(tok, step.token, top_n)]}
            sent_lp = False
            for p in step.pieces:
                if isinstance(p, tc.ToolCall):
                    head = {"index": n_calls, "id": new_id("call_"), "type": "function",
                            "function": {"name": p.name, "arguments": ""}}
                    yield chunk({"tool_calls": [head]})
                    yield chunk({"tool_calls": [{"index": n_calls, "function": {"arguments": p.arguments}}]})
                    n_calls += 1
                else:
                    key = "reasoning_content" if p[0] == "reasoning" else "content"
                    yield chunk({key: p[1]}, logprobs=None if sent_lp else lp)
                    sent_lp = True
            if lp is not None and not sent_lp:
                yield chunk({"content": ""}, logprobs=lp)
            ev = step.finish
            if ev is not None:
                if ev.finish_reason == "error":
                    err = _engine_error(ev)
                    yield data_event(err.openai_body())
                    yield DONE
                    return
                yield chunk({}, finish_reason=_finish_reason(ev, n_calls))
                if include_usage:
                    yield data_event({
                        "id": ereq.request_id, "object": "chat.completion.chunk", "created": created,
                        "model": model, "system_fingerprint": state.system_fingerprint,
                        "choices": [], "usage": _usage(ev),
                    })
                yield DONE
                return
    finally:
        await steps.aclose()


# ------------------------------------------------------------ completions


def _completion_prompt(state, body: CompletionRequest) -> tuple[list[int], str]:
    tok = state.tokenizer
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request("batched prompts are not supported; send one prompt per request", "prompt")
        p = p[0]
    if isinstance(p, str):
        ids = tok.encode(p, add_special_tokens=True)
        text = p
    else:
        vocab = state.model_vocab_size
        for t in p:
            if not isinstance(t, int) or not 0 <= t < vocab:
                raise bad_request(f"prompt token {t!r} is outside the vocabulary (size {vocab})", "prompt")
        ids = list(p)
        text = tok.decode(ids)
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    return ids, text


def _completion_logprobs(tok, events, n: int, offset0: int) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    off = offset0
    for ev in events:
        text, _ = gen.token_text(tok, ev.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(ev.logprob)
        top = {}
        for i, lp in (ev.top_logprobs or [])[:n]:
            top[gen.token_text(tok, i)[0]] = lp
        out["top_logprobs"].append(top if n else None)
        out["text_offset"].append(off)
        off += len(text)
    return out


@router.post("/v1/completions")
async def completions(request: Request):
    state = _state(request)
    state.require_ready()
    body = await parse_body(request, CompletionRequest)
    if body.n not in (None, 1) or body.best_of not in (None, 1):
        raise bad_request("n > 1 and best_of > 1 are not supported", "n")
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    ids, prompt_text = _completion_prompt(state, body)
    max_tokens = gen.cap_max_tokens(state, len(ids), body.max_tokens)
    grammar = None
    if body.response_format is not None and body.response_format.type != "text":
        rf = body.response_format
        grammar = state.grammar.json_schema(rf.json_schema.schema_ if rf.json_schema else None)
    want_lp = body.logprobs is not None
    params = gen.sampling_params(state, body, max_tokens, stop=body.stop, logprobs=want_lp,
                                 top_logprobs=body.logprobs or 0, grammar=grammar)
    ereq = EngineRequest(prompt_ids=ids, params=params, request_id=new_id("cmpl-"),
                         cache_salt=body.cache_salt or "")
    parser = gen.OutputParser(state.tokenizer, reasoning=False, in_reasoning=False, tool_family=None)
    model = body.model or state.settings.model_name
    echo = prompt_text if body.echo else ""
    if body.stream:
        steps = await gen.run(state, ereq, parser)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_completion_stream(state, ereq, steps, model, echo, include_usage, body.logprobs))
    steps = await gen.run(state, ereq, parser, http_request=request, heartbeat_s=state.settings.disconnect_poll_s)
    text, events, finish = [], [], None
    async for step in steps:
        if step.token is not None:
            events.append(step.token)
        text += [p[1] for p in step.pieces if isinstance(p, tuple)]
        if step.finish is not None:
            finish = step.finish
    if finish is None:
        return JSONResponse({}, status_code=499)
    if finish.finish_reason == "error":
        raise _engine_error(finish)
    logprobs = None
    if want_lp:
        logprobs = _completion_logprobs(state.tokenizer, events, body.logprobs or 0, len(echo))
        if echo:
            prompt_lp = {
                "tokens": [gen.token_text(state.tokenizer, i)[0] for i in ids],
                "token_logprobs": [None] * len(ids),
                "top_logprobs": [None] * len(ids),
            }
            offs, o = [], 0
            for t in prompt_lp["tokens"]:
                offs.append(o)
                o += len(t)
            prompt_lp["text_offset"] = offs
            logprobs = {k: prompt_lp[k] + logprobs[k] for k in logprobs}
    return {
        "id": ereq.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": state.system_fingerprint,
        "choices": [{"index": 0, "text": echo + "".join(text), "logprobs": logprobs,
                     "finish_reason": _finish_reason(finish, 0)}],
        "usage": _usage(finish),
    }


async def _completion_stream(state, ereq, steps, model, echo, include_usage, n_lp):
    created = int(time.time())

    def chunk(text, finish_reason=None, logprobs=None):
        return data_event({
            "id": ereq.request_id, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": state.system_fingerprint,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
        })

    offset = len(echo)
    try:
        if echo:
            yield chunk(echo)
        async for step in steps:
            text = "".join(p[1] for p in step.pieces if isinstance(p, tuple))
            lp = None
            if step.token is not None and n_lp is not None:
                lp = _completion_logprobs(state.tokenizer, [step.token], n_lp, offset)
            if text or lp is not None:
                yield chunk(text, logprobs=lp)
            offset += len(text)
            ev = step.finish
            if ev is not None:
                if ev.finish_reason == "error":
                    yield data_event(_engine_error(ev).openai_body())
                    yield DONE
                    return
                yield chunk("", finish_reason=_finish_reason(ev, 0))
                if include_usage:
                    yield data_event({
                        "id": ereq.request_id, "object": "text_completion", "created": created,
                        "model": model, "choices": [], "usage": _usage(ev),
                    })
                yield DONE
                return
    finally:
        await steps.aclose()


@router.get("/v1/models")
async def list_models(request: Request):
    state = _state(request)
    name = state.settings.model_name
    return {"object": "list", "data": [{
        "id": name, "object": "model", "created": state.created, "owned_by": "mlxfast",
        "max_model_len": state.max_model_len if state.engine is not None else None,
    }]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    state = _state(request)
    if model_id != state.settings.model_name:
        raise APIError(404, f"model '{model_id}' not found", "not_found_error", param="model", code="model_not_found")
    return {"id": model_id, "object": "model", "created": state.created, "owned_by": "mlxfast"}
