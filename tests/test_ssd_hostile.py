"""The SSD cache directory against what others put in it (it may be a shared,
world-writable place): FIFOs and symlinks planted in place of block, temp,
lock, namespace and quarantine files, directories of other modes and owners,
and a hung disk (simulated with an LD_PRELOAD shim whose preadv/fdatasync
never return). Nothing may be written outside the directory, nothing may
hang, answers equal those computed without the tier, and SIGTERM still ends
the server within its --shutdown-timeout."""

import hashlib
import logging
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest

from conftest import free_port, start_server, wait_healthy
from engine_utils import tiny_model
from mlxfast import _ext
from ssd_utils import BS, ask, cold, engine, prompt

NS = 0x1234_5678_9ABC_DEF0
ROWS = 4
LAYOUT = "test;uint8:4x64"
SPECS = [("uint8", [ROWS, 64], ROWS * 64)]
LINUX = sys.platform.startswith("linux")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def victim(path: Path, text: str = "precious data\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def write_blocks(d: Path, n: int, salt: int = 0) -> list[bytes]:
    import mlx.core as mx
    import numpy as np

    ks = [bytes([salt, i]) + bytes(14) for i in range(n)]
    data = mx.array(np.random.default_rng(salt).integers(0, 256, (n * ROWS, 64), dtype=np.uint8))
    w = _ext.KVWriter(str(d), 1 << 30)
    w.submit([k.hex() + ".kv" for k in ks], ks, [ROWS] * n, NS, LAYOUT, [data], ROWS)
    assert w.wait_idle(30)
    assert w.stats()["written"] == n
    w.close()
    return ks


def read_blocks(d: Path, ks, timeout=10.0):
    """The reader's result, or None if it did not finish in time."""
    r = _ext.KVReader(str(d))
    job = r.submit([k.hex() + ".kv" for k in ks], ks, SPECS, NS, LAYOUT, True)
    done = r.wait(job, timeout)
    res = r.poll()[0] if done else None
    return r, res


def unblock_fifo(path: Path) -> None:
    """Let a reader blocked opening this FIFO go (the code before the fix blocks there)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


# ---------------------------------------------------------------- native I/O


def test_reader_refuses_a_fifo_without_blocking(tmp_path):
    d = tmp_path / "ns"
    d.mkdir()
    ks = write_blocks(d, 2)
    fifo = d / (ks[0].hex() + ".kv")
    fifo.unlink()
    os.mkfifo(fifo)
    r, res = read_blocks(d, ks)
    try:
        assert res is not None, "the reader blocked on a FIFO"
        assert res[2] == 0 and res[4] == "not a regular file" and res[5] is False
    finally:
        unblock_fifo(fifo)
        r.close()


def test_reader_refuses_a_symlink_and_touches_nothing_outside(tmp_path):
    d, outside = tmp_path / "ns", tmp_path / "outside"
    d.mkdir()
    outside.mkdir()
    ks = write_blocks(d, 2)
    write_blocks(outside, 2)  # the same keys and data: a sound block, but not ours to read
    target = outside / (ks[0].hex() + ".kv")
    os.utime(target, ns=(1, 1))
    before = (digest(target), target.stat().st_mtime_ns)
    (d / target.name).unlink()
    (d / target.name).symlink_to(target)
    r, res = read_blocks(d, ks)
    r.close()
    assert res is not None and res[2] == 0 and res[4] == "a symbolic link"
    assert (digest(target), target.stat().st_mtime_ns) == before  # not even its mtime (LRU touch)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_reader_refuses_a_file_of_another_user(tmp_path):
    d = tmp_path / "ns"
    d.mkdir()
    ks = write_blocks(d, 2)
    os.chown(d / (ks[0].hex() + ".kv"), 65534, 65534)
    r, res = read_blocks(d, ks)
    r.close()
    assert res[2] == 0 and res[4] == "owned by another user"


def test_scan_never_follows_blocks_or_moves_outside(tmp_path):
    root, outside = tmp_path / "ssd", tmp_path / "outside"
    d = root / "ns"
    d.mkdir(parents=True)
    ks = write_blocks(d, 3)
    v1, v2 = victim(outside / "v1"), victim(outside / "v2")
    sums = {p: digest(p) for p in (v1, v2)}
    (d / (ks[0].hex() + ".kv")).unlink()
    os.mkfifo(d / (ks[0].hex() + ".kv"))
    (d / (ks[1].hex() + ".kv")).unlink()
    (d / (ks[1].hex() + ".kv")).symlink_to(v1)
    (d / (ks[2].hex() + ".kv.123.tmp")).symlink_to(v2)  # a "leftover" the scan removes
    qtarget = outside / "q"
    qtarget.mkdir()
    (root / "quarantine").symlink_to(qtarget, target_is_directory=True)
    out = []
    t = threading.Thread(target=lambda: out.append(_ext.kv_scan(str(d), str(root / "quarantine"), NS, LAYOUT)),
                         daemon=True)
    t.start()
    t.join(30)
    unblock_fifo(d / (ks[0].hex() + ".kv"))
    t.join(10)
    assert out, "the scan blocked"
    entries, tmp_removed, quarantined, reasons = out[0]
    assert [e[0] for e in entries] == [ks[2].hex()] and tmp_removed == 1 and quarantined == 2, reasons
    assert sorted(os.listdir(d)) == [ks[2].hex() + ".kv"]  # unusable quarantine: the bad entries unlinked
    assert list(qtarget.iterdir()) == []
    assert {p: digest(p) for p in (v1, v2)} == sums

    # with a real quarantine directory the planted entries move there, as they are
    (root / "quarantine").unlink()
    (d / "x.kv").symlink_to(v1)
    os.mkfifo(d / (ks[0].hex() + ".kv"))
    entries, _, quarantined, _ = _ext.kv_scan(str(d), str(root / "quarantine"), NS, LAYOUT)
    assert quarantined == 2 and len(entries) == 1
    q = root / "quarantine"
    assert stat.S_IMODE(q.stat().st_mode) == 0o700
    assert (q / "x.kv").is_symlink() and stat.S_ISFIFO((q / (ks[0].hex() + ".kv")).lstat().st_mode)
    assert digest(v1) == sums[v1]


def test_quarantine_never_moves_a_file_through_a_symlink(tmp_path):
    root, outside = tmp_path / "ssd", tmp_path / "outside"
    d = root / "ns"
    d.mkdir(parents=True)
    outside.mkdir()
    bad = d / "bad.kv"
    bad.write_bytes(b"junk")
    (root / "quarantine").symlink_to(outside, target_is_directory=True)
    assert _ext.kv_quarantine(str(bad), str(root / "quarantine"))
    assert not bad.exists() and list(outside.iterdir()) == []


def test_writer_never_writes_through_planted_files(tmp_path):
    d, outside = tmp_path / "ns", tmp_path / "outside"
    d.mkdir()
    v1, v2 = victim(outside / "v1"), victim(outside / "v2")
    sums = {p: digest(p) for p in (v1, v2)}
    ks = [bytes([7, i]) + bytes(14) for i in range(2)]
    for k in ks:  # every temp name the writer used to pick (final name + pid), pre-planted
        (d / f"{k.hex()}.kv.{os.getpid()}.tmp").symlink_to(v1)
    (d / (ks[1].hex() + ".kv")).symlink_to(v2)  # and a symlink under a final name
    import mlx.core as mx
    import numpy as np

    data = mx.array(np.arange(2 * ROWS * 64, dtype=np.uint8).reshape(2 * ROWS, 64))
    w = _ext.KVWriter(str(d), 1 << 30)
    w.submit([k.hex() + ".kv" for k in ks], ks, [ROWS] * 2, NS, LAYOUT, [data], ROWS)
    assert w.wait_idle(30)
    done = w.poll()
    w.close()
    assert [c[2] for c in done] == [0, 0], done  # both written
    assert {p: digest(p) for p in (v1, v2)} == sums
    for k in ks:  # the rename replaced the symlink, as a regular file of mode 0600
        st = (d / (k.hex() + ".kv")).lstat()
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    r, res = read_blocks(d, ks)
    r.close()
    assert res[2] == 2 and mx.array_equal(res[8][0], data).item()


# ------------------------------------------------- a hung disk (LD_PRELOAD)

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

/* A hung disk: preadv of *.kv and fdatasync of *.tmp files under
   $MLXFAST_STALL_DIR never return (those calls $MLXFAST_STALL names). */
static int stalls(int fd, const char* call, const char* suffix) {
  const char* which = getenv("MLXFAST_STALL");
  const char* dir = getenv("MLXFAST_STALL_DIR");
  if (!which || !dir || !strstr(which, call)) return 0;
  char link[64], path[4096];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, path, sizeof path - 1);
  if (n <= 0) return 0;
  path[n] = 0;
  size_t ls = strlen(suffix);
  return strncmp(path, dir, strlen(dir)) == 0 && (size_t)n >= ls && strcmp(path + n - ls, suffix) == 0;
}

static void hang(void) { for (;;) pause(); }

ssize_t preadv(int fd, const struct iovec* iov, int cnt, off_t off) {
  static ssize_t (*real)(int, const struct iovec*, int, off_t);
  if (!real) real = (ssize_t (*)(int, const struct iovec*, int, off_t))dlsym(RTLD_NEXT, "preadv");
  if (stalls(fd, "preadv", ".kv")) hang();
  return real(fd, iov, cnt, off);
}

ssize_t preadv64(int fd, const struct iovec* iov, int cnt, off_t off) { return preadv(fd, iov, cnt, off); }

int fdatasync(int fd) {
  static int (*real)(int);
  if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
  if (stalls(fd, "fdatasync", ".tmp")) hang();
  return real(fd);
}
"""


@pytest.fixture(scope="module")
def stall_shim(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    # The tests using this are Linux-only; a C compiler is a build requirement there.
    assert cc is not None, "the hung-disk shim needs a C compiler (cc or gcc)"
    d = tmp_path_factory.mktemp("shim")
    (d / "stall.c").write_text(SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "stall.so"), str(d / "stall.c"), "-ldl"],
                   check=True)
    return d / "stall.so"


