"""The tensor-parallel server, black box: real ranks on loopback.

* one server under ``mlx.launch -n 2 --backend ring -- python -m mlxfast.serve``
  (a tiny model with 8 query / 4 KV heads, n-gram speculative decoding):
  answers equal one process's (``mlxfast.generate`` in this process), 4
  concurrent streams, a prefix hit, a stop string, drafts verified, /health
  and /stats per rank, a graceful stop that ends every rank;
* ``--tensor-parallel-size 2`` (ranks started by the server itself): a rank
  killed mid-request gives the client a 5xx in the API's error shape and ends
  the server with one clear error (exit 1) within a bounded time; one killed
  while idle is noticed by the heartbeat;
* start-up refusals: ranks that do not connect, ranks with different model
  files, the default model (9 heads) over 2 ranks, the SSD tier.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port, free_port_pair, wait_healthy
from tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
TP_MODEL = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
            "intermediate_size": 512}
PROMPTS = ["w5 w6 w7 w8", "w100 w3 w44", "w9 w9 w9 w9 w9 w10 w11", "w200 w201",
           "w17 w18 w19 w20 w21 w22 w23 w24 w25 w26 w27 w28 w29 w30 w31 w32 w33 w34 w35", "w77"]


def _env() -> dict:
    return dict(os.environ, PYTHONUNBUFFERED="1", MLXFAST_NUM_THREADS="1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tp-srv") / "m", "llama", **TP_MODEL)


@pytest.fixture(scope="module")
def launched(tiny):
    """2 ranks of ``mlxfast serve`` under mlx.launch (rank 0 serves HTTP)."""
    port = free_port()
    launch = Path(sys.executable).parent / "mlx.launch"
    proc = subprocess.Popen(
        [str(launch), "-n", "2", "--backend", "ring", "--starting-port", str(free_port_pair()), "--",
         sys.executable, "-m", "mlxfast.serve", "--model", str(tiny), "--port", str(port),
         "--log-level", "warning", "--max-model-len", "512", "--max-tokens", "16",
         "--kv-cache-dtype", "float32",  # the library's dense cache holds float32 too
         "--draft-kind", "ngram", "--draft-select", "all"],  # drafts ride in the step's tokens: lossless under TP too
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=120)
        yield url, proc
    finally:
        _stop_ranks(url, proc)


def _stop_ranks(url, proc):
    """Killing mlx.launch leaves its ranks serving: stop rank 0 (it stops
    the others), and kill what is left."""
    if proc.poll() is not None:
        return
    try:
        pids = [r["pid"] for r in httpx.get(url + "/stats", timeout=5).json()["engine"]["ranks"]]
    except Exception:
        pids = []
    if pids:
        os.kill(pids[0], signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def reference(tiny):
    """One process's greedy completions of PROMPTS (the library's path = /v1/completions')."""
    import mlxfast

    model, tok = mlxfast.load(str(tiny))
    return [mlxfast.generate(model, tok, p, chat=False, max_tokens=24, temp=0) for p in PROMPTS]


def _complete(url, prompt, **kw):
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0, **kw},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url, prompt):
    text = ""
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_answers_equal_one_process_with_4_concurrent_streams(launched, reference):
    url, _ = launched
    with cf.ThreadPoolExecutor(4) as ex:
        streamed = list(ex.map(lambda p: _stream(url, p), PROMPTS))
    assert streamed == reference
    assert [_complete(url, p)["choices"][0]["text"] for p in PROMPTS[:2]] == reference[:2]


def test_prefix_hit_and_stop_string(launched, reference):
    url, _ = launched
    long = PROMPTS[4] + " w36 w37"  # 21 tokens and BOS: its first block is cached from PROMPTS[4]
    _complete(url, PROMPTS[4])
    body = _complete(url, long)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    words = reference[0].split()
    stop = " " + words[3]
    cut = _complete(url, PROMPTS[0], stop=[stop])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == reference[0][:reference[0].index(stop)]


