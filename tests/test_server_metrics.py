"""/metrics against the real server: it parses with prometheus_client's own
text parser, and each family moves when it should (requests, tokens,
latencies, the prefix cache, KV usage). The engine measures; the server only
renders what ``engine.stats()`` holds, so /metrics and /stats agree."""

from __future__ import annotations

import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "SmolLM2-135M-Instruct"  # the default model's served name
PROMPT = "Name three colours of the rainbow, please."


def scrape(server) -> dict[str, dict[tuple, float]]:
    """{family name: {(sample name, sorted labels): value}} of one scrape."""
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(r.text):
        assert fam.name.startswith("mlxfast:"), fam.name
        samples = out.setdefault(fam.name, {})
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m, family, sample=None, **labels) -> float:
    labels.setdefault("model_name", MODEL)
    return m[family][(sample or family, tuple(sorted(labels.items())))]


def complete(server, max_tokens=8, stream=False, prompt=PROMPT):
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    return httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=120)


def test_every_family_parses_with_its_type(server):
    complete(server, max_tokens=2)
    m = scrape(server)
    types = {fam.name: fam.type for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    assert types["mlxfast:num_requests_running"] == "gauge"
    assert types["mlxfast:num_requests_waiting"] == "gauge"
    assert types["mlxfast:kv_cache_usage_perc"] == "gauge"
    for counter in ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
                    "num_preemptions", "request_success"):
        assert types[f"mlxfast:{counter}"] == "counter", counter
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert types[f"mlxfast:{hist}"] == "histogram", hist
        buckets = sorted((float(dict(k[1])["le"]), v) for k, v in m[f"mlxfast:{hist}"].items()
                         if k[0].endswith("_bucket"))
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == float("inf")  # cumulative, ends at +Inf
        assert counts[-1] == value(m, f"mlxfast:{hist}", f"mlxfast:{hist}_count")


def test_a_request_moves_the_request_token_and_latency_families(server, tokenizer):
    before = scrape(server)
    r = complete(server, max_tokens=6)
    assert r.status_code == 200
    usage = r.json()["usage"]
    after = scrape(server)

    def delta(family, sample=None, **labels):
        try:
            old = value(before, family, sample, **labels)
        except KeyError:
            old = 0.0
        return value(after, family, sample, **labels) - old

    assert usage["completion_tokens"] == 6
    assert delta("mlxfast:prompt_tokens", "mlxfast:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("mlxfast:generation_tokens", "mlxfast:generation_tokens_total") == 6
    assert delta("mlxfast:request_success", "mlxfast:request_success_total", finished_reason="length") == 1
    assert delta("mlxfast:time_to_first_token_seconds", "mlxfast:time_to_first_token_seconds_count") == 1
    assert delta("mlxfast:inter_token_latency_seconds", "mlxfast:inter_token_latency_seconds_count") == 5
    assert delta("mlxfast:e2e_request_latency_seconds", "mlxfast:e2e_request_latency_seconds_count") == 1
    assert delta("mlxfast:e2e_request_latency_seconds", "mlxfast:e2e_request_latency_seconds_sum") > 0
    assert delta("mlxfast:request_prompt_tokens", "mlxfast:request_prompt_tokens_sum") == usage["prompt_tokens"]
    assert delta("mlxfast:request_generation_tokens", "mlxfast:request_generation_tokens_sum") == 6
    assert delta("mlxfast:prefix_cache_queries", "mlxfast:prefix_cache_queries_total") == usage["prompt_tokens"]
    assert value(after, "mlxfast:num_requests_running") == 0
    # /stats reports the same numbers: one source.
    stats = httpx.get(server.url + "/stats", headers=server.headers, timeout=30).json()["metrics"]
    after2 = scrape(server)
    assert stats["generation_tokens_total"] == value(after2, "mlxfast:generation_tokens",
                                                     "mlxfast:generation_tokens_total")


def test_a_repeated_prompt_moves_the_prefix_cache_hits(server):
    long = " ".join([PROMPT] * 8)  # several KV blocks
    complete(server, max_tokens=1, prompt=long)
    before = value(scrape(server), "mlxfast:prefix_cache_hits", "mlxfast:prefix_cache_hits_total")
    r = complete(server, max_tokens=1, prompt=long)
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    after = value(scrape(server), "mlxfast:prefix_cache_hits", "mlxfast:prefix_cache_hits_total")
    assert cached > 0 and after - before == cached


def test_kv_usage_and_running_while_a_request_streams(server):
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers,
                      timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break
        during = scrape(server)
    assert value(during, "mlxfast:num_requests_running") >= 1
    assert 0 < value(during, "mlxfast:kv_cache_usage_perc") <= 1
    for _ in range(100):  # the disconnect aborts it; the engine frees its blocks
        after = scrape(server)
        if value(after, "mlxfast:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert value(after, "mlxfast:num_requests_running") == 0
    assert value(after, "mlxfast:request_success", "mlxfast:request_success_total", finished_reason="abort") >= 1