def stall_env(shim: Path, d: Path, calls: str) -> dict:
    return dict(os.environ, LD_PRELOAD=str(shim), MLXFAST_STALL=calls, MLXFAST_STALL_DIR=str(d.resolve()))


CLOSE_STUCK = textwrap.dedent("""
    import sys, time, mlx.core as mx, numpy as np
    from mlxfast import _ext
    d, ns, layout = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    key = bytes([0, 0]) + bytes(14)
    r = _ext.KVReader(d)
    r.submit([key.hex() + ".kv"], [key], [("uint8", [4, 64], 256)], ns, layout, True)
    w = _ext.KVWriter(d, 1 << 30)
    k2 = bytes([9, 9]) + bytes(14)
    w.submit([k2.hex() + ".kv"], [k2], [4], ns, layout, [mx.zeros((4, 64), mx.uint8)], 4)
    while w.stats()["in_flight"] == 0 or r.pending() == 0:
        time.sleep(0.01)
    time.sleep(0.2)  # both threads are now inside the stuck calls
    print(r.close(0.5), w.wait_idle(0.2), w.close(False, 0.5), flush=True)
""")


@pytest.mark.skipif(not LINUX, reason="LD_PRELOAD")
def test_close_does_not_wait_for_threads_stuck_on_the_disk(tmp_path, stall_shim):
    d = tmp_path / "ns"
    d.mkdir()
    write_blocks(d, 1)
    script = tmp_path / "stuck.py"
    script.write_text(CLOSE_STUCK)
    proc = subprocess.Popen([sys.executable, str(script), str(d), str(NS), LAYOUT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=stall_env(stall_shim, d, "preadv fdatasync"))
    try:
        out, err = proc.communicate(timeout=60)  # closing, then exiting, never waits on them
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the process did not exit: a close or the exit waited for a stuck thread")
    assert proc.returncode == 0, err
    assert out.split() == ["False", "False", "False"]  # neither thread stopped; both were let go


# ------------------------------------------------------ engine (tiny model)


@pytest.fixture(scope="module")
def model():
    return tiny_model(3, layers=2)


def layout_of(model, tmp_path) -> tuple[str, str]:
    """(namespace directory name, namespace text file name) this model uses."""
    d = tmp_path / "probe-run"
    e = engine(model, ssd_cache_dir=str(d))
    try:
        name = e.connector.dir.name
    finally:
        e.shutdown()
    shutil.rmtree(d)
    return name, name + ".txt"


def test_planted_symlinks_at_namespace_file_and_probe(model, tmp_path):
    ns_dir, ns_txt = layout_of(model, tmp_path)
    d, outside = tmp_path / "ssd", tmp_path / "outside"
    (d / ns_dir).mkdir(parents=True)
    v1, v2 = victim(outside / "v1"), victim(outside / "v2")
    sums = {p: digest(p) for p in (v1, v2)}
    (d / ns_txt).symlink_to(v1)
    (d / ns_dir / f".probe.{os.getpid()}.tmp").symlink_to(v2)  # the probe's old, predictable name
    p = prompt(1, 60)
    e = engine(model, ssd_cache_dir=str(d))
    try:
        assert e.connector.enabled
        namespace = e.connector.namespace
        toks, _ = ask(e, p)
        assert e.flush_cache(30)["durable"]
    finally:
        e.shutdown()
    assert {q: digest(q) for q in (v1, v2)} == sums
    assert not (d / ns_txt).is_symlink() and (d / ns_txt).read_text() == namespace + "\n"
    assert toks == cold(model, p)
    e = engine(model, ssd_cache_dir=str(d))  # and the blocks written there restore
    try:
        toks, fin = ask(e, p + [1])
    finally:
        e.shutdown()
    assert fin.cached_tokens == 60 // BS * BS and toks == cold(model, p + [1])


def test_planted_symlink_at_lock_runs_ram_only(model, tmp_path, caplog):
    d = tmp_path / "ssd"
    d.mkdir()
    v = victim(tmp_path / "outside" / "v")
    before = digest(v)
    (d / "lock").symlink_to(v)
    p = prompt(2, 40)
    with caplog.at_level(logging.WARNING, logger="mlxfast.ssd"):
        e = engine(model, ssd_cache_dir=str(d))
    try:
        assert not e.connector.enabled and "lock is a symbolic link" in caplog.text
        toks, _ = ask(e, p)
    finally:
        e.shutdown()
    assert digest(v) == before and toks == cold(model, p)


def test_symlinked_namespace_dir_runs_ram_only(model, tmp_path, caplog):
    ns_dir, _ = layout_of(model, tmp_path)
    d, outside = tmp_path / "ssd", tmp_path / "outside"
    d.mkdir()
    outside.mkdir()
    (d / ns_dir).symlink_to(outside, target_is_directory=True)
    p = prompt(3, 40)
    with caplog.at_level(logging.WARNING, logger="mlxfast.ssd"):
        e = engine(model, ssd_cache_dir=str(d))
    try:
        assert not e.connector.enabled and "not a directory" in caplog.text
        toks, _ = ask(e, p)
    finally:
        e.shutdown()
    assert list(outside.iterdir()) == [] and toks == cold(model, p)


def test_shared_directory_is_warned_about_and_ours_made_private(model, tmp_path, caplog):
    ns_dir, _ = layout_of(model, tmp_path)
    d = tmp_path / "ssd"
    (d / ns_dir).mkdir(parents=True)
    os.chmod(d, 0o777)
    os.chmod(d / ns_dir, 0o755)  # e.g. made by an older version under the default umask
    with caplog.at_level(logging.WARNING, logger="mlxfast.ssd"):
        e = engine(model, ssd_cache_dir=str(d))
    e.shutdown()
    assert e.connector.enabled  # a warning, not a refusal
    assert "group- or world-writable" in caplog.text
    assert stat.S_IMODE((d / ns_dir).stat().st_mode) == 0o700
    caplog.clear()
    os.chmod(d, 0o700)
    with caplog.at_level(logging.WARNING, logger="mlxfast.ssd"):
        engine(model, ssd_cache_dir=str(d)).shutdown()
    assert "writable" not in caplog.text  # a private directory: no warning
    if os.geteuid() == 0:
        os.chown(d, 65534, 65534)
        with caplog.at_level(logging.WARNING, logger="mlxfast.ssd"):
            engine(model, ssd_cache_dir=str(d)).shutdown()
        assert "owned by uid 65534" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_namespace_dir_of_another_user_is_refused(model, tmp_path, caplog):
    ns_dir, _ = layout_of(model, tmp_path)
    d = tmp_path / "ssd"
    (d / ns_dir).mkdir(parents=True)
    os.chown(d / ns_dir, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="mlxfast.ssd"):
        e = engine(model, ssd_cache_dir=str(d))
    e.shutdown()
    assert not e.connector.enabled and "owned by uid 65534" in caplog.text


class StuckReader:
    """The real reader, with results held back while ``stuck`` (a hung disk)."""

    def __init__(self, real):
        self.real, self.stuck, self.held, self.submits = real, True, [], 0

    def submit(self, *a):
        self.submits += 1
        return self.real.submit(*a)

    def poll(self):
        self.held += self.real.poll()
        if self.stuck:
            return []
        out, self.held = self.held, []
        return out

    def pending(self):
        return self.real.pending() + (len(self.held) if self.stuck else 0)

    def close(self, timeout=5.0):
        return self.real.close(timeout)


def test_a_restore_that_never_completes_is_abandoned(model, tmp_path):
    p, q, r = prompt(4, 100), prompt(5, 100), prompt(6, 100)
    e = engine(model, ssd_cache_dir=str(tmp_path))
    try:
        for x in (p, q, r):
            ask(e, x)
        assert e.flush_cache(30)["durable"]
    finally:
        e.shutdown()
    e = engine(model, ssd_cache_dir=str(tmp_path))
    try:
        reader = e.connector.reader = StuckReader(e.connector.reader)
        e.connector.restore_timeout_s = 0.5
        toks1, fin1 = ask(e, p + [1], timeout=60)  # waits 0.5 s for its read, then computes
        s1 = dict(e.stats()["ssd"])
        toks2, fin2 = ask(e, q + [2], timeout=60)  # no new read while one is stuck
        submits_while_stuck = reader.submits
        reader.stuck = False  # the read returns: its result is dropped, restores resume
        for _ in range(200):
            if not e.connector.abandoned:
                break
            threading.Event().wait(0.05)
        toks3, fin3 = ask(e, r + [3], timeout=60)
        s3 = e.stats()["ssd"]
        e.allocator.check()
    finally:
        e.shutdown()
    assert s1["restore_timeouts"] == 1 and s1["restores"] == 0 and fin1.cached_tokens == 0
    assert submits_while_stuck == 1 and fin2.cached_tokens == 0
    assert s3["restores"] == 1 and fin3.cached_tokens == 100 // BS * BS
    assert toks1 == cold(model, p + [1]) and toks2 == cold(model, q + [2]) and toks3 == cold(model, r + [3])
    assert not e.connector.abandoned and not e.connector.restoring


# ---------------------------------------------------- real server processes


def tokens(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


# 160 tokens = 10 blocks on disk; a suffix of 20 makes an 11th block, written behind
PROMPT, SUFFIXES = tokens(1, 160), [tokens(2, 20), tokens(3, 20)]


class Proc:
    def __init__(self, *extra: str, env: dict | None = None):
        self.port = free_port()
        if env is None:
            self.proc = start_server(self.port, "--max-tokens", "6", *extra)
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlxfast.serve", "--port", str(self.port), "--log-level", "warning",
                 "--max-tokens", "6", *extra],
                cwd=Path(__file__).resolve().parents[1], env=dict(env, PYTHONUNBUFFERED="1"),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_healthy(self.url, self.proc)
        except BaseException:
            self.kill()
            raise

    def complete(self, ids, timeout=60):
        body = {"model": "m", "prompt": ids, "max_tokens": 6, "temperature": 0}
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["usage"]

    def ssd_stats(self):
        return httpx.get(self.url + "/stats", timeout=30).json()["engine"]["ssd"]

    def sigterm(self, timeout):
        """SIGTERM; the process must be gone within timeout seconds. Returns stderr."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the server did not exit within {timeout}s of SIGTERM")
        assert self.proc.returncode == 0, err
        return err

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def reference():
    """Answers of a server without the SSD tier."""
    ref = Proc()
    try:
        yield {tuple(s): ref.complete(PROMPT + s)[0] for s in SUFFIXES}
    finally:
        ref.sigterm(60)


def seeded_dir(d: Path) -> None:
    """d holds PROMPT's blocks, durable, from a server that has stopped."""
    a = Proc("--ssd-cache", str(d))
    try:
        a.complete(PROMPT)
        r = httpx.post(a.url + "/admin/cache/flush", timeout=60)
        assert r.status_code == 200 and r.json()["durable"] is True, r.text
    finally:
        a.sigterm(60)
    assert len(list(d.glob("ns-*/*.kv"))) >= len(PROMPT) // 16


@pytest.mark.slow
def test_server_fifo_planted_as_block_file(tmp_path, reference):
    d = tmp_path / "ssd"
    seeded_dir(d)
    b = Proc("--ssd-cache", str(d), "--shutdown-timeout", "3")
    fifos = []
    try:
        for f in d.glob("ns-*/*.kv"):  # after the start-up scan: only a read can meet them
            f.unlink()
            os.mkfifo(f)
            fifos.append(f)
        text, usage = b.complete(PROMPT + SUFFIXES[0])
        s = b.ssd_stats()
    except BaseException:
        for f in fifos:
            unblock_fifo(f)
        b.kill()
        raise
    b.sigterm(3 + 15)
    assert text == reference[tuple(SUFFIXES[0])]
    assert s["restore_failures"] == 1 and s["quarantined"] == 1 and usage["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="LD_PRELOAD")
def test_server_hung_disk_restore_abandoned_and_sigterm_bounded(tmp_path, reference, stall_shim):
    d = tmp_path / "ssd"
    seeded_dir(d)
    b = Proc("--ssd-cache", str(d), "--ssd-restore-timeout", "2", "--shutdown-timeout", "3",
             env=stall_env(stall_shim, d, "preadv fdatasync"))
    try:
        text0, usage0 = b.complete(PROMPT + SUFFIXES[0])  # its read hangs: abandoned after 2 s
        text1, _ = b.complete(PROMPT + SUFFIXES[1])
        s = b.ssd_stats()
        for _ in range(300):  # the write-behind of the new blocks is now stuck in fdatasync
            if b.ssd_stats()["pending_writes"] > 0:
                break
            threading.Event().wait(0.1)
        assert b.ssd_stats()["written_blocks"] == 0
    except BaseException:
        b.kill()
        raise
    err = b.sigterm(3 + 15)
    assert text0 == reference[tuple(SUFFIXES[0])] and text1 == reference[tuple(SUFFIXES[1])]
    assert s["restore_timeouts"] == 1 and s["restores"] == 0
    assert usage0["prompt_tokens_details"]["cached_tokens"] == 0
    assert "did not stop" in err  # the stuck writer was left behind, not waited for
