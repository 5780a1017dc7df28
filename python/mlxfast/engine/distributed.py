"""Tensor-parallel serving over ``mx.distributed``: one scheduler on rank 0,
the same model step on every rank.

Rank 0 runs the HTTP server, the scheduler, the sampler and everything else
of the engine, as one process would. Each step, after the scheduler has
planned it, the runner broadcasts what the model call needs — token ids,
each sequence's first position and token count, its block tables — as int32
arrays through the :class:`StepChannel` (an ``all_sum`` of a buffer that only
rank 0 fills: a broadcast out of the collective every backend has). The other
ranks run :class:`Follower`: receive, build the same ``PagedContext`` over
their own KV pool (which holds only their heads), run the same model call on
their shard of the weights (models/shard.py), taking part in its
``all_sum``s, and wait for the next message. Only rank 0 computes logits and
samples. Messages: SETUP (the KV pool's configuration, answered by each
rank's parameter and KV bytes), STEP, PING (rank 0 idle: proves every rank is
alive; a lost peer makes the ring backend's next collective fail, so a dead
rank is noticed within about a heartbeat), STOP.

Faults: the ring backend fails a collective with "connection to a peer was
lost" about a second after a peer's process ends (measured), so a dead
follower fails rank 0's next step or heartbeat (the engine dies: requests in
flight get an error, /health turns 503, serve.py exits non-zero), and a dead
rank 0 fails every follower's receive (it exits non-zero). A peer that never
connects would make rank 0 wait forever in ``init``, and a peer that hangs
alive would block a collective forever: ``init_group`` and ``StepChannel.guard`` end
the process with a clear error after a timeout instead.

``launch_local`` starts N ranks on this machine with the environment
``mlx.launch --backend ring`` gives them (``MLX_RANK``, ``MLX_HOSTFILE`` with
loopback ports), supervising them itself: mlx.launch exits 0 whatever its
ranks do and does not pass SIGTERM on, and a server's exit status and
graceful stop must survive the launcher.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import mlx.core as mx
import numpy as np

log = logging.getLogger("mlxfast.tp")

SETUP, STEP, PING, STOP, KV_READ, KV_WRITE = 1, 2, 3, 4, 5, 6
_KINDS = {SETUP: "setup", STEP: "step", PING: "ping", STOP: "stop", KV_READ: "kv-read", KV_WRITE: "kv-write"}
BYTES_CHUNK = 256 << 10  # per rank and collective when blocks' bytes travel (see models/shard.py)
CAPACITY = 4096  # int32 per message's first collective (16 KiB costs what 64 bytes do: ~70 us)
_HEAD = 2  # kind, payload length
_BELL = struct.Struct("<Q")  # rank 0's "message n follows", on the liveness link

LAUNCH_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MLX_WORLD_SIZE")


def launched() -> bool:
    """Whether this process was started by a distributed launcher (mlx.launch, mpirun)."""
    return any(v in os.environ for v in LAUNCH_VARS)


def launch_rank() -> int:
    """This process's rank as its launcher set it (0 when not launched)."""
    for v in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(v, "").isdigit():
            return int(os.environ[v])
    return 0


# A watchdog of its own process: mx.distributed.init holds the GIL while it
# waits, so no thread of ours could act on a timeout.
_CONNECT_WATCH = """
import os, signal, sys, time
pid, timeout, msg = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
time.sleep(timeout)
if os.getppid() == pid:
    sys.stderr.write(msg + "\\n")
    sys.stderr.flush()
    os.kill(pid, signal.SIGKILL)
"""


