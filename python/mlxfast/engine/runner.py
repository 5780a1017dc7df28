"""Runs one scheduled step: plan -> one model call over all of the step's tokens.

Tokens of every scheduled row are flattened into ``[T, 1]`` (T batch rows of
length one), positions go to RoPE per token, and the paged context writes
each token's K/V into its slot and attends it over its own sequence. Logits
are computed only for rows that sample (the last token of each sequence
whose chunk reaches its end).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..kv.block_pool import KVPool
from ..kv.paged import PagedContext, SeqSlice
from .scheduler import StepPlan


class Runner:
    def __init__(self, model, pool: KVPool, native: bool | None = None):
        self.model = model
        self.pool = pool
        self.native = native

    def run(self, plan: StepPlan) -> mx.array | None:
        """Logits ``[len(plan.sample_rows), V]`` (lazy), or None when nothing samples
        (then the KV writes are evaluated here)."""
        tokens: list[int] = []
        seqs: list[SeqSlice] = []
        logit_rows: list[int] = []
        for r in plan.rows:
            tokens += r.seq.tokens[r.start:r.start + r.n]
            seqs.append(SeqSlice(r.seq.block_table, r.start, r.n))
            if r.sample:
                logit_rows.append(len(tokens) - 1)
        ctx = PagedContext(self.pool, seqs, native=self.native)
        x = mx.array(np.array(tokens, np.int32)[:, None])  # [T, 1], no Reshape node
        if not logit_rows:
            self.model(x, ctx, logit_rows=mx.array([0], dtype=mx.int32))
            mx.eval(self.pool.arrays())
            return None
        return self.model(x, ctx, logit_rows=mx.array(logit_rows, dtype=mx.int32))
