"""One-shot generation for the library API and ``mlxfast generate``.

A single sequence on a contiguous KV cache: the simplest correct path, and
the reference the batching engine is tested against. It shares the engine's
prompt rendering (``text/prompt.py``) and token choice (``engine.sampler.choose``:
processing, then Gumbel-max noise keyed by (seed, output index)), so a
request gives the same tokens here as through the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx

from .engine.api import SamplingParams
from .engine.sampler import SamplingState, choose
from .kv import DenseKVCache
from .text.prompt import render_chat, text_ids


@dataclass
class GenerationChunk:
    text: str
    token: int | None
    finish_reason: str | None = None  # "stop" | "length" when done


NO_TEMPLATE_MESSAGE = (
    "this model has no chat template: give it one (tokenizer.chat_template = text, or "
    "`mlxfast generate --chat-template FILE`), or pass chat=False (`--no-chat`) for a raw prompt")


def prompt_ids(tokenizer, prompt, chat: bool) -> list[int]:
    """Token ids for ``prompt``: ids as given, else chat messages (or one
    user message) rendered as the server's chat APIs render them when
    ``chat``, else the raw text as ``/v1/completions`` encodes it. A chat
    prompt for a model without a template raises ``ValueError`` (no format is
    guessed)."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], int):
        return list(prompt)
    if chat:
        if not tokenizer.chat_template:
            raise ValueError(NO_TEMPLATE_MESSAGE)
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return render_chat(tokenizer, messages).ids
    return text_ids(tokenizer, prompt)


def stream_generate(
    model,
    tokenizer,
    prompt,
    *,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    seed: int | None = None,
    chat: bool = True,
    prefill_step: int = 512,
) -> Iterator[GenerationChunk]:
    """Yield text as it is produced; the last chunk carries ``finish_reason``.

    ``prompt`` is a string, a list of chat messages, or a list of token ids.
    The sampling arguments mean what the server's fields do (``temp`` is
    ``temperature``; ``top_k`` 0 or negative and ``top_p`` 1 are off), and a
    seeded request draws the server's tokens.
    """
    ids = prompt_ids(tokenizer, prompt, chat)
    if not ids:
        raise ValueError("the prompt is empty")
    params = SamplingParams(
        max_tokens=max_tokens, temperature=float(temp), top_p=float(top_p),
        top_k=max(int(top_k), 0), min_p=float(min_p), repetition_penalty=float(repetition_penalty),
        presence_penalty=float(presence_penalty), frequency_penalty=float(frequency_penalty), seed=seed)
    # The sequence so far (prompt + output): the penalties read it and the
    # draw's noise is keyed by the output index.
    state = SamplingState.create(params, list(ids), len(ids))
    if max_tokens <= 0:
        yield GenerationChunk("", None, "length")
        return
    cache = DenseKVCache.for_model(model)
    eos = tokenizer.eos_token_ids
    detok = tokenizer.detokenizer()

    # Prefill in chunks; only the last position's logits are needed.
    pos = 0
    while len(ids) - pos > prefill_step:
        model(mx.array([ids[pos:pos + prefill_step]]), cache, logit_rows=mx.array([0]))
        cache.advance(prefill_step)
        mx.eval(cache.state_arrays())
        pos += prefill_step
    chunk = ids[pos:]
    logits = model(mx.array([chunk]), cache, logit_rows=mx.array([len(chunk) - 1]))
    cache.advance(len(chunk))

    for n in range(max_tokens):
        token = choose(logits, [state])  # [1], lazy: the next step is built on it
        mx.async_eval(token)
        if n < max_tokens - 1:
            # Build step n+1's graph while step n runs, but queue it only
            # once token n is known: queued earlier, its KV writes would see
            # the pools still referenced by step n and copy them.
            logits = model(token.reshape(1, 1), cache, logit_rows=mx.array([0]))
            cache.advance(1)
        tok = token.item()
        state.tokens.append(tok)
        if tok in eos:
            yield GenerationChunk(detok.flush(), tok, "stop")
            return
        if n == max_tokens - 1:
            yield GenerationChunk(detok.add(tok) + detok.flush(), tok, "length")
            return
        mx.async_eval(logits)
        text = detok.add(tok)
        yield GenerationChunk(text, tok)


def generate(model, tokenizer, prompt, **kwargs) -> str:
    """The whole completion as one string."""
    return "".join(c.text for c in stream_generate(model, tokenizer, prompt, **kwargs))