def _local_launch() -> tuple[int, int] | None:
    """(rank, size) when every rank of this ring launch is on this host (the
    hostfile lists loopback addresses only), else None."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        return None
    try:
        with open(path) as f:
            nodes = json.load(f)
        ips = [str(a).rsplit(":", 1)[0] for node in nodes for a in node]
    except (OSError, ValueError, TypeError):
        return None
    if len(nodes) < 2 or not all(ip.startswith("127.") or ip in ("localhost", "::1") for ip in ips):
        return None
    return launch_rank(), len(nodes)


def pin_local_rank() -> list[int] | None:
    """Ranks launched on one host share its cores: rank r keeps the r-th of N
    equal shares of the CPUs this process may use (every thread of it, and
    the kernel pool then sizes itself to them). The ring backend's socket
    threads busy-poll while a transfer is pending; unpinned, a waiting rank's
    pollers take the cores the other rank computes on (measured: an all_sum
    of 576 floats 200 us unpinned, 54 us pinned, on 2 cores). Off with
    MLXFAST_TP_PIN=0 or when the CPUs do not split."""
    where = _local_launch()
    if where is None or os.environ.get("MLXFAST_TP_PIN", "1") == "0" or not hasattr(os, "sched_setaffinity"):
        return None
    rank, size = where
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // size
    if share < 1:
        return None
    mine = cpus[rank * share:(rank + 1) * share]
    for tid in _threads() or {0}:
        try:
            os.sched_setaffinity(tid, mine)
        except OSError:
            pass
    return mine


def _threads() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux
        return set()


def init_group(timeout_s: float, backend: str | None = None):
    """The world group of this launch. Rank 0 of the ring backend waits in
    ``accept`` without bound (holding the GIL) for peers that never come:
    past ``timeout_s`` a watchdog process prints a clear error and ends this
    one."""
    backend = backend or os.environ.get("MLXFAST_TP_BACKEND", "any")
    rank = launch_rank()
    pin_local_rank()  # before the backend and the kernel pool start their threads
    msg = (f"mlxfast: error: rank {rank}: the other tensor-parallel ranks did not connect within "
           f"{timeout_s:.0f} s (backend {backend}, hostfile {os.environ.get('MLX_HOSTFILE', '-')}); "
           "is every rank started, with the same hostfile? exiting")
    watch = subprocess.Popen([sys.executable, "-c", _CONNECT_WATCH, str(os.getpid()), str(timeout_s), msg],
                             stdin=subprocess.DEVNULL)
    try:
        return mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:
        raise ConnectionError(f"rank {rank}: cannot join the tensor-parallel group: {e}") from None
    finally:
        watch.kill()
        watch.wait()


def gather_rows(group, row) -> np.ndarray:
    """Every rank's ``row`` (int64), as a [size, len(row)] table on every rank."""
    table = np.zeros((group.size(), len(row)), np.int64)
    table[group.rank()] = row
    out = mx.distributed.all_sum(mx.array(table), group=group, stream=mx.cpu)
    mx.eval(out)
    return np.array(out)


def model_fingerprint(model) -> int:
    """A 63-bit fingerprint of the loaded (unsharded) weights and config."""
    from ..kv.ssd import weights_fingerprint

    h = hashlib.blake2b(digest_size=8)
    h.update(weights_fingerprint(model).encode())
    h.update(repr(model.args).encode())
    return int.from_bytes(h.digest(), "little") >> 1


def check_same_model(group, model) -> None:
    """Refuse to go on unless every rank loaded the same weights (on every rank)."""
    fp = model_fingerprint(model)
    table = gather_rows(group, [fp])[:, 0]
    differ = [r for r in range(group.size()) if table[r] != table[0]]
    if differ:
        raise RuntimeError(
            f"the ranks loaded different models: rank(s) {', '.join(map(str, differ))} "
            f"differ from rank 0 (weight fingerprints "
            + ", ".join(f"rank {r}: {int(v):016x}" for r, v in enumerate(table))
            + "); start every rank with the same model files")


