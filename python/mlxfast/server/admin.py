"""Operational routes: /health, /metrics, /stats, /tokenize, /detokenize,
POST /admin/cache/flush."""

from __future__ import annotations

import asyncio
import math
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from . import chat
from . import generation as gen
from . import metrics as prom
from .common import off_loop, ready_body, state_of
from .errors import bad_request
from .schemas import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.get("/health")
@router.get("/v1/health", include_in_schema=False)  # llama.cpp's server answers both
async def health(request: Request):
    state = state_of(request)
    if state.status == "loading":
        return JSONResponse({"status": "loading"}, status_code=503)
    if state.status == "failed":
        return JSONResponse({"status": "error", "error": state.load_error}, status_code=503)
    if state.status == "stopping":
        return JSONResponse({"status": "stopping"}, status_code=503)
    if not state.engine_alive():
        err = state.engine.error if state.engine is not None else None
        return JSONResponse({"status": "error", "error": f"engine stopped: {err or 'unknown'}"}, status_code=503)
    channel = getattr(state.engine, "channel", None)
    if channel is not None:  # tensor parallelism: every rank answered rank 0 this long ago (a heartbeat)
        return {"status": "ok", "tensor_parallel_size": channel.size,
                "ranks_last_contact_s": round(time.monotonic() - channel.last_contact, 3)}
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    state = state_of(request)
    return Response(prom.render(state.metrics_registry), media_type=prom.CONTENT_TYPE)


def _jsonable(v):
    """Engine stats as strict JSON (inf bucket bounds become "+Inf")."""
    if isinstance(v, float) and not math.isfinite(v):
        return "+Inf" if v > 0 else ("-Inf" if v < 0 else None)
    if isinstance(v, dict):
        return {str(_jsonable(k)) if not isinstance(k, str) else k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return [_jsonable(x) for x in sorted(v)]
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return str(v)


@router.get("/stats")
async def stats(request: Request):
    state = state_of(request)
    engine_stats = state.engine_stats()
    return {
        "model": state.settings.model_name,
        "status": state.status if state.engine_alive() or state.status != "ready" else "error",
        "max_model_len": state.max_model_len if state.engine is not None else None,
        "has_chat_template": state.has_chat_template,
        "tensor_parallel_size": engine_stats.get("tensor_parallel_size"),
        "metrics": prom.values(engine_stats),
        "engine": _jsonable(engine_stats),
    }


MAX_FLUSH_TIMEOUT_S = 86400  # a day; a wait past the clock's range was an internal error


@router.post("/admin/cache/flush")
async def cache_flush(request: Request):
    """Write every cached KV block to the SSD tier and wait until it is durable:
    200 ``{durable: true, ...counters}``, else 503 with the counters."""
    state = state_of(request)
    engine = state.require_ready()
    try:
        timeout = float(request.query_params.get("timeout", 60))
    except ValueError:
        timeout = math.nan
    if not 0 <= timeout <= MAX_FLUSH_TIMEOUT_S:  # NaN too
        raise bad_request(f"timeout must be a number of seconds from 0 to {MAX_FLUSH_TIMEOUT_S}", "timeout")
    result = await asyncio.to_thread(engine.flush_cache, timeout)
    return JSONResponse(_jsonable(result), status_code=200 if result.get("durable") else 503)


@router.post("/tokenize")
async def tokenize(request: Request):
    state, body = await ready_body(request, TokenizeRequest)
    tok = state.tokenizer
    if body.prompt is not None and body.content is not None:
        raise bad_request("give 'prompt' or 'content' (llama.cpp's name for it), not both", "content")
    text = body.prompt if body.prompt is not None else body.content
    if (text is None) == (body.messages is None):
        raise bad_request("give exactly one of 'prompt' or 'messages'")
    special = body.add_special_tokens if body.add_special_tokens is not None else body.add_special
    if special is None:
        special = body.content is None  # vLLM adds them by default, llama.cpp does not

    def encode():
        if text is not None:
            return tok.encode(text, add_special_tokens=special)
        from .openai import normalize_messages
        from .prompts import template_kwargs_for

        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        prompt, _ = chat.render(state, chat.ChatRequest(
            messages=normalize_messages(body.messages), sampling=None, tools=tools,
            template_kwargs=template_kwargs_for(None, body.chat_template_kwargs),
            add_generation_prompt=body.add_generation_prompt is not False,
            continue_final_message=bool(body.continue_final_message)))
        return prompt.ids

    ids = await off_loop(encode)
    strs = [tok.id_to_token(i) for i in ids]
    tokens = ids
    if body.with_pieces:
        tokens = []
        for i in ids:
            piece, raw = gen.token_text(tok, i)
            tokens.append({"id": i, "piece": piece if "\ufffd" not in piece else raw})
    return {"tokens": tokens, "count": len(ids), "max_model_len": state.max_model_len, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(request: Request):
    state, body = await ready_body(request, DetokenizeRequest)
    vocab = state.model_vocab_size
    for t in body.tokens:
        if not 0 <= t < min(vocab, state.tokenizer.vocab_size):
            raise bad_request(f"token id {t} is outside the vocabulary", "tokens")
    text = state.tokenizer.decode(body.tokens)
    return {"prompt": text, "content": text}  # vLLM's name, llama.cpp's
