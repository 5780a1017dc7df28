"""Per-row sampling for a whole step, vectorised over the batch.

Each sampled row carries its request's ``SamplingParams``; the processing
chain runs as a fixed number of MLX ops over ``[R, V]`` whatever mix of
settings the rows have (rows that do not use a feature get its neutral value):

1. repetition penalty (HF: over prompt + output; logits > 0 divided, < 0
   multiplied), presence and frequency penalties (OpenAI: over the output),
2. ``logit_bias``,
3. the structured-output mask (llguidance bitmask; banned tokens -> -inf),
   and the stop and EOS tokens of a row short of its ``min_tokens``,
4. greedy rows (``temperature == 0``) take the argmax here; the others divide
   by temperature, apply top-k, then top-p (on the top-k renormalised
   distribution), then min-p, and sample by Gumbel-max with noise from a
   per-row key derived from ``(seed, output index)`` only — so a seeded
   request samples the same tokens alone or inside any batch. Step 4 is
   ``ops.sample_tokens``: one native primitive on the CPU (no vocabulary
   sort; noise only for tokens that can still win), the pure-MLX
   ``sample_tokens_reference`` elsewhere.

Logprobs are reported from the model's own distribution: the log-softmax of
the raw logits, before penalties, bias, masks, temperature and truncation
(vLLM's default "raw logprobs"; OpenAI documents logprobs as the model's).

One ``mx.eval`` and one host transfer per step. Steps 1-4 are ``choose``
(lazy), which one-sequence generation (``generation.py``: ``mlxfast.generate``,
``mlxfast generate``) calls too, so the library draws the engine's tokens.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .. import ops
from .api import PromptLogprob, SamplingParams

MAX_TOP_LOGPROBS = 20


@dataclass(eq=False)
class SamplingState:
    """Per-request sampling state (lives as long as the request)."""

    params: SamplingParams
    tokens: list[int]  # the sequence's prompt + output ids (shared, appended to)
    prompt_len: int
    seed: int
    matcher: object | None = None  # llguidance.LLMatcher
    stop_ids: tuple[int, ...] = ()  # the tokens that end it (not sampled before params.min_tokens)

    @classmethod
    def create(cls, params: SamplingParams, tokens: list[int], prompt_len: int, stop_ids=()):
        check_params(params)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        matcher = params.grammar() if params.grammar is not None else None
        if matcher is not None and matcher.is_error():
            raise ValueError(f"invalid grammar: {matcher.get_error()}")
        return cls(params, tokens, prompt_len, seed, matcher, tuple(sorted(stop_ids)))

    def bans_stops(self, ahead: int = 0) -> bool:
        """Whether the position ``ahead`` past the next one must not end
        the output (``min_tokens``; a grammar row's grammar decides)."""
        return (self.step + ahead < self.params.min_tokens and bool(self.stop_ids)
                and self.matcher is None)

    @property
    def step(self) -> int:
        return len(self.tokens) - self.prompt_len


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")


def check_params(p: SamplingParams) -> None:
    """Values the native sampler can hold (a ValueError ends only this request)."""
    if not 0 <= p.top_k < (1 << 31):
        raise ValueError(f"top_k must be within [0, 2^31), got {p.top_k}")
    for name in _FLOAT_FIELDS:
        if not np.isfinite(getattr(p, name)):
            raise ValueError(f"{name} must be finite, got {getattr(p, name)}")
    if not 0 <= p.min_tokens < (1 << 31):
        raise ValueError(f"min_tokens must be within [0, 2^31), got {p.min_tokens}")
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be within [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}")
    if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"prompt_logprobs must be within [0, {MAX_TOP_LOGPROBS}], got {p.prompt_logprobs}")


@dataclass
class Sampled:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None  # this row failed (e.g. its grammar); the request ends


def head_choice_ok(state: SamplingState) -> bool:
    """Whether each token of this request is the argmax of the raw logits
    (greedy, no processing, stop tokens never banned) and nothing else is
    read from them (no logprobs): then the model's head may compute that
    choice itself (``Runner.run(argmax=True)``, ``chosen``)."""
    p = state.params
    return (p.temperature <= 0 and p.repetition_penalty == 1 and not p.presence_penalty
            and not p.frequency_penalty and not p.logit_bias and state.matcher is None
            and not (p.min_tokens and state.stop_ids) and not p.logprobs and not p.top_logprobs)


def row_key(seed: int, step: int) -> tuple[int, int]:
    d = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(d[:4], "little"), int.from_bytes(d[4:], "little")


