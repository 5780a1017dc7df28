"""The SSD tier with real server processes and the default model: restart
survival, kill -9 while writing, corrupt/truncated/foreign files.

Prefill of the default model is slow on a CPU, so each cold answer is
computed once and shared: one 4,000-token prompt (restart survival) and one
800-token prompt (crash and corruption)."""

import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port, start_server, wait_healthy
from mlxfast import _ext

pytestmark = pytest.mark.slow

BS = 16  # EngineConfig.block_size default


class Proc:
    def __init__(self, ssd_dir: Path, *extra: str):
        self.port = free_port()
        self.proc = start_server(self.port, "--ssd-cache", str(ssd_dir), "--max-tokens", "8", *extra)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_healthy(self.url, self.proc)

    def complete(self, ids, max_tokens=8, salt=None):
        body = {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
        if salt:
            body["cache_salt"] = salt
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=900)
        assert r.status_code == 200, r.text
        j = r.json()
        return j["choices"][0]["text"], j["usage"]

    def flush(self, timeout=120):
        return httpx.post(self.url + "/admin/cache/flush", timeout=timeout + 30)

    def ssd_stats(self):
        return httpx.get(self.url + "/stats", timeout=30).json()["engine"]["ssd"]

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err
        return out, err

    def kill9(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.communicate(timeout=30)


def tokens(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def block_files(d: Path):
    return sorted(d.glob("ns-*/*.kv"))


def test_restart_survival(tmp_path):
    prompt, suffix = tokens(1, 4000), tokens(2, 9)
    d = tmp_path / "ssd"
    a = Proc(d)
    try:
        cold_text, cold_usage = a.complete(prompt + suffix, salt="cold-reference")  # never shared
        assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0
        a.complete(prompt, max_tokens=2)
        r = a.flush()
        assert r.status_code == 200 and r.json()["durable"] is True, r.text
        assert r.json()["pending_writes"] == 0 and r.json()["entries"] >= len(prompt) // BS
    finally:
        a.stop()
    assert not list(d.glob("ns-*/*.tmp"))
    b = Proc(d)
    try:
        assert b.ssd_stats()["entries"] >= len(prompt) // BS
        t0 = time.perf_counter()
        text, usage = b.complete(prompt + suffix)
        warm_s = time.perf_counter() - t0
        s = b.ssd_stats()
        metrics = httpx.get(b.url + "/metrics", timeout=30).text
    finally:
        b.stop()
    assert text == cold_text
    assert usage["prompt_tokens_details"]["cached_tokens"] >= len(prompt) // BS * BS
    assert s["restores"] == 1 and s["restored_blocks"] >= len(prompt) // BS
    assert "mlxfast:ssd_cache_restored_blocks_total" in metrics
    print(f"restart: restored {s['restored_blocks']} blocks in {s['restore_seconds']:.2f}s; "
          f"request {warm_s:.2f}s")


def _quiet(fn):
    def run():
        try:
            fn()
        except httpx.HTTPError:
            pass  # the server was killed under it

    return run


@pytest.fixture(scope="module")
def crash_dir(tmp_path_factory):
    """An 800-token prompt's cold answer, and a cache dir left by kill -9 mid-write."""
    d = tmp_path_factory.mktemp("crash") / "ssd"
    q = tokens(3, 800)
    c = Proc(d)
    try:
        cold_text, _ = c.complete(q)
        deadline = time.time() + 30
        while len(block_files(d)) < 8 and time.time() < deadline:  # some written behind
            time.sleep(0.05)
        flusher = threading.Thread(target=_quiet(c.flush), daemon=True)
        flusher.start()
        time.sleep(0.05)  # writes of the blocks not yet written behind are in flight
    finally:
        c.kill9()
    flusher.join(5)
    return d, q, cold_text


def test_kill9_while_writing_then_restart(crash_dir):
    d, q, cold_text = crash_dir
    c = Proc(d)
    try:
        s0 = c.ssd_stats()
        assert s0["quarantined"] == 0  # no torn file under a final name
        assert not list(d.glob("ns-*/*.tmp"))  # leftovers removed at start-up
        text, usage = c.complete(q)
        s = c.ssd_stats()
    finally:
        c.stop()
    assert text == cold_text
    assert usage["prompt_tokens_details"]["cached_tokens"] == s["restored_blocks"] * BS
    print(f"after kill -9: {s0['entries']} blocks survived, {s0['tmp_removed']} .tmp removed")


def test_corrupt_truncated_and_foreign_files(crash_dir):
    d, q, cold_text = crash_dir
    fs = block_files(d)
    assert len(fs) >= 6
    ns_dir = fs[0].parent
    rng = random.Random(5)
    picks = rng.sample(fs, 3)
    with open(picks[0], "r+b") as f:  # header: the namespace field
        f.seek(17)
        f.write(b"\x5a")
    with open(picks[1], "r+b") as f:  # data: found on restore with --ssd-cache-verify
        f.seek(4096 + 1234)
        c = f.read(1)
        f.seek(4096 + 1234)
        f.write(bytes([c[0] ^ 0x40]))
    with open(picks[2], "r+b") as f:
        f.truncate(picks[2].stat().st_size // 2)
    # a block of another model: a sound file whose header names another namespace
    raw = fs[-1].read_bytes() if fs[-1] not in picks else fs[0].read_bytes()
    import mlx.core as mx
    import numpy as np

    data = mx.array(np.frombuffer(raw[4096:], np.uint8).copy())
    layout = raw[84:84 + int.from_bytes(raw[80:84], "little")].decode()
    other = ns_dir.parent / "other"
    other.mkdir()
    key = bytes(range(16))
    w = _ext.KVWriter(str(other), 1 << 30)
    w.submit([key.hex() + ".kv"], [key], [BS], 0xDEADBEEF, layout, [data.reshape(1, -1)], 1)
    assert w.wait_idle(30)
    w.close()
    (other / (key.hex() + ".kv")).rename(ns_dir / (key.hex() + ".kv"))

    c = Proc(d, "--ssd-cache-verify")
    try:
        s0 = c.ssd_stats()
        text, _ = c.complete(q)
        s = c.ssd_stats()
    finally:
        c.stop()
    assert s0["quarantined"] == 3  # header flip, truncation, foreign namespace: at the scan
    assert text == cold_text
    quarantined = {p.name for p in (d / "quarantine").iterdir()}
    assert {picks[0].name, picks[2].name, key.hex() + ".kv"} <= quarantined
    if picks[1].exists():  # not on the restored run (the chain broke earlier)
        assert s["quarantined"] == 3
    else:
        assert s["quarantined"] == 4 and picks[1].name in quarantined


def test_second_server_on_same_dir_runs_ram_only(tmp_path):
    d = tmp_path / "ssd"
    a = Proc(d)
    try:
        b = Proc(d)
        try:
            assert a.ssd_stats()["enabled"] is True
            assert b.ssd_stats() == {"enabled": False}
            r = b.flush()
            assert r.status_code == 200 and r.json()["enabled"] is False
        finally:
            _, err = b.stop()
        assert "in use by another server" in err
    finally:
        a.stop()
