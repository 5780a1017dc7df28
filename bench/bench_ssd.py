"""SSD-tier benchmark, one run, one process (the engine in-process, no HTTP):

1. TTFT of a 4,000-token prompt: cold, with its prefix in RAM, and after a
   restart from SSD (a new engine on the same directory; the block files'
   pages are dropped from the page cache first with
   posix_fadvise(POSIX_FADV_DONTNEED), which works without root on clean,
   fsynced files, so the restore reads the disk).
2. Restore read throughput (bytes the reader thread read / its time) against
   the disk's sequential read speed, measured the same way on a file of the
   same size in the same directory (written, fsynced, dropped from the cache,
   read back in 1 MiB reads).
3. Decode tok/s of one stream with heavy write-behind traffic (a backlog of
   dirty cached blocks being written) vs without, interleaved repeats.

    .venv/bin/python bench/bench_ssd.py [--model PATH] [--dir DIR] [--prompt-tokens 4000]

Targets (issue): restore >= 10x sooner than cold prefill; restore read rate
>= half the disk's; decode with write-behind within 5% of decode without.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import mlxfast
from mlxfast.engine.api import Request, SamplingParams, TokenEvent
from mlxfast.engine.config import EngineConfig
from mlxfast.engine.engine import Engine


async def _timed(engine, request):
    t0 = time.perf_counter()
    stamps = []
    async for ev in engine.submit(request):
        if isinstance(ev, TokenEvent):
            stamps.append(time.perf_counter())
    return t0, stamps


def run(engine, prompt, max_tokens=1, salt=""):
    req = Request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                  cache_salt=salt)
    return asyncio.run(_timed(engine, req))


def ttft(engine, prompt, salt=""):
    t0, stamps = run(engine, prompt, 1, salt)
    return stamps[0] - t0


def drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_speed(directory: Path, nbytes: int) -> float:
    """Sequential read of a fresh nbytes file after dropping its pages: bytes/s."""
    path = directory / "seqread.bin"
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes >> 20)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    drop_cache([path])
    t0 = time.perf_counter()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(1 << 20)
            if not b:
                break
            n += len(b)
    dt = time.perf_counter() - t0
    path.unlink()
    return n / dt


def decode_rate(engine, prompt, n_tokens, spans=None) -> float:
    t0, stamps = run(engine, prompt, n_tokens)
    if spans is not None:
        spans.append(stamps[-1] - stamps[0])
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dir", default=None, help="SSD cache directory (default: a temp dir under ./build)")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--backlog-tokens", type=int, default=3000, help="dirty tokens written during decode")
    ap.add_argument("--repeats", type=int, default=6, help="decode runs each way (interleaved ABBA)")
    ap.add_argument("--decode-only", action="store_true", help="skip the TTFT/restore part")
    args = ap.parse_args()

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-ssd-", dir=Path("build").resolve()
                                                                 if Path("build").is_dir() else None))
    if base.exists():
        shutil.rmtree(base)
    model, tok = mlxfast.load(args.model)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
    cfg = dict(ssd_cache_dir=str(base), kv_cache_gb=1.0)

    if not args.decode_only:
        eng = Engine(model, tok, EngineConfig(**cfg)).start()
        try:
            t_cold = ttft(eng, prompt)
            t_ram = ttft(eng, prompt)
            flushed = eng.flush_cache(300)
        finally:
            eng.shutdown()
        files = sorted(base.glob("ns-*/*.kv"))
        drop_cache(files)

    eng = Engine(model, tok, EngineConfig(**cfg)).start()
    try:
        if not args.decode_only:
            t_ssd = ttft(eng, prompt)
            s = eng.stats()["ssd"]
            read_rate = s["read_bytes"] / max(s["restore_read_seconds"], 1e-9)
            disk_rate = disk_read_speed(base, s["read_bytes"])

        # Decode with and without a write-behind backlog. The backlog: cached
        # blocks of other prompts, marked not-on-disk so write-behind rewrites them.
        ssd = eng.connector
        ssd.debounce_s = 1e9  # hold the backlog until the measurement starts
        backlog = []
        for i in range(max(1, args.backlog_tokens // 1000)):
            p = [rng.randrange(1000, 40000) for _ in range(1000)]
            run(eng, p, 1)
            backlog.append(p)
        eng.flush_cache(300)
        short = [rng.randrange(1000, 40000) for _ in range(32)]
        decode_rate(eng, short, 16)  # warm-up
        quiet, heavy, written, spans, engine_cost = [], [], [], [], []

        def with_backlog():
            keys = list(eng.allocator.cached)
            ssd.index.clear()  # pretend nothing is on disk: every cached block is rewritten
            ssd.bytes = 0
            now = time.monotonic()
            for h in keys:
                ssd.dirty[h] = (eng.allocator.cached[h], now - 10)
            ssd.debounce_s = 0.0
            w0, c0 = ssd.counters["write_behind_blocks"], ssd.counters["submit_seconds"]
            heavy.append(decode_rate(eng, short, args.decode_tokens, spans))
            written.append(ssd.counters["write_behind_blocks"] - w0)
            engine_cost.append((ssd.counters["submit_seconds"] - c0) / spans[-1])
            ssd.debounce_s = 1e9
            eng.flush_cache(300)

        for i in range(args.repeats):  # ABBA order cancels drift in the machine's load
            if i % 2 == 0:
                quiet.append(decode_rate(eng, short, args.decode_tokens))
                with_backlog()
            else:
                with_backlog()
                quiet.append(decode_rate(eng, short, args.decode_tokens))
        block_bytes = ssd.block_bytes
    finally:
        eng.shutdown()
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)

    mib = 1 << 20
    q, h = statistics.median(quiet), statistics.median(heavy)
    if args.decode_only:
        print(f"decode tok/s without write-behind {q:.1f}, with {h:.1f} ({(h / q - 1) * 100:+.1f}%); "
              f"blocks written during each decode: {written}")
        print(f"  runs without: {[round(x, 1) for x in quiet]}, with: {[round(x, 1) for x in heavy]}")
        print(f"  engine-thread time spent copying blocks out for the writer: "
              f"{statistics.median(engine_cost) * 100:.1f}% of each decode (median)")
        return
    print(f"model: {args.model or 'default'}; prompt {len(prompt)} tokens; "
          f"{len(files)} block files of {block_bytes / 1024:.0f} KiB; flush durable={flushed['durable']}")
    print(f"TTFT cold           {t_cold:8.3f} s")
    print(f"TTFT prefix in RAM  {t_ram:8.3f} s   ({t_cold / t_ram:.0f}x sooner than cold)")
    print(f"TTFT after restart  {t_ssd:8.3f} s   ({t_cold / t_ssd:.0f}x sooner than cold; target >= 10x)")
    print(f"restore: {s['restored_blocks']} blocks, {s['read_bytes'] / mib:.0f} MiB read in "
          f"{s['restore_read_seconds']:.3f} s by the reader = {read_rate / mib:.0f} MiB/s; "
          f"copy into the pool {s['restore_copy_seconds']:.3f} s; "
          f"submit to admission {s['restore_seconds']:.3f} s")
    print(f"disk sequential read (same size, page cache dropped) {disk_rate / mib:.0f} MiB/s; "
          f"restore/disk = {read_rate / disk_rate:.2f} (target >= 0.5)")
    print(f"decode tok/s without write-behind {q:.1f}, with {h:.1f} "
          f"({(h / q - 1) * 100:+.1f}%; target within 5%); blocks written during each decode: {written}")
    print(f"  runs without: {[round(x, 1) for x in quiet]}, with: {[round(x, 1) for x in heavy]}")
    print(f"  engine-thread time spent copying blocks out for the writer: "
          f"{statistics.median(engine_cost) * 100:.1f}% of each decode (median)")


if __name__ == "__main__":
    main()
