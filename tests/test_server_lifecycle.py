"""Black-box process lifecycle: /health while loading, a taken port, and a
graceful SIGTERM / SIGINT that lets an in-flight stream finish and exits 0."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from conftest import free_port, start_server, wait_healthy


def test_loading_health_port_taken_and_graceful_stop():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port, "--max-tokens", "8")
    try:
        # The port answers before the model is ready: 503 while loading.
        codes = set()
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                r = httpx.get(url + "/health", timeout=2)
                codes.add(r.status_code)
                if r.status_code == 200:
                    assert r.json() == {"status": "ok"}
                    break
                assert r.json()["status"] == "loading"
                r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
                if r.status_code != 200:  # (the model may have become ready meanwhile)
                    assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
                    codes.add("post-503")
            except httpx.ConnectError:
                pass
            time.sleep(0.05)
        assert codes >= {503, 200}
        assert "post-503" in codes

        # A second server on the same port: one line on stderr, exit 1, no traceback.
        second = start_server(port)
        out, err = second.communicate(timeout=60)
        assert second.returncode == 1
        lines = [line for line in err.strip().splitlines() if line.strip()]
        assert len(lines) == 1 and "already in use" in lines[0] and "Traceback" not in err

        # SIGTERM during a stream: the stream completes, then the process exits 0.
        result = {}

        def stream():
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                              json={"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 24,
                                    "temperature": 0, "stream": True, "ignore_eos": True}) as r:
                result["body"] = b"".join(r.iter_bytes())

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.8)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert proc.wait(60) == 0
        assert result["body"].endswith(b"data: [DONE]\n\n")
        assert b'"finish_reason":"length"' in result["body"]
        # the port is free again
        try:
            httpx.get(url + "/health", timeout=1)
            raise AssertionError("server still answering")
        except httpx.ConnectError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigint_exits_zero():
    port = free_port()
    proc = start_server(port)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        _, err = proc.communicate()
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
