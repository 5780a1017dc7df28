"""Load test for any OpenAI-compatible server (loopback only).

For each concurrency level, ``concurrency`` workers stream chat completions
with distinct ~100-token prompts and a fixed number of output tokens
(``ignore_eos`` is sent, servers that ignore it may stop early), and the
script reports TTFT p50/p95, ITL p50/p95, end-to-end latency, and aggregate
output tokens/s. Bounded: ``--requests`` per level (default 2x concurrency)
and ``--time-limit`` seconds per level.

Besides the table, it writes a PNG (``--plot``, matplotlib): throughput,
TTFT p50/p95 and ITL p50/p95 against concurrency, one line per server. Give
several servers as ``--url LABEL=URL`` (run one after the other), or plot
saved runs with ``--results a.json b.json`` (what ``--json`` wrote), so
mlxfast, ``mlx_lm.server`` and llama.cpp's server land on one figure.

    python bench/load.py --url http://127.0.0.1:8080 [--levels 1,4,8,16]
        [--max-tokens 128] [--api-key KEY] [--json out.json] [--plot load.png]
    python bench/load.py --url mlxfast=http://127.0.0.1:8080 --url llama.cpp=http://127.0.0.1:8081
    python bench/load.py --results mlxfast.json llamacpp.json --plot compare.png
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
from pathlib import Path
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


async def run_level(args, url: str, model: str, concurrency: int, start_index: int) -> dict:
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
                    results.append(await one_request(client, url, model, p, args.max_tokens, headers))
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


def parse_target(text: str) -> tuple[str | None, str]:
    """``LABEL=URL`` or ``URL``."""
    label, sep, url = text.partition("=")
    if sep and "://" not in label:
        return label.strip() or None, url.strip().rstrip("/")
    return None, text.strip().rstrip("/")


def label_of(url: str) -> str:
    u = urlparse(url)
    return f"{u.hostname}:{u.port}" if u.port else (u.hostname or url)


def load_runs(path: str) -> list[dict]:
    """Runs from a ``--json`` file: a list of runs, one run, or (older files)
    a bare list of levels, labelled by the file's name."""
    with open(path) as fh:
        data = json.load(fh)
    if isinstance(data, dict):
        data = [data]
    if data and all(isinstance(x, dict) and "concurrency" in x for x in data):
        data = [{"label": Path(path).stem, "levels": data}]
    runs = []
    for run in data:
        if not isinstance(run, dict) or not isinstance(run.get("levels"), list):
            raise SystemExit(f"load.py: {path} holds no load.py results")
        runs.append(run)
    return runs


SERIES = [  # (panel title, y label, [(key, style suffix)])
    ("Throughput", "output tokens/s (all requests)", [("output_tok_s", "")]),
    ("Time to first token", "ms", [("ttft_p50_ms", "p50"), ("ttft_p95_ms", "p95")]),
    ("Inter-token latency", "ms", [("itl_p50_ms", "p50"), ("itl_p95_ms", "p95")]),
]
PLOT_SIZE = (13.5, 4.2)  # inches
PLOT_DPI = 100


def plot(runs: list[dict], path: str, title: str | None = None) -> None:
    """Throughput and TTFT/ITL p50 (solid) / p95 (dashed) against concurrency,
    one colour per run, as a PNG of PLOT_SIZE * PLOT_DPI pixels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SERIES), figsize=PLOT_SIZE, dpi=PLOT_DPI)
    levels = sorted({lv["concurrency"] for run in runs for lv in run["levels"]})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (name, ylabel, keys) in zip(axes, SERIES):
        for i, run in enumerate(runs):
            pts = sorted(run["levels"], key=lambda lv: lv["concurrency"])
            for key, which in keys:
                xy = [(lv["concurrency"], lv[key]) for lv in pts if lv.get(key) is not None]
                if not xy:
                    continue
                xs, ys = zip(*xy)
                colour = colours[i % len(colours)]
                ax.plot(xs, ys, marker="o", color=colour, linestyle="--" if which == "p95" else "-",
                        label=f"{run.get('label') or '?'}" + (f" {which}" if which else ""))
                if key == "output_tok_s":  # levels where requests failed are marked
                    for lv in pts:
                        if lv.get("errors") and lv.get(key) is not None:
                            ax.annotate(f"{lv['errors']} failed", (lv["concurrency"], lv[key]), fontsize=7,
                                        color=colour, textcoords="offset points", xytext=(4, 4))
        ys = [y for line in ax.get_lines() for y in line.get_ydata() if y and y > 0]
        log_y = bool(ys) and max(ys) / min(ys) > 30  # servers far apart: a log scale shows them all
        ax.set_title(name + (" (log scale)" if log_y else ""))
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        if len(levels) > 1 and levels[-1] / levels[0] >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(levels)
        ax.set_xticklabels([str(c) for c in levels])
        if log_y:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)


def print_level(res: dict) -> None:
    f = lambda v: "-" if v is None else str(v)  # noqa: E731
    print(f"{res['concurrency']:>4} {res['requests']:>4} {res['errors']:>3} {f(res['ttft_p50_ms']):>9} "
          f"{f(res['ttft_p95_ms']):>8} {f(res['itl_p50_ms']):>8} {f(res['itl_p95_ms']):>7} "
          f"{f(res['output_tok_s']):>8} {res['wall_s']:>7}", flush=True)
    if res["first_error"]:
        print(f"     first error: {res['first_error']}", file=sys.stderr)


def warm_up(args, url: str, model: str) -> None:
    """One short request before measuring (compiles, allocates, fills caches on
    every server alike); waits while the server answers 503 (still loading)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4}
    deadline = time.perf_counter() + 300
    while True:
        try:
            r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
            if r.status_code == 200:
                return
            if r.status_code != 503 or time.perf_counter() > deadline:
                raise SystemExit(f"load.py: {url} answered the warm-up with HTTP {r.status_code}: {r.text[:200]}")
        except httpx.HTTPError as e:
            if time.perf_counter() > deadline:
                raise SystemExit(f"load.py: {url}: warm-up failed: {e}")
        time.sleep(1)


