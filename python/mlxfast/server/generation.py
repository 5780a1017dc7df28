"""One request through the engine, shared by every API: submit, turn engine
events into parsed output (``chat.py``'s typed events), record metrics, and
abort the request if the client goes away."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..engine.api import (
    EngineDead,
    EngineOverloaded,
    FinishEvent,
    PromptTooLong,
    Request,
    SamplingParams,
    TokenEvent,
)
from .errors import APIError, bad_request
from .events import ContentDelta
from .sse import HEARTBEAT, with_heartbeat
from .state import ServerState


@dataclass
class Step:
    """What one engine event produced after parsing."""

    pieces: list = field(default_factory=list)  # chat.ContentDelta | ReasoningDelta | tool-call events
    token: TokenEvent | None = None
    reasoning: bool = False  # the token was written inside the model's reasoning
    finish: FinishEvent | None = None
    heartbeat: bool = False


def context_overflow(n_prompt: int, max_len: int, param: str = "messages") -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {max_len} tokens; the prompt has "
        f"{n_prompt} tokens, leaving no room to generate.",
        "invalid_request_error", param=param, code="context_length_exceeded",
    )


def cap_max_tokens(state: ServerState, n_prompt: int, requested: int | None, param: str = "messages") -> int:
    """The request's max_tokens, capped to the room the context leaves;
    a 400 (naming the prompt's field, ``param``) when the prompt alone fills
    the context."""
    max_len = state.max_model_len
    if n_prompt >= max_len:
        raise context_overflow(n_prompt, max_len, param)
    want = requested if requested is not None else state.settings.default_max_tokens
    room = max_len - n_prompt
    return max(1, min(want, room)) if want is not None else room


def truncate_prompt(state: ServerState, ids: list[int], body) -> list[int]:
    """vLLM's ``truncate_prompt_tokens`` (where the body's API has it): only
    the prompt's last k tokens, or with -1 as many as the context holds."""
    k = getattr(body, "truncate_prompt_tokens", None) \
        if "truncate_prompt_tokens" in getattr(type(body), "model_fields", ()) else None
    if k is None:
        return ids
    if k == -1:
        k = state.max_model_len
    elif k > state.max_model_len:
        raise bad_request(f"truncate_prompt_tokens ({k}) is more than the model's context "
                          f"({state.max_model_len} tokens)", "truncate_prompt_tokens")
    return ids[len(ids) - k:] if len(ids) > k else ids


def sampling_params(state: ServerState, body, max_tokens: int, *, stop=None, logprobs=False,
                    top_logprobs=0, grammar=None) -> SamplingParams:
    """SamplingParams from the OpenAI-style fields of ``body`` (and server defaults)."""
    s = state.settings
    declared = getattr(type(body), "model_fields", None)

    def field(name):
        """A field of the body's API; an undeclared one (kept by extra="allow",
        unvalidated) is ignored, as unknown fields are."""
        return getattr(body, name, None) if declared is None or name in declared else None

    def pick(name, default):
        v = field(name)
        return default if v is None else v

    temperature = pick("temperature", s.default_temperature if s.default_temperature is not None else 1.0)
    top_p = pick("top_p", s.default_top_p if s.default_top_p is not None else 1.0)
    top_k = pick("top_k", s.default_top_k if s.default_top_k is not None else 0)
    vocab = state.model_vocab_size
    if top_k < 0 or top_k >= vocab:  # -1 (vLLM) or a k that keeps every token: off
        top_k = 0
    bias: dict[int, float] = {}
    for k, v in (field("logit_bias") or {}).items():
        tid = int(k)
        if not 0 <= tid < vocab:
            raise bad_request(f"logit_bias token id {tid} is outside the vocabulary (size {vocab})", "logit_bias")
        bias[tid] = float(v)
    stop_ids = set(field("stop_token_ids") or [])
    for tid in stop_ids:
        if not 0 <= tid < vocab:
            raise bad_request(f"stop_token_ids: {tid} is outside the vocabulary (size {vocab})", "stop_token_ids")
    if isinstance(stop, str):
        stop = [stop]
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        min_p=float(pick("min_p", 0.0)),
        repetition_penalty=float(pick("repetition_penalty", 1.0)),
        presence_penalty=float(pick("presence_penalty", 0.0)),
        frequency_penalty=float(pick("frequency_penalty", 0.0)),
        logit_bias=bias,
        seed=field("seed"),
        stop=list(stop or []),
        stop_token_ids=stop_ids,
        ignore_eos=bool(field("ignore_eos")),
        min_tokens=min(int(field("min_tokens") or 0), max_tokens),
        include_stop_str_in_output=bool(field("include_stop_str_in_output")),
        skip_special_tokens=pick("skip_special_tokens", True),
        logprobs=bool(logprobs),
        top_logprobs=int(top_logprobs or 0),
        grammar=grammar,
    )