def _grammar_mask(states: list[SamplingState], V: int, errors: list[str | None]) -> np.ndarray | None:
    rows = [i for i, s in enumerate(states) if s.matcher is not None]
    if not rows:
        return None
    allowed = np.ones((len(states), V), bool)
    for i in rows:
        m = states[i].matcher
        try:
            if m.is_error():
                errors[i] = f"grammar error: {m.get_error()}"
                continue
            bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        except Exception as e:  # noqa: BLE001  (this row's grammar; the others go on)
            errors[i] = f"grammar error: {type(e).__name__}: {e}"
            continue
        row = np.unpackbits(bits, bitorder="little").astype(bool)
        n = min(V, row.size)
        allowed[i, :n] = row[:n]
        allowed[i, n:] = False
        if not allowed[i].any():
            errors[i] = "grammar allows no token"
            allowed[i] = True
    return allowed


def choose(logits: mx.array, states: list[SamplingState], ahead: list[int] | None = None,
           errors: list[str | None] | None = None) -> mx.array:
    """The token each row of ``logits [R, V]`` samples (steps 1-4 above), as
    an unevaluated ``[R]`` array. The one choice of tokens: ``sample`` (the
    engine's step) and one-sequence generation (``generation.py``, which
    builds its next model step on this lazy token) both call it, so a request
    draws the same tokens through the library and the server. ``ahead`` as in
    ``sample``; a grammar row's error goes to ``errors[r]``."""
    R, V = logits.shape
    ahead = ahead or [0] * R
    errors = errors if errors is not None else [None] * R
    ps = [s.params for s in states]
    x = logits.astype(mx.float32)
    plain = all(p.temperature <= 0 and p.repetition_penalty == 1 and not p.presence_penalty
                and not p.frequency_penalty and not p.logit_bias and s.matcher is None
                and not s.bans_stops(a) for p, s, a in zip(ps, states, ahead))
    if plain:
        return mx.argmax(x, axis=-1)
    x = _process(x, states, ps, V, errors, ahead)
    temps = np.array([p.temperature for p in ps], np.float32)
    if (temps <= 0).all():
        return mx.argmax(x, axis=-1)
    keys = mx.array(np.array([row_key(s.seed, s.step + a) for s, a in zip(states, ahead)], np.uint32))
    return ops.sample_tokens(x, keys, temps, [p.top_k for p in ps], [p.top_p for p in ps],
                             [p.min_p for p in ps])


def sample(logits: mx.array, states: list[SamplingState], ahead: list[int] | None = None) -> list[Sampled]:
    """Pick one token per row of ``logits [R, V]`` (``choose``) and report it;
    ``states[r]`` is row r's request. ``ahead[r]`` > 0 samples the position
    that many tokens past the request's next one (verifying draft tokens): its
    noise is that position's, so it draws what decoding would draw there (the
    processing must not depend on the tokens in between:
    ``spec.speculation_allowed``; a grammar row samples only the position after
    its forced tokens, its grammar advanced past them)."""
    return sample_async(logits, states, ahead).collect()


def sample_async(logits: mx.array, states: list[SamplingState],
                 ahead: list[int] | None = None) -> "PendingSample":
    """``sample`` in two halves: the draw's graph, queued for evaluation now,
    and ``collect()``, which waits for it. In between the engine builds the
    next step's graph on ``PendingSample.tokens`` (still lazy)."""
    R, V = logits.shape
    ps = [s.params for s in states]
    errors: list[str | None] = [None] * R
    want_lp = any(p.logprobs or p.top_logprobs for p in ps)
    x = logits.astype(mx.float32)
    raw_lp = x - mx.logsumexp(x, axis=-1, keepdims=True) if want_lp else None
    tok = choose(x, states, ahead, errors)

    outs = [tok]
    k_top = min(MAX_TOP_LOGPROBS, max((p.top_logprobs for p in ps), default=0))
    if want_lp:
        outs.append(mx.take_along_axis(raw_lp, tok[:, None], axis=-1)[:, 0])
        if k_top > 0:
            top_idx = mx.argpartition(-raw_lp, kth=k_top - 1, axis=-1)[:, :k_top]
            outs += [top_idx, mx.take_along_axis(raw_lp, top_idx, axis=-1)]
    mx.async_eval(*outs)
    return PendingSample(states, errors, outs, want_lp, k_top)


def chosen(tokens: mx.array, states: list[SamplingState]) -> "PendingSample":
    """``sample_async`` for a step whose head chose its rows' tokens
    (``head_choice_ok`` rows: the argmax ``choose`` would take)."""
    mx.async_eval(tokens)
    return PendingSample(states, [None] * len(states), [tokens], False, 0)


