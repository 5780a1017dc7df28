"""The SSD tier of the prefix cache: the pool's KV blocks, on disk.

Blocks are content-addressed by their chained block hash: one file
``<hash hex>.kv`` per block in ``DIR/ns-<namespace hash>/``, where the
namespace covers the model weights, the KV scheme and its tensor layout, the
tokenizer and the block size. The file format (header with magic, version,
namespace, token count, tensor layout, header and data checksums) and all the
I/O live in native code (``csrc/io``): a writer thread checksums and writes
each block atomically (tmp + fdatasync + rename + directory fsync) without the
GIL, behind a byte-capped queue whose overflow drops the oldest pending write
(a future miss, never a wrong answer); a reader thread restores runs of blocks
into page-aligned buffers that become MLX arrays without a copy.

How blocks get to disk (all decided on the engine thread, which owns MLX):

* **spill**: a cached block the RAM pool evicts is copied out (one gather per
  storage array) before anything overwrites it, unless it is already on disk.
* **write-behind**: full blocks that join the prefix cache are written once
  they have been there ``debounce_s`` (finished requests leave them behind),
  in small batches while the engine is busy and large ones when it is idle,
  so that a restart finds them and evictions rarely need a spill.
* **demotion** (``demote_idle_s``): free cached blocks idle that long leave
  the RAM cache once they are on disk (their pool blocks become plain free
  blocks).

Restore (the tier is a ``KVConnector``, kv/connector.py, that the scheduler
asks): when a new prompt continues past its RAM-cached blocks and the next
block hashes are on disk, the request waits (off the scheduler's queue) while
the reader loads them; other requests keep decoding. On completion the blocks
are scattered into free pool blocks, registered in the prefix cache and held
until the scheduler admits the request, where its prefix match finds them
like any RAM hit. A file that fails a check is quarantined and the prompt is computed
from there.

Two servers on one directory: an exclusive ``flock`` on ``DIR/lock``. The
second server logs a warning and runs RAM-only (the lock dies with its
process, so a crash never leaves a stale lock).

The directory may be a shared place where others plant files: no file in it
is opened through a symlink (``O_NOFOLLOW``), readers open with
``O_NONBLOCK`` and read only regular files of this user, temp files are new
(``O_CREAT | O_EXCL``, random names) and the namespace directories are ours,
mode 0700. A directory others can change is warned about at start-up. A
restore that does not finish within ``restore_timeout_s`` (a hung disk) is
abandoned and the prompt computed; closing never waits for a stuck thread.
"""

from __future__ import annotations

import errno as errno_mod
import fcntl
import hashlib
import logging
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import _ext

log = logging.getLogger("mlxfast.ssd")

WRITTEN, DROPPED, FAILED, REMOVED = 0, 1, 2, 3


class SSDUnavailable(RuntimeError):
    """The SSD tier cannot run here (directory locked by another server, unwritable)."""


_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def _warn_if_shared(root: Path) -> None:
    st = os.stat(root)
    why = []
    if st.st_uid != os.geteuid():
        why.append(f"owned by uid {st.st_uid}")
    if st.st_mode & 0o022:
        why.append("group- or world-writable")
    if why:
        log.warning("ssd cache: %s is %s: others can remove or replace what is in it (their files are "
                    "never followed or read, but the cache can be lost); a private directory (mode 0700) "
                    "is safer", root, " and ".join(why))


def _open_lock(rootfd: int, path: Path) -> int:
    try:
        fd = os.open("lock", os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | _NOFOLLOW, 0o600, dir_fd=rootfd)
    except OSError as e:
        why = "is a symbolic link" if e.errno == errno_mod.ELOOP else f"cannot be opened: {e.strerror}"
        raise SSDUnavailable(f"{path} {why}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise SSDUnavailable(f"{path} is not a regular file of this user")
    return fd


def _open_own_dir(parentfd: int, name: str, path: Path) -> int:
    """``name`` in parentfd: created 0700 if missing, refused unless it is a real
    directory (not a symlink) of this user."""
    try:
        os.mkdir(name, 0o700, dir_fd=parentfd)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=parentfd)
    except OSError as e:
        if e.errno in (errno_mod.ELOOP, errno_mod.ENOTDIR):
            raise SSDUnavailable(f"{path} is not a directory (a symbolic link?)") from None
        raise
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise SSDUnavailable(f"{path} is owned by uid {st.st_uid}, not by this user")
    if st.st_mode & 0o077:
        os.fchmod(fd, 0o700)
    return fd


