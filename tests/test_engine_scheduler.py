"""Scheduler unit tests: pure Python, fake sampled tokens, no model."""

import random

import pytest

from mlxfast.engine.scheduler import FINISHED, RUNNING, WAITING, Scheduler, Seq
from mlxfast.kv.allocator import BlockAllocator


def make(num_blocks=64, bs=4, **kw):
    kw.setdefault("max_model_len", num_blocks * bs)
    return Scheduler(BlockAllocator(num_blocks, bs), **kw)


def seq(rid, n, max_tokens=8, stop=(), first=1):
    return Seq(str(rid), list(range(first, first + n)), max_tokens=max_tokens, stop_ids=frozenset(stop))


def step(s, token=50):
    plan = s.schedule()
    ups = s.update(plan, [token] * len(plan.sample_rows))
    return plan, ups


def test_chunked_prefill_then_decode():
    s = make(max_num_batched_tokens=8, max_num_seqs=4)
    a = seq("a", 20)
    s.add(a)
    plan, ups = step(s)
    assert [(r.start, r.n, r.sample) for r in plan.rows] == [(0, 8, False)] and ups == []
    plan, ups = step(s)
    assert [(r.start, r.n, r.sample) for r in plan.rows] == [(8, 8, False)]
    plan, ups = step(s)
    assert [(r.start, r.n, r.sample) for r in plan.rows] == [(16, 4, True)]
    assert ups[0].token == 50 and a.tokens[-1] == 50 and a.num_computed == 20
    plan, ups = step(s)
    assert [(r.start, r.n, r.sample) for r in plan.rows] == [(20, 1, True)]
    assert len(a.block_tables[0]) == 6  # 22 tokens known, 21 computed -> 6 blocks of 4


def test_decodes_first_then_prefill_under_budget():
    s = make(max_num_batched_tokens=10, max_num_seqs=4)
    a, b = seq("a", 3), seq("b", 30)
    s.add(a)
    step(s)  # a prefilled, sampled
    s.add(b)
    plan, _ = step(s)
    assert [(r.seq.request_id, r.n) for r in plan.rows] == [("a", 1), ("b", 9)]
    assert plan.num_tokens == 10


def test_max_num_seqs_caps_running():
    s = make(max_num_batched_tokens=64, max_num_seqs=2)
    for i in range(4):
        s.add(seq(i, 3))
    plan, _ = step(s)
    assert len(plan.rows) == 2 and len(s.running) == 2 and len(s.waiting) == 2


def test_stops_eos_stop_ids_and_max_tokens():
    s = make(max_num_batched_tokens=64)
    a = seq("a", 3, max_tokens=100, stop={7})
    b = seq("b", 3, max_tokens=2)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    ups = s.update(plan, [7, 9])
    assert ups[0].finish_reason == "stop" and a.stop_token_id == 7 and a.status == FINISHED
    assert ups[1].finish_reason is None
    plan = s.schedule()
    ups = s.update(plan, [9])
    assert ups[0].finish_reason == "length" and b.num_output == 2
    assert s.alloc.num_free == s.alloc.num_blocks
    s.alloc.check()


def test_context_limit_finishes_with_length():
    s = make(num_blocks=4, bs=4, max_num_batched_tokens=16)  # max_model_len 16
    a = seq("a", 14, max_tokens=100)
    s.add(a)
    step(s)
    plan, ups = step(s)
    assert ups[0].finish_reason == "length" and len(a.tokens) == 16


def test_prefix_hit_reuses_blocks_and_keeps_last_token():
    s = make(bs=4, max_num_batched_tokens=64)
    a = seq("a", 10)
    s.add(a)
    step(s)  # 10 computed: blocks 0,1 full and registered
    s.finish(a, "abort")
    b = seq("b", 10)  # same prompt
    s.add(b)
    plan, _ = step(s)
    assert b.cached_tokens == 8 and plan.rows[0].start == 8 and plan.rows[0].n == 2
    c = seq("c", 8)  # prompt exactly two blocks: the last token is recomputed
    s.add(c)
    plan, _ = step(s)
    row = [r for r in plan.rows if r.seq is c][0]
    assert c.cached_tokens == 4 and (row.start, row.n) == (4, 4)
    assert s.prefix_hits == 12 and s.prefix_queries == 28