def test_speculative_drafts_are_verified_across_ranks(launched, reference):
    """Drafts ride in a step's tokens on every rank (the server verifies
    every proposal, --draft-select all: a tiny random model copies nothing,
    so the adaptive choice would rightly verify few)."""
    url, _ = launched
    body = _complete(url, PROMPTS[2] + " w9 w9 w9 w9 w9 w10 w11 w9 w9 w9")
    assert body["usage"]["speculation"]["drafted"] > 0, body["usage"]


def test_health_and_stats_report_every_rank(launched):
    url, _ = launched
    h = httpx.get(url + "/health").json()
    assert h["status"] == "ok" and h["tensor_parallel_size"] == 2 and h["ranks_last_contact_s"] < 10
    s = httpx.get(url + "/stats").json()
    assert s["tensor_parallel_size"] == 2
    ranks = s["engine"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    assert all(r["param_bytes"] > 0 and r["kv_bytes"] > 0 for r in ranks)
    assert ranks[0]["kv_bytes"] == ranks[1]["kv_bytes"]
    assert s["engine"]["tensor_parallel"]["messages"] > 0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads a process's CPU time from /proc")
def test_an_idle_rank_sleeps(launched):
    """Between messages a follower sleeps on its link to rank 0 (rank 0
    rings it before each one) instead of busy-polling in the backend's
    collective, where an idle follower took a whole core. Over 3 idle
    seconds (three heartbeats) it may use a small share of one."""
    url, _ = launched
    pids = [r["pid"] for r in httpx.get(url + "/stats").json()["engine"]["ranks"]]
    before = _cpu_seconds(pids[1])
    time.sleep(3.0)
    used = _cpu_seconds(pids[1]) - before
    assert used < 0.3, f"an idle follower used {used:.2f} s of CPU in 3 s"
    assert _complete(url, PROMPTS[0])["choices"][0]["text"]  # and wakes for the next request


def test_graceful_stop_ends_every_rank(launched):
    url, proc = launched
    pids = [r["pid"] for r in httpx.get(url + "/stats").json()["engine"]["ranks"]]
    os.kill(pids[0], signal.SIGTERM)  # rank 0 stops, then tells rank 1 to
    proc.wait(30)  # mlx.launch returns once both ranks have exited
    out, err = proc.communicate()
    assert "mlxfast: stopped" in out, err
    assert "Node with rank" not in err, err  # mlx.launch warns about ranks that fail


# ------------------------------------------------------------------ --tp N


def _start_tp(model, *extra, tp=2):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxfast.serve", "--tp", str(tp), *(["--model", str(model)] if model else []),
         "--port", str(port), "--log-level", "warning", *extra],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return f"http://127.0.0.1:{port}", proc


def _rank_pids(url):
    return [r["pid"] for r in httpx.get(url + "/stats").json()["engine"]["ranks"]]


def test_a_rank_killed_mid_request_ends_the_server_with_a_5xx(tiny):
    url, proc = _start_tp(tiny, "--max-model-len", "16384")  # a request that outlasts the kill
    try:
        wait_healthy(url, proc, timeout=120)
        pids = _rank_pids(url)
        with cf.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(httpx.post, url + "/v1/completions", timeout=60, json={
                "prompt": "w5 w6", "max_tokens": 16000, "temperature": 0, "ignore_eos": True})
            time.sleep(1.0)
            assert not fut.done()
            os.kill(pids[1], signal.SIGKILL)
            t0 = time.monotonic()
            r = fut.result(timeout=30)
        assert 500 <= r.status_code < 600, r.text
        err = r.json()["error"]
        # the backend's failed collective, or (when that spins on the dead peer's
        # socket) the rank's liveness link: both name the tensor-parallel cause
        assert err["type"] == "server_error" and ("tensor-parallel step failed" in err["message"]
                                                  or "tensor-parallel rank 1 is gone" in err["message"]), err
        code = proc.wait(30)
        assert time.monotonic() - t0 < 30
        out, stderr = proc.communicate()
        assert code == 1
        assert stderr.count("mlxfast: error: tensor-parallel serving stopped") == 1, stderr
    finally:
        if proc.poll() is None:
            proc.kill()