def _new_file(dirfd: int, name: str, data: bytes = b"") -> None:
    """Create ``name`` in dirfd (it must not exist: never written through)."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=dirfd)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _replace_file(dirfd: int, name: str, data: bytes) -> None:
    """Write ``name`` atomically; the rename replaces a planted symlink, never follows it."""
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    _new_file(dirfd, tmp, data)
    try:
        os.replace(tmp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except OSError:
        os.unlink(tmp, dir_fd=dirfd)
        raise


def _dtype_name(dt) -> str:
    return str(dt).split(".")[-1]


def weights_fingerprint(model) -> str:
    """A cheap fingerprint of the weights: every parameter's name, shape, dtype
    and a strided sample of its bytes (two fine-tunes of one architecture
    differ; hashing all weights would cost seconds on a large model)."""
    from mlx.utils import tree_flatten

    from ..models.layers import rows16_params
    from ..ops import rows16_flat_index

    packed = rows16_params(model)  # fingerprinted as in MLX's layout: the same on every CPU path
    h = hashlib.blake2b(digest_size=16)
    for name, p in tree_flatten(model.parameters()):
        shape = tuple(p.shape)
        if name in packed:
            *lead, b, c, r = shape
            shape = (*lead, b * r, c)
        h.update(f"{name}:{shape}:{p.dtype}".encode())
        flat = p.reshape(-1)
        if flat.size == 0:
            continue
        if flat.dtype == mx.bfloat16:
            flat = flat.view(mx.uint16)
        step = max(1, flat.size // 256)
        idx = np.arange(0, flat.size, step)[:256]
        if name in packed:
            idx = rows16_flat_index(shape, idx)
        h.update(np.asarray(flat[mx.array(idx.astype(np.int64))]).tobytes())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(type(tokenizer).__qualname__.encode())
    hf_json = getattr(tokenizer, "hf_json", None)
    if callable(hf_json):
        h.update(hf_json().encode())
    else:
        n = int(getattr(tokenizer, "vocab_size", 0) or 0)
        h.update(str(n).encode())
        dec = getattr(tokenizer, "decode", None)
        if callable(dec):
            for i in range(min(n, 1 << 16)):
                h.update(dec([i]).encode("utf-8", "surrogatepass") + b"\0")
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [])
    h.update(repr(eos).encode())
    return h.hexdigest()


class SSDTier:
    """The disk index and the write/restore machinery, a ``KVConnector``
    (kv/connector.py); engine-thread only, except
    ``request_flush``/``wait_flushed``/``stats`` (any thread)."""

    enabled = True

    def __init__(self, root: str | os.PathLike, namespace: str, pool, allocator, *,
                 max_bytes: int = 32 << 30, verify: bool = True, demote_idle_s: float | None = None,
                 debounce_s: float = 1.0, max_pending_bytes: int = 256 << 20,
                 busy_write_bytes: int = 8 << 20, busy_write_interval_s: float = 0.25,
                 restore_timeout_s: float = 30.0):
        self.root = Path(root)
        self.pool = pool
        self.alloc = allocator
        self.bs = pool.block_size
        self.max_bytes = int(max_bytes)
        self.verify = bool(verify)
        self.demote_idle_s = demote_idle_s
        self.debounce_s = debounce_s
        self.busy_write_interval_s = busy_write_interval_s
        self.restore_timeout_s = restore_timeout_s

        arrays = pool.arrays()
        self.specs = []
        for a in arrays:
            shape = [self.bs, *a.shape[1:]]
            self.specs.append((_dtype_name(a.dtype), shape, int(np.prod(shape)) * a.dtype.size))
        self.block_bytes = sum(s[2] for s in self.specs) + _ext.kv_header_size()
        scheme = getattr(pool, "scheme_id", f"dense-{_dtype_name(arrays[0].dtype)}")
        self.layout = scheme + ";" + ";".join(f"{d}:{'x'.join(map(str, s))}" for d, s, _ in self.specs)
        self.namespace = f"{namespace}|{self.layout}"
        self.ns_hash = _ext.xxh64(self.namespace.encode())
        ns_name = f"ns-{self.ns_hash:016x}"
        self.dir = self.root / ns_name
        self.qdir = self.root / "quarantine"

        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            rootfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the user's path
        except OSError as e:
            raise SSDUnavailable(f"cannot use {self.root}: {e.strerror or e}") from None
        try:
            _warn_if_shared(self.root)
            self._lock_fd = _open_lock(rootfd, self.root / "lock")
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(self._lock_fd)
                self._lock_fd = -1
                raise SSDUnavailable(f"{self.root} is in use by another server "
                                     f"(flock on {self.root / 'lock'})") from None
            try:
                os.ftruncate(self._lock_fd, 0)
                os.write(self._lock_fd, f"{os.getpid()}\n".encode())
            except OSError:
                pass
            try:
                nsfd = _open_own_dir(rootfd, ns_name, self.dir)
                try:
                    probe = f".probe.{secrets.token_hex(8)}.tmp"
                    _new_file(nsfd, probe)
                    os.unlink(probe, dir_fd=nsfd)
                finally:
                    os.close(nsfd)
            except OSError as e:
                raise SSDUnavailable(f"cannot write to {self.dir}: {e.strerror or e}") from None
            try:
                _replace_file(rootfd, ns_name + ".txt", (self.namespace + "\n").encode())
            except OSError as e:  # a description for people; the tier works without it
                log.warning("ssd cache: cannot write %s: %s", self.root / (ns_name + ".txt"), e.strerror or e)
        except BaseException:
            self._unlock()
            raise
        finally:
            os.close(rootfd)

        t0 = time.perf_counter()
        entries, self.tmp_removed, quarantined, reasons = _ext.kv_scan(
            str(self.dir), str(self.qdir), self.ns_hash, self.layout, False)
        self.quarantined = quarantined
        for r in reasons[:20]:
            log.warning("ssd cache: quarantined %s", r)
        # index: key -> file bytes, oldest used first
        self.index: OrderedDict[bytes, int] = OrderedDict()
        self.bytes = 0
        for key_hex, size, mtime, _tokens in sorted(entries, key=lambda e: e[2]):
            self.index[bytes.fromhex(key_hex)] = size
            self.bytes += size
        self.scan_seconds = time.perf_counter() - t0

        self.writer = _ext.KVWriter(str(self.dir), int(max_pending_bytes))
        self.reader = _ext.KVReader(str(self.dir))
        self.pending: dict[bytes, int] = {}  # key -> bytes, queued writes
        self.dirty: OrderedDict[bytes, tuple[int, float]] = OrderedDict()  # key -> (block, registered at)
        self.evicted: list[tuple[int, bytes]] = []  # blocks to spill before they are overwritten
        self.restoring: dict[int, list] = {}  # read job id -> [load id, held blocks, keys, t0, cancelled]
        self.abandoned: set[int] = set()  # read jobs past restore_timeout_s, still in the reader
        self.holds: dict[int, list[int]] = {}  # load id -> blocks held until the scheduler releases it
        self._finished: list[int] = []  # loads over, not yet reported
        self.busy_write_blocks = max(1, busy_write_bytes // self.block_bytes)
        self.busy_write_bytes = busy_write_bytes
        self._last_busy_write = 0.0
        self._last_demote = time.monotonic()
        self._fail_until = 0.0
        self._warned = False
        self._flush_req = threading.Event()
        self._flush_done = threading.Event()
        self._lock = threading.Lock()  # counters read by other threads
        self.counters = {
            "restores": 0, "restored_blocks": 0, "restored_bytes": 0, "restore_seconds": 0.0,
            "restore_read_seconds": 0.0, "restore_copy_seconds": 0.0, "read_bytes": 0,
            "restore_failures": 0, "restore_timeouts": 0, "submit_seconds": 0.0, "spilled_blocks": 0,
            "write_behind_blocks": 0, "demoted_blocks": 0,
            "evicted_files": 0, "written_blocks": 0, "dropped_writes": 0, "failed_writes": 0,
        }
        self._failed_at_flush = 0
        allocator.on_evict = self._on_evict
        allocator.on_register = self._on_register
        self._others = self._scan_others()
        self.other_bytes = sum(f[2] for f in self._others)
        self._enforce_cap()
        log.info("ssd cache: %s, %d blocks (%.1f MiB) indexed in %.2fs; %d .tmp removed, %d quarantined",
                 self.dir, len(self.index), self.bytes / (1 << 20), self.scan_seconds,
                 self.tmp_removed, self.quarantined)

    # -- allocator hooks -----------------------------------------------------
    def _on_evict(self, block: int, key: bytes) -> None:
        self.dirty.pop(key, None)
        if key not in self.index and key not in self.pending:
            self.evicted.append((block, key))

    def _on_register(self, block: int, key: bytes) -> None:
        if key not in self.index and key not in self.pending:
            self.dirty[key] = (block, time.monotonic())

    # -- writes ----------------------------------------------------------------
    def _gather(self, blocks: list[int]) -> list[mx.array]:
        bs = self.bs
        rows = (np.asarray(blocks, np.int64)[:, None] * bs + np.arange(bs)).reshape(-1)
        return self.pool.read_rows(mx.array(rows.astype(np.int32)))

    def _submit(self, items: list[tuple[int, bytes]]) -> None:
        """Copy blocks out of the pool now and queue their files."""
        if not items:
            return
        t0 = time.perf_counter()
        arrays = self._gather([b for b, _ in items])
        keys = [k for _, k in items]
        names = [k.hex() + ".kv" for k in keys]
        self.writer.submit(names, keys, [self.bs] * len(items), self.ns_hash, self.layout, arrays, self.bs)
        for k in keys:
            self.pending[k] = self.block_bytes
        self.counters["submit_seconds"] += time.perf_counter() - t0  # engine-thread cost of writes

    def save_evicted(self) -> None:
        """Before the step writes into freshly allocated blocks: save the cached
        ones it evicted (call after every allocation)."""
        if not self.evicted:
            return
        items, self.evicted = self.evicted, []
        if time.monotonic() < self._fail_until:
            return
        self._submit(items)
        self.counters["spilled_blocks"] += len(items)

    def _write_dirty(self, limit: int | None, debounce: bool) -> int:
        now = time.monotonic()
        picked = []
        for key, (block, t) in self.dirty.items():
            if limit is not None and len(picked) >= limit:
                break
            if debounce and now - t < self.debounce_s:
                break  # registration order: the rest are younger
            picked.append((key, block))
        items = []
        for key, block in picked:
            del self.dirty[key]
            if self.alloc.hash_of[block] != key or key in self.index or key in self.pending:
                continue  # evicted (then spilled), or already on its way
            items.append((block, key))
        self._submit(items)
        return len(items)

    def _poll_writes(self) -> None:
        for name, key, status, err, nbytes in self.writer.poll():
            if status == REMOVED:
                continue
            self.pending.pop(key, None)
            if status == WRITTEN:
                self.counters["written_blocks"] += 1
                if key in self.index:
                    self.bytes -= self.index[key]
                self.index[key] = nbytes
                self.index.move_to_end(key)
                self.bytes += nbytes
            elif status == DROPPED:
                self.counters["dropped_writes"] += 1
            elif status == FAILED:
                self.counters["failed_writes"] += 1
                self._fail_until = time.monotonic() + 10.0
                if not self._warned:
                    self._warned = True
                    log.warning("ssd cache: cannot write to %s (%s); serving from RAM, retrying later",
                                self.dir, os.strerror(err) if err else "error")
        self._enforce_cap()

    def _scan_others(self) -> list:
        """The directory's files outside this namespace (other models' or
        configurations' namespaces, quarantined files), in the order the cap
        drops them: quarantined first, then the oldest. max_bytes caps the
        whole directory (a 5 MiB cap held 30 MiB of them), this namespace's
        files before theirs; the lock is held, so no server uses them. Read
        through directory descriptors, never following a link."""
        try:
            rootfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return []
        files = []  # (not quarantined, mtime, size, dir name, file name)
        try:
            with os.scandir(rootfd) as it:
                dirs = [e.name for e in it if e.name != self.dir.name and e.is_dir(follow_symlinks=False)
                        and (e.name == "quarantine" or e.name.startswith("ns-"))]
            for d in dirs:
                try:
                    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=rootfd)
                except OSError:
                    continue
                try:
                    with os.scandir(fd) as it:
                        for e in it:
                            if e.is_file(follow_symlinks=False):
                                st = e.stat(follow_symlinks=False)
                                files.append((d != "quarantine", st.st_mtime, st.st_size, d, e.name))
                finally:
                    os.close(fd)
        except OSError as e:
            log.warning("ssd cache: cannot measure %s: %s", self.root, e.strerror or e)
        finally:
            os.close(rootfd)
        files.sort(key=lambda f: f[:2])
        return files

    def _drop_others(self, over: int) -> int:
        """Unlink files outside this namespace (``_scan_others``' order) until
        ``over`` bytes are gone or none is left; returns what is still over."""
        try:
            rootfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return over
        try:
            while over > 0 and self._others:
                _, _, size, d, name = self._others.pop(0)
                self.other_bytes -= size
                over -= size
                try:
                    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=rootfd)
                    try:
                        os.unlink(name, dir_fd=fd)
                    finally:
                        os.close(fd)
                except OSError:
                    pass
        finally:
            os.close(rootfd)
        return over

    def _enforce_cap(self) -> None:
        """Keep the directory's files + queued writes under max_bytes:
        other namespaces' and quarantined files go first, then this
        namespace's oldest used."""
        over = self.bytes + len(self.pending) * self.block_bytes + self.other_bytes - self.max_bytes
        if over > 0 and self._others:
            over = self._drop_others(over)
        names = []
        while over > 0 and self.index:
            key, size = self.index.popitem(last=False)
            self.bytes -= size
            over -= size
            names.append(key.hex() + ".kv")
        if names:
            self.writer.remove(names)
            self.counters["evicted_files"] += len(names)

    # -- loads (restores): the KVConnector questions ---------------------------
    def num_loadable(self, keys, start: int, limit: int) -> int:
        """Blocks ``keys[start:]`` on disk, consecutively, at most ``limit`` and
        no more than the free pool blocks allow (one is left for the prompt's rest)."""
        if self.abandoned:  # a read is stuck (hung disk?): compute until it returns
            return 0
        k = start
        while k < len(keys) and k - start < limit and keys[k] in self.index:
            k += 1
        return min(k - start, max(0, self.alloc.num_free - 1))

    def start_load(self, load_id: int, keys, start: int, n: int) -> None:
        """Read ``keys[start:start + n]`` from disk, holding the RAM-cached
        ``keys[:start]`` meanwhile; ``finished_loads`` reports it done."""
        held = self.alloc.match_prefix(list(keys[:start]))
        keys = list(keys[start:start + n])
        job = self.reader.submit([h.hex() + ".kv" for h in keys], keys, self.specs, self.ns_hash,
                                 self.layout, self.verify)
        self.restoring[job] = [load_id, held, keys, time.monotonic(), False]
        for h in keys:  # in use: the newest end of the LRU
            self.index.move_to_end(h)

    def finished_loads(self) -> list[int]:
        done, self._finished = self._finished, []
        return done

    def release(self, load_id: int) -> None:
        """Free what the load holds; a read in flight is cancelled (its result is dropped)."""
        held = self.holds.pop(load_id, None)
        if held:
            self.alloc.free(held)
        for entry in self.restoring.values():
            if entry[0] == load_id and not entry[4]:
                entry[4] = True
                self.alloc.free(entry[1])
                entry[1] = []

    def _finish_restore(self, res) -> None:
        job, n_total, n_ok, fail_name, fail_reason, fail_missing, seconds, nbytes, arrays = res
        load_id, held, keys, t0, cancelled = self.restoring.pop(job)
        self.counters["restore_read_seconds"] += seconds  # the reader thread's own time
        self.counters["read_bytes"] += nbytes
        if fail_reason:
            bad = keys[n_ok]
            if bad in self.index:
                self.bytes -= self.index.pop(bad)
            self.counters["restore_failures"] += 1
            if not fail_missing:
                _ext.kv_quarantine(str(self.dir / fail_name), str(self.qdir))
                with self._lock:
                    self.quarantined += 1
                log.warning("ssd cache: %s: %s (quarantined; recomputing from there)", fail_name, fail_reason)
        if cancelled:
            return
        n = min(n_ok, max(0, self.alloc.num_free - 1))
        if n > 0:
            tc = time.perf_counter()
            blocks = self.alloc.allocate(n)
            self.save_evicted()  # blocks just evicted for these: save them before overwriting
            bs = self.bs
            rows = mx.array((np.asarray(blocks, np.int64)[:, None] * bs + np.arange(bs))
                            .reshape(-1).astype(np.int32))
            self.pool.write_rows(rows, [src[: n * bs] if n < n_ok else src for src in arrays])
            self.counters["restore_copy_seconds"] += time.perf_counter() - tc
            for b, h in zip(blocks, keys[:n]):
                self.alloc.register(b, h)
            held = held + blocks
            self.counters["restores"] += 1
            self.counters["restored_blocks"] += n
            self.counters["restored_bytes"] += nbytes * n // max(1, n_ok)
            self.counters["restore_seconds"] += time.monotonic() - t0
        del arrays
        self._done(load_id, held)

    def _done(self, load_id: int, held: list[int]) -> None:
        """The load is over: its blocks stay held until the scheduler releases it."""
        self.holds[load_id] = held
        self._finished.append(load_id)

    def _expire_restores(self) -> None:
        """Give up on reads older than restore_timeout_s: those prompts are computed;
        the read's result, if it ever comes, is dropped."""
        now = time.monotonic()
        for job, (load_id, held, _keys, t0, cancelled) in list(self.restoring.items()):
            if now - t0 < self.restore_timeout_s:
                continue
            del self.restoring[job]
            self.abandoned.add(job)
            self.counters["restore_timeouts"] += 1
            log.warning("ssd cache: a block read has taken over %.0fs (slow or hung disk?); computing "
                        "the prompt instead, no restores until it returns", self.restore_timeout_s)
            if not cancelled:
                self._done(load_id, held)

    # -- the engine loop -------------------------------------------------------
    def has_work(self) -> bool:
        """Something to do right now (the engine should not sleep)."""
        if self._flush_req.is_set():
            return True
        if self.restoring and self.reader.pending() < len(self.restoring) + len(self.abandoned):
            return True  # a result is waiting
        return False

    def wait_timeout(self) -> float | None:
        """How long the engine may sleep before ``service`` has something to do."""
        t = []
        if self.restoring:
            t.append(0.002)
        elif self.abandoned:
            t.append(0.5)
        if self.dirty:
            _, ts = next(iter(self.dirty.values()))
            t.append(max(0.001, ts + self.debounce_s - time.monotonic()))
        if self.pending:
            t.append(0.05)
        if self.demote_idle_s:
            t.append(max(0.05, min(1.0, self.demote_idle_s / 4)))
        return min(t) if t else None

    def service(self, busy: bool) -> None:
        """Engine thread, each loop iteration: completions, restores, write-behind,
        demotion, flush requests."""
        self._poll_writes()
        if self.restoring or self.abandoned:
            for res in self.reader.poll():
                if res[0] in self.abandoned:
                    self.abandoned.discard(res[0])
                else:
                    self._finish_restore(res)
            self._expire_restores()
        now = time.monotonic()
        if self._flush_req.is_set():
            self._flush_req.clear()
            self._write_all_cached()
            self._flush_done.set()
        elif self.dirty and now >= self._fail_until:
            if not busy:
                self.counters["write_behind_blocks"] += self._write_dirty(None, debounce=True)
            elif (now - self._last_busy_write >= self.busy_write_interval_s
                  and self.writer.stats()["pending_bytes"] < self.busy_write_bytes):
                # while decoding: small batches, and only when the writer has
                # caught up (it runs at the lowest priority; never pile up)
                self._last_busy_write = now
                self.counters["write_behind_blocks"] += self._write_dirty(self.busy_write_blocks, debounce=True)
        if self.demote_idle_s and now - self._last_demote >= min(1.0, self.demote_idle_s / 4):
            self._last_demote = now
            self._demote(now)

    def _demote(self, now: float) -> None:
        alloc = self.alloc
        cutoff = now - self.demote_idle_s
        n = 0
        for b in list(alloc.free_queue):
            h = alloc.hash_of[b]
            if h is None:
                continue
            if alloc.last_used[b] > cutoff:
                break  # LRU order: the rest were used more recently
            if h in self.index:
                alloc.uncache(b)
                n += 1
            elif h not in self.pending and h not in self.dirty:
                self.dirty[h] = (b, 0.0)  # write it (next write-behind), demote after
                self.dirty.move_to_end(h, last=False)
        self.counters["demoted_blocks"] += n

    def _write_all_cached(self) -> None:
        items = [(b, h) for h, b in self.alloc.cached.items()
                 if h not in self.index and h not in self.pending]
        self.dirty.clear()
        for i in range(0, len(items), 64):
            self._submit(items[i:i + 64])

    # -- flush / close (any thread) ---------------------------------------------
    def request_flush(self) -> None:
        self._flush_done.clear()
        self._flush_req.set()

    def wait_flushed(self, timeout: float) -> bool:
        """After ``request_flush`` (and a wake-up of the engine): wait until every
        cached block is written and durable."""
        deadline = time.monotonic() + timeout
        if not self._flush_done.wait(timeout):
            return False
        return bool(self.writer.wait_idle(max(0.0, deadline - time.monotonic())))

    def flush(self, wake, timeout: float) -> dict:
        """Any thread: have the engine write every cached block not on disk,
        wait until the writer is idle (durable), then one more engine round so
        the index and counters include the completions. ``wake()`` wakes the engine."""
        deadline = time.monotonic() + timeout
        self.request_flush()
        wake()
        ok = self.wait_flushed(timeout)
        if ok:
            self.request_flush()
            wake()
            ok = self._flush_done.wait(max(0.0, deadline - time.monotonic()))
        return self.flush_result(ok)

    def flush_result(self, ok: bool) -> dict:
        s = self.stats()
        failed_now = s["failed_writes"] - self._failed_at_flush
        self._failed_at_flush = s["failed_writes"]
        durable = bool(ok) and s["pending_writes"] == 0 and failed_now == 0
        return {"durable": durable, "failed_since_last_flush": failed_now, **s}

    def stats(self) -> dict:
        w = self.writer.stats()
        c = dict(self.counters)
        c["written_blocks"] = max(c["written_blocks"], 0)
        return {
            "enabled": True,
            "dir": str(self.dir),
            "entries": len(self.index),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "other_bytes": self.other_bytes,
            "pending_writes": int(w["pending_jobs"]) + int(w["in_flight"]),
            "pending_bytes": int(w["pending_bytes"]),
            "dirty_blocks": len(self.dirty),
            "restoring": len(self.restoring),
            "quarantined": self.quarantined,
            "tmp_removed": self.tmp_removed,
            "file_syncs": int(w["file_syncs"]),
            "dir_syncs": int(w["dir_syncs"]),
            **c,
        }

    def close(self, timeout: float = 30.0) -> bool:
        """Wait up to ``timeout`` for queued writes to become durable, then stop.
        Bounded: a thread stuck on the disk is left behind, not waited for."""
        deadline = time.monotonic() + max(0.0, timeout)

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        ok = bool(self.writer.wait_idle(left())) if timeout > 0 else False
        if ok:  # the last writes may push the files over the cap: trim, wait for the unlinks
            self._poll_writes()
            self.writer.wait_idle(left())
        stopped = self.writer.close(False, max(0.2, left()))
        stopped = self.reader.close(0.5) and stopped  # a restore is of no use now
        if not stopped:
            log.warning("ssd cache: an I/O thread did not stop (slow or hung disk?); not waiting for it")
        self._poll_writes_final()
        self._unlock()
        return ok

    def _poll_writes_final(self) -> None:
        try:
            for _name, key, status, _err, _n in self.writer.poll():
                self.pending.pop(key, None)
                if status == DROPPED:
                    self.counters["dropped_writes"] += 1
        except Exception:  # noqa: BLE001
            pass

    def _unlock(self) -> None:
        fd, self._lock_fd = getattr(self, "_lock_fd", -1), -1
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


def open_tier(cfg, namespace: str, pool, allocator, model=None, tokenizer=None):
    """The SSD tier from an EngineConfig, or None (off, or unavailable: warned)."""
    root = getattr(cfg, "ssd_cache_dir", None)
    if not root:
        return None
    if not cfg.enable_prefix_cache:
        log.warning("ssd cache: --ssd-cache has no effect without the RAM prefix cache")
        return None
    parts = [namespace]
    if not cfg.model_fingerprint and model is not None:
        parts.append("w" + weights_fingerprint(model))
    if tokenizer is not None:
        parts.append("t" + tokenizer_fingerprint(tokenizer))
    try:
        return SSDTier(root, "|".join(parts), pool, allocator,
                       max_bytes=int(cfg.ssd_cache_max_gb * (1 << 30)), verify=cfg.ssd_cache_verify,
                       demote_idle_s=cfg.ssd_demote_idle_s,
                       restore_timeout_s=getattr(cfg, "ssd_restore_timeout_s", 30.0))
    except SSDUnavailable as e:
        log.warning("ssd cache disabled, serving from RAM only: %s", e)
        return None
    except OSError as e:
        if e.errno in (errno_mod.ENOSPC, errno_mod.EROFS, errno_mod.EACCES):
            log.warning("ssd cache disabled, serving from RAM only: %s", e)
            return None
        raise
