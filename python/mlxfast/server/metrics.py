"""Request metrics measured at the HTTP layer, rendered as Prometheus text in
vLLM's naming (``mlxfast:<name>``), merged with the engine's own counters."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

PREFIX = "mlxfast"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.count += 1
        self.sum += v
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
                break

    def lines(self, name: str, help: str) -> list[str]:
        out = [f"# HELP {name} {help}", f"# TYPE {name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum}")
        out.append(f"{name}_count {self.count}")
        return out


class Metrics:
    """Thread-safe counters and histograms for the requests the server ran."""

    def __init__(self):
        self._lock = threading.Lock()
        self.ttft = Histogram(_TTFT_BUCKETS)
        self.itl = Histogram(_ITL_BUCKETS)
        self.e2e = Histogram(_E2E_BUCKETS)
        self.waiting = 0  # submitted, no token yet
        self.running = 0  # producing tokens
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # prompt tokens found there
        self.requests_finished: dict[str, int] = {}
        self.started = time.time()

    def submitted(self) -> None:
        with self._lock:
            self.waiting += 1

    def first_token(self, ttft: float) -> None:
        with self._lock:
            self.waiting -= 1
            self.running += 1
            self.ttft.observe(ttft)

    def token_gap(self, gap: float) -> None:
        with self._lock:
            self.itl.observe(gap)

    def finished(self, had_token: bool, e2e: float, reason: str, prompt: int, completion: int, cached: int) -> None:
        with self._lock:
            if had_token:
                self.running -= 1
            else:
                self.waiting -= 1
            self.e2e.observe(e2e)
            self.prompt_tokens += prompt
            self.generation_tokens += completion
            self.prefix_queries += prompt
            self.prefix_hits += cached
            self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "num_requests_running": self.running,
                "num_requests_waiting": self.waiting,
                "prompt_tokens_total": self.prompt_tokens,
                "generation_tokens_total": self.generation_tokens,
                "prefix_cache_queries_total": self.prefix_queries,
                "prefix_cache_hits_total": self.prefix_hits,
                "request_success_total": dict(self.requests_finished),
                "time_to_first_token_seconds": {"count": self.ttft.count, "sum": self.ttft.sum},
                "inter_token_latency_seconds": {"count": self.itl.count, "sum": self.itl.sum},
                "e2e_request_latency_seconds": {"count": self.e2e.count, "sum": self.e2e.sum},
                "uptime_seconds": time.time() - self.started,
            }


def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return v
    return None


# Engine stats keys that may carry each gauge/counter (first present wins
# over the HTTP-layer value).
_ENGINE_KEYS = {
    "num_requests_running": ("num_requests_running", "running"),
    "num_requests_waiting": ("num_requests_waiting", "waiting"),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "kv_usage", "kv_cache_usage"),
    "num_preemptions_total": ("num_preemptions_total", "preemptions"),
    "prefix_cache_queries_total": ("prefix_cache_queries_total", "prefix_cache_queries"),
    "prefix_cache_hits_total": ("prefix_cache_hits_total", "prefix_cache_hits"),
}

_HELP = {
    "num_requests_running": ("gauge", "Requests producing tokens."),
    "num_requests_waiting": ("gauge", "Requests waiting for their first token."),
    "kv_cache_usage_perc": ("gauge", "Fraction of KV cache blocks in use (0..1)."),
    "num_preemptions_total": ("counter", "Requests preempted by the scheduler."),
    "prompt_tokens_total": ("counter", "Prompt tokens processed."),
    "generation_tokens_total": ("counter", "Tokens generated."),
    "prefix_cache_queries_total": ("counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits_total": ("counter", "Prompt tokens served from the prefix cache."),
}


def merged_values(metrics: Metrics, engine_stats: dict | None) -> dict[str, float]:
    snap = metrics.snapshot()
    values: dict[str, float] = {
        k: snap[k] for k in (
            "num_requests_running", "num_requests_waiting", "prompt_tokens_total",
            "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
        )
    }
    values.setdefault("kv_cache_usage_perc", 0.0)
    values.setdefault("num_preemptions_total", 0)
    stats = engine_stats or {}
    for name, keys in _ENGINE_KEYS.items():
        for k in keys:
            v = _num(stats.get(k))
            if v is not None:
                values[name] = v
                break
    return values


_SSD = (  # (stats key, metric, type, help)
    ("entries", "ssd_cache_entries", "gauge", "KV blocks stored in the SSD cache."),
    ("bytes", "ssd_cache_bytes", "gauge", "Bytes of KV block files in the SSD cache."),
    ("pending_writes", "ssd_cache_pending_writes", "gauge", "Block writes queued or in flight."),
    ("restores", "ssd_cache_restores_total", "counter", "Requests whose prefix was restored from SSD."),
    ("restored_blocks", "ssd_cache_restored_blocks_total", "counter", "KV blocks restored from SSD."),
    ("restore_seconds", "ssd_cache_restore_seconds_total", "counter", "Time spent restoring from SSD."),
    ("spilled_blocks", "ssd_cache_spilled_blocks_total", "counter", "Evicted RAM blocks written to SSD."),
    ("write_behind_blocks", "ssd_cache_write_behind_blocks_total", "counter", "Cached blocks written behind."),
    ("demoted_blocks", "ssd_cache_demoted_blocks_total", "counter", "Idle blocks moved from RAM to SSD."),
    ("dropped_writes", "ssd_cache_dropped_writes_total", "counter", "Block writes dropped (queue over its cap)."),
    ("failed_writes", "ssd_cache_failed_writes_total", "counter", "Block writes that failed (disk full, I/O)."),
    ("quarantined", "ssd_cache_quarantined_total", "counter", "Bad or foreign block files moved aside."),
    ("evicted_files", "ssd_cache_evicted_files_total", "counter", "Block files removed at the byte cap."),
)


def _ssd_lines(ssd, label: str) -> list[str]:
    if not isinstance(ssd, dict) or not ssd.get("enabled"):
        return []
    out = []
    for key, name, kind, help in _SSD:
        v = _num(ssd.get(key))
        if v is not None:
            full = f"{PREFIX}:{name}"
            out += [f"# HELP {full} {help}", f"# TYPE {full} {kind}", f"{full}{label} {v}"]
    return out


_SPEC = (  # (stats key, metric, help), vLLM's names
    ("num_drafts", "spec_decode_num_drafts_total", "Rows that carried draft tokens."),
    ("num_draft_tokens", "spec_decode_num_draft_tokens_total", "Draft tokens proposed and verified."),
    ("num_accepted_tokens", "spec_decode_num_accepted_tokens_total", "Draft tokens accepted."),
)


def _spec_lines(spec, model_name: str) -> list[str]:
    if not isinstance(spec, dict) or not spec.get("kind"):
        return []
    label = f'{{model_name="{model_name}",proposer="{spec["kind"]}"}}'
    out = []
    for key, name, help in _SPEC:
        v = _num(spec.get(key))
        if v is not None:
            full = f"{PREFIX}:{name}"
            out += [f"# HELP {full} {help}", f"# TYPE {full} counter", f"{full}{label} {v}"]
    return out


def render_prometheus(metrics: Metrics, engine_stats: dict | None, model_name: str) -> str:
    label = f'{{model_name="{model_name}"}}'
    lines: list[str] = []
    for name, v in merged_values(metrics, engine_stats).items():
        kind, help = _HELP[name]
        full = f"{PREFIX}:{name}"
        lines += [f"# HELP {full} {help}", f"# TYPE {full} {kind}", f"{full}{label} {v}"]
    snap = metrics.snapshot()
    full = f"{PREFIX}:request_success_total"
    lines += [f"# HELP {full} Finished requests by finish reason.", f"# TYPE {full} counter"]
    for reason, n in sorted(snap["request_success_total"].items()):
        lines.append(f'{full}{{model_name="{model_name}",finished_reason="{reason}"}} {n}')
    lines += _ssd_lines((engine_stats or {}).get("ssd"), label)
    lines += _spec_lines((engine_stats or {}).get("spec_decode"), model_name)
    with metrics._lock:
        lines += metrics.ttft.lines(f"{PREFIX}:time_to_first_token_seconds", "Time to first token.")
        lines += metrics.itl.lines(f"{PREFIX}:inter_token_latency_seconds", "Time between tokens.")
        lines += metrics.e2e.lines(f"{PREFIX}:e2e_request_latency_seconds", "End-to-end request latency.")
    return "\n".join(lines) + "\n"
