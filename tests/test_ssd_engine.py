"""The SSD tier inside the engine, on a tiny random model: restored blocks give
the same greedy tokens as a cold run; spills, write-behind, demotion, the byte
cap, corruption, locking and an unwritable disk."""

import logging
import shutil
import time

import pytest

from engine_utils import greedy, tiny_model
from mlxfast.engine.api import Request
from ssd_utils import BS, ask, cold, engine, prompt


@pytest.fixture(scope="module")
def model():
    return tiny_model(3, layers=2)


def files(d):
    return sorted(d.glob("ns-*/*.kv"))


@pytest.mark.parametrize("kv_quant", ["off", "8"])
def test_restart_restores_identical_tokens(model, tmp_path, kv_quant):
    p = prompt(1, 203)
    ext = p + [5, 6, 7, 8, 9]
    e = engine(model, ssd_cache_dir=str(tmp_path), kv_quant=kv_quant, kv_group_size=16)
    try:
        ask(e, p)
        r = e.flush_cache(30)
        assert r["durable"] and r["pending_writes"] == 0 and r["entries"] >= 203 // BS
    finally:
        e.shutdown()
    assert not list(tmp_path.glob("ns-*/*.tmp"))
    e = engine(model, ssd_cache_dir=str(tmp_path), kv_quant=kv_quant, kv_group_size=16)
    try:
        assert e.stats()["ssd"]["entries"] >= 203 // BS
        toks, fin = ask(e, ext)
        s = e.stats()["ssd"]
    finally:
        e.shutdown()
    assert toks == cold(model, ext, kv_quant=kv_quant, kv_group_size=16)
    assert fin.cached_tokens == (len(ext) - 1) // BS * BS  # every full block before the last token
    assert s["restores"] == 1 and s["restored_blocks"] == (len(ext) - 1) // BS


def test_evicted_blocks_spill_and_come_back(model, tmp_path):
    a, b = prompt(2, 150), prompt(3, 150)
    e = engine(model, ssd_cache_dir=str(tmp_path), num_blocks=24)  # 192 slots: b evicts a
    try:
        e.connector.debounce_s = 60.0  # no write-behind: only the eviction path writes
        ask(e, a)
        ask(e, b)
        s = e.stats()["ssd"]
        assert s["spilled_blocks"] > 0 and s["write_behind_blocks"] == 0
        e.flush_cache(30)  # the spills land in the index once written
        toks, fin = ask(e, a + [1, 2, 3])
        s = e.stats()["ssd"]
        e.allocator.check()
    finally:
        e.shutdown()
    assert s["restored_blocks"] > 0 and fin.cached_tokens >= 8 * BS
    assert toks == cold(model, a + [1, 2, 3], num_blocks=24)


def test_write_behind_and_demotion(model, tmp_path):
    p = prompt(4, 100)
    e = engine(model, ssd_cache_dir=str(tmp_path), ssd_demote_idle_s=0.3)
    try:
        e.connector.debounce_s = 0.05
        ask(e, p)
        deadline = time.time() + 10
        while time.time() < deadline and e.stats()["ssd"]["demoted_blocks"] < 100 // BS:
            time.sleep(0.05)
        s = e.stats()["ssd"]
        assert s["write_behind_blocks"] >= 100 // BS and s["demoted_blocks"] >= 100 // BS
        assert not e.allocator.cached  # their RAM is free again
        toks, fin = ask(e, p + [9])
        assert e.stats()["ssd"]["restored_blocks"] >= 100 // BS
    finally:
        e.shutdown()
    assert toks == cold(model, p + [9]) and fin.cached_tokens == 100 // BS * BS


def test_byte_cap_enforced(model, tmp_path):
    per_file = 4096 + 2 * 2 * BS * 2 * 16 * 4  # header + K,V of 2 layers (fp32, 2 kv heads, dim 16)
    cap_gb = 10 * per_file / (1 << 30)
    e = engine(model, ssd_cache_dir=str(tmp_path), ssd_cache_max_gb=cap_gb, kv_dtype="float32")
    try:
        assert e.connector.block_bytes == per_file
        for seed in range(3):
            ask(e, prompt(10 + seed, 60))
            e.flush_cache(30)
        s = e.stats()["ssd"]
    finally:
        e.shutdown()
    assert s["bytes"] <= 10 * per_file and s["entries"] <= 10 and s["evicted_files"] > 0
    assert len(files(tmp_path)) == s["entries"]


