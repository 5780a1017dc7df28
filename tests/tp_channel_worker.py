"""One rank of tests/test_tp_channel.py, under
``mlx.launch -n 2 --backend ring -- python tests/tp_channel_worker.py OUT.json DELAY_S``.

Rank 0 opens the liveness link, waits ``DELAY_S`` before its first message
(as a server that builds its engine before SETUP), then sends a few messages
and stays idle, pinging every heartbeat, before STOP. The follower receives
until STOP and writes how many messages it got and the CPU time its process
used while rank 0 was idle.
"""

from __future__ import annotations

import json
import sys
import time

from mlxfast.engine import distributed as D

HEARTBEAT_S, IDLE_S = 0.2, 2.0


def main(out: str, delay_s: float) -> None:
    group = D.init_group(60)
    liveness = D.Liveness(group, lambda r: None)
    channel = D.StepChannel(group, heartbeat_s=HEARTBEAT_S)
    channel.liveness = liveness
    if group.rank() == 0:
        time.sleep(delay_s)
        for i in range(3):
            channel.send(D.STEP, [i])
        channel.send(D.PING, [1])  # the follower starts measuring here
        t0 = time.monotonic()
        while time.monotonic() - t0 < IDLE_S:
            time.sleep(0.01)
            channel.ping_if_due()
        channel.send(D.PING, [2])  # and stops here
        liveness.closing = True
        channel.send(D.STOP)
        return
    got, cpu, wall = [], None, None
    while True:
        kind, payload = channel.recv()
        got.append(D._KINDS[kind])
        if kind == D.PING and payload.size and payload[0] == 1:
            cpu, wall = time.process_time(), time.monotonic()
        elif kind == D.PING and payload.size and payload[0] == 2:
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        elif kind == D.STOP:
            break
    with open(out, "w") as f:
        json.dump({"messages": got, "idle_cpu_s": cpu, "idle_wall_s": wall}, f)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
