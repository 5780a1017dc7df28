"""Continuous-batching scheduler: pure Python, no MLX.

``schedule() -> StepPlan`` decides what each sequence computes this step under
a token budget and the free-block count; ``update(plan, tokens)`` applies the
step's sampled tokens. One rule for progress: each scheduled sequence
advances ``min(tokens_to_compute, budget)`` tokens — prefill chunks, prefix
hits (fewer tokens to compute), decode and recompute after preemption are the
same thing.

Order: running sequences first (oldest first; a decode costs one token of
budget), then waiting ones (FIFO) while there is budget, a batch slot
(``max_num_seqs``) and blocks. When a running sequence needs a block and none
is free, the newest running sequence is preempted: its blocks are freed (they
stay in the prefix cache, so the recompute is often a cache hit) and it goes
back to the head of the queue.

Token-level stops (EOS / stop ids, max_tokens, the context length) are
checked here; stop strings need text, so the engine's per-request output
processor checks them and calls ``finish``.

Speculative decoding rides on the same plan: a decoding row may carry
``draft`` tokens (the ``drafter`` proposes them, given the budget and room
left once every row is planned, and selects those worth verifying). The runner computes the row's last
known token plus its drafts and gives logits at each of those positions; the
engine verifies them, and ``update`` takes the tokens it accepted plus one
more. The KV of accepted drafts is already in the pool; rejected drafts' slots
lie past ``num_computed`` and are overwritten by later tokens (causality comes
from positions), and only accepted tokens ever enter block hashes.

A sequence that scores its prompt (``score_prompt``: prompt logprobs) needs
logits at every prompt position, so it takes no prefix-cache hits; with
``max_tokens == 0`` it samples nothing and finishes ("length") once its
prompt is computed.

KV stored outside the pool (the SSD tier) comes through a connector
(kv/connector.py) the scheduler asks when a prompt arrives: a prompt whose
next blocks past its RAM hit can be loaded waits in ``loading`` until the
load is done, then joins the queue, and its prefix match takes the loaded
blocks like any RAM hit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..kv.allocator import BlockAllocator, block_hash, chain_hashes
from ..kv.connector import KVConnector, NullConnector

LOADING, WAITING, RUNNING, FINISHED = "loading", "waiting", "running", "finished"


@dataclass(eq=False)
class Seq:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    stop_ids: frozenset = frozenset()
    namespace: bytes = b""  # prefix-cache namespace (model + scheme + salt)
    score_prompt: bool = False  # compute every prompt position (no prefix-cache hits)
    data: Any = None  # the engine's per-request state (stream, sampler, detok)
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the pool
    # One block table per KV group (kv/layer_spec.py); a sliding group's
    # entries for blocks out of its window are released (-1).
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    num_released: list[int] = field(default_factory=lambda: [0])  # leading -1 entries per group
    hashes: list[bytes] = field(default_factory=list)  # full-block hashes of tokens
    num_registered: int = 0  # full blocks published to the prefix cache
    cached_tokens: int | None = None  # prompt tokens reused at first admission
    status: str = WAITING
    finish_reason: str | None = None
    stop_token_id: int | None = None
    num_preemptions: int = 0
    load_id: int | None = None  # the connector's load that holds this sequence's prefix

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)


@dataclass
class Row:
    seq: Seq
    start: int  # first position computed this step
    n: int  # known tokens computed this step
    sample: bool  # the chunk reaches the last known token (and max_tokens > 0): sample the next one
    draft: list[int] = field(default_factory=list)  # proposed tokens after it, computed too, to verify

    @property
    def num_tokens(self) -> int:
        return self.n + len(self.draft)


@dataclass
class StepPlan:
    rows: list[Row] = field(default_factory=list)
    preempted: list[Seq] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def sample_rows(self) -> list[Row]:
        return [r for r in self.rows if r.sample]


@dataclass
class SeqUpdate:
    seq: Seq
    token: int | None  # None: finished without sampling (max_tokens == 0)
    finish_reason: str | None = None  # "stop" | "length" when this token ended it
    k: int = 0  # which of the row's tokens this step (0, then accepted drafts in order)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, *, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 512, max_model_len: int = 4096,
                 drafter: Any = None, windows: tuple[int, ...] = (0,),
                 connector: KVConnector | None = None):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        self.connector = connector or NullConnector()
        if self.connector.enabled and len(windows) > 1:
            raise ValueError("a KV connector stores whole blocks of every layer: one KV group only")
        # The pool's KV groups (kv/layer_spec.py): each group's attention
        # window (0: full), one block table per group per sequence.
        self.windows = tuple(windows)
        self._sliding = [(g, w) for g, w in enumerate(self.windows) if w]
        self.drafter = drafter  # speculative decoding (engine/spec.py Drafter), or None
        self.alloc = allocator
        self.block_size = allocator.block_size
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.loading: dict[int, Seq] = {}  # load id -> sequence waiting for the connector
        self._next_load = 0
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up at first admission
        self.prefix_hits = 0  # of which found in the cache

    # -- requests ------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        """Queue a new sequence; first, if the connector can load blocks past
        its RAM-cached prefix, it waits in ``loading`` for them."""
        if len(seq.tokens) >= self.max_model_len:
            raise ValueError("prompt does not fit the context")
        if self._start_load(seq):
            return
        seq.status = WAITING
        self.waiting.append(seq)

    def _start_load(self, seq: Seq) -> bool:
        if not self.connector.enabled or seq.score_prompt or not self.alloc.enable_prefix_cache:
            return False
        bs = self.block_size
        seq.hashes = chain_hashes(seq.tokens, bs, seq.namespace, seq.hashes)
        keys = seq.hashes[:(len(seq.tokens) - 1) // bs]  # the last token is always computed
        cached = 0
        while cached < len(keys) and keys[cached] in self.alloc.cached:
            cached += 1
        n = self.connector.num_loadable(keys, cached, len(keys) - cached)
        if n <= 0:
            return False
        seq.load_id = self._next_load
        self._next_load += 1
        self.connector.start_load(seq.load_id, keys, cached, n)
        seq.status = LOADING
        self.loading[seq.load_id] = seq
        return True

    def _collect_loads(self) -> None:
        """Sequences whose loads are done join the queue (their blocks stay
        held by the connector until admission)."""
        if self.loading:
            for load_id in self.connector.finished_loads():
                seq = self.loading.pop(load_id, None)
                if seq is not None:
                    seq.status = WAITING
                    self.waiting.append(seq)

    def _release_load(self, seq: Seq) -> None:
        if seq.load_id is not None:
            self.connector.release(seq.load_id)
            seq.load_id = None

    def has_work(self) -> bool:
        self._collect_loads()
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        """Queued sequences, those waiting for a load included."""
        return len(self.waiting) + len(self.loading)

    def find(self, request_id: str) -> Seq | None:
        for s in self.running:
            if s.request_id == request_id:
                return s
        for s in self.waiting:
            if s.request_id == request_id:
                return s
        for s in self.loading.values():
            if s.request_id == request_id:
                return s
        return None

    def finish(self, seq: Seq, reason: str) -> None:
        """End a sequence (stop string, abort, error): free its blocks."""
        if seq.status == FINISHED:
            return
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq.status == LOADING:
            self.loading.pop(seq.load_id, None)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self._release_load(seq)
        self._release(seq)
        seq.status = FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Seq) -> None:
        self._free_tables(seq.block_tables)
        seq.block_tables = [[] for _ in self.windows]
        seq.num_released = [0] * len(self.windows)
        seq.num_computed = 0
        seq.num_registered = 0

    def _free_tables(self, tables: list[list[int]]) -> None:
        for table in tables:
            held = [b for b in table if b >= 0]
            if held:
                self.alloc.free(held)

    # -- blocks over KV groups ------------------------------------------------
    def _need(self, seq: Seq, end: int) -> int:
        """New blocks ``seq`` needs to hold positions ``< end`` (every group's
        table grows alike)."""
        return max(0, self.alloc.blocks_for(end) - len(seq.block_tables[0])) * len(self.windows)

    def _grow(self, seq: Seq, end: int) -> None:
        n = self.alloc.blocks_for(end) - len(seq.block_tables[0])
        if n > 0:
            for table in seq.block_tables:
                table += self.alloc.allocate(n)

    def _slide(self, seq: Seq, pos: int | None = None) -> None:
        """Free, in each sliding group, the blocks wholly before the window of
        the next position to compute (``pos``, by default the first not
        computed): no later query of ``seq`` reads them."""
        if not self._sliding:
            return
        bs = self.block_size
        pos = seq.num_computed if pos is None else pos
        for g, w in self._sliding:
            end = max(0, pos - w + 1) // bs
            lo = seq.num_released[g]
            if end > lo:
                table = seq.block_tables[g]
                self.alloc.free(table[lo:end])
                table[lo:end] = [-1] * (end - lo)
                seq.num_released[g] = end

    def _group_hashes(self, hashes: list[bytes], g: int) -> list[bytes]:
        """Group ``g``'s cache keys for blocks of these hashes (group 0 keeps
        the chain's own, which the SSD tier names files by)."""
        return hashes if g == 0 else [block_hash(h, (), b"kv-group%d" % g) for h in hashes]

    def _window_start(self, n: int, w: int) -> int:
        """First block a query at position ``n * block_size`` attends in a
        group of window ``w`` (0: full)."""
        return 0 if w == 0 else max(0, n * self.block_size - w + 1) // self.block_size

    def _match(self, seq: Seq, limit: int) -> list[list[int]]:
        """Take the longest prefix hit of ``seq`` over all groups, at most
        ``limit`` blocks: full groups need every block before it, sliding
        groups only the blocks of its window. Returns the block tables."""
        G = len(self.windows)
        alloc = self.alloc
        if seq.score_prompt or not alloc.enable_prefix_cache or limit == 0:
            return [[] for _ in range(G)]
        cached = alloc.cached
        keys = [self._group_hashes(seq.hashes[:limit], g) for g in range(G)]
        n = limit
        runs = []  # per sliding group: run[b] = cached blocks ending at b
        for g, w in enumerate(self.windows):
            if w == 0:
                k = 0
                while k < n and keys[g][k] in cached:
                    k += 1
                n = k
            else:
                run, r = [], 0
                for h in keys[g]:
                    r = r + 1 if h in cached else 0
                    run.append(r)
                runs.append((g, w, run))
        while n > 0 and any(run[n - 1] < n - self._window_start(n, w) for _, w, run in runs):
            n -= 1
        tables = []
        for g, w in enumerate(self.windows):
            lo = self._window_start(n, w)
            tables.append([-1] * lo + alloc.match_prefix(keys[g][lo:n]))
        return tables

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- one step ------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self._collect_loads()
        plan = StepPlan()
        budget = self.budget
        alloc = self.alloc
        for seq in list(self.running):
            if seq.status != RUNNING or budget == 0:
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            self._slide(seq)
            need = self._need(seq, seq.num_computed + n)
            while need > alloc.num_free and seq.status == RUNNING:
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
            if seq.status != RUNNING:
                break  # it was the newest: nothing after it remains
            self._grow(seq, seq.num_computed + n)
            plan.rows.append(Row(seq, seq.num_computed, n, _samples(seq, seq.num_computed + n)))
            budget -= n

        while (self.waiting and budget > 0 and not plan.preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            bs = self.block_size
            seq.hashes = chain_hashes(seq.tokens, bs, seq.namespace, seq.hashes)
            # The last token is always computed (its logits are sampled).
            hit = self._match(seq, (len(seq.tokens) - 1) // bs)
            num_hit = len(hit[0])
            start = num_hit * bs
            n = min(len(seq.tokens) - start, budget)
            seq.block_tables = hit
            if self._need(seq, start + n) > alloc.num_free:
                self._free_tables(hit)
                seq.block_tables = [[] for _ in self.windows]
                break
            self.waiting.popleft()
            self._release_load(seq)  # its match holds the loaded blocks now
            self._grow(seq, start + n)
            seq.num_released = [self._window_start(num_hit, w) for w in self.windows]
            seq.num_computed = start
            seq.num_registered = num_hit
            if seq.cached_tokens is None:
                seq.cached_tokens = start
                self.prefix_queries += seq.prompt_len
                self.prefix_hits += start
            seq.status = RUNNING
            self.running.append(seq)
            plan.rows.append(Row(seq, start, n, _samples(seq, start + n)))
            budget -= n
        if self.drafter is not None and budget > 0:
            self._draft(plan, budget)
        return plan

    def batch_full(self) -> bool:
        return len(self.running) >= self.max_num_seqs

    def plan_ahead(self, plan: StepPlan) -> StepPlan | None:
        """The step after ``plan`` before its tokens are known (the engine
        builds it while ``plan`` evaluates): each decoding row of ``plan``
        again, one position on, its input the token ``plan`` is sampling.
        Only where that is the step ``schedule`` would make whatever the
        tokens are, short of a stop: every row of ``plan`` is a plain decode
        (one known token, no draft, no prompt scoring), nothing waits that
        could be admitted (a sequence waiting for a batch slot while every
        slot is taken is admitted one step later than it would be, if a row
        ends on this step's token), and the rows' next blocks are free (no
        preemption). Rows whose sampled token surely ends them (max_tokens,
        the context) are left out; a row that stops on its token anyway
        computes one wasted position, whose KV lies past ``num_computed``
        (never hashed) and whose result ``update`` drops (the sequence is
        finished). None when no such step exists."""
        if (not plan.rows or plan.preempted or not self.batch_full() and (self.waiting or self.loading)
                or any(not r.sample or r.n != 1 or r.draft or r.seq.score_prompt for r in plan.rows)):
            return None
        rows, need = [], 0
        for r in plan.rows:
            seq = r.seq
            pos = r.start + 1  # where the token being sampled goes
            if (seq.status != RUNNING or seq.num_output + 1 >= seq.max_tokens
                    or len(seq.tokens) + 1 >= self.max_model_len):
                continue
            need += self._need(seq, pos + 1)
            rows.append(Row(seq, pos, 1, True))
        if not rows or need > self.alloc.num_free:
            return None
        for row in rows:
            self._slide(row.seq, row.start)
            self._grow(row.seq, row.start + 1)
        return StepPlan(rows)

    def _draft_room(self, seq, pending: int = 0) -> int:
        """How many drafts fit before max_tokens or the context ends, with
        ``pending`` tokens sampled but not yet appended; the row's next token
        comes anyway, so drafts are the tokens after it."""
        return min(seq.max_tokens - seq.num_output, self.max_model_len - len(seq.tokens)) - 1 - pending

    def wants_drafts(self, plan: StepPlan, sampled: dict) -> bool:
        """Whether ``plan``, built by ``plan_ahead`` before its inputs were
        known, should give way to a step that drafts, now that they are
        (``sampled``: each row's sequence -> the token it takes, not yet
        appended): the drafter's choice on the room ``_draft`` would give."""
        budget = self.budget - plan.num_tokens
        rows = []
        for row in plan.rows:
            seq = row.seq
            room = self._draft_room(seq, pending=1)
            if min(budget, room) > 0:
                rows.append((seq, seq.tokens + [sampled[seq]], min(budget, room)))
        return bool(rows) and self.drafter.peek(rows, plan.num_tokens, len(plan.sample_rows))

    def _draft(self, plan: StepPlan, budget: int) -> None:
        """Drafts for decoding rows from what the step leaves: its budget,
        each row's room (context, max_tokens) and free blocks (drafting never
        preempts); the drafter proposes and picks what is worth verifying."""
        alloc = self.alloc
        rows = []
        for row in plan.rows:
            seq = row.seq
            if not (row.sample and row.n == 1):
                continue
            room = self._draft_room(seq)
            if min(budget, room) > 0:
                rows.append((row, min(budget, room)))
        if not rows:
            return
        sampled = len(plan.sample_rows)
        drafts = self.drafter.draft([(row.seq, k) for row, k in rows], plan.num_tokens, sampled)
        for (row, _), draft in zip(rows, drafts):
            draft = draft[:budget]
            if not draft:
                continue
            seq = row.seq
            end = row.start + row.n + len(draft)
            if self._need(seq, end) > alloc.num_free:
                continue
            self._grow(seq, end)
            row.draft = draft
            budget -= len(draft)

    def update(self, plan: StepPlan, tokens: list) -> list[SeqUpdate]:
        """Apply a step: ``tokens`` holds, per ``plan.sample_rows`` entry, the
        sampled id, or a list of ids: the row's accepted drafts (a prefix of
        its draft) then the one token sampled after them. Stops are checked on
        each in order; what follows a stop is dropped."""
        sample_rows = plan.sample_rows
        if len(tokens) != len(sample_rows):
            raise ValueError(f"{len(tokens)} tokens for {len(sample_rows)} sampled rows")
        out = []
        it = iter(tokens)
        bs = self.block_size
        for row in plan.rows:
            seq = row.seq
            toks = next(it) if row.sample else None
            if isinstance(toks, int):
                toks = [toks]
            if seq.status != RUNNING:
                continue  # finished or preempted meanwhile
            if toks is not None and (len(toks) > len(row.draft) + 1 or toks[:-1] != row.draft[:len(toks) - 1]):
                raise ValueError(f"{seq.request_id}: the accepted tokens are not a prefix of the draft")
            # the known tokens and the accepted drafts now have their KV in the pool
            seq.num_computed = row.start + row.n + (len(toks) - 1 if toks else 0)
            updates = []
            for k, tok in enumerate(toks or []):
                seq.tokens.append(tok)
                reason = None
                if tok in seq.stop_ids:
                    reason = "stop"
                    seq.stop_token_id = tok
                elif seq.num_output >= seq.max_tokens or len(seq.tokens) >= self.max_model_len:
                    reason = "length"
                updates.append(SeqUpdate(seq, tok, reason, k))
                if reason:
                    break
            full = min(seq.num_computed, len(seq.tokens)) // bs
            if full > seq.num_registered:
                seq.hashes = chain_hashes(seq.tokens, bs, seq.namespace, seq.hashes)
                for g, table in enumerate(seq.block_tables):
                    keys = self._group_hashes(seq.hashes[seq.num_registered:full], g)
                    for b, h in zip(range(seq.num_registered, full), keys):
                        if table[b] >= 0:
                            self.alloc.register(table[b], h)
                seq.num_registered = full
            if toks is None:
                if seq.max_tokens <= 0 and seq.num_computed == len(seq.tokens):
                    self.finish(seq, "length")
                    out.append(SeqUpdate(seq, None, "length"))
                continue
            if updates[-1].finish_reason:
                self.finish(seq, updates[-1].finish_reason)
            out += updates
        return out


def _samples(seq: Seq, end: int) -> bool:
    return end == len(seq.tokens) and seq.max_tokens > 0
