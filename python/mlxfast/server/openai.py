"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..engine.api import Request as EngineRequest
from ..text.prompt import text_ids
from . import chat
from . import generation as gen
from .chat import ChatRequest
from .common import loads_field, new_id, off_loop, ready_body, state_of
from .errors import APIError, bad_request
from .events import ContentDelta, ReasoningDelta, ToolCallArgs, ToolCallStart
from .grammar import guided_spec
from .prompts import template_kwargs_for, tool_message_content
from .schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, NamedToolChoice
from .sse import DONE, data_event, sse_response

router = APIRouter()


# ------------------------------------------------------------ messages


def _content_text(content, where: str, role: str) -> str:
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
        elif part.type == "refusal" and role == "assistant":  # an earlier answer's refusal, as its text
            if part.refusal is None:
                raise bad_request(f"{where}.content[{i}] is a refusal part without 'refusal'", "messages")
            texts.append(part.refusal)
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
        d: dict[str, Any] = {"role": role, "content": _content_text(m.content, where, role)}
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
                    args = loads_field(args, f"{where}: tool call arguments", "messages", model_output=True) if args.strip() else {}
                calls.append({"id": c.id or new_id("call_"), "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        reasoning = m.reasoning_content or m.reasoning
        if reasoning and role == "assistant":
            d["reasoning_content"] = reasoning
        out.append(d)
    return out


# ------------------------------------------------------------ logprobs


def _lp_entry(names, token_id: int, logprob: float | None) -> dict:
    text, b = names(token_id)
    return {"token": text, "logprob": logprob, "bytes": b}


def chat_logprobs(names, ev, top_n: int) -> dict:
    """One token's chat logprobs entry; ``names`` is ``gen.token_names``'s."""
    entry = _lp_entry(names, ev.token_id, ev.logprob)
    entry["top_logprobs"] = [_lp_entry(names, i, lp) for i, lp in (ev.top_logprobs or [])[:top_n]]
    return entry


def _names(state, body):
    return gen.token_names(state.tokenizer, bool(body.return_tokens_as_token_ids))


# ------------------------------------------------------------ chat


def _tools_and_choice(body: ChatCompletionRequest):
    """``tools`` and ``tool_choice``, with the legacy ``functions`` /
    ``function_call`` mapped onto them."""
    if body.functions is None and body.function_call is None:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        return tools, body.tool_choice
    if body.tools is not None or body.tool_choice is not None:
        raise bad_request("give either tools / tool_choice or the legacy functions / function_call, "
                          "not both", "functions")
    tools = [{"type": "function", "function": f.model_dump(exclude_none=True)}
             for f in body.functions or []] or None
    fc = body.function_call
    if fc is None or isinstance(fc, str):
        return tools, fc
    return tools, NamedToolChoice(function=fc)


def _format_schema(rf) -> dict | None:
    """The schema of a JSON ``response_format``: OpenAI's json_schema.schema,
    or llama.cpp's ``{"type": "json_object", "schema": ...}``; None for any
    JSON object (or no format)."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
        return rf.json_schema.schema_
    schema = (rf.model_extra or {}).get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise bad_request("response_format.schema must be a JSON schema object", "response_format")
    return schema


def _guided(body) -> tuple | None:
    """vLLM's / llama.cpp's structured-output fields (``grammar.guided_spec``);
    given beside a JSON ``response_format``, a 400."""
    guided = guided_spec(body)
    rf = body.response_format
    if guided is not None and rf is not None and rf.type != "text":
        raise bad_request(f"give response_format or {guided[2]}, not both", guided[2])
    return guided


def chat_request(body: ChatCompletionRequest) -> ChatRequest:
    """A chat completion body in the chat layer's neutral form."""
    if body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is supported on /v1/completions (or use echo with logprobs there), "
                          "not on chat completions", "prompt_logprobs")
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    tools, choice = _tools_and_choice(body)
    forced = None
    if choice is None:
        choice = "auto"
    elif not isinstance(choice, str):
        choice, forced = "function", choice.function.name
    rf = body.response_format
    schema = _format_schema(rf)
    return ChatRequest(
        messages=normalize_messages(body.messages), sampling=body, guided=_guided(body),
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        stop=body.stop, tools=tools, tool_choice=choice, forced_tool=forced,
        max_tool_calls=1 if body.parallel_tool_calls is False else None,
        json_output=rf is not None and rf.type != "text", output_schema=schema,
        template_kwargs=template_kwargs_for(body.reasoning_effort, body.chat_template_kwargs),
        add_generation_prompt=body.add_generation_prompt is not False,
        continue_final_message=bool(body.continue_final_message),
        logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0,
        cache_salt=body.cache_salt or "", id_prefix="chatcmpl-",
        tool_params_param="functions[{i}].parameters" if _legacy(body) else "tools[{i}].function.parameters")


def _prepare_chat(state, body: ChatCompletionRequest):
    return chat.prepare(state, chat_request(body))


def _finish_reason(ev, n_calls: int) -> str:
    if ev.finish_reason == "stop" and n_calls:
        return "tool_calls"
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(ev.finish_reason, ev.finish_reason)


def _usage(groups: list[list]) -> dict:
    """Usage over prompts with one or more sequences each (``n``, ``best_of``,
    batched prompts): every prompt counted once."""
    prompt = sum(g[0].prompt_tokens for g in groups)
    completion = sum(f.completion_tokens for g in groups for f in g)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": sum(g[0].cached_tokens for g in groups)}}
    spec = speculation([f for g in groups for f in g])
    if spec is not None:
        usage["speculation"] = spec
    return usage


def speculation(finishes) -> dict | None:
    """Draft tokens proposed and accepted over ``finishes`` (with speculative decoding on)."""
    specs = [f.speculation for f in finishes if f.speculation is not None]
    if not specs:
        return None
    return {"drafted": sum(s["drafted"] for s in specs), "accepted": sum(s["accepted"] for s in specs)}


def _engine_error(ev) -> APIError:
    return APIError(500, f"generation failed: {ev.error or 'engine error'}", "server_error")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state, body = await ready_body(request, ChatCompletionRequest)
    model = state.resolve_model(body.model)
    prepared = await off_loop(_prepare_chat, state, body)
    ereq = prepared.request
    requests = gen.fan_out(ereq, body.n or 1)
    parsers = [prepared.parser() for _ in requests]
    if body.stream:
        steps = await gen.run_many(state, requests, parsers)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        running = _running_usage(body, [len(ereq.prompt_ids)] * len(requests))
        return sse_response(_chat_stream(state, ereq, steps, len(requests), model, include_usage,
                                         body.top_logprobs or 0, legacy=_legacy(body), running=running,
                                         echo=_echo_text(body), names=_names(state, body),
                                         token_ids=bool(body.return_token_ids)))
    steps = await gen.run_many(state, requests, parsers, http_request=request,
                               heartbeat_s=state.settings.disconnect_poll_s)
    choices = [_Choice(_echo_text(body)) for _ in requests]
    names = _names(state, body)
    async for i, step in steps:
        choices[i].add(step, names, body)
    finishes = [c.finish for c in choices]
    if any(f is None for f in finishes):  # client went away
        return JSONResponse({}, status_code=499)
    for f in finishes:
        if f.finish_reason == "error":
            raise _engine_error(f)
    out = {
        "id": ereq.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": state.system_fingerprint,
        "choices": [c.to_json(i, body) for i, c in enumerate(choices)],
        "usage": _usage([finishes]),
    }
    if body.return_token_ids:
        out["prompt_token_ids"] = list(ereq.prompt_ids)
    return out


def _echo_text(body: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the last message's text when it is the
    assistant's (the answer continues it), else nothing."""
    last = body.messages[-1]
    if not body.echo or last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "".join(p.text or "" for p in last.content if p.type == "text")


class _Choice:
    """One choice of a non-streamed chat completion, accumulated."""

    def __init__(self, echo: str = ""):
        self.content, self.reasoning, self.calls, self.logprobs = [echo] if echo else [], [], [], []
        self.token_ids: list[int] = []
        self.finish = None

    def add(self, step, names, body) -> None:
        if step.token is not None:
            self.token_ids.append(step.token.token_id)
            if body.logprobs:
                self.logprobs.append(chat_logprobs(names, step.token, body.top_logprobs or 0))
        for p in step.pieces:
            if isinstance(p, ToolCallStart):
                self.calls.append({"id": new_id("call_"), "type": "function",
                                   "function": {"name": p.name, "arguments": ""}})
            elif isinstance(p, ToolCallArgs):
                self.calls[p.index]["function"]["arguments"] += p.text
            elif isinstance(p, ReasoningDelta):
                self.reasoning.append(p.text)
            elif isinstance(p, ContentDelta):
                self.content.append(p.text)
        if step.finish is not None:
            self.finish = step.finish

    def to_json(self, index: int, body) -> dict:
        calls = self.calls
        message: dict[str, Any] = {"role": "assistant",
                                   "content": "".join(self.content) if (self.content or not calls) else None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        finish_reason = _finish_reason(self.finish, len(calls))
        if calls and _legacy(body):  # the legacy shape: one function_call, no ids
            message["function_call"] = calls[0]["function"]
            finish_reason = "function_call" if finish_reason == "tool_calls" else finish_reason
        elif calls:
            message["tool_calls"] = calls
        out = {"index": index, "message": message,
               "logprobs": {"content": self.logprobs} if body.logprobs else None,
               "finish_reason": finish_reason}
        if body.return_token_ids:
            out["token_ids"] = self.token_ids
        return out


def _legacy(body: ChatCompletionRequest) -> bool:
    return body.functions is not None or body.function_call is not None


async def _sse_choices(steps, n: int, step_chunks, usage_event):
    """The OpenAI SSE body over ``n`` choices' steps: ``step_chunks(i, step)``
    gives the chunks of one step (its finish chunk included, unless the step
    is an error); once every choice has finished, ``usage_event(finishes)``
    (or None) and ``[DONE]``. An engine error ends the stream with an error
    event; so does a later choice that could not be submitted."""
    finishes: list = [None] * n
    try:
        async for i, step in steps:
            for c in step_chunks(i, step):
                yield c
            ev = step.finish
            if ev is None:
                continue
            if ev.finish_reason == "error":
                yield data_event(_engine_error(ev).openai_body())
                yield DONE
                return
            finishes[i] = ev
            if all(f is not None for f in finishes):
                if usage_event is not None:
                    yield usage_event(finishes)
                yield DONE
                return
    except APIError as e:  # a later choice could not be submitted (the server is full)
        yield data_event(e.openai_body())
        yield DONE
    finally:
        await steps.aclose()


class _RunningUsage:
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk of a
    choice carries the usage so far (its prompt, its tokens out)."""

    def __init__(self, prompts: list[int]):
        self.prompts, self.out = prompts, [0] * len(prompts)

    def step(self, i: int, step) -> None:
        if step.token is not None:
            self.out[i] += 1

    def of(self, i: int) -> dict:
        p, c = self.prompts[i], self.out[i]
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _running_usage(body, prompts: list[int]) -> _RunningUsage | None:
    o = body.stream_options
    return _RunningUsage(prompts) if o is not None and o.include_usage and o.continuous_usage_stats else None


async def _chat_stream(state, ereq, steps, n, model, include_usage, top_n, legacy=False, running=None,
                       echo="", *, names, token_ids=False):
    created = int(time.time())
    head = {"id": ereq.request_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "system_fingerprint": state.system_fingerprint}
    unsent: list[list[int]] = [[] for _ in range(n)]  # vLLM's return_token_ids: ids not yet in a chunk

    def chunk(index, delta, finish_reason=None, logprobs=None, top=None):
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if token_ids:
            choice["token_ids"], unsent[index] = unsent[index], []
        body = {**head, **(top or {}), "choices": [choice]}
        if running is not None:
            body["usage"] = running.of(index)
        return data_event(body)

    n_calls = [0] * n

    def step_chunks(i, step):
        if running is not None:
            running.step(i, step)
        lp = None
        if step.token is not None:
            if token_ids:
                unsent[i].append(step.token.token_id)
            if step.token.logprob is not None:
                lp = {"content": [chat_logprobs(names, step.token, top_n)]}
        sent_lp = False
        for p in step.pieces:
            if isinstance(p, ToolCallStart):
                n_calls[i] += 1
                if legacy:  # the legacy shape carries one call
                    if p.index == 0:
                        yield chunk(i, {"function_call": {"name": p.name, "arguments": ""}})
                    continue
                yield chunk(i, {"tool_calls": [{"index": p.index, "id": new_id("call_"), "type": "function",
                                                "function": {"name": p.name, "arguments": ""}}]})
            elif isinstance(p, ToolCallArgs):
                if not legacy:
                    yield chunk(i, {"tool_calls": [{"index": p.index, "function": {"arguments": p.text}}]})
                elif p.index == 0:
                    yield chunk(i, {"function_call": {"arguments": p.text}})
            elif isinstance(p, (ContentDelta, ReasoningDelta)):
                key = "reasoning_content" if isinstance(p, ReasoningDelta) else "content"
                yield chunk(i, {key: p.text}, logprobs=None if sent_lp else lp)
                sent_lp = True
        ev = step.finish
        # A token that wrote nothing yet still has its chunk when its logprobs
        # or its id are asked for (a finish chunk would carry the id).
        if (lp is not None and not sent_lp) or (unsent[i] and (ev is None or ev.finish_reason == "error")):
            yield chunk(i, {"content": ""}, logprobs=None if sent_lp else lp)
        if ev is not None and ev.finish_reason != "error":
            reason = _finish_reason(ev, n_calls[i])
            yield chunk(i, {}, finish_reason="function_call" if legacy and reason == "tool_calls" else reason)

    def usage_event(finishes):
        return data_event({**head, "choices": [], "usage": _usage([finishes])})

    prompt_ids = {"prompt_token_ids": list(ereq.prompt_ids)} if token_ids else None
    for i in range(n):  # vLLM's return_token_ids: the prompt's ids ride on each choice's first chunk
        yield chunk(i, {"role": "assistant", "content": echo}, top=prompt_ids)
    async with aclosing(_sse_choices(steps, n, step_chunks, usage_event if include_usage else None)) as sse:
        async for c in sse:
            yield c


# ------------------------------------------------------------ completions


def _completion_prompts(body: CompletionRequest) -> list:
    """The request's prompts: one string or token list, or a batch of them."""
    p = body.prompt
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        return list(p)
    return [p]


def _completion_prompt(state, p) -> tuple[list[int], str]:
    tok = state.tokenizer
    if isinstance(p, str):
        ids = text_ids(tok, p)  # the library's raw-text rule too (chat=False)
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


def _prepare_completion(state, body: CompletionRequest, prompt):
    ids, prompt_text = _completion_prompt(state, prompt)
    kept = gen.truncate_prompt(state, ids, body)
    if len(kept) < len(ids):  # echo gives back the prompt the model saw
        ids, prompt_text = kept, state.tokenizer.decode(kept)
    if body.max_tokens == 0:  # score the prompt, generate nothing (OpenAI's echo without a completion)
        if not body.echo:
            raise bad_request("max_tokens must be at least 1 (0 is allowed with echo: the prompt alone)",
                              "max_tokens")
        gen.cap_max_tokens(state, len(ids), 0, "prompt")  # a 400 when the prompt alone fills the context
        max_tokens = 0
    else:
        max_tokens = gen.cap_max_tokens(state, len(ids), body.max_tokens, "prompt")
    grammar = None
    guided = _guided(body)
    if guided is not None:
        grammar = state.grammar.guided(*guided)
    elif body.response_format is not None and body.response_format.type != "text":
        grammar = state.grammar.json_schema(_format_schema(body.response_format))
    # best_of ranks its candidates by their summed logprobs, so it needs them.
    params = gen.sampling_params(state, body, max_tokens, stop=body.stop,
                                 logprobs=body.logprobs is not None or (body.best_of or 1) > (body.n or 1),
                                 top_logprobs=body.logprobs or 0, grammar=grammar)
    # The echoed prompt's logprobs and vLLM's prompt_logprobs come from one scoring pass.
    wanted = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
    if wanted:
        params.prompt_logprobs = max(wanted)
    ereq = EngineRequest(prompt_ids=ids, params=params, request_id=new_id("cmpl-"),
                         cache_salt=body.cache_salt or "")
    return ids, prompt_text, ereq


def _completion_logprobs(names, entries, n: int, offset0: int) -> dict:
    """OpenAI's legacy logprobs over ``(token id, logprob, top [(id, logprob)] | None)`` entries:
    per position the ``n`` best and the chosen token (so up to n + 1; with
    ``logprobs: 0`` the chosen one alone), None where there is no logprob
    (an echoed prompt's first token)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    off = offset0
    for token_id, logprob, top in entries:
        text, _ = names(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        best = None
        if logprob is not None:
            best = {names(i)[0]: lp for i, lp in (top or [])[:n]}
            best.setdefault(text, logprob)
        out["top_logprobs"].append(best)
        out["text_offset"].append(off)
        off += len(text)
    return out


def _token_entries(events) -> list:
    return [(ev.token_id, ev.logprob, ev.top_logprobs) for ev in events]


def _prompt_entries(ids, scores) -> list:
    """The prompt's entries: the first token has no logprob, nor has any when no scores came."""
    scores = scores or [None] * len(ids)
    return [(t, None, None) if sc is None else (t, sc.logprob, sc.top_logprobs) for t, sc in zip(ids, scores)]


def _vllm_prompt_logprobs(names, ids, scores, k: int) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first), else
    ``{token id: {logprob, rank, decoded_token}}`` for the token itself and the k best."""
    if scores is None:
        return None

    def entry(token_id, logprob, rank):
        return {"logprob": logprob, "rank": rank, "decoded_token": names(token_id)[0]}

    out: list = [None]
    for t, sc in zip(ids[1:], scores[1:]):
        d = {str(t): entry(t, sc.logprob, sc.rank)}
        for rank, (i, lp) in enumerate(sc.top_logprobs[:k], 1):
            d[str(i)] = entry(i, lp, rank)
        out.append(d)
    return out


@router.post("/v1/completions")
async def completions(request: Request):
    state, body = await ready_body(request, CompletionRequest)
    n = body.n or 1
    best_of = body.best_of if body.best_of is not None else n
    if best_of < n:
        raise bad_request(f"best_of ({best_of}) must be at least n ({n})", "best_of")
    if best_of > n and body.stream:
        raise bad_request("best_of > n cannot stream: the best choices are known only at the end", "best_of")
    if body.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported: this model has no "
                          "fill-in-the-middle tokens", "suffix")
    if body.stream and body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not supported with stream=true (echo with logprobs is)",
                          "prompt_logprobs")
    prompts = _completion_prompts(body)
    if len(prompts) * best_of > 128:
        raise bad_request(f"{len(prompts)} prompts x {best_of} choices is more than 128 sequences", "prompt")
    model = state.resolve_model(body.model)
    prepared = [await off_loop(_prepare_completion, state, body, p) for p in prompts]

    def parsers(k):
        return [gen.PlainText() for _ in range(k)]

    groups = [gen.fan_out(ereq, best_of) for _, _, ereq in prepared]
    rid = prepared[0][2].request_id
    if body.stream:
        steps = await gen.run_groups(state, groups, [parsers(len(g)) for g in groups])
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        running = _running_usage(body, [len(prepared[i // best_of][0]) for i in range(len(prepared) * best_of)])
        return sse_response(_completion_stream(state, rid, prepared, steps, best_of, model, body,
                                               include_usage, running))
    steps = await gen.run_groups(state, groups, [parsers(len(g)) for g in groups], http_request=request,
                                 heartbeat_s=state.settings.disconnect_poll_s)
    outs = [_CompletionOut() for g in groups for _ in g]
    async for i, step in steps:
        outs[i].add(step)
    if any(o.finish is None for o in outs):
        return JSONResponse({}, status_code=499)
    for o in outs:
        if o.finish.finish_reason == "error":
            raise _engine_error(o.finish)
    choices = []
    for g, (ids, prompt_text, _) in enumerate(prepared):
        mine = outs[g * best_of:(g + 1) * best_of]
        if best_of > n:  # the n with the highest summed logprob, best first (OpenAI's best_of)
            mine = sorted(mine, key=lambda o: -sum(e.logprob or 0.0 for e in o.events))[:n]
        for o in mine:
            choices.append(o.to_json(len(choices), state, body, ids, prompt_text))
    finishes = [o.finish for o in outs]
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": state.system_fingerprint,
        "choices": choices,
        "usage": _usage([finishes[g * best_of:(g + 1) * best_of] for g in range(len(groups))]),
    }


class _CompletionOut:
    """One sequence of a non-streamed text completion, accumulated."""

    def __init__(self):
        self.text, self.events, self.finish, self.scores = [], [], None, None

    def add(self, step) -> None:
        ev = step.token or step.finish
        if ev is not None and ev.prompt_logprobs is not None:
            self.scores = ev.prompt_logprobs
        if step.token is not None:
            self.events.append(step.token)
        self.text += [p.text for p in step.pieces if isinstance(p, ContentDelta)]
        if step.finish is not None:
            self.finish = step.finish

    def to_json(self, index: int, state, body, ids, prompt_text) -> dict:
        echo = prompt_text if body.echo else ""
        names = _names(state, body)
        logprobs = None
        if body.logprobs is not None:
            k = body.logprobs
            logprobs = _completion_logprobs(names, _token_entries(self.events), k, len(echo))
            if body.echo:
                prompt_lp = _completion_logprobs(names, _prompt_entries(ids, self.scores), k, 0)
                logprobs = {key: prompt_lp[key] + logprobs[key] for key in logprobs}
        choice = {"index": index, "text": echo + "".join(self.text), "logprobs": logprobs,
                  "finish_reason": _finish_reason(self.finish, 0)}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(names, ids, self.scores, body.prompt_logprobs)
        if body.return_token_ids:  # vLLM's: with echo, token_ids covers the echoed prompt too
            out_ids = [ev.token_id for ev in self.events]
            choice["token_ids"] = list(ids) + out_ids if body.echo else out_ids
            choice["prompt_token_ids"] = list(ids)
        return choice


async def _completion_stream(state, rid, prepared, steps, per_prompt, model, body, include_usage,
                             running=None):
    created = int(time.time())
    names = _names(state, body)
    n_lp = body.logprobs
    total = len(prepared) * per_prompt
    head = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": state.system_fingerprint}
    # vLLM's return_token_ids: a choice's first chunk carries its prompt's ids,
    # every chunk the ids of the tokens it writes (an echo's, the prompt's)
    token_ids = bool(body.return_token_ids)
    unsent = [list(prepared[i // per_prompt][0]) if body.echo else [] for i in range(total)]
    prompt_sent = [False] * total

    def chunk(index, text, finish_reason=None, logprobs=None):
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if token_ids:
            if not prompt_sent[index]:
                choice["prompt_token_ids"] = list(prepared[index // per_prompt][0])
                prompt_sent[index] = True
            choice["token_ids"], unsent[index] = unsent[index], []
        out = {**head, "choices": [choice]}
        if running is not None:
            out["usage"] = running.of(index)
        return data_event(out)

    echo = [prepared[i // per_prompt][1] if body.echo else "" for i in range(total)]
    offset = [len(e) for e in echo]

    def step_chunks(i, step):
        if running is not None:
            running.step(i, step)
        first = step.token or step.finish
        if first is None:
            return
        failed = step.finish is not None and step.finish.finish_reason == "error"
        if echo[i]:  # with logprobs the echo waits for the prompt's scores: they ride on the first event
            if not failed:
                ids = prepared[i // per_prompt][0]
                yield chunk(i, echo[i], logprobs=_completion_logprobs(
                    names, _prompt_entries(ids, first.prompt_logprobs), n_lp, 0))
            echo[i] = ""
        text = "".join(p.text for p in step.pieces if isinstance(p, ContentDelta))
        lp = None
        if step.token is not None:
            if token_ids:
                unsent[i].append(step.token.token_id)
            if n_lp is not None:
                lp = _completion_logprobs(names, _token_entries([step.token]), n_lp, offset[i])
        if text or lp is not None or (unsent[i] and step.finish is None):
            yield chunk(i, text, logprobs=lp)
        offset[i] += len(text)
        if step.finish is not None and not failed:
            yield chunk(i, "", finish_reason=_finish_reason(step.finish, 0))

    def usage_event(finishes):
        groups = [finishes[g * per_prompt:(g + 1) * per_prompt] for g in range(len(prepared))]
        return data_event({**head, "choices": [], "usage": _usage(groups)})

    if n_lp is None:
        for i in range(total):
            if echo[i]:
                yield chunk(i, echo[i])
                echo[i] = ""
    async with aclosing(_sse_choices(steps, total, step_chunks, usage_event if include_usage else None)) as sse:
        async for c in sse:
            yield c


@router.get("/v1/models")
async def list_models(request: Request):
    state = state_of(request)
    return {"object": "list", "data": [_model_card(state, state.settings.model_name)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    state = state_of(request)
    if model_id not in state.served_names:
        raise APIError(404, f"the model '{model_id}' does not exist; this server serves "
                       + ", ".join(f"'{n}'" for n in state.served_names),
                       "not_found_error", param="model", code="model_not_found")
    return _model_card(state, model_id)


def _model_card(state, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "mlxfast",
            "max_model_len": state.max_model_len if state.engine is not None else None,
            "has_chat_template": state.has_chat_template}