def test_no_rank_outlives_a_killed_supervisor(tiny):
    """SIGKILL to --tp's supervisor (a test harness or an OOM killer): its ranks end too."""
    url, proc = _start_tp(tiny)
    pids = []
    try:
        wait_healthy(url, proc, timeout=120)
        pids = _rank_pids(url)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 30
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in pids if _running(p)]
            time.sleep(0.2)
        assert alive == [], f"ranks {alive} outlived their supervisor"
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in pids:  # what the assertion found left over: not left to burn the CPU
            if _running(p):
                os.kill(p, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_rank_killed_while_idle_is_noticed_by_the_heartbeat(tiny):
    url, proc = _start_tp(tiny)
    try:
        wait_healthy(url, proc, timeout=120)
        os.kill(_rank_pids(url)[1], signal.SIGKILL)
        t0 = time.monotonic()
        code = proc.wait(30)
        assert time.monotonic() - t0 < 15  # the liveness link (or the next heartbeat) notices
        assert code == 1
        err = proc.communicate()[1]
        assert "mlxfast: error: tensor-parallel serving stopped" in err, err
        assert "tensor-parallel rank 1 is gone" in err or "connection to a peer was lost" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ranks_that_do_not_connect_end_the_start_up(tiny, tmp_path):
    hostfile = tmp_path / "hosts.json"
    base = free_port_pair()
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))  # rank 1 never starts
    port = free_port()
    env = dict(_env(), MLX_RANK="0", MLX_HOSTFILE=str(hostfile))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mlxfast.serve", "--model", str(tiny), "--port", str(port),
                           "--tp-timeout", "3", "--log-level", "warning"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0  # killed by its connect watchdog (init holds the GIL)
    assert time.monotonic() - t0 < 30
    assert "the other tensor-parallel ranks did not connect within 3 s" in proc.stderr, proc.stderr


def test_ranks_with_different_model_files_are_refused(tiny, tmp_path):
    other = make_tiny_model(tmp_path / "other", "llama", seed=1, **TP_MODEL)  # same shapes, other weights
    hostfile = tmp_path / "hosts.json"
    base = free_port_pair()
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "mlxfast.serve", "--model", str(m), "--port", str(port),
                               "--log-level", "warning", "--tp-timeout", "60"],
                              cwd=ROOT, env=dict(_env(), MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, m in enumerate((tiny, other))]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [1, 1]
    for _, err in outs:
        assert "the ranks loaded different models: rank(s) 1 differ from rank 0" in err, err


def test_default_model_over_2_ranks_is_a_clear_start_up_error():
    url, proc = _start_tp(None)  # the default SmolLM2-135M: 9 query heads, 3 KV heads
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "9 attention heads and 3 KV heads do not divide by 2" in err and "Sizes that divide: 3" in err, err




def test_ssd_tier_stores_every_ranks_heads_and_restores_them(tiny, tmp_path):
    """Rank 0's tier writes one file per block holding both ranks' heads
    (gathered from rank 1) and, after a restart, gives each rank its part."""
    prompt = " ".join(f"w{i}" for i in range(40, 80))  # 40 words + BOS: 2 full blocks of 16
    texts, cached, ssd = [], [], []
    for run in range(2):
        url, proc = _start_tp(tiny, "--ssd-cache", str(tmp_path / "ssd"), "--max-tokens", "12")
        try:
            wait_healthy(url, proc, timeout=120)
            body = _complete(url, prompt)
            texts.append(body["choices"][0]["text"])
            cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
            if run == 0:
                r = httpx.post(url + "/admin/cache/flush", timeout=60)
                assert r.status_code == 200 and r.json()["durable"], r.text
            ssd.append(httpx.get(url + "/stats").json()["engine"]["ssd"])
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, proc.communicate()[1]
        finally:
            if proc.poll() is None:
                proc.kill()
    files = list((tmp_path / "ssd").glob("ns-*/*.kv"))
    assert len(files) >= 2
    # both ranks' K and V of 2 layers x 2 KV heads x 32 (float16), 16 tokens, + the 4 KiB header
    assert {f.stat().st_size for f in files} == {4096 + 2 * 2 * 2 * 16 * 2 * 32 * 2}
    assert cached == [0, 32], (cached, ssd)
    assert texts[1] == texts[0]
    assert ssd[1]["restored_blocks"] >= 2, ssd[1]