def test_namespace_isolates_prefix_cache():
    s = make(bs=4, max_num_batched_tokens=64)
    a = seq("a", 10)
    a.namespace = b"tenant-1"
    s.add(a)
    step(s)
    b = seq("b", 10)
    b.namespace = b"tenant-2"
    s.add(b)
    step(s)
    assert b.cached_tokens == 0


def test_shared_prefix_blocks_are_refcounted():
    s = make(bs=4, max_num_batched_tokens=64)
    a = seq("a", 9)
    s.add(a)
    step(s)
    b = seq("b", 9)
    s.add(b)
    step(s)
    assert b.block_tables[0][:2] == a.block_tables[0][:2]
    assert all(s.alloc.refcount[x] == 2 for x in a.block_tables[0][:2])
    s.finish(a, "abort")
    assert all(s.alloc.refcount[x] == 1 for x in b.block_tables[0][:2])
    s.finish(b, "abort")
    assert s.alloc.num_free == s.alloc.num_blocks
    s.alloc.check()


def test_preempts_newest_and_recomputes():
    # 6 blocks of 4 tokens; two sequences that each want 4 blocks.
    s = make(num_blocks=6, bs=4, max_num_batched_tokens=64, max_model_len=24)
    a, b = seq("a", 7, max_tokens=20), seq("b", 7, max_tokens=20, first=30)
    s.add(a)
    s.add(b)
    step(s)
    assert len(s.running) == 2
    preempted = []
    for _ in range(30):
        plan, _ = step(s)
        preempted += plan.preempted
        s.alloc.check()
        if a.status == FINISHED:
            break
    assert b in preempted and a not in preempted
    assert a.status == FINISHED and a.finish_reason == "length"
    assert b.status in (WAITING, RUNNING) and s.num_preemptions >= 1
    while s.has_work():
        step(s)
    assert b.num_output == 17 and len(b.tokens) == 24  # capped by max_model_len
    assert s.alloc.num_free == 6


def test_abort_waiting_and_running():
    s = make(max_num_batched_tokens=64, max_num_seqs=1)
    a, b = seq("a", 5), seq("b", 5)
    s.add(a)
    s.add(b)
    step(s)
    assert s.find("b") is b and b.status == WAITING
    s.finish(b, "abort")
    s.finish(a, "abort")
    assert not s.has_work() and s.alloc.num_free == s.alloc.num_blocks


def test_random_workload_never_leaks():
    rng = random.Random(0)
    s = make(num_blocks=24, bs=4, max_num_batched_tokens=16, max_num_seqs=5, max_model_len=64)
    live = []
    for it in range(3000):
        if rng.random() < 0.3 and len(live) < 12:
            q = Seq(f"r{it}", [rng.randrange(3) for _ in range(rng.randint(1, 30))],
                    max_tokens=rng.randint(1, 20), stop_ids=frozenset({0}))
            s.add(q)
            live.append(q)
        if live and rng.random() < 0.05:
            s.finish(live.pop(rng.randrange(len(live))), "abort")
        if s.has_work():
            plan = s.schedule()
            assert plan.rows, "no progress"
            assert plan.num_tokens <= 16 and len(plan.rows) <= 5
            s.update(plan, [rng.randrange(5) for _ in plan.sample_rows])
        live = [q for q in live if q.status != FINISHED]
        s.alloc.check()
    for q in live:
        s.finish(q, "abort")
    assert s.alloc.num_free == 24 and all(r == 0 for r in s.alloc.refcount)


# -- sliding-window KV groups (kv/layer_spec.py) --------------------------------

def sliding(num_blocks=64, bs=4, windows=(0, 8), **kw):
    return Scheduler(BlockAllocator(num_blocks, bs), windows=windows, **kw)


def held(s, seq, g):
    return [b for b in seq.block_tables[g] if b >= 0]


