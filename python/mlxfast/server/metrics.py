"""``/metrics``: the engine's measurements (``engine/metrics.py``, taken from
``engine.stats()``) rendered as Prometheus text by ``prometheus_client``, in
vLLM's naming with the ``mlxfast:`` prefix. The server measures nothing itself.

Families: requests (running, waiting, finished by reason, prompt and
generation sizes), tokens, latencies (time to first token, inter-token,
end to end), the prefix cache, KV usage and preemptions, the SSD tier, and
speculative decoding (with a ``proposer`` label).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

PREFIX = "mlxfast"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# (engine stats key, metric name without the _total a counter gets, help)
_GAUGES = (
    ("num_requests_running", "num_requests_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_requests_waiting", "Requests queued for the batch (waiting for an SSD load included)."),
    ("kv_cache_usage_perc", "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)."),
)
_COUNTERS = (
    ("num_preemptions_total", "num_preemptions", "Requests preempted by the scheduler."),
    ("prompt_tokens_total", "prompt_tokens", "Prompt tokens of the requests admitted."),
    ("generation_tokens_total", "generation_tokens", "Tokens generated."),
    ("prefix_cache_queries_total", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits_total", "prefix_cache_hits", "Prompt tokens served from the prefix cache."),
)
_HISTOGRAMS = (
    ("time_to_first_token_seconds", "Time from submission to the first token."),
    ("inter_token_latency_seconds", "Time between a request's tokens."),
    ("e2e_request_latency_seconds", "Time from submission to the end of a request."),
    ("request_prompt_tokens", "Prompt tokens per finished request."),
    ("request_generation_tokens", "Generated tokens per finished request."),
)
# The SSD tier's stats keys (metric ``ssd_cache_<key>``) with their help.
_SSD_GAUGES = {
    "entries": "KV blocks stored in the SSD cache.",
    "bytes": "Bytes of KV block files in the SSD cache.",
    "pending_writes": "Block writes queued or in flight.",
}
_SSD_COUNTERS = {
    "restores": "Requests whose prefix was restored from SSD.",
    "restored_blocks": "KV blocks restored from SSD.",
    "restore_seconds": "Time spent restoring from SSD.",
    "spilled_blocks": "Evicted RAM blocks written to SSD.",
    "write_behind_blocks": "Cached blocks written behind.",
    "demoted_blocks": "Idle blocks moved from RAM to SSD.",
    "dropped_writes": "Block writes dropped (queue over its cap).",
    "failed_writes": "Block writes that failed (disk full, I/O).",
    "quarantined": "Bad or foreign block files moved aside.",
    "evicted_files": "Block files removed at the byte cap.",
}
_SPEC = (  # vLLM's names
    ("num_drafts", "spec_decode_num_drafts", "Rows that carried draft tokens."),
    ("num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
    ("num_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted."),
)


def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return v
    return None


def _name(metric: str) -> str:
    return f"{PREFIX}:{metric}"


def values(stats: dict) -> dict[str, Any]:
    """The headline numbers of ``engine.stats()`` (``/stats``'s ``metrics``)."""
    out: dict[str, Any] = {k: stats[k] for k, _, _ in _GAUGES + _COUNTERS if _num(stats.get(k)) is not None}
    if isinstance(stats.get("request_success_total"), dict):
        out["request_success_total"] = dict(stats["request_success_total"])
    return out


def _histogram(name: str, help: str, snap, labels: list[str]):
    if not isinstance(snap, dict) or not snap.get("buckets"):
        return None
    h = HistogramMetricFamily(_name(name), help, labels=["model_name"])
    buckets = [("+Inf" if math.isinf(le) else repr(float(le)), c) for le, c in snap["buckets"]]
    h.add_metric(labels, buckets, sum_value=snap.get("sum", 0.0))
    return h


def families(stats: dict, model_name: str):
    """Prometheus metric families from one ``engine.stats()`` snapshot."""
    labels = [model_name]
    for key, name, help in _GAUGES:
        v = _num(stats.get(key))
        if v is not None:
            yield _gauge(name, help, labels, v)
    for key, name, help in _COUNTERS:
        v = _num(stats.get(key))
        if v is not None:
            yield _counter(name, help, ["model_name"], labels, v)
    finished = stats.get("request_success_total")
    if isinstance(finished, dict):
        c = CounterMetricFamily(_name("request_success"), "Finished requests by finish reason.",
                                labels=["model_name", "finished_reason"])
        for reason, n in sorted(finished.items()):
            c.add_metric([model_name, str(reason)], n)
        yield c
    for name, help in _HISTOGRAMS:
        h = _histogram(name, help, stats.get(name), labels)
        if h is not None:
            yield h
    ssd = stats.get("ssd")
    if isinstance(ssd, dict) and ssd.get("enabled"):
        for table, counter in ((_SSD_GAUGES, False), (_SSD_COUNTERS, True)):
            for key, help in table.items():
                v = _num(ssd.get(key))
                if v is not None:
                    name = f"ssd_cache_{key}"
                    yield _counter(name, help, ["model_name"], labels, v) if counter else _gauge(name, help, labels, v)
    spec = stats.get("spec_decode")
    if isinstance(spec, dict) and spec.get("kind"):
        for key, name, help in _SPEC:
            v = _num(spec.get(key))
            if v is not None:
                yield _counter(name, help, ["model_name", "proposer"], [model_name, str(spec["kind"])], v)


def _gauge(name: str, help: str, labels: list[str], v: float):
    g = GaugeMetricFamily(_name(name), help, labels=["model_name"])
    g.add_metric(labels, v)
    return g


def _counter(name: str, help: str, label_names: list[str], labels: list[str], v: float):
    c = CounterMetricFamily(_name(name), help, labels=label_names)
    c.add_metric(labels, v)
    return c


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict], model_name: Callable[[], str]):
        self._stats = stats
        self._model_name = model_name

    def collect(self):
        yield from families(self._stats(), self._model_name())


def registry(stats: Callable[[], dict], model_name: Callable[[], str]) -> CollectorRegistry:
    """A registry whose one collector reads the engine's stats at each scrape."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_EngineCollector(stats, model_name))
    return reg


def render(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)
