"""Runs one scheduled step: plan -> one model call over all of the step's tokens.

Tokens of every scheduled row are flattened into ``[T, 1]`` (T batch rows of
length one), positions go to RoPE per token, and the paged context writes
each token's K/V into its slot and attends it over its own sequence. Logits
are computed only for rows that sample (the last token of each sequence
whose chunk reaches its end, and each draft token after it) and, for a sequence that scores its prompt
(``Seq.score_prompt``), for each position of its chunk that predicts a
prompt token: at most one chunk's worth of vocabulary rows per such row.
A step whose sampled rows are all greedy and read nothing else from their
logits (``sampler.head_choice_ok``) asks the head for its choice instead
(``argmax=True``): the same tokens, most logits never computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..kv.block_pool import KVPool
from ..kv.paged import PagedContext, SeqSlice
from .scheduler import Row, StepPlan


@dataclass
class StepLogits:
    # [sum over plan.sample_rows of 1 + len(row.draft), V] (lazy): per sampled
    # row, its last known token's then each draft token's; None when nothing samples
    sample: mx.array | None
    # (row, logits [m, V]): positions row.start .. row.start + m - 1, which
    # predict prompt tokens row.start + 1 .. row.start + m
    scores: list[tuple[Row, mx.array]] = field(default_factory=list)
    # [as sample's rows] uint32 (lazy): the head's greedy choice, in place of
    # ``sample``, when the step asked for it (Runner.run(argmax=True))
    tokens: mx.array | None = None


class Runner:
    def __init__(self, model, pool: KVPool, native: bool | None = None, channel=None):
        self.model = model
        self.pool = pool
        self.native = native
        # Tensor parallelism (engine/distributed.py): the step's inputs go to
        # the other ranks, which run the same call on their shards.
        self.channel = channel

    def run(self, plan: StepPlan, inputs: mx.array | None = None,
            argmax: bool = False) -> StepLogits:
        """The step's logits (lazy). With none to compute, the KV writes are
        evaluated here. ``inputs`` (``[T]`` ids, lazy) stands for the rows'
        tokens when they are still being sampled (``Scheduler.plan_ahead``).
        ``argmax``: the sampled rows' greedy choice too (``StepLogits.tokens``),
        which the head computes in place of their logits unless the step
        scores a prompt or runs tensor-parallel (the argmax of the logits then)."""
        tokens: list[int] = []
        seqs: list[SeqSlice] = []
        logit_rows: list[int] = []
        sample_at: list[int] = []  # where each sampled row's logits are in logit_rows
        scored: list[tuple[Row, int, int]] = []  # (row, first index in logit_rows, count)
        for r in plan.rows:
            base = len(tokens)
            tokens += r.seq.tokens[r.start:r.start + r.n] if inputs is None else [0] * r.n
            tokens += r.draft
            seqs.append(SeqSlice(r.seq.block_tables, r.start, r.num_tokens))
            if r.seq.score_prompt:
                m = min(r.n, r.seq.prompt_len - 1 - r.start)
                if m > 0:
                    scored.append((r, len(logit_rows), m))
                    logit_rows += range(base, base + m)
            if r.sample:
                first = len(tokens) - 1 - len(r.draft)
                sample_at += range(len(logit_rows), len(logit_rows) + 1 + len(r.draft))
                logit_rows += range(first, len(tokens))
        ctx = PagedContext(self.pool, seqs, native=self.native)
        if inputs is None:
            x = mx.array(np.array(tokens, np.int32)[:, None])  # [T, 1], no Reshape node
        else:
            x = inputs.astype(mx.int32).reshape(len(tokens), 1)
        if self.channel is not None:
            logits = self._run_parallel(tokens, seqs, x, ctx, logit_rows)
        elif not logit_rows:
            self.model(x, ctx, logit_rows=mx.array([0], dtype=mx.int32))
            mx.eval(self.pool.arrays())
        elif argmax and sample_at and not scored:
            rows = mx.array(logit_rows, dtype=mx.int32)
            return StepLogits(None, tokens=self.model(x, ctx, logit_rows=rows, argmax=True))
        else:
            logits = self.model(x, ctx, logit_rows=mx.array(logit_rows, dtype=mx.int32))
        if not logit_rows:
            return StepLogits(None)
        if not scored:
            sample, scores = logits, []
        else:
            sample = logits[mx.array(sample_at, dtype=mx.int32)] if sample_at else None
            scores = [(r, logits[i:i + m]) for r, i, m in scored]
        tokens = mx.argmax(sample, axis=-1) if argmax and sample is not None else None
        return StepLogits(sample, scores, tokens)

    def _run_parallel(self, tokens, seqs, x, ctx, logit_rows):
        """The step on every rank: its inputs broadcast, then the model call
        evaluated here, so that every rank runs all of its all_sums (the
        logits depend on every layer) and a lost rank fails the model call."""
        ch = self.channel
        with ch.guard():
            try:
                ch.send_step(tokens, seqs)
                logits = self.model(x, ctx, logit_rows=mx.array(logit_rows or [0], dtype=mx.int32))
                mx.eval(logits, self.pool.arrays())
            except RuntimeError as e:  # the backend's "connection to a peer was lost"
                raise RuntimeError(f"the tensor-parallel step failed (is a rank gone?): {e}") from e
        return logits
