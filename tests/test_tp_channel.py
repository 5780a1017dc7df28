"""The tensor-parallel step channel between real ranks (2 on loopback, ring
backend, tests/tp_channel_worker.py): a follower sleeps on its liveness link
between messages, also when rank 0 was slow to send its first one (the
follower then went into the collective without its bell; counted bells were
one ahead from then on, and every idle collective busy-polled a core)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port_pair

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, delay_s: float) -> dict:
    out = tmp_path / f"out-{delay_s}.json"
    launch = Path(sys.executable).parent / "mlx.launch"
    env = dict(os.environ, MLXFAST_NUM_THREADS="1")
    proc = subprocess.run([str(launch), "-n", "2", "--backend", "ring", "--starting-port", str(free_port_pair()),
                           "--", sys.executable, str(ROOT / "tests" / "tp_channel_worker.py"), str(out),
                           str(delay_s)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.is_file(), f"the ranks failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("delay_s", [0.0, 1.0], ids=["prompt-start", "slow-first-message"])
def test_an_idle_follower_sleeps_between_messages(tmp_path, delay_s):
    got = _run(tmp_path, delay_s)  # 1.0 s: five heartbeats of silence before the first message
    msgs = got["messages"]
    assert msgs[:4] == ["step", "step", "step", "ping"] and msgs[-2:] == ["ping", "stop"], msgs
    assert len(msgs) >= 8, msgs  # rank 0 pinged while idle
    assert got["idle_wall_s"] >= 1.9
    share = got["idle_cpu_s"] / got["idle_wall_s"]
    assert share < 0.15, f"an idle follower used {share:.0%} of a core"