def test_sliding_group_holds_only_its_window():
    s = sliding(max_num_batched_tokens=8)
    a = seq("a", 30, max_tokens=40)
    s.add(a)
    most = 0
    while a.status != "finished":
        plan, _ = step(s)
        s.alloc.check()
        if a.status == "finished":
            break
        full, slid = held(s, a, 0), held(s, a, 1)
        assert len(full) == len(a.block_tables[1]) == s.alloc.blocks_for(a.num_computed)
        # released at schedule time: the blocks wholly before the window of the
        # first position the step computed
        first = max(0, plan.rows[0].start - 8 + 1) // 4
        assert a.num_released[1] == first
        assert a.block_tables[1][:first] == [-1] * first and len(slid) == len(full) - first
        most = max(most, len(slid))
    assert a.num_output == 40
    assert most <= 8 // 4 + 1 + 8 // 4  # window + a partial block + one chunk's blocks
    assert s.alloc.num_free == s.alloc.num_blocks  # everything back (cached or not)


def test_sliding_prefix_hit_needs_only_the_window():
    s = sliding(bs=4, windows=(0, 8), max_num_batched_tokens=64)
    a = seq("a", 30, max_tokens=1)
    s.add(a)
    step(s)  # 30 computed, 7 full blocks registered in both groups
    assert a.status == "finished"
    b = seq("b", 30, max_tokens=2)
    s.add(b)
    plan, _ = step(s)
    # the last token is always computed: 29 // 4 = 7 blocks hit
    assert b.cached_tokens == 28 and plan.rows[0].start == 28
    # the sliding table holds only the blocks the first computed query (at 28) can see
    assert b.block_tables[1][:5] == [-1] * 5 and all(x >= 0 for x in b.block_tables[1][5:])
    s.alloc.check()


def test_sliding_prefix_hit_shortens_when_window_blocks_are_gone():
    s = sliding(bs=4, windows=(0, 8), max_num_batched_tokens=64)
    a = seq("a", 30, max_tokens=1)
    s.add(a)
    step(s)
    # evict the sliding group's copies of blocks 5 and 6 (the window of a hit at 28)
    keys = s._group_hashes(a.hashes, 1)
    for h in keys[5:7]:
        s.alloc.uncache(s.alloc.cached[h])
    b = seq("b", 30, max_tokens=2)
    s.add(b)
    plan, _ = step(s)
    # a hit at 4n needs sliding blocks from (4n - 7) // 4 to n - 1: n = 5 (blocks 2..4) is the longest
    assert b.cached_tokens == 20 and plan.rows[0].start == 20
    assert b.block_tables[1][:3] == [-1] * 3 and b.block_tables[1][3] >= 0
    s.alloc.check()


def test_full_groups_only_behave_as_one_table():
    one, two = make(bs=4, max_num_batched_tokens=64), sliding(bs=4, windows=(0, 0), max_num_batched_tokens=64)
    for s in (one, two):
        a = seq("a", 10)
        s.add(a)
        step(s)
        s.finish(a, "abort")
        b = seq("b", 10)
        s.add(b)
        step(s)
        assert b.cached_tokens == 8
        assert all(len(t) == 3 for t in b.block_tables)
    assert two.alloc.num_free == two.alloc.num_blocks - 2 * 3  # every group has its own blocks


