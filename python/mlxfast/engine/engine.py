"""The engine: one thread that owns every MLX call and runs continuous batching.

Each step: ``scheduler.schedule()`` -> ``runner.run(plan)`` (one model call)
-> ``sampler.sample`` (one ``mx.eval``) -> ``scheduler.update`` -> per-request
output processing -> events to the asyncio loop of each request via
``loop.call_soon_threadsafe``. With nothing to do the thread waits on a
condition variable.

Failures: an exception that belongs to one request (its admission, its
sampling parameters or grammar, its detokenizer) ends that request with
``finish_reason="error"`` and is logged with its traceback; the others go
on. When the batched sampler fails, each row is sampled alone to find the
rows at fault. Anything else (the model call itself) kills the engine:
``alive`` turns False, ``error`` says why (logged with the traceback), every
queued and running request gets an error FinishEvent and ``submit`` raises
EngineDead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import sys
import threading
import time
import traceback
from collections import deque

import mlx.core as mx

from ..kv.allocator import BlockAllocator
from ..kv.block_pool import KVPool, default_kv_dtype, kv_dtype
from ..kv.connector import KVConnector, NullConnector
from ..kv.layer_spec import KVGroups
from ..kv.schemes import parse_kv_quant
from .api import EngineDead, EngineOverloaded, FinishEvent, PromptTooLong, Request, TokenEvent
from .config import EngineConfig
from .metrics import RequestMetrics
from .output import OutputProcessor
from .runner import Runner
from .sampler import (Sampled, SamplingState, chosen, head_choice_ok, sample, sample_async,
                      score_tokens)
from .scheduler import Scheduler, Seq
from .spec import Drafter, RowSpec, check_draft_model, speculation_allowed

log = logging.getLogger("mlxfast.engine")

class RequestStream:
    """Async iterator of one request's events: TokenEvent* then one FinishEvent.

    Events wait here until the route reads them. A client that stops reading
    (a stalled socket blocks the route's writes) must not make the server
    hold its output without bound: when the oldest unread event has waited
    ``stall_timeout_s`` or more than ``max_unread`` events wait, the request
    is aborted and the stream ends with an "abort" FinishEvent."""

    def __init__(self, engine: "Engine", request_id: str, loop: asyncio.AbstractEventLoop, *,
                 stall_timeout_s: float = 60.0, max_unread: int = 4096):
        self.request_id = request_id
        self.t_submit = time.monotonic()  # latencies count from here (queueing included)
        self._engine = engine
        self._loop = loop
        self._events: deque = deque()  # (arrival time, event)
        self._wake = asyncio.Event()
        self._done = False
        self._cut = False
        self._stall_timeout_s = stall_timeout_s
        self._max_unread = max_unread

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        while not self._events:
            self._wake.clear()
            await self._wake.wait()
        _, ev = self._events.popleft()
        if isinstance(ev, FinishEvent):
            self._done = True
        return ev

    async def aclose(self) -> None:
        """Stop listening; aborts the request if it has not finished."""
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    def _deliver(self, events: list) -> None:
        try:
            self._loop.call_soon_threadsafe(self._put_all, events)
        except RuntimeError:  # the loop is closed: nobody is listening
            self._engine.abort(self.request_id)

    def _put_all(self, events: list) -> None:
        if self._cut:
            return
        now = time.monotonic()
        self._events.extend((now, ev) for ev in events)
        self._wake.set()
        if self._done or isinstance(self._events[-1][1], FinishEvent):
            return
        waited = now - self._events[0][0]
        if len(self._events) > self._max_unread or waited > self._stall_timeout_s:
            self._cut = True
            log.warning("request %s: the client read nothing for %.0f s (%d events unread); aborting it",
                        self.request_id, waited, len(self._events))
            self._events.clear()
            self._events.append((now, FinishEvent("abort", error="the client stopped reading")))
            self._engine.abort(self.request_id)


class _ReqState:
    __slots__ = ("request", "stream", "sampling", "out", "t_submit", "t_last", "events", "prompt_lps", "spec")

    def __init__(self, request, stream):
        self.request = request
        self.stream = stream
        self.sampling = None
        self.out = None
        self.t_submit = stream.t_submit
        self.t_last = None
        self.events = []
        self.prompt_lps = []  # PromptLogprob of prompt tokens 1.. scored so far
        self.spec = None  # spec.RowSpec, where speculative decoding is on and the request allows it


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = cfg = config or EngineConfig()
        args = model.args
        self.kv_dtype = kv_dtype(cfg.kv_dtype) if cfg.kv_dtype else model.dtype
        self.block_size = bs = cfg.block_size
        layers = model.kv_layers
        self.kv_spec = parse_kv_quant(cfg.kv_quant, head_dim=layers[0].head_dim, dtype=self.kv_dtype,
                                      group_size=cfg.kv_group_size)
        for d in {layer.head_dim for layer in layers}:
            self.kv_spec.for_head_dim(d)  # checks the scheme takes every layer's head dim
        if cfg.kv_dtype is None and self.kv_spec.kind == "dense":  # auto: see default_kv_dtype
            self.kv_dtype = default_kv_dtype(model.dtype)
            self.kv_spec = dataclasses.replace(self.kv_spec, dtype=self.kv_dtype)
        # Sliding-window layers free the blocks that leave their window; the
        # SSD tier stores whole blocks of every layer, so with it they keep them.
        self.kv_groups = KVGroups(layers, release=not cfg.ssd_cache_dir)
        self.kv_bytes_per_token = self.kv_spec.bytes_per_token(layers)  # with every block kept
        per_block = bs * self.kv_spec.bytes_per_token(self.kv_groups.slot_layers())
        self.num_blocks = cfg.num_blocks or max(2, int(cfg.kv_cache_gb * (1 << 30)) // per_block)
        limit = cfg.max_model_len or getattr(args, "max_position_embeddings", None) or 4096
        # A context of n tokens holds at most every block of every group.
        self.max_model_len = min(limit, self.num_blocks // len(self.kv_groups) * bs)
        fingerprint = cfg.model_fingerprint or hashlib.blake2b(
            repr(args).encode(), digest_size=8).hexdigest()
        self._namespace = f"{fingerprint}|{self.kv_spec.scheme_id}|bs{bs}"
        self.allocator = BlockAllocator(self.num_blocks, bs, cfg.enable_prefix_cache)
        if cfg.spec_kind not in (None, "ngram", "model"):
            raise ValueError(f"unknown speculative decoding kind {cfg.spec_kind!r} (known: ngram, model)")
        if (cfg.spec_kind == "model") != (cfg.draft_model is not None):
            raise ValueError("speculative decoding kind 'model' takes a draft model, and only it does")
        if cfg.draft_select not in ("adaptive", "all"):
            raise ValueError(f"draft_select must be 'adaptive' or 'all', got {cfg.draft_select!r}")
        if cfg.spec_kind and not 1 <= cfg.num_draft_tokens <= 32:
            raise ValueError(f"num_draft_tokens must be within [1, 32], got {cfg.num_draft_tokens}")
        if cfg.spec_kind:
            RowSpec(cfg.ngram_min, cfg.ngram_max)  # checks the n range now
        if cfg.draft_model is not None:
            check_draft_model(cfg.draft_model, model)
        self.drafter = None  # made on the engine thread (a draft model allocates its pool there)
        self.scheduler = Scheduler(self.allocator, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   max_model_len=self.max_model_len, drafter=self.drafter,
                                   windows=self.kv_groups.windows)
        eos = getattr(tokenizer, "eos_token_ids", None) or set()
        self._eos = frozenset(int(t) for t in eos)
        self.pool: KVPool | None = None
        self.runner: Runner | None = None
        # Tensor parallelism (engine/distributed.py): rank 0's channel to the
        # other ranks, or None in one process.
        self.channel = cfg.tp_channel
        self.on_death = None  # called with the error once the engine has died
        self._failure: str | None = None  # set by fail() (any thread)
        self._died = False
        self.ranks: list[dict] = []  # per rank: parameter and KV bytes
        # KV outside the pool (kv/connector.py): the SSD tier, opened on the
        # engine thread, or nothing.
        self.connector: KVConnector = NullConnector()

        self._cond = threading.Condition()
        self._incoming: deque = deque()
        self._aborts: deque = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._states: dict[str, _ReqState] = {}
        self._ahead = None  # (plan, logits) of the next step, built ahead (Scheduler.plan_ahead)
        self.alive = False
        self.error: str | None = None

        self.metrics = RequestMetrics()  # the one source of request metrics (/stats, /metrics)
        self.num_steps = 0
        self.num_steps_ahead = 0  # steps built while the one before evaluated
        self.num_steps_dropped = 0  # steps built ahead, then dropped unevaluated for a drafting step
        self.spec_drafts = 0  # rows that carried drafts
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0

    # -- lifecycle -----------------------------------------------------------
    def start(self, timeout: float | None = 600.0) -> "Engine":
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._main, name="mlxfast-engine", daemon=True)
        self.alive = True
        self._thread.start()
        self._ready.wait(timeout)
        if self.error:
            raise EngineDead(self.error)
        return self

    def shutdown(self, timeout: float | None = 10.0, ssd_flush_timeout: float | None = None) -> None:
        """Abort everything in flight (each gets FinishEvent "abort") and join the
        thread; then wait for pending SSD writes for up to the configured
        flush timeout, or ``ssd_flush_timeout`` when that is shorter."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self.alive = False
        flush = self.config.ssd_flush_timeout_s  # pending block writes; the directory is released
        self.connector.close(flush if ssd_flush_timeout is None else min(flush, ssd_flush_timeout))

    # -- public API (any thread) ---------------------------------------------
    def submit(self, request: Request) -> RequestStream:
        """Queue a request; call from inside a running asyncio loop."""
        if not self.alive or self._stopping:
            raise EngineDead(self.error or "the engine is not running")
        n = len(request.prompt_ids)
        if n == 0:
            raise PromptTooLong("the prompt is empty")
        if n >= self.max_model_len:
            raise PromptTooLong(
                f"the prompt has {n} tokens; the context holds {self.max_model_len} "
                f"(prompt plus at least one generated token)")
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request.request_id, loop,
                               stall_timeout_s=self.config.stream_stall_timeout_s,
                               max_unread=self.config.stream_max_unread)
        with self._cond:
            if len(self._incoming) + len(self.scheduler.waiting) >= self.config.max_waiting:
                raise EngineOverloaded(f"{self.config.max_waiting} requests are already waiting")
            self._incoming.append((request, stream))
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def flush_cache(self, timeout: float = 30.0) -> dict:
        """Write every cached block to the SSD tier and wait until it is durable
        (any thread; blocks). ``durable`` is False on timeout or failed writes."""
        def wake():
            with self._cond:
                self._cond.notify()

        return self.connector.flush(wake, timeout)

    def stats(self) -> dict:
        s = self.scheduler
        a = self.allocator
        return {
            "ssd": self.connector.stats(),
            "alive": self.alive,
            "error": self.error,
            "num_requests_running": len(s.running),
            "num_requests_waiting": s.num_waiting + len(self._incoming),
            **self.metrics.snapshot(),
            "prefix_cache_queries_total": s.prefix_queries,
            "prefix_cache_hits_total": s.prefix_hits,
            "kv_cache_usage_perc": a.usage,
            "num_preemptions_total": s.num_preemptions,
            "free_blocks": a.num_free,
            "total_blocks": a.num_blocks,
            "block_size": self.block_size,
            "kv_scheme": self.kv_spec.scheme_id,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_groups": self._group_stats(),
            "max_model_len": self.max_model_len,
            "num_steps": self.num_steps,
            "num_steps_ahead": self.num_steps_ahead,
            "num_steps_dropped": self.num_steps_dropped,
            "tensor_parallel_size": 1 if self.channel is None else self.channel.size,
            "ranks": self.ranks,  # per rank: parameter and KV pool bytes
            **({} if self.channel is None else {"tensor_parallel": self.channel.stats()}),
            "spec_decode": {"kind": self.config.spec_kind, "num_drafts": self.spec_drafts,
                            "num_draft_tokens": self.spec_draft_tokens,
                            "num_accepted_tokens": self.spec_accepted_tokens},
        }

    def _group_stats(self) -> list[dict]:
        """Per KV group: its window, layers and the blocks running sequences hold."""
        held = [0] * len(self.kv_groups)
        for seq in list(self.scheduler.running):
            for g, table in enumerate(list(seq.block_tables)):
                held[g] += len(table) - seq.num_released[g] if g < len(seq.num_released) else 0
        return [{"window": g.window, "layers": list(g.layers), "blocks_in_use": n}
                for g, n in zip(self.kv_groups.groups, held)]

    # -- engine thread -------------------------------------------------------
    def _main(self) -> None:
        cfg, bs = self.config, self.block_size
        try:
            self.pool = KVPool(self.model.kv_layers, self.num_blocks, self.block_size, self.kv_dtype,
                               kv_quant=self.kv_spec, release=not self.config.ssd_cache_dir)
            from ..models.shard import param_bytes

            own = (param_bytes(self.model), self.pool.nbytes)
            if self.channel is not None:  # every rank builds its pool of its heads' KV
                self.ranks = self.channel.setup(
                    {"num_blocks": self.num_blocks, "block_size": bs, "kv_dtype": str(self.kv_dtype).split(".")[-1],
                     "kv_quant": cfg.kv_quant, "kv_group_size": cfg.kv_group_size,
                     "release": not cfg.ssd_cache_dir, "native": cfg.native_attention}, own)
            else:
                self.ranks = [{"rank": 0, "param_bytes": own[0], "kv_bytes": own[1], "pid": os.getpid()}]
            self.runner = Runner(self.model, self.pool, native=cfg.native_attention, channel=self.channel)
            if cfg.head_choice and self.channel is None:
                self.model.prepare_head_choice()
            if self.config.spec_kind:
                draft = None
                if self.config.draft_model is not None:
                    from .draft import DraftModel

                    draft = DraftModel(self.config.draft_model, self.num_blocks, self.block_size,
                                       self.kv_dtype, native=self.config.native_attention,
                                       max_catchup=self.config.max_num_batched_tokens)
                self.drafter = self.scheduler.drafter = Drafter(
                    self.config.num_draft_tokens, draft, select_all=self.config.draft_select == "all",
                    ahead=self.config.async_scheduling and self.channel is None)
            if self.config.ssd_cache_dir:
                from ..kv.ssd import open_tier

                pool = self.pool
                if self.channel is not None:  # one file per block holds every rank's heads
                    from .distributed import ShardedKVPool

                    pool = ShardedKVPool(self.pool, self.channel)
                tier = open_tier(self.config, self._namespace, pool, self.allocator,
                                 self.model, self.tokenizer)
                if tier is not None:
                    self.connector = self.scheduler.connector = tier
        except BaseException as e:  # noqa: BLE001
            self._die(e)
            self._ready.set()
            return
        self._ready.set()
        connector = self.connector
        channel = self.channel
        try:
            while True:
                with self._cond:
                    while not (self._incoming or self._aborts or self._stopping or self._failure
                               or self.scheduler.has_work() or connector.has_work()):
                        timeout = connector.wait_timeout()
                        if channel is not None:  # idle ranks hear from rank 0 every heartbeat
                            timeout = min(timeout or channel.heartbeat_s, channel.heartbeat_s)
                        if not self._cond.wait(timeout):
                            break  # timed out: the connector has something due (or a heartbeat)
                    incoming = list(self._incoming)
                    self._incoming.clear()
                    aborts = list(self._aborts)
                    self._aborts.clear()
                    stopping = self._stopping
                    if self._failure:
                        raise ConnectionError(self._failure)
                for request, stream in incoming:
                    self._admit(request, stream)
                for rid in aborts:
                    self._abort(rid)
                if stopping:
                    for rid in list(self._states):
                        self._abort(rid)
                    connector.request_flush()  # write what is cached; shutdown() waits
                    connector.service(busy=False)
                    self._flush()
                    if channel is not None:
                        try:
                            channel.stop()
                        except RuntimeError as e:  # a rank already gone: we stop anyway
                            log.warning("tensor parallel: could not stop every rank: %s", e)
                    return
                connector.service(busy=self.scheduler.has_work())
                if self.scheduler.has_work():
                    self._step()
                elif channel is not None:
                    channel.ping_if_due()
                self._flush()
        except BaseException as e:  # noqa: BLE001
            self._die(e)

    def fail(self, reason: str, stuck_after_s: float = 1.0) -> None:
        """Kill the engine from another thread (tensor parallelism: a rank is
        gone). The engine thread dies at its next turn; one stuck in a
        collective that never returns is declared dead from here after
        ``stuck_after_s`` (it blocks in native code, touching nothing)."""
        with self._cond:
            self._failure = reason
            self._cond.notify_all()
        deadline = time.monotonic() + stuck_after_s
        while self.alive and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.alive:
            self._die(ConnectionError(reason))

    def _die(self, e: BaseException) -> None:
        with self._cond:
            if self._died:
                return
            self._died = True
        self.error = f"{type(e).__name__}: {e}"
        self.alive = False
        self._last_traceback = "" if sys.exc_info()[0] is None else traceback.format_exc()
        log.error("the engine stopped: %s\n%s", self.error, self._last_traceback)
        with self._cond:
            self._stopping = True
            pending = list(self._incoming)
            self._incoming.clear()
        for request, stream in pending:
            stream._deliver([FinishEvent("error", error=f"engine failed: {self.error}")])
        for rid, st in list(self._states.items()):
            st.events.append(FinishEvent("error", error=f"engine failed: {self.error}",
                                         prompt_tokens=len(st.request.prompt_ids)))
        self._flush()
        self._states.clear()
        if self.on_death is not None:
            self.on_death(self.error)

    def _flush(self) -> None:
        for rid, st in list(self._states.items()):
            if st.events:
                events, st.events = st.events, []
                st.stream._deliver(events)
                if isinstance(events[-1], FinishEvent):
                    fin = events[-1]
                    self.metrics.finished(fin.finish_reason, time.monotonic() - st.t_submit,
                                          fin.prompt_tokens, fin.completion_tokens)
                    del self._states[rid]

    def _admit(self, request: Request, stream: RequestStream) -> None:
        rid = request.request_id
        if rid in self._states:
            stream._deliver([FinishEvent("error", error=f"duplicate request id {rid!r}")])
            return
        st = _ReqState(request, stream)
        self._states[rid] = st
        self.metrics.admitted(len(request.prompt_ids))
        try:
            self._admit_seq(request, st)
        except Exception as e:  # noqa: BLE001  (this request's params, salt, grammar)
            log.exception("request %s failed at admission", rid)
            seq = self.scheduler.find(rid)
            if seq is not None:
                self.scheduler.finish(seq, "error")
            st.events.append(FinishEvent("error", error=f"{type(e).__name__}: {e}",
                                         prompt_tokens=len(request.prompt_ids)))

    def _admit_seq(self, request: Request, st: _ReqState) -> None:
        p = request.params
        seq = Seq(request.request_id, list(request.prompt_ids),
                  max_tokens=min(p.max_tokens, self.max_model_len - len(request.prompt_ids)),
                  stop_ids=frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self._eos),
                  namespace=f"{self._namespace}|{request.cache_salt}".encode(),
                  score_prompt=p.prompt_logprobs is not None, data=st)
        st.sampling = SamplingState.create(p, seq.tokens, seq.prompt_len, seq.stop_ids)
        st.out = OutputProcessor(self.tokenizer, p.stop, min_tokens=p.min_tokens,
                                 include_stop=p.include_stop_str_in_output,
                                 skip_special_tokens=p.skip_special_tokens)
        if self.config.spec_kind and speculation_allowed(p):
            st.spec = RowSpec(self.config.ngram_min, self.config.ngram_max, forced=p.grammar is not None,
                              pooled=self.drafter.pooled)
        if seq.max_tokens <= 0 and not seq.score_prompt:
            st.events.append(FinishEvent("length", prompt_tokens=seq.prompt_len))
            return
        self.scheduler.add(seq)

    def _abort(self, rid: str) -> None:
        st = self._states.get(rid)
        if st is None or (st.events and isinstance(st.events[-1], FinishEvent)):
            return
        seq = self.scheduler.find(rid)
        if seq is not None:
            self.scheduler.finish(seq, "abort")
            st.events.append(self._finish_event(seq, "abort"))
        else:
            st.events.append(FinishEvent("abort", prompt_tokens=len(st.request.prompt_ids)))

    def _finish_event(self, seq: Seq, reason: str, text: str = "", error: str | None = None,
                      stop_string: str | None = None) -> FinishEvent:
        st = seq.data
        if self.drafter is not None:
            self.drafter.release(seq)
        return FinishEvent(reason, text=text, stop_string=stop_string,
                           stop_token_id=seq.stop_token_id if reason == "stop" else None,
                           prompt_tokens=seq.prompt_len, completion_tokens=seq.num_output,
                           cached_tokens=seq.cached_tokens or 0, error=error,
                           speculation=None if not self.config.spec_kind else
                           {"drafted": st.spec.drafted, "accepted": st.spec.accepted} if st.spec else
                           {"drafted": 0, "accepted": 0})

    def _step(self) -> None:
        sched = self.scheduler
        t0 = time.perf_counter()  # the step's cost, drafting included
        host = None  # the host work nothing overlapped: this step's planning and build, its output
        if self._ahead is not None:  # built during the last step, already evaluating
            (plan, logits), self._ahead = self._ahead, None
        else:
            plan = sched.schedule()
            self.connector.save_evicted()  # before this step overwrites blocks the schedule evicted
            if not plan.rows:
                raise RuntimeError("scheduler produced an empty step with work pending")
            logits = self.runner.run(plan, argmax=self._head_chooses(plan))
            host = time.perf_counter() - t0
        for row, scores in logits.scores:
            self._score_prompt(row, scores)
        rows = plan.sample_rows
        if rows and not any(r.draft for r in rows) and self._can_pipeline():
            results = self._sample_pipelined(plan, logits)
        else:
            results = self._verify(logits, plan) if rows else []
        t1 = time.perf_counter()
        if self.drafter is not None:  # what a step costs, for choosing the drafts worth verifying
            self.drafter.step_done(plan.num_tokens, t1 - t0)
        by_seq = {r.seq: res for r, res in zip(rows, results)}
        updates = sched.update(plan, [[res.token for res in row_results] for row_results in results])
        self.num_steps += 1
        now = time.monotonic()
        per_seq: dict = {}
        for u in updates:
            per_seq.setdefault(u.seq, []).append(u)
        for seq, seq_updates in per_seq.items():
            st = seq.data
            if seq_updates[0].token is None:  # max_tokens == 0: the prompt is scored, nothing is generated
                st.events.append(self._finish_event(seq, seq_updates[0].finish_reason))
                continue
            # the step's tokens share its time (accepted drafts come with the next token)
            gap = None if st.t_last is None else (now - st.t_last) / len(seq_updates)
            for u in seq_updates:
                if gap is None:
                    self.metrics.token(ttft=now - st.t_submit, gap=None)
                    gap = 0.0
                else:
                    self.metrics.token(ttft=None, gap=gap)
                try:
                    self._emit(seq, st, u, by_seq[seq][u.k], after=len(seq_updates) - 1 - u.k)
                except Exception as e:  # noqa: BLE001  (this request's output processing)
                    log.exception("request %s failed in output processing", seq.request_id)
                    after = len(seq_updates) - 1 - u.k
                    if after:
                        del seq.tokens[-after:]
                    sched.finish(seq, "error")
                    st.events.append(self._finish_event(seq, "error", error=f"{type(e).__name__}: {e}"))
                if st.events and isinstance(st.events[-1], FinishEvent):
                    break  # it ended here: what the step accepted after that is dropped
            st.t_last = now
        for r in plan.rows:
            seq = r.seq
            if seq.score_prompt and r.start + r.n == seq.prompt_len:
                # The prompt is done this step, so this step's first event is the request's first.
                seq.score_prompt = False  # a recompute after preemption takes cache hits again
                if seq.data.events:
                    seq.data.events[0].prompt_logprobs = [None, *seq.data.prompt_lps]
        if host is not None and self.drafter is not None and self._ahead is None:
            self.drafter.host_done(host + time.perf_counter() - t1)

    def _head_chooses(self, plan) -> bool:
        """Whether the step's head may choose its tokens (every sampled row
        greedy and reading nothing else from its logits: ``head_choice_ok``)."""
        rows = plan.sample_rows
        return (self.config.head_choice and bool(rows)
                and all(head_choice_ok(r.seq.data.sampling) for r in rows))

    def _can_pipeline(self) -> bool:
        """Whether the next step may be built while this one evaluates
        (``Scheduler.plan_ahead`` decides which steps can): not with drafts
        (they need the tokens: with prompt lookup the step is built undrafted
        and dropped once its tokens show drafts worth verifying,
        ``Drafter.peek``; a draft model's never), tensor parallelism (its step
        is evaluated on every rank at once) or requests arriving while a batch
        slot is free (they are admitted next)."""
        return (self.config.async_scheduling and self.channel is None
                and not (self._incoming and not self.scheduler.batch_full()) and not self._stopping
                and (self.drafter is None or self.drafter.may_build_ahead()))

    def _sample_pipelined(self, plan, step) -> list[list[Sampled]]:
        """Sample a plain decode step and, while its draw evaluates, build the
        next step on the drawn tokens (vLLM's async scheduling); the next
        step is queued once this one's tokens are known (queued earlier, its
        KV writes would copy the pools this step still reads), so the host
        work on them (update, output, events) overlaps its evaluation."""
        rows = plan.sample_rows
        states = [r.seq.data.sampling for r in rows]
        logits = step.sample
        try:
            pending = chosen(step.tokens, states) if step.tokens is not None else sample_async(logits, states)
        except Exception as e:  # noqa: BLE001  (a row's processing: _sample finds it)
            return self._draw_failed(e, plan, logits, states)
        pool = self.pool.scheme
        before = pool.arrays()  # what the pools were, should the draw fail
        nxt = self.scheduler.plan_ahead(plan)
        if nxt is not None:
            self.connector.save_evicted()
            where = {r.seq: i for i, r in enumerate(rows)}
            idx = [where[r.seq] for r in nxt.rows]
            tokens = pending.tokens if len(idx) == len(rows) else pending.tokens[mx.array(idx)]
            nxt_logits = self.runner.run(nxt, inputs=tokens, argmax=self._head_chooses(nxt))
        try:
            flat = pending.collect()
        except Exception as e:  # noqa: BLE001
            if nxt is not None:  # drop the next step (unevaluated): the pools as they were;
                pool.restore(before)  # its rows keep the blocks it grew, as their next step would
            return self._draw_failed(e, plan, logits, states)
        if self.drafter is not None:  # score this step's proposals against its tokens
            for r, res in zip(rows, flat):
                if r.seq.data.spec is not None:
                    self.drafter.verified(r.seq, r.start + r.n, [res.token], 0, 0)
            if nxt is not None and self.scheduler.wants_drafts(nxt, {r.seq: res.token for r, res in zip(rows, flat)}):
                pool.restore(before)  # dropped unevaluated: the next step, scheduled anew, drafts
                nxt = None
                self.num_steps_dropped += 1
        del before
        if nxt is not None:
            mx.async_eval(*(a for a in (nxt_logits.sample, nxt_logits.tokens) if a is not None),
                          *pool.arrays())
            self._ahead = (nxt, nxt_logits)
            self.num_steps_ahead += 1
        return [[s] for s in flat]

    def _draw_failed(self, e, plan, logits, states) -> list[list[Sampled]]:
        """A plain step's draw failed: each row sampled alone (``_sample``);
        where the head chose the tokens, from the step's logits computed again
        (its KV writes are the same values)."""
        rows = plan.sample_rows
        if logits is None:
            log.error("the step's greedy choice failed (%s: %s); computing its logits",
                      type(e).__name__, e)
            logits = self.runner.run(plan).sample
        return [[s] for s in self._sample(logits, states, [0] * len(rows),
                                          [r.seq.request_id for r in rows])]

    def _score_prompt(self, row, logits) -> None:
        seq, st = row.seq, row.seq.data
        targets = seq.prompt_ids[row.start + 1:row.start + 1 + logits.shape[0]]
        del st.prompt_lps[row.start:]  # preempted while scoring: it starts over
        st.prompt_lps += score_tokens(logits, targets, st.request.params.prompt_logprobs)

    def _verify(self, step, plan) -> list[list[Sampled]]:
        """Per sampled row: its next token, sampled as without speculation,
        preceded by the drafts that sampling reproduces. The row's logits at
        its last known token and at each draft are sampled in one call, each
        position with its own noise (``sample(ahead=)``); draft j is accepted
        while every draft before it was and the token sampled at its position
        equals it. For greedy rows that is the argmax; for sampled rows it is
        speculative sampling with a deterministic proposal (accept with p(d),
        else draw from the rest of p), so the output is the target's, token
        for token under a seed."""
        rows = plan.sample_rows
        states, ahead, names, at = [], [], [], []  # at: where each position's logits are
        forced: dict[int, list[Sampled]] = {}  # a grammar row's drafts: the tokens it forces
        counts = []  # positions sampled per row
        i = 0
        for k, r in enumerate(rows):
            n = 1 + len(r.draft)
            first = 0
            if r.draft and r.seq.data.spec.forced:
                forced[k] = self._forced(step.sample[i:i + len(r.draft)], r)
                first = len(r.draft)  # only the position after them is sampled ...
                if forced[k][0].error is None and r.seq.data.sampling.matcher.is_stopped():
                    first = n  # ... unless the forced tokens end the grammar: the answer ends there
            for j in range(first, n):
                states.append(r.seq.data.sampling)
                ahead.append(j)
                names.append(r.seq.request_id)
                at.append(i + j)
            counts.append(n - first)
            i += n
        flat = None
        if step.tokens is not None:  # the head's choice (no grammar rows: every position sampled)
            try:
                flat = [Sampled(int(t)) for t in step.tokens.tolist()]
            except Exception as e:  # noqa: BLE001  (as a failed draw: from the logits, row by row)
                log.error("the step's greedy choice failed (%s: %s); computing its logits",
                          type(e).__name__, e)
                step = self.runner.run(plan)
        if flat is None:
            logits = step.sample if len(at) == i else step.sample[mx.array(at, dtype=mx.int32)]
            flat = self._sample(logits, states, ahead, names) if at else []
        out, i = [], 0
        for k, r in enumerate(rows):
            res = forced.get(k, []) + flat[i:i + counts[k]]
            i += counts[k]
            if len(res) == len(r.draft):  # the grammar ended with its forced tokens: no token after them
                accepted, n_acc = res, len(res)
            else:
                accepted = [res[0]]
                for j, d in enumerate(r.draft):
                    if res[j].error is not None or res[j].token != d:
                        break
                    accepted.append(res[j + 1])
                n_acc = len(accepted) - 1
            out.append(accepted)
            if r.seq.data.spec is not None:
                self.drafter.verified(r.seq, r.start + r.n, [s.token for s in accepted], len(r.draft), n_acc)
            if r.draft:
                self.spec_drafts += 1
                self.spec_draft_tokens += len(r.draft)
                self.spec_accepted_tokens += n_acc
        return out

    def _forced(self, logits, row) -> list[Sampled]:
        """A grammar row's drafted forced tokens as its results at those
        positions (with their logprobs, where asked), consumed by its grammar
        so the position after them samples from the advanced state."""
        st = row.seq.data
        p = st.request.params
        out = [Sampled(t) for t in row.draft]
        if p.logprobs or p.top_logprobs:
            for res, sc in zip(out, score_tokens(logits, row.draft, p.top_logprobs)):
                res.logprob = sc.logprob
                res.top_logprobs = sc.top_logprobs if p.top_logprobs else None
        matcher = st.sampling.matcher
        try:
            if not matcher.consume_tokens(list(row.draft)) or matcher.is_error():
                raise ValueError(matcher.get_error() or "forced tokens rejected")
        except Exception as e:  # noqa: BLE001  (this row's grammar)
            out[0].error = f"grammar error: {type(e).__name__}: {e}"
        return out

    def _sample(self, logits, states, ahead, names) -> list[Sampled]:
        """One token per logits row. A failure of the batched call is
        attributed by sampling each row alone: a row that fails alone gets an
        error result (its request ends), the others their tokens."""
        try:
            return sample(logits, states, ahead)
        except Exception:  # noqa: BLE001
            log.exception("batched sampling failed; sampling %d rows one by one", len(states))
        out = []
        for i, (state, a) in enumerate(zip(states, ahead)):
            try:
                out.append(sample(logits[i:i + 1], [state], [a])[0])
            except Exception as e:  # noqa: BLE001
                log.exception("request %s failed in sampling", names[i])
                out.append(Sampled(0, error=f"sampling failed: {type(e).__name__}: {e}"))
        return out

    def _emit(self, seq: Seq, st: _ReqState, u, res, after: int = 0) -> None:
        """Output for one new token; ``after`` more tokens of this step follow
        it in ``seq.tokens``, which an end here drops."""
        sched = self.scheduler

        def end(reason, **kw):
            if after:  # the step's tokens after this one are dropped (a stop token among them too)
                del seq.tokens[-after:]
                seq.stop_token_id = None
            sched.finish(seq, reason)
            st.events.append(self._finish_event(seq, reason, **kw))

        if res.error is not None:
            end("error", error=res.error)
            return
        if u.finish_reason == "stop" and seq.stop_token_id is not None:
            # The stop token is a generated token (counted, with its logprob,
            # as vLLM gives it) that adds no text: what was held comes out.
            st.events.append(TokenEvent(u.token, st.out.finish(), res.logprob, res.top_logprobs,
                                        cached_tokens=seq.cached_tokens or 0))
            st.events.append(self._finish_event(seq, "stop"))
            return
        text = st.out.add(u.token)
        st.events.append(TokenEvent(u.token, text, res.logprob, res.top_logprobs,
                                    cached_tokens=seq.cached_tokens or 0))
        if st.out.stop_string is not None:
            end("stop", stop_string=st.out.stop_string)
        elif u.finish_reason is not None:
            st.events.append(self._finish_event(seq, u.finish_reason, text=st.out.finish()))
        elif after == 0 and st.sampling.matcher is not None and st.sampling.matcher.is_stopped():
            end("stop", text=st.out.finish())  # the grammar has consumed the step's last token