def _rank0_ip() -> str:
    """Rank 0's address as the launch names it (ring hostfile, JACCL coordinator,
    NCCL host), else this host's."""
    if os.environ.get("MLXFAST_TP_RANK0_ADDR"):
        return os.environ["MLXFAST_TP_RANK0_ADDR"]
    path = os.environ.get("MLX_HOSTFILE")
    if path:
        try:
            with open(path) as f:
                nodes = json.load(f)
            if nodes and nodes[0]:
                return str(nodes[0][0]).rsplit(":", 1)[0]
        except (OSError, ValueError):
            pass
    for var in ("MLX_JACCL_COORDINATOR", "NCCL_HOST_IP"):
        if os.environ.get(var):
            return os.environ[var].rsplit(":", 1)[0] if var.endswith("COORDINATOR") else os.environ[var]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _keepalive(sock: socket.socket) -> None:
    """Notice a peer machine that vanishes (no FIN) within ~10 s."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 4), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Liveness:
    """One TCP connection from each rank to rank 0, beside the backend's.

    A process that ends closes its sockets at once, so rank 0 learns that a
    rank is gone (and a rank that rank 0 is) within milliseconds, without
    waiting on the backend: measured here, the ring backend's collective
    after a peer's death fails about a second later in one run and spins
    forever in another (its socket thread takes the EOF of a dead peer for
    EAGAIN). ``on_lost(rank)`` runs on a monitor thread (rank 0: each
    follower's rank; a follower: 0).

    Rank 0 listens on an ephemeral port of every interface; the others
    connect to the address the launch gives rank 0 (the ring hostfile, the
    JACCL coordinator, the NCCL host; ``MLXFAST_TP_RANK0_ADDR`` overrides).
    The link is best-effort: a rank that cannot open it within ``link_s`` is
    warned about, and then only the backend's errors and ``--tp-timeout``
    notice it die."""

    def __init__(self, group, on_lost, link_s: float = 15.0):
        self.rank, self.size = group.rank(), group.size()
        self.on_lost = on_lost
        self.closing = False  # set before a clean stop: EOFs are expected then
        self._socks: dict[int, socket.socket] = {}
        # A follower: the highest message number rank 0 has rung for. A bell
        # names its message, so one the follower did not wait for (it went
        # into the collective after a silence) cannot be taken for the next
        # message's: counted bells were then one ahead for good, and the
        # follower busy-polled in every idle collective.
        self._bell = threading.Condition()
        self.rung_upto = 0
        srv = None
        ip = port = 0
        if self.rank == 0:
            srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind(("0.0.0.0", 0))
            srv.listen(self.size)
            port = srv.getsockname()[1]
            ip = int.from_bytes(socket.inet_aton(socket.gethostbyname(_rank0_ip())), "big")
        row = gather_rows(group, [ip, port])[0]
        deadline = time.monotonic() + link_s
        if self.rank == 0:
            try:
                while len(self._socks) < self.size - 1:
                    srv.settimeout(max(0.01, deadline - time.monotonic()))
                    conn, _ = srv.accept()
                    conn.settimeout(link_s)
                    try:
                        r = int(conn.recv(16).decode().strip() or -1)
                    except (OSError, ValueError):
                        r = -1
                    if not 0 < r < self.size or r in self._socks:
                        conn.close()
                        continue
                    conn.settimeout(None)
                    _keepalive(conn)
                    self._socks[r] = conn
            except socket.timeout:
                missing = sorted(set(range(1, self.size)) - set(self._socks))
                log.warning("tensor parallel: rank(s) %s opened no liveness link to rank 0 within %.0f s "
                            "(is %s reachable from them?)", missing, link_s, _rank0_ip())
            finally:
                srv.close()
        else:
            host = socket.inet_ntoa(int(row[0]).to_bytes(4, "big"))
            while True:
                try:
                    conn = socket.create_connection((host, int(row[1])), timeout=link_s)
                    conn.sendall(f"{self.rank:<16d}".encode())
                    conn.settimeout(None)
                    _keepalive(conn)
                    self._socks[0] = conn
                    break
                except OSError as e:
                    if time.monotonic() >= deadline:
                        log.warning("tensor parallel: rank %d cannot open its liveness link to rank 0 "
                                    "at %s:%d: %s", self.rank, host, int(row[1]), e)
                        break
                    time.sleep(0.2)
        threading.Thread(target=self._watch, name="mlxfast-tp-liveness", daemon=True).start()

    def _watch(self) -> None:
        import select

        socks = dict(self._socks)
        pending = b""  # a follower: a bell's bytes split across reads
        while socks:
            try:
                ready, _, _ = select.select(list(socks.values()), [], [])
            except (OSError, ValueError):  # closed here
                return
            for s in ready:
                r = next(k for k, v in socks.items() if v is s)
                try:
                    data = s.recv(64)
                except OSError:
                    data = b""
                if data:
                    if self.rank:
                        data = pending + data
                        whole = len(data) // _BELL.size * _BELL.size
                        self._heard(data[:whole])
                        pending = data[whole:]
                    continue
                del socks[r]
                if not self.closing:
                    self.on_lost(r)

    @property
    def linked(self) -> bool:
        return bool(self._socks)

    def _heard(self, data: bytes) -> None:
        n = len(data) // _BELL.size
        if n:
            last = _BELL.unpack_from(data, (n - 1) * _BELL.size)[0]
            with self._bell:
                self.rung_upto = max(self.rung_upto, last)
                self._bell.notify_all()

    @property
    def rung(self) -> bool:
        """A follower: rank 0 has rung at least once (it knows this link)."""
        return self.rung_upto > 0

    def ring(self, message: int) -> None:
        """Rank 0, before message number ``message`` (1, 2, ...): its number
        to every linked rank, so that a waiting follower sleeps on its socket
        instead of busy-polling in the backend's collective (the ring
        backend's threads spin while a transfer is pending: an idle follower
        took a whole core)."""
        bell = _BELL.pack(message)
        for sock in self._socks.values():
            try:
                sock.sendall(bell)
            except OSError:
                pass  # a closed link: the monitor thread reports it

    def wait_bell(self, message: int, timeout: float) -> bool:
        """A follower: whether rank 0 has rung for message ``message`` within ``timeout``."""
        with self._bell:
            return self._bell.wait_for(lambda: self.rung_upto >= message, timeout=timeout)

    def close(self) -> None:
        self.closing = True
        for s in self._socks.values():
            try:
                s.close()
            except OSError:
                pass


class StepChannel:
    """Rank 0's messages to every rank: ``kind`` plus an int32 payload.

    One ``all_sum`` of a ``CAPACITY`` buffer carries a message's header and
    first values (rank 0's values, zeros from the others), a second one the
    rest when it is longer. Every rank must call ``send`` (rank 0) / ``recv``
    (the others) in the same order."""

    def __init__(self, group, heartbeat_s: float = 1.0, timeout_s: float = 120.0, on_timeout=None):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.heartbeat_s = heartbeat_s
        self.block_size = 16  # the KV pool's, from SETUP
        self.last_contact = time.monotonic()
        self.messages = 0
        self.collectives = 0
        self.seconds = 0.0  # spent in the channel's collectives (rank 0's view)
        self.ranks: list[dict] = []  # per rank, from the last SETUP
        self.liveness: Liveness | None = None  # the ranks' links to rank 0, if any
        # The watchdog: a guarded section (a step, a message) that lasts longer
        # than timeout_s means a peer hangs alive; on_timeout(message) runs, then
        # the process ends.
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self._since: float | None = None
        self._watch: threading.Thread | None = None

    @contextlib.contextmanager
    def guard(self, what: str = "a tensor-parallel step"):
        """Collectives inside must finish within ``timeout_s``."""
        if self._watch is None:
            self._watch = threading.Thread(target=self._watchdog, name="mlxfast-tp-watchdog", daemon=True)
            self._watch.start()
        self._what = what
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _watchdog(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            since = self._since
            if since is None or time.monotonic() - since <= self.timeout_s:
                continue
            msg = (f"rank {self.rank}: {self._what} has not finished in {self.timeout_s:.0f} s "
                   "(--tp-timeout): a tensor-parallel rank hangs")
            print(f"mlxfast: error: {msg}; exiting", file=sys.stderr, flush=True)
            if self.on_timeout is not None:
                try:
                    self.on_timeout(msg)
                except Exception:  # noqa: BLE001
                    pass
            sys.stderr.flush()
            os._exit(1)

    def _reduce(self, buf: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        out = mx.distributed.all_sum(mx.array(buf), group=self.group, stream=mx.cpu)
        mx.eval(out)
        self.collectives += 1
        self.seconds += time.perf_counter() - t0
        self.last_contact = time.monotonic()
        return np.array(out)

    def send(self, kind: int, payload=None) -> None:
        payload = np.zeros(0, np.int32) if payload is None else np.asarray(payload, np.int32)
        n = payload.size
        buf = np.zeros(CAPACITY, np.int32)
        buf[0], buf[1] = kind, n
        first = min(n, CAPACITY - _HEAD)
        buf[_HEAD:_HEAD + first] = payload[:first]
        if self.liveness is not None:
            self.liveness.ring(self.messages + 1)
        self._reduce(buf)
        if n > first:
            self._reduce(payload[first:])
        self.messages += 1

    def recv(self) -> tuple[int, np.ndarray]:
        if self.liveness is not None and self.liveness.linked:
            # Sleep until rank 0 rings for this message (it pings every
            # heartbeat when idle). A link rank 0 does not know of never
            # rings: until its first bell, after a few heartbeats' silence,
            # wait in the collective as without a link (rank 0 can be slow to
            # send its first message: it builds the engine first). Once it has
            # rung, a late bell (a loaded machine) is waited for; a rank 0 that
            # hangs is the guard's watchdog's to report.
            silent = 0
            while not self.liveness.wait_bell(self.messages + 1, max(self.heartbeat_s, 0.1)):
                silent += 1
                if not self.liveness.rung and silent >= 3:
                    break
        buf = self._reduce(np.zeros(CAPACITY, np.int32))
        kind, n = int(buf[0]), int(buf[1])
        if kind not in _KINDS or n < 0:
            raise RuntimeError(f"rank {self.rank}: a malformed tensor-parallel message (kind {kind}, "
                               f"{n} values): the ranks are out of step")
        first = min(n, CAPACITY - _HEAD)
        payload = buf[_HEAD:_HEAD + first]
        if n > first:
            payload = np.concatenate([payload, self._reduce(np.zeros(n - first, np.int32))])
        self.messages += 1
        return kind, payload

    # -- rank 0 --------------------------------------------------------------
    def setup(self, config: dict, own: tuple[int, int]) -> list[dict]:
        """Send the KV pool's configuration; every rank builds its pool and
        answers with (ok, parameter bytes, KV bytes, pid)."""
        text = json.dumps(config).encode()
        self.block_size = config["block_size"]
        with self.guard("setting up the ranks' KV pools"):
            self.send(SETUP, np.frombuffer(text.ljust(-(-len(text) // 4) * 4), np.int32))
            table = gather_rows(self.group, [1, own[0], own[1], os.getpid()])
        self.ranks = [{"rank": r, "param_bytes": int(t[1]), "kv_bytes": int(t[2]), "pid": int(t[3])}
                      for r, t in enumerate(table)]
        bad = [r for r, t in enumerate(table) if t[0] != 1]
        if bad:
            raise RuntimeError(f"tensor-parallel rank(s) {', '.join(map(str, bad))} could not build "
                               "their KV pool (see their log)")
        return self.ranks

    def send_step(self, tokens: list[int], seqs) -> None:
        """The model call's inputs: token ids, and per sequence its start, its
        token count and its block tables (what PagedContext reads)."""
        S, G = len(seqs), len(seqs[0].block_tables)
        bs = self.block_size
        parts = [np.array([len(tokens), S, G], np.int32), np.asarray(tokens, np.int32),
                 np.fromiter((s.start for s in seqs), np.int32, S),
                 np.fromiter((s.n for s in seqs), np.int32, S)]
        for g in range(G):
            for s in seqs:
                parts.append(np.asarray(s.block_tables[g][:-(-(s.start + s.n) // bs)], np.int32))
        self.send(STEP, np.concatenate(parts))

    def ping_if_due(self) -> None:
        if time.monotonic() - self.last_contact >= self.heartbeat_s:
            with self.guard("a heartbeat"):
                self.send(PING)

    def stop(self) -> None:
        if self.liveness is not None:
            self.liveness.closing = True  # the ranks end after this: their links close
        with self.guard("stopping the ranks"):
            self.send(STOP)

    def stats(self) -> dict:
        return {"size": self.size, "ranks": self.ranks, "messages": self.messages,
                "channel_collectives": self.collectives,
                "channel_seconds": round(self.seconds, 6),
                "last_contact_s": round(time.monotonic() - self.last_contact, 3)}


def decode_step(payload: np.ndarray, block_size: int):
    """(tokens [T] int32, [SeqSlice]) from a STEP payload."""
    from ..kv.paged import SeqSlice

    T, S, G = (int(v) for v in payload[:3])
    i = 3
    tokens = payload[i:i + T]
    i += T
    starts = payload[i:i + S].tolist()
    i += S
    ns = payload[i:i + S].tolist()
    i += S
    nbs = [-(-(a + n) // block_size) for a, n in zip(starts, ns)]
    tables = [[None] * S for _ in range(G)]
    for g in range(G):
        for k, nb in enumerate(nbs):
            tables[g][k] = payload[i:i + nb].tolist()
            i += nb
    if i != payload.size:
        raise RuntimeError(f"a tensor-parallel step message of {payload.size} values, {i} expected")
    return tokens, [SeqSlice([tables[g][k] for g in range(G)], starts[k], ns[k]) for k in range(S)]


def _pack(arrays) -> mx.array:
    """Arrays' bytes as one uint8 vector."""
    return mx.concatenate([a.reshape(-1).view(mx.uint8) for a in arrays])


def _unpack(buf, like) -> list[mx.array]:
    """``_pack``'s inverse: ``like`` is a list of (shape, dtype)."""
    out, o = [], 0
    for shape, dtype in like:
        n = int(np.prod(shape)) * dtype.size
        out.append(buf[o:o + n].view(dtype).reshape(shape))
        o += n
    return out


def _all_gather_bytes(x: mx.array, group) -> list[mx.array]:
    """Every rank's uint8 vector ``x`` (all of one length), in rank order."""
    size, n = group.size(), x.size
    pieces = [[] for _ in range(size)]
    for i in range(0, max(n, 1), BYTES_CHUNK):
        part = x[i:i + BYTES_CHUNK]
        g = mx.distributed.all_gather(part, group=group, stream=mx.cpu)
        mx.eval(g)
        m = part.size
        for r in range(size):
            pieces[r].append(g[r * m:(r + 1) * m])
    return [mx.concatenate(p) if len(p) > 1 else p[0] for p in pieces]


def _broadcast_bytes(x: mx.array, group) -> mx.array:
    """Rank 0's uint8 vector (the others pass zeros of its length)."""
    parts = []
    for i in range(0, max(x.size, 1), BYTES_CHUNK):
        parts.append(mx.distributed.all_sum(x[i:i + BYTES_CHUNK], group=group, stream=mx.cpu))
        mx.eval(parts[-1])
    return mx.concatenate(parts) if len(parts) > 1 else parts[0]


class _ArraySpec:
    """The shape and dtype of another rank's storage array (all the SSD tier reads of it)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


class ShardedKVPool:
    """Rank 0's view of every rank's KV pool, for the SSD tier (kv/ssd.py).

    A block's file holds every rank's heads: ``arrays()`` lists rank 0's
    storage arrays, then each other rank's (the same shapes, the heads divide
    evenly), ``read_rows`` gathers a block's rows from every rank (KV_READ, one
    ``all_gather`` per 256 KiB) and ``write_rows`` sends each rank its part
    of restored blocks (KV_WRITE). The tier's decisions, index and files stay
    on rank 0, so the ranks cannot disagree on what is cached."""

    def __init__(self, pool, channel: "StepChannel"):
        self.pool = pool
        self.channel = channel
        self.block_size = pool.block_size
        self.scheme_id = f"{pool.scheme_id}-tp{channel.size}"

    def arrays(self):
        local = list(self.pool.arrays())
        return local + [_ArraySpec(a.shape, a.dtype) for _ in range(1, self.channel.size) for a in local]

    def read_rows(self, rows: mx.array) -> list[mx.array]:
        ch = self.channel
        idx = np.array(rows, np.int32)
        with ch.guard("reading KV blocks from the ranks"):
            ch.send(KV_READ, np.concatenate([[idx.size], idx]))
            local = self.pool.read_rows(rows)
            got = _all_gather_bytes(_pack(local), ch.group)
        like = [(a.shape, a.dtype) for a in local]
        return local + [a for r in range(1, ch.size) for a in _unpack(got[r], like)]

    def write_rows(self, rows: mx.array, data) -> None:
        ch = self.channel
        k = len(data) // ch.size
        self.pool.write_rows(rows, data[:k])
        parts = [_pack(data[r * k:(r + 1) * k]) for r in range(1, ch.size)]
        idx = np.array(rows, np.int32)
        with ch.guard("writing KV blocks to the ranks"):
            ch.send(KV_WRITE, np.concatenate([[idx.size], idx, [parts[0].size]]))
            _broadcast_bytes(mx.concatenate(parts), ch.group)


class Follower:
    """A rank other than 0: runs rank 0's model steps on its shard until STOP.

    Waiting for a message is guarded too: rank 0 sends one at least every
    heartbeat, so a silence of ``timeout_s`` means it hangs."""

    def __init__(self, model, channel: StepChannel):
        self.model = model
        self.channel = channel
        self.pool = None
        self.native = None
        self.block_size = 16
        self.steps = 0

    def run(self) -> None:
        ch = self.channel
        while True:
            with ch.guard("waiting for rank 0 (or running its step)"):
                kind, payload = ch.recv()
                if kind == STEP:
                    self._step(payload)
                elif kind == SETUP:
                    self._setup(payload)
                elif kind == KV_READ:
                    rows = mx.array(payload[1:1 + int(payload[0])])
                    _all_gather_bytes(_pack(self.pool.read_rows(rows)), ch.group)
                elif kind == KV_WRITE:
                    self._write_rows(payload)
                elif kind == STOP:
                    self.pool = None
                    return

    def _setup(self, payload: np.ndarray) -> None:
        from ..kv.block_pool import KVPool, kv_dtype
        from ..kv.schemes import parse_kv_quant
        from ..models.shard import param_bytes

        self.pool = None
        ok, kv_bytes = 1, 0
        try:
            cfg = json.loads(payload.tobytes().rstrip(b" ").decode())
            layers = self.model.kv_layers
            dtype = kv_dtype(cfg["kv_dtype"])
            spec = parse_kv_quant(cfg["kv_quant"], head_dim=layers[0].head_dim, dtype=dtype,
                                  group_size=cfg["kv_group_size"])
            self.block_size = cfg["block_size"]
            self.native = cfg["native"]
            self.pool = KVPool(layers, cfg["num_blocks"], self.block_size, dtype, kv_quant=spec,
                               release=cfg["release"])
            kv_bytes = self.pool.nbytes
        except Exception:  # noqa: BLE001  (answered, then rank 0 stops the launch)
            log.exception("rank %d: cannot build the KV pool", self.channel.rank)
            ok = 0
        gather_rows(self.channel.group, [ok, param_bytes(self.model), kv_bytes, os.getpid()])
        if not ok:
            raise RuntimeError(f"rank {self.channel.rank}: cannot build the KV pool")

    def _write_rows(self, payload: np.ndarray) -> None:
        """This rank's part of restored blocks (ShardedKVPool.write_rows)."""
        ch = self.channel
        n = int(payload[0])
        rows, nbytes = mx.array(payload[1:1 + n]), int(payload[1 + n])
        buf = _broadcast_bytes(mx.zeros(((ch.size - 1) * nbytes,), mx.uint8), ch.group)
        mine = buf[(ch.rank - 1) * nbytes:ch.rank * nbytes]
        like = [((n, *a.shape[1:]), a.dtype) for a in self.pool.arrays()]
        self.pool.write_rows(rows, _unpack(mine, like))

    def _step(self, payload: np.ndarray) -> None:
        from ..kv.paged import PagedContext

        tokens, seqs = decode_step(payload, self.block_size)
        ctx = PagedContext(self.pool, seqs, native=self.native)
        h = self.model(mx.array(tokens[:, None]), ctx)  # compute_head is False: the last hidden state
        mx.eval(h, self.pool.arrays())
        self.steps += 1