def test_scheduler_and_allocator_import_without_mlx():
    """The pure half of the engine: scheduling and block accounting need no MLX."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import mlxfast.engine.scheduler, mlxfast.kv.allocator, mlxfast.kv.layer_spec, mlxfast.engine.api\n"
            "bad = sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.') or m == 'mlxfast._ext')\n"
            "print(bad)\n"
            "sys.exit(1 if bad else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_kv_groups_of_a_layer_spec():
    from mlxfast.kv.layer_spec import KVGroups, LayerKV

    full, slid = LayerKV(1, 64), LayerKV(1, 64, 512)
    g = KVGroups([slid] * 5 + [full] + [slid] * 5 + [full])  # Gemma-like: 10 sliding, 2 full
    assert g.windows == (0, 512, 512, 512, 512, 512) and g.group_size == 2
    assert g.where[5] == (0, 0) and g.where[11] == (0, 1) and g.where[0] == (1, 0)
    # one group: every layer slides -> it releases; unless release is off (SSD tier, draft pools)
    assert KVGroups([slid] * 4).windows == (512,)
    assert KVGroups([slid] * 4, release=False).windows == (0,)
    assert KVGroups([slid] * 3 + [full], release=False).windows == (0,)
    with pytest.raises(ValueError, match="different KV shapes"):
        KVGroups([LayerKV(1, 64, 8), LayerKV(2, 64)])


class FakeConnector:
    """Blocks 'on disk' by key; a load registers them in the allocator when
    the test says it is done (what the SSD tier does after its read)."""

    enabled = True

    def __init__(self, alloc, stored):
        self.alloc, self.stored = alloc, set(stored)
        self.inflight, self.holds, self.done, self.asked = {}, {}, [], []

    def num_loadable(self, keys, start, limit):
        self.asked.append((len(keys), start, limit))
        k = start
        while k < len(keys) and k - start < limit and keys[k] in self.stored:
            k += 1
        return k - start

    def start_load(self, load_id, keys, start, n):
        self.inflight[load_id] = (self.alloc.match_prefix(list(keys[:start])), list(keys[start:start + n]))

    def complete(self, load_id):
        held, keys = self.inflight.pop(load_id)
        blocks = self.alloc.allocate(len(keys))
        for b, h in zip(blocks, keys):
            self.alloc.register(b, h)
        self.holds[load_id] = held + blocks
        self.done.append(load_id)

    def finished_loads(self):
        done, self.done = self.done, []
        return done

    def release(self, load_id):
        held = self.holds.pop(load_id, None) or self.inflight.pop(load_id, (None,))[0]
        if held:
            self.alloc.free(held)


def test_the_scheduler_asks_the_connector_and_admits_after_the_load():
    from mlxfast.engine.scheduler import LOADING
    from mlxfast.kv.allocator import chain_hashes

    alloc = BlockAllocator(64, 4)
    a = seq("a", 21)  # 5 full blocks before the last token
    keys = chain_hashes(a.tokens, 4, a.namespace)
    conn = FakeConnector(alloc, keys[2:4])  # blocks 2 and 3 on 'disk'
    s = Scheduler(alloc, max_model_len=256, connector=conn)
    # RAM already holds blocks 0 and 1 (another request's prefix, finished).
    for b, h in zip(alloc.allocate(2), keys[:2]):
        alloc.register(b, h)
        alloc.free([b])
    s.add(a)
    assert a.status == LOADING and s.num_waiting == 1 and not s.has_work()
    assert conn.asked == [(5, 2, 3)]  # 5 keys, 2 cached in RAM, up to 3 more
    assert s.find("a") is a
    conn.complete(a.load_id)
    assert s.has_work() and a.status == WAITING
    plan, _ = step(s)
    assert [(r.start, r.n) for r in plan.rows] == [(16, 5)]  # 4 blocks hit: 2 from RAM, 2 loaded
    assert a.cached_tokens == 16 and a.status == RUNNING and not conn.holds  # released at admission
    s.finish(a, "abort")
    alloc.check()
    assert all(rc == 0 for rc in alloc.refcount)


def test_a_loading_sequence_can_be_aborted_and_a_scored_prompt_never_loads():
    alloc = BlockAllocator(64, 4)
    a = seq("a", 21)
    keys = chain_hashes_of(a)
    conn = FakeConnector(alloc, keys)
    s = Scheduler(alloc, max_model_len=256, connector=conn)
    s.add(a)
    assert s.find("a") is a and a.load_id is not None
    s.finish(a, "abort")
    assert a.status == FINISHED and s.num_waiting == 0 and not conn.inflight
    b = Seq("b", list(a.prompt_ids), max_tokens=4, score_prompt=True)
    s.add(b)
    assert b.status == WAITING and b.load_id is None and len(conn.asked) == 1
    alloc.check()


def chain_hashes_of(s):
    from mlxfast.kv.allocator import chain_hashes

    return chain_hashes(s.tokens, 4, s.namespace)


def test_a_connector_needs_one_kv_group():
    alloc = BlockAllocator(64, 4)
    with pytest.raises(ValueError, match="one KV group"):
        Scheduler(alloc, windows=(0, 8), connector=FakeConnector(alloc, ()))


def test_plan_ahead_is_the_step_schedule_would_make():
    s = make(max_num_batched_tokens=16, max_num_seqs=4)
    a, b = seq("a", 3, max_tokens=8), seq("b", 7, max_tokens=8)
    s.add(a)
    s.add(b)
    plan, _ = step(s)  # both prefilled: the next step decodes both
    plan = s.schedule()
    ahead = s.plan_ahead(plan)  # before this step's tokens are known
    assert [(r.seq.request_id, r.start, r.n, r.sample) for r in ahead.rows] == [("a", 4, 1, True),
                                                                               ("b", 8, 1, True)]
    assert len(b.block_tables[0]) == 3  # position 8 is in a third block of 4, grown ahead
    s.update(plan, [50, 51])
    s.update(ahead, [60, 61])
    assert a.tokens[-2:] == [50, 60] and b.tokens[-2:] == [51, 61]
    assert a.num_computed == 5 and b.num_computed == 9
    # the same state a synchronous schedule gives
    assert [(r.start, r.n) for r in s.schedule().rows] == [(5, 1), (9, 1)]


def test_plan_ahead_only_for_plain_decodes_with_blocks_free():
    s = make(max_num_batched_tokens=16, max_num_seqs=4)
    a = seq("a", 20)
    s.add(a)
    plan = s.schedule()  # a prefill chunk: its next step is not known
    assert s.plan_ahead(plan) is None
    s.update(plan, [])
    step(s)  # the rest of the prompt, then a decodes
    plan = s.schedule()
    s.add(seq("b", 3))  # waiting: the next step admits it
    assert s.plan_ahead(plan) is None
    s.waiting.clear()
    plan.rows[0].draft = [7]
    assert s.plan_ahead(plan) is None
    plan.rows[0].draft = []
    free = s.alloc.num_free
    taken = s.alloc.allocate(free)  # no block free for the next position
    needs_block = a.num_computed + 1 == len(a.block_tables[0]) * 4
    assert (s.plan_ahead(plan) is None) == needs_block
    s.alloc.free(taken)


def test_plan_ahead_leaves_out_rows_their_token_surely_ends():
    s = make(max_num_batched_tokens=16, max_num_seqs=4)
    a, b = seq("a", 3, max_tokens=2), seq("b", 3, max_tokens=9)
    s.add(a)
    s.add(b)
    step(s)  # one output token each: a's next is its last
    plan = s.schedule()
    ahead = s.plan_ahead(plan)
    assert [r.seq.request_id for r in ahead.rows] == ["b"]
    ups = s.update(plan, [50, 50])
    assert a.status == FINISHED and ups[0].finish_reason == "length"
    # a row stopped by its token (not foreseeable) is in the step ahead, and
    # update drops it; its wasted position is never hashed
    s2 = make(max_num_batched_tokens=16, bs=4)
    c = seq("c", 7, max_tokens=9, stop=(99,))
    s2.add(c)
    step(s2)
    plan = s2.schedule()
    ahead = s2.plan_ahead(plan)
    assert [r.seq.request_id for r in ahead.rows] == ["c"]
    s2.update(plan, [99])
    assert c.status == FINISHED and s2.update(ahead, [5]) == []
    assert s2.alloc.num_free == s2.alloc.num_blocks


def test_plan_ahead_with_a_full_batch_and_a_queue():
    """Sequences waiting for a batch slot while every slot is taken do not
    stop the step ahead; one that could be admitted does."""
    s = make(max_num_batched_tokens=16, max_num_seqs=2)
    a, b, c = seq("a", 3, max_tokens=9), seq("b", 3, max_tokens=9), seq("c", 3, max_tokens=9)
    for x in (a, b, c):
        s.add(x)
    step(s)  # a and b run, c waits for a slot
    plan = s.schedule()
    assert [r.seq.request_id for r in plan.rows] == ["a", "b"] and s.waiting[0] is c
    ahead = s.plan_ahead(plan)
    assert [r.seq.request_id for r in ahead.rows] == ["a", "b"]
    s.update(plan, [50, 50])
    s.update(ahead, [51, 51])
    s.finish(b, "stop")  # a slot frees: c can be admitted, so no step is built ahead
    plan = s.schedule()
    assert [r.seq.request_id for r in plan.rows] == ["a", "c"]
    s.update(plan, [52, 53])
    s.add(seq("d", 3))
    plan = s.schedule()
    assert s.plan_ahead(plan) is not None  # d waits for a slot: the batch is full