class PlainText:
    """The output parser of a text completion: all content."""

    in_reasoning = False

    def feed(self, text: str) -> list:
        return [ContentDelta(text)] if text else []

    def finish(self, text: str = "") -> list:
        return self.feed(text)


def submit(state: ServerState, request: Request):
    """engine.submit with its failures mapped to API errors."""
    engine = state.require_ready()
    try:
        return engine.submit(request)
    except PromptTooLong as e:
        raise APIError(400, str(e) or "the prompt does not fit the context",
                       "invalid_request_error", param="messages", code="context_length_exceeded") from None
    except EngineOverloaded as e:
        raise APIError(429, str(e) or "the server is busy; retry later", "rate_limit_error",
                       headers={"Retry-After": str(state.settings.retry_after_s)}) from None
    except EngineDead as e:
        raise APIError(503, f"the engine has stopped: {e}", "server_error") from None


async def run(
    state: ServerState,
    request: Request,
    parser,
    *,
    http_request=None,
    heartbeat_s: float | None = None,
) -> AsyncIterator[Step]:
    """Submit ``request`` (errors raise before the first yield) and yield a
    Step per engine event; the last Step carries the FinishEvent. With
    ``heartbeat_s``, empty heartbeat Steps come during silences (and a
    disconnected ``http_request`` aborts the request). Leaving the iteration
    early aborts the request in the engine."""
    stream = submit(state, request)
    return _steps(state, request, stream, parser, http_request, heartbeat_s)


async def _steps(state, request, stream, parser, http_request, heartbeat_s):
    finished = False
    # A disconnected client is looked for every heartbeat_s whether tokens
    # flow or not: polled only on heartbeats (silences), a request whose
    # client had gone kept generating to its max_tokens while tokens came.
    poll_at = time.monotonic() + heartbeat_s if http_request is not None and heartbeat_s else None
    try:
        source = with_heartbeat(stream, heartbeat_s) if heartbeat_s else stream
        async for ev in source:
            if poll_at is not None and (ev is HEARTBEAT or time.monotonic() >= poll_at):
                if await http_request.is_disconnected():
                    return
                poll_at = time.monotonic() + heartbeat_s
            if ev is HEARTBEAT:
                yield Step(heartbeat=True)
                continue
            if isinstance(ev, TokenEvent):
                reasoning = parser.in_reasoning
                yield Step(pieces=parser.feed(ev.text), token=ev, reasoning=reasoning)
            elif isinstance(ev, FinishEvent):
                finished = True
                yield Step(pieces=parser.finish(ev.text or ""), finish=ev)
                return
        # The stream ended without a FinishEvent: treat as an engine failure.
        finished = True
        yield Step(pieces=parser.finish(""), finish=FinishEvent(
            "error", error="the engine ended the request without finishing it",
            prompt_tokens=len(request.prompt_ids)))
    finally:
        if not finished:
            try:
                state.engine.abort(request.request_id)
            except Exception:
                pass