def test_byte_cap_covers_the_directory(model, tmp_path):
    """Another configuration's namespace and quarantined files count against
    the cap too, and go first (quarantine, then the oldest): the cap held
    only the live namespace's files, so a small cap left a directory of many
    times its size."""
    per_file = 4096 + 2 * 2 * BS * 2 * 16 * 4  # fp32 KV, as test_byte_cap_enforced
    e = engine(model, ssd_cache_dir=str(tmp_path), kv_dtype="float16")  # another namespace
    try:
        for seed in range(3):
            ask(e, prompt(20 + seed, 60))
        e.flush_cache(30)
    finally:
        e.shutdown()
    other = files(tmp_path)
    assert len(other) >= 9
    (tmp_path / "quarantine").mkdir(exist_ok=True)
    (tmp_path / "quarantine" / "junk.kv").write_bytes(b"x" * per_file)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.kv"  # a link is never followed
    outside.write_bytes(b"y" * 100)
    (tmp_path / "quarantine" / "link.kv").symlink_to(outside)
    cap = 6 * per_file
    e = engine(model, ssd_cache_dir=str(tmp_path), ssd_cache_max_gb=cap / (1 << 30), kv_dtype="float32")
    try:
        for seed in range(2):
            ask(e, prompt(30 + seed, 60))
            e.flush_cache(30)
        s = e.stats()["ssd"]
    finally:
        e.shutdown()
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file() and not f.is_symlink()
                  and f.parent.name.startswith(("ns-", "quarantine")))
    assert on_disk <= cap and s["bytes"] + s["other_bytes"] <= cap
    assert not (tmp_path / "quarantine" / "junk.kv").exists() and outside.read_bytes() == b"y" * 100
    assert s["entries"] > 0  # the live namespace keeps its newest files


def test_corrupt_and_foreign_files_are_quarantined(model, tmp_path):
    p = prompt(5, 120)
    e = engine(model, ssd_cache_dir=str(tmp_path))
    try:
        ask(e, p)
        assert e.flush_cache(30)["durable"]
    finally:
        e.shutdown()
    fs = files(tmp_path)
    assert len(fs) >= 4
    with open(fs[0], "r+b") as f:  # header byte
        f.seek(30)
        f.write(b"\xff")
    with open(fs[1], "r+b") as f:  # data byte: found on restore (verify on)
        f.seek(5000)
        c = f.read(1)
        f.seek(5000)
        f.write(bytes([c[0] ^ 1]))
    with open(fs[2], "r+b") as f:
        f.truncate(4096 + 17)
    other = tiny_model(99, layers=2)  # another model's block under a plausible name
    e2 = engine(other, num_blocks=64, ssd_cache_dir=str(tmp_path / "other"))
    try:
        ask(e2, prompt(6, 20))
        e2.flush_cache(30)
    finally:
        e2.shutdown()
    foreign = files(tmp_path / "other")[0]
    shutil.copy(foreign, fs[0].parent / ("ab" * 16 + ".kv"))
    e = engine(model, ssd_cache_dir=str(tmp_path))  # data checksums are verified by default
    try:
        assert e.stats()["ssd"]["quarantined"] == 3  # header, truncation, foreign: at scan
        toks, fin = ask(e, p + [3, 4])
        s = e.stats()["ssd"]
    finally:
        e.shutdown()
    assert toks == cold(model, p + [3, 4])
    q = list((tmp_path / "quarantine").iterdir())
    if fs[1].exists():  # the data flip is caught when its chain is restored
        assert s["restore_failures"] == 0
    else:
        assert s["quarantined"] == 4 and len(q) == 4
    assert len(q) >= 3


