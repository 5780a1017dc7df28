"""The SSD tier's native I/O (csrc/io): XXH64, block files, the writer thread
(atomic writes, fsync, byte-capped queue), the reader (checks, zero-copy
arrays) and the start-up scan (tmp removal, quarantine)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxfast import _ext

NS = 0x1234_5678_9ABC_DEF0
ROWS = 4
LAYOUT = "test;float16:4x2x8;uint32:4x3"
SPECS = [("float16", [ROWS, 2, 8], ROWS * 2 * 8 * 2), ("uint32", [ROWS, 3], ROWS * 3 * 4)]
HDR = _ext.kv_header_size()


def blocks(n, seed=0):
    rng = np.random.default_rng(seed)
    a = mx.array(rng.standard_normal((n * ROWS, 2, 8)).astype(np.float16))
    b = mx.array(rng.integers(0, 2**32, (n * ROWS, 3), dtype=np.uint32))
    return a, b


def keys(n, salt=b""):
    return [bytes([i % 256, i // 256]) + salt + bytes(14 - len(salt)) for i in range(n)]


def write(dir, n, seed=0, ns=NS, layout=LAYOUT, cap=1 << 30, salt=b""):
    w = _ext.KVWriter(str(dir), cap)
    ks = keys(n, salt)
    w.submit([k.hex() + ".kv" for k in ks], ks, [ROWS] * n, ns, layout, list(blocks(n, seed)), ROWS)
    assert w.wait_idle(30)
    st = w.stats()
    w.close()
    return ks, st


def read(dir, ks, verify=False, ns=NS, layout=LAYOUT):
    r = _ext.KVReader(str(dir))
    job = r.submit([k.hex() + ".kv" for k in ks], ks, SPECS, ns, layout, verify)
    assert r.wait(job, 30)
    (res,) = r.poll()
    r.close()
    return res


def scan(dir, verify=False, ns=NS, layout=LAYOUT):
    return _ext.kv_scan(str(dir), str(dir.parent / "quarantine"), ns, layout, verify)


def test_xxh64_reference_vectors():
    # Values of the reference implementation (libxxhash 0.8).
    assert _ext.xxh64(b"") == 0xEF46DB3751D8E999
    assert _ext.xxh64(b"abc") == 0x44BC2CF5AD770999
    assert _ext.xxh64(b"mlxfast", 7) == 0x9A17F61C20C45511
    data = bytes(range(256)) * 5
    assert _ext.xxh64(data) != _ext.xxh64(data[:-1] + b"\x01")


def test_write_read_roundtrip_zero_copy(tmp_path):
    d = tmp_path / "ns"
    d.mkdir()
    ks, st = write(d, 5)
    assert st["written"] == 5 and st["failed"] == 0 and st["dropped"] == 0
    assert st["file_syncs"] == 5 and st["dir_syncs"] >= 1  # fdatasync per file, directory synced
    files = sorted(p.name for p in d.iterdir())
    assert files == sorted(k.hex() + ".kv" for k in ks)  # no .tmp left, final names only
    size = (d / files[0]).stat().st_size
    assert size == HDR + sum(s[2] for s in SPECS)
    res = read(d, ks, verify=True)
    _id, n_total, n_ok, fail_name, reason, missing, secs, nbytes, arrays = res
    assert (n_total, n_ok, reason) == (5, 5, "")
    a, b = blocks(5)
    assert arrays[0].dtype == mx.float16 and arrays[0].shape == (5 * ROWS, 2, 8)
    assert mx.array_equal(arrays[0], a).item() and mx.array_equal(arrays[1], b).item()
    # partial runs: a subset of keys in any order reads those blocks
    res = read(d, [ks[3], ks[1]])
    assert res[2] == 2 and mx.array_equal(res[8][0][:ROWS], a[3 * ROWS:4 * ROWS]).item()
    entries, tmp_removed, quarantined, _ = scan(d, verify=True)
    assert len(entries) == 5 and tmp_removed == 0 and quarantined == 0


def test_queue_byte_cap_drops_oldest(tmp_path):
    d = tmp_path / "ns"
    d.mkdir()
    per_file = HDR + sum(s[2] for s in SPECS)
    w = _ext.KVWriter(str(d), 3 * per_file, True)  # paused: everything queues
    ks = keys(5)
    a, b = blocks(5)
    for i, k in enumerate(ks):  # one submit per block, oldest first
        w.submit([k.hex() + ".kv"], [k], [ROWS], NS, LAYOUT,
                 [a[i * ROWS:(i + 1) * ROWS], b[i * ROWS:(i + 1) * ROWS]], ROWS)
    st = w.stats()
    assert st["pending_jobs"] == 3 and st["dropped"] == 2 and st["pending_bytes"] <= 3 * per_file
    w.set_paused(False)
    assert w.wait_idle(30)
    done = w.poll()
    w.close()
    dropped = [k for _, k, status, _, _ in done if status == 1]
    written = [k for _, k, status, _, _ in done if status == 0]
    assert dropped == ks[:2] and written == ks[2:]
    assert sorted(p.name for p in d.iterdir()) == sorted(k.hex() + ".kv" for k in ks[2:])


def test_unwritable_directory_reports_failure(tmp_path):
    w = _ext.KVWriter(str(tmp_path / "missing"), 1 << 20)
    k = keys(1)
    w.submit([k[0].hex() + ".kv"], k, [ROWS], NS, LAYOUT, list(blocks(1)), ROWS)
    w.wait_idle(10)
    (c,) = w.poll()
    assert c[2] == 2 and c[3] == 2  # Failed, ENOENT
    assert w.stats()["failed"] == 1
    w.close()


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_checksums_detect_flips_and_truncation(tmp_path):
    d = tmp_path / "ns"
    d.mkdir()
    ks, _ = write(d, 6)
    p = [d / (k.hex() + ".kv") for k in ks]
    _flip(p[1], HDR + 100)  # data byte
    _flip(p[2], 20)  # header byte (namespace field)
    with open(p[3], "r+b") as f:  # truncated data
        f.truncate(HDR + 10)
    with open(p[4], "r+b") as f:  # truncated header
        f.truncate(100)
    # the reader stops at the first bad file of a run
    assert read(d, ks[1:], verify=True)[2:5] == (0, p[1].name, "data checksum mismatch")
    assert read(d, ks[1:], verify=False)[2] == 1  # data is checked only with verify
    assert read(d, ks[2:])[4] == "header checksum mismatch"
    assert "truncated" in read(d, ks[3:])[4] and "truncated" in read(d, ks[4:])[4]
    # the scan always checks headers and sizes; data too when asked
    entries, _, quarantined, reasons = scan(d, verify=True)
    assert sorted(e[0] for e in entries) == sorted(k.hex() for k in (ks[0], ks[5]))
    assert quarantined == 4, reasons
    q = sorted(x.name for x in (tmp_path / "quarantine").iterdir())
    assert q == sorted(x.name for x in p[1:5])
    assert any("data checksum" in r for r in reasons) and any("header checksum" in r for r in reasons)


def test_scan_quarantines_foreign_and_removes_tmp(tmp_path):
    d = tmp_path / "ns"
    d.mkdir()
    ks, _ = write(d, 2)
    other = tmp_path / "other"
    other.mkdir()
    fk, _ = write(other, 2, ns=NS + 1, salt=b"f")  # another model's namespace
    lk, _ = write(other, 1, layout="test;float32:4x2x8;uint32:4x3", salt=b"L")  # another KV layout
    for k in fk + lk:
        (other / (k.hex() + ".kv")).rename(d / (k.hex() + ".kv"))
    # a block renamed to another key, junk, and a torn write's leftover
    (d / (ks[1].hex() + ".kv")).rename(d / (keys(9)[8].hex() + ".kv"))
    (d / "notes.txt").write_text("hello")
    (d / (ks[0].hex() + ".kv.123.tmp")).write_bytes(b"partial")
    entries, tmp_removed, quarantined, reasons = scan(d)
    assert [e[0] for e in entries] == [ks[0].hex()]
    assert tmp_removed == 1 and quarantined == 5, reasons
    text = "\n".join(reasons)
    for why in ("foreign namespace", "tensor layout mismatch", "key does not match", "not a block file"):
        assert why in text
    assert not list(d.glob("*.tmp"))
    assert len(list((tmp_path / "quarantine").iterdir())) == 5


WRITER_LOOP = textwrap.dedent("""
    import sys, mlx.core as mx, numpy as np
    from mlxfast import _ext
    d = sys.argv[1]
    w = _ext.KVWriter(d, 1 << 30)
    a = mx.array(np.random.default_rng(0).standard_normal((64 * 4096,)).astype(np.float32)).reshape(64, 4096)
    i = 0
    print("ready", flush=True)
    while True:
        ks = [i.to_bytes(8, "little") + j.to_bytes(8, "little") for j in range(16)]
        w.submit([k.hex() + ".kv" for k in ks], ks, [4] * 16, 7, "crash;float32:4x4096", [a], 4)
        i += 1
        w.wait_idle(10)
