"""Tensor parallelism against one process: 2 ranks on loopback (ring backend,
started by ``mlx.launch``), tiny random-weight models with 8 query and 4 KV
heads (llama float32, tied head; mistral MLX 4-bit, untied head; Gemma 3
float32 with sliding-window layers, so two KV groups), each rank running
tests/tp_worker.py (see there for what it measures).

Tolerance: the all-reduce sums the ranks' partial products in another order
than one matmul's accumulation, so logits differ in the last bits: every
teacher-forced logit (float32 dense cache) is within 1e-4 * (|logit| + 1)
of one process's (measured: 1.6e-5 float32, 1.2e-5 4-bit). The engine's KV
is float16 or 8-bit, whose rounding turns a last-bit change of k or v into a
code step now and then: through the paged path with the engine's scheme,
TP moves a logit by up to 4e-4..4e-3 with float16 KV and 1e-2 with 8-bit KV
(measured; bounded here at 0.01 and 0.05). Greedy 48-token continuations
must be identical on at least 5 of 6 prompts (4 with 8-bit KV), and a difference may only
start at a near-tie: where the one-process top-2 margin, with the same KV
scheme, is below twice what TP moved the teacher-forced prompt's logits by
with that scheme, or below the scheme's floor: 1e-3 for float16 KV, 1e-2
for 8-bit KV (what its code steps move a logit by; the teacher-forced prompt
may meet none: measured once, Gemma 3, 8-bit KV, a margin of 0.003 against
0.013; and the 4-bit model on AVX2, 8-bit KV, a margin of 0.0035 where the
teacher-forced prompt moved 8.6e-6).

The default model (9 query heads, 3 KV heads) does not divide by 2 (its
refusal: tests/test_tp_shard.py and tests/test_tp_server.py); over 3 ranks
it does, and its real Q4_1 weights give teacher-forced logits within
2e-4 * (|logit| + 1) of one process's (measured 7.3e-5: logits reach 33,
so the reordered float32 sums of 30 layers move them by up to 1.5e-4).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port_pair
from tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
TP_MODEL = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
            "intermediate_size": 512}
MODELS = {"f32": dict(model_type="llama"),
          "q4": dict(model_type="mistral", quantize={"group_size": 64, "bits": 4}),
          # sliding-window and full layers: two KV groups, two block tables per sequence
          "gemma3": dict(model_type="gemma3_text")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("tp-parity")
    paths = {}
    for name, kw in MODELS.items():
        kw = dict(kw)
        paths[name] = str(make_tiny_model(base / name, kw.pop("model_type"), **kw, **TP_MODEL))
    out = base / "out.json"
    launch = Path(sys.executable).parent / "mlx.launch"
    env = dict(os.environ, MLXFAST_NUM_THREADS="1", PYTHONPATH=str(ROOT / "tests"))
    proc = subprocess.run([str(launch), "-n", "2", "--backend", "ring", "--starting-port", str(free_port_pair()),
                           "--", sys.executable, str(ROOT / "tests" / "tp_worker.py"), str(out),
                           *paths.values()], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.is_file(), f"the ranks failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    data = json.loads(out.read_text())
    return {name: data[p] for name, p in paths.items()}


@pytest.mark.parametrize("name", MODELS)
def test_teacher_forced_logits_match_one_process(results, name):
    lg = results[name]["logits"]
    assert lg["positions"] == 48
    assert lg["max_rel_diff"] <= 1e-4, lg
    assert lg["max_abs_diff"] > 0 or lg["max_abs_logit"] > 0  # logits were compared, not empty
    assert lg["argmax_equal"] >= 47, lg


@pytest.mark.parametrize("kv", ["off", "8"])
@pytest.mark.parametrize("name", MODELS)
def test_greedy_continuations_match_one_process(results, name, kv):
    r = results[name]
    ref, tp = r["ref"][kv], r["tp"][kv]
    assert tp["error"] is None and tp["tensor_parallel_size"] == 2 and ref["tensor_parallel_size"] == 1
    assert tp["kv_scheme"] == ref["kv_scheme"] == ("q8g32" if kv == "8" else "f16")
    assert tp["finish"] == ["length"] * 6 and all(len(t) == 48 for t in tp["tokens"])
    same = sum(a == b for a, b in zip(ref["tokens"], tp["tokens"]))
    # 8-bit KV turns TP's last-bit changes into code steps that flip near-ties
    # more often (measured on one machine: Gemma 3, two prompts at margins
    # 0.006 and 0.008); the loop below holds every difference to a near-tie.
    assert same >= (5 if kv == "off" else 4), r["differences"]
    moved = r["scheme_logit_diff"][kv]  # the most TP moves a teacher-forced logit with this KV scheme
    assert moved <= (0.01 if kv == "off" else 0.05), moved
    # A near-tie: below twice what TP moved the teacher-forced prompt, or
    # below what the scheme is measured to move a logit anywhere (float16:
    # 1e-3; 8-bit KV: 1e-2, its code steps, which one teacher-forced prompt
    # need not meet: q4 on AVX2 once flipped at a margin of 0.0035 where that
    # prompt moved 8.6e-6).
    floor = 1e-3 if kv == "off" else 1e-2
    for prompt, at, margin in r["differences"].get(kv, []):
        assert margin < max(floor, 2 * moved), \
            f"prompt {prompt} differs at token {at} where the top-2 margin is {margin} (TP moves logits {moved})"


@pytest.mark.parametrize("name", MODELS)
def test_prefix_hit_under_tensor_parallelism(results, name):
    for kv in ("off", "8"):
        ref, tp = results[name]["ref"][kv], results[name]["tp"][kv]
        assert tp["hit_cached"] == ref["hit_cached"] == 48  # 3 full blocks of the 61-token prompt
        assert tp["hit_tokens"] == ref["hit_tokens"]


@pytest.mark.parametrize("name", MODELS)
def test_each_rank_holds_its_share(results, name):
    r = results[name]
    for kv in ("off", "8"):
        (one,), ranks = r["ref"][kv]["ranks"], r["tp"][kv]["ranks"]
        assert [x["rank"] for x in ranks] == [0, 1] and ranks[0]["pid"] != ranks[1]["pid"]
        # the same blocks, half the KV heads each: N ranks hold N x the context per byte
        assert all(x["kv_bytes"] * 2 == one["kv_bytes"] for x in ranks)
    full = r["full_param_bytes"]
    assert one["param_bytes"] == full
    for x in ranks:  # a half of the sharded layers plus the replicated embedding (and head on rank 0)
        assert full * 0.3 < x["param_bytes"] < full * 0.75, (x, full)


def test_default_model_over_3_ranks_matches_one_process(tmp_path):
    out = tmp_path / "out.json"
    launch = Path(sys.executable).parent / "mlx.launch"
    env = dict(os.environ, MLXFAST_NUM_THREADS="1", PYTHONPATH=str(ROOT / "tests"))
    proc = subprocess.run([str(launch), "-n", "3", "--backend", "ring", "--starting-port", str(_port3()), "--",
                           sys.executable, str(ROOT / "tests" / "tp_worker.py"), str(out), "--logits-only",
                           "default"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.is_file(), f"the ranks failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    r = json.loads(out.read_text())["default"]
    lg = r["logits"]
    assert r["size"] == 3 and lg["positions"] == 48
    assert lg["max_rel_diff"] <= 2e-4, lg
    assert lg["argmax_equal"] >= 47, lg
    # a third of the layers plus the replicated (quantized, tied) embedding-head
    assert r["full_param_bytes"] * 0.4 < r["param_bytes"] < r["full_param_bytes"] * 0.6, r


def _port3() -> int:
    import socket

    for _ in range(50):
        socks = [socket.socket() for _ in range(3)]
        try:
            socks[0].bind(("127.0.0.1", 0))
            port = socks[0].getsockname()[1]
            socks[1].bind(("127.0.0.1", port + 1))
            socks[2].bind(("127.0.0.1", port + 2))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no three free consecutive ports")