def run_server(args, url: str, model: str, levels: list[int]) -> list[dict]:
    if args.warmup:
        warm_up(args, url, model)
    out = []
    index = 0
    for c in levels:
        res = asyncio.run(run_level(args, url, model, c, index))
        index += res["requests"] + res["errors"]
        out.append(res)
        print_level(res)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", action="append", default=None, metavar="[LABEL=]URL",
                   help="server to load (repeat for several, run one after the other; "
                        "default http://127.0.0.1:8080)")
    p.add_argument("--model", action="append", default=None,
                   help="model name to request: one for every --url, or one per --url in order "
                        "(default 'default'; mlx_lm.server wants 'default_model')")
    p.add_argument("--api-key", default=None)
    p.add_argument("--levels", default="1,4,8,16", help="comma-separated concurrency levels")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=0, help="requests per level (default 2x concurrency, max 64)")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per level")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the one short request sent to each server before measuring")
    p.add_argument("--json", default=None, help="also write the results here (a list of runs)")
    p.add_argument("--results", nargs="+", default=None, metavar="FILE",
                   help="plot (and tabulate) these --json files instead of running; with --url too, "
                        "their runs are added to the new ones")
    p.add_argument("--plot", default="load.png", metavar="PNG",
                   help="write the figure here (default load.png; '' for none)")
    p.add_argument("--title", default=None, help="the figure's title")
    args = p.parse_args(argv)

    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    if any(c < 1 or c > 64 for c in levels) or not 0 <= args.requests <= 64:
        raise SystemExit("load.py: concurrency and --requests must be within 1..64")
    targets = [parse_target(t) for t in (args.url or ([] if args.results else ["http://127.0.0.1:8080"]))]
    models = args.model or ["default"]
    if len(models) not in (1, len(targets)):
        raise SystemExit("load.py: give one --model, or one per --url")
    models = models * len(targets) if len(models) == 1 else models
    for _, url in targets:
        check_loopback(url)
        try:
            httpx.get(url + "/v1/models", timeout=10,
                      headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})
        except httpx.HTTPError as e:
            raise SystemExit(f"load.py: cannot reach {url}: {e}")

    runs = [run for f in (args.results or []) for run in load_runs(f)]
    for run in runs:
        print(f"== {run.get('label')} (from a results file)")
        print(HEADER)
        for res in run["levels"]:
            print_level({"first_error": None, **res})
    for (label, url), model in zip(targets, models):
        label = label or label_of(url)
        print(f"== {label}: {url} (model '{model}', {args.max_tokens} output tokens a request)")
        print(HEADER)
        runs.append({"label": label, "url": url, "model": model, "max_tokens": args.max_tokens,
                     "levels": run_server(args, url, model, levels)})
    print("(TTFT/ITL in ms; tok/s = aggregate output tokens per second)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(runs, fh, indent=2)
    if args.plot:
        try:
            plot(runs, args.plot, args.title)
        except ImportError:
            print("load.py: matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
            return 0
        print(f"plot: {args.plot}")
    return 0


HEADER = (f"{'conc':>4} {'reqs':>4} {'err':>3} {'TTFT p50':>9} {'p95':>8} {'ITL p50':>8} {'p95':>7} "
          f"{'tok/s':>8} {'wall s':>7}")


if __name__ == "__main__":
    sys.exit(main())