def test_second_server_on_same_directory_runs_ram_only(model, tmp_path, caplog):
    e1 = engine(model, ssd_cache_dir=str(tmp_path))
    try:
        with caplog.at_level(logging.WARNING, logger="mlxfast.ssd"):
            e2 = engine(model, ssd_cache_dir=str(tmp_path))
        try:
            assert e1.connector.enabled and not e2.connector.enabled
            assert "in use by another server" in caplog.text
            p = prompt(7, 40)
            assert ask(e2, p)[0] == cold(model, p)
        finally:
            e2.shutdown()
    finally:
        e1.shutdown()
    e3 = engine(model, ssd_cache_dir=str(tmp_path))  # the lock went with e1
    try:
        assert e3.connector.enabled
    finally:
        e3.shutdown()


def test_unwritable_disk_keeps_serving(model, tmp_path, caplog):
    e = engine(model, ssd_cache_dir=str(tmp_path))
    try:
        shutil.rmtree(e.connector.dir)  # every write now fails (ENOENT)
        p = prompt(8, 80)
        with caplog.at_level(logging.WARNING, logger="mlxfast.ssd"):
            ask(e, p)
            r = e.flush_cache(30)
            toks, _ = ask(e, p + [1])
            e.flush_cache(30)
        assert not r["durable"] and r["failed_writes"] > 0
        assert caplog.text.count("cannot write") == 1  # warned once
    finally:
        e.shutdown()
    assert toks == cold(model, p + [1])


def test_abort_while_restoring(model, tmp_path):
    p = prompt(9, 200)
    e = engine(model, ssd_cache_dir=str(tmp_path))
    try:
        ask(e, p)
        e.flush_cache(30)
    finally:
        e.shutdown()
    e = engine(model, ssd_cache_dir=str(tmp_path))
    try:
        import asyncio

        async def go():
            stream = e.submit(Request(p + [1], greedy(4, ignore_eos=True)))
            await stream.aclose()  # aborted while its blocks are being read

        asyncio.run(go())
        toks, _ = ask(e, p + [2])
        time.sleep(0.1)
        e.allocator.check()
        assert all(rc == 0 for rc in e.allocator.refcount) and not e.connector.holds
    finally:
        e.shutdown()
    assert toks == cold(model, p + [2])


def test_flush_route_and_metrics(fake_client):
    client, eng = fake_client("hi", api_key="k")
    auth = {"Authorization": "Bearer k"}
    assert client.post("/admin/cache/flush").status_code == 401  # admin routes need the key
    r = client.post("/admin/cache/flush", headers=auth)
    assert r.status_code == 200 and r.json() == {"durable": True, "enabled": False}
    calls = []

    def flush_cache(timeout):
        calls.append(timeout)
        return {"durable": len(calls) == 1, "pending_writes": len(calls) - 1, "failed_writes": 0}

    eng.flush_cache = flush_cache
    r = client.post("/admin/cache/flush?timeout=5", headers=auth)
    assert r.status_code == 200 and r.json()["durable"] is True and calls == [5.0]
    r = client.post("/admin/cache/flush", headers=auth)
    assert r.status_code == 503 and r.json() == {"durable": False, "pending_writes": 1, "failed_writes": 0}
    assert client.post("/admin/cache/flush?timeout=x", headers=auth).status_code == 400
    eng.stats = lambda: {"ssd": {"enabled": True, "entries": 7, "restored_blocks": 3, "quarantined": 1}}
    text = client.get("/metrics").text
    assert 'mlxfast:ssd_cache_entries{model_name="fake"} 7.0' in text
    assert "mlxfast:ssd_cache_restored_blocks_total" in text and "mlxfast:ssd_cache_quarantined_total" in text
    assert client.get("/stats", headers=auth).json()["engine"]["ssd"]["entries"] == 7


def test_shutdown_flushes_without_an_explicit_flush(model, tmp_path):
    p = prompt(11, 90)
    e = engine(model, ssd_cache_dir=str(tmp_path))
    try:
        e.connector.debounce_s = 60.0  # nothing written behind before the shutdown
        ask(e, p)
    finally:
        e.shutdown()
    assert len(files(tmp_path)) >= 90 // BS and not list(tmp_path.glob("ns-*/*.tmp"))
    e = engine(model, ssd_cache_dir=str(tmp_path))
    try:
        toks, fin = ask(e, p + [4])
    finally:
        e.shutdown()
    assert fin.cached_tokens == 90 // BS * BS and toks == cold(model, p + [4])