@dataclass(eq=False)
class PendingSample:
    states: list[SamplingState]
    errors: list[str | None]
    outs: list[mx.array]  # tokens [R], then (with logprobs) their logprobs and the top k
    want_lp: bool
    k_top: int

    @property
    def tokens(self) -> mx.array:
        """The drawn tokens ``[R]`` (lazy until ``collect``)."""
        return self.outs[0]

    def collect(self) -> list[Sampled]:
        """Wait for the draw; report each row's token (a grammar row's
        matcher consumes it)."""
        outs, want_lp = self.outs, self.want_lp
        toks = outs[0].tolist()
        lps = outs[1].tolist() if want_lp else None
        tops = (outs[2].tolist(), outs[3].tolist()) if want_lp and self.k_top > 0 else None
        result = []
        for i, s in enumerate(self.states):
            p = s.params
            r = Sampled(int(toks[i]), error=self.errors[i])
            if p.logprobs or p.top_logprobs:
                r.logprob = float(lps[i])
            if tops is not None and p.top_logprobs > 0:
                pairs = sorted(zip(tops[0][i], tops[1][i]), key=lambda t: -t[1])
                r.top_logprobs = [(int(t), float(v)) for t, v in pairs[:p.top_logprobs]]
            if s.matcher is not None and r.error is None:
                try:
                    if not s.matcher.consume_token(r.token) or s.matcher.is_error():
                        r.error = f"grammar error: {s.matcher.get_error() or 'token rejected'}"
                except Exception as e:  # noqa: BLE001
                    r.error = f"grammar error: {type(e).__name__}: {e}"
            result.append(r)
        return result


def _process(x: mx.array, states, ps, V: int, errors, ahead) -> mx.array:
    R = len(ps)
    rep = np.array([p.repetition_penalty for p in ps], np.float32)
    pres = np.array([p.presence_penalty for p in ps], np.float32)
    freq = np.array([p.frequency_penalty for p in ps], np.float32)
    if (rep != 1).any():
        seen = np.zeros((R, V), bool)
        for i, s in enumerate(states):
            if rep[i] != 1 and s.tokens:
                ids = np.asarray(s.tokens, np.int64)
                seen[i, ids[(ids >= 0) & (ids < V)]] = True
        r = mx.array(rep[:, None])
        x = mx.where(mx.array(seen), mx.where(x > 0, x / r, x * r), x)
    if pres.any() or freq.any():
        counts = np.zeros((R, V), np.float32)
        for i, s in enumerate(states):
            if (pres[i] or freq[i]) and s.step > 0:
                ids = np.asarray(s.tokens[s.prompt_len:], np.int64)
                ids = ids[(ids >= 0) & (ids < V)]
                np.add.at(counts[i], ids, 1.0)
        c = mx.array(counts)
        x = x - mx.array(pres[:, None]) * (c > 0) - mx.array(freq[:, None]) * c
    if any(p.logit_bias for p in ps):
        bias = np.zeros((R, V), np.float32)
        for i, p in enumerate(ps):
            for t, b in p.logit_bias.items():
                if 0 <= int(t) < V:
                    bias[i, int(t)] += float(b)
        x = x + mx.array(bias)
    allowed = _grammar_mask(states, V, errors)
    banned = [i for i, (s, a) in enumerate(zip(states, ahead)) if s.bans_stops(a)]
    if banned:
        if allowed is None:
            allowed = np.ones((R, V), bool)
        for i in banned:
            ids = [t for t in states[i].stop_ids if 0 <= t < V]
            allowed[i, ids] = False
    if allowed is not None:
        x = mx.where(mx.array(allowed), x, -mx.inf)
    return x


def score_tokens(logits: mx.array, targets: list[int], k: int) -> list[PromptLogprob]:
    """Score ``targets[i]`` under row i of ``logits [n, V]`` (the raw
    log-softmax, as ``sample`` reports): its logprob, its rank and the k best
    tokens of the row. One ``mx.eval``."""
    x = logits.astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    tlp = mx.take_along_axis(lp, mx.array(np.array(targets, np.int32))[:, None], axis=-1)
    outs = [tlp[:, 0], mx.sum(lp >= tlp, axis=-1)]
    if k > 0:
        top_idx = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
        outs += [top_idx, mx.take_along_axis(lp, top_idx, axis=-1)]
    mx.eval(*outs)
    lps, ranks = outs[0].tolist(), outs[1].tolist()
    tops = [[] for _ in targets]
    if k > 0:
        tops = [sorted(zip(map(int, ids), map(float, vals)), key=lambda t: -t[1])
                for ids, vals in zip(outs[2].tolist(), outs[3].tolist())]
    return [PromptLogprob(float(v), int(r), top) for v, r, top in zip(lps, ranks, tops)]
