"""What the engine measures about the requests it runs: the one metrics source.

The engine thread records; any thread takes a ``snapshot()`` (plain data:
numbers, ``{reason: count}``, histograms as cumulative ``[(le, count), ...]``)
that ``/stats`` returns and the server renders as Prometheus text
(``server/metrics.py``). Names and bucket bounds follow vLLM's
(``vllm:<name>`` there, ``mlxfast:<name>`` here). Pure Python, no MLX.
"""

from __future__ import annotations

import bisect
import threading

# vLLM's bucket bounds (seconds; tokens for the request-size histograms).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last = +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def snapshot(self) -> dict:
        """Prometheus-style cumulative buckets: ``[(le, count), ...]`` ending with +Inf."""
        cum, out = 0, []
        for le, c in zip(self.buckets + (float("inf"),), self.counts):
            cum += c
            out.append((le, cum))
        return {"buckets": out, "sum": self.sum, "count": out[-1][1]}


class RequestMetrics:
    """Counters and histograms of requests, tokens and latencies."""

    def __init__(self):
        self._lock = threading.Lock()
        self.num_requests_total = 0  # admitted to the engine
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.request_success_total: dict[str, int] = {}  # finished requests by finish reason
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = Histogram(TOKEN_BUCKETS)
        self.generation_tokens = Histogram(TOKEN_BUCKETS)

    def admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.num_requests_total += 1
            self.prompt_tokens_total += prompt_tokens

    def token(self, ttft: float | None, gap: float | None) -> None:
        """One generated token: its request's first (``ttft``) or a later one (``gap``)."""
        with self._lock:
            self.generation_tokens_total += 1
            if ttft is not None:
                self.ttft.observe(ttft)
            elif gap is not None:
                self.itl.observe(gap)

    def finished(self, reason: str, e2e: float, prompt_tokens: int, generation_tokens: int) -> None:
        with self._lock:
            self.request_success_total[reason] = self.request_success_total.get(reason, 0) + 1
            self.e2e.observe(e2e)
            self.prompt_tokens.observe(prompt_tokens)
            self.generation_tokens.observe(generation_tokens)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "num_requests_total": self.num_requests_total,
                "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total,
                "request_success_total": dict(self.request_success_total),
                "time_to_first_token_seconds": self.ttft.snapshot(),
                "inter_token_latency_seconds": self.itl.snapshot(),
                "e2e_request_latency_seconds": self.e2e.snapshot(),
                "request_prompt_tokens": self.prompt_tokens.snapshot(),
                "request_generation_tokens": self.generation_tokens.snapshot(),
            }