""")


def test_kill9_never_leaves_a_partial_file_under_a_final_name(tmp_path):
    d = tmp_path / "ns"
    d.mkdir()
    script = tmp_path / "loop.py"
    script.write_text(WRITER_LOOP)
    for delay in (0.3, 0.7):
        proc = subprocess.Popen([sys.executable, str(script), str(d)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        entries, tmp_removed, quarantined, reasons = _ext.kv_scan(
            str(d), str(tmp_path / "quarantine"), 7, "crash;float32:4x4096", True)
        assert quarantined == 0, reasons  # every file under a final name is whole and checks out
        assert len(entries) > 0
        assert not list(d.glob("*.tmp"))


def test_reader_missing_file(tmp_path):
    d = tmp_path / "ns"
    d.mkdir()
    ks, _ = write(d, 2)
    (d / (ks[1].hex() + ".kv")).unlink()
    res = read(d, ks)
    assert res[2] == 1 and res[5] is True and res[4] == "missing"


@pytest.mark.parametrize("bad", ["names", "layout"])
def test_writer_validates(tmp_path, bad):
    w = _ext.KVWriter(str(tmp_path), 1 << 20)
    k = keys(2)
    with pytest.raises(ValueError):
        if bad == "names":
            w.submit(["x.kv"], k, [ROWS, ROWS], NS, LAYOUT, list(blocks(2)), ROWS)
        else:
            w.submit([x.hex() + ".kv" for x in k], k, [ROWS] * 2, NS, "x" * 5000, list(blocks(2)), ROWS)
    w.close()
