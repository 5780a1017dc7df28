"""Drafts from a second, smaller model (``--draft-model``): same tokenizer,
its own KV pool, run by the engine thread inside the step it drafts for.

Each drafting row keeps the draft model's KV of its sequence in the draft
pool (block tables of its own; no prefix cache). To draft k tokens for a set
of rows: one batched forward catches each row up on the tokens it has not
seen (the prompt at first, then what the last step accepted) and gives the
first draft token; k - 1 more batched one-token forwards give the rest.
Drafts are the draft model's argmax: a deterministic proposal, which the
engine's verification turns into the target's own tokens (greedy or sampled).
After verification the row's draft KV is kept up to the tokens accepted;
rejected positions are overwritten later, as in the target's pool.
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..kv.allocator import BlockAllocator
from ..kv.block_pool import KVPool
from .runner import Runner
from .scheduler import Row, Seq, StepPlan


# A drafting row's unseen tokens in steady state: at most the token sampled
# after its drafts and its last accepted draft (which it had not fed).
STEADY_GAP = 2


class _DraftSeq:
    """A row's state in the draft pool."""

    __slots__ = ("seq", "num_computed")

    def __init__(self, request_id: str):
        self.seq = Seq(request_id, [0], max_tokens=1)  # tokens and block table set per use
        self.seq.block_tables = [[]]
        self.num_computed = 0  # tokens of the target sequence whose draft KV is in the pool


class DraftModel:
    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype, native: bool | None = None,
                 max_catchup: int = 512):
        # Tokens a step's catch-up forward may take (the target's step budget):
        # a row with more to catch up (a long prompt) does so over several
        # steps, drafting once it has.
        self.max_catchup = max_catchup
        # One block table per row: every layer keeps its blocks (windows still
        # apply in attention).
        self.pool = KVPool(model.kv_layers, num_blocks, block_size, kv_dtype, release=False)
        self.alloc = BlockAllocator(num_blocks, block_size, enable_prefix_cache=False)
        self.runner = Runner(model, self.pool, native=native)
        model.prepare_head_choice()  # its forwards take the head's greedy choice
        # This step's forwards, (tokens fed, seconds, steady): the engine's
        # Drafter.step_done takes their time out of the target's step and
        # prices the steady ones (no row fed more than STEADY_GAP tokens; a
        # prompt's catch-up is a one-off per request, not a price of drafting).
        self.forwards: list[tuple[int, float, bool]] = []

    def _state(self, seq) -> _DraftSeq:
        spec = seq.data.spec
        if spec.draft is None:
            spec.draft = _DraftSeq(seq.request_id)
        return spec.draft

    def first_feed(self, seq) -> int:
        """Tokens a row's first drafting forward feeds in steady state: its
        unseen tokens, at most STEADY_GAP (what select prices)."""
        d = seq.data.spec.draft
        gap = len(seq.tokens) - (d.num_computed if d is not None else 0)
        return max(1, min(gap, STEADY_GAP))

    def propose(self, wants: list[tuple[object, int]]) -> list[list[int]]:
        """Up to ``k`` draft tokens for each ``(seq, k)``; a row the draft
        pool has no room for gets none."""
        out: list[list[int]] = [[] for _ in wants]
        rows = []  # (index into wants, draft seq, k)
        behind = []  # rows catching up on a long context: a chunk this step, no drafts yet
        budget = self.max_catchup
        steady = True  # no row catches up on more than STEADY_GAP tokens
        for i, (seq, k) in enumerate(wants):
            if k <= 0:
                continue
            d = self._state(seq)
            d.seq.tokens = list(seq.tokens)
            gap = len(seq.tokens) - d.num_computed
            if gap > budget:
                if budget > 0 and self._room(d, d.num_computed + budget):
                    behind.append(Row(d.seq, d.num_computed, budget, False))
                    d.num_computed += budget
                    steady = False
                budget = 0
                continue
            if not self._room(d, len(seq.tokens) + k - 1):
                continue
            budget -= gap
            steady = steady and gap <= STEADY_GAP
            rows.append((i, d, k))
        if not rows:
            if behind:
                t0 = time.perf_counter()
                self.runner.run(StepPlan(behind))  # evaluated: it computes no logits
                self.forwards.append((sum(r.n for r in behind), time.perf_counter() - t0, False))
            return out
        # One forward catches every row up and gives its first draft token.
        plan = StepPlan(behind + [Row(d.seq, d.num_computed, len(d.seq.tokens) - d.num_computed, True)
                                  for _, d, _ in rows])
        for _, d, _ in rows:
            d.num_computed = len(d.seq.tokens)
        steady = steady and not behind
        drafting = rows  # in the order of the plan's sampled rows
        while drafting:
            t0 = time.perf_counter()
            tokens = self.runner.run(plan, argmax=True).tokens.tolist()
            self.forwards.append((plan.num_tokens, time.perf_counter() - t0, steady))
            steady = True  # the later forwards feed one token a row
            more, live = [], []
            for (i, d, k), tok in zip(drafting, tokens):
                out[i].append(int(tok))
                if len(out[i]) < k:  # it drafts on: the next forward feeds this token
                    d.seq.tokens.append(int(tok))
                    live.append(Row(d.seq, len(d.seq.tokens) - 1, 1, True))
                    more.append((i, d, k))
            drafting, plan = more, StepPlan(live)
        return out

    def _room(self, d: _DraftSeq, positions: int) -> bool:
        """Blocks in the draft pool for ``positions`` positions of the row (False: none free)."""
        need = self.alloc.blocks_for(positions) - len(d.seq.block_tables[0])
        if need > self.alloc.num_free:
            return False
        if need > 0:
            d.seq.block_tables[0] += self.alloc.allocate(need)
        return True

    def accepted(self, seq, old_len: int, drafted: int, accepted: int) -> None:
        """After verification: the draft KV holds the target's tokens up to
        ``old_len`` plus the accepted drafts it had fed (all but its last)."""
        d = seq.data.spec.draft
        if d is not None and drafted:
            d.num_computed = old_len + min(accepted, drafted - 1)

    def release(self, seq) -> None:
        spec = getattr(seq.data, "spec", None)
        d = spec.draft if spec is not None else None
        if d is not None and d.seq.block_tables[0]:
            self.alloc.free(d.seq.block_tables[0])
            d.seq.block_tables = [[]]
            d.num_computed = 0