# -- one machine: N ranks on loopback ----------------------------------------

def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _die_with_supervisor() -> None:
    """In a rank, before exec (Linux): SIGTERM when the supervisor dies, even
    by SIGKILL, so that no rank outlives it (an orphaned follower busy-polls
    the ring forever)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def launch_local(n: int, argv: list[str], *, grace_s: float = 15.0) -> int:
    """Run ``python -m mlxfast.serve argv`` as ``n`` ring ranks on loopback and
    supervise them: SIGINT/SIGTERM go to rank 0 (which stops the others), a
    rank that exits ends the rest within ``grace_s``, and the exit status is
    rank 0's (or the first failing rank's)."""
    ports = _free_ports(n)
    fd, hostfile = tempfile.mkstemp(prefix="mlxfast-tp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump([[f"127.0.0.1:{p}"] for p in ports], f)
    try:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    except OSError:
        cpus = os.cpu_count() or 1
    threads = str(max(1, cpus // n))
    procs = []
    for rank in range(n):  # each rank keeps its share of the cores (pin_local_rank)
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=hostfile, MLXFAST_TP_BACKEND="ring")
        env.setdefault("MLXFAST_NUM_THREADS", threads)
        env.setdefault("MLX_NUM_THREADS", threads)
        procs.append(subprocess.Popen([sys.executable, "-m", "mlxfast.serve", *argv], env=env,
                                      preexec_fn=_die_with_supervisor if sys.platform == "linux" else None))

    def forward(sig, frame):
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        first_exit = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if first_exit is None and any(c is not None for c in codes):
                first_exit = time.monotonic()
            if first_exit is not None and time.monotonic() - first_exit > grace_s:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                deadline = time.monotonic() + 3
                for p in procs:
                    try:
                        p.wait(max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
                break
            time.sleep(0.05)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        os.unlink(hostfile)
    codes = [128 - c if c < 0 else c for c in (p.returncode for p in procs)]  # killed by signal s: 128 + s
    if codes[0]:
        return codes[0]
    return next((c for c in codes if c), 0)
