"""Helpers shared by the SSD-tier engine tests: an engine over the tiny
model, random prompts, one greedy request (bounded in time), and the tokens
the same request gets with no cache at all."""

from __future__ import annotations

import random
import threading

from engine_utils import ToyTokenizer, greedy, run_requests
from mlxfast.engine.api import Request
from mlxfast.engine.config import EngineConfig
from mlxfast.engine.engine import Engine

BS = 8


def engine(model, **kw):
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", BS)
    return Engine(model, ToyTokenizer(), EngineConfig(**kw)).start()


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1, 97) for _ in range(n)]


def ask(eng, p, n=8, salt="", timeout=120.0):
    """Greedy tokens and FinishEvent of one request; fails (instead of
    hanging) past ``timeout``."""
    out = []
    t = threading.Thread(target=lambda: out.append(
        run_requests(eng, [Request(p, greedy(n, ignore_eos=True), cache_salt=salt)])[0]), daemon=True)
    t.start()
    t.join(timeout)
    assert out, f"the request did not finish in {timeout}s"
    toks, _, fin = out[0]
    return toks, fin


_cold_cache: dict = {}


def cold(model, p, n=8, **kw):
    """The tokens of ``ask`` on an engine with no prefix cache and no SSD tier."""
    key = (id(model), tuple(p), n, tuple(sorted(kw.items())))
    if key not in _cold_cache:
        e = engine(model, enable_prefix_cache=False, **kw)
        try:
            _cold_cache[key] = ask(e, p, n)[0]
        finally:
            e.shutdown()
    return _cold_cache[key]
