"""The contract between the HTTP routes and the engine.

Routes build a ``Request`` (token ids + ``SamplingParams``), call
``engine.submit(request)`` and iterate the returned async stream of events:
zero or more ``TokenEvent`` then exactly one ``FinishEvent``. Text in
``TokenEvent.text`` is already detokenized incrementally (never a broken
UTF-8 character) and never contains a stop string or anything after it.
``engine.abort(request_id)`` ends a request early (client disconnect).

Prompt log-probabilities: with ``SamplingParams.prompt_logprobs = k`` the
engine computes every prompt position (it takes no prefix-cache hits for the
prompt) and the request's first event (its first ``TokenEvent``, or its
``FinishEvent`` when no token comes: ``max_tokens == 0``, an immediate stop)
carries ``prompt_logprobs``: one entry per prompt token, ``None`` for the
first, then a ``PromptLogprob`` scoring token i under the model's raw
distribution given tokens < i. No other event carries it; a request that
ends before its prompt is computed (abort, error) gets none.
``max_tokens == 0`` is allowed only with ``prompt_logprobs``: the prompt is
scored, nothing is generated, finish_reason is "length".
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol, runtime_checkable

_ids = itertools.count()


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off (HF semantics, over prompt + output)
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, never emitted
    stop_token_ids: set[int] = field(default_factory=set)  # besides the model's EOS
    ignore_eos: bool = False
    # vLLM's: until this many tokens are out, stop and EOS tokens are not
    # sampled and stop strings do not match (a grammar row ends where its
    # grammar says).
    min_tokens: int = 0
    include_stop_str_in_output: bool = False  # vLLM's: a matched stop string ends the text
    skip_special_tokens: bool = True  # vLLM's: special tokens but parsers' markup leave no text
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20
    prompt_logprobs: int | None = None  # score the prompt, k (0..20) best alternatives per position
    # Structured output: a zero-argument factory returning a fresh
    # llguidance.LLMatcher for this request (None = unconstrained).
    grammar: Callable[[], Any] | None = None


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    cache_salt: str = ""  # isolates prefix-cache sharing between tenants


@dataclass
class PromptLogprob:
    """One prompt token's score, from the log-softmax of the raw logits (as the
    sampler's logprobs for generated tokens)."""

    logprob: float  # log P(token_i | tokens_<i)
    rank: int  # tokens at least as likely, itself included (vLLM's rank; 1 = the argmax)
    top_logprobs: list[tuple[int, float]]  # the k best (token id, logprob), best first


@dataclass
class TokenEvent:
    token_id: int
    text: str  # new text this token made final (may be "")
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first
    prompt_logprobs: list[PromptLogprob | None] | None = None  # first event only (see above)
    cached_tokens: int | None = None  # prompt tokens reused from the prefix cache (so far)


@dataclass
class FinishEvent:
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    text: str = ""  # text released at the end (held-back bytes, flushed)
    stop_string: str | None = None  # the stop string matched, if any
    stop_token_id: int | None = None  # the EOS/stop token that ended it, if any
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    error: str | None = None  # message when finish_reason == "error"
    prompt_logprobs: list[PromptLogprob | None] | None = None  # when it is the first event
    # With speculative decoding on: {"drafted": n, "accepted": m} draft tokens of this request
    speculation: dict | None = None


class EngineDead(RuntimeError):
    """The engine thread has died; /health reports it and new requests fail fast."""


class PromptTooLong(ValueError):
    """The prompt alone does not fit the context or the KV pool (a 400)."""


class EngineOverloaded(RuntimeError):
    """The wait queue is full (a 429/503 with Retry-After)."""


@runtime_checkable
class EngineLike(Protocol):
    """The engine's public surface, what the server depends on (implemented by
    ``engine.engine.Engine``; the route tests' scripted engine implements it too).

        engine = Engine(model, tokenizer, EngineConfig(...)).start()
        stream = engine.submit(request)   # inside a running asyncio loop; raises
                                          # EngineDead, PromptTooLong, EngineOverloaded
        async for event in stream: ...    # TokenEvent* then one FinishEvent
    """

    alive: bool  # False once the engine thread has died or shut down
    error: str | None  # why it died
    max_model_len: int  # the context length in tokens (prompt plus output)

    def submit(self, request: Request) -> AsyncIterator[TokenEvent | FinishEvent]: ...

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request ends with finish reason "abort"."""

    def stats(self) -> dict:
        """Counters for /stats and /metrics."""

    def flush_cache(self, timeout: float = 30.0) -> dict:
        """Make cached KV durable (SSD tier): ``{"durable": bool, ...}``."""

    def shutdown(self, timeout: float | None = 10.0, ssd_flush_timeout: float | None = None) -> None:
        """Abort in-flight requests, join the thread, flush the SSD tier."""
