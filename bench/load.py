"""Load test for any OpenAI-compatible server (loopback only).

For each concurrency level, ``concurrency`` workers stream chat completions
with distinct ~100-token prompts and a fixed number of output tokens
(``ignore_eos`` is sent, servers that ignore it may stop early), and the
script reports TTFT p50/p95, ITL p50/p95, end-to-end latency, and aggregate
output tokens/s. Bounded: ``--requests`` per level (default 2x concurrency)
and ``--time-limit`` seconds per level.

    python bench/load.py --url http://127.0.0.1:8080 [--levels 1,4,8,16]
        [--max-tokens 128] [--api-key KEY] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import socket
import statistics
import sys
import time
from urllib.parse import urlparse

import httpx

TOPICS = [
    "the history of tea", "how bridges carry load", "the life of honeybees", "why the sky is blue",
    "the rules of chess", "how volcanoes form", "the invention of printing", "ocean tides",
    "the water cycle", "how vaccines work", "the migration of birds", "ancient Rome's roads",
    "how batteries store energy", "the design of sailboats", "the orbit of the moon", "coffee farming",
    "the structure of DNA", "how glaciers move", "the origins of jazz", "desert ecosystems",
]


def make_prompt(i: int) -> str:
    """A distinct prompt of roughly 100 tokens."""
    topic = TOPICS[i % len(TOPICS)]
    return (
        f"Request {i}. You are writing for a curious student. Explain {topic} in plain language. "
        "Start with a short overview, then describe the main ideas one by one, giving a concrete "
        "example for each. Mention one common misconception and correct it. Keep sentences short, "
        "avoid jargon where you can, and define any technical term the first time you use it. "
        f"End with one question the student could explore next about {topic}."
    )


def percentile(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        raise SystemExit(f"load.py: cannot resolve {host}: {e}")
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise SystemExit(f"load.py: refusing to load a non-loopback host ({host})")


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, headers):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: list[float] = []
    usage = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                d = ch.get("delta", {})
                if d.get("content") or d.get("reasoning_content"):
                    times.append(time.perf_counter())
    end = time.perf_counter()
    n_out = usage["completion_tokens"] if usage else len(times)
    return {"t0": t0, "end": end, "times": times, "tokens": n_out}


async def run_level(args, concurrency: int, start_index: int) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    n_requests = args.requests or 2 * concurrency
    prompts = [make_prompt(start_index + i) for i in range(n_requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[dict] = []
    errors: list[str] = []
    deadline = time.perf_counter() + args.time_limit

    async with httpx.AsyncClient(timeout=httpx.Timeout(args.time_limit + 60)) as client:
        async def worker():
            while time.perf_counter() < deadline:
                try:
                    p = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    results.append(await one_request(client, args.url, args.model, p, args.max_tokens, headers))
                except Exception as e:  # keep going; report
                    errors.append(str(e))

        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))),
                                   timeout=args.time_limit + 60)
        except asyncio.TimeoutError:
            errors.append("level timed out")
        wall = time.perf_counter() - t0

    ttft = [r["times"][0] - r["t0"] for r in results if r["times"]]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    e2e = [r["end"] - r["t0"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p95_ms": ms(percentile(ttft, 95)),
        "itl_p50_ms": ms(percentile(itl, 50)), "itl_p95_ms": ms(percentile(itl, 95)),
        "e2e_p50_s": None if not e2e else round(statistics.median(e2e), 2),
        "output_tokens": tokens, "wall_s": round(wall, 2),
        "output_tok_s": round(tokens / wall, 1) if wall > 0 else None,
        "req_s": round(len(results) / wall, 2) if wall > 0 else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--model", default="default")
    p.add_argument("--api-key", default=None)
    p.add_argument("--levels", default="1,4,8,16", help="comma-separated concurrency levels")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=0, help="requests per level (default 2x concurrency, max 64)")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per level")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    args.url = args.url.rstrip("/")
    check_loopback(args.url)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    if any(c < 1 or c > 64 for c in levels) or not 0 <= args.requests <= 64:
        raise SystemExit("load.py: concurrency and --requests must be within 1..64")
    try:
        httpx.get(args.url + "/v1/models", timeout=10,
                  headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})
    except httpx.HTTPError as e:
        raise SystemExit(f"load.py: cannot reach {args.url}: {e}")

    header = f"{'conc':>4} {'reqs':>4} {'err':>3} {'TTFT p50':>9} {'p95':>8} {'ITL p50':>8} {'p95':>7} {'tok/s':>8} {'wall s':>7}"
    print(header)
    out = []
    index = 0
    for c in levels:
        res = asyncio.run(run_level(args, c, index))
        index += res["requests"] + res["errors"]
        out.append(res)
        f = lambda v: "-" if v is None else str(v)  # noqa: E731
        print(f"{c:>4} {res['requests']:>4} {res['errors']:>3} {f(res['ttft_p50_ms']):>9} {f(res['ttft_p95_ms']):>8} "
              f"{f(res['itl_p50_ms']):>8} {f(res['itl_p95_ms']):>7} {f(res['output_tok_s']):>8} {res['wall_s']:>7}",
              flush=True)
        if res["first_error"]:
            print(f"     first error: {res['first_error']}", file=sys.stderr)
    print("(TTFT/ITL in ms; tok/s = aggregate output tokens per second)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
