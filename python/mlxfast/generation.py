"""One-shot generation for the library API and ``mlxfast generate``.

A single sequence on a contiguous KV cache: the simplest correct path, and
the reference the batching engine is tested against.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx

from .kv import DenseKVCache


@dataclass
class GenerationChunk:
    text: str
    token: int | None
    finish_reason: str | None = None  # "stop" | "length" when done


def sample_token(logits: mx.array, temp: float, top_p: float, top_k: int, key) -> mx.array:
    """Pick one token id from logits [V] (greedy when temp == 0)."""
    if temp <= 0:
        return mx.argmax(logits, axis=-1)
    logits = logits.astype(mx.float32) / temp
    if 0 < top_k < logits.shape[-1]:
        kth = mx.sort(logits)[-top_k]
        logits = mx.where(logits < kth, -mx.inf, logits)
    if 0 < top_p < 1:
        order = mx.argsort(-logits)
        probs = mx.softmax(logits[order])
        keep_sorted = (mx.cumsum(probs) - probs) < top_p
        keep = mx.zeros_like(keep_sorted).at[order].add(keep_sorted)
        logits = mx.where(keep, logits, -mx.inf)
    return mx.random.categorical(logits, key=key)


NO_TEMPLATE_MESSAGE = (
    "this model has no chat template: give it one (tokenizer.chat_template = text, or "
    "`mlxfast generate --chat-template FILE`), or pass chat=False (`--no-chat`) for a raw prompt")


def prompt_ids(tokenizer, prompt, chat: bool) -> list[int]:
    """Token ids for ``prompt``: ids as given, else chat messages (or one
    user message) rendered with ``tokenizer.chat_template`` when ``chat``,
    else the raw text. A chat prompt for a model without a template raises
    ``ValueError`` (no format is guessed)."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], int):
        return list(prompt)
    if chat:
        if not tokenizer.chat_template:
            raise ValueError(NO_TEMPLATE_MESSAGE)
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def stream_generate(
    model,
    tokenizer,
    prompt,
    *,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    chat: bool = True,
    prefill_step: int = 512,
) -> Iterator[GenerationChunk]:
    """Yield text as it is produced; the last chunk carries ``finish_reason``.

    ``prompt`` is a string, a list of chat messages, or a list of token ids.
    """
    ids = prompt_ids(tokenizer, prompt, chat)
    if not ids:
        raise ValueError("the prompt is empty")
    if max_tokens <= 0:
        yield GenerationChunk("", None, "length")
        return
    cache = DenseKVCache.for_model(model)
    key = mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
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
        sub = None
        if temp > 0:  # greedy needs no key (a split is graph nodes every step)
            key, sub = mx.random.split(key)
        token = sample_token(logits[0], temp, top_p, top_k, sub)
        mx.async_eval(token)
        if n < max_tokens - 1:
            # Build step n+1's graph while step n runs, but queue it only
            # once token n is known: queued earlier, its KV writes would see
            # the pools still referenced by step n and copy them.
            logits = model(token.reshape(1, 1), cache, logit_rows=mx.array([0]))
            cache.advance(1)
        tok = token.item()
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