def fan_out(request: Request, n: int) -> list[Request]:
    """``n`` copies of ``request`` sampled independently (OpenAI's ``n``): ids
    ``<id>-<i>``, seeds ``seed + i`` when seeded, so a seeded ``n`` is
    reproducible and each choice equals the single request with its seed."""
    if n == 1:
        return [request]
    out = []
    for i in range(n):
        seed = None if request.params.seed is None else request.params.seed + i
        out.append(dataclasses.replace(request, request_id=f"{request.request_id}-{i}",
                                       params=dataclasses.replace(request.params, seed=seed)))
    return out


async def run_many(state: ServerState, requests: list[Request], parsers: list, *,
                   http_request=None, heartbeat_s: float | None = None) -> AsyncIterator[tuple[int, Step]]:
    """``run`` for requests that share one prompt, yielding ``(index, Step)``.
    The first runs alone until its first event, when its prompt's blocks are
    in the prefix cache; then the others start and reuse them, so the prompt
    is prefilled once. The first submission's errors raise here; a later
    one's raise from the iteration."""
    kw = {"http_request": http_request, "heartbeat_s": heartbeat_s}
    first = await run(state, requests[0], parsers[0], **kw)
    if len(requests) == 1:
        return _indexed(first)

    async def the_rest():
        rest = []
        try:
            for j in range(1, len(requests)):
                rest.append((j, _indexed(await run(state, requests[j], parsers[j], **kw))))
        except BaseException:
            for _, r in rest:
                await r.aclose()
            raise
        return rest

    return _fan_in([(0, _indexed(first))], later=the_rest)


async def run_groups(state: ServerState, groups: list[list[Request]], parsers: list[list], *,
                     http_request=None, heartbeat_s: float | None = None) -> AsyncIterator[tuple[int, Step]]:
    """``run_many`` for several prompts at once (a batched completion), each
    group its own prompt; indices run over all groups' requests in order."""
    runs = []
    try:
        for requests, ps in zip(groups, parsers):
            runs.append(await run_many(state, requests, ps, http_request=http_request, heartbeat_s=heartbeat_s))
    except BaseException:
        for r in runs:
            await r.aclose()
        raise
    if len(runs) == 1:
        return runs[0]
    offsets = [sum(len(g) for g in groups[:k]) for k in range(len(groups))]
    return _fan_in(list(zip(offsets, runs)))


async def _indexed(steps):
    try:
        async for step in steps:
            yield 0, step
    finally:
        await steps.aclose()


async def _fan_in(sources, later=None):
    """Yield ``(offset + i, step)`` from every ``(offset, source)`` as steps
    come. ``later()``, awaited once at the first step that is not a
    heartbeat, returns more sources. Closing this closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    streams, tasks = [], []

    def add(offset, source):
        async def pump():
            try:
                async for i, step in source:
                    await queue.put((offset + i, step))
            except Exception as e:  # noqa: BLE001  (handed to the consumer)
                await queue.put((offset, e))
            finally:
                await queue.put((offset, done))

        streams.append(source)
        tasks.append(asyncio.ensure_future(pump()))

    for offset, source in sources:
        add(offset, source)
    live = len(tasks)
    try:
        while live:
            i, item = await queue.get()
            if item is done:
                live -= 1
                continue
            if isinstance(item, Exception):
                raise item
            if later is not None and not item.heartbeat:
                more, later = await later(), None
                for offset, source in more:
                    add(offset, source)
                    live += 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for source in streams:
            await source.aclose()


def token_text(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text and UTF-8 bytes, for logprobs."""
    try:
        b = tokenizer.token_bytes(token_id)
    except Exception:
        b = b""
    return b.decode("utf-8", errors="replace"), list(b)


def token_names(tokenizer, as_ids: bool = False):
    """``token id -> (text, bytes)`` for logprobs; with vLLM's
    ``return_tokens_as_token_ids`` every token is named ``token_id:<id>``
    (and its bytes are that name's), so a token whose bytes are not text
    stays identifiable."""
    if not as_ids:
        return functools.partial(token_text, tokenizer)

    def name(token_id: int) -> tuple[str, list[int]]:
        text = f"token_id:{token_id}"
        return text, list(text.encode())
    return name
